//! Calico input at the edges of what the mapper accepts: each refusal names its object, each
//! report says what was done, and what is within bounds maps without a word.

use std::collections::BTreeMap;

use blockipam_import::calico::{cidr_segment, family_segment};
use blockipam_import::{map, plan_import, CalicoSnapshot, ImportError, Mapping, NotMapped};
use ipam_core::model::{encode, Attribute, MAX_ATTRIBUTE_BYTES};
use ipam_core::IpamConfig;
use ipnet::IpNet;
use serde_json::{json, Value};
use test_kit::calico::{CalicoBlockBuilder, CalicoFixture};

fn mapped(fixture: &CalicoFixture) -> Mapping {
    map(&CalicoSnapshot::parse(42, fixture.entries()))
}

/// Adds a block stored under `key_cidr`'s key with `value` (a builder's JSON, edited by a test).
fn raw_block(fixture: CalicoFixture, key_cidr: &str, value: &Value) -> CalicoFixture {
    let cidr: IpNet = key_cidr.parse().expect("a block CIDR");
    let key = format!(
        "/ipam/v2/assignment/{}/block/{}",
        family_segment(&cidr),
        cidr_segment(&cidr)
    );
    fixture.raw(&key, &value.to_string())
}

/// The reports on objects whose name starts with `object`, as (object, field, value, note).
fn reports<'a>(mapping: &'a Mapping, object: &str) -> Vec<&'a NotMapped> {
    mapping
        .plan
        .not_mapped
        .iter()
        .filter(|n| n.object.starts_with(object))
        .collect()
}

