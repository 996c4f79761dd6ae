//! The end-of-run comparison: what every simulated pod believes it holds against what the store
//! records (`list_allocations`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipam_core::AllocationInfo;
use serde::Serialize;

/// How many problem descriptions a report keeps.
const SAMPLES: usize = 10;

/// What the comparison found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Verification {
    /// Pods that believe they hold addresses.
    pub live_pods: u64,
    /// Addresses they believe they hold.
    pub believed_addresses: u64,
    /// Allocations in the store (all handles).
    pub store_allocations: u64,
    /// Allocations in the store whose handle is this run's network's.
    pub run_allocations: u64,
    /// Addresses believed by two pods, or held in the store by another handle than the pod's.
    pub duplicates: u64,
    /// Addresses a pod believes it holds that the store does not record at all.
    pub missing: u64,
    /// The store holds them for this run's network, but no pod believes it holds them.
    pub leaked: u64,
    /// Pods whose DEL failed (excluded: whether they hold their address is unknown).
    pub uncertain_pods: u64,
    /// Descriptions of the first problems.
    pub samples: Vec<String>,
}

impl Verification {
    /// True when nothing is duplicated, missing or leaked.
    pub fn is_clean(&self) -> bool {
        self.duplicates == 0 && self.missing == 0 && self.leaked == 0
    }

    fn note(&mut self, problem: String) {
        if self.samples.len() < SAMPLES {
            self.samples.push(problem);
        }
    }
}

/// Compares `believed` (handle → addresses, one entry per live pod) with `allocations`.
/// `run_prefix` (`<network>.`) says which handles are this run's; `uncertain` handles are left
/// out of the leak count.
pub fn compare(
    believed: &BTreeMap<String, Vec<IpAddr>>,
    uncertain: &BTreeSet<String>,
    allocations: &[AllocationInfo],
    run_prefix: &str,
) -> Verification {
    let mut result = Verification {
        live_pods: believed.len() as u64,
        believed_addresses: believed.values().map(|ips| ips.len() as u64).sum(),
        store_allocations: allocations.len() as u64,
        uncertain_pods: uncertain.len() as u64,
        ..Verification::default()
    };
    let in_store: BTreeMap<IpAddr, &str> = allocations
        .iter()
        .map(|a| (a.ip, a.handle.as_str()))
        .collect();
    let mut believers: BTreeMap<IpAddr, &str> = BTreeMap::new();
    for (handle, ips) in believed {
        for ip in ips {
            if let Some(other) = believers.insert(*ip, handle) {
                result.duplicates += 1;
                result.note(format!(
                    "{ip} is believed held by both {other} and {handle}"
                ));
            }
            match in_store.get(ip) {
                Some(owner) if *owner == handle => {}
                Some(owner) => {
                    result.duplicates += 1;
                    result.note(format!(
                        "{ip} is believed held by {handle} but the store gives it to {owner}"
                    ));
                }
                None => {
                    result.missing += 1;
                    result.note(format!(
                        "{ip} is believed held by {handle} but the store has no allocation for it"
                    ));
                }
            }
        }
    }
    for allocation in allocations {
        if !allocation.handle.starts_with(run_prefix) {
            continue;
        }
        result.run_allocations += 1;
        let believed_here = believed
            .get(&allocation.handle)
            .is_some_and(|ips| ips.contains(&allocation.ip));
        if !believed_here && !uncertain.contains(&allocation.handle) {
            result.leaked += 1;
            result.note(format!(
                "{} is allocated to {} but no pod believes it holds it",
                allocation.ip, allocation.handle
            ));
        }
    }
    result
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

    fn believed(entries: &[(&str, [u8; 4])]) -> BTreeMap<String, Vec<IpAddr>> {
        let mut map: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
        for (handle, ip) in entries {
            map.entry((*handle).to_owned())
                .or_default()
                .push(IpAddr::from(*ip));
        }
        map
    }

    #[test]
    fn agreement_is_clean_and_foreign_allocations_are_ignored() {
        let result = compare(
            &believed(&[("load.a", [10, 0, 0, 1])]),
            &BTreeSet::new(),
            &[
                allocation([10, 0, 0, 1], "load.a"),
                allocation([10, 0, 0, 9], "other.x"),
            ],
            "load.",
        );
        assert!(result.is_clean(), "{result:?}");
        assert_eq!((result.store_allocations, result.run_allocations), (2, 1));
    }

    #[test]
    fn duplicates_missing_and_leaked_addresses_are_each_found() {
        let result = compare(
            &believed(&[
                ("load.a", [10, 0, 0, 1]),
                ("load.b", [10, 0, 0, 1]),
                ("load.c", [10, 0, 0, 3]),
            ]),
            &BTreeSet::from(["load.u".to_owned()]),
            &[
                allocation([10, 0, 0, 1], "load.a"),
                allocation([10, 0, 0, 5], "load.gone"),
                allocation([10, 0, 0, 6], "load.u"),
            ],
            "load.",
        );
        // b believes .1 (also a's) and the store gives .1 to a: two findings.
        assert_eq!(result.duplicates, 2, "{result:?}");
        assert_eq!(result.missing, 1, "{result:?}");
        assert_eq!(result.leaked, 1, "{result:?}");
        assert!(!result.is_clean());
        assert_eq!(result.samples.len(), 4);
    }
}
