//! `release --ip IP... [--sequence N] | --handle ID | --from-report FILE [--apply]`: free addresses
//! by hand (what a CNI DEL or a garbage collector would have done), guarded by sequence numbers
//! when asked.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::Path;

use blockipam_store::DatastoreSettings;
use ipam_core::model::{keys, validate_handle};
use ipam_core::{AllocationInfo, Condition, Ipam, IpamError, Read, ReleaseRequest};
use serde::Serialize;

use super::pool::invalid_text;
use super::report::{self, not_releasable_reason, RELEASABLE_KINDS};
use super::{open_ipam, to_json};
use crate::cli::ReleaseArgs;
use crate::error::CtlError;
use crate::output::{Outcome, Table};
use crate::settings::OpenMode;

#[derive(Debug, Serialize)]
struct ReleaseJson {
    #[serde(skip_serializing_if = "Option::is_none")]
    handle: Option<String>,
    released: Vec<IpAddr>,
    not_allocated: Vec<IpAddr>,
}

/// `release --ip A --sequence N` as JSON.
#[derive(Debug, Serialize)]
struct GuardedReleaseJson {
    ip: IpAddr,
    sequence: u64,
    released: bool,
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
    // Checked here as well as declared to clap, whose required group of `--ip`, `--handle` and
    // `--from-report` lets these through: a guard or an --apply dropped in silence would release
    // what the operator meant to keep, or nothing when they meant to release.
    if args.sequence.is_some() && args.ip.is_empty() {
        return Err(CtlError::usage(
            "--sequence guards one --ip; it cannot be used with --handle or --from-report (the \
             report's own sequence numbers guard each of its addresses)",
        ));
    }
    if args.apply && args.from_report.is_none() {
        return Err(CtlError::usage(
            "--apply goes with --from-report only: --ip and --handle release at once",
        ));
    }
    if let Some(path) = &args.from_report {
        return from_report(settings, path, args.apply).await;
    }
    if let Some(sequence) = args.sequence {
        return guarded(settings, &args.ip, sequence).await;
    }
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

/// `release --ip A --sequence N`: releases A only while the allocation made at sequence N holds
/// it; otherwise refuses, saying what holds the address now, and changes nothing.
async fn guarded(
    settings: &DatastoreSettings,
    ips: &[IpAddr],
    sequence: u64,
) -> Result<Outcome, CtlError> {
    // A repeated address counts once, as in an unguarded release.
    let distinct: std::collections::BTreeSet<IpAddr> = ips.iter().copied().collect();
    let ip = match distinct.into_iter().collect::<Vec<_>>()[..] {
        [ip] => ip,
        _ => {
            return Err(CtlError::usage(
                "--sequence guards one address: give exactly one --ip",
            ))
        }
    };
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let outcome = ipam
        .release_ips(&[ReleaseRequest {
            ip,
            sequence: Some(sequence),
        }])
        .await?;
    if outcome.released.contains(&ip) {
        let json = GuardedReleaseJson {
            ip,
            sequence,
            released: true,
        };
        return Ok(Outcome::ok(
            to_json(&json)?,
            format!("Released {ip} (sequence {sequence}).\n"),
        ));
    }
    if outcome.sequence_mismatch.contains(&ip) {
        let holder = match ipam.get_assignment(ip).await? {
            Some(info) => format!(
                "it carries sequence {} now, not {sequence} (handle {:?})",
                info.sequence, info.handle
            ),
            None => format!("it no longer carries sequence {sequence}"),
        };
        return Err(CtlError::failed(format!(
            "{ip} was not released: {holder}: it was allocated again since; nothing changed"
        )));
    }
    Err(CtlError::failed(format!(
        "{ip} was not released: it is not allocated, so no allocation carries sequence \
         {sequence}; nothing changed"
    )))
}

/// One address a report lists as leaked.
#[derive(Debug, Clone, Serialize)]
struct ReportedAddress {
    ip: IpAddr,
    handle: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    node: Option<String>,
    block: String,
    sequence: u64,
    kind: String,
}

/// A reported address left alone, and why.
#[derive(Debug, Serialize)]
struct SkippedAddress {
    #[serde(flatten)]
    address: ReportedAddress,
    reason: String,
}

/// Problems of the report that are not released, by kind.
#[derive(Debug, Serialize)]
struct KindNotReleased {
    kind: String,
    problems: usize,
    reason: &'static str,
}

#[derive(Debug, Serialize)]
struct FromReportJson {
    applied: bool,
    /// With `--apply`: what was released; without: what would be.
    released: Vec<ReportedAddress>,
    skipped: Vec<SkippedAddress>,
    kinds_not_released: Vec<KindNotReleased>,
}

/// Why `address` may not be released now (`None`: it may), given what is allocated now and which
/// of the reported handles exist: it is no longer allocated, it was allocated again since the
/// report (another sequence number), or its handle exists again (the pod's DEL can release it).
fn why_not(
    address: &ReportedAddress,
    allocated: &BTreeMap<IpAddr, AllocationInfo>,
    existing_handles: &BTreeSet<String>,
) -> Option<String> {
    let Some(now) = allocated.get(&address.ip) else {
        return Some("no longer allocated".to_owned());
    };
    if now.sequence != address.sequence {
        return Some(format!(
            "allocated again since the report (sequence {} now, {} in the report)",
            now.sequence, address.sequence
        ));
    }
    if existing_handles.contains(&address.handle) {
        return Some(format!(
            "its handle {:?} exists again (check --repair recreated it, or its pod wrote it): its \
             DEL releases it",
            address.handle
        ));
    }
    None
}

/// Releases `chosen`, each address only while it carries the sequence number the report
/// recorded, and each handle's addresses only while that handle is still absent (one guarded
/// release per handle): a handle that reappears after it was read (`check --repair` recreating it,
/// its pod writing it) stops its release at the next write, and its addresses are left to its DEL.
/// Returns what was released and what was left, with why.
///
/// # Errors
/// Store trouble.
async fn release_while_handles_absent(
    ipam: &Ipam,
    chosen: Vec<ReportedAddress>,
) -> Result<(Vec<ReportedAddress>, Vec<SkippedAddress>), CtlError> {
    let mut by_handle: BTreeMap<String, Vec<ReportedAddress>> = BTreeMap::new();
    for address in chosen {
        by_handle
            .entry(address.handle.clone())
            .or_default()
            .push(address);
    }
    let (mut released, mut skipped) = (Vec::new(), Vec::new());
    for (handle, addresses) in by_handle {
        let requests: Vec<ReleaseRequest> = addresses
            .iter()
            .map(|a| ReleaseRequest {
                ip: a.ip,
                sequence: Some(a.sequence),
            })
            .collect();
        let guarded = ipam
            .clone()
            .guarded_by(vec![Condition::absent(keys::handle(&handle))]);
        match guarded.release_ips(&requests).await {
            Ok(outcome) => {
                let freed: BTreeSet<IpAddr> = outcome.released.into_iter().collect();
                for address in addresses {
                    if freed.contains(&address.ip) {
                        released.push(address);
                    } else if outcome.sequence_mismatch.contains(&address.ip) {
                        skipped.push(SkippedAddress {
                            address,
                            reason: "allocated again while releasing (another sequence number)"
                                .into(),
                        });
                    } else {
                        skipped.push(SkippedAddress {
                            address,
                            reason: "released by someone else while releasing".into(),
                        });
                    }
                }
            }
            Err(IpamError::GuardLost { .. }) => {
                for address in addresses {
                    let reason = match ipam.get_assignment(address.ip).await? {
                        Some(now) if now.sequence == address.sequence => format!(
                            "its handle {handle:?} was written while releasing (check --repair \
                             recreated it, or its pod wrote it): its DEL releases it"
                        ),
                        Some(_) => {
                            "allocated again while releasing (another sequence number)".into()
                        }
                        None => format!(
                            "no longer allocated: released before its handle {handle:?} was \
                             written again while releasing, or by its DEL since"
                        ),
                    };
                    skipped.push(SkippedAddress { address, reason });
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    released.sort_by_key(|a| a.ip);
    Ok((released, skipped))
}

/// The reported handles that exist now, in one batched read.
async fn existing_handles(
    ipam: &Ipam,
    addresses: &BTreeMap<IpAddr, ReportedAddress>,
) -> Result<BTreeSet<String>, CtlError> {
    let handles: BTreeSet<&str> = addresses.values().map(|a| a.handle.as_str()).collect();
    let reads: Vec<Read> = handles.iter().map(|h| Read::Get(keys::handle(h))).collect();
    let mut existing = BTreeSet::new();
    if reads.is_empty() {
        return Ok(existing);
    }
    for (handle, result) in handles.iter().zip(ipam.store().read_many(&reads).await?) {
        if result.into_got()?.is_some() {
            existing.insert((*handle).to_owned());
        }
    }
    Ok(existing)
}

/// `release --from-report FILE [--apply]`: the addresses of the report's problems of
/// [`RELEASABLE_KINDS`], each released only while it carries the sequence number the report
/// recorded; without `--apply`, what would be released and what not, nothing written.
async fn from_report(
    settings: &DatastoreSettings,
    path: &Path,
    apply: bool,
) -> Result<Outcome, CtlError> {
    let report = report::read(path, settings)?;
    let mut candidates: BTreeMap<IpAddr, ReportedAddress> = BTreeMap::new();
    let mut not_released: BTreeMap<String, usize> = BTreeMap::new();
    for problem in report.standing() {
        if !RELEASABLE_KINDS.contains(&problem.kind.as_str()) {
            *not_released.entry(problem.kind.clone()).or_default() += 1;
            continue;
        }
        for address in &problem.addresses {
            candidates.entry(address.ip).or_insert(ReportedAddress {
                ip: address.ip,
                handle: address.handle.clone(),
                node: address.node.clone(),
                block: address.block.to_string(),
                sequence: address.sequence,
                kind: problem.kind.clone(),
            });
        }
    }
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let allocated: BTreeMap<IpAddr, AllocationInfo> = if candidates.is_empty() {
        BTreeMap::new()
    } else {
        ipam.list_allocations()
            .await?
            .into_iter()
            .map(|a| (a.ip, a))
            .collect()
    };
    let existing = existing_handles(&ipam, &candidates).await?;
    let mut chosen: Vec<ReportedAddress> = Vec::new();
    let mut skipped: Vec<SkippedAddress> = Vec::new();
    for address in candidates.into_values() {
        match why_not(&address, &allocated, &existing) {
            Some(reason) => skipped.push(SkippedAddress { address, reason }),
            None => chosen.push(address),
        }
    }
    let released = if apply && !chosen.is_empty() {
        let (released, not_released) = release_while_handles_absent(&ipam, chosen).await?;
        skipped.extend(not_released);
        released
    } else {
        chosen
    };
    skipped.sort_by_key(|s| s.address.ip);
    let kinds_not_released: Vec<KindNotReleased> = not_released
        .into_iter()
        .map(|(kind, problems)| KindNotReleased {
            reason: not_releasable_reason(&kind),
            kind,
            problems,
        })
        .collect();
    let mut table = String::new();
    let verb = if apply { "Released" } else { "Would release" };
    if released.is_empty() {
        table.push_str(if apply {
            "Released nothing.\n"
        } else {
            "Would release nothing.\n"
        });
    } else {
        let mut rows = Table::new(&["IP", "HANDLE", "NODE", "BLOCK", "SEQUENCE"]);
        for a in &released {
            rows.row(vec![
                a.ip.to_string(),
                a.handle.clone(),
                a.node.clone().unwrap_or_else(|| "-".into()),
                a.block.clone(),
                a.sequence.to_string(),
            ]);
        }
        table.push_str(&format!(
            "{verb} {} leaked address{}:\n{}",
            released.len(),
            if released.len() == 1 { "" } else { "es" },
            rows.render()
        ));
    }
    if !skipped.is_empty() {
        let mut rows = Table::new(&["IP", "HANDLE", "SEQUENCE", "WHY SKIPPED"]);
        for s in &skipped {
            rows.row(vec![
                s.address.ip.to_string(),
                s.address.handle.clone(),
                s.address.sequence.to_string(),
                s.reason.clone(),
            ]);
        }
        table.push_str(&format!(
            "Skipped {} reported address{}:\n{}",
            skipped.len(),
            if skipped.len() == 1 { "" } else { "es" },
            rows.render()
        ));
    }
    for kind in &kinds_not_released {
        table.push_str(&format!(
            "Not released: {} problem{} of kind {} ({}).\n",
            kind.problems,
            if kind.problems == 1 { "" } else { "s" },
            kind.kind,
            kind.reason
        ));
    }
    if !apply && !released.is_empty() {
        table.push_str("Nothing was changed: run again with --apply to release them.\n");
    }
    let json = FromReportJson {
        applied: apply,
        released,
        skipped,
        kinds_not_released,
    };
    Ok(Outcome::ok(to_json(&json)?, table))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipam_core::model::{encode, Handle};
    use ipam_core::KvStore;
    use std::sync::Arc;

    /// A store whose pods `net.a` and `net.b` lost their handles (what `check` reports as
    /// missing-handle), and their addresses as a report lists them.
    async fn two_leaks() -> (Arc<dyn KvStore>, Ipam, Vec<ReportedAddress>) {
        let (store, ipam) = super::super::test_support::two_pods_on_node_a().await;
        let reported = ipam
            .list_allocations()
            .await
            .expect("list")
            .into_iter()
            .map(|a| ReportedAddress {
                ip: a.ip,
                handle: a.handle,
                node: a.block_host,
                block: a.block.to_string(),
                sequence: a.sequence,
                kind: ipam_core::check::kinds::MISSING_HANDLE.into(),
            })
            .collect();
        for pod in ["net.a", "net.b"] {
            store.delete(&keys::handle(pod)).await.expect("lose it");
        }
        (store, ipam, reported)
    }

    /// A handle written again after the report's handles were read (a repair recreating it) keeps
    /// its addresses; the other leak is released.
    #[tokio::test]
    async fn a_handle_written_again_after_the_decision_keeps_its_addresses() {
        let (store, ipam, reported) = two_leaks().await;
        let recreated = Handle {
            blocks: BTreeMap::from([(reported[0].block.parse().expect("a block"), 1)]),
            ..Handle::default()
        };
        store
            .put(
                &keys::handle(&reported[0].handle),
                encode(&recreated).expect("encode"),
            )
            .await
            .expect("recreate the first pod's handle");

        let (released, skipped) = release_while_handles_absent(&ipam, reported.clone())
            .await
            .expect("release");
        assert_eq!(
            released.iter().map(|a| a.ip).collect::<Vec<_>>(),
            vec![reported[1].ip],
            "{skipped:?}"
        );
        assert_eq!(skipped.len(), 1, "{skipped:?}");
        assert_eq!(skipped[0].address.ip, reported[0].ip);
        assert!(
            skipped[0].reason.contains("was written while releasing"),
            "{}",
            skipped[0].reason
        );
        let kept = ipam
            .get_assignment(reported[0].ip)
            .await
            .expect("read")
            .expect("still allocated");
        assert_eq!(kept.handle, reported[0].handle);
        assert!(ipam
            .get_assignment(reported[1].ip)
            .await
            .expect("read")
            .is_none());
    }

    /// Handles still absent: every reported address is released.
    #[tokio::test]
    async fn leaks_whose_handles_stay_absent_are_released() {
        let (_store, ipam, reported) = two_leaks().await;
        let (released, skipped) = release_while_handles_absent(&ipam, reported.clone())
            .await
            .expect("release");
        assert!(skipped.is_empty(), "{skipped:?}");
        assert_eq!(
            released.iter().map(|a| a.ip).collect::<Vec<_>>(),
            reported.iter().map(|a| a.ip).collect::<Vec<_>>()
        );
        assert!(ipam.list_allocations().await.expect("list").is_empty());
    }
}
