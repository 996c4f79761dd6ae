//! The command line: flags (the store selection with blockipamctl's names and environment
//! fallbacks, then the load), their translation into a [`LoadConfig`] and store settings, and the
//! whole program as one function the binary calls.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use blockipam_store::flags::EtcdConnectionFlags;
use blockipam_store::{
    parse_seconds, DatastoreSettings, RawDatastoreSettings, SecondsError, Secret,
};
use clap::{ArgGroup, Parser, ValueEnum};

use crate::config::{LoadConfig, Mode, RawShape, StopRule};
use crate::error::LoadError;
use crate::run::{run, StoreTarget};
use crate::scenario::node_release::default_blockipamctl;
use crate::scenario::{run_scenario, Scenario, ScenarioConfig};

/// Exit status: the run passed.
pub const EXIT_PASSED: i32 = 0;
/// Exit status: an operation failed, a duplicate was found, the check found problems, or the run
/// could not be made.
pub const EXIT_FAILED: i32 = 1;
/// Exit status: bad flags.
pub const EXIT_USAGE: i32 = 2;

/// How operations reach the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// The allocator API in this process.
    Api,
    /// The real blockipam binary, one process per operation.
    Plugin,
}

/// Which scenario runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ScenarioArg {
    /// Nodes churning pods (the load run).
    Churn,
    /// New nodes each ADD one address in a pool whose blocks are nearly all claimed.
    Borrow,
    /// One node's addresses released by `blockipamctl node release --addresses`.
    NodeRelease,
}

