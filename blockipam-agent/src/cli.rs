//! The agent's command line: the socket, who may connect, and the same store selection flags and
//! environment variables as `blockipamctl`.

use std::path::PathBuf;
use std::time::Duration;

use blockipam_store::flags::EtcdConnectionFlags;
use blockipam_store::{
    seconds_from_f64, DatastoreSettings, RawDatastoreSettings, Secret, DEFAULT_AGENT_SOCKET,
};
use clap::builder::FalseyValueParser;
use clap::Parser;

use crate::leak_collection::LeakAction;
use crate::AgentError;

/// blockipam-agent: holds a blockipam store open and serves it to the plugin and blockipamctl on
/// this node over a unix socket.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "blockipam-agent",
    // A negative number is a value, refused by its flag's own check, not an unknown argument.
    allow_negative_numbers = true,
    version,
    about = "Holds a blockipam store open and serves it to the plugin and blockipamctl over a unix socket",
    after_help = "Stops cleanly on SIGTERM or SIGINT: stops accepting, lets requests in flight finish, \
                  closes the store and removes the socket. See docs/agent.md."
)]
pub struct AgentArgs {
    /// The unix socket to serve on
    #[arg(long, value_name = "PATH", env = "BLOCKIPAM_AGENT_SOCKET", default_value = DEFAULT_AGENT_SOCKET)]
    pub socket: PathBuf,
    /// A user (uid) besides root allowed to connect; repeat for several. Makes the socket 0666 and
    /// its new directory 0711: the peer credentials keep other users out
    #[arg(
        long = "allowed-uid",
        value_name = "UID",
        env = "BLOCKIPAM_AGENT_ALLOWED_UIDS",
        value_delimiter = ','
    )]
    pub allowed_uid: Vec<u32>,
    /// Seconds requests in flight at shutdown may take to finish
    #[arg(
        long,
        value_name = "SECONDS",
        env = "BLOCKIPAM_AGENT_SHUTDOWN_GRACE_SECONDS",
        default_value = "10",
        value_parser = seconds_up_to_a_day
    )]
    pub shutdown_grace_seconds: f64,
    /// Serve Prometheus metrics over HTTP at this IP:PORT (GET /metrics), for example
    /// 127.0.0.1:9091, with the probes GET /healthz (live) and GET /readyz (store open, socket
    /// accepting, store answering; 503 with the reason otherwise); off when absent
    #[arg(
        long,
        value_name = "ADDR",
        env = "BLOCKIPAM_AGENT_METRICS_LISTEN",
        help_heading = "Metrics"
    )]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Seconds a computation of the ipam_* gauges (a read of the pools and the claim and
    /// borrowed-block indexes, then of the blocks holding another node's addresses) is reused
    /// by later scrapes; 0 computes on every scrape
    #[arg(
        long,
        value_name = "SECONDS",
        env = "BLOCKIPAM_AGENT_METRICS_CACHE_SECONDS",
        default_value = "5",
        help_heading = "Metrics",
        value_parser = seconds_up_to_a_day
    )]
    pub metrics_cache_seconds: f64,
    /// Create the store when it does not exist, always (off: a missing store is an error)
    #[arg(long, env = "BLOCKIPAM_AGENT_CREATE_IF_MISSING", value_parser = FalseyValueParser::new())]
    pub create_if_missing: bool,
    /// Create a missing embedded store only if this node never had one: a marker file beside the
    /// store (<store>.created) records its creation, and a missing store with a marker is refused
    #[arg(long, env = "BLOCKIPAM_AGENT_CREATE_ON_FIRST_START", value_parser = FalseyValueParser::new())]
    pub create_on_first_start: bool,
    /// Store type: sled, redb or etcdv3 [default: etcdv3 when etcd endpoints are given, else sled]
    #[arg(
        long,
        value_name = "TYPE",
        env = "DATASTORE_TYPE",
        help_heading = "Store"
    )]
    pub datastore_type: Option<String>,
    /// Embedded store path [default: /var/lib/blockipam/store.sled (sled), /var/lib/blockipam/store.redb (redb)]
    #[arg(
        long,
        value_name = "PATH",
        env = "DATASTORE_PATH",
        help_heading = "Store"
    )]
    pub datastore_path: Option<PathBuf>,
    /// etcd endpoints and TLS files
    #[command(flatten)]
    pub etcd: EtcdConnectionFlags,
    /// etcd key prefix, ending with '/'; empty means the default [default: /blockipam/]
    #[arg(
        long,
        value_name = "PREFIX",
        env = "ETCD_PREFIX",
        help_heading = "Store"
    )]
    pub etcd_prefix: Option<String>,
    /// etcd user name, for clusters with authentication on (with a password)
    #[arg(
        long,
        value_name = "NAME",
        env = "ETCD_USERNAME",
        help_heading = "Store"
    )]
    pub etcd_username: Option<String>,
    /// etcd password; prefer the environment variable, which other users cannot read in the process list
    #[arg(
        long,
        value_name = "PASSWORD",
        env = "ETCD_PASSWORD",
        hide_env_values = true,
        help_heading = "Store"
    )]
    pub etcd_password: Option<Secret>,
    /// Seconds to wait for an embedded store another process holds
    #[arg(
        long,
        value_name = "SECONDS",
        env = "BLOCKIPAM_LOCK_WAIT_SECONDS",
        default_value = "10",
        help_heading = "Store",
        value_parser = seconds_up_to_a_day
    )]
    pub lock_wait_seconds: f64,
    /// Upper bound in seconds on one etcd request, connecting included [default: 10]
    #[arg(
        long,
        value_name = "SECONDS",
        env = "BLOCKIPAM_ETCD_TIMEOUT_SECONDS",
        help_heading = "Store",
        value_parser = positive_seconds_up_to_a_day
    )]
    pub etcd_timeout_seconds: Option<f64>,
    /// This node's name, as the plugin records it (liveness, reclaim, leak collection) [default: /var/lib/calico/nodename, else the host name, lower-cased]
    #[arg(
        long,
        value_name = "NAME",
        env = "NODENAME",
        help_heading = "Liveness and dead-node reclaim (etcd only)"
    )]
    pub node: Option<String>,
    /// TTL of the etcd lease that keeps this node's liveness key; renewed every TTL/4 to TTL/3
    #[arg(long, value_name = "SECONDS", env = "BLOCKIPAM_AGENT_LIVENESS_TTL_SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600), help_heading = "Liveness and dead-node reclaim (etcd only)")]
    pub liveness_ttl_seconds: u64,
    /// Length of the grace countdown (an etcd lease) a node must stay through with no agent
    /// liveness key and no plugin commit before its blocks are released (its addresses are kept)
    #[arg(long, value_name = "SECONDS", env = "BLOCKIPAM_AGENT_DEAD_NODE_GRACE_SECONDS", default_value_t = 900, value_parser = clap::value_parser!(u64).range(1..=ipam_core::dead_nodes::MAX_GRACE_SECONDS), help_heading = "Liveness and dead-node reclaim (etcd only)")]
    pub dead_node_grace_seconds: u64,
    /// Seconds between two looks of the reclaimer (the leader's, the others' to become leader)
    #[arg(long, value_name = "SECONDS", env = "BLOCKIPAM_AGENT_RECLAIM_INTERVAL_SECONDS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400), help_heading = "Liveness and dead-node reclaim (etcd only)")]
    pub reclaim_interval_seconds: u64,
    /// Never reclaim dead nodes from this agent (this node's own liveness is still kept)
    #[arg(
        long,
        env = "BLOCKIPAM_AGENT_NO_RECLAIM",
        value_parser = FalseyValueParser::new(),
        help_heading = "Liveness and dead-node reclaim (etcd only)"
    )]
    pub no_reclaim: bool,
    /// As reclaimer leader, also release empty blocks hosts no longer need (as `blockipamctl blocks release-empty --apply`) once empty this long; 0: never
    #[arg(
        long,
        value_name = "SECONDS",
        env = "BLOCKIPAM_AGENT_EMPTY_BLOCK_RELEASE_SECONDS",
        default_value_t = 900,
        help_heading = "Liveness and dead-node reclaim (etcd only)"
    )]
    pub empty_block_release_seconds: u64,
    /// Compare this node's allocations with the pods the container runtime runs: release those
    /// whose container has been gone at every look for the grace (release), only log and count
    /// (report), or never ask the runtime (off)
    #[arg(
        long,
        value_enum,
        value_name = "ACTION",
        env = "BLOCKIPAM_AGENT_LEAK_COLLECTION",
        default_value = "release",
        help_heading = "Leak collection (container runtime)"
    )]
    pub leak_collection: LeakAction,
    /// The container runtime's CRI socket (containerd's; CRI-O's is /var/run/crio/crio.sock)
    #[arg(
        long,
        value_name = "PATH",
        env = "BLOCKIPAM_AGENT_CRI_SOCKET",
        default_value = cri_client::CONTAINERD_SOCKET,
        help_heading = "Leak collection (container runtime)"
    )]
    pub cri_socket: PathBuf,
    /// How long an allocation's container must have been gone at every look (and the allocation
    /// at least this old) before it is released (Calico's leakGracePeriod)
    #[arg(long, value_name = "SECONDS", env = "BLOCKIPAM_AGENT_LEAK_GRACE_SECONDS", default_value_t = ipam_core::allocator::leaks::DEFAULT_LEAK_GRACE_SECONDS, value_parser = clap::value_parser!(u64).range(1..), help_heading = "Leak collection (container runtime)")]
    pub leak_grace_seconds: u64,
    /// Seconds between two looks at the runtime; looks more than three intervals apart restart
    /// every countdown
    #[arg(long, value_name = "SECONDS", env = "BLOCKIPAM_AGENT_LEAK_SCAN_SECONDS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400), help_heading = "Leak collection (container runtime)")]
    pub leak_scan_seconds: u64,
    /// libcni's cache directory (its results/ record each ADD): a live pod's address the store
    /// records as free is recorded for it again from there
    #[arg(
        long,
        value_name = "PATH",
        env = "BLOCKIPAM_AGENT_CNI_CACHE_DIR",
        default_value = crate::cni_cache::DEFAULT_CNI_CACHE_DIR,
        help_heading = "Leak collection (container runtime)"
    )]
    pub cni_cache_dir: PathBuf,
}

