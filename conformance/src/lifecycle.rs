//! Address and block lifecycle cases: IP cooldown, empty-block takeover and the release of empty
//! blocks hosts no longer need, with a clock the case moves by hand, on every backend.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ipam_core::model::keys;
use ipam_core::selector::Selector;
use ipam_core::{
    Clock, EmptyBlockFilter, EmptyBlockReason, Ipam, IpamConfig, IpamError, PoolChange,
};
use ipnet::IpNet;

use crate::ipam::{assert_clean, spec, v4};
use crate::StoreFactory;

/// Expands every lifecycle case into one `#[tokio::test]` inside a module `lifecycle`.
#[macro_export]
macro_rules! lifecycle_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(lifecycle, $crate::lifecycle, $factory;
            cooling_address_is_not_handed_out_until_its_cooldown_passes,
            cooling_addresses_keep_a_block_from_being_empty,
            explicitly_requested_cooling_address_is_refused_until_it_cools,
            a_cooling_gateway_is_reserved_once_cooled_and_the_networks_other_addresses_at_once,
            address_status_tells_until_when_an_address_cools_and_which_reservations_cover_it,
            addresses_not_free_are_the_allocated_and_the_cooling_ones_until_they_cool,
            usage_counts_an_address_both_reserved_and_cooling_once,
            the_cooldown_in_force_applies_raised_lowered_or_turned_off,
            cooldown_over_the_limit_is_refused_and_changes_nothing,
            empty_block_of_another_host_is_taken_over_once_old_enough,
            takeover_waits_for_cooling_addresses,
            takeover_passes_over_an_empty_block_that_is_wholly_reserved,
            takeover_passes_over_a_block_used_again_after_the_claim_index_was_read,
            release_empty_passes_over_a_block_used_again_after_the_claim_index_was_read,
            release_empty_keeps_each_hosts_newest_block_and_dry_run_writes_nothing,
            release_empty_releases_blocks_of_pools_that_no_longer_select_the_host,
            release_empty_takes_a_node_whose_labels_do_not_decode_as_still_selected,
            release_empty_gets_past_a_block_it_cannot_decode_and_keeps_its_hosts_blocks,
        );
    };
}

/// A clock the case sets: seconds since the epoch.
struct HandClock(Arc<AtomicU64>);

impl HandClock {
    fn new(start: u64) -> Self {
        HandClock(Arc::new(AtomicU64::new(start)))
    }

    fn clock(&self) -> Clock {
        let now = Arc::clone(&self.0);
        Clock::from_fn(move || now.load(Ordering::SeqCst))
    }

    fn set(&self, now: u64) {
        self.0.store(now, Ordering::SeqCst);
    }
}

/// A store with one pool of `cidr` in `block_size` blocks, its config changed by `configure`,
/// and an allocator reading `clock`.
async fn lab(
    factory: &impl StoreFactory,
    cidr: &str,
    block_size: u8,
    clock: &HandClock,
    configure: impl Fn(&mut IpamConfig),
) -> (crate::TestStore, Ipam) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store)).with_clock(clock.clock());
    ipam.create_pool(&spec(cidr, "pool", block_size))
        .await
        .expect("create pool");
    let mut config = IpamConfig::default();
    configure(&mut config);
    ipam.set_config(&config).await.expect("set config");
    (t, ipam)
}

async fn assign(ipam: &Ipam, handle: &str, host: &str) -> (IpAddr, IpNet) {
    let got = ipam
        .auto_assign(&v4(handle, host, 1))
        .await
        .unwrap_or_else(|e| panic!("assign {handle} on {host}: {e}"));
    assert_eq!(got.v4.len(), 1, "{handle}: one address");
    (got.v4[0].ip, got.v4[0].block)
}

/// Narrows the lab's pool to the nodes labelled `rack=r1`.
async fn select_rack_r1(ipam: &Ipam) {
    ipam.set_pool(
        "pool",
        &PoolChange {
            node_selector: Some(Selector::parse("rack == 'r1'").expect("selector")),
            ..PoolChange::default()
        },
    )
    .await
    .expect("narrow the pool's selector to rack r1");
}

async fn block_owner(ipam: &Ipam, cidr: IpNet) -> Option<Option<String>> {
    let usage = ipam.utilization().await.expect("utilization");
    usage
        .pools
        .iter()
        .flat_map(|p| p.blocks.iter())
        .chain(usage.orphan_blocks.iter())
        .find(|b| b.cidr == cidr)
        .map(|b| b.host.clone())
}

/// `address_status` (what `blockipamctl show --ip` prints): the holder of an allocated address;
/// for a released one its block and the end of its cooldown, until that has passed; the
/// reservations covering an address, whether held, free or in no block; nothing but
/// reservations for an address in no pool.
pub async fn address_status_tells_until_when_an_address_cools_and_which_reservations_cover_it<
    F: StoreFactory,
