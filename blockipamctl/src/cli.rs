//! The command line: clap types for every command, flag and the environment variables they fall back to.

use std::net::IpAddr;
use std::path::PathBuf;

use blockipam_store::Secret;
use clap::builder::BoolishValueParser;
use clap::{ArgGroup, Args, Parser, Subcommand, ValueEnum};
use ipam_core::model::MAX_IP_COOLDOWN_SECONDS;

/// Environment variable: which store (`sled`, `redb`, `etcdv3`).
pub const ENV_DATASTORE_TYPE: &str = "DATASTORE_TYPE";
/// Environment variable: embedded store path.
pub const ENV_DATASTORE_PATH: &str = "DATASTORE_PATH";
/// Environment variable: etcd endpoints, comma-separated.
pub const ENV_ETCD_ENDPOINTS: &str = "ETCD_ENDPOINTS";
/// Environment variable: etcd CA certificate file.
pub const ENV_ETCD_CA_CERT_FILE: &str = "ETCD_CA_CERT_FILE";
/// Environment variable: etcd client certificate file.
pub const ENV_ETCD_CERT_FILE: &str = "ETCD_CERT_FILE";
/// Environment variable: etcd client key file.
pub const ENV_ETCD_KEY_FILE: &str = "ETCD_KEY_FILE";
/// Environment variable: etcd key prefix.
pub const ENV_ETCD_PREFIX: &str = "ETCD_PREFIX";
/// Environment variable: etcd user name (calicoctl's name).
pub const ENV_ETCD_USERNAME: &str = "ETCD_USERNAME";
/// Environment variable: etcd password (calicoctl's name).
pub const ENV_ETCD_PASSWORD: &str = "ETCD_PASSWORD";
/// Environment variable: how long to wait for an embedded store held by another process.
pub const ENV_LOCK_WAIT_SECONDS: &str = "BLOCKIPAM_LOCK_WAIT_SECONDS";
/// Environment variable: upper bound on one etcd request.
pub const ENV_ETCD_TIMEOUT_SECONDS: &str = "BLOCKIPAM_ETCD_TIMEOUT_SECONDS";
/// Environment variable: the node agent's socket (`none`: open the store directly).
pub const ENV_AGENT_SOCKET: &str = "BLOCKIPAM_AGENT_SOCKET";
/// Environment variable: output format (`table` or `json`).
pub const ENV_OUTPUT: &str = "BLOCKIPAMCTL_OUTPUT";
/// Environment variable: the `blockipam` plugin binary the demo runs and `install-cni` copies.
pub const ENV_PLUGIN: &str = "BLOCKIPAM_PLUGIN";
/// Environment variable: the host's CNI binary directory, as `install-cni` sees it.
pub const ENV_CNI_BIN_DIR: &str = "CNI_BIN_DIR";
/// Environment variable: the host's CNI network config directory, as `install-cni` sees it
/// (Calico's name).
pub const ENV_CNI_NET_DIR: &str = "CNI_NET_DIR";
/// Environment variable: the file name of the conflist `install-cni` writes (Calico's name).
pub const ENV_CNI_CONF_NAME: &str = "CNI_CONF_NAME";
/// Environment variable: a whole conflist template, as text (Calico's name).
pub const ENV_CNI_NETWORK_CONFIG: &str = "CNI_NETWORK_CONFIG";
/// Environment variable: a file holding a conflist template (Calico's name).
pub const ENV_CNI_NETWORK_CONFIG_FILE: &str = "CNI_NETWORK_CONFIG_FILE";
/// Environment variable: the network name of the generated conflist.
pub const ENV_NETWORK_NAME: &str = "BLOCKIPAM_NETWORK_NAME";
/// Environment variable: the main plugin type of the generated conflist.
pub const ENV_MAIN_PLUGIN: &str = "BLOCKIPAM_MAIN_PLUGIN";
/// Environment variable: the `cniVersion` of the generated conflist.
pub const ENV_CNI_VERSION: &str = "BLOCKIPAM_CNI_VERSION";
/// Environment variable: extra keys (a JSON object) for the conflist's `ipam` section.
pub const ENV_IPAM_CONFIG: &str = "BLOCKIPAM_IPAM_CONFIG";
/// Environment variables naming the node, in the order they are read (Calico's names).
pub const ENV_NODE_NAMES: [&str; 2] = ["NODENAME", "KUBERNETES_NODE_NAME"];

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum OutputFormat {
    /// Aligned columns for people.
    #[default]
    Table,
    /// One JSON document for scripts.
    Json,
}

