//! Full pools: a new node's ADD reads a window of claim entries, not the whole index, and still claims any released block.

use std::net::IpAddr;
use std::sync::Arc;

use ipam_core::kv::MAX_TXN_OPS;
use ipam_core::model::keys;
use ipam_core::reservations::Reservation;
use ipam_core::{AssignIpsRequest, EmptyBlockFilter, Ipam, KvError, KvStore, MemoryStore, Op, Txn};
use ipnet::IpNet;

use crate::hooked::HookedStore;
use crate::ipam::{assert_clean, spec, v4};
use crate::read_cost::{ReadCost, ReadMeter};
use crate::StoreFactory;

/// Expands every full-pool case into one `#[test]` inside a module `full_pools`.
#[macro_export]
macro_rules! full_pools_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(full_pools, $crate::full_pools, $factory;
            a_borrowing_add_in_a_full_pool_reads_as_much_with_1024_blocks_as_with_64,
            a_block_released_after_the_pool_was_marked_full_is_claimed_by_the_next_new_node,
            a_mark_a_writer_without_marks_made_wrong_is_forgotten_by_the_empty_block_pass,
            a_window_without_room_falls_back_to_the_whole_claim_index,
            a_new_node_in_a_nearly_full_pool_claims_an_unclaimed_block_of_its_window,
            a_pool_whose_only_unclaimed_block_is_reserved_stays_marked_through_the_empty_block_pass,
            a_pool_of_mixed_block_sizes_is_never_marked_full,
            a_borrowing_add_reads_only_as_many_lenders_as_it_needs,
            a_hosts_first_block_is_the_one_at_its_hashed_start,
            a_search_past_the_window_takes_the_first_unclaimed_block_from_the_hosts_start,
            a_search_past_reserved_blocks_takes_the_first_unclaimed_block_from_the_hosts_start,
        );
    };
}

/// Blocks of four addresses: a pool of 1,024 blocks is a /20.
const BLOCK_SIZE: u8 = 30;

/// The store under test holding a pool of `blocks` blocks of [`BLOCK_SIZE`] at `pool`, the
/// blocks `claimed` says claimed by their own filler node each, holding one address; made on
/// the in-memory store and copied.
async fn partly_claimed_pool<F: StoreFactory>(
    factory: &F,
    pool: &str,
    blocks: u32,
    claimed: impl Fn(u32) -> bool,
) -> crate::TestStore {
    filled_pool(factory, pool, blocks, |block| u32::from(claimed(block))).await
}

/// A fresh store under test holding every key of `memory`, copied in large transactions.
async fn copy_into<F: StoreFactory>(factory: &F, memory: &Arc<dyn KvStore>) -> crate::TestStore {
    let t = factory.fresh().await;
    let everything = memory.list("").await.expect("list the made store");
    for chunk in everything.chunks(MAX_TXN_OPS) {
        let mut txn = Txn::new();
        for kv in chunk {
            txn = txn.then(Op::put(kv.key.clone(), kv.value.clone()));
        }
        t.store.commit(txn).await.expect("copy");
    }
    t
}

/// The store under test holding a pool of `blocks` blocks of [`BLOCK_SIZE`] at `pool`, each
/// block where `used` is not 0 claimed by its own filler node holding `used` of its addresses;
/// made on the in-memory store (fast at any size) and copied in large transactions.
async fn filled_pool<F: StoreFactory>(
    factory: &F,
    pool: &str,
    blocks: u32,
    used: impl Fn(u32) -> u32,
) -> crate::TestStore {
    let memory: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let maker = Ipam::new(Arc::clone(&memory));
    maker
        .create_pool(&spec(pool, "pool", BLOCK_SIZE))
        .await
        .expect("create pool");
    let pool: IpNet = pool.parse().expect("pool CIDR");
    let first = match pool.network() {
        IpAddr::V4(a) => u32::from(a),
        IpAddr::V6(_) => unreachable!("an IPv4 pool"),
    };
    for block in (0..blocks).filter(|b| used(*b) > 0) {
        let ips = (0..used(block))
            .map(|i| IpAddr::V4((first + block * 4 + i).into()))
            .collect();
        maker
            .assign_ips(&AssignIpsRequest {
                ips,
                handle: format!("filler.{block:04}"),
                host: format!("filler-{block:04}"),
                ..AssignIpsRequest::default()
            })
            .await
            .unwrap_or_else(|e| panic!("filling block {block}: {e}"));
    }
    copy_into(factory, &memory).await
}

