//! Hostile input through the real `blockipam` binary: malformed netconf, `CNI_ARGS` and environment, and damaged store files.
//!
//! Every row of the table runs the plugin against a store that already holds allocations (on
//! sled, and the whole table again on etcd) and states the CNI error code it must answer. For
//! each row the test asserts that code, a well-formed CNI error JSON on stdout, exit status 1
//! with no panic and no hang, and a store unchanged key for key, value for value and revision
//! for revision (dumped through the store adapter after the plugin exited). All failing rows are
//! reported together.
//!
//! The damaged-store tests truncate and bit-flip the sled and redb data files and run the plugin
//! on them: it answers, or fails with a clear CNI error, and never panics or hangs.
//!
//! `fuzz_seeds_and_corpus_replay_without_panic` replays the fuzz targets' committed seeds (and a
//! local corpus, when `scripts/fuzz` left one) through the same parsers, as an ordinary test.

use crate::common;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use backend_etcd::{EtcdConfig, EtcdStore};
use blockipam::protocol::SUPPORTED_VERSIONS;
use blockipam_store::{Backend, DatastoreSettings, DatastoreType};
use common::*;
use ipam_core::KvStore;
use serde_json::{json, Value};
use test_kit::cni::start_cni;
use test_kit::etcd::{unique_prefix, EtcdServer, PrefixGuard};

/// Longest one plugin call may take before the row counts as a hang (not a timing assertion:
/// a healthy call takes milliseconds).
const HANG_BOUND: Duration = Duration::from_secs(60);

/// The container every row acts for unless it says otherwise; it holds nothing.
const INTRUDER: &str = "intruder";

/// An address outside every pool of the sandbox.
const OUTSIDE_V4: &str = "192.0.2.10";

/// One mebibyte.
const MIB: usize = 1024 * 1024;

/// Every key, value and revision of a store.
type Dump = Vec<(String, Vec<u8>, u64)>;

/// Where the plugin keeps its data in one run of the table.
enum Target {
    /// An embedded store in a sandbox.
    Embedded(Sandbox),
    /// A key prefix on the shared etcd; the sandbox holds the lock file.
    Etcd {
        sandbox: Sandbox,
        endpoint: String,
        prefix: String,
        _guard: Box<PrefixGuard>,
    },
}

impl Target {
    fn sandbox(&self) -> &Sandbox {
        match self {
            Target::Embedded(sandbox) | Target::Etcd { sandbox, .. } => sandbox,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Target::Embedded(sandbox) => sandbox.store_type.as_str(),
            Target::Etcd { .. } => "etcd",
        }
    }

    /// The `ipam` object for this target with `extra` merged in (`null` removes a key).
    fn ipam(&self, extra: Value) -> Value {
        let mut ipam = match self {
            Target::Embedded(sandbox) => sandbox.ipam(json!({})),
            Target::Etcd {
                sandbox,
                endpoint,
                prefix,
                ..
            } => sandbox.ipam(json!({
                "datastore_type": "etcdv3",
                "datastore_path": null,
                "etcd_endpoints": endpoint,
                "etcd_prefix": prefix,
            })),
        };
        merge(&mut ipam, extra);
        ipam
    }

    /// A netconf at spec 1.0.0 for this target.
    fn netconf(&self, extra: Value) -> Value {
        json!({"cniVersion": "1.0.0", "name": NETWORK, "ipam": self.ipam(extra)})
    }

    /// Every key, value and revision, read through the store adapter.
    fn dump(&self) -> Dump {
        block_on(async {
            let store: std::sync::Arc<dyn KvStore> = match self {
                Target::Embedded(sandbox) => DatastoreSettings {
                    backend: Backend::embedded(sandbox.store_type, Some(sandbox.store_path()))
                        .expect("an embedded store type"),
                    ..DatastoreSettings::default()
                }
                .open()
                .await
                .unwrap_or_else(|e| panic!("cannot open the {} store: {e}", self.name())),
                Target::Etcd {
                    endpoint, prefix, ..
                } => std::sync::Arc::new(
                    EtcdStore::connect(EtcdConfig::new([endpoint.clone()]).with_prefix(prefix))
                        .await
                        .expect("connect to etcd"),
                ),
            };
            store
                .list("")
                .await
                .expect("list the store")
                .into_iter()
                .map(|kv| (kv.key, kv.value, kv.revision.get()))
                .collect()
        })
    }
}

/// What Rust's panic report carries (`thread 'main' panicked at ...`): a panic nobody caught. A
/// panic inside a store engine that the adapter catches is answered as a CNI error whose message
/// says so ("redb panicked while opening ..."), which is the clear error this file asks for; the
/// plugin's panic hook reports the engine's own panic as one log line.
const UNCAUGHT_PANIC: &str = "panicked at";

/// What the fixture's containers hold.
#[derive(Debug)]
struct Fixture {
    /// An address held by container `c1` (eth0).
    held_by_c1: String,
    /// The ADD result of `c1` (eth0), spec 1.0.0.
    c1_result: Value,
    /// Every address the fixture's containers hold.
    held: Vec<String>,
}

/// Fills the target's store through the plugin: c1 (dual stack), c2 on eth0 and net1, c3 added
/// and deleted again (so the store has released addresses too).
fn populate(target: &Target) -> Fixture {
    let dual = target.netconf(json!({"assign_ipv6": true}));
    let single = target.netconf(json!({}));
    let c1 = cni("ADD", "c1", "eth0", &dual, &[]).success_json("ADD c1");
    let c2 = cni("ADD", "c2", "eth0", &single, &[]).success_json("ADD c2 eth0");
    let c2_net1 = cni("ADD", "c2", "net1", &single, &[]).success_json("ADD c2 net1");
    cni("ADD", "c3", "eth0", &single, &[]).success_json("ADD c3");
    cni("DEL", "c3", "eth0", &single, &[]).assert_silent_success("DEL c3");
    Fixture {
        held_by_c1: first_address(&c1),
        held: [&c1, &c2, &c2_net1]
            .into_iter()
            .flat_map(addresses)
            .collect(),
        c1_result: c1,
    }
}

/// One hostile call and the CNI error code it must get.
#[derive(Debug, Clone)]
struct Row {
    what: String,
    code: u64,
    env: BTreeMap<OsString, OsString>,
    stdin: Vec<u8>,
    /// False for rows whose input only an embedded store refuses (a path the etcd target never
    /// opens).
    on_etcd: bool,
}

