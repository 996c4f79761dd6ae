//! The node-release scenario: one node holding `--addresses` addresses (one pod handle each),
//! then the real `blockipamctl node release <node> --addresses` run as a process against the same
//! store (its wall time), and the same release through the API with a counting client on a second,
//! identically filled store (its round trips, and what it read); then the node must hold nothing
//! and the check must be clean.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use blockipam_store::{Backend, DatastoreSettings};
use etcd_client::DeleteOptions;
use ipam_core::{AutoAssignRequest, CountingStore, Ipam, RoundTrips};
use serde::Serialize;

use super::reads::{ReadClassifier, ReadKinds};
use super::{check, prepare_pool, CheckOutcome, ScenarioConfig};
use crate::config::LoadConfig;
use crate::error::LoadError;
use crate::etcd_status::StatusClient;
use crate::pods::{self, container_id, PodKind};
use crate::run::{open, open_target, StoreTarget};

/// What `blockipamctl node release --addresses` did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CtlRun {
    /// The command line (without any password).
    pub command: String,
    /// From spawn to exit.
    pub wall_seconds: f64,
    /// Its exit status.
    pub exit_code: Option<i32>,
    /// Its standard output.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
}

/// The same release through the API on the twin store.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ApiRelease {
    /// How the twin store was made.
    pub twin: String,
    /// Wall time of `release_host(node, true)`.
    pub seconds: f64,
    /// Reads and commits it made.
    pub reads: u64,
    /// Commits.
    pub commits: u64,
    /// Reads plus commits.
    pub round_trips: u64,
    /// What the reads were of.
    pub read_kinds: ReadKinds,
    /// Addresses it released.
    pub released_addresses: u64,
}

/// What the node-release scenario measured and found.
#[derive(Debug, Clone, Serialize)]
pub struct NodeReleaseReport {
    /// `node-release`.
    pub scenario: &'static str,
    /// The store, described.
    pub store: String,
    /// The released node.
    pub node: String,
    /// Addresses it held (one pod handle each).
    pub addresses: u64,
    /// Seconds filling took (each store).
    pub fill_seconds: f64,
    /// The real `blockipamctl` process.
    pub blockipamctl: CtlRun,
    /// The same release through the API on the twin store.
    pub api_release: ApiRelease,
    /// Addresses still recorded for the node afterwards (must be 0).
    pub node_allocations_after: u64,
    /// Blocks still affine to the node afterwards (must be 0).
    pub node_blocks_after: u64,
    /// All allocations in the store afterwards.
    pub allocations_after: u64,
    /// The final check of the real store.
    pub check: CheckOutcome,
    /// blockipamctl succeeded, the node holds nothing, the twin released every address, and the
    /// check is clean.
    pub passed: bool,
}

impl NodeReleaseReport {
    /// The report for people.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "blockipam-load node-release: node {} holding {} addresses (filled in {:.2} s)",
            self.node, self.addresses, self.fill_seconds
        );
        let _ = writeln!(out, "store: {}", self.store);
        let c = &self.blockipamctl;
        let _ = writeln!(
            out,
            "blockipamctl: {:.3} s wall, exit {}: {}",
            c.wall_seconds,
            c.exit_code
                .map(|code| code.to_string())
                .unwrap_or_else(|| "by signal".into()),
            c.command
        );
        if c.exit_code != Some(0) {
            let _ = writeln!(out, "  stdout: {}", c.stdout.trim());
            let _ = writeln!(out, "  stderr: {}", c.stderr.trim());
        }
        let a = &self.api_release;
        let _ = writeln!(
            out,
            "same release through the API ({}): {:.3} s, {} round trips ({} reads, {} commits), {} addresses released; block values read {}, claim entries read {}",
            a.twin,
            a.seconds,
            a.round_trips,
            a.reads,
            a.commits,
            a.released_addresses,
            a.read_kinds.block_values,
            a.read_kinds.claim_entries
        );
        let _ = writeln!(
            out,
            "after: {} addresses and {} blocks of the node; {} allocations in the store",
            self.node_allocations_after, self.node_blocks_after, self.allocations_after
        );
        let _ = writeln!(
            out,
            "check: {}",
            if self.check.clean {
                "clean"
            } else {
                "PROBLEMS"
            }
        );
        for problem in &self.check.problems {
            let _ = writeln!(out, "  {problem}");
        }
        let _ = writeln!(out, "result: {}", if self.passed { "PASS" } else { "FAIL" });
        out
    }
}

