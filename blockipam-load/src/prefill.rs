//! Prefill: allocations put in the store the plugin's way (one pod's address per handle, with the plugin's attributes) before the measured run, held by one node (to measure per-call latency as the store grows), and their check after the run: every one still present, held by its own handle.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Instant;

use ipam_core::{AllocationInfo, AutoAssignRequest, Ipam};
use serde::Serialize;

use crate::config::LoadConfig;
use crate::error::LoadError;
use crate::pods::{self, container_id, PodKind};

/// How many problem descriptions the summary keeps.
const SAMPLES: usize = 10;

/// The prefilled allocations: handle → addresses.
#[derive(Debug, Clone, Default)]
pub struct Prefilled {
    /// The node holding them.
    pub host: String,
    /// Each handle's addresses.
    pub handles: BTreeMap<String, Vec<IpAddr>>,
    /// Seconds the prefill took.
    pub seconds: f64,
}

/// The prefill, and what the end of the run found of it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PrefillSummary {
    /// The node holding the prefilled allocations.
    pub node: String,
    /// Addresses prefilled.
    pub addresses: u64,
    /// Handles they were prefilled under (`<network>-prefill.<container id>`, one address each).
    pub handles: u64,
    /// Seconds the prefill took (not part of the measured run).
    pub seconds: f64,
    /// Prefilled addresses the store still records under their own handle at the end.
    pub present: u64,
    /// Prefilled addresses the store no longer records.
    pub missing: u64,
    /// Prefilled addresses the store records under another handle (a duplicate).
    pub held_by_another: u64,
    /// Descriptions of the first problems.
    pub samples: Vec<String>,
}

impl PrefillSummary {
    /// Every prefilled address is present, held by its own handle.
    pub fn is_clean(&self) -> bool {
        self.present == self.addresses && self.missing == 0 && self.held_by_another == 0
    }
}

/// The handle prefix of prefilled allocations: not the run's `<network>.`, so that the run's
/// leak count leaves them out.
pub fn handle_prefix(config: &LoadConfig) -> String {
    format!("{}-prefill.", config.network)
}

/// Puts `config.prefill` allocations held by the prefill node in the store the plugin's way: one
/// address per pod, under the pod's own handle, with the attributes the plugin records (a 64-hex
/// container id, the pod and its namespace, the interface, the time), one call after another.
///
/// # Errors
/// [`LoadError::Failed`] when an assignment fails (with a hint when the host hit its block limit).
pub async fn prefill(ipam: &Ipam, config: &LoadConfig) -> Result<Prefilled, LoadError> {
    let started = Instant::now();
    let host = config.prefill_host();
    let mut done = Prefilled {
        host: host.clone(),
        ..Prefilled::default()
    };
    for index in 0..config.prefill {
        let container = container_id(PodKind::Prefill, 0, index);
        let handle = format!("{}{container}", handle_prefix(config));
        let request = AutoAssignRequest {
            handle: handle.clone(),
            host: host.clone(),
            num_v4: 1,
            attributes: pods::attributes(&config.network, &container),
            skip_block_edges: true,
            ..AutoAssignRequest::default()
        };
        let assigned = ipam.auto_assign(&request).await.map_err(|e| {
            LoadError::failed(format!(
                "prefill: assigning an address to {handle} on {host} failed after {index} \
                 addresses: {e} (a large prefill needs --max-blocks-per-host 0 and a pool big \
                 enough)"
            ))
        })?;
        if assigned.v4.len() != 1 {
            return Err(LoadError::failed(format!(
                "prefill: {handle} asked for 1 address and got {}",
                assigned.v4.len()
            )));
        }
        done.handles
            .insert(handle, assigned.v4.into_iter().map(|a| a.ip).collect());
    }
    done.seconds = started.elapsed().as_secs_f64();
    Ok(done)
}

/// Compares the prefilled allocations with what the store holds at the end.
pub fn verify(prefilled: &Prefilled, allocations: &[AllocationInfo]) -> PrefillSummary {
    let owners: BTreeMap<IpAddr, &str> = allocations
        .iter()
        .map(|a| (a.ip, a.handle.as_str()))
        .collect();
    let mut summary = PrefillSummary {
        node: prefilled.host.clone(),
        handles: prefilled.handles.len() as u64,
        seconds: prefilled.seconds,
        ..PrefillSummary::default()
    };
    for (handle, ips) in &prefilled.handles {
        for ip in ips {
            summary.addresses += 1;
            let problem = match owners.get(ip) {
                Some(owner) if owner == handle => {
                    summary.present += 1;
                    None
                }
                Some(owner) => {
                    summary.held_by_another += 1;
                    Some(format!("prefilled {ip} of {handle} is held by {owner}"))
                }
                None => {
                    summary.missing += 1;
                    Some(format!("prefilled {ip} of {handle} is gone from the store"))
                }
            };
            if let Some(problem) = problem {
                if summary.samples.len() < SAMPLES {
                    summary.samples.push(problem);
                }
            }
        }
    }
    summary
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allocation(ip: [u8; 4], handle: &str) -> AllocationInfo {
        AllocationInfo {
            ip: IpAddr::from(ip),
            block: "10.0.0.0/26".parse().expect("block"),
            block_host: Some("n".into()),
            handle: handle.into(),
            attributes: BTreeMap::new(),
            sequence: 0,
        }
    }

    #[test]
    fn prefilled_addresses_must_stay_with_their_handle() {
        let prefilled = Prefilled {
            host: "n".into(),
            handles: BTreeMap::from([(
                "load-prefill.000000".to_owned(),
                vec![
                    IpAddr::from([10, 0, 0, 1]),
                    IpAddr::from([10, 0, 0, 2]),
                    IpAddr::from([10, 0, 0, 3]),
                ],
            )]),
            seconds: 0.0,
        };
        let clean = verify(
            &prefilled,
            &[
                allocation([10, 0, 0, 1], "load-prefill.000000"),
                allocation([10, 0, 0, 2], "load-prefill.000000"),
                allocation([10, 0, 0, 3], "load-prefill.000000"),
            ],
        );
        assert!(clean.is_clean(), "{clean:?}");
        let broken = verify(
            &prefilled,
            &[
                allocation([10, 0, 0, 1], "load-prefill.000000"),
                allocation([10, 0, 0, 2], "load.pod"),
            ],
        );
        assert!(!broken.is_clean());
        assert_eq!(
            (broken.present, broken.held_by_another, broken.missing),
            (1, 1, 1)
        );
    }
}