>(
    factory: &F,
) {
    let clock = HandClock::new(1_000);
    let (_t, ipam) = lab(factory, "10.41.0.0/24", 30, &clock, |c| {
        c.ip_cooldown_seconds = 60;
    })
    .await;
    let (released, block) = assign(&ipam, "h0", "node-a").await;
    let (held, _) = assign(&ipam, "h1", "node-a").await;
    clock.set(1_010);
    ipam.release_handle("h0").await.expect("release");
    let unblocked: IpAddr = "10.41.0.200".parse().expect("ip");
    let outside: IpAddr = "10.42.0.1".parse().expect("ip");
    for (name, cidrs) in [
        (
            "both",
            vec![
                IpNet::new(released, 32).expect("/32"),
                IpNet::new(outside, 32).expect("/32"),
            ],
        ),
        ("wide", vec!["10.41.0.0/25".parse().expect("cidr")]),
    ] {
        ipam.add_reservation(&ipam_core::reservations::Reservation {
            name: name.into(),
            cidrs,
        })
        .await
        .expect("reserve");
    }

    let status = ipam.address_status(released).await.expect("status");
    assert_eq!(status.allocation, None, "{status:?}");
    assert_eq!(
        status.block,
        Some((block, Some("node-a".into()))),
        "{status:?}"
    );
    assert_eq!(
        status.cooling_until,
        Some(1_071),
        "released at 1,010 (a whole second) for 60 s: cooled from 1,071"
    );
    assert_eq!(
        status.reserved_by,
        vec!["both".to_owned(), "wide".to_owned()]
    );
    assert_eq!(status.pool.map(|p| p.name), Some("pool".into()));

    let status = ipam.address_status(held).await.expect("status");
    assert_eq!(
        status.allocation.map(|a| a.handle),
        Some("h1".into()),
        "the holder"
    );
    assert_eq!(
        (status.cooling_until, status.reserved_by),
        (None, vec!["wide".to_owned()])
    );

    let status = ipam.address_status(unblocked).await.expect("status");
    assert_eq!(
        (status.allocation, status.block, status.cooling_until),
        (None, None, None),
        "no block holds {unblocked}"
    );
    assert!(
        status.reserved_by.is_empty() && status.pool.is_some(),
        "{unblocked}"
    );

    let status = ipam.address_status(outside).await.expect("status");
    assert_eq!(
        (status.pool, status.block, status.reserved_by),
        (None, None, vec!["both".to_owned()]),
        "{outside} is in no pool"
    );

    // Exactly 60 s after the release's stamp may be less than 60 s after the release: still
    // cooling. Once the cooldown has passed, nothing is cooling.
    clock.set(1_070);
    let status = ipam.address_status(released).await.expect("status");
    assert_eq!(status.cooling_until, Some(1_071), "{status:?}");
    clock.set(1_071);
    let status = ipam.address_status(released).await.expect("status");
    assert_eq!((status.allocation, status.cooling_until), (None, None));
    assert_eq!(status.block.map(|(cidr, _)| cidr), Some(block));
    assert_clean(&ipam).await;
}

/// `addresses_not_free` (what CNI STATUS reads when which addresses are free decides its
/// answer): the allocated addresses of every node's blocks and the released ones still cooling,
/// until their cooldown has passed; not the operator's reservations.
pub async fn addresses_not_free_are_the_allocated_and_the_cooling_ones_until_they_cool<
    F: StoreFactory,
>(
    factory: &F,
) {
    let clock = HandClock::new(1_000);
    let (_t, ipam) = lab(factory, "10.43.0.0/24", 30, &clock, |c| {
        c.ip_cooldown_seconds = 60;
    })
    .await;
    let (released, _) = assign(&ipam, "h0", "node-a").await;
    let (held, _) = assign(&ipam, "h1", "node-a").await;
    let (elsewhere, _) = assign(&ipam, "h2", "node-b").await;
    ipam.add_reservation(&ipam_core::reservations::Reservation {
        name: "reserved".into(),
        cidrs: vec!["10.43.0.200/32".parse().expect("cidr")],
    })
    .await
    .expect("reserve");
    assert_eq!(
        ipam.addresses_not_free().await.expect("read"),
        [released, held, elsewhere].into(),
        "every allocated address, of every node"
    );
    clock.set(1_010);
    ipam.release_handle("h0").await.expect("release");
    assert_eq!(
        ipam.addresses_not_free().await.expect("read"),
        [released, held, elsewhere].into(),
        "the released address cools"
    );
    clock.set(1_071);
    assert_eq!(
        ipam.addresses_not_free().await.expect("read"),
        [held, elsewhere].into(),
        "its cooldown passed, it is free"
    );
    assert_clean(&ipam).await;
}

/// `show`'s figures: an address both reserved and cooling is left out of the free count once,
/// in its block's row and in its pool's; after its cooldown it stays out, as reserved; a cooling
/// address nobody reserved is left out while it cools.
pub async fn usage_counts_an_address_both_reserved_and_cooling_once<F: StoreFactory>(factory: &F) {
    let clock = HandClock::new(1_000);
    let (_t, ipam) = lab(factory, "10.43.0.0/24", 28, &clock, |c| {
        c.ip_cooldown_seconds = 60;
    })
    .await;
    let (reserved_ip, block) = assign(&ipam, "h0", "node-a").await;
    assign(&ipam, "h1", "node-a").await;
    // Reserved while allocated (left to its holder), then released: reserved and cooling.
    ipam.add_reservation(&ipam_core::reservations::Reservation {
        name: "vip".into(),
        cidrs: vec![IpNet::from(reserved_ip)],
    })
    .await
    .expect("reserve");
    clock.set(1_010);
    ipam.release_handle("h0").await.expect("release h0");
    // (in use, reserved, cooling, free) of the block's row and of the pool's.
    let figures = || async {
        let usage = ipam.utilization().await.expect("usage");
        let pool = &usage.pools[0];
        let row = pool
            .blocks
            .iter()
            .find(|b| b.cidr == block)
            .expect("the block's row");
        (
            (row.in_use, row.reserved, row.cooling, row.free),
            (pool.in_use, pool.reserved, pool.cooling, pool.free),
        )
    };
    // A /28 of 16 and a /24 of 256: one in use, one out as both reserved and cooling.
    assert_eq!(figures().await, ((1, 1, 1, 14), (1, 1, 1, 254)), "cooling");
    clock.set(1_071);
    assert_eq!(
        figures().await,
        ((1, 1, 0, 14), (1, 1, 0, 254)),
        "cooled: still reserved"
    );
    ipam.release_handle("h1").await.expect("release h1");
    assert_eq!(
        figures().await,
        ((0, 1, 1, 14), (0, 1, 1, 254)),
        "a cooling address nobody reserved is out while it cools"
    );
    clock.set(1_132);
    assert_eq!(
        figures().await,
        ((0, 1, 0, 15), (0, 1, 0, 255)),
        "all cooled"
    );
}