impl OutputFormat {
    /// Parses `table` or `json`.
    pub fn parse(text: &str) -> Option<OutputFormat> {
        match text {
            "table" => Some(OutputFormat::Table),
            "json" => Some(OutputFormat::Json),
            _ => None,
        }
    }
}

/// blockipamctl: operate a blockipam IPAM store (pools, config, usage, consistency, node removal,
/// migration between stores).
#[derive(Debug, Parser)]
#[command(
    name = "blockipamctl",
    version,
    about = "Operate a blockipam IPAM store: pools, config, usage, check/repair, node removal, migration",
    long_about = None,
    propagate_version = true,
    args_override_self = true,
    after_help = "Exit status: 0 success, 1 failure or problems found, 2 usage error.\n\
                  Every flag of the store selection falls back to the environment variable named in its help."
)]
pub struct Cli {
    /// Store selection and output format (accepted before or after the command).
    #[command(flatten)]
    pub global: GlobalArgs,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Flags shared by every command.
#[derive(Debug, Clone, Default, Args)]
pub struct GlobalArgs {
    /// Store type: sled, redb or etcdv3 [env: DATASTORE_TYPE] [default: etcdv3 when etcd endpoints are given, else sled]
    #[arg(long, global = true, value_name = "TYPE", help_heading = "Store")]
    pub datastore_type: Option<String>,
    /// Embedded store path [env: DATASTORE_PATH] [default: /var/lib/blockipam/store.sled (sled), /var/lib/blockipam/store.redb (redb)]
    #[arg(long, global = true, value_name = "PATH", help_heading = "Store")]
    pub datastore_path: Option<PathBuf>,
    /// etcd endpoints, comma-separated (host:port, http://host:port or https://host:port) [env: ETCD_ENDPOINTS]
    #[arg(long, global = true, value_name = "LIST", help_heading = "Store")]
    pub etcd_endpoints: Option<String>,
    /// etcd CA certificate (PEM) [env: ETCD_CA_CERT_FILE]
    #[arg(long, global = true, value_name = "FILE", help_heading = "Store")]
    pub etcd_ca_cert_file: Option<PathBuf>,
    /// etcd client certificate (PEM) [env: ETCD_CERT_FILE]
    #[arg(long, global = true, value_name = "FILE", help_heading = "Store")]
    pub etcd_cert_file: Option<PathBuf>,
    /// etcd client key (PEM) [env: ETCD_KEY_FILE]
    #[arg(long, global = true, value_name = "FILE", help_heading = "Store")]
    pub etcd_key_file: Option<PathBuf>,
    /// etcd key prefix, ending with '/' [env: ETCD_PREFIX] [default: /blockipam/]
    #[arg(long, global = true, value_name = "PREFIX", help_heading = "Store")]
    pub etcd_prefix: Option<String>,
    /// etcd user name, for clusters with authentication on (with a password) [env: ETCD_USERNAME]
    #[arg(long, global = true, value_name = "NAME", help_heading = "Store")]
    pub etcd_username: Option<String>,
    /// etcd password; prefer the environment variable, which other users cannot read in the process list [env: ETCD_PASSWORD]
    #[arg(long, global = true, value_name = "PASSWORD", help_heading = "Store")]
    pub etcd_password: Option<Secret>,
    /// Seconds to wait for an embedded store another process holds [env: BLOCKIPAM_LOCK_WAIT_SECONDS] [default: 10]
    #[arg(long, global = true, value_name = "SECONDS", help_heading = "Store")]
    pub lock_wait_seconds: Option<String>,
    /// Upper bound in seconds on one etcd request, connecting included [env: BLOCKIPAM_ETCD_TIMEOUT_SECONDS] [default: 10]
    #[arg(long, global = true, value_name = "SECONDS", help_heading = "Store")]
    pub etcd_timeout_seconds: Option<String>,
    /// The node agent's socket, used when its agent serves the selected store; "" or none: open the store directly [env: BLOCKIPAM_AGENT_SOCKET] [default: /run/blockipam/agent.sock]
    #[arg(long, global = true, value_name = "PATH", help_heading = "Store")]
    pub agent_socket: Option<String>,
    /// Output format [env: BLOCKIPAMCTL_OUTPUT] [default: table]
    #[arg(short = 'o', long, global = true, value_enum, value_name = "FORMAT")]
    pub output: Option<OutputFormat>,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create, list, enable, disable and delete IP pools.
    #[command(subcommand)]
    Pool(PoolCommand),
    /// Show or change the IPAM configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Show pool usage; optionally blocks, borrowed addresses, or one address.
    Show(ShowArgs),
    /// Release addresses by IP (optionally only while they carry a sequence number), by handle, or
    /// the leaked ones a check report lists.
    Release(ReleaseArgs),
    /// Check the store for inconsistencies (exit 1 when any); optionally repair the safe ones.
    /// With -o json, the output is a report `release --from-report` reads.
    Check(CheckArgs),
    /// List nodes, label them (for pools' node selectors), or retire a node that was removed from
    /// the cluster.
    #[command(subcommand)]
    Node(NodeCommand),
    /// A node's tunnel address (IPIP, VXLAN, WireGuard), from a pool that allows tunnel use, with
    /// Calico's handle and type.
    #[command(subcommand)]
    TunnelAddress(TunnelAddressCommand),
    /// A namespace's pools: what Calico reads from a namespace's ipv4pools/ipv6pools annotations.
    #[command(subcommand)]
    Namespace(NamespaceCommand),
    /// IP reservations: addresses auto-assign never hands out (Calico's IPReservation).
    #[command(subcommand)]
    Reservation(ReservationCommand),
    /// Blocks: release the empty ones hosts no longer need.
    #[command(subcommand)]
    Blocks(BlocksCommand),
    /// Release the blocks (never the addresses) of dead nodes: registered by an agent, with no
    /// liveness key and no plugin commit for a whole grace countdown timed by etcd; or release the
    /// leaks the agents report. Shows what it would do unless --apply.
    Gc(GcArgs),
    /// Copy everything into another, empty store and verify the copy.
    Migrate(MigrateArgs),
    /// Import another IPAM's datastore (Calico on etcd) into the selected, empty store.
    #[command(subcommand)]
    Import(ImportCommand),
    /// Run the real blockipam plugin through the CNI protocol against a local sled store.
    Demo(DemoArgs),
    /// Install the plugin and a network config (conflist) into a node's CNI directories, as the
    /// container image's init container does: each file replaced atomically, and only when it
    /// changed.
    InstallCni(InstallCniArgs),
    /// Rolling upgrades: the stored format every writer writes, what each node reads, and the
    /// finalize that lets writers use this release's format.
    #[command(subcommand)]
    Upgrade(UpgradeCommand),
}

/// `upgrade` subcommands.
#[derive(Debug, Subcommand)]
pub enum UpgradeCommand {
    /// Show the format the store records, the one writers write, what this build reads, and what
    /// each node's agent and plugin read (exit 1 while a node may read only an older format).
    Status,
    /// Record this release's format as the one every writer writes, in one compare-and-swap;
    /// refused while a node may read only an older format, unless --force. Binaries of the
    /// previous release refuse the store afterwards.
    Finalize(UpgradeFinalizeArgs),
}

/// `upgrade finalize`.
#[derive(Debug, Args)]
pub struct UpgradeFinalizeArgs {
    /// Finalize although nodes may read only an older format: their binaries will refuse the
    /// store until they are upgraded
    #[arg(long)]
    pub force: bool,
}

/// `pool` subcommands.
#[derive(Debug, Subcommand)]
pub enum PoolCommand {
    /// Create a pool.
    Add(PoolAddArgs),
    /// List pools.
    List,
    /// Enable a pool (addresses are handed out from it again).
    Enable(PoolRef),
    /// Disable a pool (no new addresses from it; existing ones stay).
    Disable(PoolRef),
    /// Delete a pool; refused while any address in it is allocated, unless --force.
    Delete(PoolDeleteArgs),
    /// Change a pool's node selector, assignment mode, allowed uses, disabled flag or block size
    /// (one compare-and-swap; the CIDR never changes; a new block size applies to new blocks,
    /// existing ones keep theirs and drain).
    Set(PoolSetArgs),
    /// Replace a pool by N sub-pools (N a power of two) named split-<name>-0 .. split-<name>-(N-1),
    /// each with the pool's settings; blocks and allocations stay, in the sub-pool containing
    /// them; namespace pools settings naming the pool are rewritten to name the sub-pools.
    Split(PoolSplitArgs),
}

/// `pool split`.
#[derive(Debug, Args)]
pub struct PoolSplitArgs {
    /// The pool's name or CIDR.
    #[arg(value_name = "NAME|CIDR")]
    pub pool: String,
    /// How many sub-pools: a power of two, 2 to 32, each at least one block large.
    #[arg(value_name = "N")]
    pub parts: u32,
}

/// `pool set`.
#[derive(Debug, Args)]
#[command(group(
    ArgGroup::new("change")
        .required(true)
        .multiple(true)
        .args(["node_selector", "assignment_mode", "allowed_uses", "disabled", "block_size"])
))]
pub struct PoolSetArgs {
    /// The pool's name or CIDR.
    #[arg(value_name = "NAME|CIDR")]
    pub pool: String,
    /// Nodes that auto-assign from the pool, in Calico's selector syntax (e.g.
    /// 'rack == "r1" && has(zone)'; all() selects every node).
    #[arg(long, value_name = "SELECTOR")]
    pub node_selector: Option<String>,
    /// automatic (auto-assign may pick it) or manual (only when named, or for explicit addresses).
    #[arg(long, value_name = "MODE")]
    pub assignment_mode: Option<String>,
    /// Comma-separated: workload, tunnel, loadbalancer (loadbalancer only alone).
    #[arg(long, value_name = "USES")]
    pub allowed_uses: Option<String>,
    /// Disable (true) or enable (false) the pool.
    #[arg(long, value_name = "BOOL", value_parser = BoolishValueParser::new(), hide_possible_values = true)]
    pub disabled: Option<bool>,
    /// Block prefix length for blocks claimed from now on (IPv4 23..=32, IPv6 119..=128);
    /// existing blocks keep their size until they are released.
    #[arg(long, value_name = "PREFIX_LEN")]
    pub block_size: Option<u8>,
}