/// The host the block holding `ip` is affine to.
async fn block_host(ipam: &Ipam, ip: IpAddr) -> Option<String> {
    ipam.get_assignment(ip)
        .await
        .expect("who holds it")
        .and_then(|a| a.block_host)
}

/// Where `host`'s new-block search starts in a pool of `blocks` blocks: FNV-1a of the host name
/// (stable across builds), modulo the block count.
fn search_start(host: &str, blocks: u64) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in host.as_bytes() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash % blocks
}

/// True when the store holds a full-pool mark for the pool named `pool`.
async fn marked(store: &Arc<dyn KvStore>, pool: &str) -> bool {
    store
        .get(&keys::full_pool_mark(pool))
        .await
        .expect("read the mark")
        .is_some()
}

/// In a pool whose every block is claimed by another node, with room, the first new node's ADD
/// reads the whole claim index and marks the pool full; every later new node's ADD reads the
/// same keys, and bytes within a few per key, with 1,024 blocks in the pool as with 64: a window
/// of the claim index and one lender's block, never the whole index.
pub async fn a_borrowing_add_in_a_full_pool_reads_as_much_with_1024_blocks_as_with_64<
    F: StoreFactory,
>(
    factory: &F,
) {
    let mut costs: Vec<ReadCost> = Vec::new();
    for (pool, blocks) in [("10.64.0.0/24", 64), ("10.64.0.0/20", 1024)] {
        let t = filled_pool(factory, pool, blocks, |_| 1).await;
        let meter = ReadMeter::new(Arc::clone(&t.store));
        let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
        meter.take();
        let proving = ipam
            .auto_assign(&v4("new-a", "new-node-a", 1))
            .await
            .expect("the first new node's ADD");
        let proof = meter.take();
        assert!(
            proof.keys > u64::from(blocks),
            "the first ADD lists the whole claim index ({blocks} entries): {proof:?}"
        );
        assert!(
            marked(&t.store, "pool").await,
            "the first ADD marked the pool full"
        );
        assert_ne!(
            block_host(&ipam, proving.v4[0].ip).await.as_deref(),
            Some("new-node-a")
        );
        meter.take();
        let got = ipam
            .auto_assign(&v4("new-b", "new-node-b", 1))
            .await
            .expect("the next new node's ADD");
        let cost = meter.take();
        let lender = block_host(&ipam, got.v4[0].ip).await;
        assert!(
            lender.as_deref().is_some_and(|h| h.starts_with("filler-")),
            "the next new node borrowed from a filler: {lender:?}"
        );
        assert_eq!(
            (cost.round_trips, cost.commits),
            (3, 1),
            "with {blocks} blocks: the first read, the new-block probe with its window, the lender's block; one transaction: {cost:?}"
        );
        assert!(
            cost.keys < 100,
            "with {blocks} blocks the ADD read {} keys: more than a window",
            cost.keys
        );
        costs.push(cost);
        assert_clean(&Ipam::new(Arc::clone(&t.store))).await;
    }
    let (small, large) = (costs[0], costs[1]);
    assert_eq!(
        small.keys, large.keys,
        "keys read grew from 64 to 1,024 blocks: {small:?} then {large:?}"
    );
    assert!(
        large.bytes <= small.bytes + 4 * large.keys,
        "bytes read grew from 64 to 1,024 blocks by more than a few per key: {small:?} then {large:?}"
    );
}

/// After the pool was marked full, a block released through the allocator (its affinity given
/// up while empty: the block is deleted) is claimed by the next new node, not passed over for a
/// borrowed address: the release moved the block-release counter, so the mark is not believed.
pub async fn a_block_released_after_the_pool_was_marked_full_is_claimed_by_the_next_new_node<
    F: StoreFactory,