/// The cooldown in force when an address is looked at applies, not the one it was released
/// under: raising it holds a cooling address longer, lowering it frees it sooner, and turning it
/// off frees it at once, in the second of its release.
pub async fn the_cooldown_in_force_applies_raised_lowered_or_turned_off<F: StoreFactory>(
    factory: &F,
) {
    let clock = HandClock::new(7_000);
    // One block of four addresses: the cooling one is all that is left to hand out.
    let (_t, ipam) = lab(factory, "10.43.0.0/30", 30, &clock, |c| {
        c.ip_cooldown_seconds = 60;
    })
    .await;
    let (released, _) = assign(&ipam, "h0", "node-a").await;
    for n in 1..=3 {
        assign(&ipam, &format!("h{n}"), "node-a").await;
    }
    ipam.release_handle("h0").await.expect("release");
    let set_cooldown = |seconds: u32| {
        let ipam = &ipam;
        async move {
            ipam.update_config(|c| c.ip_cooldown_seconds = seconds)
                .await
                .expect("set the cooldown");
        }
    };
    let cooling_until = || async {
        ipam.address_status(released)
            .await
            .expect("status")
            .cooling_until
    };
    assert_eq!(cooling_until().await, Some(7_061), "released under 60 s");
    set_cooldown(120).await;
    assert_eq!(cooling_until().await, Some(7_121), "raised to 120 s");
    set_cooldown(10).await;
    assert_eq!(cooling_until().await, Some(7_011), "lowered to 10 s");
    set_cooldown(0).await;
    assert_eq!(cooling_until().await, None, "turned off: cooled at once");
    let (ip, _) = assign(&ipam, "h4", "node-a").await;
    assert_eq!(ip, released, "handed out in the second of its release");
    assert_clean(&ipam).await;
}

/// A released address is not handed out again while it cools, even when that leaves nothing to
/// hand out; once the cooldown has passed it is.
pub async fn cooling_address_is_not_handed_out_until_its_cooldown_passes<F: StoreFactory>(
    factory: &F,
) {
    let clock = HandClock::new(1_000);
    // One block of four addresses: nowhere else to go.
    let (_t, ipam) = lab(factory, "10.40.0.0/30", 30, &clock, |c| {
        c.ip_cooldown_seconds = 60;
    })
    .await;
    let (first, first_block) = assign(&ipam, "h0", "node-a").await;
    ipam.release_handle("h0").await.expect("release");
    // The block's three other addresses are fresh and come first anyway.
    for n in 1..=3 {
        let (ip, block) = assign(&ipam, &format!("h{n}"), "node-a").await;
        assert_eq!(block, first_block);
        assert_ne!(ip, first, "h{n} got the cooling address");
    }
    // Only the cooling address is left: 60 s after its release's stamp (a whole second, so
    // possibly less than 60 s after the release itself) there is nothing to hand out, on this
    // host or another.
    clock.set(1_060);
    for host in ["node-a", "node-b"] {
        assert!(
            matches!(
                ipam.auto_assign(&v4("h4", host, 1)).await,
                Err(IpamError::Exhausted { .. })
            ),
            "{host} got an address 60 s after its release's stamp, a 60 s cooldown"
        );
    }
    // Usage counts it as cooling, in its block and its pool, and not as free.
    let usage = ipam.utilization().await.expect("utilization");
    let pool = &usage.pools[0];
    assert_eq!(
        (pool.in_use, pool.cooling, pool.free),
        (3, 1, 0),
        "{pool:?}"
    );
    assert_eq!(
        (
            pool.blocks[0].in_use,
            pool.blocks[0].cooling,
            pool.blocks[0].free
        ),
        (3, 1, 0)
    );
    // A second later it is free again.
    clock.set(1_061);
    let pool = ipam.utilization().await.expect("utilization").pools[0].clone();
    assert_eq!(
        (pool.in_use, pool.cooling, pool.free),
        (3, 0, 1),
        "{pool:?}"
    );
    let (ip, _) = assign(&ipam, "h4", "node-a").await;
    assert_eq!(ip, first, "the cooled address is reused");
    assert_clean(&ipam).await;
}

/// A block whose only addresses are cooling is not empty: releasing the host unassigns it instead
/// of deleting it, `check` is clean, and the release of empty blocks deletes it only once cooled.
pub async fn cooling_addresses_keep_a_block_from_being_empty<F: StoreFactory>(factory: &F) {
    let clock = HandClock::new(5_000);
    let (_t, ipam) = lab(factory, "10.41.0.0/28", 30, &clock, |c| {
        c.ip_cooldown_seconds = 120;
    })
    .await;
    let (_, block) = assign(&ipam, "h0", "node-a").await;
    ipam.release_handle("h0").await.expect("release");
    let report = ipam
        .release_host("node-a", false)
        .await
        .expect("release host");
    assert_eq!(report.deleted_blocks, Vec::<IpNet>::new(), "{report:?}");
    assert_eq!(report.unassigned_blocks, vec![block]);
    assert_eq!(block_owner(&ipam, block).await, Some(None), "kept, unowned");
    assert_clean(&ipam).await;
    let filter = EmptyBlockFilter {
        older_than_seconds: 0,
        only_unselected: false,
    };
    clock.set(5_120);
    let found = ipam.release_empty_blocks(filter, true).await.expect("pass");
    assert!(found.is_empty(), "still cooling: {found:?}");
    assert_eq!(block_owner(&ipam, block).await, Some(None));
    clock.set(5_121);
    let found = ipam.release_empty_blocks(filter, true).await.expect("pass");
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].reason, EmptyBlockReason::Unowned);
    assert!(found[0].released);
    assert_eq!(block_owner(&ipam, block).await, None, "deleted once cooled");
    assert_clean(&ipam).await;
}