/// blockipam-load: simulated nodes churning pods (ADD, hold, DEL) against one blockipam store, from
/// a seeded schedule; reports throughput, latency per operation kind, round trips, conflicts,
/// etcd's database size, the final check and duplicates.
#[derive(Debug, Parser)]
#[command(
    name = "blockipam-load",
    // A negative number is a value, refused by its flag's own check, not an unknown argument.
    allow_negative_numbers = true,
    version,
    about = "Load generator for blockipam: simulated nodes churning pods against one store",
    args_override_self = true,
    group(ArgGroup::new("stop").args(["operations", "duration_seconds", "churn_cycles"])),
    after_help = "Exit status: 0 the run passed; 1 an operation failed (other than a conflict the \
                  allocator retried), a duplicate address, a failed check, or the run could not be \
                  made; 2 usage error.\nAn embedded store without --datastore-path is a new \
                  temporary store; etcd without --etcd-prefix gets a new prefix of its own."
)]
pub struct Cli {
    /// Store type: sled, redb or etcdv3 [default: etcdv3 when etcd endpoints are given, else sled]
    #[arg(
        long,
        env = "DATASTORE_TYPE",
        value_name = "TYPE",
        help_heading = "Store"
    )]
    pub datastore_type: Option<String>,
    /// Embedded store path [default: a new temporary store]
    #[arg(
        long,
        env = "DATASTORE_PATH",
        value_name = "PATH",
        help_heading = "Store"
    )]
    pub datastore_path: Option<PathBuf>,
    /// etcd endpoints and TLS files
    #[command(flatten)]
    pub etcd: EtcdConnectionFlags,
    /// etcd key prefix, ending with '/'; empty means the default [default: /blockipam-load/<network>-<seed>-<time>-<pid>/]
    #[arg(
        long,
        env = "ETCD_PREFIX",
        value_name = "PREFIX",
        help_heading = "Store"
    )]
    pub etcd_prefix: Option<String>,
    /// etcd user name (with a password)
    #[arg(
        long,
        env = "ETCD_USERNAME",
        value_name = "NAME",
        help_heading = "Store"
    )]
    pub etcd_username: Option<String>,
    /// etcd password; prefer the environment variable
    #[arg(
        long,
        env = "ETCD_PASSWORD",
        hide_env_values = true,
        value_name = "PASSWORD",
        help_heading = "Store"
    )]
    pub etcd_password: Option<Secret>,
    /// Seconds to wait for an embedded store another process holds [default: 10]
    #[arg(
        long,
        env = "BLOCKIPAM_LOCK_WAIT_SECONDS",
        value_name = "SECONDS",
        help_heading = "Store"
    )]
    pub lock_wait_seconds: Option<String>,
    /// Upper bound in seconds on one etcd request [default: 10]
    #[arg(
        long,
        env = "BLOCKIPAM_ETCD_TIMEOUT_SECONDS",
        value_name = "SECONDS",
        help_heading = "Store"
    )]
    pub etcd_timeout_seconds: Option<String>,

    /// How operations reach the store
    #[arg(long, value_enum, default_value = "api")]
    pub mode: ModeArg,
    /// Simulated nodes
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub nodes: u32,
    /// Pods each node holds once filled
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub pods_per_node: u32,
    /// Stop after this many operations in total (the fill counts)
    #[arg(long, value_name = "N")]
    pub operations: Option<u64>,
    /// Stop starting operations after this many seconds (the fill counts)
    #[arg(long, value_name = "SECONDS")]
    pub duration_seconds: Option<f64>,
    /// After filling, each node replaces this many pods (DEL of a random one, then ADD) [default: 5 when no --operations or --duration-seconds]
    #[arg(long, value_name = "N")]
    pub churn_cycles: Option<u64>,
    /// Pace churn: cycles per node per second, Poisson from the seed [default: back to back]
    #[arg(long, value_name = "RATE")]
    pub churn_rate: Option<f64>,
    /// At the end, every node deletes the pods it holds
    #[arg(long)]
    pub drain: bool,
    /// The pool's CIDR
    #[arg(long, value_name = "CIDR", default_value = "10.64.0.0/10")]
    pub pool: ipnet::IpNet,
    /// Block prefix length [default: 26 for IPv4]
    #[arg(long, value_name = "PREFIX_LEN")]
    pub block_size: Option<u8>,
    /// Set strict affinity (never borrow from other hosts' blocks)
    #[arg(long)]
    pub strict_affinity: bool,
    /// Set max_blocks_per_host (0 = unlimited) [default: leave the store's setting]
    #[arg(long, value_name = "N")]
    pub max_blocks_per_host: Option<u32>,
    /// The schedule's seed
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
    /// Operations in flight at once, each from another node
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub concurrency: u32,
    /// CNI network name (handles are <network>.<container id>)
    #[arg(long, value_name = "NAME", default_value = "load")]
    pub network: String,
    /// The blockipam plugin binary (plugin mode) [default: blockipam next to this executable]
    #[arg(long, env = "BLOCKIPAM_PLUGIN", value_name = "PATH")]
    pub plugin: Option<PathBuf>,
    /// etcd: sample the database size this often during the run
    #[arg(long, value_name = "SECONDS")]
    pub etcd_status_interval_seconds: Option<f64>,
    /// etcd: after the run, compact all history and report the size again (benchmark etcd only)
    #[arg(long)]
    pub compact_at_end: bool,
    /// Pod streams per node, each its own schedule, sharing the node's name and lock file (several of one node's operations in flight at once)
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub lanes_per_node: u32,
    /// Before the measured run, put this many allocations held by --prefill-node in the store the plugin's way, one pod's address per handle with the plugin's attributes (not measured, never counted as leaked; checked present at the end)
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub prefill: u64,
    /// The node holding the prefilled allocations [default: the first node]
    #[arg(long, value_name = "NAME")]
    pub prefill_node: Option<String>,
    /// etcd: after the run, this many seconds of a raw etcd-client loop of one-key conditional Txn writes (--concurrency workers, own connections); reports raw_ceiling, allocation_to_raw_ratio and etcd_cpu (what etcd's members spent per operation and per raw write, from their /metrics)
    #[arg(long, value_name = "SECONDS")]
    pub raw_etcd_ceiling_seconds: Option<f64>,
    /// etcd: each raw Txn also puts this many more new keys of the same size (to measure what a put costs)
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub raw_etcd_extra_puts: u32,
    /// etcd: each raw Txn also tests this many more keys (each worker's own, present: version > 0)
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub raw_etcd_extra_conditions: u32,
    /// etcd: bytes of each value the raw loop puts (to tell what a value's size costs from what a key costs)
    #[arg(long, value_name = "BYTES", default_value_t = crate::config::RAW_VALUE_BYTES)]
    pub raw_etcd_value_bytes: usize,
    /// Api mode: each node reads through a cache of its own, as its node agent serves the plugin (a steady ADD or DEL is then one transaction)
    #[arg(long)]
    pub agent_cache: bool,
    /// What to run: churn (the load run), borrow (new nodes ADD in a nearly full pool) or node-release (blockipamctl node release --addresses of one node)
    #[arg(long, value_enum, default_value = "churn", help_heading = "Scenarios")]
    pub scenario: ScenarioArg,
    /// borrow: percentage of the pool's blocks claimed by filler nodes (one address each)
    #[arg(
        long,
        value_name = "PERCENT",
        default_value_t = 95,
        help_heading = "Scenarios"
    )]
    pub claimed_percent: u32,
    /// node-release: addresses the node holds (one pod handle each); the node is --prefill-node
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1000,
        help_heading = "Scenarios"
    )]
    pub addresses: u64,
    /// node-release: the blockipamctl binary [default: blockipamctl next to this executable]
    #[arg(long, value_name = "PATH", help_heading = "Scenarios")]
    pub blockipamctl: Option<PathBuf>,
    /// Print the report as JSON on stdout
    #[arg(long)]
    pub json: bool,
}

