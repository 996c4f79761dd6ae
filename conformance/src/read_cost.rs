//! Per-call read cost (issue 25): a steady-state CNI ADD and DEL read the same keys, and about the same bytes, whether the node holds 16 blocks or 1,024.
//!
//! The node's state is made the plugin's way (one address per container, with the attributes the
//! plugin records) on the in-memory store, then copied into the store under test in large
//! transactions, so that 1,024 blocks cost seconds on every backend.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use ipam_core::allocator::leaks::{
    handle_id, Attachment, LeakPolicy, LeakWatch, LiveSandbox, RuntimeView, ATTR_CONTAINER_ID,
    ATTR_INTERFACE,
};
use ipam_core::allocator::{AutoAssignRequest, AutoAssignResult, NamespaceLookup};
use ipam_core::kv::{MAX_TXN_BYTES, MAX_TXN_OPS};
use ipam_core::model::keys;
use ipam_core::{
    AllowedUse, EmptyBlockFilter, Ipam, KeyValue, KvError, KvStore, MemoryStore, Op, Read,
    ReadResult, Revision, Txn,
};

use crate::ipam::{assert_clean, holder, spec};
use crate::StoreFactory;

/// Expands every read-cost case into one `#[test]` inside a module `read_cost`.
#[macro_export]
macro_rules! read_cost_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(read_cost, $crate::read_cost, $factory;
            steady_state_add_and_del_read_as_much_with_1024_blocks_on_the_node_as_with_16,
            steady_state_with_block_edges_skipped_reads_as_much_with_1024_blocks_on_the_node_as_with_16,
            del_of_an_address_in_a_full_block_reads_as_much_with_1024_blocks_on_the_node_as_with_16,
            a_new_block_for_an_add_skipping_edges_reads_none_of_the_blocks_full_but_for_their_edges,
            a_leak_look_reads_as_much_with_1024_blocks_of_other_nodes_in_the_store_as_without,
            a_nodes_usage_reads_as_much_with_1024_blocks_of_other_nodes_in_the_store_as_without,
            a_new_nodes_block_prospect_reads_as_much_with_1024_blocks_of_other_nodes_and_names_the_block_its_add_claims,
            a_borrowing_nodes_first_lender_with_room_is_the_block_its_add_borrows_from,
            past_its_probe_a_node_finds_the_block_its_add_takes_in_the_claim_index_reading_no_other_block,
            a_borrowing_add_among_blocks_full_but_for_their_edges_reads_them_in_doubling_batches,
            a_steady_add_on_a_network_set_up_is_one_read_and_one_transaction,
            the_release_of_empty_blocks_reads_only_the_blocks_of_nodes_that_have_an_empty_one,
        );
    };
}

/// The network name the plugin records (and builds handles from).
const NETWORK: &str = "k8s-pod-network";
/// The pool: 2,048 blocks of four addresses, room for both nodes.
const POOL: &str = "10.64.0.0/19";
/// Four addresses per block: 1,024 mostly full blocks stay a few thousand allocations.
const BLOCK_SIZE: u8 = 30;
/// Addresses in one block of [`BLOCK_SIZE`].
const BLOCK_ADDRESSES: u32 = 4;
/// The two nodes, names of one length, and how many blocks each holds.
const SMALL_NODE: (&str, u32) = ("node-0016", 16);
const LARGE_NODE: (&str, u32) = ("node-1024", 1024);
/// What the two nodes' reads may differ by: the same keys, whose text (a block's CIDR, a pod's
/// name) differs by a few bytes. One full block's value is over a kilobyte here, so one more
/// block read is more than this.
const BYTES_SLACK: u64 = 256;

/// What reads brought back, and how many calls reached the store.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReadCost {
    /// Reads (`get`, `list`, or one `read_many` batch).
    pub round_trips: u64,
    /// Transactions.
    pub commits: u64,
    /// Keys returned (a `get` that found nothing returns none).
    pub keys: u64,
    /// Bytes of the keys and values returned.
    pub bytes: u64,
}

/// Passes every call through and tallies what reads return (benchmarks use it too).
#[derive(Debug)]
pub struct ReadMeter {
    inner: Arc<dyn KvStore>,
    tally: Mutex<ReadCost>,
    /// The keys reads returned, in order, when made with [`ReadMeter::recording_keys`].
    keys_read: Mutex<Option<Vec<String>>>,
}

impl ReadMeter {
    /// A meter in front of `inner`, its tally at zero.
    pub fn new(inner: Arc<dyn KvStore>) -> Arc<Self> {
        Arc::new(ReadMeter {
            inner,
            tally: Mutex::new(ReadCost::default()),
            keys_read: Mutex::new(None),
        })
    }

    /// A meter that also records every key its reads return ([`ReadMeter::take_keys`]).
    pub fn recording_keys(inner: Arc<dyn KvStore>) -> Arc<Self> {
        Arc::new(ReadMeter {
            inner,
            tally: Mutex::new(ReadCost::default()),
            keys_read: Mutex::new(Some(Vec::new())),
        })
    }

    /// The keys reads returned since the last call (none unless made with
    /// [`ReadMeter::recording_keys`]).
    pub fn take_keys(&self) -> Vec<String> {
        self.keys_read
            .lock()
            .expect("keys read")
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// The tally so far, starting again from zero.
    pub fn take(&self) -> ReadCost {
        std::mem::take(&mut *self.tally.lock().expect("tally"))
    }

    fn count<'a>(&self, returned: impl Iterator<Item = &'a KeyValue>) {
        let mut tally = self.tally.lock().expect("tally");
        let mut keys_read = self.keys_read.lock().expect("keys read");
        tally.round_trips += 1;
        for kv in returned {
            tally.keys += 1;
            tally.bytes += (kv.key.len() + kv.value.len()) as u64;
            if let Some(keys) = keys_read.as_mut() {
                keys.push(kv.key.clone());
            }
        }
    }
}

#[async_trait]
impl KvStore for ReadMeter {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        let got = self.inner.get(key).await?;
        self.count(got.iter());
        Ok(got)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        let listed = self.inner.list(prefix).await?;
        self.count(listed.iter());
        Ok(listed)
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        self.tally.lock().expect("tally").commits += 1;
        self.inner.commit(txn).await
    }

    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        let results = self.inner.read_many(reads).await?;
        self.count(results.iter().flat_map(|result| match result {
            ReadResult::Got(got) => got.iter().collect::<Vec<_>>(),
            ReadResult::Listed(listed) => listed.iter().collect(),
        }));
        Ok(results)
    }
}

/// The `n`th container on node `node`: a 64-hex id, as runtimes name sandboxes.
pub fn container_id(node: &str, n: u32) -> String {
    let tag = node
        .bytes()
        .fold(0u64, |h, b| h.wrapping_mul(31) ^ u64::from(b));
    format!("{:032x}{:032x}", u128::from(tag), n)
}

