//! `install-cni` through the real binary: the plugin copied byte for byte and executable, the
//! conflist written 0600 and usable by the real plugin, second runs that change nothing, readers
//! that never see a partial file, and bad input that writes nothing.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use test_kit::cni::run_cni;

use crate::common::{call_plugin_binary, run_guarded, Backend, Lab, Run, BIN, CTL_ENV};

/// Variables `install-cni` reads besides blockipamctl's own: removed from every child.
const INSTALL_ENV: &[&str] = &[
    "CNI_BIN_DIR",
    "CNI_NET_DIR",
    "CNI_CONF_NAME",
    "CNI_NETWORK_CONFIG",
    "CNI_NETWORK_CONFIG_FILE",
    "BLOCKIPAM_NETWORK_NAME",
    "BLOCKIPAM_MAIN_PLUGIN",
    "BLOCKIPAM_CNI_VERSION",
    "BLOCKIPAM_IPAM_CONFIG",
    "BLOCKIPAM_AGENT_SOCKET",
    "NODENAME",
    "KUBERNETES_NODE_NAME",
];

const HANG_GUARD: Duration = Duration::from_secs(120);

/// A host's CNI directories in a temporary directory, and the plugin to install.
struct Host {
    dir: tempfile::TempDir,
    plugin: PathBuf,
}

impl Host {
    fn new() -> Host {
        let dir = tempfile::Builder::new()
            .prefix("blockipam-install-cni-")
            .tempdir()
            .expect("a temporary directory");
        fs::create_dir(dir.path().join("bin")).expect("bin dir");
        fs::create_dir(dir.path().join("net.d")).expect("net.d dir");
        Host {
            dir,
            plugin: test_kit::plugin::build_plugin_beside(Path::new(BIN)),
        }
    }

    fn bin_dir(&self) -> PathBuf {
        self.dir.path().join("bin")
    }

    fn conf_dir(&self) -> PathBuf {
        self.dir.path().join("net.d")
    }

    fn installed_plugin(&self) -> PathBuf {
        self.bin_dir().join("blockipam")
    }

    fn conflist(&self) -> PathBuf {
        self.conf_dir().join("10-blockipam.conflist")
    }

    /// `install-cni` with the directories and `args`, `--plugin` unless `args` names one.
    fn install(&self, args: &[&str], env: &[(&str, &str)]) -> Run {
        let mut full: Vec<String> = vec!["install-cni".into(), "--bin-dir".into()];
        full.push(self.bin_dir().display().to_string());
        full.push("--conf-dir".into());
        full.push(self.conf_dir().display().to_string());
        if !args.contains(&"--plugin") {
            full.push("--plugin".into());
            full.push(self.plugin.display().to_string());
        }
        full.extend(args.iter().map(|a| (*a).to_owned()));
        let mut command = Command::new(BIN);
        command.args(&full);
        for name in CTL_ENV.iter().chain(INSTALL_ENV) {
            command.env_remove(name);
        }
        for (name, value) in env {
            command.env(name, value);
        }
        run_guarded(command, &full)
    }

    /// Every file name in both directories.
    fn entries(&self) -> Vec<String> {
        let mut names: Vec<String> = [self.bin_dir(), self.conf_dir()]
            .iter()
            .flat_map(|dir| fs::read_dir(dir).expect("read dir"))
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn read_conflist(&self) -> Value {
        serde_json::from_slice(&fs::read(self.conflist()).expect("the conflist")).expect("JSON")
    }
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).expect("metadata").permissions().mode() & 0o7777
}

/// (mtime in ns, inode) of a file: unchanged when nothing rewrote it.
fn stamp(path: &Path) -> (i64, i64, u64) {
    let meta = fs::metadata(path).expect("metadata");
    (meta.mtime(), meta.mtime_nsec(), meta.ino())
}

/// Runs `plugin` once for `command` with the netconf the main plugin of `conflist` would pass.
fn call_plugin(plugin: &Path, conflist: &Value, command: &str, container: &str) -> (i32, Value) {
    let mut netconf = conflist["plugins"][0].clone();
    netconf["name"] = conflist["name"].clone();
    netconf["cniVersion"] = conflist["cniVersion"].clone();
    call_plugin_binary(plugin, command, container, None, &netconf)
}

