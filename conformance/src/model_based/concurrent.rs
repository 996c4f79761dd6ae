//! Concurrent tasks on one store: each keeps its own belief of what it holds, and at the end the
//! beliefs must add up to exactly what the store holds.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use ipam_core::{AssignIpsRequest, AutoAssignRequest, Ipam, IpamError, KvStore, ReleaseRequest};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use crate::hooked::HookedStore;
use crate::StoreFactory;

use super::sequences::{env_size, fail, lock, store_error, Tally};
use super::{
    address_at, menu_spec, CASES_ENV, DEFAULT_CASES, DEFAULT_STEPS, INITIAL_POOLS, POOL_MENU,
    POOL_NAMES, STEPS_ENV, TASKS, TASK_HANDLES,
};

// ---------------------------------------------------------------------------------------------
// Concurrent tasks
// ---------------------------------------------------------------------------------------------

/// One step of a concurrent task. Each task has its own host and handles; it only releases what
/// it holds, so what it holds at the end is exactly what it believes it holds.
#[derive(Debug, Clone)]
pub enum TaskStep {
    /// Auto-assign for one of the task's handles.
    AutoAssign {
        /// Handle index (within the task).
        handle: u8,
        /// IPv4 addresses wanted.
        v4: u8,
        /// IPv6 addresses wanted.
        v6: u8,
    },
    /// Assign one specific address (often held by another task: refused).
    AssignAddress {
        /// Handle index (within the task).
        handle: u8,
        /// Which address.
        address: u16,
    },
    /// Release one of the task's addresses, guarded with its sequence number or not.
    ReleaseHeld {
        /// Which held address.
        index: u16,
        /// Pass the recorded sequence number.
        guarded: bool,
    },
    /// Release an (address, sequence) pair the task released before: must be refused.
    ReleaseStale(u16),
    /// Release one of the task's handles.
    ReleaseHandle(u8),
    /// Retire the task's host, with or without its addresses.
    ReleaseHost(bool),
    /// Release the task's affinity to the block of one of its addresses.
    ReleaseAffinity(u16),
    /// Disable or enable a pool.
    SetPoolDisabled {
        /// Name index.
        pool: u8,
        /// The new state.
        disabled: bool,
    },
    /// Delete a pool without force (must be refused while anyone holds an address in it).
    DeletePool(u8),
    /// Create a pool of the menu.
    AddPool(u8),
}

fn task_step_strategy() -> impl Strategy<Value = TaskStep> {
    let names = POOL_NAMES.len() as u8;
    prop_oneof![
        8 => (0..TASK_HANDLES, prop_oneof![4 => Just((1u8, 0u8)), 2 => Just((2, 0)), 1 => Just((0, 1)), 2 => Just((1, 1))])
            .prop_map(|(handle, (v4, v6))| TaskStep::AutoAssign { handle, v4, v6 }),
        2 => (0..TASK_HANDLES, any::<u16>())
            .prop_map(|(handle, address)| TaskStep::AssignAddress { handle, address }),
        5 => (any::<u16>(), any::<bool>())
            .prop_map(|(index, guarded)| TaskStep::ReleaseHeld { index, guarded }),
        2 => any::<u16>().prop_map(TaskStep::ReleaseStale),
        1 => (0..TASK_HANDLES).prop_map(TaskStep::ReleaseHandle),
        1 => any::<bool>().prop_map(TaskStep::ReleaseHost),
        1 => any::<u16>().prop_map(TaskStep::ReleaseAffinity),
        1 => (0..names, any::<bool>())
            .prop_map(|(pool, disabled)| TaskStep::SetPoolDisabled { pool, disabled }),
        1 => (0..names).prop_map(TaskStep::DeletePool),
        1 => (0..POOL_MENU.len() as u8).prop_map(TaskStep::AddPool),
    ]
}

/// What one task believes it holds, and the pairs it released.
#[derive(Debug, Default)]
struct Belief {
    held: BTreeMap<IpAddr, (String, Option<u64>)>,
    retired: Vec<(IpAddr, u64)>,
    tally: Tally,
}

