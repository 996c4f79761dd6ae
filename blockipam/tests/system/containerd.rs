//! A containerd 1.6 with its CRI plugin, run by the system tests as the kubelet's runtime: the
//! machine check, the supervisor (own root, state, socket, network namespace; optionally a private
//! mount namespace with the test's directories over host paths), the gRPC driver `cri/cri.py`, and a
//! cleanup on drop that leaves nothing behind (checked by [`Traces::leftovers`]).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};

use crate::common::{plugin_binary, Sandbox};
use serde_json::{json, Value};

/// Debian's containerd and its tools.
const CONTAINERD: &str = "/usr/bin/containerd";
const CTR: &str = "/usr/bin/ctr";
const SHIM: &str = "/usr/bin/containerd-shim-runc-v2";
/// The Python that Debian's python3-grpcio is installed for (a `python3` earlier on `PATH`, such as
/// pyenv's, does not have it).
const PYTHON: &str = "/usr/bin/python3";
/// Debian's CNI plugins.
const CNI_PLUGINS: &str = "/usr/lib/cni";
/// The statically linked busybox of `busybox-static`: the sandbox image's whole root file system.
const BUSYBOX: &str = "/bin/busybox";
/// The sandbox ("pause") image the test builds and imports.
const SANDBOX_IMAGE: &str = "localhost/blockipam-cri-sandbox:1";
/// containerd's CRI namespace.
const CRI_NAMESPACE: &str = "k8s.io";
/// Where libcni caches results (containerd 1.6 does not move it).
const CNI_CACHE: &str = "/var/lib/cni";
/// Where containerd 1.6 puts its shims' sockets, whatever its state directory.
const SHIM_SOCKETS: &str = "/run/containerd/s";

/// Fails (never skips) when the machine cannot run this test, naming the Debian packages to install.
pub(crate) fn require_environment() {
    let mut missing: Vec<String> = Vec::new();
    let mut need = |ok: bool, package: &str, what: &str| {
        if !ok {
            missing.push(format!("{package} ({what})"));
        }
    };
    let exists = |path: &str| Path::new(path).exists();
    need(exists(CONTAINERD), "containerd", CONTAINERD);
    need(exists(CTR), "containerd", CTR);
    need(exists(SHIM), "containerd", SHIM);
    need(
        exists("/usr/sbin/runc") || exists("/usr/bin/runc"),
        "runc",
        "runc",
    );
    for plugin in ["ptp", "loopback"] {
        need(
            Path::new(CNI_PLUGINS).join(plugin).is_file(),
            "containernetworking-plugins",
            &format!("{CNI_PLUGINS}/{plugin}"),
        );
    }
    need(
        exists("/usr/bin/protoc"),
        "protobuf-compiler",
        "/usr/bin/protoc",
    );
    need(
        python_imports("grpc"),
        "python3-grpcio",
        &format!("{PYTHON} -c 'import grpc'"),
    );
    need(
        python_imports("google.protobuf"),
        "python3-protobuf",
        &format!("{PYTHON} -c 'import google.protobuf'"),
    );
    need(
        is_static_executable(BUSYBOX),
        "busybox-static",
        "a statically linked /bin/busybox",
    );
    need(
        exists("/usr/sbin/ip") || exists("/sbin/ip") || exists("/usr/bin/ip"),
        "iproute2",
        "ip",
    );
    need(exists("/usr/bin/nsenter"), "util-linux", "/usr/bin/nsenter");
    assert!(
        missing.is_empty() && crate::common::running_as_root(),
        "the containerd CRI end-to-end test needs root and these Debian packages: run as root after \
         `apt-get install containerd python3-grpcio busybox-static protobuf-compiler \
         containernetworking-plugins iproute2` (or scripts/setup); missing: {missing:?}, root: {}", crate::common::running_as_root()
    );
}

