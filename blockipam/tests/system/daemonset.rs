//! The DaemonSet of `deploy/kubernetes/` run the kubelet's way under containerd's CRI: install, pods, rolling update.
//!
//! No API server runs here, so the test does what the kubelet does with the DaemonSet's pod on one
//! node. It reads `deploy/kubernetes/blockipam-single-node.yaml` (serde_yaml) and takes everything
//! from it: each container's image, command, args and environment (`value`, and `valueFrom` resolved
//! as the kubelet does: `fieldRef spec.nodeName` is the test's node, `configMapKeyRef` and
//! `secretKeyRef` the ConfigMap and Secret of the same file), its volume mounts and the hostPath
//! volumes, the probes. It imports the image `scripts/build-image` made (`BLOCKIPAM_IMAGE_ARCHIVE`,
//! an OCI archive) into its own containerd 1.6 ([`crate::containerd`]), runs the pod's sandbox with
//! the node's network, the init container `install-cni` to its exit 0, then the agent container
//! until the readiness probe of the manifest answers 200 (through the node's network, as the
//! kubelet probes).
//!
//! The manifest's host paths (`/opt/cni/bin`, `/etc/cni/net.d`, `/run/blockipam`,
//! `/var/lib/blockipam`) and `/var/lib/cni` are used verbatim: containerd runs in a private mount
//! namespace where the test's own directories are bound over them, so containerd, the containers
//! and the plugin containerd runs see the test's directories there and the machine's own stay
//! untouched. containerd's CNI directories are those host paths: ordinary pod sandboxes get their
//! network from the conflist the init container wrote, through the plugin it installed (beside
//! Debian's `ptp` and `loopback`, put there by the test), and their addresses from the agent the
//! DaemonSet runs (its metrics count the plugin's connections; `blockipamctl` run in the agent's
//! container, as `kubectl exec` would, reads the store through the agent).
//!
//! The rolling update: a second image version is made from the first by the test itself
//! (`cri/cri.py add-layer`: one more layer holding v1's plugin with bytes appended, which an ELF
//! executable ignores), imported, and the node's pod replaced as a DaemonSet `RollingUpdate` does on a
//! node (the old pod stopped and removed, the new pod's init container and agent run), while one
//! thread keeps creating and stopping ordinary pod sandboxes and another keeps reading the installed
//! plugin. Every sandbox creation either gets a valid, unduplicated address or fails cleanly and is
//! retried (no exec format error, no text file busy, no missing plugin); every read of the installed
//! plugin is v1's or v2's bytes, never a part; at the end the installed plugin is v2's, and the store
//! holds nothing and `blockipamctl check` finds nothing. Everything containerd and the test created
//! is removed on drop, and checked to be gone.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::Read as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::common::Sandbox;
use crate::containerd::{require_environment, Cri, HostPathMount};
use serde::Deserialize;
use serde_json::{json, Value};

/// The node the test plays (the downward API's `spec.nodeName`).
const NODE: &str = "daemonset-node";
/// The etcd manifest, relative to the workspace.
const ETCD_MANIFEST: &str = "deploy/kubernetes/blockipam-etcd.yaml";
/// The single-node manifest, relative to the workspace.
const SINGLE_NODE_MANIFEST: &str = "deploy/kubernetes/blockipam-single-node.yaml";
/// The variable naming the image archive of `scripts/build-image`.
const IMAGE_ARCHIVE_VARIABLE: &str = "BLOCKIPAM_IMAGE_ARCHIVE";
/// The plugin's path in the image.
const PLUGIN_IN_IMAGE: &str = "/usr/bin/blockipam";
/// Where libcni caches results: bound over too, so that nothing is left there.
const CNI_CACHE: &str = "/var/lib/cni";
/// Bound on every wait (none is expected to come near it).
const WAIT_LIMIT: Duration = Duration::from_secs(90);
/// Ordinary pods that must start through the new agent before the update counts as done.
const PODS_AFTER_UPDATE: usize = 3;
/// What a sandbox creation must never fail with: a plugin run while it was being written, or
/// missing for a moment.
const TORN_PLUGIN_ERRORS: [&str; 5] = [
    "exec format error",
    "text file busy",
    "failed to find plugin",
    "no such file or directory",
    "permission denied",
];

/// The image archive `scripts/build-image` made; fails (never skips) without it.
fn image_archive() -> PathBuf {
    let path = std::env::var_os(IMAGE_ARCHIVE_VARIABLE)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            panic!(
                "{IMAGE_ARCHIVE_VARIABLE} is not set: the DaemonSet test runs the container image; build it \
                 with scripts/build-image and export its path as {IMAGE_ARCHIVE_VARIABLE} (scripts/test \
                 does both)"
            )
        });
    assert!(
        path.is_file(),
        "{IMAGE_ARCHIVE_VARIABLE}={} is not a file: build the image with scripts/build-image",
        path.display()
    );
    path
}

/// A manifest's documents, as JSON values.
struct Manifest {
    docs: Vec<Value>,
}

impl Manifest {
    fn read(relative: &str) -> Manifest {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(relative);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let docs = serde_yaml::Deserializer::from_str(&text)
            .map(|document| {
                let value = serde_yaml::Value::deserialize(document)
                    .unwrap_or_else(|e| panic!("{relative} is not YAML: {e}"));
                serde_json::to_value(value).expect("YAML as JSON")
            })
            .filter(|doc| !doc.is_null())
            .collect();
        Manifest { docs }
    }

