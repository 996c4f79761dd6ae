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
    block.release_ordinal(0, Lifetime::default());
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
    block.release_ordinal(3, Lifetime::default());
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
    block.release_ordinal(0, Lifetime::default());
    block.release_ordinal(2, Lifetime::default());
    assert_eq!(block.attributes.len(), 1);
    assert_eq!(block.attribute_of(1).map(|a| a.handle.as_str()), Some("b"));
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
    block.release_ordinal(1, cooling).expect("held");
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
    block.release_ordinal(0, Lifetime::default());
    block.release_ordinal(7, Lifetime::default());
    assert!(block.only_its_edges_free());
    let cooling = Lifetime {
        now: 1_000,
        cooldown_seconds: 30,
    };
    block.release_ordinal(3, cooling).expect("held");
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