impl Row {
    /// `command` for (`container`, eth0) with `stdin` as is.
    fn raw(what: &str, code: u64, command: &str, container: &str, stdin: Vec<u8>) -> Row {
        Row {
            what: what.to_owned(),
            code,
            env: cni_env(command, container, "eth0")
                .into_iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v)))
                .collect(),
            stdin,
            on_etcd: true,
        }
    }

    /// An ADD of [`INTRUDER`] with `netconf`.
    fn add(what: &str, code: u64, netconf: &Value) -> Row {
        Row::raw(
            what,
            code,
            "ADD",
            INTRUDER,
            netconf.to_string().into_bytes(),
        )
    }

    /// `command` for `container` with `netconf`.
    fn call(what: &str, code: u64, command: &str, container: &str, netconf: &Value) -> Row {
        Row::raw(
            what,
            code,
            command,
            container,
            netconf.to_string().into_bytes(),
        )
    }

    fn env(mut self, key: &str, value: impl Into<Vec<u8>>) -> Row {
        self.env
            .insert(OsString::from(key), OsString::from_vec(value.into()));
        self
    }

    fn unset(mut self, key: &str) -> Row {
        self.env.remove(&OsString::from(key));
        self
    }

    fn embedded_only(mut self) -> Row {
        self.on_etcd = false;
        self
    }
}

/// `base` with the top-level keys of `extra` set (`null` removes).
fn with_top(base: &Value, extra: Value) -> Value {
    let mut netconf = base.clone();
    merge(&mut netconf, extra);
    netconf
}

/// `netconf` serialised with `needle` (which must occur in it) replaced by raw bytes.
fn splice(netconf: &Value, needle: &str, bytes: &[u8]) -> Vec<u8> {
    let text = netconf.to_string();
    let at = text
        .find(needle)
        .unwrap_or_else(|| panic!("{needle:?} is not in {text}"));
    let mut out = text.as_bytes()[..at].to_vec();
    out.extend_from_slice(bytes);
    out.extend_from_slice(&text.as_bytes()[at + needle.len()..]);
    out
}