#[test]
fn install_cni_copies_an_executable_plugin_and_writes_a_conflist_the_plugin_runs_with() {
    let host = Host::new();
    let lab = Lab::new(Backend::Sled);
    lab.ctl(&["pool", "add", "10.244.0.0/16"]).ok();
    let store = lab.path().display().to_string();
    let lock = lab.dir.path().join("ipam.lock").display().to_string();
    let ipam = json!({ "ipam_lock_file": lock }).to_string();
    let run = host.install(
        &[
            "-o",
            "json",
            "--datastore-type",
            "sled",
            "--datastore-path",
            &store,
            "--agent-socket",
            "none",
            "--node",
            "node-a",
            "--ipam-config",
            &ipam,
        ],
        &[],
    );
    let doc = run.ok().json();
    assert_eq!(doc["plugin"]["changed"], true, "{doc}");
    assert_eq!(doc["conflist"]["changed"], true, "{doc}");
    let installed = host.installed_plugin();
    assert_eq!(
        fs::read(&installed).expect("installed plugin"),
        fs::read(&host.plugin).expect("source plugin"),
        "the installed plugin is not byte-identical"
    );
    assert_eq!(mode(&installed), 0o755);
    assert_eq!(mode(&host.conflist()), 0o600);
    assert_eq!(
        host.entries(),
        ["10-blockipam.conflist", "blockipam"],
        "only the two files, no temporary file left"
    );

    // The installed plugin answers VERSION through the CNI protocol.
    let version = run_cni(
        &installed,
        &[],
        &[("CNI_COMMAND".to_owned(), "VERSION".to_owned())],
        b"",
        HANG_GUARD,
    );
    assert_eq!(version.status, 0, "{}", version.stderr);
    let version: Value = serde_json::from_str(&version.stdout).expect("VERSION JSON");
    assert!(
        version["supportedVersions"]
            .as_array()
            .is_some_and(|v| v.contains(&json!("1.0.0"))),
        "{version}"
    );

    // The conflist is what was asked, and the plugin allocates and releases with it.
    let conflist = host.read_conflist();
    assert_eq!(conflist["name"], "pods");
    assert_eq!(conflist["plugins"][0]["type"], "ptp");
    let section = &conflist["plugins"][0]["ipam"];
    assert_eq!(section["type"], "blockipam");
    assert_eq!(section["datastore_type"], "sled");
    assert_eq!(section["datastore_path"], store.as_str());
    assert_eq!(section["nodename"], "node-a");
    assert_eq!(section["agent_socket"], "none");
    let (status, result) = call_plugin(&installed, &conflist, "ADD", "c1");
    assert_eq!(status, 0, "ADD: {result}");
    let address = result["ips"][0]["address"]
        .as_str()
        .expect("an address")
        .split('/')
        .next()
        .expect("an IP")
        .to_owned();
    assert!(address.starts_with("10.244."), "{result}");
    let shown = lab
        .ctl(&["-o", "json", "show", "--ip", &address])
        .ok()
        .json();
    assert_eq!(shown["allocated"], true, "{shown}");
    assert_eq!(shown["block_host"], "node-a", "{shown}");
    assert_eq!(shown["handle"], "pods.c1", "{shown}");
    let (status, result) = call_plugin(&installed, &conflist, "DEL", "c1");
    assert_eq!(status, 0, "DEL: {result}");
    let shown = lab
        .ctl(&["-o", "json", "show", "--ip", &address])
        .ok()
        .json();
    assert_eq!(shown["allocated"], false, "{shown}");
}

#[test]
fn install_cni_a_second_run_with_the_same_input_changes_nothing() {
    let host = Host::new();
    let args = [
        "--datastore-path",
        "/var/lib/blockipam/pods.sled",
        "--node",
        "n1",
    ];
    host.install(&args, &[]).ok();
    let before = (stamp(&host.installed_plugin()), stamp(&host.conflist()));
    // Coarse file-system clocks would hide a rewrite made within the same tick.
    std::thread::sleep(Duration::from_millis(20));
    let doc = host
        .install(&[&["-o", "json"][..], &args].concat(), &[])
        .ok()
        .json();
    assert_eq!(doc["plugin"]["changed"], false, "{doc}");
    assert_eq!(doc["conflist"]["changed"], false, "{doc}");
    let after = (stamp(&host.installed_plugin()), stamp(&host.conflist()));
    assert_eq!(before, after, "a no-op run rewrote a file");
    host.install(&args, &[]).ok().stdout_has("is up to date");
}

