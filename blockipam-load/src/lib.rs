//! blockipam-load: a load generator for blockipam. Simulated nodes churn pods (ADD, hold, DEL)
//! against one store from a seeded schedule, through the allocator API or the real `blockipam`
//! plugin binary, and the run reports throughput, per-kind latency (a node's first ADD, steady
//! ADDs, DELs), store round trips and conflicts, etcd's database size, the final `check` and any
//! duplicate address.
//!
//! The binary is `src/main.rs` over [`run_cli`]; tests and other programs call [`run`] with a
//! [`LoadConfig`] and a [`StoreTarget`] and get a [`Report`].
//!
//! Beside the churn run: [`scenario`] (borrowing in a nearly full pool, `blockipamctl node
//! release`), [`prefill`], [`raw_ceiling`] (the raw etcd write rate beside the allocation rate),
//! and [`plot`], the library of the `blockipam-plot` binary.

pub mod cli;
pub mod config;
pub mod driver;
pub mod error;
pub mod etcd_status;
pub mod ledger;
pub mod observe;
pub mod plot;
pub mod pods;
pub mod prefill;
pub mod progress;
pub mod raw_ceiling;
pub mod report;
pub mod rng;
pub mod run;
pub mod scenario;
pub mod schedule;
pub mod stats;
pub mod verify;

pub use cli::{run_cli, EXIT_FAILED, EXIT_PASSED, EXIT_USAGE};
pub use config::{LoadConfig, Mode, RawShape, StopRule};
pub use error::LoadError;
pub use report::Report;
pub use run::{run, Progress, StoreTarget};
pub use schedule::OpKind;