/// An address named explicitly is refused while it cools, as Calico refuses it (it still has an
/// allocation entry there), with an error saying until when, and nothing is written; once the
/// cooldown has passed it is handed out.
pub async fn explicitly_requested_cooling_address_is_refused_until_it_cools<F: StoreFactory>(
    factory: &F,
) {
    let clock = HandClock::new(9_000);
    let (t, ipam) = lab(factory, "10.42.0.0/28", 30, &clock, |c| {
        c.ip_cooldown_seconds = 600;
    })
    .await;
    let (ip, _) = assign(&ipam, "h0", "node-a").await;
    ipam.release_handle("h0").await.expect("release");
    let request = ipam_core::AssignIpsRequest {
        handle: "h1".into(),
        host: "node-a".into(),
        ips: vec![ip],
        ..Default::default()
    };
    clock.set(9_600);
    let before = t.store.list("").await.expect("list");
    match ipam.assign_ips(&request).await {
        Err(IpamError::AddressCooling {
            ip: refused,
            released_at,
            cools_at,
        }) => {
            assert_eq!((refused, released_at, cools_at), (ip, 9_000, 9_601));
        }
        other => panic!("a cooling address was not refused: {other:?}"),
    }
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "a refused assignment wrote"
    );
    clock.set(9_601);
    let got = ipam.assign_ips(&request).await.expect("cooled: assigned");
    assert_eq!(got[0].ip, ip);
    assert_clean(&ipam).await;
}

/// A network whose gateway address a container released lately (in IP cooldown) is set up as far
/// as it can be: the pool's network and broadcast addresses are reserved at once, so no container
/// gets them; the gateway is handed to no one while it cools, and reserved by the first call
/// after its cooldown ends.
pub async fn a_cooling_gateway_is_reserved_once_cooled_and_the_networks_other_addresses_at_once<
    F: StoreFactory,
>(
    factory: &F,
) {
    use ipam_core::network_setup::NetworkSetup;
    use ipam_core::AutoAssignRequest;

    let clock = HandClock::new(20_000);
    let cidr = "10.44.0.0/28";
    let (_t, ipam) = lab(factory, cidr, 28, &clock, |c| {
        c.ip_cooldown_seconds = 600;
    })
    .await;
    let address = |text: &str| -> IpAddr { text.parse().expect("address") };
    let gateway = address("10.44.0.1");
    let old = ipam_core::AssignIpsRequest {
        handle: "old-pod".into(),
        host: "node-a".into(),
        ips: vec![gateway],
        ..Default::default()
    };
    ipam.assign_ips(&old).await.expect("a container holds it");
    ipam.release_handle("old-pod").await.expect("released");

    let setup = NetworkSetup {
        network: "net".into(),
        pools: vec![spec(cidr, "pool", 28)],
        gateways: vec![gateway],
        reservation_handle: "net:gateway".into(),
    };
    let request = |handle: &str, n: u32| AutoAssignRequest {
        handle: handle.into(),
        host: "node-a".into(),
        num_v4: n,
        setup: Some(setup.clone()),
        ..Default::default()
    };
    let reserved = || async {
        let mut held: Vec<IpAddr> = ipam
            .ips_by_handle("net:gateway")
            .await
            .expect("the reservations")
            .into_iter()
            .map(|a| a.ip)
            .collect();
        held.sort();
        held
    };
    // Every address but the gateway and the pool's edges: 13 of 16.
    clock.set(20_300);
    let got = ipam
        .auto_assign(&request("pod-all", 13))
        .await
        .expect("the network set up around its cooling gateway");
    let handed_out: Vec<IpAddr> = got.v4.iter().map(|a| a.ip).collect();
    let expected: Vec<IpAddr> = (2..=14).map(|i| address(&format!("10.44.0.{i}"))).collect();
    assert_eq!(handed_out, expected, "neither the gateway nor an edge");
    assert_eq!(
        reserved().await,
        vec![address("10.44.0.0"), address("10.44.0.15")],
        "the network and broadcast addresses reserved while the gateway cools"
    );
    let outcome = ipam.auto_assign(&request("pod-more", 1)).await;
    assert!(
        matches!(outcome, Err(IpamError::Exhausted { .. })),
        "the cooling gateway was offered: {outcome:?}"
    );
    assert_eq!(reserved().await.len(), 2, "still cooling");

    // Cooled: the next call reserves it (and finds nothing left for itself).
    clock.set(20_601);
    let outcome = ipam.auto_assign(&request("pod-later", 1)).await;
    assert!(
        matches!(outcome, Err(IpamError::Exhausted { .. })),
        "the cooled gateway was handed to a container: {outcome:?}"
    );
    assert_eq!(
        reserved().await,
        vec![address("10.44.0.0"), gateway, address("10.44.0.15")],
        "the gateway reserved once cooled"
    );
    assert_clean(&ipam).await;
}

/// Calico's limit: a cooldown over 1200 s is refused, by `set_config` and by `update_config`,
/// and the stored config stays as it was.
pub async fn cooldown_over_the_limit_is_refused_and_changes_nothing<F: StoreFactory>(factory: &F) {
    let clock = HandClock::new(1);
    let (_t, ipam) = lab(factory, "10.43.0.0/28", 30, &clock, |c| {
        c.ip_cooldown_seconds = 1200;
    })
    .await;
    let too_long = IpamConfig {
        ip_cooldown_seconds: 1201,
        ..IpamConfig::default()
    };
    assert!(matches!(
        ipam.set_config(&too_long).await,
        Err(IpamError::InvalidArgument(_))
    ));
    assert!(matches!(
        ipam.update_config(|c| c.ip_cooldown_seconds = 5000).await,
        Err(IpamError::InvalidArgument(_))
    ));
    assert_eq!(
        ipam.get_config().await.expect("config").ip_cooldown_seconds,
        1200
    );
}