/// `pool add`.
#[derive(Debug, Args)]
pub struct PoolAddArgs {
    /// The pool's network, e.g. 10.0.0.0/16 or fd00:1::/64 (no host bits; not overlapping
    /// 169.254.0.0/16 or fe80::/10).
    #[arg(value_name = "CIDR")]
    pub cidr: ipnet::IpNet,
    /// Pool name [default: the CIDR with '/' replaced by '-', e.g. 10.0.0.0-16]
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// Block prefix length: IPv4 23..=32 (default 26), IPv6 119..=128 (default 122).
    #[arg(long, value_name = "PREFIX_LEN")]
    pub block_size: Option<u8>,
    /// Create the pool disabled.
    #[arg(long)]
    pub disabled: bool,
    /// Nodes that auto-assign from the pool, in Calico's selector syntax [default: all()].
    #[arg(long, value_name = "SELECTOR")]
    pub node_selector: Option<String>,
    /// automatic or manual [default: automatic].
    #[arg(long, value_name = "MODE")]
    pub assignment_mode: Option<String>,
    /// Comma-separated: workload, tunnel, loadbalancer [default: workload,tunnel].
    #[arg(long, value_name = "USES")]
    pub allowed_uses: Option<String>,
}

/// A pool named by name or CIDR.
#[derive(Debug, Args)]
pub struct PoolRef {
    /// The pool's name or CIDR.
    #[arg(value_name = "NAME|CIDR")]
    pub pool: String,
}

