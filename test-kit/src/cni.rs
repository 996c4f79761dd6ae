//! Running a CNI plugin as a runtime does: the CNI environment, the netconf on standard input,
//! and its exit status, standard output and standard error collected within a time bound.

use std::ffi::{OsStr, OsString};
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
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
/// written to its standard input, and collects what it produced: [`start_cni`] then
/// [`CniProcess::finish`].
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
    start_cni(program, args, env.iter().map(|(k, v)| (k, v)), stdin).finish(hang_guard)
}

/// Starts `program` with `args` and exactly the environment `env` (nothing inherited; values
/// need not be UTF-8), writes `stdin` to its standard input from a thread of its own (a program
/// that exits without reading it is fine) and reads its output as it comes.
///
/// # Panics
/// When the program cannot be started.
pub fn start_cni<K, V>(
    program: &Path,
    args: &[&str],
    env: impl IntoIterator<Item = (K, V)>,
    stdin: &[u8],
) -> CniProcess
where
    K: AsRef<OsStr>,
    V: AsRef<OsStr>,
{
    let env: Vec<(OsString, OsString)> = env
        .into_iter()
        .map(|(k, v)| (k.as_ref().to_owned(), v.as_ref().to_owned()))
        .collect();
    let command = env
        .iter()
        .find(|(name, _)| name == "CNI_COMMAND")
        .map(|(_, value)| value.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut child = Command::new(program)
        .args(args)
        .env_clear()
        .envs(env)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
    let feeder = child.stdin.take().map(|mut pipe| {
        let input = stdin.to_vec();
        // A plugin may exit without reading (VERSION, an environment error): a broken pipe is
        // fine.
        std::thread::spawn(move || {
            let _ = pipe.write_all(&input);
        })
    });
    let stdout = read_to_end_on_a_thread(child.stdout.take());
    let stderr = read_to_end_on_a_thread(child.stderr.take());
    CniProcess {
        child,
        feeder,
        stdout,
        stderr,
        what: format!("{} ({command})", program.display()),
    }
}

/// A process started by [`start_cni`].
#[derive(Debug)]
pub struct CniProcess {
    child: Child,
    feeder: Option<JoinHandle<()>>,
    stdout: JoinHandle<Vec<u8>>,
    stderr: JoinHandle<Vec<u8>>,
    /// The program and its `CNI_COMMAND`, for messages.
    what: String,
}

/// How a process started by [`start_cni`] ended.
#[derive(Debug)]
pub struct Ended {
    /// Its exit status.
    pub status: ExitStatus,
    /// Standard output (invalid UTF-8 replaced).
    pub stdout: String,
    /// Standard error (invalid UTF-8 replaced).
    pub stderr: String,
    /// It outlived the bound and was killed.
    pub hung: bool,
}

impl From<Ended> for Outcome {
    fn from(ended: Ended) -> Self {
        Outcome {
            status: ended.status.code().unwrap_or(-1),
            stdout: ended.stdout,
            stderr: ended.stderr,
        }
    }
}

impl CniProcess {
    /// Sends it `SIGKILL`.
    ///
    /// # Errors
    /// When it was already reaped.
    pub fn kill(&mut self) -> std::io::Result<()> {
        self.child.kill()
    }

    /// Waits until it ends; one still running after `hang_guard` is killed and reported as
    /// hung. A bound that only turns a hang into a result, not a timing assertion.
    ///
    /// # Panics
    /// When it cannot be waited for, or an output reader panicked.
    pub fn wait_or_kill(mut self, hang_guard: Duration) -> Ended {
        let deadline = Instant::now() + hang_guard;
        let mut hung = false;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("poll the plugin") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                hung = true;
                break self.child.wait().expect("reap the killed plugin");
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        if let Some(feeder) = self.feeder {
            let _ = feeder.join();
        }
        let text = |reader: JoinHandle<Vec<u8>>| {
            String::from_utf8_lossy(&reader.join().expect("an output reader")).into_owned()
        };
        Ended {
            status,
            stdout: text(self.stdout),
            stderr: text(self.stderr),
            hung,
        }
    }

    /// As [`wait_or_kill`](Self::wait_or_kill), failing the test when it hung.
    ///
    /// # Panics
    /// When it outlived `hang_guard`.
    pub fn wait(self, hang_guard: Duration) -> Ended {
        let what = self.what.clone();
        let ended = self.wait_or_kill(hang_guard);
        assert!(!ended.hung, "{what} hung: killed after {hang_guard:?}");
        ended
    }

    /// As [`wait`](Self::wait), as an [`Outcome`].
    ///
    /// # Panics
    /// As [`wait`](Self::wait).
    pub fn finish(self, hang_guard: Duration) -> Outcome {
        self.wait(hang_guard).into()
    }
}

/// Reads `pipe` (if any) to its end on a thread of its own, so that a full pipe never blocks the
/// child.
fn read_to_end_on_a_thread(pipe: Option<impl Read + Send + 'static>) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut bytes);
        }
        bytes
    })
}

/// Every address (without prefix) of an ADD result of spec 0.3.0 or later; none for anything
/// else.
pub fn result_addresses(result: &Value) -> Vec<String> {
    result["ips"]
        .as_array()
        .map(|ips| {
            ips.iter()
                .filter_map(|ip| ip["address"].as_str())
                .filter_map(|a| a.split('/').next())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}