fn non_empty<T: Clone>(value: &Option<T>, text: impl Fn(&T) -> bool) -> Option<T> {
    value.as_ref().filter(|v| text(v)).cloned()
}

fn path(value: &Option<PathBuf>) -> Option<PathBuf> {
    non_empty(value, |p: &PathBuf| !p.as_os_str().is_empty())
}

fn string(value: &Option<String>) -> Option<String> {
    non_empty(value, |s: &String| !s.is_empty())
}

fn seconds(text: &str, flag: &str, allow_zero: bool) -> Result<Duration, LoadError> {
    parse_seconds(text, allow_zero).map_err(|e| match e {
        SecondsError::NotANumber => LoadError::usage(format!(
            "invalid value {text:?} for {flag}: expected a number of seconds"
        )),
        SecondsError::OutOfRange => LoadError::usage(format!(
            "invalid value {text:?} for {flag}: expected seconds {} up to one day",
            if allow_zero { "from 0" } else { "above 0" }
        )),
    })
}

impl Cli {
    /// The store the flags and environment select.
    ///
    /// # Errors
    /// [`LoadError::Usage`] for a bad value or an incomplete etcd selection.
    pub fn settings(&self) -> Result<DatastoreSettings, LoadError> {
        let datastore_type = blockipam_store::given_datastore_type(self.datastore_type.as_deref())
            .map_err(|e| LoadError::usage(format!("invalid value for --datastore-type: {e}")))?;
        let lock_wait = string(&self.lock_wait_seconds)
            .map(|text| seconds(&text, "--lock-wait-seconds", true))
            .transpose()?;
        let etcd_request_timeout = string(&self.etcd_timeout_seconds)
            .map(|text| seconds(&text, "--etcd-timeout-seconds", false))
            .transpose()?;
        let mut settings = DatastoreSettings::from_raw(self.etcd.apply(RawDatastoreSettings {
            datastore_type,
            path: self.datastore_path.clone(),
            etcd_prefix: self.etcd_prefix.clone(),
            etcd_username: self.etcd_username.clone(),
            etcd_password: self.etcd_password.clone(),
            etcd_request_timeout,
            ..RawDatastoreSettings::default()
        }))
        .map_err(|e| LoadError::usage(ipam_core::KvError::from(e).to_string()))?;
        if let Some(lock_wait) = lock_wait {
            settings.lock_wait = lock_wait;
        }
        Ok(settings)
    }

