//! Running a CNI plugin as a runtime does: the CNI environment, the netconf on standard input,
//! and its exit status, standard output and standard error collected within a time bound.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A bound for calls whose test gives none: it only turns a hung plugin into a test failure.
pub const HANG_GUARD: Duration = Duration::from_secs(300);

/// What one plugin call produced.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Exit status (-1 when killed by a signal).
    pub status: i32,
    /// Standard output, verbatim.
    pub stdout: String,
    /// Standard error, verbatim.
    pub stderr: String,
}

impl Outcome {
    /// Stdout parsed as JSON (panics with the whole outcome when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:#?}"))
    }

    /// Asserts success with empty stdout.
    pub fn assert_silent_success(&self, what: &str) {
        assert_eq!(self.status, 0, "{what} failed: {self:#?}");
        assert_eq!(self.stdout, "", "{what} printed on stdout: {self:#?}");
    }

    /// Asserts success and returns the result JSON.
    pub fn success_json(&self, what: &str) -> Value {
        assert_eq!(self.status, 0, "{what} failed: {self:#?}");
        self.json()
    }

    /// Asserts an error JSON with `code` (and the exact key set the spec defines) and
    /// returns its message.
    pub fn assert_error(&self, code: u64, what: &str) -> String {
        assert_ne!(self.status, 0, "{what} should have failed: {self:#?}");
        let value = self.json();
        let object = value.as_object().expect("error is an object");
        let keys: Vec<&str> = object.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            vec!["cniVersion", "code", "details", "msg"],
            "{what}: error JSON keys: {self:#?}"
        );
        assert_eq!(value["code"], json!(code), "{what}: wrong code: {self:#?}");
        value["msg"].as_str().expect("msg is a string").to_owned()
    }
}

/// The environment the spec requires for `command` on container `container`, interface
/// `ifname`: `CNI_CONTAINERID` and `CNI_IFNAME` for ADD, DEL and CHECK, `CNI_NETNS`
/// (`/var/run/netns/<container>`) for ADD and CHECK, `CNI_PATH` (`/usr/lib/cni`) for every
/// command but VERSION.
pub fn cni_env(command: &str, container: &str, ifname: &str) -> Vec<(String, String)> {
    let mut env = vec![("CNI_COMMAND".to_owned(), command.to_owned())];
    if matches!(command, "ADD" | "DEL" | "CHECK") {
        env.push(("CNI_CONTAINERID".to_owned(), container.to_owned()));
        env.push(("CNI_IFNAME".to_owned(), ifname.to_owned()));
    }
    if matches!(command, "ADD" | "CHECK") {
        env.push((
            "CNI_NETNS".to_owned(),
            format!("/var/run/netns/{container}"),
        ));
    }
    if command != "VERSION" {
        env.push(("CNI_PATH".to_owned(), "/usr/lib/cni".to_owned()));
    }
    env
}

/// Every CNI variable whatever the command, as some runtimes send them: `CNI_COMMAND`,
/// `CNI_CONTAINERID`, `CNI_NETNS`, `CNI_IFNAME` and `CNI_PATH`.
pub fn full_cni_env(
    command: &str,
    container: &str,
    ifname: &str,
    netns: &str,
    cni_path: &str,
) -> Vec<(String, String)> {
    [
        ("CNI_COMMAND", command),
        ("CNI_CONTAINERID", container),
        ("CNI_NETNS", netns),
        ("CNI_IFNAME", ifname),
        ("CNI_PATH", cni_path),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value.to_owned()))
    .collect()
}

/// Runs `program` with `args`, exactly the environment `env` (nothing inherited) and `stdin`
/// written to its standard input (a program that exits without reading it is fine), and
/// collects what it produced. A program still running after `hang_guard` is killed and the test
/// fails: a safety net, not a timing assertion.
///
/// # Panics
/// When the program cannot be started, or outlives `hang_guard`.
pub fn run_cni(
    program: &Path,
    args: &[&str],
    env: &[(String, String)],
    stdin: &[u8],
    hang_guard: Duration,
) -> Outcome {
    let mut child = Command::new(program)
        .args(args)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
    let stdout = child.stdout.take().map(read_to_end_on_a_thread);
    let stderr = child.stderr.take().map(read_to_end_on_a_thread);
    if let Some(mut input) = child.stdin.take() {
        // A plugin may exit without reading (VERSION): a broken pipe is fine.
        let _ = input.write_all(stdin);
    }
    let deadline = Instant::now() + hang_guard;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the plugin") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let command = env
                .iter()
                .find(|(name, _)| name == "CNI_COMMAND")
                .map_or("", |(_, value)| value.as_str());
            panic!(
                "{} ({command}) hung: killed after {hang_guard:?}",
                program.display()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let collect = |reader: Option<std::thread::JoinHandle<String>>| {
        reader
            .map(|reader| reader.join().expect("an output reader"))
            .unwrap_or_default()
    };
    Outcome {
        status: status.code().unwrap_or(-1),
        stdout: collect(stdout),
        stderr: collect(stderr),
    }
}

/// Reads `pipe` to its end on a thread of its own, so that a full pipe never blocks the child.
fn read_to_end_on_a_thread(
    mut pipe: impl Read + Send + 'static,
) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}