#[test]
fn install_cni_a_changed_input_rewrites_only_the_conflist() {
    let host = Host::new();
    host.install(&["--node", "n1"], &[]).ok();
    let plugin_before = stamp(&host.installed_plugin());
    let doc = host
        .install(&["-o", "json"], &[("NODENAME", "n2")])
        .ok()
        .json();
    assert_eq!(doc["plugin"]["changed"], false, "{doc}");
    assert_eq!(doc["conflist"]["changed"], true, "{doc}");
    assert_eq!(stamp(&host.installed_plugin()), plugin_before);
    assert_eq!(host.read_conflist()["plugins"][0]["ipam"]["nodename"], "n2");
    // A conflist someone made world-readable is put back to 0600.
    fs::set_permissions(host.conflist(), fs::Permissions::from_mode(0o644)).expect("chmod");
    let doc = host
        .install(&["-o", "json"], &[("NODENAME", "n2")])
        .ok()
        .json();
    assert_eq!(doc["conflist"]["changed"], true, "{doc}");
    assert_eq!(mode(&host.conflist()), 0o600);
    assert_eq!(host.entries(), ["10-blockipam.conflist", "blockipam"]);
}

/// The generated conflist's main plugin and network name are the ones given (flag or variable),
/// with every character either allows; bad ones are in the bad-input test.
#[test]
fn install_cni_generates_the_main_plugin_and_network_name_given() {
    let host = Host::new();
    host.install(
        &["--node", "n1", "--main-plugin", "my_bridge-2.0"],
        &[("BLOCKIPAM_NETWORK_NAME", "k8s-pod_net.1")],
    )
    .ok();
    let conflist = host.read_conflist();
    assert_eq!(
        conflist["plugins"][0]["type"], "my_bridge-2.0",
        "{conflist}"
    );
    assert_eq!(conflist["name"], "k8s-pod_net.1", "{conflist}");
    host.install(
        &["--node", "n1", "--network-name", "pods2"],
        &[("BLOCKIPAM_MAIN_PLUGIN", "bridge")],
    )
    .ok();
    let conflist = host.read_conflist();
    assert_eq!(conflist["plugins"][0]["type"], "bridge", "{conflist}");
    assert_eq!(conflist["name"], "pods2", "{conflist}");
}