>(
    factory: &F,
) {
    let t = filled_pool(factory, "10.64.0.0/24", 64, |_| 1).await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    ipam.auto_assign(&v4("new-a", "new-node-a", 1))
        .await
        .expect("the first new node's ADD");
    assert!(marked(&t.store, "pool").await, "the pool is marked full");
    // A filler 56 blocks after where new-node-b's search starts (beyond the 48 claim entries a
    // search reads first) gives its block up: its address goes, then its
    // affinity, and the empty block is deleted.
    let index = (search_start("new-node-b", 64) + 56) % 64;
    ipam.release_handle(&format!("filler.{index:04}"))
        .await
        .expect("release");
    let freed: IpNet = format!("10.64.0.{}/30", index * 4).parse().expect("cidr");
    ipam.release_affinity(&format!("filler-{index:04}"), freed)
        .await
        .expect("release the affinity");
    assert!(
        t.store
            .get(&keys::block_claim(&freed))
            .await
            .expect("read")
            .is_none(),
        "the block is gone"
    );
    let got = ipam
        .auto_assign(&v4("new-b", "new-node-b", 1))
        .await
        .expect("the next new node's ADD");
    assert!(
        freed.contains(&got.v4[0].ip),
        "claimed the freed block: {got:?}"
    );
    assert_eq!(
        block_host(&ipam, got.v4[0].ip).await.as_deref(),
        Some("new-node-b")
    );
    assert_clean(&ipam).await;
}

/// A writer that keeps no marks (the previous release) deletes a block of a pool marked full
/// without moving the block-release counter. The reclaimer's empty-block pass, which reads the
/// whole claim index, sees fewer claimed blocks than the pool holds and moves the counter; a dry
/// run does not. The next new node then claims the free block.
pub async fn a_mark_a_writer_without_marks_made_wrong_is_forgotten_by_the_empty_block_pass<
    F: StoreFactory,
>(
    factory: &F,
) {
    let t = filled_pool(factory, "10.64.0.0/24", 64, |_| 1).await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    // A filler 56 blocks after where new-node-b's search starts (beyond the 48 claim entries a
    // search reads first) has an empty block (kept: it is the filler's newest).
    let index = (search_start("new-node-b", 64) + 56) % 64;
    ipam.release_handle(&format!("filler.{index:04}"))
        .await
        .expect("release");
    ipam.auto_assign(&v4("new-a", "new-node-a", 1))
        .await
        .expect("the first new node's ADD");
    assert!(marked(&t.store, "pool").await, "the pool is marked full");
    // Delete that empty block and its claim entry as a writer without marks would.
    let freed: IpNet = format!("10.64.0.{}/30", index * 4).parse().expect("cidr");
    let block_key = keys::block(Some(&format!("filler-{index:04}")), &freed);
    let stored = t
        .store
        .get(&block_key)
        .await
        .expect("read")
        .expect("the filler's empty block");
    let counter_before = t.store.get(&keys::block_releases()).await.expect("read");
    t.store
        .commit(
            Txn::new()
                .then(Op::delete(stored.key.clone()))
                .then(Op::delete(keys::block_claim(&freed))),
        )
        .await
        .expect("delete the block as an older writer");
    let filter = EmptyBlockFilter {
        older_than_seconds: 0,
        only_unselected: false,
    };
    ipam.release_empty_blocks(filter, false)
        .await
        .expect("dry run");
    assert_eq!(
        t.store.get(&keys::block_releases()).await.expect("read"),
        counter_before,
        "a dry run writes nothing"
    );
    // A store failure on the counter's write is the pass's error, and writes nothing.
    let failing = HookedStore::new(Arc::clone(&t.store));
    failing.refuse_commits(|txn| {
        touches_counter(txn).then(|| KvError::unavailable("the store is unreachable"))
    });
    Ipam::new(failing as Arc<dyn KvStore>)
        .release_empty_blocks(filter, true)
        .await
        .expect_err("the counter's write failed");
    assert_eq!(
        t.store.get(&keys::block_releases()).await.expect("read"),
        counter_before,
        "a failed pass writes nothing"
    );
    ipam.release_empty_blocks(filter, true)
        .await
        .expect("the empty-block pass");
    assert_ne!(
        t.store
            .get(&keys::block_releases())
            .await
            .expect("read")
            .map(|kv| kv.revision),
        counter_before.map(|kv| kv.revision),
        "the pass moved the counter"
    );
    let got = ipam
        .auto_assign(&v4("new-b", "new-node-b", 1))
        .await
        .expect("the next new node's ADD");
    assert!(
        freed.contains(&got.v4[0].ip),
        "claimed the freed block: {got:?}"
    );
    // A pass that finds the marks right moves nothing.
    ipam.auto_assign(&v4("new-c", "new-node-c", 1))
        .await
        .expect("a new node's ADD in the full pool again");
    assert!(marked(&t.store, "pool").await, "marked full again");
    let counter = t.store.get(&keys::block_releases()).await.expect("read");
    ipam.release_empty_blocks(filter, true)
        .await
        .expect("the empty-block pass");
    assert_eq!(
        t.store.get(&keys::block_releases()).await.expect("read"),
        counter,
        "marks that are right are left alone"
    );
    // Made wrong again (another filler's emptied block deleted without the counter), the pass
    // races a release that moves the counter between its read and its write: its write,
    // conditioned on the counter as read, conflicts, and the pass goes on without an error.
    let again = (index + 1) % 64;
    ipam.release_handle(&format!("filler.{again:04}"))
        .await
        .expect("release");
    let emptied: IpNet = format!("10.64.0.{}/30", again * 4).parse().expect("cidr");
    t.store
        .commit(
            Txn::new()
                .then(Op::delete(keys::block(
                    Some(&format!("filler-{again:04}")),
                    &emptied,
                )))
                .then(Op::delete(keys::block_claim(&emptied))),
        )
        .await
        .expect("delete the block as an older writer");
    let racing = HookedStore::new(Arc::clone(&t.store));
    let other = Arc::clone(&t.store);
    racing.before_commit(touches_counter, move || async move {
        other
            .put(&keys::block_releases(), b"{}".to_vec())
            .await
            .expect("another writer's release");
    });
    Ipam::new(racing.clone() as Arc<dyn KvStore>)
        .release_empty_blocks(filter, true)
        .await
        .expect("a counter moved meanwhile is no error");
    assert!(racing.commit_hook_fired(), "the pass wrote the counter");
    assert_eq!(racing.conflicts(), 1, "and lost to the other writer");
    assert_clean(&ipam).await;
}

