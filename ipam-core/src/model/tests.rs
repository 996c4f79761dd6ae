//! Unit tests of the stored objects, their encoding and their validation.

use crate::model::{decode, encode, keys, Attribute, Block, Lifetime, Pool};
use std::collections::BTreeMap;

use ipnet::IpNet;

use crate::model::error::IpamError;

fn attr(handle: &str) -> Attribute {
    Attribute {
        handle: handle.into(),
        metadata: BTreeMap::new(),
    }
}

fn net(s: &str) -> IpNet {
    s.parse().expect("cidr")
}

#[test]
fn fresh_ordinals_come_first_and_released_ones_are_reused_last() {
    let mut block = Block::new(net("10.0.0.0/30"), None, 0);
    let a = attr("a");
    assert_eq!(block.allocate_next(&a), Some(0));
    assert_eq!(block.allocate_next(&a), Some(1));
    block
        .release_ordinal(0, Lifetime::default())
        .expect("inline");
    assert_eq!(block.allocate_next(&a), Some(2));
    assert_eq!(block.allocate_next(&a), Some(3));
    assert_eq!(block.allocate_next(&a), Some(0));
    assert_eq!(block.allocate_next(&a), None);
    assert!(block.self_check().is_empty());
}

#[test]
fn specific_ordinal_is_skipped_by_the_fresh_cursor_and_queued_when_released() {
    let mut block = Block::new(net("10.0.0.0/29"), None, 0);
    let a = attr("a");
    assert!(block.allocate_ordinal(3, &a));
    assert!(!block.allocate_ordinal(3, &a));
    block
        .release_ordinal(3, Lifetime::default())
        .expect("inline");
    let order: Vec<u32> = std::iter::from_fn(|| block.allocate_next(&a)).collect();
    assert_eq!(order, vec![0, 1, 2, 4, 5, 6, 7, 3]);
    assert!(block.self_check().is_empty());
}