fn python_imports(module: &str) -> bool {
    Command::new(PYTHON)
        .args(["-c", &format!("import {module}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether `path` is an ELF64 executable without a program interpreter (`PT_INTERP`): it runs in a
/// root file system that holds nothing else.
fn is_static_executable(path: &str) -> bool {
    let Ok(bytes) = std::fs::read(path) else {
        return false;
    };
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 {
        return false;
    }
    let u16_at = |at: usize| usize::from(u16::from_le_bytes([bytes[at], bytes[at + 1]]));
    let Some(table) = bytes
        .get(0x20..0x28)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .and_then(|b| usize::try_from(u64::from_le_bytes(b)).ok())
    else {
        return false;
    };
    let (entry_size, entries) = (u16_at(0x36), u16_at(0x38));
    (0..entries).all(|i| {
        let at = table + i * entry_size;
        bytes
            .get(at..at + 4)
            .is_some_and(|kind| kind != 3u32.to_le_bytes())
    })
}

pub(crate) fn run_ok(command: &mut Command, what: &str) -> String {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    assert!(
        output.status.success(),
        "{what} failed ({}): {}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Runs a command for cleanup: failures are reported on stderr, never panics.
pub(crate) fn run_quietly(command: &mut Command) -> bool {
    match command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
    {
        Ok(output) if output.status.success() => true,
        Ok(output) => {
            eprintln!(
                "cleanup: {command:?} failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            );
            false
        }
        Err(e) => {
            eprintln!("cleanup: cannot run {command:?}: {e}");
            false
        }
    }
}

/// A tag unique on this machine: the process id and a clock reading.
pub(crate) fn unique_tag() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{:x}{:05x}", std::process::id(), nanos & 0xf_ffff)
}

/// Where everything one containerd run leaves on the machine: what [`Cri`] removes on drop, and
/// what [`Traces::leftovers`] looks for afterwards.
#[derive(Debug, Clone)]
pub(crate) struct Traces {
    /// Holds containerd's root, state, socket, CNI directories and the image (inside the sandbox).
    pub(crate) dir: PathBuf,
    /// containerd's gRPC socket.
    pub(crate) socket: PathBuf,
    /// The CNI network's name (unique per run): libcni's cache entries start with it.
    pub(crate) network: String,
    /// The network namespace containerd runs in.
    pub(crate) host_netns: String,
    /// The pods' cgroup parent (under every cgroup hierarchy).
    pub(crate) cgroup_parent: String,
    /// Every pod sandbox id containerd handed out.
    pub(crate) sandbox_ids: Vec<String>,
}

impl Traces {
    /// The shim socket containerd 1.6 uses for a task: `/run/containerd/s/<sha256 of
    /// "<grpc address>/<namespace>/<id>">`.
    pub(crate) fn shim_socket(&self, id: &str) -> Option<PathBuf> {
        let key = self.socket.join(CRI_NAMESPACE).join(id);
        let mut child = Command::new("sha256sum")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .ok()?;
        child
            .stdin
            .take()?
            .write_all(key.as_os_str().as_encoded_bytes())
            .ok()?;
        let output = child.wait_with_output().ok()?;
        let digest = String::from_utf8_lossy(&output.stdout)
            .split_whitespace()
            .next()?
            .to_owned();
        Some(Path::new(SHIM_SOCKETS).join(digest))
    }

    /// libcni's cached results of this run: `<network>-<id>-eth0` and `cni-loopback-<id>-lo`.
    fn cache_entries(&self) -> Vec<PathBuf> {
        let results = Path::new(CNI_CACHE).join("results");
        let Ok(entries) = std::fs::read_dir(&results) else {
            return Vec::new();
        };
        entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|path| {
                let name = path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                name.starts_with(&format!("{}-", self.network))
                    || self
                        .sandbox_ids
                        .iter()
                        .any(|id| name == format!("cni-loopback-{id}-lo"))
            })
            .collect()
    }

    /// Mount points under [`Traces::dir`], deepest first.
    fn mounts(&self) -> Vec<PathBuf> {
        let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut mounts: Vec<PathBuf> = table
            .lines()
            .filter_map(|line| line.split(' ').nth(4))
            .map(|point| PathBuf::from(point.replace("\\040", " ")))
            .filter(|point| point.starts_with(&self.dir))
            .collect();
        mounts.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
        mounts.dedup();
        mounts
    }

    /// Processes whose command line names this run's socket (its containerd and shims).
    fn processes(&self) -> Vec<u32> {
        let socket = self.socket.to_string_lossy().into_owned();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| *pid != std::process::id())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
                    .is_ok_and(|c| c.contains(&socket) || c.contains(&*self.dir.to_string_lossy()))
            })
            .collect()
    }

    /// The pods' cgroup directories still present.
    fn cgroups(&self) -> Vec<PathBuf> {
        let relative = self.cgroup_parent.trim_start_matches('/');
        let mut found = Vec::new();
        let root = Path::new("/sys/fs/cgroup");
        if root.join(relative).is_dir() {
            found.push(root.join(relative));
        }
        if let Ok(entries) = std::fs::read_dir(root) {
            for entry in entries.filter_map(Result::ok) {
                let candidate = entry.path().join(relative);
                if candidate.is_dir() {
                    found.push(candidate);
                }
            }
        }
        found
    }

    /// Kills what containerd started (its shims and anything else naming this run), deletes the
    /// containers runc still knows, unmounts what is mounted under the run's directory (network
    /// namespaces, shm, root file systems) and removes the pods' cgroups.
    fn stop_everything_started(&self) {
        // Shims (and anything else) this containerd started, then the containers runc still knows.
        for pid in self.processes() {
            run_quietly(Command::new("kill").args(["-KILL", &pid.to_string()]));
        }
        let runc_root = self.dir.join("runc").join(CRI_NAMESPACE);
        if let Ok(entries) = std::fs::read_dir(&runc_root) {
            for entry in entries.filter_map(Result::ok) {
                run_quietly(
                    Command::new("runc")
                        .arg("--root")
                        .arg(&runc_root)
                        .args(["delete", "--force"])
                        .arg(entry.file_name()),
                );
            }
        }
        // Mounts (network namespaces, shm, root file systems) under the directory.
        for mount in self.mounts() {
            run_quietly(Command::new("umount").arg("--lazy").arg(&mount));
        }
        // Cgroups, children first.
        for cgroup in self.cgroups() {
            remove_cgroup_tree(&cgroup);
        }
    }

    fn netns_exists(&self) -> bool {
        Path::new("/run/netns").join(&self.host_netns).exists()
    }

    /// What is left on the machine (empty after a clean drop).
    pub(crate) fn leftovers(&self) -> Vec<String> {
        let mut left = Vec::new();
        left.extend(self.processes().iter().map(|pid| format!("process {pid}")));
        left.extend(
            self.mounts()
                .iter()
                .map(|p| format!("mount {}", p.display())),
        );
        left.extend(
            self.cgroups()
                .iter()
                .map(|p| format!("cgroup {}", p.display())),
        );
        left.extend(
            self.cache_entries()
                .iter()
                .map(|p| format!("libcni cache {}", p.display())),
        );
        for id in &self.sandbox_ids {
            if let Some(socket) = self.shim_socket(id).filter(|s| s.exists()) {
                left.push(format!("shim socket {}", socket.display()));
            }
        }
        if self.netns_exists() {
            left.push(format!("network namespace {}", self.host_netns));
        }
        if self.dir.exists() {
            left.push(format!("directory {}", self.dir.display()));
        }
        left
    }
}

/// One containerd with its CRI plugin, in its own network namespace; everything removed on drop.
pub(crate) struct Cri {
    /// What this run leaves on the machine (sandbox ids are added as pods start).
    traces: Mutex<Traces>,
    /// The containerd process.
    containerd: Option<Child>,
    /// Generated runtime.v1 message classes.
    stubs: PathBuf,
    /// Shared directories that did not exist before this run (removed on drop when empty).
    created_shared_dirs: Vec<PathBuf>,
    /// Mount points this run created for its private mount namespace (removed on drop, deepest
    /// first, when empty).
    created_mount_points: Vec<PathBuf>,
    /// One containerd test at a time in this process: they share `/run/containerd/s`,
    /// `/var/lib/cni` and the mount points, which each creates and removes when missing. Dropped
    /// last, after the cleanup.
    exclusive: Option<MutexGuard<'static, ()>>,
}

/// Held by the running containerd test (see [`Cri`]).
static CONTAINERD_TESTS: Mutex<()> = Mutex::new(());

/// A directory of the test's bound over a host path inside containerd's private mount namespace:
/// containerd, its shims, the containers and the CNI plugins it runs see `source` at `host_path`;
/// the rest of the machine sees neither.
#[derive(Debug, Clone)]
pub(crate) struct HostPathMount {
    /// The path the manifest names, e.g. `/opt/cni/bin`.
    pub(crate) host_path: PathBuf,
    /// The test's directory seen there.
    pub(crate) source: PathBuf,
}

impl Cri {
    /// Records where things will be and creates the network namespace: from here on, drop cleans up.
    pub(crate) fn prepare(sandbox: &Sandbox) -> Cri {
        let exclusive = CONTAINERD_TESTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let tag = unique_tag();
        let dir = sandbox.dir.path().join("cri");
        let shared = [
            PathBuf::from("/run/containerd"),
            PathBuf::from(SHIM_SOCKETS),
            PathBuf::from(CNI_CACHE),
            Path::new(CNI_CACHE).join("results"),
        ];
        let cri = Cri {
            traces: Mutex::new(Traces {
                socket: dir.join("containerd.sock"),
                dir: dir.clone(),
                network: format!("bipam-cri-{tag}"),
                host_netns: format!("bipam-cri-{tag}"),
                cgroup_parent: format!("/bipam-cri-{tag}"),
                sandbox_ids: Vec::new(),
            }),
            containerd: None,
            stubs: dir.join("stubs"),
            // Deepest last, so that drop removes them deepest first.
            created_shared_dirs: shared.into_iter().filter(|d| !d.exists()).collect(),
            created_mount_points: Vec::new(),
            exclusive: Some(exclusive),
        };
        let netns = cri.traces().host_netns;
        run_ok(
            Command::new("ip").args(["netns", "add", &netns]),
            "ip netns add",
        );
        run_ok(
            Command::new("ip").args(["netns", "exec", &netns, "ip", "link", "set", "lo", "up"]),
            "bring up lo in containerd's namespace",
        );
        cri
    }

    /// Shuts containerd down and cleans up as drop does, but keeps other containerd tests out
    /// until the caller lets go of the returned guard: what is left can be checked meanwhile
    /// without seeing the next test's directories.
    pub(crate) fn shut_down_holding_the_lock(mut self) -> MutexGuard<'static, ()> {
        let exclusive = self.exclusive.take().expect("held from prepare to drop");
        drop(self);
        exclusive
    }

    /// Puts containerd's gRPC socket at `socket` instead of the run's directory (before it starts):
    /// where a pod that mounts the runtime's socket directory finds it.
    pub(crate) fn set_socket(&mut self, socket: PathBuf) {
        assert!(
            self.containerd.is_none(),
            "set_socket after containerd started"
        );
        self.traces.lock().expect("traces").socket = socket;
    }

    pub(crate) fn traces(&self) -> Traces {
        self.traces.lock().expect("traces").clone()
    }

    /// Writes the CNI directories, the conflist and containerd's config, starts containerd, waits
    /// for its CRI to answer, generates the gRPC message classes and imports the sandbox image.
    pub(crate) fn start(&mut self, conflist: &Value) {
        let traces = self.traces();
        let dir = &traces.dir;
        let bin_dir = dir.join("cni-bin");
        let conf_dir = dir.join("cni-conf");
        for d in [&bin_dir, &conf_dir, &dir.join("logs")] {
            std::fs::create_dir_all(d).expect("create containerd's directories");
        }
        std::os::unix::fs::symlink(plugin_binary(), bin_dir.join("blockipam"))
            .expect("link blockipam");
        for plugin in ["ptp", "loopback"] {
            std::os::unix::fs::symlink(Path::new(CNI_PLUGINS).join(plugin), bin_dir.join(plugin))
                .expect("link a CNI plugin");
        }
        std::fs::write(
            conf_dir.join("10-blockipam.conflist"),
            serde_json::to_vec_pretty(conflist).expect("conflist JSON"),
        )
        .expect("write the conflist");
        self.launch(&bin_dir, &conf_dir, &[]);
    }

    /// Starts containerd in a private mount namespace where each of `mounts` is bound over its
    /// host path (missing mount points are created, and removed on drop), with the CNI binary and
    /// config directories at those (host) paths, then as [`Cri::start`]: the CRI answering, the
    /// stubs generated, the sandbox image imported.
    pub(crate) fn start_with_host_paths(
        &mut self,
        mounts: &[HostPathMount],
        bin_dir: &Path,
        conf_dir: &Path,
    ) {
        std::fs::create_dir_all(self.traces().dir.join("logs")).expect("create the log directory");
        for mount in mounts {
            let mut missing = Vec::new();
            let mut at = Some(mount.host_path.as_path());
            while let Some(path) = at.filter(|p| !p.exists()) {
                missing.push(path.to_path_buf());
                at = path.parent();
            }
            for path in missing.into_iter().rev() {
                std::fs::create_dir(&path)
                    .unwrap_or_else(|e| panic!("create the mount point {}: {e}", path.display()));
                self.created_mount_points.push(path);
            }
        }
        self.launch(bin_dir, conf_dir, mounts);
    }

    fn launch(&mut self, bin_dir: &Path, conf_dir: &Path, mounts: &[HostPathMount]) {
        let traces = self.traces();
        let dir = &traces.dir;
        let config = containerd_config(&traces, bin_dir, conf_dir);
        let config_path = dir.join("containerd.toml");
        std::fs::write(&config_path, config).expect("write containerd's config");
        let log = std::fs::File::create(dir.join("logs/containerd.log")).expect("containerd log");
        let mut command = if mounts.is_empty() {
            Command::new("nsenter")
        } else {
            // unshare and nsenter exec (no fork), and so does the shell: the child is containerd.
            let mut command = Command::new("unshare");
            command.args(["--mount", "--propagation", "private", "nsenter"]);
            command
        };
        command.arg(format!("--net=/run/netns/{}", traces.host_netns));
        if !mounts.is_empty() {
            command.args([
                "/bin/sh",
                "-ec",
                r#"while [ "$1" != -- ]; do mount --bind "$1" "$2"; shift 2; done; shift; exec "$@""#,
                "sh",
            ]);
            for mount in mounts {
                command.arg(&mount.source).arg(&mount.host_path);
            }
            command.arg("--");
        }
        let child = command
            .arg(CONTAINERD)
            .arg("--config")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .spawn()
            .expect("start containerd");
        self.containerd = Some(child);

        self.python(&["stubs", &self.stubs.to_string_lossy()])
            .unwrap_or_else(|e| panic!("generating the CRI stubs failed: {e}"));
        let image = dir.join("sandbox-image.tar");
        self.python(&[
            "image",
            &image.to_string_lossy(),
            SANDBOX_IMAGE,
            "/bin/sleep",
            "2147483647",
        ])
        .unwrap_or_else(|e| panic!("building the sandbox image failed: {e}"));
        let version = self
            .driver(&["wait"])
            .unwrap_or_else(|e| panic!("containerd's CRI does not answer: {e}\n{}", self.log()));
        assert_eq!(version["runtime_api_version"], "v1", "{version}");
        self.import_image(&image);
    }

    /// Imports an image archive (docker or OCI) into the CRI's namespace, unpacked for the
    /// `native` snapshotter, as an operator does with `ctr -n k8s.io images import`.
    pub(crate) fn import_image(&self, archive: &Path) -> String {
        run_ok(
            Command::new(CTR)
                .arg("--address")
                .arg(&self.traces().socket)
                .args([
                    "-n",
                    CRI_NAMESPACE,
                    "images",
                    "import",
                    "--snapshotter",
                    "native",
                ])
                .arg(archive),
            "ctr images import",
        )
    }

    /// The node goes down hard and comes back with a fresh runtime state: containerd, its shims
    /// and the pods' processes killed (no StopPodSandbox, so no CNI DEL reaches the plugin), the
    /// pods' mounts, network namespaces and cgroups gone, and containerd's root, state and socket
    /// wiped. libcni's cache, on disk, stays. [`Cri::power_on`] starts containerd again.
    pub(crate) fn power_off(&mut self) {
        self.resume_containerd();
        if let Some(mut child) = self.containerd.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let traces = self.traces();
        traces.stop_everything_started();
        for id in &traces.sandbox_ids {
            if let Some(socket) = traces.shim_socket(id) {
                let _ = std::fs::remove_file(socket);
            }
        }
        for wiped in ["root", "state", "runc"] {
            let path = traces.dir.join(wiped);
            if path.exists() {
                std::fs::remove_dir_all(&path)
                    .unwrap_or_else(|e| panic!("wipe {}: {e}", path.display()));
            }
        }
        for socket in [
            traces.socket.clone(),
            traces.socket.with_extension("sock.ttrpc"),
        ] {
            let _ = std::fs::remove_file(socket);
        }
        assert!(
            traces.mounts().is_empty() && traces.processes().is_empty(),
            "the power-off left something running: {:?}",
            traces.leftovers()
        );
    }

    /// Starts containerd again after [`Cri::power_off`], on the configuration and CNI directories
    /// of [`Cri::start`]: it knows no sandbox.
    pub(crate) fn power_on(&mut self) {
        assert!(self.containerd.is_none(), "power_on while containerd runs");
        let dir = self.traces().dir;
        self.launch(&dir.join("cni-bin"), &dir.join("cni-conf"), &[]);
    }

    /// Stops containerd with SIGSTOP, as a hung runtime: its socket accepts, nothing answers.
    pub(crate) fn pause_containerd(&self) {
        assert!(self.signal_containerd("STOP"), "SIGSTOP to containerd");
    }

    /// Lets a paused containerd go on (SIGCONT; harmless when it runs).
    pub(crate) fn resume_containerd(&self) {
        self.signal_containerd("CONT");
    }

    /// Sends SIG`signal` to containerd; whether it was sent (false when it is not running).
    fn signal_containerd(&self, signal: &str) -> bool {
        self.containerd.as_ref().is_some_and(|child| {
            run_quietly(Command::new("kill").args([format!("-{signal}"), child.id().to_string()]))
        })
    }

    /// containerd's log so far (for failure messages).
    pub(crate) fn log(&self) -> String {
        let path = self.traces().dir.join("logs/containerd.log");
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    pub(crate) fn python(&self, args: &[&str]) -> Result<String, String> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/system/cri/cri.py");
        let output = Command::new(PYTHON)
            .arg(script)
            .args(args)
            .output()
            .map_err(|e| format!("cannot run {PYTHON}: {e}"))?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&output.stderr).trim().to_owned())
        }
    }

    /// Runs the gRPC driver against this containerd; its JSON answer, or its error line.
    fn driver(&self, args: &[&str]) -> Result<Value, String> {
        let socket = self.traces().socket.to_string_lossy().into_owned();
        let stubs = self.stubs.to_string_lossy().into_owned();
        let mut all = vec!["--stubs", &stubs, "--socket", &socket];
        all.extend_from_slice(args);
        let stdout = self.python(&all)?;
        serde_json::from_str(&stdout).map_err(|e| format!("not JSON ({e}): {stdout}"))
    }

    /// One RuntimeService call.
    pub(crate) fn call(&self, method: &str, request: &Value) -> Result<Value, String> {
        self.driver(&["call", method, &request.to_string()])
    }

    /// RunPodSandbox for pod `name` in `namespace` with `annotations`: its sandbox id, or the error.
    pub(crate) fn run_pod(
        &self,
        name: &str,
        namespace: &str,
        annotations: &BTreeMap<&str, String>,
    ) -> Result<String, String> {
        let cgroup_parent = self.traces().cgroup_parent;
        let request = json!({"config": {
            "metadata": {"name": name, "uid": format!("uid-{name}"), "namespace": namespace, "attempt": 0},
            "hostname": name,
            "annotations": annotations,
            "linux": {
                "cgroup_parent": cgroup_parent,
                "security_context": {"namespace_options": {"network": "POD"}}
            }
        }});
        self.run_pod_config(&request["config"])
    }

    /// RunPodSandbox with this whole PodSandboxConfig: its sandbox id, or the error.
    pub(crate) fn run_pod_config(&self, config: &Value) -> Result<String, String> {
        let request = json!({ "config": config });
        let response = self.call("RunPodSandbox", &request)?;
        let id = response["pod_sandbox_id"]
            .as_str()
            .unwrap_or_else(|| panic!("RunPodSandbox answered without an id: {response}"))
            .to_owned();
        self.traces
            .lock()
            .expect("traces")
            .sandbox_ids
            .push(id.clone());
        Ok(id)
    }

    pub(crate) fn status(&self, id: &str) -> Value {
        self.call("PodSandboxStatus", &json!({"pod_sandbox_id": id}))
            .unwrap_or_else(|e| panic!("PodSandboxStatus {id}: {e}"))
    }

    pub(crate) fn stop_pod(&self, id: &str) {
        self.call("StopPodSandbox", &json!({"pod_sandbox_id": id}))
            .unwrap_or_else(|e| panic!("StopPodSandbox {id}: {e}\n{}", self.log()));
    }

    pub(crate) fn remove_pod(&self, id: &str) {
        self.call("RemovePodSandbox", &json!({"pod_sandbox_id": id}))
            .unwrap_or_else(|e| panic!("RemovePodSandbox {id}: {e}\n{}", self.log()));
    }

    /// CreateContainer then StartContainer in sandbox `sandbox_id` (made from `sandbox_config`):
    /// the container's id, or the error.
    pub(crate) fn run_container(
        &self,
        sandbox_id: &str,
        sandbox_config: &Value,
        config: &Value,
    ) -> Result<String, String> {
        let created = self.call(
            "CreateContainer",
            &json!({"pod_sandbox_id": sandbox_id, "config": config, "sandbox_config": sandbox_config}),
        )?;
        let id = created["container_id"]
            .as_str()
            .ok_or_else(|| format!("CreateContainer answered without an id: {created}"))?
            .to_owned();
        self.call("StartContainer", &json!({"container_id": id}))?;
        Ok(id)
    }

    /// ContainerStatus's `status` object.
    pub(crate) fn container_status(&self, id: &str) -> Value {
        self.call("ContainerStatus", &json!({"container_id": id}))
            .unwrap_or_else(|e| panic!("ContainerStatus {id}: {e}"))["status"]
            .clone()
    }

    /// StopContainer with the grace period a kubelet gives (SIGTERM, then SIGKILL after it).
    pub(crate) fn stop_container(&self, id: &str, grace_seconds: u64) {
        self.call(
            "StopContainer",
            &json!({"container_id": id, "timeout": grace_seconds}),
        )
        .unwrap_or_else(|e| panic!("StopContainer {id}: {e}\n{}", self.log()));
    }

    /// ExecSync (`kubectl exec`): exit code, stdout and stderr of `command` in container `id`.
    pub(crate) fn exec_sync(&self, id: &str, command: &[&str]) -> (i64, String, String) {
        let answer = self
            .call(
                "ExecSync",
                &json!({"container_id": id, "cmd": command, "timeout": 30}),
            )
            .unwrap_or_else(|e| panic!("ExecSync {command:?} in {id}: {e}"));
        let text = |field: &str| {
            String::from_utf8_lossy(&base64_decode(answer[field].as_str().unwrap_or("")))
                .into_owned()
        };
        (
            answer["exit_code"].as_i64().unwrap_or(-1),
            text("stdout"),
            text("stderr"),
        )
    }

    pub(crate) fn list_pods(&self) -> Result<Vec<String>, String> {
        let listed = self.call("ListPodSandbox", &json!({}))?;
        Ok(listed["items"]
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .filter_map(|item| item["id"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default())
    }
}

impl Drop for Cri {
    fn drop(&mut self) {
        // 0. A containerd a test paused and did not resume (an assertion failed meanwhile).
        self.resume_containerd();
        // 1. Pods still there: stopped and removed through the CRI (this runs the CNI DELs).
        if self.containerd.is_some() {
            match self.list_pods() {
                Ok(ids) => {
                    for id in ids {
                        self.traces
                            .lock()
                            .map(|mut t| {
                                if !t.sandbox_ids.contains(&id) {
                                    t.sandbox_ids.push(id.clone());
                                }
                            })
                            .ok();
                        for method in ["StopPodSandbox", "RemovePodSandbox"] {
                            if let Err(e) = self.call(method, &json!({"pod_sandbox_id": id})) {
                                eprintln!("cleanup: {method} {id}: {e}");
                            }
                        }
                    }
                }
                Err(e) => eprintln!("cleanup: ListPodSandbox: {e}"),
            }
        }
        let traces = match self.traces.lock() {
            Ok(t) => t.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        // 2. containerd: SIGTERM, then SIGKILL if it has not gone after about 10 s.
        if let Some(mut child) = self.containerd.take() {
            run_quietly(Command::new("kill").args(["-TERM", &child.id().to_string()]));
            let mut exited = false;
            for _ in 0..100 {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    exited = true;
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            if !exited {
                eprintln!("cleanup: containerd ignored SIGTERM; killing it");
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        // 3-5. Shims, containers, mounts and cgroups.
        traces.stop_everything_started();
        // 6. libcni's cache entries and the shim sockets of this run.
        for entry in traces.cache_entries() {
            let _ = std::fs::remove_file(entry);
        }
        for id in &traces.sandbox_ids {
            if let Some(socket) = traces.shim_socket(id) {
                let _ = std::fs::remove_file(socket);
            }
        }
        for shared in self.created_shared_dirs.iter().rev() {
            // Only when empty: something else may have started using it meanwhile.
            let _ = std::fs::remove_dir(shared);
        }
        // 7. Mount points made for the private mount namespace (gone with containerd), deepest first.
        for point in self.created_mount_points.iter().rev() {
            // Already gone when it was also a shared directory this run created (step 6).
            if let Err(e) = std::fs::remove_dir(point).or_else(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    Ok(())
                } else {
                    Err(e)
                }
            }) {
                eprintln!(
                    "cleanup: cannot remove the mount point {}: {e}",
                    point.display()
                );
            }
        }
        // 8. The namespace, and the directory (before the sandbox removes the rest).
        if traces.netns_exists() {
            run_quietly(Command::new("ip").args(["netns", "del", &traces.host_netns]));
        }
        if let Err(e) = std::fs::remove_dir_all(&traces.dir) {
            eprintln!("cleanup: cannot remove {}: {e}", traces.dir.display());
        }
    }
}

/// Removes a cgroup directory and its child cgroups (a cgroup is removed with rmdir, children first).
pub(crate) fn remove_cgroup_tree(path: &Path) {
    if let Ok(entries) = std::fs::read_dir(path) {
        for entry in entries.filter_map(Result::ok) {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup_tree(&entry.path());
            }
        }
    }
    if let Err(e) = std::fs::remove_dir(path) {
        eprintln!("cleanup: cannot remove cgroup {}: {e}", path.display());
    }
}

/// containerd's configuration: everything of its own under the run's directory, the `native`
/// snapshotter, runc with cgroupfs, and what the CRI plugin needs on this machine
/// (`restrict_oom_score_adj`: root here cannot set the -998 CRI gives sandboxes).
pub(crate) fn containerd_config(traces: &Traces, bin_dir: &Path, conf_dir: &Path) -> String {
    let dir = traces.dir.display();
    let socket = traces.socket.display();
    format!(
        r#"version = 2
root = "{dir}/root"
state = "{dir}/state"
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.overlayfs", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{SANDBOX_IMAGE}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{dir}/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{bin}"
    conf_dir = "{conf}"
    max_conf_num = 1
"#,
        bin = bin_dir.display(),
        conf = conf_dir.display(),
    )
}

/// Decodes standard base64 (the proto3 JSON mapping of `bytes` fields); stops at padding.
pub(crate) fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' | b'-' => Some(62),
        b'/' | b'_' => Some(63),
        _ => None,
    };
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut buffer, mut bits) = (0u32, 0u32);
    for c in text.bytes().map_while(value) {
        buffer = (buffer << 6) | u32::from(c);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push(((buffer >> bits) & 0xff) as u8);
        }
    }
    out
}