/// The whole table for `target`.
fn rows(target: &Target, fixture: &Fixture) -> Vec<Row> {
    let base = target.netconf(json!({}));
    let ipam = |extra: Value| target.netconf(extra);
    let text = base.to_string();
    let mut rows = Vec::new();

    // Standard input that is not a netconf at all: code 6.
    for (what, stdin) in [
        ("empty stdin", Vec::new()),
        ("stdin that is not JSON", b"this is not json".to_vec()),
        ("a JSON array", b"[1, 2, 3]".to_vec()),
        ("a JSON string", b"\"netconf\"".to_vec()),
        ("JSON null", b"null".to_vec()),
        ("a JSON number", b"42".to_vec()),
        (
            "a truncated netconf",
            text.as_bytes()[..text.len() / 2].to_vec(),
        ),
        (
            "a netconf with trailing garbage",
            format!("{text} }}").into_bytes(),
        ),
        (
            "invalid UTF-8 inside a string",
            splice(&base, "node-a", b"node-\xff\xfe"),
        ),
        (
            "a raw NUL byte inside a string",
            splice(&base, "node-a", b"node\0a"),
        ),
        (
            "a raw NUL byte between tokens",
            format!("\0{text}").into_bytes(),
        ),
        (
            "arrays nested 100,000 deep",
            ["[".repeat(100_000), "]".repeat(100_000)]
                .concat()
                .into_bytes(),
        ),
        (
            "8 MiB of whitespace around an array",
            [" ".repeat(8 * MIB), "[]".to_owned()].concat().into_bytes(),
        ),
        ("a UTF-16 netconf", {
            let mut bytes = vec![0xff, 0xfe];
            bytes.extend(text.encode_utf16().flat_map(u16::to_le_bytes));
            bytes
        }),
    ] {
        rows.push(Row::raw(what, 6, "ADD", INTRUDER, stdin));
    }
    rows.push(Row::raw(
        "DEL of a holding container with stdin that is not JSON",
        6,
        "DEL",
        "c1",
        b"{\"cniVersion\": ".to_vec(),
    ));

    // name and cniVersion, read first as libcni's skeleton does.
    for (what, code, name) in [
        ("no network name", 7, Value::Null),
        ("an empty network name", 7, json!("")),
        ("a numeric network name", 6, json!(5)),
        ("a list as network name", 6, json!(["testnet"])),
        ("a network name with a space", 7, json!("test net")),
        ("a network name starting with a dash", 7, json!("-testnet")),
        ("a network name with a NUL", 7, json!("test\u{0}net")),
        ("a non-ASCII network name", 7, json!("ネット")),
        (
            "a 1 MiB network name with a bad last character",
            7,
            json!(format!("{}!", "a".repeat(MIB))),
        ),
        (
            "a 1 MiB network name (the handle would be too long)",
            7,
            json!("a".repeat(MIB)),
        ),
    ] {
        rows.push(Row::add(
            what,
            code,
            &with_top(&base, json!({"name": name})),
        ));
    }
    for (what, code, version) in [
        ("a numeric cniVersion", 6, json!(1)),
        ("an object as cniVersion", 6, json!({})),
        ("an unknown cniVersion", 1, json!("9.9.9")),
        ("a two-part cniVersion", 1, json!("1.0")),
        ("a v-prefixed cniVersion", 1, json!("v1.0.0")),
        ("a cniVersion with a NUL", 1, json!("1.0.0\u{0}")),
        ("a 64 KiB cniVersion", 1, json!("1.".repeat(32 * 1024))),
    ] {
        rows.push(Row::add(
            what,
            code,
            &with_top(&base, json!({"cniVersion": version})),
        ));
    }
    let at = |version: &str| with_top(&base, json!({"cniVersion": version}));
    rows.push(Row::call(
        "CHECK at spec 0.3.1",
        1,
        "CHECK",
        "c1",
        &at("0.3.1"),
    ));
    rows.push(Row::call("GC at spec 1.0.0", 1, "GC", "", &at("1.0.0")));
    rows.push(Row::call(
        "STATUS at spec 0.4.0",
        1,
        "STATUS",
        "",
        &at("0.4.0"),
    ));

    // A wrong type for every key the plugin reads (inside `ipam`): code 7.
    for (key, value) in [
        ("datastore_type", json!(5)),
        ("etcd_endpoints", json!(5)),
        ("etcd_endpoints", json!([5])),
        ("datastore_path", json!(5)),
        ("datastore_path", json!([])),
        ("etcd_ca_cert_file", json!(true)),
        ("etcd_cert_file", json!({})),
        ("etcd_key_file", json!(1)),
        ("etcd_prefix", json!([])),
        ("etcd_username", json!(5)),
        ("etcd_password", json!(["secret"])),
        ("ipam_lock_timeout_seconds", json!("ten")),
        ("ipam_lock_timeout_seconds", json!(-1)),
        ("ipam_lock_timeout_seconds", json!(1e300)),
        ("timeout_seconds", json!(0)),
        ("timeout_seconds", json!(1e-10)),
        ("timeout_seconds", json!("90")),
        ("log_level", json!(3)),
        ("log_file_path", json!(3)),
        ("ipam_lock_file", json!({})),
        ("agent_socket", json!(5)),
        ("agent_socket", json!(["/run/blockipam/agent.sock"])),
        ("nodename", json!(5)),
        ("nodename_file", json!([])),
        ("assign_ipv4", json!(1)),
        ("assign_ipv6", json!([])),
        ("ipv4_pools", json!("test-v4")),
        ("ipv4_pools", json!([1])),
        ("ipv6_pools", json!({})),
        ("pools", json!({})),
        ("pools", json!([5])),
        ("pools", json!([{"cidr": 5}])),
        ("pools", json!([{"block_size": 26}])),
        (
            "pools",
            json!([{"cidr": "10.244.7.0/24", "block_size": "26"}]),
        ),
        ("pools", json!([{"cidr": "10.244.7.0/24", "name": 5}])),
        ("gateway", json!(5)),
        ("gateway", json!(["10.244.7.1", 5])),
        ("gateway", json!("not-an-address")),
        ("routes", json!({})),
        ("routes", json!([5])),
        ("routes", json!([{"dst": 5}])),
        ("routes", json!([{"gw": "10.244.7.1"}])),
        ("routes", json!([{"dst": "10.0.0.0/8", "gw": 1}])),
        ("routes", json!([{"dst": "10.0.0.0/8", "gw": "gateway"}])),
        ("routes", json!([{"dst": "10.0.0.0/8", "gw": "fd00::1"}])),
        ("routes", json!([{"dst": "10.0.0.0/33"}])),
    ] {
        rows.push(Row::add(
            &format!("ipam.{key} = {value}"),
            7,
            &ipam(json!({ key: value })),
        ));
    }
    for (what, ipam_value) in [
        ("ipam as a string", json!("blockipam")),
        ("ipam as a list", json!([])),
    ] {
        rows.push(Row::add(
            what,
            7,
            &with_top(&base, json!({"ipam": ipam_value})),
        ));
    }
    // Keys read at the top level when `ipam` does not set them.
    rows.push(Row::add(
        "top-level datastore_type = 5",
        7,
        &with_top(
            &ipam(json!({"datastore_type": null})),
            json!({"datastore_type": 5}),
        ),
    ));
    rows.push(Row::add(
        "top-level timeout_seconds = \"x\"",
        7,
        &with_top(&base, json!({"timeout_seconds": "x"})),
    ));
    // Keys only read at the top level.
    for (what, extra) in [
        ("args = 5", json!({"args": 5})),
        ("args.cni = 5", json!({"args": {"cni": 5}})),
        (
            "args.cni.ips as a string",
            json!({"args": {"cni": {"ips": "10.244.7.5"}}}),
        ),
        ("args.cni.ips = [5]", json!({"args": {"cni": {"ips": [5]}}})),
        (
            "args.cni.ips with a non-address",
            json!({"args": {"cni": {"ips": ["not-an-address"]}}}),
        ),
        ("runtimeConfig = 5", json!({"runtimeConfig": 5})),
        (
            "runtimeConfig.ips = {}",
            json!({"runtimeConfig": {"ips": {}}}),
        ),
        (
            "runtimeConfig.ips with an octet over 255",
            json!({"runtimeConfig": {"ips": ["10.244.7.300"]}}),
        ),
        ("prevResult = 5", json!({"prevResult": 5})),
        ("prevResult = []", json!({"prevResult": []})),
    ] {
        rows.push(Row::add(what, 7, &with_top(&base, extra)));
    }
    rows.push(Row::call(
        "DEL of a holding container with prevResult = 5",
        7,
        "DEL",
        "c1",
        &with_top(&base, json!({"prevResult": 5})),
    ));
    for (what, prev) in [
        (
            "CHECK with a numeric prevResult address",
            json!({"ips": [{"address": 5}]}),
        ),
        ("CHECK with prevResult.ips a string", json!({"ips": "x"})),
        (
            "CHECK with a non-address in prevResult",
            json!({"ips": [{"address": "10.244.7.300/26"}]}),
        ),
    ] {
        rows.push(Row::call(
            what,
            6,
            "CHECK",
            "c1",
            &with_top(&base, json!({"cniVersion": "1.1.0", "prevResult": prev})),
        ));
    }
    for (what, attachments) in [
        (
            "GC with valid-attachments = 5",
            json!({"cni.dev/valid-attachments": 5}),
        ),
        (
            "GC with valid-attachments = [5]",
            json!({"cni.dev/valid-attachments": [5]}),
        ),
        (
            "GC with a numeric containerID",
            json!({"cni.dev/valid-attachments": [{"containerID": 5, "ifname": "eth0"}]}),
        ),
        (
            "GC with an attachment without ifname",
            json!({"cni.dev/valid-attachments": [{"containerID": "c1"}]}),
        ),
        (
            "GC with the older attachments key a string",
            json!({"cni.dev/attachments": "c1"}),
        ),
    ] {
        let mut netconf = with_top(&base, attachments);
        merge(&mut netconf, json!({"cniVersion": "1.1.0"}));
        rows.push(Row::call(what, 7, "GC", "", &netconf));
    }
    rows.push(Row::call(
        "STATUS with ipam.nodename = 5",
        7,
        "STATUS",
        "",
        &with_top(
            &ipam(json!({"nodename": 5})),
            json!({"cniVersion": "1.1.0"}),
        ),
    ));

    // Values blockipam does not support: code 2.
    for (key, value) in [
        ("datastore_type", "kubernetes"),
        ("log_level", "loud"),
        ("assign_ipv4", "maybe"),
        ("assign_ipv6", "yes"),
    ] {
        rows.push(Row::add(
            &format!("ipam.{key} = {value:?}"),
            2,
            &ipam(json!({ key: value })),
        ));
    }

    // Bad pools: code 7, and no pool is created.
    for (what, pool) in [
        ("a pool CIDR with a /33", json!({"cidr": "10.244.7.0/33"})),
        ("a pool CIDR that is not one", json!({"cidr": "not-a-cidr"})),
        ("an empty pool CIDR", json!({"cidr": ""})),
        (
            "a pool CIDR with host bits",
            json!({"cidr": "10.244.9.1/24"}),
        ),
        (
            "an IPv6 pool CIDR with host bits",
            json!({"cidr": "fd00:99::1/120"}),
        ),
        (
            "a block larger than its pool",
            json!({"cidr": "10.244.9.0/24", "block_size": 19}),
        ),
        (
            "block size 33",
            json!({"cidr": "10.244.9.0/24", "block_size": 33}),
        ),
        (
            "block size 300",
            json!({"cidr": "10.244.9.0/24", "block_size": 300}),
        ),
        (
            "block size -1",
            json!({"cidr": "10.244.9.0/24", "block_size": -1}),
        ),
        (
            "block size 26.5",
            json!({"cidr": "10.244.9.0/24", "block_size": 26.5}),
        ),
        (
            "IPv6 block size 129",
            json!({"cidr": "fd00:99::/120", "block_size": 129}),
        ),
        (
            "a pool name with a slash",
            json!({"cidr": "10.244.9.0/24", "name": "bad/name"}),
        ),
        (
            "a pool name with a NUL",
            json!({"cidr": "10.244.9.0/24", "name": "bad\u{0}name"}),
        ),
        (
            "a 1 MiB pool name",
            json!({"cidr": "10.244.9.0/24", "name": "p".repeat(MIB)}),
        ),
        (
            "a 1 MiB pool CIDR",
            json!({"cidr": format!("10.244.9.0/{}", "2".repeat(MIB))}),
        ),
    ] {
        let mut pools = base["ipam"]["pools"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        pools.push(pool);
        rows.push(Row::add(what, 7, &ipam(json!({"pools": pools}))));
    }
    rows.push(Row::add(
        "etcdv3 without endpoints",
        7,
        &ipam(json!({"datastore_type": "etcdv3", "etcd_endpoints": null})),
    ));
    rows.push(Row::add(
        "a user name without a password",
        7,
        &ipam(json!({"etcd_username": "blockipam", "etcd_password": null})),
    ));
    rows.push(Row::add(
        "a client certificate without its key",
        7,
        &ipam(json!({"etcd_cert_file": "/nonexistent/cert.pem", "etcd_key_file": null})),
    ));
    // A TLS file that cannot be read is found only when the store is opened: still the netconf's
    // fault (code 7), for STATUS too, which answers every failure of the store itself with 50.
    let unreadable_ca = json!({
        "datastore_type": "etcdv3",
        "datastore_path": null,
        "etcd_endpoints": "http://127.0.0.1:1",
        "etcd_ca_cert_file": "/nonexistent/ca.pem",
    });
    rows.push(Row::add(
        "an etcd CA file that cannot be read",
        7,
        &ipam(unreadable_ca.clone()),
    ));
    rows.push(Row::call(
        "STATUS with an etcd CA file that cannot be read",
        7,
        "STATUS",
        "",
        &with_top(&ipam(unreadable_ca), json!({"cniVersion": "1.1.0"})),
    ));

    // Addresses outside every pool, or held: nothing may be allocated.
    rows.push(
        Row::add("IP= outside every pool", 103, &base).env("CNI_ARGS", format!("IP={OUTSIDE_V4}")),
    );
    rows.push(Row::add("IPv6 IP= outside every pool", 103, &base).env("CNI_ARGS", "IP=fd00:99::1"));
    rows.push(Row::add(
        "args.cni.ips outside every pool",
        103,
        &with_top(&base, json!({"args": {"cni": {"ips": [OUTSIDE_V4]}}})),
    ));
    rows.push(Row::add(
        "runtimeConfig.ips outside every pool",
        103,
        &with_top(
            &base,
            json!({"runtimeConfig": {"ips": [format!("{OUTSIDE_V4}/24")]}}),
        ),
    ));
    rows.push(Row::add(
        "runtimeConfig.ips with a free address and one outside every pool",
        103,
        &with_top(
            &base,
            json!({"runtimeConfig": {"ips": ["10.244.7.40", OUTSIDE_V4]}}),
        ),
    ));
    rows.push(
        Row::add("IP= of another container's address", 102, &base)
            .env("CNI_ARGS", format!("IP={}", fixture.held_by_c1)),
    );
    rows.push(Row::add(
        "runtimeConfig.ips of another container's address",
        102,
        &with_top(
            &base,
            json!({"runtimeConfig": {"ips": [fixture.held_by_c1.clone()]}}),
        ),
    ));

    // CNI_ARGS that libcni would refuse: code 4.
    let args_rows: [(&str, Vec<u8>); 13] = [
        ("a pair without =", b"IP".to_vec()),
        ("a pair with two =", b"IP=1=2".to_vec()),
        ("a trailing ;", b"K8S_POD_NAME=a;".to_vec()),
        ("a lone ;", b";".to_vec()),
        ("a lone =", b"=".to_vec()),
        ("IP= not an address", b"IP=not-an-address".to_vec()),
        ("IP= with an octet over 255", b"IP=10.244.7.300".to_vec()),
        ("IgnoreUnknown=yes", b"IgnoreUnknown=yes".to_vec()),
        ("an unknown key", b"FOO=bar".to_vec()),
        (
            "an unknown key with IgnoreUnknown=0",
            b"K8S_POD_NAME=web;FOO=bar;IgnoreUnknown=0".to_vec(),
        ),
        ("IP= with invalid UTF-8", b"IP=10.244.7.\xff".to_vec()),
        (
            "a 100 KiB unknown key",
            format!("{}=1", "K".repeat(100 * 1024)).into_bytes(),
        ),
        (
            "IP= with 10,000 bad items",
            format!("IP={}", "x,".repeat(10_000)).into_bytes(),
        ),
    ];
    for (what, args) in args_rows {
        rows.push(Row::add(&format!("CNI_ARGS: {what}"), 4, &base).env("CNI_ARGS", args));
    }
    rows.push(
        Row::call(
            "DEL of a holding container with an unknown CNI_ARGS key",
            4,
            "DEL",
            "c1",
            &base,
        )
        .env("CNI_ARGS", "FOO=bar"),
    );

    // The environment: code 4.
    for (what, command) in [
        ("an unknown CNI_COMMAND", b"FOO".to_vec()),
        ("a lower-case CNI_COMMAND", b"add".to_vec()),
        ("CNI_COMMAND with a trailing space", b"ADD ".to_vec()),
        ("CNI_COMMAND with invalid UTF-8", b"AD\xff".to_vec()),
    ] {
        rows.push(Row::add(what, 4, &base).env("CNI_COMMAND", command));
    }
    for key in ["CNI_CONTAINERID", "CNI_IFNAME", "CNI_NETNS", "CNI_PATH"] {
        rows.push(Row::add(&format!("no {key}"), 4, &base).unset(key));
        rows.push(Row::add(&format!("an empty {key}"), 4, &base).env(key, ""));
    }
    rows.push(
        Row::call("DEL without CNI_CONTAINERID", 4, "DEL", "c1", &base).unset("CNI_CONTAINERID"),
    );
    for (what, code, id) in [
        ("a container id with a slash", 4, b"a/b".to_vec()),
        ("a container id starting with a dash", 4, b"-abc".to_vec()),
        (
            "a container id that climbs directories",
            4,
            b"../../etc".to_vec(),
        ),
        ("a container id with a trailing space", 4, b"c1 ".to_vec()),
        ("a container id with invalid UTF-8", 4, b"c\xff1".to_vec()),
        (
            "a 100 KiB container id (the handle would be too long)",
            7,
            "c".repeat(100 * 1024).into_bytes(),
        ),
    ] {
        rows.push(Row::add(what, code, &base).env("CNI_CONTAINERID", id));
    }
    for (what, ifname) in [
        ("a 16-character interface name", "eth0123456789abc"),
        ("interface name .", "."),
        ("interface name ..", ".."),
        ("an interface name with a slash", "a/b"),
        ("an interface name with a colon", "a:b"),
        ("an interface name with a space", "a b"),
        ("an interface name that is a tab", "\t"),
    ] {
        rows.push(Row::add(what, 4, &base).env("CNI_IFNAME", ifname));
    }
    rows.push(
        Row::call(
            "DEL of a holding container with interface name ..",
            4,
            "DEL",
            "c1",
            &base,
        )
        .env("CNI_IFNAME", ".."),
    );

    // NUL bytes and huge strings in values that reach validation.
    rows.push(Row::add(
        "a nodename with a NUL",
        7,
        &ipam(json!({"nodename": "node\u{0}a"})),
    ));
    rows.push(Row::add(
        "a 1 MiB nodename",
        7,
        &ipam(json!({"nodename": "n".repeat(MIB)})),
    ));
    rows.push(Row::add(
        "nodename \"-\" (the network reservations' pseudo-node)",
        7,
        &ipam(json!({"nodename": "-"})),
    ));
    rows.push(Row::add(
        "an ipam_lock_file with a NUL",
        5,
        &ipam(json!({"ipam_lock_file": "/tmp/blockipam\u{0}lock"})),
    ));
    rows.push(
        Row::add(
            "a datastore_path with a NUL",
            5,
            &ipam(json!({"datastore_path": "/tmp/blockipam\u{0}store"})),
        )
        .embedded_only(),
    );
    rows
}

/// What one call produced.
#[derive(Debug)]
struct Call {
    status: Option<i32>,
    stdout: String,
    stderr: String,
    hung: bool,
}

/// Runs the plugin with exactly `env` and `stdin`, killing it after [`HANG_BOUND`].
fn run_plugin(env: &BTreeMap<OsString, OsString>, stdin: &[u8]) -> Call {
    let ended = start_cni(plugin_binary(), &[], env, stdin).wait_or_kill(HANG_BOUND);
    Call {
        status: ended.status.code(),
        stdout: ended.stdout,
        stderr: ended.stderr,
        hung: ended.hung,
    }
}

/// Problems with an answer that should be a CNI error with `code` (empty when it is one).
fn error_answer_problems(call: &Call, code: Option<u64>) -> Vec<String> {
    let mut problems = Vec::new();
    if call.hung {
        problems.push(format!("no answer within {HANG_BOUND:?}"));
        return problems;
    }
    if call.stderr.contains(UNCAUGHT_PANIC) || call.stderr.contains("RUST_BACKTRACE") {
        problems.push(format!("panicked: {}", call.stderr.trim()));
    }
    if call.status != Some(1) {
        problems.push(format!("exit status {:?}, expected 1", call.status));
    }
    let value: Value = match serde_json::from_str(&call.stdout) {
        Ok(value) => value,
        Err(e) => {
            problems.push(format!("stdout is not JSON ({e}): {:?}", call.stdout));
            return problems;
        }
    };
    let keys: Vec<&str> = value
        .as_object()
        .map(|o| o.keys().map(String::as_str).collect())
        .unwrap_or_default();
    if keys != ["cniVersion", "code", "details", "msg"] {
        problems.push(format!("error JSON keys {keys:?}: {value}"));
    }
    let version_ok = value["cniVersion"]
        .as_str()
        .is_some_and(|v| SUPPORTED_VERSIONS.contains(&v));
    if !version_ok {
        problems.push(format!("cniVersion is not a supported version: {value}"));
    }
    if value["msg"].as_str().is_none_or(str::is_empty) || !value["details"].is_string() {
        problems.push(format!("msg/details are not strings: {value}"));
    }
    match (code, value["code"].as_u64()) {
        (Some(wanted), Some(got)) if wanted == got => {}
        (Some(wanted), got) => problems.push(format!(
            "code {got:?}, expected {wanted} (msg: {})",
            value["msg"]
        )),
        (None, None) => problems.push(format!("no numeric code: {value}")),
        (None, Some(_)) => {}
    }
    problems
}

/// How two dumps differ (empty when they are equal).
fn dump_difference(before: &Dump, after: &Dump) -> Vec<String> {
    let old: BTreeMap<&str, (&[u8], u64)> = before
        .iter()
        .map(|(k, v, r)| (k.as_str(), (v.as_slice(), *r)))
        .collect();
    let new: BTreeMap<&str, (&[u8], u64)> = after
        .iter()
        .map(|(k, v, r)| (k.as_str(), (v.as_slice(), *r)))
        .collect();
    let mut changes = Vec::new();
    for (key, (value, rev)) in &old {
        match new.get(key) {
            None => changes.push(format!("deleted {key}")),
            Some((v, r)) if v != value || r != rev => {
                changes.push(format!("rewrote {key} (revision {rev} -> {r})"))
            }
            Some(_) => {}
        }
    }
    for key in new.keys().filter(|k| !old.contains_key(*k)) {
        changes.push(format!("created {key}"));
    }
    changes
}

/// Runs the whole table on `target` and fails listing every row that misbehaved.
fn run_table(target: &Target) {
    let fixture = populate(target);
    let mut before = target.dump();
    assert!(
        before.iter().any(|(k, _, _)| k.contains("handles/")),
        "the fixture holds no allocation: {before:?}"
    );
    let table: Vec<Row> = rows(target, &fixture)
        .into_iter()
        .filter(|row| row.on_etcd || matches!(target, Target::Embedded(_)))
        .collect();
    let mut failures = Vec::new();
    for row in &table {
        let call = run_plugin(&row.env, &row.stdin);
        let mut problems = error_answer_problems(&call, Some(row.code));
        let after = target.dump();
        let changes = dump_difference(&before, &after);
        if !changes.is_empty() {
            problems.push(format!("the store changed: {}", changes.join("; ")));
            // Later rows are judged against the store as this one left it.
            before = after;
        }
        if !problems.is_empty() {
            failures.push(format!("- {}: {}", row.what, problems.join("; ")));
        }
    }
    println!(
        "{}: {} hostile rows, {} failed",
        target.name(),
        table.len(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} hostile rows misbehaved on {}:\n{}",
        failures.len(),
        table.len(),
        target.name(),
        failures.join("\n")
    );
}

#[test]
fn hostile_inputs_get_their_error_code_and_leave_the_sled_store_unchanged() {
    run_table(&Target::Embedded(Sandbox::with_store(DatastoreType::Sled)));
}

#[test]
fn hostile_inputs_get_their_error_code_and_leave_the_etcd_store_unchanged() {
    let server = EtcdServer::try_shared().unwrap_or_else(|e| {
        panic!("this test needs a local etcd (apt-get install etcd-server, or scripts/setup): {e}")
    });
    let prefix = unique_prefix();
    run_table(&Target::Etcd {
        sandbox: Sandbox::new(),
        endpoint: server.endpoint(),
        _guard: Box::new(PrefixGuard::new(server.config(&prefix))),
        prefix,
    });
}

// ---------------------------------------------------------------------------------------------
// Damaged store files
// ---------------------------------------------------------------------------------------------

/// Every regular file under `path` (the path itself when it is a file).
fn files_under(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return vec![path.to_owned()];
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).expect("read the store directory") {
        let entry = entry.expect("directory entry");
        let file = entry.path();
        if file.is_dir() {
            files.extend(files_under(&file));
        } else {
            files.push(file);
        }
    }
    files.sort();
    files
}

