//! The leak decision on hand-made allocations and runtime views: what waits, what is released, what is never touched, what is reported.

use super::*;
use ipnet::IpNet;

const GRACE: u64 = 900;
const POLICY: LeakPolicy = LeakPolicy {
    grace_seconds: GRACE,
    max_gap_seconds: 180,
};
const T0: u64 = 1_800_000_000;
/// A runtime view's one live sandbox, whose allocation ("10.0.0.1") proves the runtime is the
/// plugin's.
const LIVE: &[(&str, &[&str])] = &[("live", &["10.0.0.1"])];

fn ip(text: &str) -> IpAddr {
    text.parse().expect("an address")
}

/// An allocation the plugin made on `node` for `container`'s pod (no timestamp unless given).
fn allocation(address: &str, sequence: u64, node: &str, container: Option<&str>) -> AllocationInfo {
    let mut attributes = BTreeMap::from([(ATTR_NODE.to_owned(), node.to_owned())]);
    if let Some(container) = container {
        attributes.insert(ATTR_CONTAINER_ID.to_owned(), container.to_owned());
        attributes.insert(ATTR_POD.to_owned(), format!("pod-{container}"));
    }
    AllocationInfo {
        ip: ip(address),
        block: "10.0.0.0/26".parse::<IpNet>().expect("a block"),
        block_host: Some(node.to_owned()),
        handle: format!("net.{}", container.unwrap_or("reservation")),
        attributes,
        sequence,
    }
}

fn view(at: u64, live: &[(&str, &[&str])]) -> RuntimeView {
    RuntimeView {
        observed_at: at,
        sandboxes: live
            .iter()
            .map(|(id, addresses)| {
                (
                    (*id).to_owned(),
                    LiveSandbox {
                        pod: format!("pod-{id}"),
                        namespace: "default".into(),
                        uid: format!("uid-{id}"),
                        addresses: addresses.iter().map(|a| ip(a)).collect(),
                    },
                )
            })
            .collect(),
    }
}

fn in_pool(address: IpAddr) -> bool {
    "10.0.0.0/24"
        .parse::<IpNet>()
        .expect("a pool")
        .contains(&address)
}

fn leaked_addresses(decisions: &LeakDecisions) -> Vec<IpAddr> {
    decisions.leaked.iter().map(|m| m.allocation.ip).collect()
}

fn waiting_addresses(decisions: &LeakDecisions) -> Vec<IpAddr> {
    decisions.waiting.iter().map(|m| m.allocation.ip).collect()
}

#[test]
fn a_missing_container_is_released_only_after_the_whole_grace() {
    // Looks stamp whole seconds: exactly GRACE apart may be less than GRACE, so the first look
    // that releases is more than GRACE after the first that found the container missing.
    let allocations = [
        allocation("10.0.0.1", 1, "node-a", Some("live")),
        allocation("10.0.0.2", 2, "node-a", Some("gone")),
    ];
    let mut watch = LeakWatch::new();
    let mut at = T0;
    while at <= T0 + GRACE {
        let decisions = watch.observe(
            "node-a",
            &allocations,
            &view(at, &[("live", &["10.0.0.1"])]),
            &in_pool,
            POLICY,
        );
        assert_eq!(decisions.live, 1);
        assert!(decisions.leaked.is_empty(), "at {at}: {decisions:?}");
        assert_eq!(waiting_addresses(&decisions), [ip("10.0.0.2")]);
        assert_eq!(decisions.waiting[0].missing_since, T0);
        at += 60;
    }
    let decisions = watch.observe(
        "node-a",
        &allocations,
        &view(T0 + GRACE + 1, &[("live", &["10.0.0.1"])]),
        &in_pool,
        POLICY,
    );
    assert_eq!(leaked_addresses(&decisions), [ip("10.0.0.2")]);
    assert_eq!(decisions.leaked[0].missing_since, T0);
    assert!(decisions.waiting.is_empty());
    assert!(decisions.disagreements.is_empty());
}