/// The plugin's ADD for the `n`th pod on `node`: the handle and attributes it records, one
/// address, the pod's namespace looked up.
pub fn pod_add(node: &str, n: u32) -> AutoAssignRequest {
    let container = container_id(node, n);
    let namespace = format!("team-{:03}", n % 97);
    AutoAssignRequest {
        handle: handle_id(NETWORK, &container),
        host: node.to_owned(),
        num_v4: 1,
        attributes: Attachment {
            network: NETWORK,
            container_id: &container,
            interface: "eth0",
            namespace: Some(&namespace),
            pod: Some(&format!("frontend-7d9f8b6c5-{n:05}-{node}")),
        }
        .attributes("2026-11-24T04:30:00Z"),
        reuse_existing: true,
        namespace: Some(NamespaceLookup {
            namespace,
            v4: true,
            v6: true,
        }),
        purpose: AllowedUse::Workload,
        ..Default::default()
    }
}

/// [`pod_add`] as the plugin sends it when its netconf has no gateway (its default): addresses
/// are reported with the block's prefix, so a block's network and last address are never taken.
pub fn pod_add_skipping_edges(node: &str, n: u32) -> AutoAssignRequest {
    AutoAssignRequest {
        skip_block_edges: true,
        ..pod_add(node, n)
    }
}

/// Whether a node's pods were added taking block edges (a gateway in the netconf) or skipping
/// them (the plugin's default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Edges {
    Taken,
    Skipped,
}

impl Edges {
    fn add(self, node: &str, n: u32) -> AutoAssignRequest {
        match self {
            Edges::Taken => pod_add(node, n),
            Edges::Skipped => pod_add_skipping_edges(node, n),
        }
    }

    /// Addresses of one block a pod may get.
    fn usable_per_block(self) -> u32 {
        match self {
            Edges::Taken => BLOCK_ADDRESSES,
            Edges::Skipped => BLOCK_ADDRESSES - 2,
        }
    }
}

/// The plugin's DEL of the `n`th pod on `node`: its handle's addresses on `eth0` released.
async fn pod_del(ipam: &Ipam, node: &str, n: u32) {
    let released = ipam
        .release_chosen(&handle_id(NETWORK, &container_id(node, n)), node, |held| {
            held.iter()
                .filter(|info| {
                    info.attributes.get(ATTR_INTERFACE).map(String::as_str) == Some("eth0")
                })
                .map(|info| info.ip)
                .collect()
        })
        .await
        .unwrap_or_else(|e| panic!("DEL of pod {n} on {node}: {e}"));
    assert_eq!(released.released.len(), 1, "DEL of pod {n} on {node}");
}

/// A store holding both nodes, each with its blocks full but the last, which has two of its
/// four addresses in use (with `edges` skipped: one of its two host addresses): made on the
/// in-memory store, copied in transactions as large as the storage contract allows. A block whose
/// only free addresses are its edges counts as full (it is stored under `full/`).
async fn two_nodes<F: StoreFactory>(factory: &F, edges: Edges) -> crate::TestStore {
    let (memory, maker) = memory_maker().await;
    for (node, blocks) in [SMALL_NODE, LARGE_NODE] {
        fill_node_with(&maker, node, blocks, edges).await;
    }
    let t = factory.fresh().await;
    copy_store(&memory, &t.store).await;
    for (node, blocks) in [SMALL_NODE, LARGE_NODE] {
        let full = t
            .store
            .list(&keys::host_full_blocks_dir(node))
            .await
            .expect("list full blocks");
        let open = t
            .store
            .list(&keys::host_open_blocks_dir(node))
            .await
            .expect("list open blocks");
        assert_eq!(
            (full.len(), open.len()),
            (blocks as usize - 1, 1),
            "{node}: full and open blocks"
        );
    }
    t
}

/// The in-memory store the nodes are made on, with the pool and no per-node block limit.
async fn memory_maker() -> (Arc<dyn KvStore>, Ipam) {
    let memory: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let maker = Ipam::new(Arc::clone(&memory));
    maker
        .create_pool(&spec(POOL, "pool", BLOCK_SIZE))
        .await
        .expect("create pool");
    maker
        .update_config(|c| c.max_blocks_per_host = 0)
        .await
        .expect("no per-node block limit");
    (memory, maker)
}

/// `blocks` blocks of `node`, full but the last, which has two of its addresses in use.
async fn fill_node(maker: &Ipam, node: &str, blocks: u32) {
    fill_node_with(maker, node, blocks, Edges::Taken).await;
}

/// `blocks` blocks of `node`, full (but for their edges when `edges` are skipped) but the last,
/// which has room for one pod more (two when edges are taken).
async fn fill_node_with(maker: &Ipam, node: &str, blocks: u32, edges: Edges) {
    for n in 0..pods_filled(blocks, edges) {
        maker
            .auto_assign(&edges.add(node, n))
            .await
            .unwrap_or_else(|e| panic!("ADD of pod {n} on {node}: {e}"));
    }
}

/// How many pods [`fill_node_with`] adds.
fn pods_filled(blocks: u32, edges: Edges) -> u32 {
    match edges {
        Edges::Taken => blocks * BLOCK_ADDRESSES - 2,
        Edges::Skipped => blocks * edges.usable_per_block() - 1,
    }
}

/// The small node's blocks, made on the in-memory store and copied into a fresh store under test,
/// with an allocator reading it through a meter.
struct SmallNodeStore {
    memory: Arc<dyn KvStore>,
    maker: Ipam,
    t: crate::TestStore,
    meter: Arc<ReadMeter>,
    ipam: Ipam,
}

impl SmallNodeStore {
    async fn new<F: StoreFactory>(factory: &F) -> Self {
        let (memory, maker) = memory_maker().await;
        let (node, blocks) = SMALL_NODE;
        fill_node(&maker, node, blocks).await;
        let t = factory.fresh().await;
        copy_store(&memory, &t.store).await;
        let meter = ReadMeter::new(Arc::clone(&t.store));
        let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
        SmallNodeStore {
            memory,
            maker,
            t,
            meter,
            ipam,
        }
    }

    /// The large node's 1,024 blocks join the store under test.
    async fn add_the_large_node(&self) {
        let (other, other_blocks) = LARGE_NODE;
        fill_node(&self.maker, other, other_blocks).await;
        copy_store(&self.memory, &self.t.store).await;
    }
}

/// Copies every key of `from` into `to`, in transactions as large as the storage contract allows.
async fn copy_store(from: &Arc<dyn KvStore>, to: &Arc<dyn KvStore>) {
    let everything = from.list("").await.expect("list the made store");
    let mut txn = Txn::new();
    let mut txn_bytes = 0;
    for kv in everything {
        let size = kv.key.len() + kv.value.len();
        if txn.ops.len() == MAX_TXN_OPS || txn_bytes + size > MAX_TXN_BYTES / 2 {
            to.commit(std::mem::take(&mut txn)).await.expect("copy");
            txn_bytes = 0;
        }
        txn_bytes += size;
        txn = txn.then(Op::put(kv.key, kv.value));
    }
    to.commit(txn).await.expect("copy");
}

/// Asserts the two nodes' costs of one call are the same round trips, commits and keys, and
/// bytes within [`BYTES_SLACK`].
fn assert_flat(call: &str, small: ReadCost, large: ReadCost) {
    assert_eq!(
        (small.round_trips, small.commits, small.keys),
        (large.round_trips, large.commits, large.keys),
        "{call}: round trips, commits and keys read grew from {} to {} blocks on the node: {small:?} then {large:?}",
        SMALL_NODE.1,
        LARGE_NODE.1
    );
    assert!(
        large.bytes.abs_diff(small.bytes) <= BYTES_SLACK,
        "{call}: bytes read went from {} with {} blocks on the node to {} with {}",
        small.bytes,
        SMALL_NODE.1,
        large.bytes,
        LARGE_NODE.1
    );
}