/// While installs alternate between two different plugins (each run replaces the file), a
/// reader that keeps opening the target sees nothing or one whole plugin, never a part.
#[test]
fn install_cni_a_concurrent_reader_never_sees_a_partial_plugin() {
    let host = Host::new();
    let first = fs::read(&host.plugin).expect("plugin");
    let mut second = first.clone();
    second.extend(std::iter::repeat_n(0u8, 8 << 20));
    let second_path = host.dir.path().join("padded-plugin");
    fs::write(&second_path, &second).expect("write the padded plugin");
    let target = host.installed_plugin();
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let (done, target) = (Arc::clone(&done), target.clone());
        let (first, second) = (first.clone(), second.clone());
        std::thread::spawn(move || {
            let (mut reads, mut partial) = (0u64, 0u64);
            while !done.load(Ordering::Relaxed) {
                match fs::read(&target) {
                    Ok(bytes) => {
                        reads += 1;
                        if bytes != first && bytes != second {
                            partial += 1;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => panic!("reading {}: {e}", target.display()),
                }
            }
            (reads, partial)
        })
    };
    let sources = [host.plugin.clone(), second_path];
    for round in 0..8 {
        let source = sources[round % 2].display().to_string();
        let doc = host
            .install(&["-o", "json", "--plugin", &source], &[])
            .ok()
            .json();
        assert_eq!(doc["plugin"]["changed"], true, "round {round}: {doc}");
    }
    done.store(true, Ordering::Relaxed);
    let (reads, partial) = reader.join().expect("the reader");
    assert!(reads > 0, "the reader never saw the plugin");
    assert_eq!(
        partial, 0,
        "{partial} of {reads} reads saw a partial plugin"
    );
    assert_eq!(host.entries(), ["10-blockipam.conflist", "blockipam"]);
}

#[test]
fn install_cni_a_template_gets_the_store_and_node_settings() {
    let host = Host::new();
    let template = json!({
        "cniVersion": "1.0.0",
        "name": "k8s-pods",
        "plugins": [
            {"type": "bridge", "bridge": "cni0", "ipam": {
                "type": "blockipam",
                "datastore_path": "/template/store.sled",
                "gateway": "10.244.0.1",
                "log_file_path": "/var/log/__KUBERNETES_NODE_NAME__.log"
            }},
            {"type": "portmap", "capabilities": {"portMappings": true}}
        ]
    })
    .to_string();
    let file = host.dir.path().join("template.json");
    fs::write(&file, &template).expect("write the template");
    let file_text = file.display().to_string();
    host.install(
        &["--network-config-file", &file_text],
        &[
            ("KUBERNETES_NODE_NAME", "worker-1"),
            ("ETCD_ENDPOINTS", "https://10.0.0.10:2379"),
            ("ETCD_CA_CERT_FILE", "/etc/blockipam/ca.pem"),
            ("ETCD_USERNAME", "blockipam"),
            ("ETCD_PASSWORD", "s3cret"),
        ],
    )
    .ok();
    let conflist = host.read_conflist();
    assert_eq!(conflist["name"], "k8s-pods");
    assert_eq!(conflist["plugins"][1]["type"], "portmap");
    let section = &conflist["plugins"][0]["ipam"];
    assert_eq!(section["datastore_type"], "etcdv3");
    assert_eq!(section["etcd_endpoints"], "https://10.0.0.10:2379");
    assert_eq!(section["etcd_ca_cert_file"], "/etc/blockipam/ca.pem");
    assert_eq!(section["etcd_username"], "blockipam");
    assert_eq!(section["etcd_password"], "s3cret");
    assert_eq!(
        section.get("datastore_path"),
        None,
        "the template's store keys are replaced as a whole: {section}"
    );
    assert_eq!(section["gateway"], "10.244.0.1");
    assert_eq!(section["nodename"], "worker-1");
    assert_eq!(section["log_file_path"], "/var/log/worker-1.log");
    assert_eq!(
        mode(&host.conflist()),
        0o600,
        "a conflist holding a password"
    );
    // Without store settings, the template's store stands.
    host.install(
        &[],
        &[("CNI_NETWORK_CONFIG", &template), ("NODENAME", "w2")],
    )
    .ok();
    let section = &host.read_conflist()["plugins"][0]["ipam"];
    assert_eq!(section["datastore_path"], "/template/store.sled");
    assert_eq!(section.get("datastore_type"), None, "{section}");
}

/// The lock wait goes into the conflist only when given, by the flag or the variable alone: whole
/// seconds as an integer, a fraction as a number with its fraction.
#[test]
fn install_cni_writes_the_lock_wait_only_when_given() {
    let host = Host::new();
    let lock_wait = |args: &[&str], env: &[(&str, &str)]| {
        host.install(args, env).ok();
        host.read_conflist()["plugins"][0]["ipam"]
            .get("ipam_lock_timeout_seconds")
            .cloned()
    };
    assert_eq!(lock_wait(&[], &[]), None);
    let whole = lock_wait(&["--lock-wait-seconds", "30"], &[]).expect("written");
    assert_eq!(whole.as_u64(), Some(30), "{whole}");
    let fraction = lock_wait(&[], &[("BLOCKIPAM_LOCK_WAIT_SECONDS", "2.5")]).expect("written");
    assert!(fraction.is_f64(), "{fraction}");
    assert_eq!(fraction.as_f64(), Some(2.5));
}

/// Arguments, environment, and a word the error line must hold.
type BadInput<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);

