//! The plugin binary alone, through the CNI protocol as a runtime calls it, on every store.
//!
//! One test binary per kind of test: this one runs the real `blockipam` executable (the test
//! build, or the shipped static build that `BLOCKIPAM_TEST_PLUGIN` names) call by call and checks
//! its answers and the store after them. The system tests, several processes and real parts at
//! once, are in `tests/system`.

#[path = "../common/mod.rs"]
mod common;

mod behaviour;
mod binary_layout;
mod concurrency;
mod durability;
mod etcd;
mod hostile_input;
mod protocol;
mod round_trips;
mod security;
mod store_presence;