/// When its pools have no unclaimed block left, a host takes over another host's block that has
/// been empty for the reclaim age (not before), and allocates from it.
pub async fn empty_block_of_another_host_is_taken_over_once_old_enough<F: StoreFactory>(
    factory: &F,
) {
    let clock = HandClock::new(20_000);
    let (_t, ipam) = lab(factory, "10.44.0.0/29", 30, &clock, |c| {
        c.strict_affinity = true;
        c.empty_block_reclaim_seconds = 60;
    })
    .await;
    let (_, block_a) = assign(&ipam, "a0", "node-a").await;
    let (_, block_b) = assign(&ipam, "b0", "node-b").await;
    assert_ne!(block_a, block_b);
    ipam.release_handle("a0").await.expect("release");
    // Both blocks claimed, node-a's empty for 59 s: node-c finds nothing.
    clock.set(20_059);
    assert!(
        matches!(
            ipam.auto_assign(&v4("c0", "node-c", 1)).await,
            Err(IpamError::Exhausted { .. })
        ),
        "took over a block empty for less than the reclaim age"
    );
    clock.set(20_060);
    let (ip, block) = assign(&ipam, "c0", "node-c").await;
    assert_eq!(block, block_a, "node-a's empty block");
    assert!(block_a.contains(&ip));
    assert_eq!(
        block_owner(&ipam, block_a).await,
        Some(Some("node-c".into()))
    );
    assert_eq!(
        block_owner(&ipam, block_b).await,
        Some(Some("node-b".into())),
        "a block in use is never taken"
    );
    assert_clean(&ipam).await;
}

/// A block whose addresses are still cooling is not empty, however long ago its last allocation
/// was released: the takeover waits for the cooldown.
pub async fn takeover_waits_for_cooling_addresses<F: StoreFactory>(factory: &F) {
    let clock = HandClock::new(30_000);
    let (_t, ipam) = lab(factory, "10.45.0.0/30", 30, &clock, |c| {
        c.strict_affinity = true;
        c.empty_block_reclaim_seconds = 10;
        c.ip_cooldown_seconds = 300;
    })
    .await;
    let (_, block) = assign(&ipam, "a0", "node-a").await;
    ipam.release_handle("a0").await.expect("release");
    // Cooled at 30,301 (the release's stamp, 300 s, and the second that stamp may hide);
    // empty long enough 10 s later.
    for still_waiting in [30_300, 30_310] {
        clock.set(still_waiting);
        assert!(
            matches!(
                ipam.auto_assign(&v4("c0", "node-c", 1)).await,
                Err(IpamError::Exhausted { .. })
            ),
            "taken over at {still_waiting}"
        );
    }
    clock.set(30_311);
    let (_, taken) = assign(&ipam, "c0", "node-c").await;
    assert_eq!(taken, block);
    assert_clean(&ipam).await;
}

/// An empty block of another host that a reservation covers whole is never taken over, however
/// long it has been empty: the takeover takes the next one, and with none left the pool is
/// exhausted.
pub async fn takeover_passes_over_an_empty_block_that_is_wholly_reserved<F: StoreFactory>(
    factory: &F,
) {
    let clock = HandClock::new(50_000);
    let (_t, ipam) = lab(factory, "10.47.0.0/29", 30, &clock, |c| {
        c.strict_affinity = true;
        c.empty_block_reclaim_seconds = 60;
    })
    .await;
    let (_, block_a) = assign(&ipam, "a0", "node-a").await;
    let (_, block_b) = assign(&ipam, "b0", "node-b").await;
    assert_ne!(block_a, block_b);
    // node-a's block empty first (the oldest, taken first), then node-b's.
    ipam.release_handle("a0").await.expect("release");
    clock.set(50_010);
    ipam.release_handle("b0").await.expect("release");
    ipam.add_reservation(&ipam_core::reservations::Reservation {
        name: "all-of-a".to_owned(),
        cidrs: vec![block_a],
    })
    .await
    .expect("reserve node-a's block");
    clock.set(50_100);
    let (ip, taken) = assign(&ipam, "c0", "node-c").await;
    assert_eq!(taken, block_b, "took over the wholly reserved block");
    assert!(block_b.contains(&ip));
    assert_eq!(
        block_owner(&ipam, block_a).await,
        Some(Some("node-a".into())),
        "the reserved block changed hands"
    );
    assert!(
        matches!(
            ipam.auto_assign(&v4("d0", "node-d", 1)).await,
            Err(IpamError::Exhausted { .. })
        ),
        "only the reserved block was left"
    );
    assert_eq!(
        block_owner(&ipam, block_a).await,
        Some(Some("node-a".into()))
    );
    assert_clean(&ipam).await;
}

/// An allocator over `store` that runs `hook` once, right after its first listing of the claim
/// index has been answered (another writer's calls land between that read and the block reads
/// that follow it), and the wrapper, to check that the hook ran.
fn after_claim_index_read<H, Fut>(
    store: &Arc<dyn ipam_core::KvStore>,
    clock: &HandClock,
    hook: H,
) -> (Arc<crate::hooked::HookedStore>, Ipam)
where
    H: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let hooked = crate::hooked::HookedStore::new(Arc::clone(store));
    let ipam = Ipam::new(hooked.clone() as Arc<dyn ipam_core::KvStore>).with_clock(clock.clock());
    let claims = ipam_core::model::keys::claims_dir();
    hooked.after_read(
        move |reads| {
            reads
                .iter()
                .any(|r| matches!(r, ipam_core::Read::List(p) if *p == claims))
        },
        hook,
    );
    (hooked, ipam)
}