/// Issue 25: one steady-state ADD (the node's open block has room) and the DEL of that pod read
/// the same keys, and the same bytes but for a few, with 16 blocks on the node and with 1,024,
/// and each is one read and one transaction.
pub async fn steady_state_add_and_del_read_as_much_with_1024_blocks_on_the_node_as_with_16<
    F: StoreFactory,
>(
    factory: &F,
) {
    let t = two_nodes(factory, Edges::Taken).await;
    let meter = ReadMeter::new(Arc::clone(&t.store));
    let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
    let mut costs = Vec::new();
    for (node, blocks) in [SMALL_NODE, LARGE_NODE] {
        let probe = blocks * BLOCK_ADDRESSES;
        meter.take();
        ipam.auto_assign(&pod_add(node, probe))
            .await
            .unwrap_or_else(|e| panic!("ADD on {node}: {e}"));
        let add = meter.take();
        pod_del(&ipam, node, probe).await;
        let del = meter.take();
        for (call, cost) in [("ADD", add), ("DEL", del)] {
            assert_eq!(
                (cost.round_trips, cost.commits),
                (1, 1),
                "steady-state {call} on {node}: {cost:?}"
            );
        }
        costs.push((add, del));
    }
    assert_flat("steady-state ADD", costs[0].0, costs[1].0);
    assert_flat("steady-state DEL", costs[0].1, costs[1].1);
    assert_clean(&Ipam::new(Arc::clone(&t.store))).await;
}

/// Issue 25, with the plugin's default netconf (no gateway, so block edges are never handed out):
/// a block filled up to its edges is stored as full, so the steady-state DEL (of the last pod
/// added) and the ADD that follows read the same keys, and the same bytes but for a few, with 16
/// blocks on the node and with 1,024, one read and one transaction each. (Before, every such
/// block stayed among the node's blocks with room, and both calls read all of them.)
pub async fn steady_state_with_block_edges_skipped_reads_as_much_with_1024_blocks_on_the_node_as_with_16<
    F: StoreFactory,
>(
    factory: &F,
) {
    let edges = Edges::Skipped;
    let t = two_nodes(factory, edges).await;
    let meter = ReadMeter::new(Arc::clone(&t.store));
    let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
    let mut costs = Vec::new();
    for (node, blocks) in [SMALL_NODE, LARGE_NODE] {
        let last = pods_filled(blocks, edges) - 1;
        meter.take();
        pod_del(&ipam, node, last).await;
        let del = meter.take();
        ipam.auto_assign(&edges.add(node, blocks * BLOCK_ADDRESSES))
            .await
            .unwrap_or_else(|e| panic!("ADD on {node}: {e}"));
        let add = meter.take();
        for (call, cost) in [("DEL", del), ("ADD", add)] {
            assert_eq!(
                (cost.round_trips, cost.commits),
                (1, 1),
                "steady-state {call} on {node}: {cost:?}"
            );
        }
        costs.push((add, del));
    }
    assert_flat("steady-state ADD, edges skipped", costs[0].0, costs[1].0);
    assert_flat("steady-state DEL, edges skipped", costs[0].1, costs[1].1);
    assert_clean(&Ipam::new(Arc::clone(&t.store))).await;
}

/// Issue 25: the DEL of a pod whose address lies in one of the node's full blocks reads that
/// block by key (one read more than the steady state), never every block of the node: the same
/// keys, and the same bytes but for a few, with 16 blocks on the node and with 1,024.
pub async fn del_of_an_address_in_a_full_block_reads_as_much_with_1024_blocks_on_the_node_as_with_16<
    F: StoreFactory,
>(
    factory: &F,
) {
    let t = two_nodes(factory, Edges::Taken).await;
    let meter = ReadMeter::new(Arc::clone(&t.store));
    let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
    let mut costs = Vec::new();
    for (node, _) in [SMALL_NODE, LARGE_NODE] {
        meter.take();
        // The node's first pod: its block filled long ago.
        pod_del(&ipam, node, 0).await;
        let del = meter.take();
        assert_eq!(
            (del.round_trips, del.commits),
            (2, 1),
            "DEL from a full block on {node}: {del:?}"
        );
        costs.push(del);
    }
    assert_flat("DEL from a full block", costs[0], costs[1]);
    assert_clean(&Ipam::new(Arc::clone(&t.store))).await;
}

/// A node agent's leak look after its first (which reads the whole store once) reads the node's
/// own blocks and its borrowed-block index: the same keys, and the same bytes, whether the rest
/// of the store holds nothing or 1,024 blocks of another node, full of pods' attributes. The
/// first look of an agent, a survey, reads those blocks too.
pub async fn a_leak_look_reads_as_much_with_1024_blocks_of_other_nodes_in_the_store_as_without<
    F: StoreFactory,
>(
    factory: &F,
) {
    let small = SmallNodeStore::new(factory).await;
    let (t, meter, ipam) = (&small.t, &small.meter, &small.ipam);
    let (node, blocks) = SMALL_NODE;
    // Pod 1 runs; every other pod of the node is gone.
    let live = ipam
        .list_allocations()
        .await
        .expect("list")
        .into_iter()
        .find(|a| a.attributes.get(ATTR_CONTAINER_ID) == Some(&container_id(node, 1)))
        .expect("pod 1's address");
    let view = |at| RuntimeView {
        observed_at: at,
        sandboxes: BTreeMap::from([(
            container_id(node, 1),
            LiveSandbox {
                pod: "frontend".into(),
                namespace: "team-001".into(),
                uid: "uid-1".into(),
                addresses: vec![live.ip],
            },
        )]),
    };
    let policy = LeakPolicy {
        grace_seconds: 900,
        max_gap_seconds: 900,
    };
    let mut looks = Vec::new();
    let mut surveys = Vec::new();
    for round in 0..2u64 {
        if round == 1 {
            // 1,024 blocks of another node join the store.
            small.add_the_large_node().await;
        }
        let at = 1_800_000_000 + round * 10_000;
        let mut watch = LeakWatch::new();
        meter.take();
        let first = ipam
            .look_for_leaks(node, &view(at), &mut watch, policy)
            .await
            .expect("first look");
        surveys.push(meter.take());
        assert!(watch.last_look_surveyed());
        let second = ipam
            .look_for_leaks(node, &view(at + 60), &mut watch, policy)
            .await
            .expect("second look");
        let cost = meter.take();
        assert!(!watch.last_look_surveyed());
        assert_eq!(
            (first.live, first.waiting.len()),
            (second.live, second.waiting.len()),
            "both looks judge the node's allocations alike"
        );
        assert_eq!(second.live, 1);
        assert_eq!(second.waiting.len() as u32, blocks * BLOCK_ADDRESSES - 3);
        assert_eq!(
            cost.commits, 0,
            "a look with nothing to index writes nothing"
        );
        looks.push(cost);
    }
    assert_eq!(
        (looks[0].round_trips, looks[0].keys, looks[0].bytes),
        (looks[1].round_trips, looks[1].keys, looks[1].bytes),
        "a look's reads grew with the other node's blocks: {:?} then {:?}",
        looks[0],
        looks[1]
    );
    assert!(
        surveys[1].keys >= surveys[0].keys + u64::from(LARGE_NODE.1),
        "an agent's first look reads every block: {:?} then {:?}",
        surveys[0],
        surveys[1]
    );
    assert_clean(&Ipam::new(Arc::clone(&t.store))).await;
}