    /// The run's parameters.
    ///
    /// # Errors
    /// [`LoadError::Usage`] for a bad value.
    pub fn load_config(&self) -> Result<LoadConfig, LoadError> {
        let stop = match (self.operations, self.duration_seconds, self.churn_cycles) {
            (Some(n), _, _) => StopRule::Operations(n),
            (_, Some(s), _) => {
                StopRule::Duration(seconds(&s.to_string(), "--duration-seconds", false)?)
            }
            (_, _, Some(c)) => StopRule::ChurnCycles(c),
            (None, None, None) => StopRule::ChurnCycles(5),
        };
        let mode = match self.mode {
            ModeArg::Api => Mode::Api,
            ModeArg::Plugin => Mode::Plugin,
        };
        let plugin = match (mode, path(&self.plugin)) {
            (Mode::Plugin, None) => Some(default_plugin()?),
            (_, plugin) => plugin,
        };
        let config = LoadConfig {
            mode,
            nodes: self.nodes,
            pods_per_node: self.pods_per_node,
            stop,
            churn_rate: self.churn_rate,
            drain: self.drain,
            pool: self.pool,
            block_size: self.block_size,
            strict_affinity: self.strict_affinity,
            max_blocks_per_host: self.max_blocks_per_host,
            seed: self.seed,
            concurrency: self.concurrency,
            network: self.network.clone(),
            plugin,
            etcd_status_interval: self
                .etcd_status_interval_seconds
                .map(|s| seconds(&s.to_string(), "--etcd-status-interval-seconds", false))
                .transpose()?,
            compact_at_end: self.compact_at_end,
            lanes_per_node: self.lanes_per_node,
            prefill: self.prefill,
            prefill_node: string(&self.prefill_node),
            raw_etcd_ceiling: self
                .raw_etcd_ceiling_seconds
                .map(|s| seconds(&s.to_string(), "--raw-etcd-ceiling-seconds", false))
                .transpose()?,
            raw_etcd_shape: RawShape {
                extra_puts: self.raw_etcd_extra_puts,
                extra_conditions: self.raw_etcd_extra_conditions,
                value_bytes: self.raw_etcd_value_bytes,
            },
            agent_cache: self.agent_cache,
        };
        config.validate()?;
        Ok(config)
    }
}

/// `blockipam` next to this executable.
fn default_plugin() -> Result<PathBuf, LoadError> {
    let exe = std::env::current_exe().map_err(|e| {
        LoadError::usage(format!(
            "cannot tell where blockipam-load runs from ({e}); pass --plugin PATH"
        ))
    })?;
    Ok(exe
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
        .join("blockipam"))
}

/// The whole program: parses `args`, runs, prints the report (text, or JSON with `--json`) on
/// `stdout`, messages and the progress line (only when `stderr_is_terminal`) on `stderr`, and
/// returns the exit status.
pub fn run_cli<I, T>(
    args: I,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
    stderr_is_terminal: bool,
) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            if e.use_stderr() {
                let _ = write!(stderr, "{e}");
                return EXIT_USAGE;
            }
            let _ = write!(stdout, "{e}");
            return EXIT_PASSED;
        }
    };
    let prepared = cli.settings().and_then(|s| Ok((s, cli.load_config()?)));
    let (settings, config) = match prepared {
        Ok(prepared) => prepared,
        Err(e) => return fail(stderr, &e),
    };
    if cli.scenario != ScenarioArg::Churn {
        return run_scenario_cli(&cli, settings, &config, stdout, stderr);
    }
    if stderr_is_terminal && u64::from(config.concurrency) > config.streams() {
        let _ = writeln!(
            stderr,
            "blockipam-load: note: --concurrency {} but {} nodes x {} lanes: at most {} operations in flight (one per pod stream); --lanes-per-node N runs N streams per node",
            config.concurrency,
            config.nodes,
            config.lanes_per_node,
            config.streams()
        );
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            return fail(
                stderr,
                &LoadError::failed(format!("cannot start tokio: {e}")),
            )
        }
    };
    let result = runtime.block_on(async {
        let mut draw = |progress: &crate::run::Progress| {
            if stderr_is_terminal {
                crate::progress::draw(&mut *stderr, progress);
            }
        };
        run(&config, StoreTarget::from(settings), &mut draw).await
    });
    match result {
        Ok(report) => {
            let printed = if cli.json {
                serde_json::to_string_pretty(&report)
                    .map_err(|e| e.to_string())
                    .and_then(|json| writeln!(stdout, "{json}").map_err(|e| e.to_string()))
            } else {
                write!(stdout, "{}", report.to_text()).map_err(|e| e.to_string())
            };
            if let Err(e) = printed {
                return fail(
                    stderr,
                    &LoadError::failed(format!("cannot print the report: {e}")),
                );
            }
            if report.passed {
                EXIT_PASSED
            } else {
                let _ = writeln!(
                    stderr,
                    "blockipam-load: FAILED: {} errors, {} duplicates, {} missing, {} leaked, check {}",
                    report.errors,
                    report.duplicates(),
                    report.verification.missing,
                    report.verification.leaked,
                    if report.check.clean { "clean" } else { "found problems" }
                );
                EXIT_FAILED
            }
        }
        Err(e) => fail(stderr, &e),
    }
}