/// The store's main data file: sled's `db` log, or the redb file.
fn data_file(sandbox: &Sandbox) -> PathBuf {
    match sandbox.store_type {
        DatastoreType::Sled => sandbox.store_path().join("db"),
        _ => sandbox.store_path(),
    }
}

/// One way to damage the data file.
#[derive(Debug, Clone)]
enum Damage {
    TruncateTo(u64),
    FlipBit { offset: u64, bit: u8 },
}

fn apply(damage: &Damage, file: &Path) {
    match damage {
        Damage::TruncateTo(len) => std::fs::OpenOptions::new()
            .write(true)
            .open(file)
            .and_then(|f| f.set_len(*len))
            .expect("truncate the data file"),
        Damage::FlipBit { offset, bit } => {
            use std::os::unix::fs::FileExt;
            // In place: the file keeps its length and inode, as a plugin holding it open sees.
            let handle = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(file)
                .expect("open the data file");
            let mut byte = [0u8];
            if handle.read_exact_at(&mut byte, *offset).is_ok() {
                byte[0] ^= 1 << bit;
                handle
                    .write_all_at(&byte, *offset)
                    .expect("write the flipped byte");
            }
        }
    }
}

/// Truncations at several lengths, and single-bit flips spread over the file plus flips inside
/// the stored records (found by the text of a handle key).
fn damages(pristine: &[u8]) -> Vec<Damage> {
    let len = pristine.len() as u64;
    let mut list: Vec<Damage> = [0, 1, 16, len / 8, len / 4, len / 2, 3 * len / 4, len - 1]
        .into_iter()
        .map(Damage::TruncateTo)
        .collect();
    for i in 0..24u64 {
        list.push(Damage::FlipBit {
            offset: len * (2 * i + 1) / 48,
            bit: (i % 8) as u8,
        });
    }
    let needle = b"testnet.c1";
    let records: Vec<u64> = pristine
        .windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i as u64)
        .take(4)
        .collect();
    assert!(!records.is_empty(), "no record text found in the data file");
    for at in records {
        for (delta, bit) in [(0u64, 0u8), (3, 5), (12, 1), (24, 7), (40, 3)] {
            if at + delta < len {
                list.push(Damage::FlipBit {
                    offset: at + delta,
                    bit,
                });
            }
        }
    }
    list
}