/// The usage of a node's blocks with room (what CNI STATUS reads first, every few seconds on every
/// node) reads the same keys and bytes with 1,024 blocks of another node in the store as without,
/// in one round trip with the config and the node's labels, and gives each such block the row the
/// usage of the whole store gives it; a node object it cannot decode is refused.
pub async fn a_nodes_usage_reads_as_much_with_1024_blocks_of_other_nodes_in_the_store_as_without<
    F: StoreFactory,
>(
    factory: &F,
) {
    let small = SmallNodeStore::new(factory).await;
    let (meter, ipam) = (&small.meter, &small.ipam);
    let node = SMALL_NODE.0;
    let labels = ipam
        .set_node_labels(node, &[("zone".into(), "a".into())], &[])
        .await
        .expect("label the node");
    let config = ipam_core::IpamConfig {
        max_blocks_per_host: 40,
        ..ipam.get_config().await.expect("the config")
    };
    let mut costs = Vec::new();
    let mut whole_costs = Vec::new();
    for round in 0..2 {
        if round == 1 {
            small.add_the_large_node().await;
        }
        // (The large node's store, copied in, holds a config of its own.)
        ipam.set_config(&config).await.expect("a config of its own");
        meter.take();
        let read = ipam.host_utilization(node).await.expect("the node's usage");
        costs.push(meter.take());
        assert_eq!(costs[round].round_trips, 1, "round {round}: one read");
        assert_eq!((&read.config, &read.labels), (&config, &labels));
        let usage = read.usage;
        let whole = ipam.utilization().await.expect("the whole usage");
        whole_costs.push(meter.take());
        let rows: Vec<_> = usage.pools.iter().flat_map(|p| p.blocks.iter()).collect();
        // The last block has two addresses in use; the others are full (kept under `full/`).
        assert_eq!(rows.len(), 1, "round {round}: {rows:?}");
        assert_eq!(rows[0].host.as_deref(), Some(node));
        assert_eq!((rows[0].in_use, rows[0].free), (2, 2));
        let same = whole
            .pools
            .iter()
            .flat_map(|p| p.blocks.iter())
            .find(|b| b.cidr == rows[0].cidr);
        assert_eq!(same, Some(rows[0]), "round {round}: the whole usage's row");
        assert_eq!(
            usage.pools.iter().map(|p| &p.pool).collect::<Vec<_>>(),
            whole.pools.iter().map(|p| &p.pool).collect::<Vec<_>>(),
            "every pool"
        );
        assert!(usage.undecodable.is_empty(), "{:?}", usage.undecodable);
    }
    assert_eq!(
        (costs[0].round_trips, costs[0].keys, costs[0].bytes),
        (costs[1].round_trips, costs[1].keys, costs[1].bytes),
        "the node's usage read more with another node's blocks: {:?} then {:?}",
        costs[0],
        costs[1]
    );
    assert!(
        whole_costs[1].keys >= whole_costs[0].keys + u64::from(LARGE_NODE.1),
        "the whole usage reads every block: {:?} then {:?}",
        whole_costs[0],
        whole_costs[1]
    );
    assert!(matches!(
        ipam.host_utilization("bad/name").await,
        Err(ipam_core::IpamError::InvalidArgument(_))
    ));
    assert_eq!(
        ipam.host_utilization("node-never-labelled")
            .await
            .expect("a node without an object")
            .labels,
        std::collections::BTreeMap::new()
    );
    small
        .t
        .store
        .put(&keys::node_key(node), b"garbage{".to_vec())
        .await
        .expect("damage the node object");
    let refused = ipam.host_utilization(node).await;
    assert!(
        matches!(refused, Err(ipam_core::IpamError::Corrupt { .. })),
        "{refused:?}"
    );
}

/// What the next ADD of a node that must borrow (every block of its pool claimed) finds among the
/// claim entries its new-block search probes: the blocks of other nodes with a free address, in
/// the order it borrows from them, and the first whose block it can take an address from now:
/// past one with only its edges free when edges are skipped, past a reserved address, past a
/// block it cannot decode; a full block and the node's own are no lenders, nor blocks outside the
/// pools asked about. One read when the first lender has room, two when it has not.
pub async fn a_borrowing_nodes_first_lender_with_room_is_the_block_its_add_borrows_from<
    F: StoreFactory,