/// The takeover decides from the claim index, then reads the blocks it picked: a block whose host
/// allocates in it again between the two reads is not empty any more, and is never taken over
/// with the new allocation in it.
pub async fn takeover_passes_over_a_block_used_again_after_the_claim_index_was_read<
    F: StoreFactory,
>(
    factory: &F,
) {
    let clock = HandClock::new(60_000);
    let (t, ipam) = lab(factory, "10.48.0.0/29", 30, &clock, |c| {
        c.strict_affinity = true;
        c.empty_block_reclaim_seconds = 60;
    })
    .await;
    let (_, block_a) = assign(&ipam, "a0", "node-a").await;
    let (_, block_b) = assign(&ipam, "b0", "node-b").await;
    assert_ne!(block_a, block_b);
    ipam.release_handle("a0").await.expect("release");
    clock.set(60_100);
    // Right after node-c reads the claim index (node-a's block empty for 100 s), node-a
    // allocates in its block again.
    let node_a = ipam.clone();
    let (hooked, node_c) = after_claim_index_read(&t.store, &clock, move || async move {
        let (_, block) = assign(&node_a, "a1", "node-a").await;
        assert_eq!(block, block_a);
    });
    let outcome = node_c.auto_assign(&v4("c0", "node-c", 1)).await;
    assert!(
        hooked.read_hook_fired(),
        "node-c never read the claim index"
    );
    assert!(
        matches!(outcome, Err(IpamError::Exhausted { .. })),
        "{outcome:?}"
    );
    assert_eq!(
        block_owner(&ipam, block_a).await,
        Some(Some("node-a".into())),
        "a block in use again was taken over"
    );
    let held = ipam.ips_by_handle("a1").await.expect("read");
    assert_eq!(held.len(), 1);
    assert!(block_a.contains(&held[0].ip));
    assert_clean(&ipam).await;
}

/// The empty-block pass decides from the claim index, then reads the blocks it may release: a
/// block used and emptied again between the two reads has been empty for less than the age asked
/// for, and stays.
pub async fn release_empty_passes_over_a_block_used_again_after_the_claim_index_was_read<
    F: StoreFactory,
>(
    factory: &F,
) {
    let clock = HandClock::new(70_000);
    let (t, ipam) = lab(factory, "10.49.0.0/28", 30, &clock, |c| {
        c.max_blocks_per_host = 0;
    })
    .await;
    let mut blocks = Vec::new();
    for n in 0..5 {
        clock.set(70_000 + n);
        let (_, block) = assign(&ipam, &format!("h{n}"), "node-a").await;
        if !blocks.contains(&block) {
            blocks.push(block);
        }
    }
    assert_eq!(blocks.len(), 2, "two /30 blocks: {blocks:?}");
    for n in 0..5 {
        ipam.release_handle(&format!("h{n}"))
            .await
            .expect("release");
    }
    clock.set(71_000);
    // Right after the pass reads the claim index (the older block empty for 1,000 s), node-a
    // takes an address in it and gives it back.
    let node_a = ipam.clone();
    let older_block = blocks[0];
    let (hooked, pass) = after_claim_index_read(&t.store, &clock, move || async move {
        let ip = older_block.hosts().next().expect("a host address");
        node_a
            .assign_ips(&ipam_core::AssignIpsRequest {
                ips: vec![ip],
                handle: "again".to_owned(),
                host: "node-a".to_owned(),
                ..Default::default()
            })
            .await
            .expect("assign in the older block");
        node_a.release_handle("again").await.expect("release");
    });
    let found = pass
        .release_empty_blocks(
            EmptyBlockFilter {
                older_than_seconds: 60,
                only_unselected: false,
            },
            true,
        )
        .await
        .expect("pass");
    assert!(
        hooked.read_hook_fired(),
        "the pass never read the claim index"
    );
    assert!(
        found.iter().all(|b| b.cidr != older_block || !b.released),
        "released a block empty for 0 s: {found:?}"
    );
    assert_eq!(
        block_owner(&ipam, older_block).await,
        Some(Some("node-a".into())),
        "a block emptied again was released"
    );
    // Once it has been empty long enough, the next pass releases it.
    clock.set(71_060);
    let found = ipam
        .release_empty_blocks(
            EmptyBlockFilter {
                older_than_seconds: 60,
                only_unselected: false,
            },
            true,
        )
        .await
        .expect("pass");
    assert_eq!(
        found
            .iter()
            .map(|b| (b.cidr, b.released))
            .collect::<Vec<_>>(),
        vec![(older_block, true)]
    );
    assert_clean(&ipam).await;
}

/// Per host and family the newest block stays, the other empty ones go; a dry run reports the
/// same and writes nothing; blocks empty for less than the age stay.
pub async fn release_empty_keeps_each_hosts_newest_block_and_dry_run_writes_nothing<
    F: StoreFactory,