impl Belief {
    fn forget(&mut self, ip: IpAddr) {
        if let Some((_, Some(sequence))) = self.held.remove(&ip) {
            self.retired.push((ip, sequence));
        }
    }

    fn handle_addresses(&self, handle: &str) -> Vec<IpAddr> {
        self.held
            .iter()
            .filter(|(_, (h, _))| h == handle)
            .map(|(ip, _)| *ip)
            .collect()
    }
}

/// Records newly held addresses and learns their sequence numbers from the store.
async fn learn(
    ipam: &Ipam,
    belief: &mut Belief,
    handle: &str,
    ips: &[IpAddr],
) -> Result<(), String> {
    let allocations = ipam
        .allocations_by_handle(handle)
        .await
        .map_err(|e| format!("allocations_by_handle({handle}): {e}"))?;
    for ip in ips {
        let sequence = allocations.iter().find(|a| a.ip == *ip).map(|a| a.sequence);
        belief.held.insert(*ip, (handle.to_owned(), sequence));
    }
    Ok(())
}

/// One task's run. An error names the step and what went wrong.
async fn run_task(ipam: Ipam, task: usize, steps: Vec<TaskStep>) -> Result<Belief, String> {
    let host = format!("t{task}");
    let handle_of = |h: u8| format!("t{task}-h{}", h % TASK_HANDLES);
    let mut belief = Belief::default();
    for (index, step) in steps.iter().enumerate() {
        let context = |message: String| format!("task {task} step {index} {step:?}: {message}");
        match step {
            TaskStep::AutoAssign { handle, v4, v6 } => {
                let handle = handle_of(*handle);
                let result = ipam
                    .auto_assign(&AutoAssignRequest {
                        handle: handle.clone(),
                        host: host.clone(),
                        num_v4: u32::from(*v4),
                        num_v6: u32::from(*v6),
                        ..Default::default()
                    })
                    .await;
                belief.tally.outcome("auto_assign", &result);
                match result {
                    Ok(got) => {
                        let ips: Vec<IpAddr> = got.v4.iter().chain(&got.v6).map(|a| a.ip).collect();
                        if let Some(ip) = ips.iter().find(|ip| belief.held.contains_key(ip)) {
                            return Err(context(format!("handed out {ip}, which this task holds")));
                        }
                        learn(&ipam, &mut belief, &handle, &ips)
                            .await
                            .map_err(context)?;
                    }
                    Err(IpamError::Exhausted { .. }) | Err(IpamError::BlockLimit { .. }) => {}
                    Err(e) => return Err(context(format!("unexpected error {e:?}"))),
                }
            }
            TaskStep::AssignAddress { handle, address } => {
                let handle = handle_of(*handle);
                let ip = address_at(*address);
                let result = ipam
                    .assign_ips(&AssignIpsRequest {
                        ips: vec![ip],
                        handle: handle.clone(),
                        host: host.clone(),
                        ..Default::default()
                    })
                    .await;
                belief.tally.outcome("assign_ips", &result);
                match (result, belief.held.get(&ip).cloned()) {
                    (Ok(_), Some((holder, _))) if holder == handle => {}
                    (Ok(_), Some((holder, _))) => {
                        return Err(context(format!("assigned {ip}, which {holder} holds")))
                    }
                    (Ok(_), None) => learn(&ipam, &mut belief, &handle, &[ip])
                        .await
                        .map_err(context)?,
                    (Err(IpamError::AlreadyAssigned { handle: holder, .. }), mine) => {
                        let believed = mine.map(|(h, _)| h);
                        let is_mine = holder.starts_with(&format!("t{task}-"));
                        if is_mine != believed.is_some()
                            || (is_mine && believed != Some(holder.clone()))
                        {
                            return Err(context(format!(
                                "refused as held by {holder}; this task believes {believed:?}"
                            )));
                        }
                    }
                    (Err(IpamError::NotInPool(_)), _) => {}
                    (Err(e), _) => return Err(context(format!("unexpected error {e:?}"))),
                }
            }
            TaskStep::ReleaseHeld { index, guarded } => {
                let held: Vec<(IpAddr, Option<u64>)> =
                    belief.held.iter().map(|(ip, (_, s))| (*ip, *s)).collect();
                if held.is_empty() {
                    continue;
                }
                let (ip, sequence) = held[usize::from(*index) % held.len()];
                let sequence = if *guarded { sequence } else { None };
                let outcome = ipam
                    .release_ips(&[ReleaseRequest { ip, sequence }])
                    .await
                    .map_err(|e| context(format!("release failed: {e:?}")))?;
                if outcome.released != vec![ip] {
                    return Err(context(format!(
                        "releasing held {ip} (sequence {sequence:?}) gave {outcome:?}"
                    )));
                }
                belief.forget(ip);
                belief.tally.add(
                    if sequence.is_some() {
                        "release of a held address, guarded: released"
                    } else {
                        "release of a held address, unguarded: released"
                    },
                    1,
                );
            }
            TaskStep::ReleaseStale(index) => {
                if belief.retired.is_empty() {
                    continue;
                }
                let (ip, sequence) = belief.retired[usize::from(*index) % belief.retired.len()];
                let outcome = ipam
                    .release_ips(&[ReleaseRequest {
                        ip,
                        sequence: Some(sequence),
                    }])
                    .await
                    .map_err(|e| context(format!("release failed: {e:?}")))?;
                belief.tally.add(
                    if outcome.sequence_mismatch.is_empty() {
                        "stale guarded release: not allocated"
                    } else {
                        "stale guarded release: refused (sequence mismatch)"
                    },
                    1,
                );
                if !outcome.released.is_empty() {
                    return Err(context(format!(
                        "a stale guarded release of ({ip}, sequence {sequence}) freed a live \
                         address: {outcome:?}"
                    )));
                }
            }
            TaskStep::ReleaseHandle(handle) => {
                let handle = handle_of(*handle);
                let mut released = ipam
                    .release_handle(&handle)
                    .await
                    .map_err(|e| context(format!("release_handle failed: {e:?}")))?;
                belief.tally.add("release_handle: ok", 1);
                released.sort();
                let expected = belief.handle_addresses(&handle);
                if released != expected {
                    return Err(context(format!(
                        "released {released:?}, the handle was believed to hold {expected:?}"
                    )));
                }
                for ip in expected {
                    belief.forget(ip);
                }
            }
            TaskStep::ReleaseHost(addresses) => {
                let report = ipam
                    .release_host(&host, *addresses)
                    .await
                    .map_err(|e| context(format!("release_host failed: {e:?}")))?;
                belief.tally.add(
                    if *addresses {
                        "release_host with addresses: ok"
                    } else {
                        "release_host: ok"
                    },
                    1,
                );
                if *addresses {
                    let expected: Vec<IpAddr> = belief.held.keys().copied().collect();
                    if report.released_addresses != expected {
                        return Err(context(format!(
                            "released {:?}, the host was believed to hold {expected:?}",
                            report.released_addresses
                        )));
                    }
                    for ip in expected {
                        belief.forget(ip);
                    }
                }
            }
            TaskStep::ReleaseAffinity(index) => {
                // The block of an address depends on its pool; ask the store.
                let Some(ip) = belief
                    .held
                    .keys()
                    .nth(usize::from(*index) % belief.held.len().max(1))
                else {
                    continue;
                };
                let Some(info) = ipam
                    .get_assignment(*ip)
                    .await
                    .map_err(|e| context(format!("get_assignment failed: {e:?}")))?
                else {
                    let pools = ipam.list_pools().await;
                    return Err(context(format!(
                        "held {ip} is not allocated in the store (pools now: {pools:?})"
                    )));
                };
                let result = ipam.release_affinity(&host, info.block).await;
                belief.tally.outcome("release_affinity", &result);
                match result {
                    Ok(()) | Err(IpamError::BlockOwnedByOtherHost { .. }) => {}
                    Err(e) => return Err(context(format!("unexpected error {e:?}"))),
                }
            }
            TaskStep::SetPoolDisabled { pool, disabled } => {
                let name = POOL_NAMES[usize::from(*pool) % POOL_NAMES.len()];
                let result = ipam.set_pool_disabled(name, *disabled).await;
                belief.tally.outcome("set_pool_disabled", &result);
                match result {
                    Ok(_) | Err(IpamError::PoolNotFound(_)) => {}
                    Err(e) => return Err(context(format!("unexpected error {e:?}"))),
                }
            }
            TaskStep::DeletePool(pool) => {
                let name = POOL_NAMES[usize::from(*pool) % POOL_NAMES.len()];
                let result = ipam.delete_pool(name, false).await;
                belief.tally.outcome("delete_pool", &result);
                match result {
                    Ok(deletion) => {
                        let mine: Vec<IpAddr> = belief
                            .held
                            .keys()
                            .filter(|ip| deletion.pool.cidr.contains(*ip))
                            .copied()
                            .collect();
                        if !mine.is_empty() {
                            return Err(context(format!(
                                "deleted pool {} without force while this task held {mine:?}",
                                deletion.pool.cidr
                            )));
                        }
                    }
                    Err(IpamError::PoolInUse { .. }) | Err(IpamError::PoolNotFound(_)) => {}
                    Err(e) => return Err(context(format!("unexpected error {e:?}"))),
                }
            }
            TaskStep::AddPool(menu) => {
                let result = ipam.create_pool(&menu_spec(usize::from(*menu))).await;
                belief.tally.outcome("create_pool", &result);
                match result {
                    Ok(_) | Err(IpamError::PoolExists(_)) | Err(IpamError::PoolOverlap { .. }) => {}
                    Err(e) => return Err(context(format!("unexpected error {e:?}"))),
                }
            }
        }
    }
    Ok(belief)
}