>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let meter = ReadMeter::new(Arc::clone(&t.store));
    let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
    ipam.create_pool(&spec("10.70.0.0/28", "lend", 30))
        .await
        .expect("a pool of four /30 blocks");
    let block =
        |n: u32| -> ipnet::IpNet { format!("10.70.0.{}/30", n * 4).parse().expect("a block") };
    let ip = |text: &str| -> std::net::IpAddr { text.parse().expect("an address") };
    // node-a: both host addresses taken, only its edges free; node-b: one host address free;
    // node-c: empty; node-d: full.
    for (n, node, taken) in [
        (0, "node-a", vec!["10.70.0.1", "10.70.0.2"]),
        (1, "node-b", vec!["10.70.0.5"]),
        (2, "node-c", vec![]),
        (
            3,
            "node-d",
            vec!["10.70.0.12", "10.70.0.13", "10.70.0.14", "10.70.0.15"],
        ),
    ] {
        ipam.claim_affinity(node, block(n))
            .await
            .expect("claim a block");
        if !taken.is_empty() {
            ipam.assign_ips(&ipam_core::AssignIpsRequest {
                ips: taken.iter().map(|text| ip(text)).collect(),
                handle: format!("pods-of-{node}"),
                host: node.into(),
                ..ipam_core::AssignIpsRequest::default()
            })
            .await
            .expect("take addresses");
        }
    }
    let pools = vec![ipam.get_pool("lend").await.expect("the pool")];
    let within = [pools[0].cidr];
    let config = ipam.get_config().await.expect("the config");
    let prospect = ipam
        .new_block_prospect("node-x", &pools, true, false)
        .await
        .expect("node-x's prospect");
    assert_eq!(prospect.unclaimed, [None], "every block claimed");
    assert_eq!(prospect.lenders, [block(0), block(1), block(2)]);
    meter.take();
    let first = ipam
        .first_lender_with_room(&prospect, &within, &config, false)
        .await
        .expect("a lender");
    assert_eq!((first, meter.take().round_trips), (Some(block(0)), 1));
    let past_edges = ipam
        .first_lender_with_room(&prospect, &within, &config, true)
        .await
        .expect("a lender");
    assert_eq!((past_edges, meter.take().round_trips), (Some(block(1)), 2));
    // The ADD borrows from that block.
    let borrowed = ipam
        .auto_assign(&AutoAssignRequest {
            skip_block_edges: true,
            ..crate::ipam::v4("borrower", "node-x", 1)
        })
        .await
        .expect("node-x borrows");
    assert_eq!(borrowed.v4[0].block, block(1), "{borrowed:?}");
    ipam.release_handle("borrower")
        .await
        .expect("release the borrowed address");
    // The node's own block is no lender for it.
    let own = ipam
        .new_block_prospect("node-a", &pools, true, false)
        .await
        .expect("node-a's prospect");
    assert_eq!(own.lenders, [block(1), block(2)]);
    // node-a's block damaged and node-b's free host address reserved: node-c's block lends when
    // edges are skipped, node-b's edges when they are not.
    ipam.add_reservation(&ipam_core::reservations::Reservation {
        name: "node-b-free".into(),
        cidrs: vec!["10.70.0.6/32".parse().expect("a CIDR")],
    })
    .await
    .expect("reserve node-b's free address");
    let node_a_blocks = t
        .store
        .list(&keys::host_blocks_dir("node-a"))
        .await
        .expect("node-a's blocks");
    assert_eq!(node_a_blocks.len(), 1, "{node_a_blocks:?}");
    t.store
        .put(&node_a_blocks[0].key, b"garbage{".to_vec())
        .await
        .expect("damage node-a's block");
    let prospect = ipam
        .new_block_prospect("node-x", &pools, true, false)
        .await
        .expect("node-x's prospect");
    assert_eq!(
        ipam.first_lender_with_room(&prospect, &within, &config, true)
            .await
            .expect("past the damaged block and the reserved address"),
        Some(block(2))
    );
    assert_eq!(
        ipam.first_lender_with_room(&prospect, &within, &config, false)
            .await
            .expect("node-b's edges"),
        Some(block(1))
    );
    // Lenders are looked for in the pools given only.
    let elsewhere = ["10.71.0.0/16".parse().expect("a CIDR")];
    assert_eq!(
        ipam.first_lender_with_room(&prospect, &elsewhere, &config, false)
            .await
            .expect("no lender there"),
        None
    );
    // Blocks nobody holds lend first: node-b's and node-c's released (each keeps an address), the
    // second read holds node-c's former block and node-a's, out of address order.
    ipam.assign_ips(&ipam_core::AssignIpsRequest {
        ips: vec![ip("10.70.0.9")],
        handle: "pods-of-node-c".into(),
        host: "node-c".into(),
        ..ipam_core::AssignIpsRequest::default()
    })
    .await
    .expect("an address of node-c's");
    for (node, n) in [("node-b", 1), ("node-c", 2)] {
        ipam.release_affinity(node, block(n))
            .await
            .expect("release the block");
    }
    let prospect = ipam
        .new_block_prospect("node-x", &pools, true, false)
        .await
        .expect("node-x's prospect");
    assert_eq!(prospect.lenders, [block(1), block(2), block(0)]);
    meter.take();
    let nobodys = ipam
        .first_lender_with_room(&prospect, &within, &config, true)
        .await
        .expect("nobody's block");
    assert_eq!((nobodys, meter.take().round_trips), (Some(block(2)), 2));
    assert_eq!(
        ipam.first_lender_with_room(&prospect, &within, &config, false)
            .await
            .expect("nobody's block's edges"),
        Some(block(1))
    );
}

/// Where a node whose probed blocks give it nothing looks next (what CNI STATUS reads for a node
/// of a nearly full pool): the claim index names the block its ADD then claims (one the probe
/// missed) or borrows from, in one listing and, to borrow, the lender's block; no other block is
/// read; none where neither is allowed or left; a damaged lender passed over.
pub async fn past_its_probe_a_node_finds_the_block_its_add_takes_in_the_claim_index_reading_no_other_block<
    F: StoreFactory,
>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let meter = ReadMeter::recording_keys(Arc::clone(&t.store));
    let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
    ipam.create_pool(&spec("10.72.0.0/25", "tight", 30))
        .await
        .expect("a pool of 32 /30 blocks");
    let block =
        |n: u32| -> ipnet::IpNet { format!("10.72.0.{}/30", n * 4).parse().expect("a block") };
    // Every block held by another node: blocks 0 to 29 full, 30 empty, 31 with its second host
    // address free, then released by its node (it keeps its addresses, held by nobody).
    for n in 0..32u32 {
        let holder = format!("holder-{n:02}");
        ipam.claim_affinity(&holder, block(n))
            .await
            .expect("claim a block");
        let taken = match n {
            30 => 0,
            31 => 3,
            _ => 4,
        };
        if taken > 0 {
            let cidr = block(n);
            ipam.assign_ips(&ipam_core::AssignIpsRequest {
                ips: [cidr.network(), cidr.broadcast()]
                    .into_iter()
                    .chain(cidr.hosts())
                    .take(taken)
                    .collect(),
                handle: holder.clone(),
                host: holder,
                ..ipam_core::AssignIpsRequest::default()
            })
            .await
            .expect("fill the block");
        }
    }
    ipam.release_affinity("holder-31", block(31))
        .await
        .expect("release block 31");
    let pools = vec![ipam.get_pool("tight").await.expect("the pool")];
    let config = ipam.get_config().await.expect("the config");
    // A node whose probe (16 blocks from its hashed start) reaches neither block 30 nor 31.
    let mut node = String::new();
    for n in 0.. {
        node = format!("node-{n}");
        let prospect = ipam
            .new_block_prospect(&node, &pools, true, false)
            .await
            .expect("a prospect");
        if prospect.lenders.is_empty() {
            break;
        }
        assert!(n < 1000, "no node name whose probe misses blocks 30 and 31");
    }
    let prospect = ipam
        .new_block_prospect(&node, &pools, true, false)
        .await
        .expect("the node's prospect");
    assert_eq!(prospect.unclaimed, [None], "every probed block claimed");
    let blocks_read = |keys: Vec<String>| -> Vec<String> {
        keys.into_iter()
            .filter(|k| !k.starts_with(&keys::claims_dir()) && *k != keys::sequence_floor())
            .collect()
    };
    // No block unclaimed: the first lender, block 31 (nobody's, before the empty block 30 of
    // another node), whose block alone is read.
    meter.take();
    meter.take_keys();
    let found = ipam
        .room_in_claim_index(&prospect, &pools, &config, true, true, true)
        .await
        .expect("a lender")
        .block;
    let (cost, read) = (meter.take(), blocks_read(meter.take_keys()));
    assert_eq!((found, cost.round_trips), (Some(block(31)), 2), "{read:?}");
    assert_eq!(read, [keys::block(None, &block(31))]);
    let borrowed = ipam
        .auto_assign(&AutoAssignRequest {
            skip_block_edges: true,
            ..crate::ipam::v4("borrower", &node, 1)
        })
        .await
        .expect("the node borrows");
    assert_eq!(borrowed.v4[0].block, block(31), "{borrowed:?}");
    ipam.release_handle("borrower")
        .await
        .expect("release the borrowed address");
    // Neither claiming nor borrowing: nothing, from the listing alone.
    meter.take();
    assert_eq!(
        ipam.room_in_claim_index(&prospect, &pools, &config, true, true, false)
            .await
            .expect("no room"),
        ipam_core::ClaimIndexRoom::default()
    );
    assert_eq!(meter.take().round_trips, 1);
    assert_eq!(
        ipam.room_in_claim_index(&prospect, &pools, &config, true, false, false)
            .await
            .expect("nothing to look for"),
        ipam_core::ClaimIndexRoom::default()
    );
    assert_eq!(meter.take().round_trips, 0, "nothing read");
    // Block 30 released, and so unclaimed (it is empty): the ADD claims it, the listing alone
    // says so; a node that may only borrow finds block 31.
    ipam.release_affinity("holder-30", block(30))
        .await
        .expect("release the empty block");
    let prospect = ipam
        .new_block_prospect(&node, &pools, true, false)
        .await
        .expect("the node's prospect");
    assert_eq!(prospect.unclaimed, [None], "block 30 is not probed");
    meter.take();
    meter.take_keys();
    let found = ipam
        .room_in_claim_index(&prospect, &pools, &config, true, true, true)
        .await
        .expect("an unclaimed block")
        .block;
    let (cost, read) = (meter.take(), blocks_read(meter.take_keys()));
    assert_eq!((found, cost.round_trips), (Some(block(30)), 1), "{read:?}");
    assert_eq!(read, Vec::<String>::new());
    assert_eq!(
        ipam.room_in_claim_index(&prospect, &pools, &config, true, false, true)
            .await
            .expect("a lender")
            .block,
        Some(block(31))
    );
    let claimed = ipam
        .auto_assign(&AutoAssignRequest {
            skip_block_edges: true,
            ..crate::ipam::v4("claimer", &node, 1)
        })
        .await
        .expect("the node claims");
    assert_eq!(claimed.v4[0].block, block(30), "{claimed:?}");
    // Block 30 now the node's own, block 31 is its one lender: damaged, it is passed over (and
    // named), and nothing lends, in one read of the index and one of the block (the full blocks
    // are not read); an empty block of another pool is no lender for this one.
    t.store
        .put(&keys::block(None, &block(31)), b"garbage{".to_vec())
        .await
        .expect("damage block 31");
    ipam.create_pool(&spec("10.73.0.0/28", "other", 30))
        .await
        .expect("another pool");
    ipam.claim_affinity("holder-other", "10.73.0.0/30".parse().expect("a block"))
        .await
        .expect("an empty block of the other pool");
    let prospect = ipam
        .new_block_prospect(&node, &pools, true, false)
        .await
        .expect("the node's prospect");
    meter.take();
    let room = ipam
        .room_in_claim_index(&prospect, &pools, &config, true, true, true)
        .await
        .expect("past the damaged block");
    assert_eq!(meter.take().round_trips, 2);
    assert_eq!(room.block, None);
    let named: Vec<&str> = room.undecodable.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(named, [keys::block(None, &block(31))]);
}

