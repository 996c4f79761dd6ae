//! One simulated node's operations: fill up to its pods, then churn (DEL a random held pod, ADD a
//! new one), then optionally drain, all drawn from the node's own seeded stream, so that a seed
//! gives each node the same sequence whatever the other nodes do.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::config::{LoadConfig, StopRule};
use crate::pods::{container_id, PodKind};
use crate::rng::SplitMix64;

/// The kinds of operation, reported separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// A node's first ADD: it claims the node's first block.
    FirstAdd,
    /// Every later ADD (steady state; occasionally a further block claim or a borrow).
    Add,
    /// A DEL.
    Del,
}

impl OpKind {
    /// Every kind, in report order.
    pub const ALL: [OpKind; 3] = [OpKind::FirstAdd, OpKind::Add, OpKind::Del];

    /// `first_add`, `add`, `del`.
    pub fn as_str(self) -> &'static str {
        match self {
            OpKind::FirstAdd => "first_add",
            OpKind::Add => "add",
            OpKind::Del => "del",
        }
    }
}

/// A pod attachment: its container id and the addresses it believes it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    /// The CNI container id, 64 hex digits ([`crate::pods::container_id`]).
    pub container: String,
    /// Addresses the ADD returned.
    pub ips: Vec<IpAddr>,
}

/// One operation to make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedOp {
    /// Its kind.
    pub kind: OpKind,
    /// The pod it is for (for a DEL, with the addresses it holds).
    pub pod: Pod,
}

/// What a node does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Make this operation now.
    Run(PlannedOp),
    /// Nothing before this instant (churn pacing).
    WaitUntil(Instant),
    /// The node has finished.
    Done,
}

/// How far a node may go.
#[derive(Debug, Clone, Copy)]
enum Limit {
    Operations(u64),
    Until(Instant),
    ChurnCycles(u64),
}

/// A node's schedule and what it believes it holds.
#[derive(Debug, Clone)]
pub struct NodeSchedule {
    node: u32,
    rng: SplitMix64,
    pods_per_node: usize,
    limit: Limit,
    churn_rate: Option<f64>,
    drain: bool,
    held: Vec<Pod>,
    uncertain: Vec<String>,
    next_pod: u64,
    started: u64,
    cycles: u64,
    filled: bool,
    pending_add: bool,
    first_add_made: bool,
    draining: bool,
    ready_at: Option<Instant>,
    stopped: bool,
}

impl NodeSchedule {
    /// The schedule of pod stream `node` (the node's index when each node has one lane; else
    /// `node index × lanes + lane`), for a run that started at `start`.
    pub fn new(config: &LoadConfig, node: u32, start: Instant) -> Self {
        let limit = match config.stop {
            StopRule::Operations(total) => {
                let streams = config.streams();
                let share = total / streams + u64::from(u64::from(node) < total % streams);
                Limit::Operations(share)
            }
            StopRule::Duration(d) => Limit::Until(start + d),
            StopRule::ChurnCycles(cycles) => Limit::ChurnCycles(cycles),
        };
        NodeSchedule {
            node,
            rng: SplitMix64::derived(config.seed, u64::from(node)),
            pods_per_node: config.pods_per_node as usize,
            limit,
            churn_rate: config.churn_rate,
            drain: config.drain,
            held: Vec::new(),
            uncertain: Vec::new(),
            next_pod: 0,
            started: 0,
            cycles: 0,
            filled: false,
            pending_add: false,
            first_add_made: false,
            draining: false,
            ready_at: None,
            stopped: false,
        }
    }

    /// The node's index.
    pub fn node(&self) -> u32 {
        self.node
    }

    /// The pods the node believes it holds.
    pub fn held(&self) -> &[Pod] {
        &self.held
    }

    /// Containers whose DEL failed: whether they still hold their addresses is unknown.
    pub fn uncertain(&self) -> &[String] {
        &self.uncertain
    }

    /// Operations started so far.
    pub fn started(&self) -> u64 {
        self.started
    }

    fn new_pod(&mut self) -> Pod {
        let container = container_id(PodKind::Run, u64::from(self.node), self.next_pod);
        self.next_pod += 1;
        Pod {
            container,
            ips: Vec::new(),
        }
    }