/// True when `txn` writes the block-release counter.
fn touches_counter(txn: &Txn) -> bool {
    txn.ops.iter().any(|op| op.key() == keys::block_releases())
}

/// In a pool marked full whose blocks are all full but one, far from where the new nodes' windows
/// start, every new node still gets an address: a window without room sends the search to the
/// whole claim index, which finds the block with room.
pub async fn a_window_without_room_falls_back_to_the_whole_claim_index<F: StoreFactory>(
    factory: &F,
) {
    // Block 700 keeps three free addresses; every other block is full.
    let t = filled_pool(factory, "10.64.0.0/20", 1024, |block| {
        if block == 700 {
            1
        } else {
            4
        }
    })
    .await;
    let meter = ReadMeter::new(Arc::clone(&t.store));
    let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
    let room: IpNet = "10.64.10.240/30".parse().expect("cidr");
    let mut fell_back = 0;
    for node in ["new-node-a", "new-node-b", "new-node-c"] {
        meter.take();
        let got = ipam
            .auto_assign(&v4(&format!("{node}-pod"), node, 1))
            .await
            .unwrap_or_else(|e| panic!("{node}'s ADD: {e}"));
        let cost = meter.take();
        assert!(
            room.contains(&got.v4[0].ip),
            "{node} borrowed from the block with room: {got:?}"
        );
        if cost.keys > 1024 {
            fell_back += 1;
        }
    }
    assert!(marked(&t.store, "pool").await, "the pool is marked full");
    assert!(
        fell_back >= 2,
        "the nodes after the first believed the mark, found no room in their window and read the whole index: {fell_back} of 3 read it"
    );
    let exhausted = ipam
        .auto_assign(&v4("new-d-pod", "new-node-d", 1))
        .await
        .expect_err("no address left");
    assert!(
        matches!(exhausted, ipam_core::IpamError::Exhausted { .. }),
        "{exhausted}"
    );
    assert_clean(&Ipam::new(Arc::clone(&t.store))).await;
}

/// In a pool of 1,024 blocks of which one in twenty is unclaimed, none of them among the 16 blocks
/// a new node probes first, the node claims an unclaimed block among the 32 that follow (the
/// window, read by key in the same batch), without listing the whole index.
pub async fn a_new_node_in_a_nearly_full_pool_claims_an_unclaimed_block_of_its_window<
    F: StoreFactory,