/// Runs the scenario.
///
/// # Errors
/// [`LoadError::Usage`] without store settings or without `blockipamctl`; [`LoadError::Failed`]
/// when a store cannot be set up or read back, or `blockipamctl` cannot be started.
pub async fn run(
    config: &LoadConfig,
    scenario: &ScenarioConfig,
    target: StoreTarget,
) -> Result<NodeReleaseReport, LoadError> {
    if matches!(target, StoreTarget::Shared(_)) {
        return Err(LoadError::usage(
            "the node-release scenario needs store settings (blockipamctl opens the store itself)",
        ));
    }
    let ctl = scenario
        .blockipamctl
        .clone()
        .ok_or_else(|| LoadError::usage("node-release needs the blockipamctl binary"))?;
    if !ctl.is_file() {
        return Err(LoadError::failed(format!(
            "blockipamctl was not found at {}: build it with `cargo build -p blockipamctl` or pass --blockipamctl PATH",
            ctl.display()
        )));
    }
    let host = config.prefill_host();
    let (settings, store, temporary) = open_target(config, target).await?;
    let settings = settings.ok_or_else(|| LoadError::usage("node-release needs store settings"))?;

    // The twin: the same kind of store, beside the real one.
    let twin_dir = tempfile::Builder::new()
        .prefix("blockipam-load-twin-")
        .tempdir()
        .map_err(|e| LoadError::failed(format!("cannot create a temporary directory: {e}")))?;
    let mut twin_settings = settings.clone();
    let kind = settings.datastore_type();
    let twin_description = match &mut twin_settings.backend {
        Backend::Etcd(etcd) => {
            let prefix = etcd.prefix.clone().unwrap_or_default();
            let twin_prefix = format!("{}-twin/", prefix.trim_end_matches('/'));
            etcd.prefix = Some(twin_prefix.clone());
            format!("the same etcd under prefix {twin_prefix}, deleted afterwards")
        }
        Backend::Sled { path } | Backend::Redb { path } => {
            *path = Some(twin_dir.path().join(format!("twin.{kind}")));
            format!("a second {kind} store in a temporary directory")
        }
    };
    twin_settings.create_if_missing = true;
    let twin_store = open(&twin_settings).await?;

    let started = Instant::now();
    fill(&Ipam::new(store.clone()), config, &host, scenario.addresses).await?;
    let fill_seconds = started.elapsed().as_secs_f64();
    fill(
        &Ipam::new(twin_store.clone()),
        config,
        &host,
        scenario.addresses,
    )
    .await?;

    // The real command, against the real store (closed here first: an embedded store admits
    // one process).
    drop(store);
    let blockipamctl = run_blockipamctl(&ctl, &settings, &host)?;

    // The same release through the API, counted, on the twin.
    let classifier = Arc::new(ReadClassifier::new(twin_store.clone()));
    let counting = Arc::new(CountingStore::new(classifier.clone()));
    let started = Instant::now();
    let released = Ipam::new(counting.clone())
        .release_host(&host, true)
        .await
        .map_err(|e| LoadError::failed(format!("the API release on the twin failed: {e}")))?;
    let seconds = started.elapsed().as_secs_f64();
    let RoundTrips { reads, commits } = counting.round_trips();
    let api_release = ApiRelease {
        twin: twin_description,
        seconds,
        reads,
        commits,
        round_trips: reads + commits,
        read_kinds: classifier.kinds(),
        released_addresses: released.released_addresses.len() as u64,
    };
    drop(twin_store);
    if settings.etcd().is_some() {
        delete_etcd_prefix(&twin_settings).await?;
    }

    // Verify the real store.
    let ipam = Ipam::new(open(&settings).await?);
    let allocations = ipam
        .list_allocations()
        .await
        .map_err(|e| LoadError::failed(format!("cannot list the allocations: {e}")))?;
    let node_allocations_after = allocations
        .iter()
        .filter(|a| a.attributes.get("node") == Some(&host))
        .count() as u64;
    let node_blocks_after = ipam
        .utilization()
        .await
        .map_err(|e| LoadError::failed(format!("cannot read the utilization: {e}")))?
        .pools
        .iter()
        .flat_map(|p| &p.blocks)
        .filter(|b| b.host.as_deref() == Some(host.as_str()))
        .count() as u64;
    let check = check(&ipam).await?;
    drop(ipam);
    drop(temporary);
    let passed = blockipamctl.exit_code == Some(0)
        && node_allocations_after == 0
        && node_blocks_after == 0
        && api_release.released_addresses == scenario.addresses
        && check.clean;
    Ok(NodeReleaseReport {
        scenario: "node-release",
        store: settings.describe(),
        node: host,
        addresses: scenario.addresses,
        fill_seconds,
        blockipamctl,
        api_release,
        node_allocations_after,
        node_blocks_after,
        allocations_after: allocations.len() as u64,
        check,
        passed,
    })
}

