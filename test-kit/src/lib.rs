//! blockipam's test kit, a dev-dependency only: throwaway etcd servers, clusters and a test PKI
//! ([`etcd`]), the agent run in the test's own process ([`agent`]), the plugin binary and the
//! CNI calls that run it ([`plugin`], [`cni`]), the previous release's binaries ([`previous`]),
//! Calico-format fixtures ([`calico`]), and what a process traced by strace wrote and synced
//! before it reported ([`strace`]).

pub mod agent;
pub mod calico;
pub mod cni;
pub mod etcd;
pub mod plugin;
pub mod previous;
pub mod strace;

/// Runs `future` to completion on a fresh current-thread runtime.
///
/// # Panics
/// When the runtime cannot be built.
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
        .block_on(future)
}

/// Seconds since the Unix epoch by this machine's clock (the one the plugin, the CLI and the agent
/// stamp releases, marks and looks with).
pub use ipam_core::model::timestamp::unix_now;

/// The first file named `name` in a directory of `PATH`, as a shell would run it.
pub fn find_on_path(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}