#[test]
fn other_nodes_and_reservations_are_never_touched() {
    let allocations = [
        allocation("10.0.0.3", 1, "node-b", Some("gone-elsewhere")),
        allocation("10.0.0.4", 1, "node-a", None),
    ];
    let mut watch = LeakWatch::new();
    for at in [T0, T0 + 60, T0 + GRACE, T0 + GRACE + 60] {
        let decisions = watch.observe("node-a", &allocations, &view(at, &[]), &in_pool, POLICY);
        assert!(decisions.leaked.is_empty() && decisions.waiting.is_empty());
        assert_eq!(decisions.not_a_pod, 1);
        assert_eq!(decisions.live, 0);
    }
    assert_eq!(watch.counting(), 0);
}

#[test]
fn a_sandbox_in_any_state_keeps_its_allocations() {
    // The view lists the sandbox (stopped, no address): its allocation is live.
    let allocations = [allocation("10.0.0.5", 1, "node-a", Some("stopped"))];
    let mut watch = LeakWatch::new();
    for at in [T0, T0 + GRACE, T0 + 2 * GRACE] {
        let decisions = watch.observe(
            "node-a",
            &allocations,
            &view(at, &[("stopped", &[])]),
            &in_pool,
            POLICY,
        );
        assert_eq!(decisions.live, 1);
        assert!(decisions.leaked.is_empty());
    }
}

#[test]
fn an_allocation_younger_than_the_grace_by_its_timestamp_waits() {
    let mut young = allocation("10.0.0.6", 1, "node-a", Some("gone"));
    // Stamped 300 s after the first look that found its container missing (the plugin's clock
    // and the look's disagree, or the look raced the ADD).
    young
        .attributes
        .insert(ATTR_TIMESTAMP.to_owned(), timestamp::format_unix(T0 + 300));
    let allocations = [young, allocation("10.0.0.1", 1, "node-a", Some("live"))];
    let mut watch = LeakWatch::new();
    let mut seen = Vec::new();
    for at in T0..=T0 + GRACE + 600 {
        let decisions = watch.observe("node-a", &allocations, &view(at, LIVE), &in_pool, POLICY);
        if !decisions.leaked.is_empty() {
            seen.push(at);
        }
    }
    // Missing since T0 (a clock the plugin's stamp disagrees with): released only once the
    // allocation is more than GRACE old by its own (whole-second) stamp.
    assert_eq!(seen.first(), Some(&(T0 + 300 + GRACE + 1)));
}

#[test]
fn an_unanswered_look_or_a_long_gap_restarts_every_countdown() {
    let allocations = [
        allocation("10.0.0.7", 1, "node-a", Some("gone")),
        allocation("10.0.0.1", 1, "node-a", Some("live")),
    ];
    let mut watch = LeakWatch::new();
    watch.observe("node-a", &allocations, &view(T0, LIVE), &in_pool, POLICY);
    assert_eq!(watch.counting(), 1);
    watch.runtime_unanswered();
    assert_eq!(watch.counting(), 0);
    let back = T0 + GRACE + 1;
    let decisions = watch.observe("node-a", &allocations, &view(back, LIVE), &in_pool, POLICY);
    assert!(decisions.leaked.is_empty(), "the countdown started again");
    assert_eq!(decisions.waiting[0].missing_since, back);

    // Two answered looks too far apart: the absence in between is not proven.
    let later = back + POLICY.max_gap_seconds + 1;
    let decisions = watch.observe("node-a", &allocations, &view(later, LIVE), &in_pool, POLICY);
    assert!(decisions.countdowns_restarted);
    assert!(decisions.leaked.is_empty());
    assert_eq!(decisions.waiting[0].missing_since, later);

    // A clock that went back restarts them too.
    let decisions = watch.observe(
        "node-a",
        &allocations,
        &view(later - 10, LIVE),
        &in_pool,
        POLICY,
    );
    assert!(decisions.countdowns_restarted);
    assert_eq!(decisions.waiting[0].missing_since, later - 10);
}

