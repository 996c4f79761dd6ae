//! IP reservation cases (Calico's `IPReservation`): stored objects, auto-assign skipping reserved
//! addresses and wholly reserved blocks, explicit addresses and usage figures, on every backend.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipam_core::reservations::{reservation_key, reservations_dir, Reservation};
use ipam_core::{AssignIpsRequest, Ipam, IpamConfig, IpamError};
use ipnet::IpNet;

use crate::ipam::{
    assert_clean, assert_reported_corrupt, assign_one, holder, ip, ipam_with_pool, net, v4,
};
use crate::StoreFactory;

/// Expands every reservation case into one `#[tokio::test]` inside a module `reservations`.
#[macro_export]
macro_rules! reservations_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(reservations, $crate::reservations, $factory;
            reservations_are_added_listed_and_deleted,
            invalid_or_clashing_reservations_are_refused_and_write_nothing,
            auto_assign_skips_reserved_addresses,
            wholly_reserved_blocks_are_skipped_without_claiming_them,
            every_block_reserved_is_exhausted_with_no_block_claimed,
            a_reserved_affine_block_sends_the_host_to_a_new_block,
            borrowing_skips_a_wholly_reserved_lender,
            explicit_assign_of_a_reserved_address_succeeds,
            allocations_on_reserved_addresses_are_left_alone_and_counted,
            corrupt_reservation_is_reported_by_check_and_stops_auto_assign,
        );
    };
}

fn reservation(name: &str, cidrs: &[&str]) -> Reservation {
    Reservation {
        name: name.to_owned(),
        cidrs: cidrs.iter().map(|c| net(c)).collect(),
    }
}

async fn reserve(ipam: &Ipam, name: &str, cidrs: &[&str]) {
    ipam.add_reservation(&reservation(name, cidrs))
        .await
        .unwrap_or_else(|e| panic!("reserve {name} {cidrs:?}: {e}"));
}

/// Every block of every pool.
pub(crate) async fn blocks(ipam: &Ipam) -> BTreeSet<IpNet> {
    ipam.utilization()
        .await
        .expect("usage")
        .pools
        .iter()
        .flat_map(|p| p.blocks.iter().map(|b| b.cidr))
        .collect()
}

/// Add stores the object under `ipam/v1/ipreservations/<name>`, list returns every one sorted by
/// name, delete removes it and returns what it held; deleting it again is a clear error.
pub async fn reservations_are_added_listed_and_deleted<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    reserve(&ipam, "vips", &["10.0.0.5/32", "fd00::/120"]).await;
    reserve(&ipam, "gateways", &["10.0.0.1/32"]).await;
    assert!(t
        .store
        .get(&reservation_key("vips"))
        .await
        .expect("get")
        .is_some());
    let listed = ipam.list_reservations().await.expect("list");
    assert_eq!(
        listed,
        vec![
            reservation("gateways", &["10.0.0.1/32"]),
            reservation("vips", &["10.0.0.5/32", "fd00::/120"]),
        ]
    );
    let deleted = ipam.delete_reservation("vips").await.expect("delete");
    assert_eq!(deleted, reservation("vips", &["10.0.0.5/32", "fd00::/120"]));
    assert_eq!(
        ipam.list_reservations().await.expect("list"),
        vec![reservation("gateways", &["10.0.0.1/32"])]
    );
    match ipam.delete_reservation("vips").await {
        Err(IpamError::ReservationNotFound(name)) => assert_eq!(name, "vips"),
        other => panic!("deleting a missing reservation must fail clearly, got {other:?}"),
    }
    assert_clean(&ipam).await;
}

/// A taken name, a CIDR with host bits, an empty list, a duplicate and a bad name are refused;
/// none of them writes anything.
pub async fn invalid_or_clashing_reservations_are_refused_and_write_nothing<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    reserve(&ipam, "r1", &["10.0.0.8/29"]).await;
    match ipam
        .add_reservation(&reservation("r1", &["10.0.0.64/26"]))
        .await
    {
        Err(IpamError::ReservationExists(name)) => assert_eq!(name, "r1"),
        other => panic!("a taken name must be refused, got {other:?}"),
    }
    let host_bits = Reservation {
        name: "r2".into(),
        cidrs: vec![net("10.0.0.5/24")],
    };
    let empty = Reservation {
        name: "r3".into(),
        cidrs: Vec::new(),
    };
    let twice = reservation("r4", &["10.0.0.1/32", "10.0.0.1/32"]);
    let bad_name = reservation("no/slash", &["10.0.0.1/32"]);
    for refused in [host_bits, empty, twice, bad_name] {
        match ipam.add_reservation(&refused).await {
            Err(IpamError::InvalidArgument(_)) => {}
            other => panic!("{refused:?} must be refused, got {other:?}"),
        }
    }
    let stored = t.store.list(&reservations_dir()).await.expect("list");
    assert_eq!(stored.len(), 1, "only r1 is stored: {stored:?}");
    assert_eq!(
        ipam.list_reservations().await.expect("list"),
        vec![reservation("r1", &["10.0.0.8/29"])]
    );
}