fn as_refs(pairs: &[(String, String)]) -> Vec<(&str, &str)> {
    pairs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

/// Asserts the mapping refuses with exactly one reason, containing each of `needles`, and that
/// `plan_import` refuses with the same reason.
fn assert_refused_once(fixture: &CalicoFixture, needles: &[&str]) {
    let mapping = mapped(fixture);
    assert_eq!(mapping.refusals.len(), 1, "{:?}", mapping.refusals);
    for needle in needles {
        assert!(
            mapping.refusals[0].contains(needle),
            "{needle:?} in {:?}",
            mapping.refusals[0]
        );
    }
    match plan_import(&CalicoSnapshot::parse(42, fixture.entries())) {
        Err(ImportError::Unmappable(reasons)) => assert_eq!(reasons, mapping.refusals),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn the_ipam_configuration_is_taken_as_calico_stored_it_and_only_its_set_unknown_fields_reported() {
    let fixture = CalicoFixture::new().config(json!({
        "strict_affinity": true,
        "auto_allocate_blocks": false,
        "maxBlocksPerHost": 7,
        "ipCooldownSeconds": 0,
        "unsetNull": null,
        "unsetFalse": false,
        "unsetZero": 0,
        "unsetText": "",
        "unsetList": [],
        "unsetObject": {},
        "kubeVirtVMAddressPersistence": "Enabled",
        "pollSeconds": 30,
    }));
    let mapping = mapped(&fixture);
    assert!(mapping.refusals.is_empty(), "{:?}", mapping.refusals);
    assert!(mapping.plan.config_stored);
    assert_eq!(
        mapping.plan.config,
        IpamConfig {
            strict_affinity: true,
            auto_allocate_blocks: false,
            max_blocks_per_host: 7,
            ip_cooldown_seconds: 0,
            ..IpamConfig::default()
        }
    );
    let reported: Vec<(&str, &str, &str)> = reports(&mapping, "ipam config")
        .iter()
        .map(|n| (n.field.as_str(), n.value.as_str(), n.note.as_str()))
        .collect();
    assert_eq!(
        reported,
        [
            (
                "kubeVirtVMAddressPersistence",
                "\"Enabled\"",
                "not mapped: blockipam has no such setting"
            ),
            (
                "pollSeconds",
                "30",
                "not mapped: blockipam has no such setting"
            ),
        ],
        "a cooldown of 0 and unset fields lose nothing"
    );
}

#[test]
fn calicos_defaults_stand_in_for_a_missing_configuration_and_bounds_are_kept() {
    let mapping = mapped(&CalicoFixture::new());
    assert!(!mapping.plan.config_stored);
    assert_eq!(
        mapping.plan.config,
        IpamConfig {
            strict_affinity: false,
            auto_allocate_blocks: true,
            max_blocks_per_host: 20,
            ip_cooldown_seconds: 0,
            ..IpamConfig::default()
        }
    );

    // Calico's 0 means its default; 1200 s is the longest cooldown, taken without a report.
    let mapping = mapped(
        &CalicoFixture::new().config(json!({"maxBlocksPerHost": 0, "ipCooldownSeconds": 1200})),
    );
    assert!(mapping.refusals.is_empty(), "{:?}", mapping.refusals);
    assert_eq!(mapping.plan.config.max_blocks_per_host, 20);
    assert_eq!(mapping.plan.config.ip_cooldown_seconds, 1200);
    assert!(
        reports(&mapping, "ipam config").is_empty(),
        "{:#?}",
        mapping.plan.not_mapped
    );

    assert_refused_once(
        &CalicoFixture::new().config(json!({"maxBlocksPerHost": -1})),
        &["maxBlocksPerHost -1 is out of range"],
    );
}

#[test]
fn pool_fields_blockipam_does_not_keep_are_reported_with_the_reason() {
    let fixture = CalicoFixture::new().pool(
        "p",
        "10.5.0.0/24",
        26,
        json!({
            "namespaceSelector": "team == 'a'",
            "ipipMode": "Always",
            "vxlanMode": "Never",
            "natOutgoing": false,
            "nodeSelector": "",
            "futureKnob": "on",
        }),
    );
    let mapping = mapped(&fixture);
    assert!(mapping.refusals.is_empty(), "{:?}", mapping.refusals);
    let reported: Vec<(&str, &str, &str)> = reports(&mapping, "ippool p")
        .iter()
        .map(|n| (n.field.as_str(), n.value.as_str(), n.note.as_str()))
        .collect();
    assert_eq!(
        reported,
        [
            (
                "spec.futureKnob",
                "\"on\"",
                "not mapped: a pool field this import does not know"
            ),
            (
                "spec.ipipMode",
                "\"Always\"",
                "not mapped: routing and encapsulation are not blockipam's (configure the \
                 network plugin)"
            ),
            (
                "spec.namespaceSelector",
                "\"team == 'a'\"",
                "not mapped: blockipam pools serve every namespace"
            ),
        ],
        "Calico's defaults (vxlanMode Never, natOutgoing false, no node selector) lose nothing"
    );
}

#[test]
fn pools_that_overlap_refuse_whichever_holds_the_other() {
    let fixture = CalicoFixture::new()
        .pool("a", "10.3.0.0/24", 26, json!({}))
        .pool("b", "10.3.0.128/25", 26, json!({}))
        .pool("c", "10.3.16.0/25", 26, json!({}))
        .pool("d", "10.3.16.0/20", 26, json!({}))
        .pool("e", "10.3.64.0/24", 26, json!({}));
    let mapping = mapped(&fixture);
    assert_eq!(
        mapping.refusals,
        [
            "pools a (10.3.0.0/24) and b (10.3.0.128/25) overlap",
            "pools c (10.3.16.0/25) and d (10.3.16.0/20) overlap",
        ]
    );
}

#[test]
fn an_affinity_is_reported_only_when_it_is_not_ownership_or_names_no_block() {
    let owned = CalicoBlockBuilder::new("10.4.0.0/26", Some("node-a"), 1).allocate(
        0,
        "net.a",
        &[("node", "node-a")],
        1,
    );
    let pending = CalicoBlockBuilder::new("10.4.0.64/26", Some("node-b"), 1).allocate(
        0,
        "net.b",
        &[("node", "node-b")],
        1,
    );
    let mut deleted = CalicoBlockBuilder::new("10.4.0.128/26", Some("node-c"), 1).to_json();
    deleted["deleted"] = json!(true);
    let fixture = raw_block(
        CalicoFixture::new()
            .pool("p", "10.4.0.0/24", 26, json!({}))
            .block(&owned)
            .affinity("node-a", "10.4.0.0/26", "confirmed")
            .block(&pending)
            .affinity("node-b", "10.4.0.64/26", "pending")
            .affinity("node-c", "10.4.0.128/26", "confirmed")
            .affinity("node-d", "10.4.0.192/26", "confirmed"),
        "10.4.0.128/26",
        &deleted,
    );
    let mapping = mapped(&fixture);
    assert!(mapping.refusals.is_empty(), "{:?}", mapping.refusals);
    let reported: Vec<(&str, &str, &str)> = reports(&mapping, "affinity ")
        .iter()
        .map(|n| (n.object.as_str(), n.field.as_str(), n.value.as_str()))
        .collect();
    assert_eq!(
        reported,
        [
            ("affinity node-b 10.4.0.64/26", "state", "\"pending\""),
            ("affinity node-c 10.4.0.128/26", "", ""),
            ("affinity node-d 10.4.0.192/26", "", ""),
        ]
    );
    for missing in &reports(&mapping, "affinity ")[1..] {
        assert!(
            missing.note.starts_with("the block does not exist"),
            "{missing:?}"
        );
    }
    let affinity_of = |cidr: &str| {
        let cidr: IpNet = cidr.parse().expect("cidr");
        mapping
            .plan
            .blocks
            .iter()
            .find(|b| b.cidr == cidr)
            .map(|b| b.affinity.clone())
    };
    assert_eq!(affinity_of("10.4.0.0/26"), Some(Some("node-a".to_owned())));
    assert_eq!(affinity_of("10.4.0.64/26"), Some(None));
    assert_eq!(
        affinity_of("10.4.0.128/26"),
        None,
        "a deleted block is skipped"
    );
}

#[test]
fn a_block_affine_through_the_older_host_affinity_field_keeps_its_host() {
    let block = |host_affinity: &str| {
        let mut value = CalicoBlockBuilder::new("10.4.1.0/26", None, 1)
            .allocate(3, "net.h", &[("node", "node-h")], 1)
            .to_json();
        value.as_object_mut().expect("an object").remove("affinity");
        value["hostAffinity"] = json!(host_affinity);
        value
    };
    let fixture = |host_affinity: &str| {
        raw_block(
            CalicoFixture::new()
                .pool("p", "10.4.1.0/24", 26, json!({}))
                .affinity("node-h", "10.4.1.0/26", "confirmed"),
            "10.4.1.0/26",
            &block(host_affinity),
        )
    };
    let mapping = mapped(&fixture("node-h"));
    assert!(mapping.refusals.is_empty(), "{:?}", mapping.refusals);
    assert_eq!(mapping.plan.blocks.len(), 1);
    assert_eq!(mapping.plan.blocks[0].affinity.as_deref(), Some("node-h"));

    // An empty host is no affinity (not a host name to refuse): the block is imported without.
    let mapping = mapped(&fixture(""));
    assert!(mapping.refusals.is_empty(), "{:?}", mapping.refusals);
    assert_eq!(mapping.plan.blocks.len(), 1);
    assert_eq!(mapping.plan.blocks[0].affinity, None);
}

#[test]
fn a_node_with_as_many_labels_as_blockipam_keeps_is_imported_and_one_more_refuses() {
    let labels = |count: usize| -> Vec<(String, String)> {
        (0..count)
            .map(|i| (format!("label-{i:03}"), "v".to_owned()))
            .collect()
    };
    let (most, too_many) = (labels(256), labels(257));
    let fixture = CalicoFixture::new()
        .node("node-a", &as_refs(&most))
        .node("node-b", &as_refs(&too_many));
    let mapping = mapped(&fixture);
    assert_eq!(mapping.refusals.len(), 1, "{:?}", mapping.refusals);
    assert!(
        mapping.refusals[0].starts_with("node \"node-b\": it has 257 labels"),
        "{}",
        mapping.refusals[0]
    );
    assert_eq!(
        mapping.plan.node_labels.keys().collect::<Vec<_>>(),
        ["node-a"]
    );
    assert_eq!(
        mapping.plan.node_labels["node-a"],
        most.into_iter().collect::<BTreeMap<_, _>>()
    );
}

#[test]
fn a_block_whose_value_names_another_cidr_refuses() {
    let value = CalicoBlockBuilder::new("10.2.0.64/26", Some("n"), 1)
        .allocate(0, "net.x", &[("node", "n")], 1)
        .to_json();
    let fixture = raw_block(
        CalicoFixture::new().pool("p", "10.2.0.0/24", 26, json!({})),
        "10.2.0.0/26",
        &value,
    );
    assert_refused_once(
        &fixture,
        &["block 10.2.0.0/26: its value names CIDR 10.2.0.64/26"],
    );
}

#[test]
fn a_block_in_no_pool_is_skipped_when_empty_and_refuses_when_it_holds_addresses() {
    let pools = || CalicoFixture::new().pool("elsewhere", "10.1.8.0/24", 26, json!({}));
    let empty = CalicoBlockBuilder::new("10.1.0.0/26", Some("n"), 4);
    let mapping = mapped(
        &pools()
            .block(&empty)
            .affinity("n", "10.1.0.0/26", "confirmed"),
    );
    assert!(mapping.refusals.is_empty(), "{:?}", mapping.refusals);
    assert!(mapping.plan.blocks.is_empty());
    let reported: Vec<&str> = reports(&mapping, "block 10.1.0.0/26")
        .iter()
        .map(|n| n.note.as_str())
        .collect();
    assert_eq!(reported, ["empty and in no IP pool: skipped"]);

    let holding = empty.allocate(5, "net.y", &[("node", "n")], 4);
    assert_refused_once(
        &pools()
            .block(&holding)
            .affinity("n", "10.1.0.0/26", "confirmed"),
        &[
            "block 10.1.0.0/26: 1 addresses in use or cooling",
            "lies in no IP pool",
        ],
    );
}

#[test]
fn unknown_block_and_attribute_fields_are_counted_unless_unset() {
    let builder = CalicoBlockBuilder::new("10.0.9.0/26", Some("n"), 1)
        .allocate(0, "net.live", &[("node", "n")], 1)
        .allocate(1, "net.gone", &[("node", "n")], 1)
        .release_into_cooldown(1, "2026-01-01T00:00:00Z")
        .field("futureBlockField", json!("x"))
        .field("unsetBlockField", json!(false));
    let mut value = builder.to_json();
    assert_eq!(value["allocations"][0], json!(0), "the live attribute");
    assert_eq!(value["allocations"][1], json!(1), "the cooling attribute");
    value["attributes"][0]["futureAttributeField"] = json!(7);
    value["attributes"][0]["unsetAttributeField"] = json!("");
    value["attributes"][1]["futureCoolingField"] = json!(["y"]);
    value["attributes"][1]["unsetCoolingField"] = json!(null);
    let fixture = raw_block(
        CalicoFixture::new()
            .pool("p", "10.0.9.0/24", 26, json!({}))
            .config(json!({"ipCooldownSeconds": 60}))
            .affinity("n", "10.0.9.0/26", "confirmed"),
        "10.0.9.0/26",
        &value,
    );
    let mapping = mapped(&fixture);
    assert!(mapping.refusals.is_empty(), "{:?}", mapping.refusals);
    let counted: Vec<(&str, &str, &str)> = mapping
        .plan
        .not_mapped
        .iter()
        .filter(|n| n.object.ends_with("(1)"))
        .map(|n| (n.object.as_str(), n.field.as_str(), n.value.as_str()))
        .collect();
    assert_eq!(
        counted,
        [
            ("allocations (1)", "futureAttributeField", "7"),
            ("blocks (1)", "futureBlockField", "\"x\""),
            ("cooling addresses (1)", "futureCoolingField", "[\"y\"]"),
        ]
    );
}

#[test]
fn an_allocation_whose_handle_blockipam_cannot_hold_refuses() {
    let long = "h".repeat(513);
    for handle in ["", "net.\u{1}bell", long.as_str()] {
        let block = CalicoBlockBuilder::new("10.0.10.0/26", Some("n"), 1).allocate(
            2,
            handle,
            &[("node", "n")],
            1,
        );
        let fixture = CalicoFixture::new()
            .pool("p", "10.0.10.0/24", 26, json!({}))
            .block(&block)
            .affinity("n", "10.0.10.0/26", "confirmed");
        assert_refused_once(
            &fixture,
            &[
                "block 10.0.10.0/26: 10.0.10.2 has handle_id",
                "blockipam needs a handle of 1 to 512 printable characters",
            ],
        );
    }
    let longest = "h".repeat(512);
    let block = CalicoBlockBuilder::new("10.0.10.0/26", Some("n"), 1).allocate(
        2,
        &longest,
        &[("node", "n")],
        1,
    );
    let mapping = mapped(
        &CalicoFixture::new()
            .pool("p", "10.0.10.0/24", 26, json!({}))
            .block(&block)
            .affinity("n", "10.0.10.0/26", "confirmed"),
    );
    assert!(mapping.refusals.is_empty(), "{:?}", mapping.refusals);
}

/// The largest attribute the allocator takes (handle and metadata, with the node, encoded) is
/// the largest the import takes: a block imported with a larger one would hold what blockipam
/// itself never writes.
#[test]
fn an_attribute_of_the_largest_size_is_imported_and_one_byte_more_refuses() {
    let padded = |padding: usize| {
        let metadata = BTreeMap::from([
            ("node".to_owned(), "n".to_owned()),
            ("pad".to_owned(), "a".repeat(padding)),
        ]);
        let size = encode(&Attribute {
            handle: "net.big".into(),
            metadata: metadata.clone(),
        })
        .expect("encode")
        .len();
        (metadata, size)
    };
    let at_limit = (0..MAX_ATTRIBUTE_BYTES)
        .find(|padding| padded(*padding).1 == MAX_ATTRIBUTE_BYTES)
        .expect("a padding giving an attribute of exactly the limit");
    let fixture = |padding: usize| {
        let (metadata, _) = padded(padding);
        let secondary: Vec<(&str, &str)> = metadata
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let block = CalicoBlockBuilder::new("10.0.11.0/26", Some("n"), 1)
            .allocate(0, "net.big", &secondary, 1);
        CalicoFixture::new()
            .pool("p", "10.0.11.0/24", 26, json!({}))
            .block(&block)
            .affinity("n", "10.0.11.0/26", "confirmed")
    };
    let mapping = mapped(&fixture(at_limit));
    assert!(mapping.refusals.is_empty(), "{:?}", mapping.refusals);
    assert_eq!(mapping.plan.blocks.len(), 1);

    assert_eq!(padded(at_limit + 1).1, MAX_ATTRIBUTE_BYTES + 1);
    assert_refused_once(
        &fixture(at_limit + 1),
        &[&format!(
            "the attributes of 10.0.11.0 take {} bytes, more than blockipam's {MAX_ATTRIBUTE_BYTES}",
            MAX_ATTRIBUTE_BYTES + 1
        )],
    );
}

#[test]
fn a_free_list_that_disagrees_with_the_allocations_is_corrected_and_reported() {
    let builder = CalicoBlockBuilder::new("10.0.12.0/26", Some("n"), 1).allocate(
        0,
        "net.z",
        &[("node", "n")],
        1,
    );
    let listed: Vec<u32> = (1..64).collect();
    let with_free_list = |unallocated: Vec<u32>| {
        let mut value = builder.to_json();
        value["unallocated"] = json!(unallocated);
        let mapping = mapped(&raw_block(
            CalicoFixture::new()
                .pool("p", "10.0.12.0/24", 26, json!({}))
                .affinity("n", "10.0.12.0/26", "confirmed"),
            "10.0.12.0/26",
            &value,
        ));
        assert!(mapping.refusals.is_empty(), "{:?}", mapping.refusals);
        let released: Vec<u32> = mapping.plan.blocks[0].released.iter().copied().collect();
        let reported: Vec<String> = reports(&mapping, "block 10.0.12.0/26")
            .iter()
            .filter(|n| n.field == "unallocated")
            .map(|n| n.value.clone())
            .collect();
        (released, reported)
    };

    let (released, reported) = with_free_list(listed.clone());
    assert_eq!(released, listed);
    assert!(reported.is_empty(), "{reported:?}");

    // Listed twice, or listed though allocated: dropped, nothing appended.
    let mut twice = listed.clone();
    twice.insert(10, 5);
    twice.insert(0, 0);
    let (released, reported) = with_free_list(twice);
    assert_eq!(released, listed);
    assert_eq!(reported, ["dropped [0, 5], appended []"]);

    // A free ordinal missing from the list: appended at its end, nothing dropped.
    let mut missing: Vec<u32> = listed.iter().copied().filter(|o| *o != 9).collect();
    let (released, reported) = with_free_list(missing.clone());
    missing.push(9);
    assert_eq!(released, missing);
    assert_eq!(reported, ["dropped [], appended [9]"]);
}

#[test]
fn handle_objects_are_compared_with_what_the_blocks_hold() {
    let block = CalicoBlockBuilder::new("10.0.13.0/26", Some("n"), 1)
        .allocate(0, "h-agrees", &[("node", "n")], 1)
        .allocate(1, "h-object-deleted", &[("node", "n")], 1)
        .allocate(2, "h-no-object", &[("node", "n")], 1)
        .allocate(3, "h-disagrees", &[("node", "n")], 1);
    let handle = |fixture: CalicoFixture, id: &str, count: u32, deleted: bool| {
        fixture.raw(
            &format!("/ipam/v2/handle/{id}"),
            &json!({"block": {"10.0.13.0/26": count}, "deleted": deleted}).to_string(),
        )
    };
    let mut fixture = CalicoFixture::new()
        .pool("p", "10.0.13.0/24", 26, json!({}))
        .block(&block)
        .affinity("n", "10.0.13.0/26", "confirmed");
    for (id, count, deleted) in [
        ("h-agrees", 1, false),
        ("h-object-deleted", 1, true),
        ("h-disagrees", 2, false),
        ("h-leaked", 2, false),
        ("h-gone", 3, true),
    ] {
        fixture = handle(fixture, id, count, deleted);
    }
    let mapping = mapped(&fixture);
    assert!(mapping.refusals.is_empty(), "{:?}", mapping.refusals);
    let reported: Vec<(&str, &str, &str)> = reports(&mapping, "handle ")
        .iter()
        .map(|n| (n.object.as_str(), n.field.as_str(), n.note.as_str()))
        .collect();
    let no_object = "Calico has no handle object for addresses the blocks hold: created from the \
                     blocks";
    assert_eq!(
        reported,
        [
            ("handle h-no-object", "", no_object),
            ("handle h-object-deleted", "", no_object),
            (
                "handle h-disagrees",
                "block",
                "Calico's handle object disagrees with the blocks: imported as the blocks say"
            ),
            (
                "handle h-leaked",
                "block",
                "the blocks hold no address for this handle (a leak in Calico): not imported"
            ),
        ],
        "an agreeing handle and a deleted handle object holding nothing are not reported"
    );
    assert_eq!(
        mapping.plan.handles.keys().collect::<Vec<_>>(),
        ["h-agrees", "h-disagrees", "h-no-object", "h-object-deleted"]
    );
}