/// `pool delete`.
#[derive(Debug, Args)]
pub struct PoolDeleteArgs {
    /// The pool's name or CIDR.
    #[arg(value_name = "NAME|CIDR")]
    pub pool: String,
    /// Release every address still allocated in the pool, then delete it.
    #[arg(long)]
    pub force: bool,
}

/// `config` subcommands.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Print the IPAM configuration.
    Show,
    /// Change the given settings; the others keep their value.
    Set(ConfigSetArgs),
}

/// `config set`.
#[derive(Debug, Args)]
#[command(group(
    ArgGroup::new("setting")
        .required(true)
        .multiple(true)
        .args(["strict_affinity", "auto_allocate_blocks", "max_blocks_per_host", "ip_cooldown_seconds", "empty_block_reclaim_seconds"])
))]
pub struct ConfigSetArgs {
    /// Never borrow addresses from blocks affine to other hosts (true/false, yes/no, on/off, 1/0).
    #[arg(long, value_name = "BOOL", value_parser = BoolishValueParser::new(), hide_possible_values = true)]
    pub strict_affinity: Option<bool>,
    /// Let hosts claim new blocks as they need them (true/false, yes/no, on/off, 1/0).
    #[arg(long, value_name = "BOOL", value_parser = BoolishValueParser::new(), hide_possible_values = true)]
    pub auto_allocate_blocks: Option<bool>,
    /// Most blocks of one family a host may own; 0 means unlimited.
    #[arg(long, value_name = "N")]
    pub max_blocks_per_host: Option<u32>,
    /// Seconds a released address waits before it is handed out again (0 to 1200; Calico's
    /// ipCooldownSeconds).
    #[arg(
        long,
        value_name = "SECONDS",
        value_parser = clap::value_parser!(u32).range(0..=i64::from(MAX_IP_COOLDOWN_SECONDS))
    )]
    pub ip_cooldown_seconds: Option<u32>,
    /// Seconds a block must have been empty before another host may take it over when its pools
    /// have no unclaimed block left (default 60).
    #[arg(long, value_name = "SECONDS")]
    pub empty_block_reclaim_seconds: Option<u32>,
}