/// Restores `pristine` (file path → bytes) exactly: other files are removed.
fn restore(root: &Path, pristine: &BTreeMap<PathBuf, Vec<u8>>) {
    for file in files_under(root) {
        if !pristine.contains_key(&file) {
            std::fs::remove_file(&file).expect("remove a file the plugin added");
        }
    }
    for (file, bytes) in pristine {
        if let Some(parent) = file.parent() {
            std::fs::create_dir_all(parent).expect("recreate a directory");
        }
        std::fs::write(file, bytes).expect("restore a store file");
    }
}

/// Damages the store of `store_type` in many ways and runs ADD, DEL and CHECK on each: every call
/// succeeds or answers a clear CNI error, and none panics or hangs.
fn damaged_store_never_panics(store_type: DatastoreType) {
    let target = Target::Embedded(Sandbox::with_store(store_type));
    let fixture = populate(&target);
    let sandbox = target.sandbox();
    let root = sandbox.store_path();
    let pristine: BTreeMap<PathBuf, Vec<u8>> = files_under(&root)
        .into_iter()
        .map(|f| {
            let bytes = std::fs::read(&f).expect("read a store file");
            (f, bytes)
        })
        .collect();
    let file = data_file(sandbox);
    let list = damages(&pristine[&file]);
    // Spec 1.0.0 as the fixture's ADDs (CHECK compares with what c1 was given then).
    let netconf = sandbox.netconf("1.0.0", json!({"assign_ipv6": true}));
    let calls: [(&str, &str); 3] = [("ADD", "newcomer"), ("DEL", "c2"), ("CHECK", "c1")];
    let mut failures = Vec::new();
    let mut answered = BTreeMap::<String, usize>::new();
    for damage in &list {
        for (command, container) in calls {
            restore(&root, &pristine);
            apply(damage, &file);
            let env = cni_env(command, container, "eth0")
                .into_iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v)))
                .collect();
            let mut netconf = netconf.clone();
            if command == "CHECK" {
                let Some(object) = netconf.as_object_mut() else {
                    unreachable!("a netconf is an object")
                };
                object.insert("prevResult".into(), fixture.c1_result.clone());
            }
            let call = run_plugin(&env, netconf.to_string().as_bytes());
            let outcome = if call.status == Some(0) && !call.hung {
                if call.stderr.contains(UNCAUGHT_PANIC) {
                    failures.push(format!("{damage:?} {command}: panicked: {}", call.stderr));
                }
                if command == "ADD" {
                    let given = serde_json::from_str::<Value>(&call.stdout)
                        .map(|result| addresses(&result))
                        .unwrap_or_default();
                    let taken: Vec<&String> =
                        given.iter().filter(|a| fixture.held.contains(a)).collect();
                    if given.is_empty() || !taken.is_empty() {
                        failures.push(format!(
                            "{damage:?} ADD: the damage went unnoticed and the new container \
                             got {given:?}, of which {taken:?} are held by the fixture's containers"
                        ));
                    }
                }
                "success".to_owned()
            } else {
                let mut problems = error_answer_problems(&call, None);
                let code = serde_json::from_str::<Value>(&call.stdout)
                    .ok()
                    .and_then(|v| v["code"].as_u64());
                // A damage is reported as one (108), or as the record CHECK compares having
                // changed (107): nothing else.
                let expected = code == Some(108) || (command == "CHECK" && code == Some(107));
                if code.is_some() && !expected {
                    problems.push(format!(
                        "code {code:?}, expected 108 (or 107 for CHECK): {}",
                        call.stdout.trim()
                    ));
                }
                if !problems.is_empty() {
                    failures.push(format!("{damage:?} {command}: {}", problems.join("; ")));
                }
                code.map(|code| format!("code {code}"))
                    .unwrap_or_else(|| "no answer".into())
            };
            *answered.entry(outcome).or_default() += 1;
        }
    }
    println!(
        "{}: {} damages x {} commands: {answered:?}",
        store_type.as_str(),
        list.len(),
        calls.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} calls on a damaged {} store misbehaved:\n{}",
        failures.len(),
        list.len() * calls.len(),
        store_type.as_str(),
        failures.join("\n")
    );
}