#[test]
fn host_address_allocation_skips_block_edges_and_keeps_them_free() {
    let mut block = Block::new(net("10.0.0.8/29"), None, 0);
    let a = attr("a");
    let order: Vec<u32> = std::iter::from_fn(|| block.allocate_next_host_address(&a)).collect();
    assert_eq!(order, vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(block.free(), 2);
    // The edges are still free for callers that may use them, in free-list order.
    assert_eq!(block.allocate_next(&a), Some(0));
    assert_eq!(block.allocate_next(&a), Some(7));
    assert!(block.self_check().is_empty());
    // /31 and /32 blocks (and /127, /128) have no edges.
    let mut small = Block::new(net("10.0.0.0/31"), None, 0);
    assert_eq!(small.allocate_next_host_address(&a), Some(0));
    assert_eq!(small.allocate_next_host_address(&a), Some(1));
    let v6 = Block::new(net("fd00::/126"), None, 0);
    assert!(v6.is_edge(0) && v6.is_edge(3) && !v6.is_edge(1));
}

#[test]
fn unused_attributes_are_dropped_and_indices_stay_valid() {
    let mut block = Block::new(net("10.0.0.0/29"), None, 0);
    block.allocate_next(&attr("a"));
    block.allocate_next(&attr("b"));
    block.allocate_next(&attr("a"));
    assert_eq!(block.attributes.len(), 2);
    block
        .release_ordinal(0, Lifetime::default())
        .expect("inline");
    block
        .release_ordinal(2, Lifetime::default())
        .expect("inline");
    assert_eq!(block.attributes.len(), 1);
    assert_eq!(
        block
            .attribute_of(1)
            .expect("inline")
            .map(|a| a.handle.as_str()),
        Some("b")
    );
    assert!(block.self_check().is_empty());
}

#[test]
fn large_block_encoding_is_small_when_mostly_free() {
    let mut block = Block::new(net("10.0.0.0/23"), Some("host-a".into()), 0);
    for i in 0..10 {
        block.allocate_next(&attr(&format!("h{i}")));
    }
    let bytes = encode(&block).expect("encode");
    assert!(
        bytes.len() < 1024,
        "a /23 block with 10 allocations took {} bytes",
        bytes.len()
    );
    let back: Block = decode("k", &bytes).expect("decode");
    assert_eq!(back, block);
}

#[test]
fn decoding_damaged_bytes_is_an_error_not_a_panic() {
    let block = Block::new(net("fd00::/122"), Some("h".into()), 0);
    let bytes = encode(&block).expect("encode");
    for cut in 0..bytes.len() {
        assert!(
            decode::<Block>("k", &bytes[..cut]).is_err(),
            "truncated at {cut} decoded"
        );
    }
    let mut wrong_version = bytes.clone();
    wrong_version[0] = 99;
    assert!(matches!(
        decode::<Block>("k", &wrong_version),
        Err(IpamError::Corrupt { .. })
    ));
    let mut trailing = bytes;
    trailing.push(0);
    assert!(decode::<Block>("k", &trailing).is_err());
}

#[test]
fn cidr_segments_round_trip_for_both_families() {
    for s in ["10.0.0.0/26", "fd00::/122", "0.0.0.0/0", "2001:db8::40/122"] {
        let n = net(s);
        assert_eq!(keys::parse_cidr_segment(&keys::cidr_segment(&n)), Some(n));
    }
}

#[test]
fn pool_block_arithmetic() {
    let pool = Pool {
        name: "p".into(),
        cidr: net("10.1.0.0/24"),
        block_size: 26,
        disabled: false,
        ..Pool::default()
    };
    assert_eq!(pool.block_count(), 4);
    assert_eq!(pool.block_at(3), Some(net("10.1.0.192/26")));
    assert_eq!(
        pool.block_containing("10.1.0.77".parse().expect("ip")),
        Some(net("10.1.0.64/26"))
    );
    assert_eq!(pool.block_containing("10.2.0.1".parse().expect("ip")), None);
    let v6 = Pool {
        name: "p6".into(),
        cidr: net("fd00::/64"),
        block_size: 122,
        disabled: false,
        ..Pool::default()
    };
    assert_eq!(v6.block_count(), 1u128 << 58);
    assert_eq!(v6.block_at(1), Some(net("fd00::40/122")));
    for index in [0, 1, 3] {
        let block = pool.block_at(index).expect("a block");
        assert_eq!(pool.block_index_of(&block), Some(index));
    }
    assert_eq!(v6.block_index_of(&net("fd00::40/122")), Some(1));
    assert_eq!(
        v6.block_index_of(&net("fd00::ffff:ffff:ffff:ffc0/122")),
        Some((1u128 << 58) - 1)
    );
    for not_one_of_its_blocks in [
        "10.1.0.64/27", // another size
        "10.1.0.96/26", // not aligned (as written: IpNet keeps host bits)
        "10.1.1.0/26",  // outside
        "fd00::40/122", // another family
    ] {
        assert_eq!(
            pool.block_index_of(&net(not_one_of_its_blocks)),
            None,
            "{not_one_of_its_blocks}"
        );
    }
}

#[test]
fn downgraded_to_format_3_a_block_keeps_every_address_and_reads_back() {
    use crate::model::formats::downgrade;
    let mut block = Block::new(net("10.0.0.0/29"), Some("node-a".into()), 7);
    let cooling = Lifetime {
        now: 1_000,
        cooldown_seconds: 60,
    };
    for handle in ["a", "b", "c"] {
        block.allocate_next(&attr(handle)).expect("room");
    }
    block
        .release_ordinal(1, cooling)
        .expect("inline")
        .expect("held");
    block.claimed_at = Some(900);
    assert_eq!(block.cooling.len(), 1, "ordinal 1 cools");
    let key = keys::block_key_in(&block, crate::model::FORMAT_VERSION);
    let written = downgrade(&key, encode(&block).expect("encode"), 3).expect("downgrade");
    assert_eq!(written[0], 3);
    let read: Block = decode(&key, &written).expect("format 3 reads back");
    assert_eq!(read.allocations, block.allocations);
    assert_eq!(read.sequence, block.sequence);
    assert_eq!(read.next_fresh, block.next_fresh);
    assert!(read.cooling.is_empty());
    assert_eq!(read.claimed_at, None, "format 3 has no claim time");
    assert!(
        read.released.contains(&1),
        "the cooling address is free, not lost: {:?}",
        read.released
    );
    assert_eq!(read.free(), block.free());
    // The claim entry too.
    let claim_key = keys::block_claim(&block.cidr);
    let claim = downgrade(
        &claim_key,
        crate::model::encode_claim(&block).expect("claim"),
        3,
    )
    .expect("downgrade");
    assert_eq!(claim[0], 3);
    let entry = crate::model::decode_claim(&claim_key, &claim).expect("reads back");
    assert_eq!(entry.affinity.as_deref(), Some("node-a"));
    assert_eq!(entry.free, Some(block.free()));
    // At the current format, and for values that are not versioned objects, nothing changes; at
    // format 4, laid out as today, only the version byte does.
    let current = encode(&block).expect("encode");
    assert_eq!(
        downgrade(&key, current.clone(), crate::model::FORMAT_VERSION).expect("same"),
        current
    );
    let in_4 = downgrade(&key, current.clone(), 4).expect("format 4");
    assert_eq!((in_4[0], &in_4[1..]), (4, &current[1..]));
    let read: Block = decode(&key, &in_4).expect("format 4 reads back");
    assert_eq!(read, block);
    let json = br#"{"node":"node-a","plugin_version":"0.2.0"}"#.to_vec();
    assert_eq!(
        downgrade(&keys::activity_key("node-a"), json.clone(), 3).expect("same"),
        json
    );
}

#[test]
fn downgraded_to_format_3_a_config_with_a_cooldown_is_refused() {
    use crate::model::formats::downgrade;
    use crate::model::IpamConfig;
    let plain = IpamConfig {
        max_blocks_per_host: 30,
        ..IpamConfig::default()
    };
    let written =
        downgrade(&keys::config(), encode(&plain).expect("encode"), 3).expect("downgrade");
    assert_eq!(written[0], 3);
    let read: IpamConfig = decode(&keys::config(), &written).expect("reads back");
    assert_eq!(read, plain);
    for config in [
        IpamConfig {
            ip_cooldown_seconds: 30,
            ..IpamConfig::default()
        },
        IpamConfig {
            empty_block_reclaim_seconds: 600,
            ..IpamConfig::default()
        },
    ] {
        let refused = downgrade(&keys::config(), encode(&config).expect("encode"), 3)
            .expect_err("format 3 cannot hold it");
        assert!(
            matches!(
                refused,
                IpamError::FormatNotFinalized {
                    needs: 4,
                    writes: 3,
                    ..
                }
            ),
            "{refused:?}"
        );
    }
    assert!(matches!(
        downgrade(&keys::config(), encode(&plain).expect("encode"), 2),
        Err(IpamError::Internal(_))
    ));
    // Format 4 holds both settings: written there, they read back.
    let cooling = IpamConfig {
        ip_cooldown_seconds: 30,
        empty_block_reclaim_seconds: 600,
        ..IpamConfig::default()
    };
    let in_4 = downgrade(&keys::config(), encode(&cooling).expect("encode"), 4).expect("format 4");
    assert_eq!(in_4[0], 4);
    let read: IpamConfig = decode(&keys::config(), &in_4).expect("format 4 reads back");
    assert_eq!(read, cooling);
}

#[test]
fn a_block_key_tells_its_affinity_and_other_keys_tell_nothing() {
    let cidr = net("10.0.0.0/26");
    assert_eq!(
        keys::affinity_of_block_key(&keys::block(Some("node-a"), &cidr)),
        Some(Some("node-a"))
    );
    assert_eq!(
        keys::affinity_of_block_key(&keys::full_block("node-a", &cidr)),
        Some(Some("node-a"))
    );
    assert_eq!(
        keys::affinity_of_block_key(&keys::block(None, &cidr)),
        Some(None)
    );
    for other in [
        keys::block_claim(&cidr),
        keys::borrowed_key("node-a", &cidr),
        keys::affine_blocks_dir(),
        format!("{}unaffine/", keys::blocks_dir()),
    ] {
        assert_eq!(keys::affinity_of_block_key(&other), None, "{other}");
    }
}

#[test]
fn a_block_has_only_its_edges_free_when_both_are_free_and_nothing_else() {
    let a = attr("a");
    let mut block = Block::new(net("10.0.0.8/29"), Some("node-a".into()), 0);
    assert!(!block.only_its_edges_free(), "an empty block");
    while block.allocate_next_host_address(&a).is_some() {}
    assert!(
        block.only_its_edges_free(),
        "filled by a request that skips edges"
    );
    // One edge taken: the other is still room for requests that take edges.
    assert_eq!(block.allocate_next(&a), Some(0));
    assert!(!block.only_its_edges_free());
    assert_eq!(block.allocate_next(&a), Some(7));
    assert!(!block.only_its_edges_free(), "a full block");
    // A host address released (even while cooling) is room again.
    block
        .release_ordinal(0, Lifetime::default())
        .expect("inline");
    block
        .release_ordinal(7, Lifetime::default())
        .expect("inline");
    assert!(block.only_its_edges_free());
    let cooling = Lifetime {
        now: 1_000,
        cooldown_seconds: 30,
    };
    block
        .release_ordinal(3, cooling)
        .expect("inline")
        .expect("held");
    assert!(!block.only_its_edges_free(), "a cooling host address");
    // Blocks without edges (/31, /32) never are such blocks.
    let mut small = Block::new(net("10.0.0.0/31"), Some("node-a".into()), 0);
    assert!(!small.only_its_edges_free());
    small.allocate_next_host_address(&a);
    small.allocate_next_host_address(&a);
    assert!(!small.only_its_edges_free());
}

#[test]
fn a_block_with_only_its_edges_free_is_stored_as_full_from_format_5_on() {
    let a = attr("a");
    let cidr = net("10.0.0.8/29");
    let mut block = Block::new(cidr, Some("node-a".into()), 0);
    while block.allocate_next_host_address(&a).is_some() {}
    let open = keys::block(Some("node-a"), &cidr);
    let full = keys::full_block("node-a", &cidr);
    assert_eq!(keys::block_key_in(&block, 4), open);
    assert_eq!(keys::block_key_in(&block, 5), full);
    assert!(keys::is_block_key_of(&open, &block) && keys::is_block_key_of(&full, &block));
    // A block with room, or truly full, has one place whatever the format.
    block.allocate_next(&a);
    for format in [4, 5] {
        assert_eq!(keys::block_key_in(&block, format), open);
    }
    assert!(!keys::is_block_key_of(&full, &block));
    block.allocate_next(&a);
    for format in [4, 5] {
        assert_eq!(keys::block_key_in(&block, format), full);
    }
    assert!(!keys::is_block_key_of(&open, &block));
    // A block nobody owns lives under unaffine/.
    let mut unowned = Block::new(cidr, None, 0);
    while unowned.allocate_next_host_address(&a).is_some() {}
    assert_eq!(keys::block_key_in(&unowned, 5), keys::block(None, &cidr));
}

/// What the plugin records with an address: a 64-hex container id, pod, namespace, interface,
/// timestamp and node (about 300 bytes encoded).
fn plugin_attribute(n: u32) -> Attribute {
    let container = format!("{n:064x}");
    let metadata = [
        ("container_id", container.clone()),
        ("interface", "eth0".to_owned()),
        ("namespace", "team-042".to_owned()),
        ("node", "worker-0017.cluster.example".to_owned()),
        ("pod", format!("frontend-7d9f8b6c5-{n:06}")),
        ("timestamp", "2026-11-25T14:00:00Z".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    Attribute {
        handle: format!("k8s-pod-network.{container}"),
        metadata,
    }
}

/// The block as a reader gets it from its stored value: nothing learned about apart attributes.
fn as_read(block: &Block) -> Block {
    decode("ipam/v1/blocks/unaffine/x", &encode(block).expect("encode")).expect("decode")
}

#[test]
fn moved_apart_a_near_full_23_block_is_stored_in_a_size_bounded_by_its_addresses() {
    let mut block = Block::new(net("10.0.0.0/23"), Some("worker".into()), 0);
    for n in 0..510 {
        block.allocate_next(&plugin_attribute(n)).expect("room");
    }
    let inline = encode(&block).expect("encode").len();
    let moved = block.move_taken_apart();
    assert_eq!(moved.len(), 510);
    assert_eq!(moved[7], (7, plugin_attribute(7)));
    assert!(block.attributes.is_empty(), "the table keeps nothing apart");
    let apart = encode(&block).expect("encode").len();
    // Every allocation keeps its ordinal and sequence number only: about 7 bytes each.
    assert!(
        apart < 510 * 8 + 100,
        "{apart} bytes apart, {inline} inline"
    );
    assert!(inline > 20 * apart, "{apart} bytes apart, {inline} inline");
    // Its attributes are still known in memory, and read back as apart.
    assert_eq!(
        block.attribute_of(9).expect("known"),
        Some(&plugin_attribute(9))
    );
    let read = as_read(&block);
    assert_eq!(read, block);
    assert!(read
        .allocations
        .values()
        .all(|a| a.attribute == crate::model::APART));
    assert_eq!(read.unloaded_apart().len(), 510);
    assert!(read.self_check().is_empty(), "{:?}", read.self_check());
}

#[test]
fn an_apart_attribute_not_read_refuses_lookups_and_release_and_leaves_the_block_unchanged() {
    let mut block = Block::new(net("10.0.0.0/29"), None, 0);
    block.allocate_next(&attr("a")).expect("room");
    block.allocate_next(&attr("b")).expect("room");
    block.move_taken_apart();
    let mut read = as_read(&block);
    let before = read.clone();
    let not_loaded = |ordinal| IpamError::AttributeNotLoaded {
        block: net("10.0.0.0/29"),
        ordinal,
    };
    assert_eq!(read.attribute_of(1), Err(not_loaded(1)));
    assert_eq!(read.ordinals_of_handle("a"), Err(not_loaded(0)));
    assert_eq!(
        read.release_ordinal(1, Lifetime::default()),
        Err(not_loaded(1))
    );
    assert_eq!(read, before);
    assert_eq!(read.freed_apart().count(), 0);
    // Nothing allocated is still a plain answer.
    assert_eq!(read.attribute_of(5), Ok(None));
    assert_eq!(read.release_ordinal(5, Lifetime::default()), Ok(None));
}

#[test]
fn apart_attributes_loaded_from_owner_keys_or_learned_from_a_handle_answer_as_inline_ones() {
    let mut block = Block::new(net("10.0.0.0/29"), None, 0);
    for handle in ["a", "b", "c"] {
        block.allocate_next(&attr(handle)).expect("room");
    }
    block.move_taken_apart();
    // One inline allocation beside them (written before the store kept attributes apart).
    block.allocate_next(&attr("b")).expect("room");
    let mut read = as_read(&block);

    assert!(read.load_apart(0, attr("a")));
    assert_eq!(read.attribute_of(0), Ok(Some(&attr("a"))));
    // Ordinal 1 (b's) and 2 (c's) are unknown: whose they are cannot be answered for b.
    assert!(read.ordinals_of_handle("b").is_err());

    let held: BTreeMap<u32, BTreeMap<String, String>> = [(1, BTreeMap::new())].into();
    assert_eq!(read.learn_apart_of_handle("b", &held), Vec::<u32>::new());
    // b's own record names all of its apart ordinals; ordinal 3 is inline.
    assert_eq!(read.ordinals_of_handle("b"), Ok(vec![1, 3]));
    assert_eq!(read.attribute_of(1), Ok(Some(&attr("b"))));
    // c is still unknown, so is anything asked about it.
    assert!(read.ordinals_of_handle("c").is_err());
    assert!(read.ordinals_of_handle("d").is_err());

    // A key or a record naming an ordinal the block does not hold apart is not believed.
    assert!(!read.load_apart(3, attr("x")), "ordinal 3 is inline");
    assert!(!read.load_apart(6, attr("x")), "ordinal 6 is free");
    let stale: BTreeMap<u32, BTreeMap<String, String>> = [(6, BTreeMap::new())].into();
    assert_eq!(read.learn_apart_of_handle("d", &stale), vec![6]);
    assert_eq!(read.attribute_of(6), Ok(None));
    assert_eq!(read.attribute_of(3), Ok(Some(&attr("b"))));
    assert_eq!(read.unloaded_apart(), vec![2]);
}

#[test]
fn a_released_apart_allocation_frees_its_owner_key_and_a_retaken_ordinal_moves_apart_again() {
    let mut block = Block::new(net("10.0.0.0/29"), None, 0);
    block.allocate_next(&attr("a")).expect("room");
    block.allocate_next(&attr("b")).expect("room");
    block.move_taken_apart();
    let mut read = as_read(&block);
    read.load_apart(1, attr("b"));
    assert_eq!(
        read.release_ordinal(1, Lifetime::default()),
        Ok(Some(attr("b")))
    );
    assert_eq!(read.freed_apart().collect::<Vec<_>>(), vec![1]);
    assert!(!read.allocations.contains_key(&1));
    // Nothing was taken since the read: nothing to move.
    assert!(read.move_taken_apart().is_empty());

    assert!(read.allocate_ordinal(1, &attr("c")));
    assert_eq!(read.attribute_of(1), Ok(Some(&attr("c"))));
    assert_eq!(read.attributes, vec![attr("c")], "inline until written");
    assert_eq!(read.move_taken_apart(), vec![(1, attr("c"))]);
    assert!(read.attributes.is_empty());
    // A release of what this attempt took is not an owner key to delete (it was never written).
    let mut fresh = Block::new(net("10.0.0.0/29"), None, 0);
    fresh.allocate_next(&attr("a")).expect("room");
    fresh
        .release_ordinal(0, Lifetime::default())
        .expect("inline");
    assert_eq!(fresh.freed_apart().count(), 0);
    assert!(fresh.move_taken_apart().is_empty());
}

#[test]
fn a_block_equals_its_stored_self_whatever_was_learned_about_its_apart_attributes() {
    let mut block = Block::new(net("10.0.0.0/29"), None, 0);
    block.allocate_next(&attr("a")).expect("room");
    block.move_taken_apart();
    let mut read = as_read(&block);
    let bare = read.clone();
    read.load_apart(0, attr("a"));
    assert_eq!(read, bare);
    read.next_fresh += 1;
    assert_ne!(read, bare);
}

#[test]
fn a_dangling_inline_attribute_index_is_still_a_self_check_problem_and_apart_ones_are_not() {
    let mut block = Block::new(net("10.0.0.0/29"), None, 0);
    block.allocate_next(&attr("a")).expect("room");
    block.allocate_next(&attr("b")).expect("room");
    block.move_taken_apart();
    assert!(block.self_check().is_empty());
    block.allocations.get_mut(&1).expect("held").attribute = 3;
    assert_eq!(
        block.self_check(),
        vec!["ordinal 1 refers to missing attribute 3".to_owned()]
    );
}

#[test]
fn owner_keys_have_one_spelling_and_name_their_block_and_ordinal() {
    let cidr = net("10.0.2.0/23");
    let key = keys::owner_key(&cidr, 300);
    assert_eq!(key, "ipam/v1/owners/10.0.2.0-23/300");
    assert!(key.starts_with(&keys::block_owners_dir(&cidr)));
    assert!(key.starts_with(&keys::owners_dir()));
    assert_eq!(keys::parse_owner_key(&key), Some((cidr, 300)));
    let v6 = net("fd00::/122");
    assert_eq!(
        keys::parse_owner_key(&keys::owner_key(&v6, 0)),
        Some((v6, 0))
    );
    for other in [
        "ipam/v1/owners/10.0.2.0-23/0300",
        "ipam/v1/owners/10.0.2.0-23/+300",
        "ipam/v1/owners/10.0.2.0-23/4294967296",
        "ipam/v1/owners/10.0.2.0-23/",
        "ipam/v1/owners/10.0.2.0-23/300/1",
        "ipam/v1/owners/10.0.2.1-23/300",
        "ipam/v1/owners/10.0.2.0/300",
        "ipam/v1/handles/10.0.2.0-23/300",
        "ipam/v2/owners/10.0.2.0-23/300",
    ] {
        assert_eq!(keys::parse_owner_key(other), None, "{other}");
    }
}

/// The damage `blockipamctl check` reports in a block's own bookkeeping: an allocation newer than
/// its block, and cooling addresses outside the block, listed twice, or also free.
#[test]
fn a_blocks_self_check_names_bad_sequences_and_bad_cooling_addresses() {
    use crate::model::block::CoolingAddress;
    let mut block = Block::new(net("10.0.0.0/29"), None, 0);
    block.allocate_next(&attr("a")).expect("room");
    block.allocate_next(&attr("b")).expect("room");
    assert!(block.self_check().is_empty());
    let sequence = block.sequence;
    block.allocations.get_mut(&0).expect("held").sequence = sequence;
    assert!(block.self_check().is_empty(), "{:?}", block.self_check());
    block.allocations.get_mut(&0).expect("held").sequence = sequence + 1;
    assert_eq!(
        block.self_check(),
        vec![format!(
            "ordinal 0 was allocated at sequence {} after the block's {sequence}",
            sequence + 1
        )]
    );
    block.allocations.get_mut(&0).expect("held").sequence = sequence;

    let cooling = |ordinal| CoolingAddress {
        ordinal,
        released_at: 100,
    };
    block.cooling.push_back(cooling(5));
    assert!(block.self_check().is_empty(), "{:?}", block.self_check());
    block.cooling.push_back(cooling(8));
    block.cooling.push_back(cooling(5));
    block.released.push_back(6);
    block.cooling.push_back(cooling(6));
    assert_eq!(
        block.self_check(),
        vec![
            "cooling ordinal 8 is outside the block".to_owned(),
            "ordinal 5 is cooling twice, or both cooling and free".to_owned(),
            "ordinal 6 is cooling twice, or both cooling and free".to_owned(),
        ]
    );
}