    fn within_limit(&self, now: Instant) -> bool {
        match self.limit {
            Limit::Operations(n) => self.started < n,
            Limit::Until(deadline) => now < deadline,
            Limit::ChurnCycles(_) => true,
        }
    }

    fn add(&mut self) -> Step {
        let kind = if self.first_add_made {
            OpKind::Add
        } else {
            OpKind::FirstAdd
        };
        self.first_add_made = true;
        self.started += 1;
        Step::Run(PlannedOp {
            kind,
            pod: self.new_pod(),
        })
    }

    fn del(&mut self, index: usize) -> Step {
        self.started += 1;
        let pod = self.held.remove(index);
        Step::Run(PlannedOp {
            kind: OpKind::Del,
            pod,
        })
    }

    /// What the node does next, at `now`.
    pub fn next(&mut self, now: Instant) -> Step {
        if self.stopped {
            return Step::Done;
        }
        if self.draining {
            return if self.held.is_empty() {
                Step::Done
            } else {
                self.del(0)
            };
        }
        if !self.within_limit(now) {
            return self.finish();
        }
        if !self.filled {
            if self.held.len() < self.pods_per_node {
                return self.add();
            }
            self.filled = true;
        }
        if self.pending_add {
            self.pending_add = false;
            return self.add();
        }
        if let Limit::ChurnCycles(cycles) = self.limit {
            if self.cycles >= cycles {
                return self.finish();
            }
        }
        if let Some(ready) = self.ready_at {
            if now < ready {
                if matches!(self.limit, Limit::Until(deadline) if ready >= deadline) {
                    // The next cycle would start after the end of the run.
                    return self.finish();
                }
                return Step::WaitUntil(ready);
            }
        }
        if self.held.is_empty() {
            // Every ADD of the fill failed; nothing to churn.
            return self.finish();
        }
        self.cycles += 1;
        self.pending_add = true;
        self.ready_at = self
            .churn_rate
            .map(|rate| now + Duration::from_secs_f64(self.rng.exponential(rate).min(3600.0)));
        let victim = self.rng.below(self.held.len());
        self.del(victim)
    }

    fn finish(&mut self) -> Step {
        if self.drain && !self.held.is_empty() {
            self.draining = true;
            return self.del(0);
        }
        self.stopped = true;
        Step::Done
    }