/// Reserved addresses inside the host's block are passed over in free-list order; once the
/// reservation is deleted they are handed out again.
pub async fn auto_assign_skips_reserved_addresses<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/26", 26).await;
    reserve(&ipam, "low", &["10.0.0.0/30"]).await;
    reserve(&ipam, "one", &["10.0.0.5/32"]).await;
    let got = ipam
        .auto_assign(&v4("h1", "node-a", 3))
        .await
        .expect("assign");
    let ips: Vec<IpAddr> = got.v4.iter().map(|a| a.ip).collect();
    assert_eq!(ips, vec![ip("10.0.0.4"), ip("10.0.0.6"), ip("10.0.0.7")]);
    ipam.delete_reservation("low").await.expect("delete");
    assert_eq!(assign_one(&ipam, "h2", "node-a").await, ip("10.0.0.0"));
    assert_clean(&ipam).await;
}

/// Blocks that reservations cover entirely are passed over by the new-block search: the host
/// claims exactly one block, the only one with an unreserved address.
pub async fn wholly_reserved_blocks_are_skipped_without_claiming_them<F: StoreFactory>(
    factory: &F,
) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    reserve(&ipam, "most", &["10.0.0.0/25", "10.0.0.128/26"]).await;
    for host in ["node-a", "node-b", "node-c"] {
        let got = assign_one(&ipam, &format!("h-{host}"), host).await;
        assert!(
            net("10.0.0.192/26").contains(&got),
            "{host} got {got}, inside a reserved block"
        );
    }
    assert_eq!(
        blocks(&ipam).await,
        BTreeSet::from([net("10.0.0.192/26")]),
        "no reserved block may be claimed"
    );
    assert_clean(&ipam).await;
}

/// With every block reserved, auto-assign answers "exhausted" at once and claims no block, even
/// with no per-host block limit (it does not claim block after block looking for room).
pub async fn every_block_reserved_is_exhausted_with_no_block_claimed<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.set_config(&IpamConfig {
        max_blocks_per_host: 0,
        ..IpamConfig::default()
    })
    .await
    .expect("config");
    reserve(&ipam, "all", &["10.0.0.0/24"]).await;
    match ipam.auto_assign(&v4("h1", "node-a", 1)).await {
        Err(IpamError::Exhausted { found: 0, .. }) => {}
        other => panic!("a wholly reserved pool must be exhausted, got {other:?}"),
    }
    assert!(blocks(&ipam).await.is_empty(), "no block may be claimed");
    assert_clean(&ipam).await;
}

/// A host whose own block becomes wholly reserved (its allocations staying) claims a new block
/// rather than handing out a reserved address.
pub async fn a_reserved_affine_block_sends_the_host_to_a_new_block<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let first = assign_one(&ipam, "h1", "node-a").await;
    let first_block = *blocks(&ipam).await.iter().next().expect("one block");
    reserve(&ipam, "that-block", &[&first_block.to_string()]).await;
    let second = assign_one(&ipam, "h2", "node-a").await;
    assert!(
        !first_block.contains(&second),
        "{second} came from the reserved block {first_block}"
    );
    assert_eq!(blocks(&ipam).await.len(), 2);
    let held = ipam.ips_by_handle("h1").await.expect("by handle");
    assert_eq!(held.iter().map(|a| a.ip).collect::<Vec<_>>(), vec![first]);
    assert_clean(&ipam).await;
}

/// Borrowing never takes an address from a block reservations cover entirely.
pub async fn borrowing_skips_a_wholly_reserved_lender<F: StoreFactory>(factory: &F) {
    // Two /26 blocks: node-a holds one, node-b the other, then the host limit stops new blocks.
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/25", 26).await;
    ipam.set_config(&IpamConfig {
        max_blocks_per_host: 1,
        ..IpamConfig::default()
    })
    .await
    .expect("config");
    let a = assign_one(&ipam, "ha", "node-a").await;
    let b = assign_one(&ipam, "hb", "node-b").await;
    let usage = ipam.utilization().await.expect("usage");
    let block_of = |ip: IpAddr| {
        usage.pools[0]
            .blocks
            .iter()
            .find(|blk| blk.cidr.contains(&ip))
            .map(|blk| blk.cidr)
            .expect("block of an address")
    };
    let (block_a, block_b) = (block_of(a), block_of(b));
    reserve(&ipam, "b-block", &[&block_b.to_string()]).await;
    // node-c may own no block (limit 1, but none left to claim): it borrows, from node-a only.
    for n in 0..3 {
        let got = assign_one(&ipam, &format!("hc{n}"), "node-c").await;
        assert!(
            block_a.contains(&got),
            "{got} borrowed from reserved {block_b}"
        );
    }
    assert_clean(&ipam).await;
}