/// Gives `host` `addresses` addresses, one pod handle each, one call after another.
async fn fill(
    ipam: &Ipam,
    config: &LoadConfig,
    host: &str,
    addresses: u64,
) -> Result<(), LoadError> {
    prepare_pool(ipam, config).await?;
    for index in 0..addresses {
        let container = container_id(PodKind::NodeRelease, 0, index);
        let request = AutoAssignRequest {
            handle: config.handle(&container),
            host: host.to_owned(),
            num_v4: 1,
            attributes: pods::attributes(&config.network, &container),
            skip_block_edges: true,
            ..AutoAssignRequest::default()
        };
        ipam.auto_assign(&request).await.map_err(|e| {
            LoadError::failed(format!(
                "filling {host}: address {index} of {addresses} failed: {e} (many addresses need --max-blocks-per-host 0)"
            ))
        })?;
    }
    Ok(())
}

/// `blockipamctl node release <host> --addresses` against the store `settings` name.
fn run_blockipamctl(
    ctl: &Path,
    settings: &DatastoreSettings,
    host: &str,
) -> Result<CtlRun, LoadError> {
    let mut args: Vec<String> = vec![
        "--datastore-type".into(),
        settings.datastore_type().as_str().into(),
        "--agent-socket".into(),
        "none".into(),
    ];
    let mut push = |flag: &str, value: Option<String>| {
        if let Some(value) = value {
            args.push(flag.into());
            args.push(value);
        }
    };
    let text = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
    match settings.etcd() {
        Some(etcd) => {
            push("--etcd-endpoints", Some(etcd.endpoints.join(",")));
            push("--etcd-prefix", etcd.prefix.clone());
            push("--etcd-ca-cert-file", text(&etcd.ca_cert_file));
            push("--etcd-cert-file", text(&etcd.cert_file));
            push("--etcd-key-file", text(&etcd.key_file));
            push("--etcd-username", etcd.username.clone());
        }
        None => push("--datastore-path", text(&settings.resolved_path())),
    }
    args.extend(["node", "release", host, "--addresses"].map(String::from));
    let mut command = Command::new(ctl);
    command.env_clear().args(&args);
    if let Some(password) = settings.etcd().and_then(|etcd| etcd.password.as_ref()) {
        command.env("ETCD_PASSWORD", password.expose());
    }
    let started = Instant::now();
    let output = command
        .output()
        .map_err(|e| LoadError::failed(format!("cannot run {}: {e}", ctl.display())))?;
    let wall_seconds = started.elapsed().as_secs_f64();
    Ok(CtlRun {
        command: format!("{} {}", ctl.display(), args.join(" ")),
        wall_seconds,
        exit_code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    })
}

/// Deletes every key under the etcd prefix `settings` name (the twin's).
async fn delete_etcd_prefix(settings: &DatastoreSettings) -> Result<(), LoadError> {
    let config = settings
        .etcd()
        .ok_or_else(|| LoadError::usage("the twin store is not on etcd"))?
        .config()
        .map_err(|e| LoadError::usage(e.to_string()))?;
    let client = StatusClient::new(&config).map_err(LoadError::failed)?;
    let mut connection = client.connect_cluster().await.map_err(LoadError::failed)?;
    connection
        .delete(
            config.prefix.clone(),
            Some(DeleteOptions::new().with_prefix()),
        )
        .await
        .map_err(|e| LoadError::failed(format!("cannot delete the twin {}: {e}", config.prefix)))?;
    Ok(())
}

/// `blockipamctl` next to this executable.
pub fn default_blockipamctl() -> Option<PathBuf> {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("blockipamctl")))
}