>(
    factory: &F,
) {
    let node = "new-node-a";
    let blocks = 1024;
    let start = search_start(node, u64::from(blocks)) as u32;
    let probed = |block: u32| (block + blocks - start) % blocks < 16;
    let t = partly_claimed_pool(factory, "10.64.0.0/20", blocks, |block| {
        block % 20 != 7 || probed(block)
    })
    .await;
    let meter = ReadMeter::new(Arc::clone(&t.store));
    let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
    meter.take();
    let got = ipam
        .auto_assign(&v4("new-a", node, 1))
        .await
        .expect("the new node's ADD");
    let cost = meter.take();
    let block = got.v4[0].block;
    assert_eq!(
        block_host(&ipam, got.v4[0].ip).await.as_deref(),
        Some(node),
        "claimed a block of its own: {got:?}"
    );
    let index = (u32::from(match block.network() {
        IpAddr::V4(a) => a,
        IpAddr::V6(_) => unreachable!("an IPv4 pool"),
    }) - u32::from(std::net::Ipv4Addr::new(10, 64, 0, 0)))
        / 4;
    assert!(
        index % 20 == 7 && !probed(index),
        "an unclaimed block the probes did not reach: {block}"
    );
    assert_eq!(
        (cost.round_trips, cost.commits),
        (2, 1),
        "the first read and the probe with its window; one transaction: {cost:?}"
    );
    assert!(
        cost.keys < 100,
        "read {} keys: more than the probes and a window",
        cost.keys
    );
    assert!(
        !marked(&t.store, "pool").await,
        "a pool with unclaimed blocks is not marked full"
    );
    assert_clean(&Ipam::new(Arc::clone(&t.store))).await;
}

/// A pool whose only unclaimed block is wholly reserved is full for every search (searches skip
/// such blocks): the empty-block pass keeps its mark, so borrowing ADDs go on reading a window
/// rather than listing the whole index after every pass. Once the reservation leaves room in the
/// block, the same pass retires the mark and the next new node claims the block.
pub async fn a_pool_whose_only_unclaimed_block_is_reserved_stays_marked_through_the_empty_block_pass<
    F: StoreFactory,
>(
    factory: &F,
) {
    // The unclaimed block lies 56 blocks after where new-node-a's search starts: beyond the 48
    // claim entries a search reads first, so only a listing of the whole index finds it.
    let index = (search_start("new-node-a", 64) + 56) % 64;
    let t = partly_claimed_pool(factory, "10.64.0.0/24", 64, |b| u64::from(b) != index).await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    let unclaimed: IpNet = format!("10.64.0.{}/30", index * 4).parse().expect("cidr");
    ipam.add_reservation(&Reservation {
        name: "vips".into(),
        cidrs: vec![unclaimed],
    })
    .await
    .expect("reserve the unclaimed block");
    let got = ipam
        .auto_assign(&v4("new-a", "new-node-a", 1))
        .await
        .expect("the first new node's ADD");
    assert!(!unclaimed.contains(&got.v4[0].ip), "borrowed: {got:?}");
    assert!(marked(&t.store, "pool").await, "the pool is marked full");
    let filter = EmptyBlockFilter {
        older_than_seconds: 0,
        only_unselected: false,
    };
    ipam.release_empty_blocks(filter, true)
        .await
        .expect("the empty-block pass");
    assert_eq!(
        t.store.get(&keys::block_releases()).await.expect("read"),
        None,
        "the pass kept the mark: the only unclaimed block is wholly reserved"
    );
    // The reservation goes: the block is claimable, and the pass says so.
    ipam.delete_reservation("vips")
        .await
        .expect("delete the reservation");
    ipam.release_empty_blocks(filter, true)
        .await
        .expect("the empty-block pass");
    assert!(
        t.store
            .get(&keys::block_releases())
            .await
            .expect("read")
            .is_some(),
        "the pass retired the mark: the unclaimed block has room now"
    );
    let got = ipam
        .auto_assign(&v4("new-b", "new-node-b", 1))
        .await
        .expect("the next new node's ADD");
    assert!(
        unclaimed.contains(&got.v4[0].ip),
        "claimed the block the reservation left: {got:?}"
    );
    assert_clean(&ipam).await;
}