/// A seconds flag's value, 0 to one day with fractions: checked as the flags are parsed, so a bad
/// one is a usage error (status 2) before anything starts, as in `blockipamctl`.
fn seconds_up_to_a_day(text: &str) -> Result<f64, String> {
    checked_seconds(text, true)
}

/// As [`seconds_up_to_a_day`], without 0.
fn positive_seconds_up_to_a_day(text: &str) -> Result<f64, String> {
    checked_seconds(text, false)
}

fn checked_seconds(text: &str, allow_zero: bool) -> Result<f64, String> {
    let lower_bound = if allow_zero {
        "0 or more"
    } else {
        "more than 0"
    };
    blockipam_store::parse_seconds(text, allow_zero)
        .map(|duration| duration.as_secs_f64())
        .map_err(|_| format!("expected {lower_bound} seconds, up to one day"))
}

fn seconds(value: f64, flag: &str, allow_zero: bool) -> Result<Duration, AgentError> {
    seconds_from_f64(value, allow_zero).map_err(|_| {
        AgentError::new(format!(
            "invalid value {value} for --{flag}: expected seconds, up to one day"
        ))
    })
}

impl AgentArgs {
    /// The store these flags select, opened directly (an agent never goes through an agent).
    ///
    /// # Errors
    /// [`AgentError`] for an unknown type, a bad number of seconds, or incomplete etcd settings.
    pub fn datastore_settings(&self) -> Result<DatastoreSettings, AgentError> {
        // Checked here rather than by clap, which would count a variable set to `false` as given.
        if self.create_if_missing && self.create_on_first_start {
            return Err(AgentError::new(
                "--create-if-missing (BLOCKIPAM_AGENT_CREATE_IF_MISSING) and \
                 --create-on-first-start (BLOCKIPAM_AGENT_CREATE_ON_FIRST_START) are both on: \
                 choose one (the unit sets BLOCKIPAM_AGENT_CREATE_ON_FIRST_START=true; set it to \
                 false to create the store always)",
            ));
        }
        let datastore_type = blockipam_store::given_datastore_type(self.datastore_type.as_deref())
            .map_err(|e| AgentError::new(format!("invalid value for --datastore-type: {e}")))?;
        let etcd_request_timeout = self
            .etcd_timeout_seconds
            .map(|value| seconds(value, "etcd-timeout-seconds", false))
            .transpose()?;
        let lock_wait = seconds(self.lock_wait_seconds, "lock-wait-seconds", true)?;
        let raw = self.etcd.apply(RawDatastoreSettings {
            datastore_type,
            path: self.datastore_path.clone(),
            etcd_prefix: self.etcd_prefix.clone(),
            etcd_username: self.etcd_username.clone(),
            etcd_password: self.etcd_password.clone(),
            etcd_request_timeout,
            ..RawDatastoreSettings::default()
        });
        // `run` turns `lazy_connect` on: an etcd unreachable at boot does not stop the agent.
        Ok(DatastoreSettings {
            lock_wait,
            create_if_missing: self.create_if_missing,
            agent_socket: None,
            ..DatastoreSettings::from_raw(raw).map_err(|e| {
                AgentError::new(format!(
                    "incomplete etcd settings: {}",
                    ipam_core::KvError::from(e)
                ))
            })?
        })
    }