    /// Records an operation's outcome: a successful ADD's pod is held from now on; a failed DEL's
    /// pod is uncertain. Any failure stops the node (the run fails anyway; going on would only
    /// pile consequences on the first error).
    pub fn record(&mut self, op: PlannedOp, outcome: &Result<Vec<IpAddr>, String>) {
        match (op.kind, outcome) {
            (OpKind::FirstAdd | OpKind::Add, Ok(ips)) => self.held.push(Pod {
                container: op.pod.container,
                ips: ips.clone(),
            }),
            (OpKind::Del, Ok(_)) => {}
            (OpKind::Del, Err(_)) => {
                self.uncertain.push(op.pod.container);
                self.stopped = true;
            }
            (_, Err(_)) => self.stopped = true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(stop: StopRule) -> LoadConfig {
        LoadConfig {
            nodes: 3,
            pods_per_node: 4,
            stop,
            seed: 99,
            ..LoadConfig::default()
        }
    }

    /// Runs a node's schedule with every operation succeeding; returns (kind, container) pairs.
    fn trace(config: &LoadConfig, node: u32) -> Vec<(OpKind, String)> {
        let start = Instant::now();
        let mut schedule = NodeSchedule::new(config, node, start);
        let mut ops = Vec::new();
        let mut address = 0u32;
        loop {
            match schedule.next(start) {
                Step::Run(op) => {
                    ops.push((op.kind, op.pod.container.clone()));
                    address += 1;
                    let ips = vec![IpAddr::from(address.to_be_bytes())];
                    schedule.record(op, &Ok(ips));
                }
                Step::WaitUntil(_) => panic!("no pacing was configured"),
                Step::Done => return ops,
            }
            assert!(ops.len() < 10_000, "the schedule never ends");
        }
    }

    #[test]
    fn a_node_fills_then_churns_with_one_first_add_and_repeats_for_the_same_seed() {
        let config = config(StopRule::ChurnCycles(6));
        let ops = trace(&config, 1);
        assert_eq!(ops.len(), 4 + 2 * 6);
        assert_eq!(ops[0].0, OpKind::FirstAdd);
        assert!(ops[1..4].iter().all(|(k, _)| *k == OpKind::Add));
        for pair in ops[4..].chunks(2) {
            assert_eq!(pair[0].0, OpKind::Del);
            assert_eq!(pair[1].0, OpKind::Add);
        }
        assert_eq!(
            ops,
            trace(&config, 1),
            "same seed, same node: same schedule"
        );
        let other_seed = LoadConfig {
            seed: 100,
            ..config.clone()
        };
        assert_ne!(
            ops,
            trace(&other_seed, 1),
            "another seed deletes other pods"
        );
    }

    #[test]
    fn an_operation_budget_is_split_over_the_nodes_and_drain_empties_the_node() {
        let budget = config(StopRule::Operations(20));
        let counts: Vec<usize> = (0..3).map(|n| trace(&budget, n).len()).collect();
        assert_eq!(counts, [7, 7, 6]);
        let drained = LoadConfig {
            drain: true,
            ..budget
        };
        let start = Instant::now();
        for node in 0..3 {
            let mut schedule = NodeSchedule::new(&drained, node, start);
            let mut n = 0u32;
            while let Step::Run(op) = schedule.next(start) {
                n += 1;
                schedule.record(op, &Ok(vec![IpAddr::from(n.to_be_bytes())]));
            }
            assert!(schedule.held().is_empty(), "drain left pods");
            assert!(u64::from(n) > counts[node as usize] as u64, "no drain DEL");
        }
    }

    #[test]
    fn a_failed_operation_stops_the_node_and_a_failed_del_is_uncertain() {
        let config = config(StopRule::ChurnCycles(3));
        let start = Instant::now();
        let mut schedule = NodeSchedule::new(&config, 0, start);
        for n in 0..4u32 {
            let Step::Run(op) = schedule.next(start) else {
                panic!("fill expected")
            };
            schedule.record(op, &Ok(vec![IpAddr::from(n.to_be_bytes())]));
        }
        let Step::Run(del) = schedule.next(start) else {
            panic!("a churn DEL expected")
        };
        assert_eq!(del.kind, OpKind::Del);
        let container = del.pod.container.clone();
        schedule.record(del, &Err("boom".into()));
        assert_eq!(schedule.next(start), Step::Done);
        assert_eq!(schedule.uncertain(), [container]);
        assert_eq!(schedule.held().len(), 3);
    }

    #[test]
    fn a_churn_rate_paces_cycles() {
        let paced = LoadConfig {
            churn_rate: Some(0.001),
            ..config(StopRule::ChurnCycles(2))
        };
        let start = Instant::now();
        let mut schedule = NodeSchedule::new(&paced, 0, start);
        let mut n = 0u32;
        let waited = loop {
            match schedule.next(start) {
                Step::Run(op) => {
                    n += 1;
                    schedule.record(op, &Ok(vec![IpAddr::from(n.to_be_bytes())]));
                }
                Step::WaitUntil(when) => break when,
                Step::Done => panic!("the second cycle was never due"),
            }
        };
        // Fill (4) and the first cycle (DEL + ADD) run at once; the second cycle waits.
        assert_eq!(n, 6);
        assert!(waited > start);

        // A cycle due after the end of a timed run is not waited for.
        let timed = LoadConfig {
            churn_rate: Some(0.000_01),
            ..config(StopRule::Duration(Duration::from_secs(60)))
        };
        let mut schedule = NodeSchedule::new(&timed, 0, start);
        let mut n = 0u32;
        loop {
            match schedule.next(start) {
                Step::Run(op) => {
                    n += 1;
                    schedule.record(op, &Ok(vec![IpAddr::from(n.to_be_bytes())]));
                }
                Step::WaitUntil(when) => panic!("waits until {when:?}, after the run's end"),
                Step::Done => break,
            }
        }
        assert_eq!(n, 6);
    }
}