/// Runs a scenario other than churn and prints its report.
fn run_scenario_cli(
    cli: &Cli,
    settings: DatastoreSettings,
    config: &LoadConfig,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> i32 {
    let scenario = ScenarioConfig {
        scenario: match cli.scenario {
            ScenarioArg::Churn => Scenario::Churn,
            ScenarioArg::Borrow => Scenario::Borrow,
            ScenarioArg::NodeRelease => Scenario::NodeRelease,
        },
        claimed_percent: cli.claimed_percent,
        addresses: cli.addresses,
        blockipamctl: path(&cli.blockipamctl).or_else(default_blockipamctl),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            return fail(
                stderr,
                &LoadError::failed(format!("cannot start tokio: {e}")),
            )
        }
    };
    let result = runtime.block_on(run_scenario(config, &scenario, StoreTarget::from(settings)));
    match result {
        Ok(report) => {
            let printed = if cli.json {
                serde_json::to_string_pretty(&report)
                    .map_err(|e| e.to_string())
                    .and_then(|json| writeln!(stdout, "{json}").map_err(|e| e.to_string()))
            } else {
                write!(stdout, "{}", report.to_text()).map_err(|e| e.to_string())
            };
            if let Err(e) = printed {
                return fail(
                    stderr,
                    &LoadError::failed(format!("cannot print the report: {e}")),
                );
            }
            if report.passed() {
                EXIT_PASSED
            } else {
                let _ = writeln!(stderr, "blockipam-load: scenario FAILED (see the report)");
                EXIT_FAILED
            }
        }
        Err(e) => fail(stderr, &e),
    }
}