/// Damages the data file while plugin calls are running on it (ADD of a new container, at a
/// varying moment of each call): each call still answers, successfully or with a CNI error, and
/// none panics or hangs.
fn store_damaged_under_a_running_plugin_never_panics(store_type: DatastoreType) {
    const CALLS: u64 = 30;
    let target = Target::Embedded(Sandbox::with_store(store_type));
    populate(&target);
    let sandbox = target.sandbox();
    let root = sandbox.store_path();
    let pristine: BTreeMap<PathBuf, Vec<u8>> = files_under(&root)
        .into_iter()
        .map(|f| {
            let bytes = std::fs::read(&f).expect("read a store file");
            (f, bytes)
        })
        .collect();
    let file = data_file(sandbox);
    let len = pristine[&file].len() as u64;
    let netconf = sandbox.netconf("1.0.0", json!({}));
    let mut failures = Vec::new();
    let mut answered = BTreeMap::<String, usize>::new();
    for i in 0..CALLS {
        restore(&root, &pristine);
        // Deterministic variety: the damage, and how long after the start it lands.
        let damage = if i % 3 == 0 {
            Damage::TruncateTo(len * (i % 7) / 7)
        } else {
            Damage::FlipBit {
                offset: (i * 7919 * 64) % len,
                bit: (i % 8) as u8,
            }
        };
        let delay = Duration::from_micros(500 * (i % 12));
        let env: BTreeMap<OsString, OsString> = cni_env("ADD", &format!("racer{i}"), "eth0")
            .into_iter()
            .map(|(k, v)| (OsString::from(k), OsString::from(v)))
            .collect();
        let stdin = netconf.to_string().into_bytes();
        let call = std::thread::scope(|scope| {
            let running = scope.spawn(|| run_plugin(&env, &stdin));
            std::thread::sleep(delay);
            apply(&damage, &file);
            running.join().expect("the plugin runner")
        });
        let outcome = if call.status == Some(0) && !call.hung {
            if call.stderr.contains(UNCAUGHT_PANIC) {
                failures.push(format!(
                    "{damage:?} after {delay:?}: panicked: {}",
                    call.stderr
                ));
            }
            "success".to_owned()
        } else {
            let problems = error_answer_problems(&call, None);
            if !problems.is_empty() {
                failures.push(format!(
                    "{damage:?} after {delay:?}: {}",
                    problems.join("; ")
                ));
            }
            serde_json::from_str::<Value>(&call.stdout)
                .ok()
                .and_then(|v| v["code"].as_u64())
                .map(|code| format!("code {code}"))
                .unwrap_or_else(|| "no answer".into())
        };
        *answered.entry(outcome).or_default() += 1;
    }
    println!(
        "{}: {CALLS} calls damaged while running: {answered:?}",
        store_type.as_str()
    );
    assert!(
        failures.is_empty(),
        "{} of {CALLS} calls on a {} store damaged under them misbehaved:\n{}",
        failures.len(),
        store_type.as_str(),
        failures.join("\n")
    );
}