/// An explicitly requested address is assigned even when reserved (as Calico: reservations keep
/// addresses from auto-assign only).
pub async fn explicit_assign_of_a_reserved_address_succeeds<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    reserve(&ipam, "vip", &["10.0.0.10/32"]).await;
    let got = ipam
        .assign_ips(&AssignIpsRequest {
            ips: vec![ip("10.0.0.10")],
            handle: "explicit".into(),
            host: "node-a".into(),
            ..Default::default()
        })
        .await
        .expect("explicit assign of a reserved address");
    assert_eq!(got[0].ip, ip("10.0.0.10"));
    let holder = ipam
        .get_assignment(ip("10.0.0.10"))
        .await
        .expect("who")
        .expect("allocated");
    assert_eq!(holder.handle, "explicit");
    assert_clean(&ipam).await;
}

/// Reserving an allocated address leaves the allocation alone (released normally later); usage
/// counts reserved addresses once, and free leaves out reserved addresses not allocated.
pub async fn allocations_on_reserved_addresses_are_left_alone_and_counted<F: StoreFactory>(
    factory: &F,
) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let held = ipam
        .auto_assign(&v4("h1", "node-a", 2))
        .await
        .expect("assign");
    let block = held.v4[0].block;
    let first = held.v4[0].ip;
    // The first allocated address, four more of the same block, and 8 addresses outside it.
    let start = block.network();
    let IpAddr::V4(base) = start else {
        panic!("IPv4 block expected")
    };
    let o = base.octets();
    let in_block = format!("{}.{}.{}.{}/30", o[0], o[1], o[2], o[3] + 4);
    let outside = if block == net("10.0.0.0/26") {
        "10.0.0.64/29"
    } else {
        "10.0.0.0/29"
    };
    reserve(
        &ipam,
        "mixed",
        &[&IpNet::from(first).to_string(), &in_block, outside],
    )
    .await;
    let usage = ipam.utilization().await.expect("usage");
    let pool = &usage.pools[0];
    assert_eq!(pool.reserved, 13);
    assert_eq!(pool.in_use, 2);
    // 256 addresses, 2 allocated (one of them reserved), 12 reserved and not allocated.
    assert_eq!(pool.free, 256 - 2 - 12);
    let row = pool
        .blocks
        .iter()
        .find(|b| b.cidr == block)
        .expect("block row");
    assert_eq!((row.reserved, row.in_use, row.free), (5, 2, 64 - 2 - 4));
    assert_eq!(
        holder(&ipam, first).await,
        Some("h1".to_owned()),
        "a reservation never takes an allocated address away"
    );
    assert_eq!(ipam.release_handle("h1").await.expect("release").len(), 2);
    let usage = ipam.utilization().await.expect("usage");
    assert_eq!(usage.pools[0].free, 256 - 13);
    assert_clean(&ipam).await;
}

/// A reservation that does not decode is reported by `check` naming its key and the way out, the
/// listing of each reservation shows it beside the others, and auto-assign refuses to guess (a
/// corrupt-object error) rather than hand out what it might reserve.
pub async fn corrupt_reservation_is_reported_by_check_and_stops_auto_assign<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let kept = Reservation {
        name: "vips".into(),
        cidrs: vec!["10.0.0.5/32".parse().expect("cidr")],
    };
    ipam.add_reservation(&kept).await.expect("reserve");
    let key = reservation_key("broken");
    t.store
        .put(&key, vec![ipam_core::model::FORMAT_VERSION, 0xff, 0xff])
        .await
        .expect("put");
    assert_reported_corrupt(
        &ipam.check(false).await.expect("check"),
        &key,
        "`blockipamctl reservation delete broken`",
    );
    let each = ipam.list_reservations_each().await.expect("list each");
    assert_eq!(each.len(), 2, "{each:?}");
    assert_eq!(each[0].0, "broken");
    assert!(
        matches!(&each[0].1, Err(IpamError::Corrupt { key: named, .. }) if *named == key),
        "{each:?}"
    );
    assert_eq!(each[1], ("vips".to_owned(), Ok(kept.clone())));
    match ipam.list_reservations().await {
        Err(IpamError::Corrupt { key: named, .. }) => assert_eq!(named, key),
        other => panic!("the whole listing must name the corrupt reservation, got {other:?}"),
    }
    match ipam.auto_assign(&v4("h1", "node-a", 1)).await {
        Err(IpamError::Corrupt { key: named, .. }) => assert_eq!(named, key),
        other => panic!("auto-assign must stop at the corrupt reservation, got {other:?}"),
    }
    // The operator's way out: delete it.
    ipam.delete_reservation("broken").await.expect("delete");
    assert_eq!(ipam.list_reservations().await.expect("list"), vec![kept]);
    assign_one(&ipam, "h1", "node-a").await;
}