fn fail(stderr: &mut dyn Write, error: &LoadError) -> i32 {
    let _ = writeln!(stderr, "blockipam-load: error: {error}");
    match error {
        LoadError::Usage(_) => EXIT_USAGE,
        _ => EXIT_FAILED,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockipam_store::DatastoreType;

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("blockipam-load").chain(args.iter().copied()))
            .expect("flags parse")
    }

    /// `--etcd-prefix ""` is the default prefix's identity, as everywhere else (the run then gives
    /// itself a prefix of its own, as when the flag is absent).
    #[test]
    fn an_empty_etcd_prefix_is_the_default_prefix() {
        let etcd = [
            "--datastore-type",
            "etcdv3",
            "--etcd-endpoints",
            "127.0.0.1:2379",
        ];
        let default = parse(&etcd).settings().expect("settings");
        let empty = parse(&[&etcd[..], &["--etcd-prefix", ""]].concat())
            .settings()
            .expect("settings");
        assert_eq!(empty.etcd().expect("etcd").prefix, None);
        assert_eq!(empty.identity(), default.identity());
    }

    #[test]
    fn flags_become_settings_and_a_config() {
        let cli = parse(&[
            "--datastore-type",
            "etcdv3",
            "--etcd-endpoints",
            "127.0.0.1:1, 127.0.0.1:2",
            "--nodes",
            "50",
            "--operations",
            "300",
            "--block-size",
            "28",
            "--strict-affinity",
            "--seed",
            "7",
        ]);
        let settings = cli.settings().expect("settings");
        assert_eq!(settings.datastore_type(), DatastoreType::Etcdv3);
        assert_eq!(settings.etcd().expect("etcd").endpoints.len(), 2);
        let config = cli.load_config().expect("config");
        assert_eq!(config.stop, StopRule::Operations(300));
        assert_eq!(
            (config.nodes, config.block_size, config.seed),
            (50, Some(28), 7)
        );
        assert!(config.strict_affinity);
    }

    #[test]
    fn measurement_flags_become_the_config_and_a_zero_ceiling_is_a_usage_error() {
        let cli = parse(&[
            "--scenario",
            "node-release",
            "--lanes-per-node",
            "4",
            "--prefill",
            "100",
            "--prefill-node",
            "node-x",
            "--raw-etcd-ceiling-seconds",
            "2.5",
        ]);
        assert_eq!(cli.scenario, ScenarioArg::NodeRelease);
        let config = cli.load_config().expect("config");
        assert_eq!(config.lanes_per_node, 4);
        assert_eq!(config.streams(), 40);
        assert_eq!(
            (config.prefill, config.prefill_host()),
            (100, "node-x".into())
        );
        assert_eq!(config.raw_etcd_ceiling, Some(Duration::from_millis(2500)));
        let cli = parse(&["--raw-etcd-ceiling-seconds", "0"]);
        assert!(matches!(cli.load_config(), Err(LoadError::Usage(_))));
        let shaped = parse(&[
            "--raw-etcd-ceiling-seconds",
            "1",
            "--raw-etcd-extra-puts",
            "3",
            "--raw-etcd-extra-conditions",
            "9",
            "--raw-etcd-value-bytes",
            "800",
        ])
        .load_config()
        .expect("a shaped raw loop");
        assert_eq!(
            shaped.raw_etcd_shape,
            RawShape {
                extra_puts: 3,
                extra_conditions: 9,
                value_bytes: 800,
            }
        );
        let plain = parse(&["--raw-etcd-ceiling-seconds", "1"])
            .load_config()
            .expect("the plain raw loop");
        assert_eq!(plain.raw_etcd_shape.value_bytes, 200);
        let largest = parse(&[
            "--raw-etcd-ceiling-seconds",
            "1",
            "--raw-etcd-extra-puts",
            "3",
            "--raw-etcd-value-bytes",
            "250000",
        ]);
        assert!(
            largest.load_config().is_ok(),
            "4 × 250,000 bytes is the limit"
        );
        for refused in [
            &["--raw-etcd-extra-puts", "1"][..],
            &[
                "--raw-etcd-ceiling-seconds",
                "1",
                "--raw-etcd-extra-puts",
                "101",
            ],
            &[
                "--raw-etcd-ceiling-seconds",
                "1",
                "--raw-etcd-extra-conditions",
                "101",
            ],
            &["--raw-etcd-value-bytes", "800"],
            &[
                "--raw-etcd-ceiling-seconds",
                "1",
                "--raw-etcd-value-bytes",
                "0",
            ],
            &[
                "--raw-etcd-ceiling-seconds",
                "1",
                "--raw-etcd-extra-puts",
                "3",
                "--raw-etcd-value-bytes",
                "250001",
            ],
        ] {
            assert!(
                matches!(parse(refused).load_config(), Err(LoadError::Usage(_))),
                "{refused:?}"
            );
        }
    }

    #[test]
    fn stop_rules_exclude_each_other_and_bad_values_are_usage_errors() {
        let both = Cli::try_parse_from(["x", "--operations", "5", "--duration-seconds", "1"]);
        assert!(both.is_err(), "two stop rules were accepted");
        let cli = parse(&["--duration-seconds", "0"]);
        assert!(matches!(cli.load_config(), Err(LoadError::Usage(_))));
        let cli = parse(&["--datastore-type", "etcdv3"]);
        assert!(
            matches!(cli.settings(), Err(LoadError::Usage(_))),
            "etcd without endpoints"
        );
        let mut out = Vec::new();
        let mut err = Vec::new();
        let code = run_cli(["x", "--nodes", "0"], &mut out, &mut err, false);
        assert_eq!(code, EXIT_USAGE, "{}", String::from_utf8_lossy(&err));
        // A negative number is refused as that flag's value, not as an unknown argument.
        let negative = Cli::try_parse_from(["x", "--nodes", "-1"])
            .expect_err("a negative node count must be refused");
        assert_eq!(negative.exit_code(), 2);
        assert!(
            negative.to_string().contains("'-1' for '--nodes"),
            "{negative}"
        );
    }
}