#[test]
fn sled_store_damaged_under_a_running_plugin_gives_an_answer_or_a_clear_error() {
    store_damaged_under_a_running_plugin_never_panics(DatastoreType::Sled);
}

#[test]
fn redb_store_damaged_under_a_running_plugin_gives_an_answer_or_a_clear_error() {
    store_damaged_under_a_running_plugin_never_panics(DatastoreType::Redb);
}

#[test]
fn truncated_or_bit_flipped_sled_store_gives_an_answer_or_a_clear_error_never_a_panic() {
    damaged_store_never_panics(DatastoreType::Sled);
}

#[test]
fn truncated_or_bit_flipped_redb_store_gives_an_answer_or_a_clear_error_never_a_panic() {
    damaged_store_never_panics(DatastoreType::Redb);
}

// ---------------------------------------------------------------------------------------------
// The fuzz targets' seeds, replayed
// ---------------------------------------------------------------------------------------------

/// Every file in `fuzz/seeds/<target>` and, when present, `fuzz/corpus/<target>`.
fn fuzz_inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut inputs = Vec::new();
    for dir in ["seeds", "corpus"] {
        let dir = fuzz.join(dir).join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            assert!(
                dir.ends_with(format!("corpus/{target}")),
                "no seeds in {}",
                dir.display()
            );
            continue;
        };
        for entry in entries {
            let path = entry.expect("directory entry").path();
            let bytes = std::fs::read(&path).expect("read a fuzz input");
            inputs.push((path, bytes));
        }
    }
    inputs
}

fn decodes_consistently<T>(bytes: &[u8]) -> bool
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug + 'static,
{
    let Ok(value) = ipam_core::model::decode::<T>("fuzz", bytes) else {
        return false;
    };
    let encoded = ipam_core::model::encode(&value).expect("a decoded object encodes");
    let again: T = ipam_core::model::decode("fuzz", &encoded).expect("re-encoded bytes decode");
    assert_eq!(again, value);
    true
}

/// What the `stored_objects` fuzz target checks of a claim index entry: the allocator's reader
/// takes it (any format) or refuses it without a panic; one in this build's format reads the same
/// as a `Claim` and encodes back to it. Whether it was taken.
fn claim_decodes_consistently(bytes: &[u8]) -> bool {
    use ipam_core::model::{decode_claim, Claim, ClaimEntry, FORMAT_VERSION};
    let entry_of = |claim: Claim| ClaimEntry {
        affinity: claim.affinity,
        free: Some(claim.free),
        emptied_at: claim.emptied_at,
        last_cooling_release: claim.last_cooling_release,
    };
    let Ok(entry) = decode_claim("fuzz", bytes) else {
        return false;
    };
    if bytes.first() == Some(&FORMAT_VERSION) {
        assert!(decodes_consistently::<Claim>(bytes), "{entry:?}");
        let claim: Claim = ipam_core::model::decode("fuzz", bytes).expect("decoded above");
        assert_eq!(entry, entry_of(claim));
    }
    true
}

/// Set to 1 to rewrite `fuzz/seeds/stored_objects` from typical objects in the current encoding
/// (after a change of the stored format), before the replay.
const WRITE_SEEDS_ENV: &str = "BLOCKIPAM_WRITE_FUZZ_SEEDS";