/// A pool whose blocks the plugin filled (block edges skipped, so each keeps its two edges free,
/// which its claim entry counts as free): a borrowing ADD that skips edges reads the lenders in
/// batches of 1, 2, 4, ..., a few reads for 64 blocks where it made one per block; it fails when
/// none has a host address free, and borrows the one a release left, as STATUS's look at the
/// claim index finds it; an ADD that may take edges takes the first lender's.
pub async fn a_borrowing_add_among_blocks_full_but_for_their_edges_reads_them_in_doubling_batches<
    F: StoreFactory,
>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let meter = ReadMeter::new(Arc::clone(&t.store));
    let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
    ipam.create_pool(&spec("10.74.0.0/24", "edges", 30))
        .await
        .expect("a pool of 64 /30 blocks");
    let add = |handle: &str, node: &str, skip_block_edges: bool| AutoAssignRequest {
        skip_block_edges,
        ..crate::ipam::v4(handle, node, 1)
    };
    // The handle of each block's second pod.
    let mut second_pods: BTreeMap<ipnet::IpNet, String> = BTreeMap::new();
    for n in 0..64u32 {
        let node = format!("node-{n:02}");
        for k in 0..2 {
            let handle = format!("pod-{n:02}-{k}");
            let got = ipam
                .auto_assign(&add(&handle, &node, true))
                .await
                .expect("an address of the node's block");
            second_pods.insert(got.v4[0].block, handle);
        }
    }
    assert_eq!(second_pods.len(), 64, "a block for each node");
    let config = ipam.get_config().await.expect("the config");
    assert_eq!(
        config.ip_cooldown_seconds, 0,
        "released addresses are free at once"
    );
    let pools = vec![ipam.get_pool("edges").await.expect("the pool")];
    let last: ipnet::IpNet = "10.74.0.252/30".parse().expect("the last block");
    meter.take();
    let refused = ipam.auto_assign(&add("new-1", "node-new", true)).await;
    let cost = meter.take();
    assert!(
        matches!(refused, Err(ipam_core::IpamError::Exhausted { .. })),
        "{refused:?}"
    );
    assert!(
        cost.round_trips <= 12,
        "a refused ADD read 64 lenders in {cost:?}"
    );
    // The last block's second host address released: the ADD borrows it, as STATUS finds it.
    ipam.release_handle(&second_pods[&last])
        .await
        .expect("release an address of the last block");
    let prospect = ipam
        .new_block_prospect("node-new", &pools, true, true)
        .await
        .expect("the new node's prospect");
    meter.take();
    let room = ipam
        .room_in_claim_index(&prospect, &pools, &config, true, true, true)
        .await
        .expect("a lender");
    let status_cost = meter.take();
    assert_eq!(room.block, Some(last));
    assert!(status_cost.round_trips <= 8, "{status_cost:?}");
    let borrowed = ipam
        .auto_assign(&add("new-2", "node-new", true))
        .await
        .expect("the new node borrows");
    let cost = meter.take();
    assert_eq!(borrowed.v4[0].block, last, "{borrowed:?}");
    assert!(
        cost.round_trips <= 12,
        "a borrowing ADD found the last of 64 lenders in {cost:?}"
    );
    // An ADD that may take edges: the first lender's block, read alone.
    let edge = ipam
        .auto_assign(&add("new-3", "node-new", false))
        .await
        .expect("an edge");
    let cost = meter.take();
    assert_eq!(
        edge.v4[0].block,
        "10.74.0.0/30".parse::<ipnet::IpNet>().expect("a block")
    );
    assert!(cost.round_trips <= 4, "an ADD taking an edge: {cost:?}");
}

/// What the first read of a new node's new-block search finds (what CNI STATUS reads every few
/// seconds on a node with no block with room): the same keys, and the same bytes, with 1,024
/// blocks of another node in the store as without; the block it names is the one the node's ADD
/// then claims, past a reservation covering the first; none where every probed block is taken,
/// or in a pool of mixed block sizes; a claim entry it cannot decode refused.
pub async fn a_new_nodes_block_prospect_reads_as_much_with_1024_blocks_of_other_nodes_and_names_the_block_its_add_claims<
    F: StoreFactory,