/// Runs the tasks at once on one store, then compares what they believe with what it holds.
async fn run_concurrently<F: StoreFactory>(
    factory: &F,
    plans: Vec<Vec<TaskStep>>,
    tally: &Mutex<Tally>,
) -> Result<(), TestCaseError> {
    let test_store = factory.fresh().await;
    // Every store call yields first, so that the tasks interleave at each one.
    let racing = HookedStore::racing(Arc::clone(&test_store.store));
    let ipam = Ipam::new(Arc::clone(&racing) as Arc<dyn KvStore>);
    let result = check_concurrently(&ipam, plans, tally).await;
    let mut counts = lock(tally);
    counts.add("cases", 1);
    counts.add("commits", racing.commits());
    counts.add(
        "commits refused by a concurrent change (conflicts: the tasks really raced)",
        racing.conflicts(),
    );
    result
}

/// Creates the pools, runs the tasks, compares beliefs with the store.
async fn check_concurrently(
    ipam: &Ipam,
    plans: Vec<Vec<TaskStep>>,
    tally: &Mutex<Tally>,
) -> Result<(), TestCaseError> {
    for menu in INITIAL_POOLS {
        ipam.create_pool(&menu_spec(menu))
            .await
            .map_err(store_error("create_pool"))?;
    }
    // Every task starts at the same moment; they share one allocator over one store handle.
    let start = Arc::new(tokio::sync::Barrier::new(plans.len()));
    let mut tasks = Vec::new();
    for (task, steps) in plans.into_iter().enumerate() {
        let ipam = ipam.clone();
        let start = Arc::clone(&start);
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            run_task(ipam, task, steps).await
        }));
    }
    let mut beliefs = Vec::new();
    let mut errors = Vec::new();
    for task in tasks {
        match task.await {
            Ok(Ok(belief)) => {
                lock(tally).merge(&belief.tally);
                beliefs.push(belief)
            }
            Ok(Err(e)) => errors.push(e),
            Err(e) => errors.push(format!("a task panicked: {e}")),
        }
    }
    if !errors.is_empty() {
        return Err(fail(errors.join("\n")));
    }
    let mut believed: BTreeMap<IpAddr, (String, Option<u64>)> = BTreeMap::new();
    for belief in &beliefs {
        for (ip, held) in &belief.held {
            if let Some(other) = believed.insert(*ip, held.clone()) {
                return Err(fail(format!(
                    "{ip} is believed held by both {} and {}",
                    other.0, held.0
                )));
            }
        }
    }
    let allocations = ipam
        .list_allocations()
        .await
        .map_err(store_error("list_allocations"))?;
    let mut store: BTreeMap<IpAddr, (String, Option<u64>)> = BTreeMap::new();
    for a in allocations {
        if store
            .insert(a.ip, (a.handle.clone(), Some(a.sequence)))
            .is_some()
        {
            return Err(fail(format!("{} is allocated twice in the store", a.ip)));
        }
    }
    let store_holders: BTreeMap<&IpAddr, &String> =
        store.iter().map(|(ip, h)| (ip, &h.0)).collect();
    let believed_holders: BTreeMap<&IpAddr, &String> =
        believed.iter().map(|(ip, h)| (ip, &h.0)).collect();
    if store_holders != believed_holders {
        let lost: Vec<_> = believed_holders
            .iter()
            .filter(|(ip, h)| store_holders.get(*ip) != Some(*h))
            .collect();
        let leaked: Vec<_> = store_holders
            .iter()
            .filter(|(ip, h)| believed_holders.get(*ip) != Some(*h))
            .collect();
        return Err(fail(format!(
            "the tasks' beliefs and the store differ: believed but not in the store {lost:?}; \
             in the store but believed by no task {leaked:?}"
        )));
    }
    for (ip, (handle, sequence)) in &believed {
        if sequence.is_some() && store.get(ip).map(|s| s.1) != Some(*sequence) {
            return Err(fail(format!(
                "{ip} ({handle}): believed sequence {sequence:?}, store {:?}",
                store.get(ip)
            )));
        }
    }
    for (task, belief) in beliefs.iter().enumerate() {
        for h in 0..TASK_HANDLES {
            let handle = format!("t{task}-h{h}");
            let held: Vec<IpAddr> = ipam
                .ips_by_handle(&handle)
                .await
                .map_err(store_error("ips_by_handle"))?
                .into_iter()
                .map(|a| a.ip)
                .collect();
            let expected = belief.handle_addresses(&handle);
            if held != expected {
                return Err(fail(format!(
                    "handle {handle}: ips_by_handle says {held:?}, the task believes {expected:?}"
                )));
            }
        }
    }
    let report = ipam.check(false).await.map_err(store_error("check"))?;
    if !report.problems.is_empty() {
        return Err(fail(format!(
            "check found problems: {:#?}",
            report.problems
        )));
    }
    Ok(())
}