#[test]
fn a_reallocated_address_or_a_container_back_starts_a_fresh_countdown() {
    let mut watch = LeakWatch::new();
    let first = [
        allocation("10.0.0.8", 1, "node-a", Some("gone")),
        allocation("10.0.0.1", 1, "node-a", Some("live")),
    ];
    watch.observe("node-a", &first, &view(T0, LIVE), &in_pool, POLICY);
    // The address was released and taken again (new sequence) by another missing container.
    let second = [
        allocation("10.0.0.8", 7, "node-a", Some("also-gone")),
        allocation("10.0.0.1", 1, "node-a", Some("live")),
    ];
    let decisions = watch.observe(
        "node-a",
        &second,
        &view(T0 + GRACE + 1, LIVE),
        &in_pool,
        POLICY,
    );
    assert!(decisions.leaked.is_empty());
    assert_eq!(decisions.waiting[0].missing_since, T0 + GRACE + 1);
    assert_eq!(watch.counting(), 1, "the first countdown is forgotten");

    // The container comes back for one look: its countdown is dropped.
    let mut watch = LeakWatch::new();
    watch.observe("node-a", &first, &view(T0, LIVE), &in_pool, POLICY);
    watch.observe(
        "node-a",
        &first,
        &view(T0 + 60, &[("gone", &[]), ("live", &["10.0.0.1"])]),
        &in_pool,
        POLICY,
    );
    let decisions = watch.observe(
        "node-a",
        &first,
        &view(T0 + GRACE + 1, LIVE),
        &in_pool,
        POLICY,
    );
    assert!(decisions.leaked.is_empty());
    assert_eq!(decisions.waiting[0].missing_since, T0 + GRACE + 1);
}

#[test]
fn live_addresses_the_store_does_not_record_for_their_sandbox_are_reported() {
    let allocations = [
        allocation("10.0.0.10", 1, "node-a", Some("own")),
        allocation("10.0.0.11", 1, "node-b", Some("other")),
    ];
    let mut watch = LeakWatch::new();
    let decisions = watch.observe(
        "node-a",
        &allocations,
        &view(
            T0,
            &[
                // Its own address: fine. An address another node's container holds: a duplicate.
                ("own", &["10.0.0.10", "10.0.0.11"]),
                // A free address in a pool, and one outside every pool (not ours).
                ("unrecorded", &["10.0.0.12", "192.168.1.5"]),
            ],
        ),
        &in_pool,
        POLICY,
    );
    assert_eq!(decisions.disagreements.len(), 2, "{decisions:#?}");
    let duplicate = &decisions.disagreements[0];
    assert_eq!(duplicate.address, ip("10.0.0.11"));
    assert_eq!(duplicate.sandbox_id, "own");
    assert_eq!(duplicate.pod, "default/pod-own");
    assert_eq!(
        duplicate.holder,
        AddressHolder::Other(allocations[1].clone())
    );
    let free = &decisions.disagreements[1];
    assert_eq!(free.address, ip("10.0.0.12"));
    assert_eq!(free.sandbox_id, "unrecorded");
    assert_eq!(free.holder, AddressHolder::Free);
}