>(
    factory: &F,
) {
    let small = SmallNodeStore::new(factory).await;
    let (meter, ipam) = (&small.meter, &small.ipam);
    // A node whose probed blocks lie apart from both other nodes' blocks.
    let new_node = "node-new";
    let pools = vec![ipam.get_pool("pool").await.expect("the pool")];
    let mut costs = Vec::new();
    let mut prospects = Vec::new();
    for round in 0..2 {
        if round == 1 {
            small.add_the_large_node().await;
        }
        meter.take();
        let prospect = ipam
            .new_block_prospect(new_node, &pools, false, true)
            .await
            .expect("the new node's prospect");
        costs.push(meter.take());
        assert!(
            prospect.full_blocks.is_empty(),
            "round {round}: {prospect:?}"
        );
        assert!(
            prospect.unclaimed[0].is_some(),
            "round {round}: {prospect:?}"
        );
        prospects.push(prospect);
    }
    assert_eq!(
        prospects[0], prospects[1],
        "the same block, beside the large node"
    );
    assert_eq!(
        (costs[0].round_trips, costs[0].keys, costs[0].bytes),
        (costs[1].round_trips, costs[1].keys, costs[1].bytes),
        "the prospect read more with another node's blocks: {:?} then {:?}",
        costs[0],
        costs[1]
    );
    // The large node claimed its blocks from its probe's start on: all taken, its full blocks
    // named.
    let (large, large_blocks) = LARGE_NODE;
    let taken = ipam
        .new_block_prospect(large, &pools, false, true)
        .await
        .expect("the large node's prospect");
    assert_eq!(taken.unclaimed, [None], "{taken:?}");
    assert_eq!(taken.full_blocks.len(), large_blocks as usize - 1);
    let uncounted = ipam
        .new_block_prospect(large, &pools, false, false)
        .await
        .expect("without its full blocks");
    assert!(uncounted.full_blocks.is_empty(), "{uncounted:?}");
    // A reservation covering the first unclaimed block: the next one, which the ADD claims.
    let first = prospects[0].unclaimed[0].expect("a block");
    small
        .maker
        .add_reservation(&ipam_core::reservations::Reservation {
            name: "first-block".into(),
            cidrs: vec![first],
        })
        .await
        .expect("reserve the block");
    copy_store(&small.memory, &small.t.store).await;
    let next = ipam
        .new_block_prospect(new_node, &pools, false, true)
        .await
        .expect("the prospect past the reservation")
        .unclaimed[0]
        .expect("a block past the reserved one");
    assert_ne!(next, first);
    let added = ipam
        .auto_assign(&pod_add(new_node, 0))
        .await
        .expect("the new node's ADD");
    assert_eq!(
        added.v4.iter().map(|a| a.block).collect::<Vec<_>>(),
        [next],
        "the ADD claimed another block than the prospect named"
    );
    // A claim entry that cannot be decoded among the probed blocks: refused, as the ADD is.
    let mut another = None;
    for n in 0..64 {
        let node = format!("node-another-{n}");
        let prospect = ipam
            .new_block_prospect(&node, &pools, false, true)
            .await
            .expect("another node's prospect");
        if let Some(block) = prospect.unclaimed[0] {
            another = Some((node, block));
            break;
        }
    }
    let (another_node, another) = another.expect("a node whose probe finds a block");
    small
        .t
        .store
        .put(&keys::block_claim(&another), b"garbage{".to_vec())
        .await
        .expect("damage a claim entry");
    let refused = ipam
        .new_block_prospect(&another_node, &pools, false, true)
        .await;
    assert!(
        matches!(refused, Err(ipam_core::IpamError::Corrupt { .. })),
        "{refused:?}"
    );
    small
        .t
        .store
        .delete(&keys::block_claim(&another))
        .await
        .expect("repair the claim entry");
    // Once the pool holds blocks of two sizes, only the claim index tells.
    ipam.set_pool(
        "pool",
        &ipam_core::PoolChange {
            block_size: Some(BLOCK_SIZE - 1),
            ..ipam_core::PoolChange::default()
        },
    )
    .await
    .expect("a larger block size");
    let pools = vec![ipam.get_pool("pool").await.expect("the pool")];
    let mixed = ipam
        .new_block_prospect(&another_node, &pools, false, true)
        .await
        .expect("the prospect in a pool of mixed sizes");
    assert_eq!(mixed.unclaimed, [None], "{mixed:?}");
    assert!(matches!(
        ipam.new_block_prospect("bad/name", &pools, false, true)
            .await,
        Err(ipam_core::IpamError::InvalidArgument(_))
    ));
}

/// A node whose blocks are all full but for their edges (stored under `full/`): an ADD that
/// may take edges (a gateway in the netconf) takes one of theirs instead of a new block, reading
/// them; an ADD that skips edges (the plugin's default) then claims a new block without reading
/// any of them, since their edges are no use to it. Where new blocks are not allowed, the ADD
/// that may take edges still takes one of theirs, and reads none of them once one of the node's
/// blocks has room again.
pub async fn a_new_block_for_an_add_skipping_edges_reads_none_of_the_blocks_full_but_for_their_edges<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (node, blocks) = ("node-edges", 4);
    let (memory, maker) = memory_maker().await;
    for n in 0..blocks * Edges::Skipped.usable_per_block() {
        maker
            .auto_assign(&pod_add_skipping_edges(node, n))
            .await
            .unwrap_or_else(|e| panic!("ADD of pod {n} on {node}: {e}"));
    }
    let t = factory.fresh().await;
    copy_store(&memory, &t.store).await;
    let full_dir = keys::host_full_blocks_dir(node);
    let full: Vec<String> = t
        .store
        .list(&full_dir)
        .await
        .expect("list full blocks")
        .into_iter()
        .map(|kv| kv.key)
        .collect();
    assert_eq!(
        full.len(),
        blocks as usize,
        "{node}'s blocks, full but for their edges"
    );
    let meter = ReadMeter::recording_keys(Arc::clone(&t.store));
    let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
    let before = crate::reservations::blocks(&ipam).await;

    takes_an_edge_of(&ipam, &meter, pod_add(node, blocks * 2), &before, &full_dir).await;

    let skipping = assigns_without_reading_under(
        &ipam,
        &meter,
        pod_add_skipping_edges(node, blocks * 2 + 1),
        &full_dir,
    )
    .await;
    let new_block = skipping.v4[0].block;
    assert!(
        !before.contains(&new_block),
        "{skipping:?} is in one of {before:?}"
    );
    assert_clean(&Ipam::new(Arc::clone(&t.store))).await;

    // Where new blocks are not allowed, the ADD that may take edges still finds them in the
    // node's own blocks (read by their own listing).
    let t = factory.fresh().await;
    copy_store(&memory, &t.store).await;
    let meter = ReadMeter::recording_keys(Arc::clone(&t.store));
    let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
    ipam.update_config(|c| c.auto_allocate_blocks = false)
        .await
        .expect("no new blocks");
    takes_an_edge_of(&ipam, &meter, pod_add(node, blocks * 2), &before, &full_dir).await;
    // And once one of its blocks has room again, the ADD is served from it alone.
    pod_del(&ipam, node, 0).await;
    assigns_without_reading_under(&ipam, &meter, pod_add(node, blocks * 2 + 1), &full_dir).await;
    assert_clean(&Ipam::new(Arc::clone(&t.store))).await;
}