#[test]
fn install_cni_bad_input_is_refused_and_writes_nothing() {
    let host = Host::new();
    let no_blockipam =
        json!({"cniVersion": "1.0.0", "name": "n", "plugins": [{"type": "ptp", "ipam": {"type": "host-local"}}]})
            .to_string();
    let bad_name =
        json!({"cniVersion": "1.0.0", "name": "bad name", "plugins": [{"type": "ptp", "ipam": {"type": "blockipam"}}]})
            .to_string();
    let placeholder_without_node = json!({"cniVersion": "1.0.0", "name": "n", "plugins": [{"type": "ptp", "ipam": {"type": "blockipam", "nodename": "__KUBERNETES_NODE_NAME__"}}]}).to_string();
    let cases: Vec<BadInput> = vec![
        (
            vec![],
            vec![("CNI_NETWORK_CONFIG", "{not json")],
            "not JSON",
        ),
        (
            vec![],
            vec![("CNI_NETWORK_CONFIG", "{\"name\":\"n\"}")],
            "cniVersion",
        ),
        (
            vec![],
            vec![("CNI_NETWORK_CONFIG", &no_blockipam)],
            "blockipam",
        ),
        (
            vec![],
            vec![("CNI_NETWORK_CONFIG", &bad_name)],
            "network name",
        ),
        (
            vec![],
            vec![("CNI_NETWORK_CONFIG", &placeholder_without_node)],
            "__KUBERNETES_NODE_NAME__",
        ),
        (
            vec!["--main-plugin", "bridge"],
            vec![("CNI_NETWORK_CONFIG", &no_blockipam)],
            "template",
        ),
        (
            vec!["--network-config-file", "/nonexistent/template.json"],
            vec![("CNI_NETWORK_CONFIG", &no_blockipam)],
            "give one",
        ),
        (vec!["--conf-name", "../x.conflist"], vec![], "--conf-name"),
        (
            vec!["--conf-name", "10-blockipam.conf"],
            vec![],
            "--conf-name",
        ),
        (
            vec!["--conf-name", "sub/10-blockipam.conflist"],
            vec![],
            "--conf-name",
        ),
        (
            vec![],
            vec![("CNI_CONF_NAME", ".10-blockipam.conflist")],
            "CNI_CONF_NAME",
        ),
        (vec!["--network-name", "a b"], vec![], "--network-name"),
        (vec!["--main-plugin", ""], vec![], "--main-plugin"),
        (
            vec![],
            vec![("BLOCKIPAM_MAIN_PLUGIN", "a/b")],
            "BLOCKIPAM_MAIN_PLUGIN",
        ),
        (vec!["--cni-version", "0.2.0"], vec![], "cniVersion"),
        (vec!["--ipam-config", "[1]"], vec![], "--ipam-config"),
        (
            vec!["--ipam-config", "{\"type\": \"host-local\"}"],
            vec![],
            "type",
        ),
        (
            vec![],
            vec![
                ("ETCD_ENDPOINTS", "127.0.0.1:1"),
                ("DATASTORE_TYPE", "sled"),
            ],
            "ETCD_ENDPOINTS",
        ),
        // What opening the store would refuse (the plugin would fail every ADD), but for the
        // TLS files, which are the node's paths.
        (
            vec![],
            vec![("ETCD_ENDPOINTS", "127.0.0.1:1"), ("ETCD_PREFIX", "x")],
            "must end with '/'",
        ),
        (
            vec![],
            vec![("ETCD_ENDPOINTS", "ftp://127.0.0.1:1")],
            "unsupported scheme",
        ),
        (
            vec![],
            vec![("ETCD_ENDPOINTS", "https://127.0.0.1:1")],
            "needs ca_cert_file",
        ),
        (vec!["--node", " "], vec![], "--node"),
        (vec!["--node", "worker 1"], vec![], "whitespace"),
        (vec![], vec![("NODENAME", "worker\u{1}")], "control"),
        (vec!["--node", "-"], vec![], "pseudo-node"),
        (vec![], vec![("NODENAME", "a/b")], "may not contain '/'"),
        (
            vec![],
            vec![
                ("CNI_NETWORK_CONFIG", &placeholder_without_node),
                ("KUBERNETES_NODE_NAME", "-"),
            ],
            "pseudo-node",
        ),
    ];
    for (args, env, needle) in cases {
        let run = host.install(&args, &env);
        run.expect_code(2);
        let line = run.error_line();
        assert!(line.contains(needle), "{args:?} {env:?}: {line}");
        assert!(
            host.entries().is_empty(),
            "{args:?} {env:?} wrote {:?}",
            host.entries()
        );
    }
    // Failures (exit 1): a missing plugin, a missing directory; nothing written either.
    let missing = host.dir.path().join("no-such-plugin").display().to_string();
    let run = host.install(&["--plugin", &missing], &[]);
    run.expect_code(1);
    assert!(
        run.error_line().contains("no-such-plugin"),
        "{}",
        run.stderr
    );
    fs::remove_dir(host.conf_dir()).expect("remove net.d");
    let run = host.install(&[], &[]);
    run.expect_code(1);
    assert!(run.error_line().contains("--conf-dir"), "{}", run.stderr);
    let left: Vec<_> = fs::read_dir(host.bin_dir()).expect("bin").collect();
    assert!(
        left.is_empty(),
        "the plugin was installed without its conflist directory"
    );
}