#[test]
fn nothing_is_released_while_the_runtime_reports_none_of_this_nodes_containers() {
    // A runtime that runs none of the containers the store records for this node (another
    // runtime's socket, or one that lost its state and runs nothing yet): the countdowns go on,
    // and nothing is released until it reports one of them.
    let allocations = [
        allocation("10.0.0.20", 1, "node-a", Some("gone-1")),
        allocation("10.0.0.21", 1, "node-a", Some("gone-2")),
    ];
    let mut watch = LeakWatch::new();
    for at in (T0..=T0 + 2 * GRACE).step_by(60) {
        let decisions = watch.observe(
            "node-a",
            &allocations,
            &view(at, &[("someone-elses", &["10.0.0.99"])]),
            &in_pool,
            POLICY,
        );
        assert!(decisions.runtime_unproven);
        assert!(decisions.leaked.is_empty(), "at {at}: {decisions:?}");
        assert_eq!(decisions.waiting.len(), 2);
    }
    // A pod the plugin served runs again: the runtime is the plugin's, and both allocations,
    // missing at every look since T0, are released at once.
    let mut with_live = allocations.to_vec();
    with_live.push(allocation("10.0.0.1", 1, "node-a", Some("live")));
    let decisions = watch.observe(
        "node-a",
        &with_live,
        &view(T0 + 2 * GRACE + 60, LIVE),
        &in_pool,
        POLICY,
    );
    assert!(!decisions.runtime_unproven);
    assert_eq!(
        leaked_addresses(&decisions),
        [ip("10.0.0.20"), ip("10.0.0.21")]
    );
    assert!(decisions.leaked.iter().all(|m| m.missing_since == T0));
}

#[test]
fn a_container_without_a_kubernetes_pod_is_not_judged() {
    // Podman (or anything calling the plugin without K8S_POD_NAME) is not a CRI pod.
    let mut podman = allocation("10.0.0.30", 1, "node-a", Some("podman-container"));
    podman.attributes.remove(ATTR_POD);
    let allocations = [podman, allocation("10.0.0.1", 1, "node-a", Some("live"))];
    let mut watch = LeakWatch::new();
    for at in [T0, T0 + GRACE, T0 + 2 * GRACE] {
        let decisions = watch.observe("node-a", &allocations, &view(at, LIVE), &in_pool, POLICY);
        assert_eq!(decisions.not_a_pod, 1);
        assert!(decisions.leaked.is_empty() && decisions.waiting.is_empty());
    }
}

#[test]
fn the_first_look_and_one_in_survey_every_looks_survey_the_store() {
    let mut watch = LeakWatch::new();
    assert!(watch.survey_due(), "an agent's first look surveys");
    assert!(!watch.last_look_surveyed());
    watch.looked(true);
    assert!(watch.last_look_surveyed());
    for look in 1..SURVEY_EVERY_LOOKS {
        assert!(!watch.survey_due(), "look {look} after a survey");
        watch.looked(false);
        assert!(!watch.last_look_surveyed());
    }
    assert!(
        watch.survey_due(),
        "the look {SURVEY_EVERY_LOOKS} after a survey"
    );
    // A look that had to survey early (a live address outside the node's blocks) starts the
    // count again.
    watch.looked(true);
    assert!(!watch.survey_due());
}

#[test]
fn an_attachment_records_the_pod_and_namespace_only_when_named() {
    let named = Attachment {
        network: "net",
        container_id: "c1",
        interface: "eth0",
        namespace: Some("team-a"),
        pod: Some("web-1"),
    };
    assert_eq!(
        named.attributes("2026-11-25T01:00:00Z"),
        BTreeMap::from([
            (ATTR_NETWORK.to_owned(), "net".to_owned()),
            (ATTR_CONTAINER_ID.to_owned(), "c1".to_owned()),
            (ATTR_INTERFACE.to_owned(), "eth0".to_owned()),
            (ATTR_TIMESTAMP.to_owned(), "2026-11-25T01:00:00Z".to_owned()),
            (ATTR_NAMESPACE.to_owned(), "team-a".to_owned()),
            (ATTR_POD.to_owned(), "web-1".to_owned()),
        ])
    );
    // A runtime that is not Kubernetes names no pod; CNI_ARGS may name one empty.
    for (namespace, pod) in [(None, None), (Some(""), Some(""))] {
        let unnamed = Attachment {
            namespace,
            pod,
            ..named
        }
        .attributes("2026-11-25T01:00:00Z");
        assert_eq!(unnamed.len(), 4, "{unnamed:?}");
        assert!(!unnamed.contains_key(ATTR_NAMESPACE) && !unnamed.contains_key(ATTR_POD));
    }
}