/// A new node's ADD that finds no unclaimed block in two pools, one of them holding blocks of two
/// sizes (its block size changed), borrows and marks only the other pool full: in a pool of mixed
/// sizes an unclaimed CIDR of the current size may overlap an older block, so "no unclaimed block
/// found" proves nothing there.
pub async fn a_pool_of_mixed_block_sizes_is_never_marked_full<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    for (cidr, name) in [("10.50.0.0/28", "plain"), ("10.51.0.0/28", "mixed")] {
        ipam.create_pool(&spec(cidr, name, 30))
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e}"));
    }
    // node-a claims all eight /30 blocks and fills them but for one address.
    for n in 0..31 {
        ipam.auto_assign(&v4(&format!("pod-{n}"), "node-a", 1))
            .await
            .unwrap_or_else(|e| panic!("ADD of pod {n} on node-a: {e}"));
    }
    let change = ipam_core::PoolChange {
        block_size: Some(29),
        ..ipam_core::PoolChange::default()
    };
    ipam.set_pool("mixed", &change)
        .await
        .expect("a larger block size for the mixed pool");
    assert!(!marked(&t.store, "plain").await && !marked(&t.store, "mixed").await);

    let got = ipam
        .auto_assign(&v4("pod-b", "node-b", 1))
        .await
        .expect("node-b borrows the last address");
    assert_eq!(got.v4.len(), 1);
    assert!(
        marked(&t.store, "plain").await,
        "the pool without mixed sizes, every block claimed, is not marked full"
    );
    assert!(
        !marked(&t.store, "mixed").await,
        "the pool of mixed block sizes is marked full"
    );
    assert_clean(&ipam).await;
}

/// A borrowing ADD reads only as many lenders' blocks as the addresses it still misses need
/// (the claim index says how many each has free): here, after one address from its own block,
/// two lenders with one free address each of the seven in the pool.
pub async fn a_borrowing_add_reads_only_as_many_lenders_as_it_needs<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let maker = Ipam::new(Arc::clone(&t.store));
    // Eight /30 blocks, one per node, each with three of its four addresses in use.
    maker
        .create_pool(&spec("10.60.0.0/27", "pool", 30))
        .await
        .expect("create pool");
    let nodes: Vec<String> = (0..8).map(|n| format!("node-{n}")).collect();
    for node in &nodes {
        let got = maker
            .auto_assign(&v4(&format!("{node}-pods"), node, 3))
            .await
            .unwrap_or_else(|e| panic!("three addresses on {node}: {e}"));
        assert_eq!(got.v4.len(), 3);
    }
    let borrower = &nodes[0];
    let meter = ReadMeter::recording_keys(Arc::clone(&t.store));
    let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
    meter.take_keys();
    let got = ipam
        .auto_assign(&v4("more", borrower, 3))
        .await
        .expect("one own address and two borrowed");
    let read = meter.take_keys();
    let lenders: std::collections::BTreeSet<&String> = read
        .iter()
        .filter(|key| {
            key.starts_with(&keys::affine_blocks_dir())
                && !key.starts_with(&keys::host_blocks_dir(borrower))
        })
        .collect();
    assert_eq!(
        lenders.len(),
        2,
        "{got:?}: the borrowing ADD read these blocks of other nodes: {lenders:#?}"
    );
    let borrowed = got
        .v4
        .iter()
        .filter(|a| {
            lenders
                .iter()
                .any(|key| key.ends_with(&keys::cidr_segment(&a.block)))
        })
        .count();
    assert_eq!(borrowed, 2, "{got:?} from {lenders:#?}");
    assert_clean(&ipam).await;
}

/// A host's first block, in an empty pool, is the one at its hashed start (Calico's way: hosts
/// spread over the pool and the same host name lands in the same place in every store).
pub async fn a_hosts_first_block_is_the_one_at_its_hashed_start<F: StoreFactory>(factory: &F) {
    let pool: IpNet = "10.70.0.0/22".parse().expect("pool");
    let blocks = 64u64; // /28 blocks in a /22
    let mut starts = std::collections::BTreeSet::new();
    for host in [
        "node-a",
        "node-b",
        "worker-17",
        "n",
        "ip-10-0-3-4.ec2.internal",
    ] {
        let t = factory.fresh().await;
        let ipam = Ipam::new(Arc::clone(&t.store));
        ipam.create_pool(&spec(&pool.to_string(), "pool", 28))
            .await
            .expect("create pool");
        let got = ipam
            .auto_assign(&v4("pod", host, 1))
            .await
            .unwrap_or_else(|e| panic!("ADD on {host}: {e}"));
        let start = search_start(host, blocks);
        let IpAddr::V4(network) = pool.network() else {
            panic!("an IPv4 pool");
        };
        let expected: IpNet = format!(
            "{}/28",
            std::net::Ipv4Addr::from(u32::from(network) + 16 * start as u32)
        )
        .parse()
        .expect("block");
        assert_eq!(got.v4[0].block, expected, "{host}'s first block");
        starts.insert(start);
    }
    assert!(
        starts.len() > 1,
        "the hosts should not all start at one block: {starts:?}"
    );
}