/// Runs `blockipamctl -o json <args>` on the sled store at `store` (in-process, through the library
/// entry point the binary calls), through the agent at `agent_socket` or directly, and returns its
/// JSON output; panics unless it succeeds.
pub(crate) fn ctl_on(store: &Path, agent_socket: Option<&Path>, args: &[&str]) -> Value {
    let (status, stdout, stderr) = ctl_run(store, agent_socket, args);
    assert_eq!(
        status, 0,
        "blockipamctl {args:?} failed: {stdout}\n{stderr}"
    );
    serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("blockipamctl {args:?}: not JSON ({e}): {stdout}"))
}

/// As [`ctl_on`], whatever the outcome: the exit status, stdout and stderr.
pub(crate) fn ctl_run(
    store: &Path,
    agent_socket: Option<&Path>,
    args: &[&str],
) -> (i32, String, String) {
    let store = store.display().to_string();
    let socket = agent_socket.map_or_else(|| "none".to_owned(), |s| s.display().to_string());
    let mut argv: Vec<String> = [
        "blockipamctl",
        "-o",
        "json",
        "--datastore-type",
        "sled",
        "--datastore-path",
        &store,
        "--agent-socket",
        &socket,
        "--lock-wait-seconds",
        "10",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    argv.extend(args.iter().map(|a| (*a).to_owned()));
    let env = blockipamctl::Env::new(Vec::<(String, String)>::new());
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let status = blockipamctl::run(argv, &env, &mut stdout, &mut stderr, false);
    (
        status,
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    )
}