    /// How long a computation of the IPAM gauges is reused.
    ///
    /// # Errors
    /// [`AgentError`] for a bad number of seconds.
    pub fn metrics_cache(&self) -> Result<Duration, AgentError> {
        seconds(self.metrics_cache_seconds, "metrics-cache-seconds", true)
    }

    /// The bound on finishing requests at shutdown.
    ///
    /// # Errors
    /// [`AgentError`] for a bad number of seconds.
    pub fn shutdown_grace(&self) -> Result<Duration, AgentError> {
        seconds(self.shutdown_grace_seconds, "shutdown-grace-seconds", true)
    }
}

#[cfg(test)]
impl AgentArgs {
    /// The flags of an agent of node `node-a` serving `/run/x/agent.sock`, then `args`: what the
    /// unit tests of the agent's settings start from.
    pub(crate) fn parsed_for_test(args: &[&str]) -> AgentArgs {
        let fixed = [
            "blockipam-agent",
            "--node",
            "node-a",
            "--socket",
            "/run/x/agent.sock",
        ];
        AgentArgs::try_parse_from(fixed.into_iter().chain(args.iter().copied()))
            .expect("flags parse")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(args: &[&str]) -> DatastoreSettings {
        AgentArgs::try_parse_from(std::iter::once("blockipam-agent").chain(args.iter().copied()))
            .expect("flags parse")
            .datastore_settings()
            .expect("settings")
    }

    /// Bad leak-collection settings are refused by the flag parser (exit 2), naming the flag.
    #[test]
    fn bad_leak_collection_settings_are_refused_naming_the_flag() {
        for (args, flag) in [
            (&["--leak-collection", "sometimes"][..], "--leak-collection"),
            (&["--leak-collection", ""][..], "--leak-collection"),
            (&["--leak-grace-seconds", "0"][..], "--leak-grace-seconds"),
            (&["--leak-grace-seconds", "15m"][..], "--leak-grace-seconds"),
            (&["--leak-scan-seconds", "0"][..], "--leak-scan-seconds"),
            (&["--leak-scan-seconds", "86401"][..], "--leak-scan-seconds"),
            (&["--cri-socket", ""][..], "--cri-socket"),
            // A negative number is refused as that flag's value, not as an unknown argument.
            (&["--leak-grace-seconds", "-1"][..], "--leak-grace-seconds"),
            (
                &["--shutdown-grace-seconds", "-1"][..],
                "--shutdown-grace-seconds",
            ),
        ] {
            let error = AgentArgs::try_parse_from(
                std::iter::once("blockipam-agent").chain(args.iter().copied()),
            )
            .expect_err(&format!("{args:?} must be refused"));
            assert_eq!(error.exit_code(), 2, "{args:?}");
            assert!(error.to_string().contains(flag), "{args:?}: {error}");
        }
        let parsed = AgentArgs::try_parse_from(["blockipam-agent"]).expect("defaults");
        assert_eq!(parsed.leak_collection, LeakAction::Release);
        assert_eq!(parsed.leak_grace_seconds, 900);
        assert_eq!(parsed.leak_scan_seconds, 60);
        assert_eq!(
            parsed.cri_socket,
            PathBuf::from(cri_client::CONTAINERD_SOCKET)
        );
    }

    /// Every flag can be set from the environment (`/etc/default/blockipam-agent`), and
    /// docs/agent.md names each variable.
    #[test]
    fn every_flag_has_an_environment_variable_named_in_the_docs() {
        use clap::CommandFactory;
        let docs = include_str!("../../docs/agent.md");
        let command = AgentArgs::command();
        let mut flags = 0;
        for arg in command.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if matches!(long, "help" | "version") {
                continue;
            }
            flags += 1;
            let variable = arg
                .get_env()
                .unwrap_or_else(|| panic!("--{long} has no environment variable"))
                .to_string_lossy()
                .into_owned();
            assert!(
                docs.contains(&format!("`--{long}")) && docs.contains(&format!("`{variable}`")),
                "docs/agent.md does not name --{long} and {variable}"
            );
        }
        assert!(flags >= 24, "only {flags} flags seen");
    }