    /// Sets `stringData[key]` of the Secret `name`, as an operator edits it before applying.
    fn set_secret(&mut self, name: &str, key: &str, value: &str) {
        let secret = self
            .docs
            .iter_mut()
            .find(|doc| doc["kind"] == "Secret" && doc["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("the manifest has no Secret {name}"));
        secret["stringData"][key] = Value::from(value);
    }

    fn object(&self, kind: &str, name: &str) -> Option<&Value> {
        self.docs
            .iter()
            .find(|doc| doc["kind"] == kind && doc["metadata"]["name"] == name)
    }

    fn daemonset(&self) -> &Value {
        self.docs
            .iter()
            .find(|doc| doc["kind"] == "DaemonSet")
            .expect("the manifest has a DaemonSet")
    }

    /// Every container's image is `localhost/blockipam:<the workspace's version>`, the name
    /// `scripts/build-image` gives the image (operators retag it).
    fn assert_images_are_this_version(&self) {
        let expected = format!("localhost/blockipam:{}", env!("CARGO_PKG_VERSION"));
        let spec = self.pod_spec();
        for container in spec["initContainers"]
            .as_array()
            .into_iter()
            .chain(spec["containers"].as_array())
            .flatten()
        {
            assert_eq!(
                container["image"],
                expected.as_str(),
                "{}",
                container["name"]
            );
        }
    }

    fn pod_spec(&self) -> &Value {
        &self.daemonset()["spec"]["template"]["spec"]
    }

    /// `data[key]` of a ConfigMap, or `stringData[key]` (else base64 `data[key]`) of a Secret.
    fn key(&self, kind: &str, name: &str, key: &str) -> Option<String> {
        let object = self.object(kind, name)?;
        if let Some(text) = object["stringData"][key].as_str() {
            return Some(text.to_owned());
        }
        let data = object["data"][key].as_str()?;
        Some(if kind == "Secret" {
            String::from_utf8(crate::containerd::base64_decode(data)).expect("UTF-8 secret")
        } else {
            data.to_owned()
        })
    }

    /// A container's environment as the kubelet resolves it.
    fn environment(&self, container: &Value) -> Vec<(String, String)> {
        let mut envs = Vec::new();
        for item in container["env"].as_array().into_iter().flatten() {
            let name = item["name"].as_str().expect("env name").to_owned();
            if let Some(value) = item.get("value") {
                envs.push((name, value.as_str().expect("a string value").to_owned()));
                continue;
            }
            let from = &item["valueFrom"];
            let resolved = if let Some(field) = from["fieldRef"]["fieldPath"].as_str() {
                assert_eq!(
                    field, "spec.nodeName",
                    "{name}: the test resolves only spec.nodeName"
                );
                Some(NODE.to_owned())
            } else {
                let (kind, reference) = if from.get("secretKeyRef").is_some() {
                    ("Secret", &from["secretKeyRef"])
                } else if from.get("configMapKeyRef").is_some() {
                    ("ConfigMap", &from["configMapKeyRef"])
                } else {
                    panic!("{name}: unsupported valueFrom {from}")
                };
                let (object, key) = (
                    reference["name"].as_str().expect("a name"),
                    reference["key"].as_str().expect("a key"),
                );
                let value = self.key(kind, object, key);
                // The kubelet refuses to start a container whose required key is missing.
                assert!(
                    value.is_some() || reference["optional"] == true,
                    "{name}: {kind} {object} has no key {key} (CreateContainerConfigError)"
                );
                value
            };
            if let Some(value) = resolved {
                envs.push((name, value));
            }
        }
        envs
    }
}

/// The value of variable `name` in the agent container's environment (a plain `value`).
fn agent_env(spec: &Value, name: &str) -> PathBuf {
    spec["containers"][0]["env"]
        .as_array()
        .expect("the agent's env")
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str())
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("the agent's env has no {name}"))
}

/// The hostPath volumes of a pod spec: volume name → host path.
fn host_path_volumes(spec: &Value) -> BTreeMap<String, PathBuf> {
    spec["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .filter_map(|volume| {
            let path = volume["hostPath"]["path"].as_str()?;
            Some((
                volume["name"].as_str().expect("volume name").to_owned(),
                PathBuf::from(path),
            ))
        })
        .collect()
}

/// Every volume of the pod as the kubelet provides it: a hostPath volume is its host path; a
/// secret volume a directory (under `dir`) holding one file per key of the Secret, empty when an
/// optional Secret does not exist. Other kinds fail the test.
fn pod_volumes(manifest: &Manifest, dir: &Path) -> BTreeMap<String, PathBuf> {
    let mut volumes = host_path_volumes(manifest.pod_spec());
    for volume in manifest.pod_spec()["volumes"].as_array().expect("volumes") {
        let name = volume["name"].as_str().expect("volume name");
        if volumes.contains_key(name) {
            continue;
        }
        let secret = &volume["secret"];
        let secret_name = secret["secretName"]
            .as_str()
            .unwrap_or_else(|| panic!("the test runs hostPath and secret volumes only: {volume}"));
        let files = dir.join("secret-volumes").join(name);
        std::fs::create_dir_all(&files).expect("a secret volume's directory");
        match manifest.object("Secret", secret_name) {
            Some(object) => {
                for field in ["stringData", "data"] {
                    for key in object[field]
                        .as_object()
                        .into_iter()
                        .flatten()
                        .map(|(k, _)| k)
                    {
                        let value = manifest.key("Secret", secret_name, key).expect("a value");
                        std::fs::write(files.join(key), value).expect("a secret file");
                    }
                }
            }
            None => assert_eq!(
                secret["optional"], true,
                "volume {name}: no Secret {secret_name} (the kubelet would not start the pod)"
            ),
        }
        volumes.insert(name.to_owned(), files);
    }
    volumes
}

