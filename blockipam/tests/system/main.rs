//! System tests: the plugin among real parts and failures (several nodes racing, crashes, etcd
//! members killed, Debian's `ptp`/`bridge` in network namespaces, containerd's CRI, the DaemonSet of
//! `deploy/kubernetes/` run from the container image).
//!
//! One test binary per kind of test: this one runs many processes at once (plugins of several
//! simulated nodes, etcd clusters, containerd) and checks what they leave in the store. The
//! crash tests (`crash::`) and the multi-node race (`multinode::`) run the test build of the plugin,
//! the only one with crash points; `scripts/test` runs the others a second time on the shipped
//! static build.

#[path = "../common/mod.rs"]
mod common;
mod fleet;

mod containerd;
mod crash;
mod cri;
mod daemonset;
mod e2e;
mod etcd_failures;
mod leaks;
mod multinode;