/// `show`.
#[derive(Debug, Args)]
pub struct ShowArgs {
    /// Also list every block with its host and usage.
    #[arg(long, conflicts_with = "ip")]
    pub blocks: bool,
    /// Also list addresses whose node differs from their block's host.
    #[arg(long, conflicts_with = "ip")]
    pub borrowed: bool,
    /// Show who holds one address instead.
    #[arg(long, value_name = "IP")]
    pub ip: Option<IpAddr>,
}

/// `release`.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("what").required(true).args(["ip", "handle", "from_report"])))]
pub struct ReleaseArgs {
    /// Addresses to release (repeat the flag or list several after it).
    #[arg(long, value_name = "IP", num_args = 1.., conflicts_with_all = ["handle", "from_report"])]
    pub ip: Vec<IpAddr>,
    /// Release every address of this handle (what a CNI DEL does).
    #[arg(long, value_name = "ID", conflicts_with = "from_report")]
    pub handle: Option<String>,
    /// With one --ip: release it only while it carries this sequence number (as `show --ip`
    /// prints it); an address allocated again since is refused, and nothing changes
    #[arg(long, value_name = "N", requires = "ip")]
    pub sequence: Option<u64>,
    /// Release the leaked addresses (kind missing-handle) a `check -o json` report of this store
    /// lists, each only while it carries the sequence number the report recorded
    #[arg(long, value_name = "FILE")]
    pub from_report: Option<PathBuf>,
    /// With --from-report: release them; without it nothing is written
    #[arg(long, requires = "from_report")]
    pub apply: bool,
}

/// `check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Fix what is safe to fix (handle counts, missing and damaged handles, claim index entries,
    /// empty blocks without affinity, orphaned owner keys), then check again. Nothing is repaired
    /// while an `import calico` is unfinished: run it again first.
    #[arg(long)]
    pub repair: bool,
}

/// `namespace` subcommands.
#[derive(Debug, Subcommand)]
pub enum NamespaceCommand {
    /// Show a namespace's pools, or set them (--ipv4/--ipv6), or remove them (--clear).
    Pools(NamespacePoolsArgs),
}

/// `namespace pools`.
#[derive(Debug, Args)]
pub struct NamespacePoolsArgs {
    /// The namespace (matched on the pod's K8S_POD_NAMESPACE).
    #[arg(value_name = "NAMESPACE")]
    pub namespace: String,
    /// An IPv4 pool (name or CIDR) for the namespace's pods; repeat for several.
    #[arg(long = "ipv4", value_name = "POOL")]
    pub ipv4: Vec<String>,
    /// An IPv6 pool (name or CIDR) for the namespace's pods; repeat for several.
    #[arg(long = "ipv6", value_name = "POOL")]
    pub ipv6: Vec<String>,
    /// Remove the namespace's pools.
    #[arg(long, conflicts_with_all = ["ipv4", "ipv6"])]
    pub clear: bool,
}

/// `reservation` subcommands.
#[derive(Debug, Subcommand)]
pub enum ReservationCommand {
    /// Reserve CIDRs or single addresses under a new name.
    Add(ReservationAddArgs),
    /// List every reservation.
    List,
    /// Delete a reservation (its addresses may be auto-assigned again).
    Delete(ReservationDeleteArgs),
}