/// A new node whose probes and window (the 48 claim entries from its hashed start) find every
/// block claimed lists the claim index and takes the first unclaimed block counting on from the
/// same start, wrapping around, as its first probes would have: a host's blocks stay where its
/// later probes look, whichever way the rest of the pool is taken.
pub async fn a_search_past_the_window_takes_the_first_unclaimed_block_from_the_hosts_start<
    F: StoreFactory,
>(
    factory: &F,
) {
    // Every block of the window, and beyond it one in three: unclaimed blocks scattered.
    takes_the_first_block_with_room_after_its_window(
        factory,
        |after_start| after_start < 48 || after_start % 3 == 0,
        |_| false,
    )
    .await;
}

/// As above, when the 52 blocks after the window are wholly reserved and the rest claimed but for
/// two: the search's first steps (one more than the claimed blocks) find no block it may use, so
/// it scans on to the end of the pool, counting on from the start and wrapping around.
pub async fn a_search_past_reserved_blocks_takes_the_first_unclaimed_block_from_the_hosts_start<
    F: StoreFactory,
>(
    factory: &F,
) {
    takes_the_first_block_with_room_after_its_window(
        factory,
        |after_start| {
            after_start < 48 || (after_start >= 100 && ![101, 126].contains(&after_start))
        },
        |after_start| (48..100).contains(&after_start),
    )
    .await;
}

/// The window cases: a pool of 128 /30 blocks, those `claimed` and `reserved` say (by their
/// distance from where node-a's search starts) claimed by filler nodes or wholly reserved;
/// node-a's first ADD lists the claim index and claims the first block neither claimed nor
/// reserved, counting on from its start.
async fn takes_the_first_block_with_room_after_its_window<F: StoreFactory>(
    factory: &F,
    claimed: impl Fn(u32) -> bool,
    reserved: impl Fn(u32) -> bool,
) {
    let node = "node-a";
    let blocks = 128; // /30 blocks in a /23
    let start = search_start(node, u64::from(blocks)) as u32;
    let after_start = |block: u32| (block + blocks - start) % blocks;
    let t = partly_claimed_pool(factory, "10.66.0.0/23", blocks, |block| {
        claimed(after_start(block))
    })
    .await;
    let first = u32::from(std::net::Ipv4Addr::new(10, 66, 0, 0));
    let cidr_of = |block: u32| -> IpNet {
        format!("{}/30", std::net::Ipv4Addr::from(first + block * 4))
            .parse()
            .expect("block")
    };
    let reserved_blocks: Vec<IpNet> = (0..blocks)
        .filter(|block| reserved(after_start(*block)))
        .map(cidr_of)
        .collect();
    if !reserved_blocks.is_empty() {
        Ipam::new(Arc::clone(&t.store))
            .add_reservation(&Reservation {
                name: "whole-blocks".into(),
                cidrs: reserved_blocks,
            })
            .await
            .expect("reserve blocks");
    }
    let expected = (0..blocks)
        .map(|step| (start + step) % blocks)
        .find(|block| !claimed(after_start(*block)) && !reserved(after_start(*block)))
        .map(cidr_of)
        .expect("an unclaimed block");
    // A claimed block beyond the window: only a listing of the claim index returns its entry.
    let beyond_window = (0..blocks)
        .find(|block| after_start(*block) >= 48 && claimed(after_start(*block)))
        .map(cidr_of)
        .expect("a claimed block beyond the window");
    let meter = ReadMeter::recording_keys(Arc::clone(&t.store));
    let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
    meter.take_keys();
    let got = ipam
        .auto_assign(&v4("new-a", node, 1))
        .await
        .expect("the new node's ADD");
    let read = meter.take_keys();
    assert!(
        read.contains(&keys::block_claim(&beyond_window)),
        "the ADD found an unclaimed block without listing the claim index: {read:#?}"
    );
    assert_eq!(
        got.v4[0].block, expected,
        "{node}'s new block: the first unclaimed one from its start, block {start}"
    );
    assert_eq!(
        block_host(&ipam, got.v4[0].ip).await.as_deref(),
        Some(node),
        "claimed a block of its own: {got:?}"
    );
    assert_clean(&Ipam::new(Arc::clone(&t.store))).await;
}