>(
    factory: &F,
) {
    let clock = HandClock::new(40_000);
    let (_t, ipam) = lab(factory, "10.46.0.0/27", 30, &clock, |c| {
        c.max_blocks_per_host = 0;
    })
    .await;
    let mut blocks = Vec::new();
    for n in 0..9 {
        clock.set(40_000 + n);
        let (_, block) = assign(&ipam, &format!("h{n}"), "node-a").await;
        if !blocks.contains(&block) {
            blocks.push(block);
        }
    }
    assert_eq!(blocks.len(), 3, "three /30 blocks: {blocks:?}");
    for n in 0..9 {
        ipam.release_handle(&format!("h{n}"))
            .await
            .expect("release");
    }
    clock.set(41_000);
    let older = |seconds| EmptyBlockFilter {
        older_than_seconds: seconds,
        only_unselected: false,
    };
    assert!(ipam
        .release_empty_blocks(older(5_000), true)
        .await
        .expect("pass")
        .is_empty());
    let preview = ipam
        .release_empty_blocks(older(60), false)
        .await
        .expect("dry run");
    let mut previewed: Vec<IpNet> = preview.iter().map(|b| b.cidr).collect();
    previewed.sort();
    assert_eq!(previewed, vec![blocks[0], blocks[1]], "all but the newest");
    assert!(preview
        .iter()
        .all(|b| !b.released && b.reason == EmptyBlockReason::BeyondNewest));
    for block in &blocks {
        assert_eq!(
            block_owner(&ipam, *block).await,
            Some(Some("node-a".into())),
            "the dry run wrote"
        );
    }
    let applied = ipam
        .release_empty_blocks(older(60), true)
        .await
        .expect("apply");
    assert!(applied.iter().all(|b| b.released), "{applied:?}");
    assert_eq!(block_owner(&ipam, blocks[0]).await, None);
    assert_eq!(block_owner(&ipam, blocks[1]).await, None);
    assert_eq!(
        block_owner(&ipam, blocks[2]).await,
        Some(Some("node-a".into())),
        "the newest stays"
    );
    assert!(ipam
        .release_empty_blocks(older(60), true)
        .await
        .expect("again")
        .is_empty());
    assert_clean(&ipam).await;
}

/// When a pool stops selecting a node, the node's empty blocks in it go, its newest included;
/// its blocks in use stay.
pub async fn release_empty_releases_blocks_of_pools_that_no_longer_select_the_host<
    F: StoreFactory,
>(
    factory: &F,
) {
    let clock = HandClock::new(50_000);
    let (_t, ipam) = lab(factory, "10.47.0.0/28", 30, &clock, |_| {}).await;
    let (_, emptied) = assign(&ipam, "a0", "node-a").await;
    let (_, in_use) = assign(&ipam, "b0", "node-b").await;
    ipam.release_handle("a0").await.expect("release");
    let unselected = EmptyBlockFilter {
        older_than_seconds: 0,
        only_unselected: true,
    };
    assert!(
        ipam.release_empty_blocks(unselected, true)
            .await
            .expect("pass")
            .is_empty(),
        "the pool still selects every node"
    );
    select_rack_r1(&ipam).await;
    let found = ipam
        .release_empty_blocks(unselected, true)
        .await
        .expect("pass");
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].cidr, emptied);
    assert_eq!(found[0].reason, EmptyBlockReason::PoolNoLongerSelects);
    assert!(found[0].released);
    assert_eq!(block_owner(&ipam, emptied).await, None);
    assert_eq!(
        block_owner(&ipam, in_use).await,
        Some(Some("node-b".into())),
        "a block in use stays"
    );
    assert_clean(&ipam).await;
}

/// A node whose labels object cannot be decoded: the release of empty blocks still runs for every
/// node (another node's block in a pool that no longer selects it goes), and for that node only
/// what its labels cannot change goes (empty blocks beyond its newest); its newest block stays, as
/// if its pools still selected it.
pub async fn release_empty_takes_a_node_whose_labels_do_not_decode_as_still_selected<
    F: StoreFactory,
>(
    factory: &F,
) {
    use ipam_core::nodes::node_key;

    let clock = HandClock::new(60_000);
    let (t, ipam) = lab(factory, "10.49.0.0/27", 30, &clock, |c| {
        c.max_blocks_per_host = 0;
    })
    .await;
    let rack = |value: &str| vec![("rack".to_owned(), value.to_owned())];
    for host in ["node-x", "node-y"] {
        ipam.set_node_labels(host, &rack("r1"), &[])
            .await
            .expect("label");
    }
    select_rack_r1(&ipam).await;
    let mut x_blocks = Vec::new();
    for n in 0..6 {
        clock.set(60_000 + n);
        let (_, block) = assign(&ipam, &format!("x{n}"), "node-x").await;
        if !x_blocks.contains(&block) {
            x_blocks.push(block);
        }
    }
    assert_eq!(x_blocks.len(), 2, "two /30 blocks: {x_blocks:?}");
    let (_, y_block) = assign(&ipam, "y0", "node-y").await;
    for handle in ["x0", "x1", "x2", "x3", "x4", "x5", "y0"] {
        ipam.release_handle(handle).await.expect("release");
    }
    ipam.set_node_labels("node-y", &rack("r2"), &[])
        .await
        .expect("node-y moves to rack r2");
    t.store
        .put(
            &node_key("node-x"),
            vec![ipam_core::model::FORMAT_VERSION, 0xff, 0xff],
        )
        .await
        .expect("damage node-x's labels");
    clock.set(61_000);

    let unselected = ipam
        .release_empty_blocks(
            EmptyBlockFilter {
                older_than_seconds: 60,
                only_unselected: true,
            },
            false,
        )
        .await
        .expect("a damaged node's labels stop no pass");
    assert_eq!(
        unselected
            .iter()
            .map(|b| (b.cidr, b.reason))
            .collect::<Vec<_>>(),
        vec![(y_block, EmptyBlockReason::PoolNoLongerSelects)],
        "only node-y is known to be no longer selected"
    );
    let mut found: Vec<(IpNet, EmptyBlockReason, bool)> = ipam
        .release_empty_blocks(
            EmptyBlockFilter {
                older_than_seconds: 60,
                only_unselected: false,
            },
            true,
        )
        .await
        .expect("a damaged node's labels stop no pass")
        .into_iter()
        .map(|b| (b.cidr, b.reason, b.released))
        .collect();
    found.sort_by_key(|(cidr, _, _)| *cidr);
    let mut expected = vec![
        (x_blocks[0], EmptyBlockReason::BeyondNewest, true),
        (y_block, EmptyBlockReason::PoolNoLongerSelects, true),
    ];
    expected.sort_by_key(|(cidr, _, _)| *cidr);
    assert_eq!(found, expected);
    assert_eq!(block_owner(&ipam, x_blocks[0]).await, None);
    assert_eq!(block_owner(&ipam, y_block).await, None);
    assert_eq!(
        block_owner(&ipam, x_blocks[1]).await,
        Some(Some("node-x".into())),
        "node-x's newest block stays: its labels are unknown"
    );
}

