//! The blockipam CNI IPAM plugin as a library, with [`run`] as the entry point.
//!
//! [`run`] takes the environment, stdin, stdout and stderr of one invocation and returns the exit
//! status, so tests drive it in-process and the binary is a thin wrapper.
//!
//! One call: check the environment and spec version as libcni's skeleton does, parse the
//! netconf, take the host lock (`ipam_lock_file`), open the store, run the command under the
//! deadline, close the store, release the lock, and only then print the result (or the error
//! JSON) on stdout.

pub mod arena;
pub mod args;
pub mod commands;
pub mod errors;
pub mod logging;
pub mod netconf;
pub mod protocol;
pub mod timestamp;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use blockipam_store::{DatastoreSettings, DatastoreType, StoreRoute};
use ipam_core::fault::{self, FaultPoint};
use ipam_core::lockfile::LockFile;
use ipam_core::{CountingStore, Ipam};
use serde_json::Value;

use crate::args::{parse_cni_args, CniArgs};
use crate::commands::Attachment;
use crate::errors::{from_ipam, from_kv, from_lock};
use crate::logging::Sink;
use crate::netconf::{is_valid_cni_name, parse_header, parse_netconf, resolve_nodename, NetConf};
use crate::protocol::{codes, is_supported, version_info, CniError, SpecVersion, CURRENT_VERSION};

/// The one-line text printed (on stderr) when `CNI_COMMAND` is not set.
pub const ABOUT: &str = concat!(
    "blockipam v",
    env!("CARGO_PKG_VERSION"),
    ": CNI IPAM plugin with Calico's block-affinity allocator on sled, redb or etcd v3; CNI spec 0.1.0, 0.2.0, 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0"
);

/// Longest an etcd connection attempt may take (see [`etcd_timeouts`]).
const ETCD_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest one etcd request may take (see [`etcd_timeouts`]).
const ETCD_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Initial size of the buffer the netconf is read into (it grows for a larger one).
const NETCONF_READ_CAPACITY: usize = 64 * 1024;
/// Longest accepted interface name (Linux `IFNAMSIZ` - 1).
const MAX_IFNAME_LEN: usize = 15;

/// A CNI command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Allocate for an attachment.
    Add,
    /// Release an attachment's addresses.
    Del,
    /// Verify an attachment still holds its addresses.
    Check,
    /// Report supported spec versions.
    Version,
    /// Release allocations of attachments that no longer exist.
    Gc,
    /// Report whether ADD can succeed.
    Status,
}

impl Command {
    fn parse(text: &str) -> Option<Command> {
        Some(match text {
            "ADD" => Command::Add,
            "DEL" => Command::Del,
            "CHECK" => Command::Check,
            "VERSION" => Command::Version,
            "GC" => Command::Gc,
            "STATUS" => Command::Status,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Version => "VERSION",
            Command::Gc => "GC",
            Command::Status => "STATUS",
        }
    }

    /// The environment variables this command requires (libcni's skeleton's table).
    fn required_env(self) -> &'static [&'static str] {
        match self {
            Command::Add | Command::Check => {
                &["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"]
            }
            Command::Del => &["CNI_CONTAINERID", "CNI_IFNAME", "CNI_PATH"],
            Command::Gc | Command::Status => &["CNI_PATH"],
            Command::Version => &[],
        }
    }

    /// The oldest spec version that has this command.
    fn minimum_version(self) -> Option<SpecVersion> {
        match self {
            Command::Check => Some(SpecVersion(0, 4, 0)),
            Command::Gc | Command::Status => Some(SpecVersion(1, 1, 0)),
            _ => None,
        }
    }
}