/// `reservation add`.
#[derive(Debug, Args)]
pub struct ReservationAddArgs {
    /// The reservation's name (letters, digits, '.', '_', '-', ':').
    #[arg(value_name = "NAME")]
    pub name: String,
    /// CIDRs (no host bits) or single addresses to reserve.
    #[arg(value_name = "CIDR|IP", required = true, num_args = 1..)]
    pub cidrs: Vec<String>,
}

/// `reservation delete`.
#[derive(Debug, Args)]
pub struct ReservationDeleteArgs {
    /// The reservation's name.
    #[arg(value_name = "NAME")]
    pub name: String,
}

/// `tunnel-address` subcommands.
#[derive(Debug, Subcommand)]
pub enum TunnelAddressCommand {
    /// Give the node its tunnel address of this type (the same one again when it has it).
    Assign(TunnelAddressArgs),
    /// Release the node's tunnel address of this type (nothing to release is success).
    Release(TunnelAddressArgs),
}

/// `tunnel-address assign|release`.
#[derive(Debug, Args)]
pub struct TunnelAddressArgs {
    /// The node.
    #[arg(value_name = "NODE")]
    pub node: String,
    /// ipip, vxlan, vxlan-v6, wireguard or wireguard-v6.
    #[arg(long = "type", value_name = "TYPE")]
    pub tunnel_type: String,
}

/// `node` subcommands.
#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// Every node the store knows (agent registrations, labels, blocks, addresses) with its
    /// liveness as `gc` sees it, its labels, blocks and addresses.
    List,
    /// Remove everything a removed node leaves behind: its addresses, blocks, labels and agent
    /// registration. Shows what it would do unless --apply; refused while the node is alive or
    /// active, unless --force.
    Retire(NodeRetireArgs),
    /// Release a removed node's block affinities (empty blocks are deleted, others un-assigned).
    Release(NodeReleaseArgs),
    /// Set or remove a node's labels (what pools' node selectors match), in one atomic update.
    Label(NodeLabelArgs),
    /// Show a node's labels.
    Show(NodeShowArgs),
}

/// `node label`.
#[derive(Debug, Args)]
#[command(
    group(ArgGroup::new("change").required(true).multiple(true).args(["labels", "remove", "replace"])),
    override_usage = "blockipamctl node label <HOST> [KEY=VALUE]... [--remove <KEY>]...\n       blockipamctl node label <HOST> [KEY=VALUE]... --replace"
)]
pub struct NodeLabelArgs {
    /// The node (host) name, as the plugin records it.
    #[arg(value_name = "HOST")]
    pub host: String,
    /// Labels to set, each KEY=VALUE (Kubernetes label syntax; an existing value is replaced).
    #[arg(value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
    /// A label to remove (repeat the flag for several); a label the node lacks is no error.
    #[arg(long, value_name = "KEY", action = clap::ArgAction::Append)]
    pub remove: Vec<String>,
    /// Replace the node's labels whole with the KEY=VALUE given (none: remove them all), whatever
    /// it had, a labels object that cannot be decoded included.
    #[arg(long, conflicts_with = "remove")]
    pub replace: bool,
}

/// `node show`.
#[derive(Debug, Args)]
pub struct NodeShowArgs {
    /// The node (host) name.
    #[arg(value_name = "HOST")]
    pub host: String,
}

/// `node retire`.
#[derive(Debug, Args)]
pub struct NodeRetireArgs {
    /// The node (host) name, as the plugin recorded it.
    #[arg(value_name = "HOST")]
    pub host: String,
    /// Remove it; without it nothing is written
    #[arg(long)]
    pub apply: bool,
    /// Retire it although it is seen alive (its agent keeps its liveness key) or active (its
    /// plugin committed since it was marked missing): its pods' addresses are released
    #[arg(long)]
    pub force: bool,
}

/// `node release`.
#[derive(Debug, Args)]
pub struct NodeReleaseArgs {
    /// The node (host) name, as the plugin recorded it.
    #[arg(value_name = "HOST")]
    pub host: String,
    /// Also release every address whose node attribute is this host.
    #[arg(long)]
    pub addresses: bool,
}