/// Runs `add` through `ipam` (over `meter`, recording keys): it must take an edge of one of
/// `blocks`, and read blocks under `full_dir` (where those are kept) to find it.
async fn takes_an_edge_of(
    ipam: &Ipam,
    meter: &ReadMeter,
    add: AutoAssignRequest,
    blocks: &std::collections::BTreeSet<ipnet::IpNet>,
    full_dir: &str,
) {
    meter.take_keys();
    let taking = ipam.auto_assign(&add).await.expect("ADD taking edges");
    let read = meter.take_keys();
    let address = &taking.v4[0];
    assert!(
        blocks.contains(&address.block)
            && (address.ip == address.block.network() || address.ip == address.block.broadcast()),
        "{address:?} is not an edge of one of {blocks:?}"
    );
    assert!(
        read.iter().any(|key| key.starts_with(full_dir)),
        "the ADD taking edges found one without reading the blocks holding them: {read:#?}"
    );
}

/// Runs `add` through `ipam` (over `meter`, recording keys): it must succeed without reading any
/// key under `full_dir` (blocks full but for their edges, of no use to it); returns what it got.
async fn assigns_without_reading_under(
    ipam: &Ipam,
    meter: &ReadMeter,
    add: AutoAssignRequest,
    full_dir: &str,
) -> AutoAssignResult {
    meter.take_keys();
    let assigned = ipam
        .auto_assign(&add)
        .await
        .unwrap_or_else(|e| panic!("ADD of {}: {e}", add.handle));
    let read = meter.take_keys();
    assert!(
        !read.iter().any(|key| key.starts_with(full_dir)),
        "{assigned:?}: the ADD read blocks full but for their edges, of no use to it: {read:#?}"
    );
    assigned
}

/// An ADD carrying its network's set-up (the plugin's: its pool and a gateway, reserved) sets
/// the network up on the first call: the pool is created beside another pool of the same block
/// size, the gateway reserved. Every later ADD finds it all in place in its one read: one read
/// and one transaction, as without a set-up.
pub async fn a_steady_add_on_a_network_set_up_is_one_read_and_one_transaction<F: StoreFactory>(
    factory: &F,
) {
    use ipam_core::network_setup::NetworkSetup;

    let t = factory.fresh().await;
    let meter = ReadMeter::new(Arc::clone(&t.store));
    let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
    ipam.create_pool(&spec("10.31.0.0/24", "other", 26))
        .await
        .expect("another pool of the same block size");
    let pool = "10.32.0.0/24";
    let gateway: std::net::IpAddr = "10.32.0.1".parse().expect("gateway");
    let setup = NetworkSetup {
        network: NETWORK.into(),
        pools: vec![spec(pool, "net-pool", 26)],
        gateways: vec![gateway],
        reservation_handle: format!("{NETWORK}:gateway"),
    };
    let add = |n: u32, setup: &NetworkSetup| AutoAssignRequest {
        handle: format!("{NETWORK}.{}", container_id("node-a", n)),
        host: "node-a".into(),
        num_v4: 1,
        v4_pools: vec![pool.into()],
        setup: Some(setup.clone()),
        ..Default::default()
    };
    let first = ipam
        .auto_assign(&add(0, &setup))
        .await
        .expect("the ADD setting the network up");
    let net: ipnet::IpNet = pool.parse().expect("pool");
    assert!(net.contains(&first.v4[0].ip), "{first:?}");
    assert_eq!(
        holder(&ipam, gateway).await,
        Some(setup.reservation_handle.clone()),
        "the gateway is reserved"
    );
    let steady = |setup: NetworkSetup, calls: std::ops::Range<u32>| {
        let (ipam, meter) = (&ipam, &meter);
        async move {
            for n in calls {
                meter.take();
                let got = ipam
                    .auto_assign(&add(n, &setup))
                    .await
                    .unwrap_or_else(|e| panic!("ADD {n}: {e}"));
                let cost = meter.take();
                assert!(net.contains(&got.v4[0].ip), "{got:?}");
                assert!(
                    !setup.gateways.contains(&got.v4[0].ip),
                    "a gateway handed out: {got:?}"
                );
                assert_eq!(
                    (cost.round_trips, cost.commits),
                    (1, 1),
                    "ADD {n} on the network set up: {cost:?}"
                );
            }
        }
    };
    steady(setup.clone(), 1..4).await;
    // The network gains a gateway: the next ADD reserves it (the reservations' record is stale
    // now, and written again), and the ADDs after it are back to one read and one transaction.
    let second: std::net::IpAddr = "10.32.0.2".parse().expect("gateway");
    let setup = NetworkSetup {
        gateways: vec![gateway, second],
        ..setup
    };
    ipam.auto_assign(&add(4, &setup))
        .await
        .expect("the ADD reserving the second gateway");
    assert_eq!(
        holder(&ipam, second).await,
        Some(setup.reservation_handle.clone()),
        "the second gateway is reserved"
    );
    steady(setup, 5..8).await;
    assert_clean(&Ipam::new(Arc::clone(&t.store))).await;
}

/// The release of empty blocks (`blocks release-empty`, the etcd agents' reclaimer pass) judges
/// from the claim index: in a store of 1,040 blocks none of which is empty it reads no block's
/// value; once one node has an empty block it reads that node's blocks (to know its newest) and
/// no other node's.
pub async fn the_release_of_empty_blocks_reads_only_the_blocks_of_nodes_that_have_an_empty_one<
    F: StoreFactory,
>(
    factory: &F,
) {
    let t = two_nodes(factory, Edges::Taken).await;
    let meter = ReadMeter::recording_keys(Arc::clone(&t.store));
    let ipam = Ipam::new(meter.clone() as Arc<dyn KvStore>);
    let filter = EmptyBlockFilter {
        older_than_seconds: 0,
        only_unselected: false,
    };
    let blocks_read = |meter: &ReadMeter| -> Vec<String> {
        meter
            .take_keys()
            .into_iter()
            .filter(|key| key.starts_with(&keys::blocks_dir()))
            .collect()
    };
    let found = ipam
        .release_empty_blocks(filter, false)
        .await
        .expect("a pass with no empty block");
    assert_eq!(found, Vec::new());
    let read = blocks_read(&meter);
    assert!(
        read.is_empty(),
        "no block is empty, yet {} blocks were read, the first {:?}",
        read.len(),
        read.first()
    );

    // The small node's open block loses its two pods.
    let (node, blocks) = SMALL_NODE;
    let filled = pods_filled(blocks, Edges::Taken);
    for n in filled - 2..filled {
        pod_del(&ipam, node, n).await;
    }
    meter.take_keys();
    ipam.release_empty_blocks(filter, false)
        .await
        .expect("a pass with one empty block");
    let read = blocks_read(&meter);
    let others: Vec<&String> = read
        .iter()
        .filter(|key| !key.starts_with(&keys::host_blocks_dir(node)))
        .collect();
    assert!(
        others.is_empty(),
        "only {node}'s blocks, yet {} others were read, the first {:?}",
        others.len(),
        others.first()
    );
    assert_eq!(
        read.len(),
        blocks as usize,
        "every block of {node}, whose newest decides"
    );
    assert_clean(&Ipam::new(Arc::clone(&t.store))).await;
}