/// Typical stored objects, each as the `stored_objects` fuzz target reads it: one byte naming the
/// type (0 block, 1 handle, 2 pool, 3 IPAM config, 4 block claim entry, 5 pool generation, 6 an
/// owner key's attribute), then the value as the store holds it.
fn stored_object_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use ipam_core::model::{encode, Attribute, Block, Claim, Handle, IpamConfig, Pool};
    let net = |text: &str| text.parse::<ipnet::IpNet>().expect("a CIDR");
    let attribute = |handle: &str, interface: &str| Attribute {
        handle: handle.to_owned(),
        metadata: [
            ("node", "node-a"),
            ("interface", interface),
            ("container_id", "0123456789abcdef"),
            ("pod", "web-0"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect(),
    };
    let mut affine = Block::new(net("10.244.7.0/26"), Some("node-a".into()), 7);
    affine.allocate_next(&attribute("testnet.c1", "eth0"));
    affine.allocate_next(&attribute("testnet.c2", "eth0"));
    affine.allocate_next(&attribute("testnet.c2", "net1"));
    affine
        .release_ordinal(1, ipam_core::Lifetime::default())
        .expect("inline");
    let mut unaffine = Block::new(net("fd00:10:244::/122"), None, 0);
    unaffine.allocate_next(&attribute("testnet.c1", "eth0"));
    let mut handle = Handle::default();
    handle.add(net("10.244.7.0/26"), 2);
    handle.add(net("fd00:10:244::/122"), 1);
    // Format 6: a block keeping its new allocations' attributes apart, one written before inline,
    // and the handle recording the metadata of what it holds apart.
    let mut apart: Block =
        ipam_core::model::decode("seed", &encode(&affine).expect("encode a seed block"))
            .expect("decode a seed block");
    apart.allocate_next(&attribute("testnet.c3", "eth0"));
    apart.allocate_next(&attribute("testnet.c4", "eth0"));
    let moved = apart.move_taken_apart();
    let mut handle_apart = Handle::default();
    for (ordinal, held) in &moved {
        handle_apart.hold(apart.cidr, *ordinal, Some(&held.metadata));
    }
    let pool = |name: &str, cidr: &str, block_size: u8, disabled: bool| Pool {
        name: name.to_owned(),
        cidr: net(cidr),
        block_size,
        disabled,
        ..Pool::default()
    };
    let claim = |affinity: Option<&str>, free: u32, emptied_at: Option<u64>| Claim {
        affinity: affinity.map(str::to_owned),
        free,
        emptied_at,
        last_cooling_release: None,
    };
    // A claim entry as format 1 wrote it: the affine host alone (the same body encoding).
    let format_1 = |mut seed: Vec<u8>| {
        seed[1] = 1;
        seed
    };
    let seed = |kind: u8, bytes: Result<Vec<u8>, ipam_core::IpamError>| {
        let mut out = vec![kind];
        out.extend(bytes.expect("encode a seed"));
        out
    };
    vec![
        ("block-affine", seed(0, encode(&affine))),
        ("block-v6-unaffine", seed(0, encode(&unaffine))),
        (
            "block-empty",
            seed(0, encode(&Block::new(net("10.0.0.0/31"), None, 0))),
        ),
        ("handle", seed(1, encode(&handle))),
        ("block-apart", seed(0, encode(&apart))),
        ("handle-apart", seed(1, encode(&handle_apart))),
        ("owner-key", seed(6, encode(&moved[0].1))),
        (
            "pool-v4",
            seed(2, encode(&pool("test-v4", "10.244.7.0/24", 26, false))),
        ),
        (
            "pool-v6",
            seed(2, encode(&pool("test-v6", "fd00:10:244::/120", 122, true))),
        ),
        ("config", seed(3, encode(&IpamConfig::default()))),
        ("claim", seed(4, encode(&claim(Some("node-a"), 61, None)))),
        (
            "claim-empty",
            seed(4, encode(&claim(None, 64, Some(1_764_000_000)))),
        ),
        (
            "claim-v1-affine",
            format_1(seed(4, encode(&Some("node-a".to_owned())))),
        ),
        ("claim-v1-none", format_1(seed(4, encode(&None::<String>)))),
        ("pool-generation", seed(5, encode(&42u64))),
    ]
}

#[test]
fn fuzz_seeds_and_corpus_replay_without_panic() {
    use ipam_core::model::{Block, Handle, IpamConfig, Pool};
    if std::env::var_os(WRITE_SEEDS_ENV).is_some_and(|v| v == "1") {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/stored_objects");
        std::fs::create_dir_all(&dir).expect("create the seed directory");
        for (name, bytes) in stored_object_seeds() {
            std::fs::write(dir.join(name), bytes).expect("write a seed");
        }
    }
    // A seed must be accepted, unless it records an input that once broke a target
    // (`regression-*`); whatever is accepted must satisfy the target's checks.
    let must_accept = |path: &Path| {
        path.to_string_lossy().contains("/seeds/")
            && !path.to_string_lossy().contains("/regression-")
    };
    let netconf = fuzz_inputs("netconf");
    let mut refused = Vec::new();
    for (path, bytes) in &netconf {
        let parsed = blockipam::netconf::parse_header(bytes).and_then(|(value, name, version)| {
            blockipam::netconf::parse_netconf(&value, name, version)
        });
        match parsed {
            Ok(conf) => {
                assert!(
                    blockipam::netconf::is_valid_cni_name(&conf.name) && !conf.timeout.is_zero(),
                    "{}: accepted as {conf:?}",
                    path.display()
                );
            }
            Err(_) if must_accept(path) => refused.push(path.display().to_string()),
            Err(_) => {}
        }
    }
    let args = fuzz_inputs("cni_args");
    for (path, bytes) in &args {
        let parsed = blockipam::args::parse_cni_args(&String::from_utf8_lossy(bytes));
        if parsed.is_err() && must_accept(path) {
            refused.push(path.display().to_string());
        }
    }
    // Stored objects: whatever decodes must round-trip, and nothing panics.
    let objects = fuzz_inputs("stored_objects");
    let mut decoded = 0;
    for (path, bytes) in &objects {
        let Some((&kind, body)) = bytes.split_first() else {
            continue;
        };
        let ok = match kind % 7 {
            0 => {
                if let Ok(block) = ipam_core::model::decode::<Block>("fuzz", body) {
                    let _ = block.self_check();
                }
                decodes_consistently::<Block>(body)
            }
            1 => decodes_consistently::<Handle>(body),
            2 => decodes_consistently::<Pool>(body),
            3 => decodes_consistently::<IpamConfig>(body),
            4 => claim_decodes_consistently(body),
            5 => decodes_consistently::<u64>(body),
            _ => decodes_consistently::<ipam_core::model::Attribute>(body),
        };
        decoded += usize::from(ok);
        // The seeds are objects as some format wrote them, and every format is still read.
        if !ok && must_accept(path) {
            refused.push(path.display().to_string());
        }
    }
    println!(
        "replayed {} netconf, {} CNI_ARGS and {} stored-object inputs ({decoded} decoded)",
        netconf.len(),
        args.len(),
        objects.len()
    );
    assert!(
        netconf.len() >= 4 && args.len() >= 4 && objects.len() >= 10,
        "the committed fuzz seeds are missing"
    );
    assert!(refused.is_empty(), "committed seeds refused: {refused:?}");
}