/// Runs one invocation: `env` is the process environment (only `CNI_*` keys are read), `stdin`
/// the netconf. The result or the error JSON goes to `stdout`; log lines (unless
/// `log_file_path` is set) and the about text go to `stderr` when the call ends. Returns the exit
/// status: 0 on success, 1 after an error JSON.
pub fn run(
    env: &BTreeMap<String, String>,
    stdin: &mut dyn Read,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> i32 {
    let buffer = Arc::new(Mutex::new(Vec::<u8>::new()));
    let sink: Sink = buffer.clone();
    let status = run_with_log_sink(env, stdin, stdout, sink);
    let logged = match buffer.lock() {
        Ok(mut bytes) => std::mem::take(&mut *bytes),
        Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
    };
    let _ = stderr.write_all(&logged);
    let _ = stderr.flush();
    status
}

/// As [`run`], with log lines written to `sink` as they happen (the binary passes its stderr).
pub fn run_with_log_sink(
    env: &BTreeMap<String, String>,
    stdin: &mut dyn Read,
    stdout: &mut dyn Write,
    sink: Sink,
) -> i32 {
    let command = env.get("CNI_COMMAND").map(String::as_str).unwrap_or("");
    if command.is_empty() {
        let mut writer = logging::SinkWriter::new(sink);
        let _ = writeln!(writer, "{ABOUT}");
        return 0;
    }
    let early = logging::dispatch(netconf::LogLevel::Info, sink.clone(), None);
    let mut version = CURRENT_VERSION.to_owned();
    let outcome = tracing::dispatcher::with_default(&early, || {
        execute(env, command, stdin, &sink, &mut version)
    });
    if outcome.is_ok() {
        fault::point(FaultPoint::BeforeReply);
    }
    let (value, status) = match outcome {
        Ok(None) => return 0,
        Ok(Some(value)) => (value, 0),
        Err(error) => (error.to_json(&version), 1),
    };
    // One write for the whole answer (stdout is line-buffered: one system call per line otherwise).
    let written = serde_json::to_vec_pretty(&value)
        .map_err(std::io::Error::from)
        .and_then(|mut bytes| {
            bytes.push(b'\n');
            stdout.write_all(&bytes)
        })
        .and_then(|()| stdout.flush());
    match written {
        Ok(()) => status,
        Err(_) => 1,
    }
}

/// The parsed, validated CNI environment.
#[derive(Debug, Clone, Default)]
struct CniEnv {
    container_id: String,
    ifname: String,
    args: String,
}

fn check_env(env: &BTreeMap<String, String>, command: Command) -> Result<CniEnv, CniError> {
    let get = |key: &str| env.get(key).map(String::as_str).unwrap_or("");
    let missing: Vec<&str> = command
        .required_env()
        .iter()
        .copied()
        .filter(|key| get(key).is_empty())
        .collect();
    if !missing.is_empty() {
        return Err(CniError::new(
            codes::INVALID_ENVIRONMENT,
            format!("required env variables [{}] missing", missing.join(",")),
        ));
    }
    let container_id = get("CNI_CONTAINERID").to_owned();
    let ifname = get("CNI_IFNAME").to_owned();
    if command.required_env().contains(&"CNI_CONTAINERID") && !is_valid_cni_name(&container_id) {
        return Err(CniError::with_details(
            codes::INVALID_ENVIRONMENT,
            "invalid characters in CNI_CONTAINERID",
            container_id,
        ));
    }
    if command.required_env().contains(&"CNI_IFNAME") {
        if ifname.len() > MAX_IFNAME_LEN {
            return Err(CniError::with_details(
                codes::INVALID_ENVIRONMENT,
                "CNI_IFNAME is too long",
                format!("interface names have at most {MAX_IFNAME_LEN} bytes"),
            ));
        }
        if ifname == "." || ifname == ".." {
            return Err(CniError::new(
                codes::INVALID_ENVIRONMENT,
                "CNI_IFNAME is . or ..",
            ));
        }
        if ifname
            .chars()
            .any(|c| c == '/' || c == ':' || c.is_whitespace())
        {
            return Err(CniError::new(
                codes::INVALID_ENVIRONMENT,
                "CNI_IFNAME contains / or : or whitespace characters",
            ));
        }
    }
    Ok(CniEnv {
        container_id,
        ifname,
        args: get("CNI_ARGS").to_owned(),
    })
}

fn check_version(command: Command, version: &str) -> Result<(), CniError> {
    if let Some(minimum) = command.minimum_version() {
        let parsed =
            SpecVersion::parse(version).map_err(|e| CniError::new(codes::DECODING_FAILURE, e))?;
        if parsed < minimum {
            return Err(CniError::new(
                codes::INCOMPATIBLE_VERSION,
                format!("config version does not allow {}", command.name()),
            ));
        }
    }
    if !is_supported(version) {
        return Err(CniError::with_details(
            codes::INCOMPATIBLE_VERSION,
            "incompatible CNI versions",
            format!(
                "config is {version:?}, plugin supports {:?}",
                protocol::SUPPORTED_VERSIONS
            ),
        ));
    }
    Ok(())
}

fn execute(
    env: &BTreeMap<String, String>,
    command_text: &str,
    stdin: &mut dyn Read,
    sink: &Sink,
    version: &mut String,
) -> Result<Option<Value>, CniError> {
    let command = Command::parse(command_text).ok_or_else(|| {
        CniError::new(
            codes::INVALID_ENVIRONMENT,
            format!("unknown CNI_COMMAND: {command_text}"),
        )
    })?;
    let cni_env = check_env(env, command)?;
    if command == Command::Version {
        return Ok(Some(version_info()));
    }
    // Sized for any ordinary netconf, so that it is read in one system call.
    let mut input = Vec::with_capacity(NETCONF_READ_CAPACITY);
    stdin
        .read_to_end(&mut input)
        .map_err(|e| CniError::new(codes::IO_FAILURE, format!("error reading from stdin: {e}")))?;
    let (value, name, requested_version) = parse_header(&input)?;
    if is_supported(&requested_version) {
        *version = requested_version.clone();
    }
    check_version(command, &requested_version)?;
    let conf = parse_netconf(&value, name, requested_version)?;
    let dispatch = logging::dispatch(conf.log_level, sink.clone(), conf.log_file_path.as_deref());
    tracing::dispatcher::with_default(&dispatch, || {
        let outcome = serve(command, &cni_env, &conf);
        match &outcome {
            Ok(_) => {}
            Err(e) => tracing::error!(
                command = command.name(),
                container = %cni_env.container_id,
                ifname = %cni_env.ifname,
                code = e.code,
                "{}",
                e.msg
            ),
        }
        outcome
    })
}

fn serve(command: Command, env: &CniEnv, conf: &NetConf) -> Result<Option<Value>, CniError> {
    let args = match command {
        Command::Add | Command::Del | Command::Check => parse_cni_args(&env.args)?,
        _ => CniArgs::default(),
    };
    let node = resolve_nodename(conf)?;
    if command == Command::Add {
        refuse_reservations_node(&node)?;
    }
    // Another call of this node holding the host lock beyond the wait is code 11 for every
    // command, STATUS included: it clears up by itself, the plugin is not unavailable.
    let lock = LockFile::acquire(&conf.lock_file, conf.lock_wait).map_err(|e| from_lock(&e))?;
    let outcome = locked(command, env, conf, &args, &node, lock);
    if command == Command::Status {
        // STATUS speaks in one code: the plugin is not available, and why.
        return outcome.map_err(|e| match e.code {
            codes::INVALID_NETWORK_CONFIG
            | codes::UNSUPPORTED_FIELD
            | codes::DECODING_FAILURE
            | codes::PLUGIN_NOT_AVAILABLE => e,
            _ => CniError::with_details(
                codes::PLUGIN_NOT_AVAILABLE,
                format!("the IPAM store is not usable: {}", e.msg),
                e.details,
            ),
        });
    }
    outcome
}

/// Refuses to allocate for the network reservations' pseudo-node: gateway addresses are reserved
/// under that name, and a pod's address there would be taken for a reservation (never reclaimed
/// with a dead node, never listed as a node's). Only ADD is refused, before the store is opened:
/// DEL and CHECK still reach an address an earlier release allocated under that name.
fn refuse_reservations_node(node: &str) -> Result<(), CniError> {
    if node == commands::GATEWAY_NODE {
        return Err(CniError::config(format!(
            "the node name {node:?} is the network reservations' pseudo-node (gateway addresses \
             are reserved under it), not a node: set nodename (or nodename_file) to this node's \
             own name"
        )));
    }
    Ok(())
}

fn locked(
    command: Command,
    env: &CniEnv,
    conf: &NetConf,
    args: &CniArgs,
    node: &str,
    lock: LockFile,
) -> Result<Option<Value>, CniError> {
    fault::point(FaultPoint::HoldingLock);
    // Sockets and timers only: no signal driver (its set-up is a socketpair and a handler table
    // at every call, for nothing the plugin waits on).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|e| CniError::new(codes::IO_FAILURE, format!("cannot start the runtime: {e}")))?;
    let outcome = runtime.block_on(async {
        // At most a day away (netconf.rs): the sum cannot overflow. The deadline travels with
        // every request to an agent, which then starts no commit after this call has given up
        // (docs/agent.md).
        let deadline = tokio::time::Instant::now() + conf.timeout;
        let call = with_store(command, env, conf, args, node);
        match tokio::time::timeout_at(deadline, backend_agent::deadline::within(deadline, call))
            .await
        {
            Ok(outcome) => outcome,
            Err(_) => Err(CniError::new(
                codes::TRY_AGAIN_LATER,
                format!(
                    "{} did not finish within its deadline of {:?} (timeout_seconds)",
                    command.name(),
                    conf.timeout
                ),
            )),
        }
    });
    // Every store handle is closed (and any blocking store work finished) before the lock goes.
    drop(runtime);
    drop(lock);
    outcome
}

/// The etcd connect and request timeouts under the call's `deadline`: 5 s and 10 s, so that a
/// dead endpoint is given up in time to try another; a timeout that could not fire before the
/// deadline is moved past it, so that a silent etcd always ends the call with the deadline's own
/// error (naming `timeout_seconds`) instead of whichever of two equal timers fires first.
fn etcd_timeouts(deadline: Duration) -> (Duration, Duration) {
    let beyond_deadline = deadline + Duration::from_secs(1);
    let under = |cap: Duration| if cap < deadline { cap } else { beyond_deadline };
    (under(ETCD_CONNECT_TIMEOUT), under(ETCD_REQUEST_TIMEOUT))
}

/// Logs (at info, every call) which way the store was reached, so that an operator can tell the
/// agent is used. Through an agent serving etcd, the netconf's etcd TLS files and credentials are
/// not used: the agent's own are.
fn log_route(route: &StoreRoute, settings: &DatastoreSettings) {
    match route {
        StoreRoute::Agent { .. } if settings.etcd().is_some() => tracing::info!(
            "store reached {route}; the agent's own etcd credentials and TLS files are used, not \
             this netconf's"
        ),
        StoreRoute::Agent { .. } => tracing::info!("store reached {route}"),
        _ => tracing::info!("store opened {route}"),
    }
}

async fn with_store(
    command: Command,
    env: &CniEnv,
    conf: &NetConf,
    args: &CniArgs,
    node: &str,
) -> Result<Option<Value>, CniError> {
    let mut settings = conf.datastore.clone();
    // A netconf listing pools describes a network that may start from nothing: its first call
    // creates the store. Any other call fails on a missing store rather than hand out addresses
    // from an empty new one while the lost store's (a deleted file, an unmounted volume) are in use.
    settings.create_if_missing = !conf.pools.is_empty();
    // Nor over a store the node agent's marker says this node had (a lost one).
    settings
        .refuse_to_replace_a_lost_store()
        .map_err(|e| from_kv(&e, true))?;
    // An embedded store's lock is waited for within the call's deadline: the call cannot return
    // before an open in progress does, so a longer wait would outlive `timeout_seconds`.
    settings.lock_wait = settings.lock_wait.min(conf.timeout);
    if let Some(etcd) = settings.etcd_mut() {
        etcd.timeouts = Some(etcd_timeouts(conf.timeout));
    }
    tracing::debug!(store = %settings.describe(), "opening the store");
    let (store, route) = settings
        .open_routed(|| {
            // sled's start allocates and frees megabytes: the system allocator reuses that
            // memory, the arena would touch a fresh page for each of it (arena.rs).
            if settings.datastore_type() == DatastoreType::Sled {
                arena::CALL_ARENA.stop_bumping();
            }
        })
        .await
        .map_err(|e| from_kv(&e, true))?;
    log_route(&route, &settings);
    // Every call logs (at debug) how many store round trips it made: the figure the allocator
    // is built to keep at two per steady-state ADD and per DEL.
    let counted = Arc::new(CountingStore::new(store));
    // Every commit also rewrites this node's activity record: the evidence that keeps a node
    // whose agent is down, but whose runtime keeps calling, from being reclaimed as dead.
    let ipam = Ipam::new(counted.clone())
        .recording_activity(node, env!("CARGO_PKG_VERSION"))
        .map_err(|e| from_ipam(&e))?;
    let attachment = Attachment {
        conf,
        container_id: &env.container_id,
        ifname: &env.ifname,
        args,
        node,
    };
    let outcome = match command {
        Command::Add => commands::add(&ipam, &attachment).await.map(|result| {
            let addresses: Vec<String> = result.ips.iter().map(|i| i.address.to_string()).collect();
            tracing::info!(
                handle = %attachment.handle(),
                ifname = %env.ifname,
                %node,
                ?addresses,
                "ADD done"
            );
            Some(result.render(&conf.cni_version))
        }),
        Command::Del => commands::del(&ipam, &attachment).await.map(|_| None),
        Command::Check => commands::check(&ipam, &attachment).await.map(|()| None),
        Command::Gc => commands::gc(&ipam, conf, node).await.map(|_| None),
        Command::Status => commands::status(&ipam, conf, node).await.map(|()| None),
        Command::Version => Ok(Some(version_info())),
    };
    let trips = counted.round_trips();
    tracing::debug!(
        command = command.name(),
        reads = trips.reads,
        commits = trips.commits,
        round_trips = trips.total(),
        "store round trips"
    );
    // Close the store before anything is printed. An engine that panicked inside the call (redb
    // on some damaged pages; the adapter turned that panic into the call's error) may panic
    // again while closing, on the lock its first panic poisoned: that must not kill the plugin
    // without an answer. What was committed is on disk already (each commit is synced).
    let closed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        drop(ipam);
        drop(counted);
    }));
    if closed.is_err() {
        tracing::error!("the store failed while closing (see the internal failure above)");
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_for(command: &str, ifname: &str) -> BTreeMap<String, String> {
        [
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_NETNS", "/var/run/netns/test"),
            ("CNI_IFNAME", ifname),
            ("CNI_PATH", "/opt/cni/bin"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    #[test]
    fn an_interface_name_of_fifteen_bytes_is_the_longest_accepted() {
        let longest = "a".repeat(MAX_IFNAME_LEN);
        assert_eq!(MAX_IFNAME_LEN, 15, "Linux IFNAMSIZ - 1");
        let env = check_env(&env_for("ADD", &longest), Command::Add).expect("15 characters");
        assert_eq!(env.ifname, longest);
        let refused =
            check_env(&env_for("ADD", &"a".repeat(16)), Command::Add).expect_err("16 characters");
        assert_eq!(refused.code, codes::INVALID_ENVIRONMENT);
        assert_eq!(refused.msg, "CNI_IFNAME is too long");
        // The kernel counts bytes: eight two-byte characters are sixteen.
        let wide = "é".repeat(8);
        let refused = check_env(&env_for("ADD", &wide), Command::Add).expect_err("16 bytes");
        assert_eq!(refused.code, codes::INVALID_ENVIRONMENT);
        assert!(refused.details.contains("15 bytes"), "{refused:?}");
    }

    #[test]
    fn etcd_timeouts_that_cannot_fire_before_the_deadline_are_moved_past_it() {
        let s = Duration::from_secs;
        // A long deadline keeps both: a dead endpoint is given up in time to try another.
        assert_eq!(etcd_timeouts(s(30)), (s(5), s(10)));
        assert_eq!(etcd_timeouts(s(11)), (s(5), s(10)));
        // A timeout equal to the deadline could fire with it: it is moved a second past it.
        assert_eq!(etcd_timeouts(s(10)), (s(5), s(11)));
        assert_eq!(etcd_timeouts(s(5)), (s(6), s(6)));
        assert_eq!(etcd_timeouts(s(1)), (s(2), s(2)));
        assert_eq!(
            etcd_timeouts(Duration::from_millis(5_500)),
            (s(5), Duration::from_millis(6_500))
        );
    }
}