    /// The two ways of creating a store exclude each other; a switch's variable set to `false`
    /// is off, and does not count against the other.
    #[test]
    fn create_if_missing_and_create_on_first_start_exclude_each_other() {
        let parsed = |args: &[&str]| {
            AgentArgs::try_parse_from(
                std::iter::once("blockipam-agent").chain(args.iter().copied()),
            )
            .expect("flags parse")
        };
        let err = parsed(&["--create-if-missing", "--create-on-first-start"])
            .datastore_settings()
            .expect_err("both on");
        assert!(err.message.contains("choose one"), "{err}");
        assert!(settings(&["--create-if-missing"]).create_if_missing);
        assert!(parsed(&["--create-on-first-start"]).create_on_first_start);
    }

    /// The store settings carry the lock wait and the etcd request timeout given by flags, and no
    /// agent socket.
    #[test]
    fn the_store_settings_carry_the_flags_given_and_no_agent_socket() {
        let embedded = settings(&["--lock-wait-seconds", "3"]);
        assert_eq!(embedded.lock_wait, Duration::from_secs(3));
        let etcd = settings(&[
            "--datastore-type",
            "etcdv3",
            "--etcd-endpoints",
            "127.0.0.1:2379",
            "--etcd-timeout-seconds",
            "7",
        ]);
        assert_eq!(
            etcd.etcd().expect("etcd").timeouts,
            Some(blockipam_store::EtcdSettings::timeouts_for_request(
                Duration::from_secs(7)
            ))
        );
        assert_ne!(
            settings(&[]).lock_wait,
            Duration::from_secs(3),
            "the default is not what the test gives"
        );
        // The agent opens its store itself, never through an agent's socket (the plugin's
        // default, which could be this agent's own or another's).
        for settings in [&embedded, &etcd] {
            assert_eq!(settings.agent_socket, None);
        }
    }

    /// `--etcd-prefix ""` (or an empty `ETCD_PREFIX=` line of the environment file, which reaches
    /// the same field) is the default prefix, as an empty `etcd_prefix` in the plugin's netconf:
    /// the agent announces the store the plugin asks for. A prefix given is the one served.
    #[test]
    fn an_empty_etcd_prefix_is_the_default_prefix_and_a_given_one_is_served() {
        let etcd = [
            "--datastore-type",
            "etcdv3",
            "--etcd-endpoints",
            "127.0.0.1:2379",
        ];
        let default = settings(&etcd);
        let empty = settings(&[&etcd[..], &["--etcd-prefix", ""]].concat());
        assert_eq!(empty.etcd().expect("etcd").prefix, None);
        assert_eq!(empty.identity(), default.identity());
        assert_eq!(
            default.identity().etcd_prefix.as_deref(),
            Some(blockipam_store::DEFAULT_ETCD_PREFIX)
        );
        // A prefix given is the one the agent serves.
        let given = settings(&[&etcd[..], &["--etcd-prefix", "/mine/"]].concat());
        assert_eq!(given.identity().etcd_prefix.as_deref(), Some("/mine/"));
    }
}