/// The CRI ContainerConfig the kubelet makes of a pod spec's container.
fn container_config(
    manifest: &Manifest,
    volumes: &BTreeMap<String, PathBuf>,
    container: &Value,
    image: &str,
) -> Value {
    let mounts: Vec<Value> = container["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|mount| {
            let name = mount["name"].as_str().expect("mount name");
            json!({
                "container_path": mount["mountPath"],
                "host_path": volumes.get(name).unwrap_or_else(|| panic!("no volume {name}")),
                "readonly": mount["readOnly"] == true,
            })
        })
        .collect();
    let envs: Vec<Value> = manifest
        .environment(container)
        .into_iter()
        .map(|(key, value)| json!({"key": key, "value": value}))
        .collect();
    let name = container["name"].as_str().expect("container name");
    json!({
        "metadata": {"name": name, "attempt": 0},
        "image": {"image": image},
        "command": container["command"].as_array().cloned().unwrap_or_default(),
        "args": container["args"].as_array().cloned().unwrap_or_default(),
        "envs": envs,
        "mounts": mounts,
        "log_path": format!("{name}.log"),
        "linux": {"security_context": {"namespace_options": {"network": "NODE", "pid": "CONTAINER"}}}
    })
}

/// The node's DaemonSet pod, running.
struct NodePod {
    sandbox_id: String,
    agent_id: String,
    logs: PathBuf,
}

/// The kubelet's probe of the manifest's `httpGet` through the node's network: the body on a
/// 2xx answer, else why not.
fn probe(cri: &Cri, probe: &Value) -> Result<String, String> {
    let http = &probe["httpGet"];
    let url = format!(
        "http://{}:{}{}",
        http["host"].as_str().unwrap_or("127.0.0.1"),
        http["port"],
        http["path"].as_str().expect("a probe path")
    );
    http_get(cri, &url)
}