/// Several tasks (each its own host and handles) run random sequences at the same time on one
/// store through one shared allocator, interleaving at every await: afterwards the union of what
/// each believes it holds (successful assigns minus successful releases) is exactly what the
/// store holds, no address is held twice, every handle reads back right, and the check is clean.
/// Each task also checks its own answers as it goes (a stale guarded release must free nothing;
/// a pool it holds addresses in must not be deleted without force).
pub async fn concurrent_tasks_hold_exactly_what_they_believe<F: StoreFactory>(factory: &F) {
    let cases = env_size(CASES_ENV, DEFAULT_CASES);
    let steps = env_size(STEPS_ENV, DEFAULT_STEPS).max(1) as usize;
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        // Interleavings do not repeat, so shrinking would chase a moving target.
        max_shrink_iters: 0,
        ..Config::default()
    });
    let runtime = tokio::runtime::Handle::current();
    let strategy = proptest::collection::vec(
        proptest::collection::vec(task_step_strategy(), 1..=steps),
        TASKS,
    );
    let tally = Mutex::new(Tally::default());
    let result = runner.run(&strategy, |plans| {
        tokio::task::block_in_place(|| runtime.block_on(run_concurrently(factory, plans, &tally)))
    });
    if let Err(failure) = result {
        panic!(
            "{} store: concurrent tasks and the store disagree: {failure}",
            factory.backend_name()
        );
    }
    eprintln!(
        "{} store, concurrent tasks ({TASKS} tasks, {CASES_ENV}={cases}, {STEPS_ENV}={steps}):\n{}",
        factory.backend_name(),
        lock(&tally)
    );
}