/// A block that cannot be decoded does not stop the release of empty blocks (the agent's
/// reclaimer pass, `blocks release-empty`): it is named and never released (what it holds is
/// unknown), and none of its host's empty blocks is taken to be beyond the host's newest (it may
/// be the newest); every other host's blocks, and unowned blocks, are judged as usual. The
/// plain pass still fails naming it, before writing anything.
pub async fn release_empty_gets_past_a_block_it_cannot_decode_and_keeps_its_hosts_blocks<
    F: StoreFactory,
>(
    factory: &F,
) {
    let clock = HandClock::new(70_000);
    let (t, ipam) = lab(factory, "10.52.0.0/26", 30, &clock, |c| {
        c.max_blocks_per_host = 0;
        c.ip_cooldown_seconds = 120;
    })
    .await;
    let fill = |host: &'static str, count: u64, start: u64| {
        let clock = &clock;
        let ipam = &ipam;
        async move {
            let mut blocks = Vec::new();
            for n in 0..count {
                clock.set(start + n);
                let (_, block) = assign(ipam, &format!("{host}-{n}"), host).await;
                if !blocks.contains(&block) {
                    blocks.push(block);
                }
            }
            for n in 0..count {
                ipam.release_handle(&format!("{host}-{n}"))
                    .await
                    .expect("release");
            }
            blocks
        }
    };
    let a_blocks = fill("node-a", 9, 70_000).await;
    let b_blocks = fill("node-b", 6, 70_100).await;
    let c_blocks = fill("node-c", 1, 70_200).await;
    assert_eq!(a_blocks.len(), 3, "{a_blocks:?}");
    assert_eq!(b_blocks.len(), 2, "{b_blocks:?}");
    let unowned = c_blocks[0];
    ipam.release_host("node-c", false)
        .await
        .expect("node-c's block loses its owner while its address cools");
    assert_eq!(block_owner(&ipam, unowned).await, Some(None));
    clock.set(80_000);

    let damage = |key: String| {
        let store = Arc::clone(&t.store);
        async move {
            let intact = store.get(&key).await.expect("get").expect("block").value;
            store
                .put(&key, vec![ipam_core::model::FORMAT_VERSION, 0xff, 0xff])
                .await
                .expect("damage it");
            (key, intact)
        }
    };
    let newest_of_a = a_blocks[2];
    let (a_key, a_intact) = damage(keys::block(Some("node-a"), &newest_of_a)).await;
    let (c_key, c_intact) = damage(keys::block(None, &unowned)).await;
    let older = EmptyBlockFilter {
        older_than_seconds: 60,
        only_unselected: false,
    };
    let before = t.store.list("").await.expect("list");
    match ipam.release_empty_blocks(older, true).await {
        Err(IpamError::Corrupt { key, .. }) => assert!(key == a_key || key == c_key, "{key}"),
        other => panic!("expected the plain pass to fail naming a damaged block, got {other:?}"),
    }
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "nothing written"
    );

    let mut named = vec![a_key.clone(), c_key.clone()];
    named.sort();
    for apply in [false, true] {
        let (found, undecodable) = ipam
            .release_empty_blocks_each(older, apply)
            .await
            .expect("the pass gets past the damaged blocks");
        let keys: Vec<String> = undecodable.iter().map(|o| o.key.clone()).collect();
        assert_eq!(keys, named);
        assert_eq!(found.len(), 1, "only node-b's older block: {found:?}");
        assert_eq!(found[0].cidr, b_blocks[0]);
        assert_eq!(found[0].reason, EmptyBlockReason::BeyondNewest);
        assert_eq!(found[0].released, apply);
    }
    assert_eq!(block_owner(&ipam, b_blocks[0]).await, None);
    assert_eq!(
        block_owner(&ipam, b_blocks[1]).await,
        Some(Some("node-b".into())),
        "node-b's newest stays"
    );
    for block in &a_blocks[..2] {
        assert_eq!(
            block_owner(&ipam, *block).await,
            Some(Some("node-a".into())),
            "node-a's newest block cannot be told: its other empty blocks stay"
        );
    }

    t.store.put(&a_key, a_intact).await.expect("restore it");
    t.store.put(&c_key, c_intact).await.expect("restore it");
    let (found, undecodable) = ipam
        .release_empty_blocks_each(older, true)
        .await
        .expect("pass");
    assert!(undecodable.is_empty(), "{undecodable:?}");
    let mut released: Vec<(IpNet, EmptyBlockReason)> = found
        .iter()
        .filter(|b| b.released)
        .map(|b| (b.cidr, b.reason))
        .collect();
    released.sort_by_key(|(cidr, _)| *cidr);
    let mut expected = vec![
        (a_blocks[0], EmptyBlockReason::BeyondNewest),
        (a_blocks[1], EmptyBlockReason::BeyondNewest),
        (unowned, EmptyBlockReason::Unowned),
    ];
    expected.sort_by_key(|(cidr, _)| *cidr);
    assert_eq!(released, expected);
    assert_eq!(
        block_owner(&ipam, newest_of_a).await,
        Some(Some("node-a".into()))
    );
    assert_clean(&ipam).await;
}