/// `GET url` from the node's network namespace (Python's urllib: busybox's wget has no timeout
/// here); the body of a 2xx answer, else the error.
fn http_get(cri: &Cri, url: &str) -> Result<String, String> {
    let output = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", cri.traces().host_netns))
        .args([
            "/usr/bin/python3",
            "-c",
            "import sys, urllib.error, urllib.request\n\
             try:\n    sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())\n\
             except urllib.error.HTTPError as e:\n    sys.exit(f'HTTP {e.code}: {e.read().decode().strip()}')\n\
             except Exception as e:\n    sys.exit(str(e))",
            url,
        ])
        .output()
        .map_err(|e| format!("cannot run python3: {e}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "{url}: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// Runs the DaemonSet's pod as the kubelet does: the sandbox on the node's network, each init
/// container to its exit 0, then the containers until the readiness probe answers.
fn run_node_pod(cri: &Cri, manifest: &Manifest, image: Option<&str>, generation: u32) -> NodePod {
    let pod = start_node_pod(cri, manifest, image, generation);
    pod.wait_until_ready(cri, manifest);
    pod
}

/// Starts the DaemonSet's pod as the kubelet does: the sandbox on the node's network, each init
/// container to its exit 0, then the containers (not waiting for readiness).
fn start_node_pod(cri: &Cri, manifest: &Manifest, image: Option<&str>, generation: u32) -> NodePod {
    let daemonset = manifest.daemonset();
    let spec = manifest.pod_spec();
    assert_eq!(
        spec["hostNetwork"], true,
        "the DaemonSet runs on the node's network"
    );
    let logs = cri.traces().dir.join(format!("pod-logs-{generation}"));
    std::fs::create_dir_all(&logs).expect("the pod's log directory");
    let sandbox_config = json!({
        "metadata": {
            "name": format!("{}-{NODE}-{generation}", daemonset["metadata"]["name"].as_str().expect("name")),
            "uid": format!("daemonset-pod-{generation}"),
            "namespace": daemonset["metadata"]["namespace"],
            "attempt": 0
        },
        "log_directory": logs,
        "linux": {
            "cgroup_parent": cri.traces().cgroup_parent,
            "security_context": {"namespace_options": {"network": "NODE", "pid": "CONTAINER"}}
        }
    });
    let volumes = pod_volumes(manifest, &logs);
    let sandbox_id = cri
        .run_pod_config(&sandbox_config)
        .unwrap_or_else(|e| panic!("RunPodSandbox of the DaemonSet's pod: {e}\n{}", cri.log()));
    let image_of = |container: &Value| {
        image
            .map(str::to_owned)
            .unwrap_or_else(|| container["image"].as_str().expect("image").to_owned())
    };
    for init in spec["initContainers"].as_array().expect("initContainers") {
        let name = init["name"].as_str().expect("name");
        let config = container_config(manifest, &volumes, init, &image_of(init));
        let id = cri
            .run_container(&sandbox_id, &sandbox_config, &config)
            .unwrap_or_else(|e| panic!("init container {name}: {e}\n{}", cri.log()));
        let status = wait_for(WAIT_LIMIT, || {
            let status = cri.container_status(&id);
            (status["state"] == "CONTAINER_EXITED").then_some(status)
        })
        .unwrap_or_else(|| panic!("init container {name} did not exit within {WAIT_LIMIT:?}"));
        assert_eq!(
            status["exit_code"],
            0,
            "init container {name}: {status}\n{}",
            read_log(&logs.join(format!("{name}.log")))
        );
    }
    let containers = spec["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1, "one main container: the agent");
    let agent = &containers[0];
    let name = agent["name"].as_str().expect("name");
    let agent_id = cri
        .run_container(
            &sandbox_id,
            &sandbox_config,
            &container_config(manifest, &volumes, agent, &image_of(agent)),
        )
        .unwrap_or_else(|e| panic!("container {name}: {e}\n{}", cri.log()));
    NodePod {
        sandbox_id,
        agent_id,
        logs,
    }
}

impl NodePod {
    /// Waits, as the kubelet's readiness probe does, until the manifest's readiness probe answers
    /// `200 ok` (the agent must keep running meanwhile); then the liveness probe must answer too.
    fn wait_until_ready(&self, cri: &Cri, manifest: &Manifest) {
        let agent = &manifest.pod_spec()["containers"][0];
        let mut last = String::new();
        let ready = wait_for(WAIT_LIMIT, || {
            self.assert_running(cri);
            match probe(cri, &agent["readinessProbe"]) {
                Ok(body) => Some(body),
                Err(e) => {
                    last = e;
                    None
                }
            }
        });
        assert_eq!(
            ready.as_deref(),
            Some("ok\n"),
            "the readiness probe did not pass within {WAIT_LIMIT:?}: {last}\n{}",
            self.agent_log()
        );
        assert_eq!(
            probe(cri, &agent["livenessProbe"]).as_deref(),
            Ok("ok\n"),
            "the liveness probe"
        );
    }

    fn assert_running(&self, cri: &Cri) {
        let status = cri.container_status(&self.agent_id);
        assert_eq!(
            status["state"],
            "CONTAINER_RUNNING",
            "the agent stopped: {status}\n{}",
            self.agent_log()
        );
    }

    fn agent_log(&self) -> String {
        read_log(&self.logs.join("blockipam-agent.log"))
    }

    /// What a DaemonSet update does to the node's old pod: its containers stopped with the pod's
    /// grace period, the pod stopped and removed.
    fn stop(self, cri: &Cri, grace_seconds: u64) {
        cri.stop_container(&self.agent_id, grace_seconds);
        cri.stop_pod(&self.sandbox_id);
        cri.remove_pod(&self.sandbox_id);
    }
}

fn read_log(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Polls `check` every 100 ms until it gives a value, for at most `limit`.
fn wait_for<T>(limit: Duration, mut check: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = check() {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `blockipamctl -o json ARGS` in the agent's container (`kubectl exec`): its environment names
/// the store and the socket, so it reads the store through the agent.
fn ctl(cri: &Cri, pod: &NodePod, args: &[&str]) -> Value {
    let mut command = vec!["/usr/bin/blockipamctl", "-o", "json"];
    command.extend_from_slice(args);
    let (code, stdout, stderr) = cri.exec_sync(&pod.agent_id, &command);
    assert_eq!(code, 0, "{command:?}: {stdout}\n{stderr}");
    serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("{command:?}: not JSON ({e}): {stdout}"))
}

/// The agent's `blockipam_agent_connections_total{outcome="accepted"}`: plugin calls it served.
fn accepted_connections(cri: &Cri, manifest: &Manifest) -> f64 {
    agent_metric(
        cri,
        manifest,
        "blockipam_agent_connections_total{outcome=\"accepted\"}",
    )
    .unwrap_or(0.0)
}

/// One sample of the agent's metrics, scraped at the address its probes use.
fn agent_metric(cri: &Cri, manifest: &Manifest, sample: &str) -> Option<f64> {
    let agent = &manifest.pod_spec()["containers"][0];
    let http = &agent["readinessProbe"]["httpGet"];
    let url = format!(
        "http://{}:{}/metrics",
        http["host"].as_str().unwrap_or("127.0.0.1"),
        http["port"]
    );
    let text = http_get(cri, &url).expect("scrape the agent's metrics");
    text.lines()
        .find_map(|line| line.strip_prefix(&format!("{sample} ")))
        .and_then(|value| value.trim().parse().ok())
}

/// An ordinary pod's sandbox: RunPodSandbox on the pod network, and its address.
fn run_ordinary_pod(cri: &Cri, name: &str) -> Result<(String, String), String> {
    let id = cri.run_pod(name, "default", &BTreeMap::new())?;
    let status = cri.status(&id);
    let ip = status["status"]["network"]["ip"]
        .as_str()
        .ok_or_else(|| format!("{name}: PodSandboxStatus has no IP: {status}"))?
        .to_owned();
    Ok((id, ip))
}

/// The pool of the ConfigMap's ipam config (the one pool the manifest configures).
fn manifest_pool(manifest: &Manifest) -> ipnet::IpNet {
    let ipam: Value = serde_json::from_str(
        &manifest
            .key("ConfigMap", "blockipam-config", "ipam_config")
            .expect("ipam_config"),
    )
    .expect("ipam_config is JSON");
    ipam["pools"][0]["cidr"]
        .as_str()
        .expect("a pool")
        .parse()
        .expect("a CIDR")
}

/// The test's node: its containerd in a private mount namespace with the test's directories over
/// the manifest's host paths (and libcni's cache), Debian's `ptp` and `loopback` in its CNI binary
/// directory, the image imported. Dropped: everything removed (`cri` before the sandbox's directory).
struct Node {
    cri: Cri,
    /// Where the test sees the node's CNI binary directory.
    bin_seen: PathBuf,
    /// Where the test sees the node's CNI config directory.
    conf_seen: PathBuf,
    /// Host paths that did not exist before (mount points the run creates, and must remove).
    missing_before: Vec<PathBuf>,
    _sandbox: Sandbox,
}

impl Node {
    fn start(manifest: &Manifest, archive: &Path) -> Node {
        let sandbox = Sandbox::new();
        let mut cri = Cri::prepare(&sandbox);
        let spec = manifest.pod_spec();
        let host = cri.traces().dir.join("host");
        // The test's directory for each host path the manifest names, and for libcni's cache.
        let mut host_paths: BTreeSet<PathBuf> = host_path_volumes(spec).into_values().collect();
        host_paths.insert(PathBuf::from(CNI_CACHE));
        let mounts: Vec<HostPathMount> = host_paths
            .iter()
            .map(|host_path| HostPathMount {
                host_path: host_path.clone(),
                source: host.join(host_path.strip_prefix("/").expect("absolute")),
            })
            .collect();
        let missing_before: Vec<PathBuf> =
            host_paths.iter().filter(|p| !p.exists()).cloned().collect();
        for mount in &mounts {
            std::fs::create_dir_all(&mount.source).expect("the test's host directory");
        }
        let seen_at = |host_path: &Path| {
            mounts
                .iter()
                .find(|m| m.host_path == host_path)
                .unwrap_or_else(|| {
                    panic!("the manifest mounts no hostPath {}", host_path.display())
                })
                .source
                .clone()
        };
        // containerd's CNI directories are the ones the init container writes into.
        let init = &spec["initContainers"][0];
        let volumes = host_path_volumes(spec);
        let host_dir_of = |mount_path: &str| {
            init["volumeMounts"]
                .as_array()
                .expect("volumeMounts")
                .iter()
                .find(|m| m["mountPath"] == mount_path)
                .map(|m| volumes[m["name"].as_str().expect("name")].clone())
                .unwrap_or_else(|| panic!("install-cni has no volume at {mount_path}"))
        };
        let bin_dir = host_dir_of("/host/opt/cni/bin");
        let conf_dir = host_dir_of("/host/etc/cni/net.d");
        let bin_seen = seen_at(&bin_dir);
        let conf_seen = seen_at(&conf_dir);
        // What the node already has: Debian's plugins the conflist's main plugin needs.
        for plugin in ["ptp", "loopback"] {
            std::fs::copy(
                Path::new("/usr/lib/cni").join(plugin),
                bin_seen.join(plugin),
            )
            .expect("copy a CNI plugin");
        }
        // The runtime's socket where the manifest's agent looks for it (leak collection): in the
        // test's directory bound over the host path the manifest mounts.
        let cri_socket = agent_env(spec, "BLOCKIPAM_AGENT_CRI_SOCKET");
        let cri_socket_dir = cri_socket.parent().expect("a socket in a directory");
        cri.set_socket(seen_at(cri_socket_dir).join(cri_socket.file_name().expect("a file name")));
        cri.start_with_host_paths(&mounts, &bin_dir, &conf_dir);
        let imported = cri.import_image(archive);
        eprintln!("imported {}: {}", archive.display(), imported.trim());
        Node {
            cri,
            bin_seen,
            conf_seen,
            missing_before,
            _sandbox: sandbox,
        }
    }

    /// Shuts containerd down, cleans up, and checks that nothing is left.
    fn finish(self) {
        let traces = self.cri.traces();
        let Node {
            cri,
            missing_before,
            _sandbox,
            ..
        } = self;
        // Checked before the next containerd test may start and make the same mount points.
        let exclusive = cri.shut_down_holding_the_lock();
        assert_eq!(traces.leftovers(), Vec::<String>::new());
        let left: Vec<&PathBuf> = missing_before.iter().filter(|p| p.exists()).collect();
        assert_eq!(
            left,
            Vec::<&PathBuf>::new(),
            "mount points left on the machine"
        );
        drop(exclusive);
    }
}

/// Ordinary pods started on the node get distinct addresses of the manifest's pool through the
/// agent (its accepted connections move; `blockipamctl show --ip` in its container sees each, for
/// this node). Returns the pods (sandbox id, address).
fn pods_get_distinct_addresses_through_the_agent(
    cri: &Cri,
    manifest: &Manifest,
    agent: &NodePod,
    prefix: &str,
    count: usize,
) -> Vec<(String, String)> {
    let pool = manifest_pool(manifest);
    let before = accepted_connections(cri, manifest);
    let mut pods = Vec::new();
    for n in 0..count {
        let (id, ip) = run_ordinary_pod(cri, &format!("{prefix}-{n}")).unwrap_or_else(|e| {
            panic!("an ordinary pod: {e}\n{}\n{}", cri.log(), agent.agent_log())
        });
        let address: std::net::IpAddr = ip.parse().expect("an address");
        assert!(pool.contains(&address), "{ip} is not in {pool}");
        let shown = ctl(cri, agent, &["show", "--ip", &ip]);
        assert_eq!(shown["allocated"], true, "{shown}");
        assert_eq!(shown["attributes"]["node"], NODE, "{shown}");
        pods.push((id, ip));
    }
    let distinct: BTreeSet<&String> = pods.iter().map(|(_, ip)| ip).collect();
    assert_eq!(distinct.len(), pods.len(), "{pods:?}");
    let after = accepted_connections(cri, manifest);
    assert!(
        after >= before + count as f64,
        "the plugin calls did not go through the agent: accepted connections {before} → {after}"
    );
    // The agent reaches the runtime through the socket directory the manifest mounts, and finds
    // every allocation of the node live (leak collection).
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let answering = agent_metric(cri, manifest, "blockipam_agent_runtime_answering");
        let missing = agent_metric(cri, manifest, "ipam_leaked_allocations");
        if answering == Some(1.0) && missing == Some(0.0) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the agent's leak collection does not see the runtime (answering {answering:?}, \
             missing {missing:?})\n{}",
            agent.agent_log()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    pods
}

/// The resident size of this run's agents, in KiB (`VmRSS` of each `blockipam-agent` process in
/// the run's cgroups), for the log: what the manifest's memory request and limit are set from.
fn agents_resident_kib(cri: &Cri) -> Vec<u64> {
    let cgroup_parent = cri.traces().cgroup_parent;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.starts_with(b"/usr/bin/blockipam-agent\0"))
                && std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
                    .is_ok_and(|c| c.contains(&cgroup_parent))
        })
        .filter_map(|pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            status
                .lines()
                .find_map(|line| line.strip_prefix("VmRSS:"))?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// What the churn thread saw while the DaemonSet was updated.
#[derive(Debug, Default)]
struct ChurnReport {
    /// Addresses of sandboxes created, in order.
    addresses: Vec<String>,
    /// Creations that failed (each retried), with their error.
    failures: Vec<String>,
    /// Addresses handed out while another live sandbox held them.
    duplicates: Vec<String>,
}

#[test]
fn daemonset_installs_the_plugin_runs_the_agent_and_survives_a_rolling_update_under_pod_churn() {
    require_environment();
    let archive = image_archive();
    let manifest = Manifest::read(SINGLE_NODE_MANIFEST);
    manifest.assert_images_are_this_version();
    let daemonset = manifest.daemonset();
    let strategy = &daemonset["spec"]["updateStrategy"];
    assert_eq!(strategy["type"], "RollingUpdate", "{strategy}");
    assert_eq!(strategy["rollingUpdate"]["maxUnavailable"], 1, "{strategy}");
    let spec = manifest.pod_spec();
    assert_eq!(spec["tolerations"], json!([{"operator": "Exists"}]));
    assert_eq!(spec["priorityClassName"], "system-node-critical");
    let grace_seconds = spec["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
    let pool = manifest_pool(&manifest);
    let network = manifest
        .key("ConfigMap", "blockipam-config", "network_name")
        .expect("network_name");

    let node = Node::start(&manifest, &archive);
    let cri = &node.cri;
    let init = &spec["initContainers"][0];
    let (bin_seen, conf_seen) = (node.bin_seen.clone(), node.conf_seen.clone());

    // 1. The DaemonSet's pod: install-cni, then the agent until ready.
    let first = run_node_pod(cri, &manifest, None, 1);
    let installed_plugin = bin_seen.join("blockipam");
    let conflist_path = conf_seen.join("10-blockipam.conflist");
    let v1_plugin = std::fs::read(&installed_plugin).expect("install-cni installed the plugin");
    let conflist: Value = serde_json::from_slice(
        &std::fs::read(&conflist_path).expect("install-cni wrote the conflist"),
    )
    .expect("the conflist is JSON");
    let ipam = &conflist["plugins"][0]["ipam"];
    assert_eq!(conflist["name"], network.as_str(), "{conflist}");
    assert_eq!(ipam["nodename"], NODE, "{conflist}");
    assert_eq!(
        ipam["agent_socket"],
        manifest
            .environment(init)
            .iter()
            .find(|(k, _)| k == "BLOCKIPAM_AGENT_SOCKET")
            .expect("socket")
            .1,
        "{conflist}"
    );
    let work = cri.traces().dir.join("images");
    std::fs::create_dir_all(&work).expect("images dir");
    let from_image = work.join("v1-plugin");
    cri.python(&[
        "extract",
        &archive.to_string_lossy(),
        PLUGIN_IN_IMAGE,
        &from_image.to_string_lossy(),
    ])
    .unwrap_or_else(|e| panic!("extract the plugin from the image: {e}"));
    assert!(
        std::fs::read(&from_image).expect("v1 plugin") == v1_plugin,
        "the installed plugin is not the image's"
    );

    // 2. Ordinary pods get distinct addresses of the pool through the agent; StopPodSandbox
    // releases them.
    let mut held = pods_get_distinct_addresses_through_the_agent(cri, &manifest, &first, "pod", 3);
    let (released_id, released_ip) = held.pop().expect("a pod");
    cri.stop_pod(&released_id);
    cri.remove_pod(&released_id);
    let shown = ctl(cri, &first, &["show", "--ip", &released_ip]);
    assert_eq!(shown["allocated"], false, "after StopPodSandbox: {shown}");

    // 3. The rolling update, under pod churn.
    let mut v2_plugin = v1_plugin.clone();
    v2_plugin.extend_from_slice(b"\n# blockipam DaemonSet test: image version 2\n");
    let v2_file = work.join("v2-plugin");
    std::fs::write(&v2_file, &v2_plugin).expect("write the v2 plugin");
    let v1_image = spec["containers"][0]["image"].as_str().expect("image");
    let v2_image = format!("{v1_image}-update");
    let v2_archive = work.join("v2.tar");
    cri.python(&[
        "add-layer",
        &archive.to_string_lossy(),
        &v2_archive.to_string_lossy(),
        &v2_image,
        PLUGIN_IN_IMAGE,
        &v2_file.to_string_lossy(),
    ])
    .unwrap_or_else(|e| panic!("derive the second image: {e}"));
    cri.import_image(&v2_archive);

    // A plugin the runtime started just before the update: its file stays v1's, whole, whatever
    // the update does (a new file renamed over the name), which an in-place rewrite would break.
    let mut opened_before_update =
        std::fs::File::open(&installed_plugin).expect("open the installed plugin");
    let inode_before_update = std::fs::metadata(&installed_plugin).expect("plugin").ino();
    let stop = AtomicBool::new(false);
    let updated = AtomicBool::new(false);
    let after_update = AtomicUsize::new(0);
    // Sandboxes created while the node's pod was being replaced (for the log: how many fell in
    // that window depends on timing).
    let updating = AtomicBool::new(false);
    let during_update = AtomicUsize::new(0);
    let created = AtomicUsize::new(0);
    let torn_reads = Mutex::new(Vec::<String>::new());
    let held_ips: BTreeSet<String> = held.iter().map(|(_, ip)| ip.clone()).collect();
    let (report, second) = std::thread::scope(|scope| {
        let churn = scope.spawn(|| {
            let mut report = ChurnReport::default();
            let mut live: VecDeque<(String, String)> = VecDeque::new();
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                match run_ordinary_pod(cri, &format!("churn-{n}")) {
                    Ok((id, ip)) => {
                        if held_ips.contains(&ip) || live.iter().any(|(_, other)| *other == ip) {
                            report.duplicates.push(ip.clone());
                        }
                        report.addresses.push(ip.clone());
                        created.fetch_add(1, Ordering::SeqCst);
                        if updating.load(Ordering::SeqCst) {
                            during_update.fetch_add(1, Ordering::SeqCst);
                        }
                        if updated.load(Ordering::SeqCst) {
                            after_update.fetch_add(1, Ordering::SeqCst);
                        }
                        live.push_back((id, ip));
                        if live.len() > 2 {
                            let (old, _) = live.pop_front().expect("a live pod");
                            cri.stop_pod(&old);
                            cri.remove_pod(&old);
                        }
                    }
                    Err(e) => {
                        // The kubelet retries a failed sandbox; so does this loop.
                        report.failures.push(e);
                        std::thread::sleep(Duration::from_millis(200));
                    }
                }
            }
            for (id, _) in live {
                cri.stop_pod(&id);
                cri.remove_pod(&id);
            }
            report
        });
        let reader = scope.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                match std::fs::read(&installed_plugin) {
                    Ok(bytes) if bytes == v1_plugin || bytes == v2_plugin => {}
                    Ok(bytes) => torn_reads
                        .lock()
                        .expect("reads")
                        .push(format!("{} bytes, neither v1's nor v2's", bytes.len())),
                    Err(e) => torn_reads.lock().expect("reads").push(e.to_string()),
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        // Some pods through the old agent first.
        let started = wait_for(WAIT_LIMIT, || {
            (created.load(Ordering::SeqCst) >= 2 || churn.is_finished()).then_some(())
        });
        assert!(started.is_some(), "no pod started through the first agent");
        updating.store(true, Ordering::SeqCst);
        first.stop(cri, grace_seconds);
        let second = run_node_pod(cri, &manifest, Some(&v2_image), 2);
        updating.store(false, Ordering::SeqCst);
        updated.store(true, Ordering::SeqCst);
        let enough = wait_for(WAIT_LIMIT, || {
            (after_update.load(Ordering::SeqCst) >= PODS_AFTER_UPDATE || churn.is_finished())
                .then_some(())
        });
        stop.store(true, Ordering::SeqCst);
        reader.join().expect("the reader thread");
        let report = churn.join().expect("the churn thread");
        assert!(
            enough.is_some(),
            "fewer than {PODS_AFTER_UPDATE} pods started after the update: {report:?}\n{}",
            second.agent_log()
        );
        (report, second)
    });
    eprintln!(
        "churn: {} sandboxes ({} while the node's pod was replaced), {} failed creations (retried): {:?}",
        report.addresses.len(),
        during_update.load(Ordering::SeqCst),
        report.failures.len(),
        report.failures
    );
    let torn = torn_reads.into_inner().expect("reads");
    assert_eq!(torn, Vec::<String>::new(), "reads of the installed plugin");
    assert_eq!(report.duplicates, Vec::<String>::new(), "{report:?}");
    for failure in &report.failures {
        let lower = failure.to_lowercase();
        assert!(
            !TORN_PLUGIN_ERRORS.iter().any(|bad| lower.contains(bad)),
            "a sandbox failed on the plugin itself: {failure}"
        );
    }
    for ip in &report.addresses {
        let address: std::net::IpAddr = ip.parse().expect("an address");
        assert!(pool.contains(&address), "{ip} is not in {pool}");
    }
    assert!(
        std::fs::read(&installed_plugin).expect("the installed plugin") == v2_plugin,
        "the installed plugin is not v2's after the update"
    );
    let mut seen_by_earlier_run = Vec::new();
    opened_before_update
        .read_to_end(&mut seen_by_earlier_run)
        .expect("read the plugin opened before the update");
    assert!(
        seen_by_earlier_run == v1_plugin,
        "the plugin file opened before the update changed under it ({} bytes, v1 has {}): the \
         update rewrote it in place instead of replacing it",
        seen_by_earlier_run.len(),
        v1_plugin.len()
    );
    assert_ne!(
        std::fs::metadata(&installed_plugin).expect("plugin").ino(),
        inode_before_update,
        "the update did not replace the plugin's file"
    );
    assert_eq!(
        serde_json::from_slice::<Value>(&std::fs::read(&conflist_path).expect("conflist"))
            .expect("JSON"),
        conflist,
        "the update changed the conflist"
    );

    eprintln!(
        "the agent's resident size after the update, in KiB: {:?}",
        agents_resident_kib(cri)
    );
    // 4. The pods held across the update keep their addresses; once all are stopped the store
    // holds nothing, and check finds nothing.
    for (id, ip) in &held {
        let shown = ctl(cri, &second, &["show", "--ip", ip]);
        assert_eq!(
            shown["allocated"], true,
            "{ip} held across the update: {shown}"
        );
        cri.stop_pod(id);
        cri.remove_pod(id);
    }
    ctl(
        cri,
        &second,
        &["release", "--handle", &format!("{network}:gateway")],
    );
    let usage = ctl(cri, &second, &["show"]);
    for pool in usage["pools"].as_array().expect("pools") {
        assert_eq!(pool["in_use"], 0, "{usage}");
    }
    let (code, stdout, stderr) =
        cri.exec_sync(&second.agent_id, &["/usr/bin/blockipamctl", "check"]);
    assert_eq!(code, 0, "blockipamctl check: {stdout}\n{stderr}");

    // Shutting everything down leaves nothing behind, the mount points it made included.
    second.stop(cri, grace_seconds);
    node.finish();
}

/// An etcd server in the node's network namespace (where the DaemonSet's agent, on the node's
/// network, reaches it at 127.0.0.1); killed on drop.
struct NodeEtcd {
    child: std::process::Child,
    endpoint: String,
}

impl NodeEtcd {
    /// Ports of the node's own namespace: nothing else listens there.
    const CLIENT: &'static str = "http://127.0.0.1:23790";
    const PEER: &'static str = "http://127.0.0.1:23800";

    fn start(cri: &Cri) -> NodeEtcd {
        let dir = cri.traces().dir.join("etcd");
        let log = std::fs::File::create(cri.traces().dir.join("logs/etcd.log")).expect("etcd log");
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", cri.traces().host_netns))
            .arg("/usr/bin/etcd")
            .args(["--name", "node-etcd", "--data-dir"])
            .arg(&dir)
            .args(["--listen-client-urls", Self::CLIENT])
            .args(["--advertise-client-urls", Self::CLIENT])
            .args(["--listen-peer-urls", Self::PEER])
            .args(["--initial-advertise-peer-urls", Self::PEER])
            .args(["--initial-cluster", &format!("node-etcd={}", Self::PEER)])
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .spawn()
            .expect("start etcd (Debian package etcd-server)");
        let etcd = NodeEtcd {
            child,
            endpoint: Self::CLIENT.to_owned(),
        };
        let healthy = wait_for(WAIT_LIMIT, || {
            http_get(cri, &format!("{}/health", Self::CLIENT))
                .ok()
                .filter(|body| body.contains("true"))
        });
        assert!(
            healthy.is_some(),
            "etcd did not become healthy within {WAIT_LIMIT:?}"
        );
        etcd
    }
}

impl Drop for NodeEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The clustered manifest on a real etcd: the Secret filled with the test's etcd (endpoint and a
/// key prefix; the optional user, password and TLS keys left out, as the kubelet leaves out their
/// variables), the optional TLS Secret absent (an empty volume). While etcd is not there the agent
/// runs but `/readyz` answers 503 with its reason; once etcd answers the probe passes, pods get
/// distinct addresses of the pool through the agent, StopPodSandbox releases them, and `check` on
/// the etcd store is clean.
#[test]
fn daemonset_on_etcd_is_ready_once_etcd_answers_and_serves_pods_through_the_agent() {
    require_environment();
    let archive = image_archive();
    let mut manifest = Manifest::read(ETCD_MANIFEST);
    manifest.assert_images_are_this_version();
    manifest.set_secret("blockipam-etcd", "etcd_endpoints", NodeEtcd::CLIENT);
    manifest.set_secret("blockipam-etcd", "etcd_prefix", "/daemonset-test/");
    let grace_seconds = manifest.pod_spec()["terminationGracePeriodSeconds"]
        .as_u64()
        .unwrap_or(30);
    let network = manifest
        .key("ConfigMap", "blockipam-config", "network_name")
        .expect("network_name");
    let node = Node::start(&manifest, &archive);
    let cri = &node.cri;

    let pod = start_node_pod(cri, &manifest, None, 1);
    let readiness = &manifest.pod_spec()["containers"][0]["readinessProbe"];
    let mut last = Ok(String::new());
    let unready = wait_for(WAIT_LIMIT, || {
        pod.assert_running(cri);
        last = probe(cri, readiness);
        last.clone().err().filter(|e| e.contains(": HTTP 503: "))
    })
    .unwrap_or_else(|| {
        panic!(
            "/readyz never answered 503 without etcd (last: {last:?})\n{}",
            pod.agent_log()
        )
    });
    assert!(unready.contains("not ready: "), "{unready}");
    eprintln!("without etcd: {unready}");
    let conflist: Value = serde_json::from_slice(
        &std::fs::read(node.conf_seen.join("10-blockipam.conflist")).expect("the conflist"),
    )
    .expect("JSON");
    let ipam = &conflist["plugins"][0]["ipam"];
    assert_eq!(ipam["datastore_type"], "etcdv3", "{conflist}");
    assert_eq!(ipam["etcd_endpoints"], NodeEtcd::CLIENT, "{conflist}");
    assert_eq!(ipam["etcd_prefix"], "/daemonset-test/", "{conflist}");
    assert!(ipam.get("etcd_password").is_none(), "{conflist}");

    let etcd = NodeEtcd::start(cri);
    pod.wait_until_ready(cri, &manifest);
    let pods = pods_get_distinct_addresses_through_the_agent(cri, &manifest, &pod, "etcd-pod", 3);
    for (id, ip) in &pods {
        cri.stop_pod(id);
        cri.remove_pod(id);
        let shown = ctl(cri, &pod, &["show", "--ip", ip]);
        assert_eq!(shown["allocated"], false, "after StopPodSandbox: {shown}");
    }
    ctl(
        cri,
        &pod,
        &["release", "--handle", &format!("{network}:gateway")],
    );
    let usage = ctl(cri, &pod, &["show"]);
    for pool in usage["pools"].as_array().expect("pools") {
        assert_eq!(pool["in_use"], 0, "{usage}");
    }
    let (code, stdout, stderr) = cri.exec_sync(&pod.agent_id, &["/usr/bin/blockipamctl", "check"]);
    assert_eq!(code, 0, "blockipamctl check: {stdout}\n{stderr}");
    eprintln!(
        "etcd at {}: {} pods served; the agent's resident size in KiB: {:?}",
        etcd.endpoint,
        pods.len(),
        agents_resident_kib(cri)
    );

    pod.stop(cri, grace_seconds);
    drop(etcd);
    node.finish();
}