/// `gc`.
#[derive(Debug, Args)]
pub struct GcArgs {
    /// Nodes an agent registered: show each with its state (alive, active, missing, dead) and
    /// what releasing it would free
    #[arg(long, conflicts_with_all = ["leaks", "report"])]
    pub dead_nodes: bool,
    /// This node's leaks, as its agent's last look at the container runtime found them: each
    /// allocation whose container the runtime no longer runs, since when, and whether its grace
    /// has passed; live pods' addresses the store disagrees with. With --apply, release the ones
    /// past their grace
    #[arg(long)]
    pub leaks: bool,
    /// The agent's report that --leaks reads [default: leaks.json beside the agent's socket]
    #[arg(long, value_name = "PATH", requires = "leaks")]
    pub report: Option<std::path::PathBuf>,
    /// Length of the grace countdowns --apply starts (an etcd lease): a node is dead once its
    /// countdown ran out with no liveness key and no plugin commit meanwhile (1 to 9000000000,
    /// etcd's longest lease)
    #[arg(long, value_name = "SECONDS", default_value_t = 900, value_parser = clap::value_parser!(u64).range(1..=ipam_core::dead_nodes::MAX_GRACE_SECONDS))]
    pub grace_seconds: u64,
    /// --dead-nodes: start the countdowns of newly missing nodes and release dead ones' blocks
    /// (like `node release` without --addresses); --leaks: release the leaks past their grace (each guarded by
    /// its sequence number); without it nothing is written
    #[arg(long)]
    pub apply: bool,
}

/// `blocks` subcommands.
#[derive(Debug, Subcommand)]
pub enum BlocksCommand {
    /// Empty blocks hosts no longer need: each host's empty blocks beyond its newest block,
    /// empty blocks in pools that no longer select their host, and unowned blocks whose cooling
    /// addresses have cooled. Shows them unless --apply.
    ReleaseEmpty(ReleaseEmptyArgs),
}

/// `blocks release-empty`.
#[derive(Debug, Args)]
pub struct ReleaseEmptyArgs {
    /// Only blocks empty for at least this long: seconds, or a number with s, m, h or d
    /// [default: the configured empty_block_reclaim_seconds]
    #[arg(long, value_name = "DURATION")]
    pub older_than: Option<String>,
    /// Release them (each in its own transaction, guarded by its revision); without it nothing
    /// is written
    #[arg(long)]
    pub apply: bool,
}

/// `migrate`.
#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// Target store type: sled, redb or etcdv3.
    #[arg(long, value_name = "TYPE")]
    pub to_datastore_type: String,
    /// Target embedded store path [default: the type's default path].
    #[arg(long, value_name = "PATH")]
    pub to_datastore_path: Option<PathBuf>,
    /// Target etcd endpoints, comma-separated.
    #[arg(long, value_name = "LIST")]
    pub to_etcd_endpoints: Option<String>,
    /// Target etcd CA certificate (PEM).
    #[arg(long, value_name = "FILE")]
    pub to_etcd_ca_cert_file: Option<PathBuf>,
    /// Target etcd client certificate (PEM).
    #[arg(long, value_name = "FILE")]
    pub to_etcd_cert_file: Option<PathBuf>,
    /// Target etcd client key (PEM).
    #[arg(long, value_name = "FILE")]
    pub to_etcd_key_file: Option<PathBuf>,
    /// Target etcd key prefix [default: /blockipam/].
    #[arg(long, value_name = "PREFIX")]
    pub to_etcd_prefix: Option<String>,
    /// Target etcd user name (with --to-etcd-password-env or --to-etcd-password).
    #[arg(long, value_name = "NAME")]
    pub to_etcd_username: Option<String>,
    /// Name of the environment variable holding the target user's password (ETCD_PASSWORD, say).
    #[arg(long, value_name = "VAR", conflicts_with = "to_etcd_password")]
    pub to_etcd_password_env: Option<String>,
    /// Target etcd password; prefer --to-etcd-password-env, which other users cannot read in the
    /// process list.
    #[arg(long, value_name = "PASSWORD")]
    pub to_etcd_password: Option<Secret>,
}

/// `import` subcommands.
#[derive(Debug, Subcommand)]
pub enum ImportCommand {
    /// Read a Calico etcdv3 datastore at one revision, write its pools, config, blocks and
    /// handles into the selected empty store, and verify them; report what cannot be mapped.
    Calico(ImportCalicoArgs),
}

