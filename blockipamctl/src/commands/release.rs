//! `release --ip IP... | --handle ID`: free addresses by hand (what a CNI DEL or a garbage collector
//! would have done).

use std::net::IpAddr;

use blockipam_store::DatastoreSettings;
use ipam_core::model::validate_handle;
use ipam_core::ReleaseRequest;
use serde::Serialize;

use super::pool::invalid_text;
use super::{open_ipam, to_json};
use crate::cli::ReleaseArgs;
use crate::error::CtlError;
use crate::output::Outcome;
use crate::settings::OpenMode;

#[derive(Debug, Serialize)]
struct ReleaseJson {
    #[serde(skip_serializing_if = "Option::is_none")]
    handle: Option<String>,
    released: Vec<IpAddr>,
    not_allocated: Vec<IpAddr>,
}

fn list(ips: &[IpAddr]) -> String {
    ips.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `release`. Addresses that were not allocated are reported, not errors (exit status 0).
///
/// # Errors
/// [`CtlError::Usage`] for an invalid handle id; store trouble.
pub async fn run(settings: &DatastoreSettings, args: &ReleaseArgs) -> Result<Outcome, CtlError> {
    if let Some(handle) = &args.handle {
        validate_handle(handle).map_err(|e| CtlError::usage(invalid_text(&e)))?;
        let ipam = open_ipam(settings, OpenMode::Existing).await?;
        let released = ipam.release_handle(handle).await?;
        let table = if released.is_empty() {
            format!("Handle {handle:?} held no addresses; nothing was released.\n")
        } else {
            format!(
                "Released {} address{} of handle {handle:?}: {}\n",
                released.len(),
                if released.len() == 1 { "" } else { "es" },
                list(&released)
            )
        };
        let json = ReleaseJson {
            handle: Some(handle.clone()),
            released,
            not_allocated: Vec::new(),
        };
        return Ok(Outcome::ok(to_json(&json)?, table));
    }
    let mut ips: Vec<IpAddr> = Vec::new();
    for ip in &args.ip {
        if !ips.contains(ip) {
            ips.push(*ip);
        }
    }
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let requests: Vec<ReleaseRequest> = ips
        .iter()
        .map(|ip| ReleaseRequest {
            ip: *ip,
            sequence: None,
        })
        .collect();
    let outcome = ipam.release_ips(&requests).await?;
    let mut table = String::new();
    if !outcome.released.is_empty() {
        table.push_str(&format!(
            "Released {} address{}: {}\n",
            outcome.released.len(),
            if outcome.released.len() == 1 {
                ""
            } else {
                "es"
            },
            list(&outcome.released)
        ));
    }
    if !outcome.not_allocated.is_empty() {
        table.push_str(&format!(
            "Not allocated (nothing to do): {}\n",
            list(&outcome.not_allocated)
        ));
    }
    let json = ReleaseJson {
        handle: None,
        released: outcome.released,
        not_allocated: outcome.not_allocated,
    };
    Ok(Outcome::ok(to_json(&json)?, table))
}