/// `import calico`.
#[derive(Debug, Args)]
pub struct ImportCalicoArgs {
    /// Calico's etcd endpoints, comma-separated (http://host:port, https://host:port or host:port).
    #[arg(long, value_name = "LIST")]
    pub from_etcd_endpoints: String,
    /// Calico's key prefix.
    #[arg(long, value_name = "PREFIX", default_value = "/calico")]
    pub from_etcd_prefix: String,
    /// CA certificate (PEM) of Calico's etcd servers (turns TLS on).
    #[arg(long, value_name = "FILE")]
    pub from_etcd_ca_cert_file: Option<PathBuf>,
    /// Client certificate (PEM) for Calico's etcd (with --from-etcd-key-file).
    #[arg(long, value_name = "FILE")]
    pub from_etcd_cert_file: Option<PathBuf>,
    /// Client key (PEM) for Calico's etcd.
    #[arg(long, value_name = "FILE")]
    pub from_etcd_key_file: Option<PathBuf>,
    /// etcd user name for Calico's etcd (with --from-etcd-password-env).
    #[arg(long, value_name = "NAME")]
    pub from_etcd_username: Option<String>,
    /// Name of the environment variable holding that user's password.
    #[arg(long, value_name = "VAR")]
    pub from_etcd_password_env: Option<String>,
    /// Read and map only: report what would be imported and what cannot be mapped; write nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// `demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Directory for the demo's sled store and lock file (created when missing).
    #[arg(long, value_name = "DIR", default_value = "blockipam-demo")]
    pub dir: PathBuf,
    /// The blockipam plugin binary [env: BLOCKIPAM_PLUGIN] [default: `blockipam` next to this executable]
    #[arg(long, value_name = "PATH")]
    pub plugin: Option<PathBuf>,
    /// Simulated nodes.
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=8))]
    pub nodes: u8,
    /// Containers per node.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=16))]
    pub containers_per_node: u8,
}

/// `install-cni`.
#[derive(Debug, Args)]
pub struct InstallCniArgs {
    /// The blockipam plugin binary to install [env: BLOCKIPAM_PLUGIN] [default: `blockipam` next to this executable]
    #[arg(long, value_name = "PATH")]
    pub plugin: Option<PathBuf>,
    /// The host's CNI binary directory, where `blockipam` is installed [env: CNI_BIN_DIR] [default: /host/opt/cni/bin]
    #[arg(long, value_name = "DIR")]
    pub bin_dir: Option<PathBuf>,
    /// The host's CNI network config directory [env: CNI_NET_DIR] [default: /host/etc/cni/net.d]
    #[arg(long, value_name = "DIR")]
    pub conf_dir: Option<PathBuf>,
    /// File name of the conflist, ending with .conflist [env: CNI_CONF_NAME] [default: 10-blockipam.conflist]
    #[arg(long, value_name = "NAME")]
    pub conf_name: Option<String>,
    /// A conflist template file: its plugins whose ipam type is blockipam get the store and node settings [env: CNI_NETWORK_CONFIG_FILE, or the template itself in CNI_NETWORK_CONFIG]
    #[arg(long, value_name = "FILE")]
    pub network_config_file: Option<PathBuf>,
    /// Network name of the generated conflist (without a template) [env: BLOCKIPAM_NETWORK_NAME] [default: pods]
    #[arg(long, value_name = "NAME")]
    pub network_name: Option<String>,
    /// Main plugin of the generated conflist, e.g. ptp or bridge (without a template) [env: BLOCKIPAM_MAIN_PLUGIN] [default: ptp]
    #[arg(long, value_name = "TYPE")]
    pub main_plugin: Option<String>,
    /// cniVersion of the generated conflist (without a template) [env: BLOCKIPAM_CNI_VERSION] [default: 1.0.0]
    #[arg(long, value_name = "VERSION")]
    pub cni_version: Option<String>,
    /// Extra keys for the ipam section, as a JSON object, e.g. '{"gateway": "10.244.0.1"}' [env: BLOCKIPAM_IPAM_CONFIG]
    #[arg(long, value_name = "JSON")]
    pub ipam_config: Option<String>,
    /// The node name written as ipam.nodename [env: NODENAME, else KUBERNETES_NODE_NAME] [default: none: the plugin reads /var/lib/calico/nodename, else the host name]
    #[arg(long, value_name = "NAME")]
    pub node: Option<String>,
}
