//! Running the CNI plugin binary the way a container runtime does: an environment holding only
//! the CNI variables (and what the caller adds), the netconf on standard input, the result on
//! standard output. `blockipamctl demo` and the load generator's plugin mode both call it.

use std::fmt;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::AsyncWriteExt;

/// `ETXTBSY`: the binary is still open for writing (just built or copied); retried briefly.
const TEXT_FILE_BUSY: i32 = 26;
/// How often, 25 ms apart, a busy binary is tried again.
const BUSY_RETRIES: u32 = 20;

/// One call of the plugin for one container, on interface `eth0` in `/var/run/netns/<id>`.
#[derive(Debug, Clone, Copy)]
pub struct PluginCall<'a> {
    /// The plugin binary; its directory is `CNI_PATH`.
    pub plugin: &'a Path,
    /// `CNI_COMMAND`: `ADD`, `DEL`, `CHECK`, ...
    pub command: &'a str,
    /// `CNI_CONTAINERID`.
    pub container_id: &'a str,
    /// Variables set besides the CNI ones (`PATH`, `CNI_ARGS`); nothing else is inherited.
    pub extra_env: &'a [(&'a str, &'a str)],
}

/// What the plugin answered.
#[derive(Debug, Clone)]
pub struct PluginOutput {
    /// Its exit status.
    pub status: ExitStatus,
    /// Its standard output (the CNI result or error).
    pub stdout: Vec<u8>,
    /// Its standard error (its log, when it logs there).
    pub stderr: Vec<u8>,
}

/// Why the plugin could not be run to its end.
#[derive(Debug)]
pub enum PluginCallError {
    /// The binary could not be started.
    Spawn(std::io::Error),
    /// Its output could not be read.
    Wait(std::io::Error),
    /// It had not finished when the caller's bound ran out (it is killed).
    TimedOut(Duration),
}

impl fmt::Display for PluginCallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PluginCallError::Spawn(e) => write!(f, "cannot start it: {e}"),
            PluginCallError::Wait(e) => write!(f, "cannot read its answer: {e}"),
            PluginCallError::TimedOut(bound) => {
                write!(f, "it did not finish within {} s", bound.as_secs())
            }
        }
    }
}

impl std::error::Error for PluginCallError {}

/// Runs `call` with `netconf` on standard input, killing the plugin if it is still running after
/// `bound` (when given). A plugin that exits without reading its input is judged by its exit
/// status, not here.
///
/// # Errors
/// [`PluginCallError`]: the binary could not be started, its answer not read, or the bound ran
/// out.
pub async fn run_plugin(
    call: &PluginCall<'_>,
    netconf: &[u8],
    bound: Option<Duration>,
) -> Result<PluginOutput, PluginCallError> {
    let cni_path = call.plugin.parent().unwrap_or(Path::new(""));
    let mut attempts = 0;
    let mut child = loop {
        let mut command = tokio::process::Command::new(call.plugin);
        command
            .env_clear()
            .envs(call.extra_env.iter().copied())
            .env("CNI_COMMAND", call.command)
            .env("CNI_CONTAINERID", call.container_id)
            .env("CNI_NETNS", format!("/var/run/netns/{}", call.container_id))
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", cni_path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        match command.spawn() {
            Ok(child) => break child,
            Err(e) if e.raw_os_error() == Some(TEXT_FILE_BUSY) && attempts < BUSY_RETRIES => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            Err(e) => return Err(PluginCallError::Spawn(e)),
        }
    };
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(netconf).await;
        drop(stdin);
    }
    let output = match bound {
        Some(bound) => tokio::time::timeout(bound, child.wait_with_output())
            .await
            .map_err(|_| PluginCallError::TimedOut(bound))?,
        None => child.wait_with_output().await,
    }
    .map_err(PluginCallError::Wait)?;
    Ok(PluginOutput {
        status: output.status,
        stdout: output.stdout,
        stderr: output.stderr,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn script(dir: &Path, body: &str) -> std::path::PathBuf {
        let path = dir.join("plugin");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write the script");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    }

    #[tokio::test]
    async fn the_plugin_sees_only_the_cni_variables_and_the_netconf_on_stdin() {
        let dir = tempfile::tempdir().expect("temp dir");
        let plugin = script(
            dir.path(),
            r#"printf '%s|%s|%s|%s|%s|%s|' "$CNI_COMMAND" "$CNI_CONTAINERID" "$CNI_NETNS" "$CNI_IFNAME" "$CNI_ARGS" "${HOME:-unset}"; cat; echo err >&2; exit 3"#,
        );
        let call = PluginCall {
            plugin: &plugin,
            command: "ADD",
            container_id: "c1",
            extra_env: &[("CNI_ARGS", "IgnoreUnknown=1"), ("PATH", "/usr/bin:/bin")],
        };
        let output = run_plugin(&call, b"{\"netconf\":1}", Some(Duration::from_secs(30)))
            .await
            .expect("the script runs");
        assert_eq!(output.status.code(), Some(3));
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            "ADD|c1|/var/run/netns/c1|eth0|IgnoreUnknown=1|unset|{\"netconf\":1}"
        );
        assert_eq!(String::from_utf8_lossy(&output.stderr), "err\n");
    }

    #[tokio::test]
    async fn a_plugin_past_its_bound_is_reported_and_a_missing_one_cannot_start() {
        let dir = tempfile::tempdir().expect("temp dir");
        let plugin = script(dir.path(), "exec sleep 30");
        let call = PluginCall {
            plugin: &plugin,
            command: "ADD",
            container_id: "c1",
            extra_env: &[("PATH", "/usr/bin:/bin")],
        };
        let late = run_plugin(&call, b"{}", Some(Duration::from_millis(200))).await;
        assert!(
            matches!(late, Err(PluginCallError::TimedOut(_))),
            "{late:?}"
        );
        let missing = dir.path().join("absent");
        let absent = PluginCall {
            plugin: &missing,
            ..call
        };
        let refused = run_plugin(&absent, b"{}", None).await;
        assert!(
            matches!(refused, Err(PluginCallError::Spawn(_))),
            "{refused:?}"
        );
    }

    /// A plugin that copies its input to its output, and a handle holding it open for writing
    /// (which makes starting it fail with `ETXTBSY` while the handle lives).
    fn busy_binary(dir: &Path) -> (std::path::PathBuf, std::fs::File) {
        let plugin = script(dir, "cat");
        let writer = std::fs::OpenOptions::new()
            .append(true)
            .open(&plugin)
            .expect("hold the binary open for writing");
        (plugin, writer)
    }

    #[tokio::test]
    async fn a_binary_still_open_for_writing_is_started_once_it_is_closed() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (plugin, writer) = busy_binary(dir.path());
        let call = PluginCall {
            plugin: &plugin,
            command: "ADD",
            container_id: "c1",
            extra_env: &[("PATH", "/usr/bin:/bin")],
        };
        let closing = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            drop(writer);
        });
        let output = run_plugin(&call, b"{}", Some(Duration::from_secs(30)))
            .await
            .expect("started once the writer closed it");
        closing.await.expect("the writer closed");
        assert_eq!(output.status.code(), Some(0));
        assert_eq!(output.stdout, b"{}");
    }

    #[tokio::test]
    async fn a_binary_held_open_for_writing_is_given_up_on_after_its_retries() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (plugin, _writer) = busy_binary(dir.path());
        let call = PluginCall {
            plugin: &plugin,
            command: "ADD",
            container_id: "c1",
            extra_env: &[],
        };
        let busy = tokio::time::timeout(Duration::from_secs(20), run_plugin(&call, b"{}", None))
            .await
            .expect("the retries end");
        match busy {
            Err(PluginCallError::Spawn(e)) => assert_eq!(e.raw_os_error(), Some(TEXT_FILE_BUSY)),
            other => panic!("expected a busy binary, got {other:?}"),
        }
    }

    #[test]
    fn each_failure_says_what_went_wrong() {
        let busy = || std::io::Error::from_raw_os_error(TEXT_FILE_BUSY);
        assert!(PluginCallError::Spawn(busy())
            .to_string()
            .starts_with("cannot start it: Text file busy"));
        assert!(PluginCallError::Wait(busy())
            .to_string()
            .starts_with("cannot read its answer: Text file busy"));
        assert_eq!(
            PluginCallError::TimedOut(Duration::from_millis(5_500)).to_string(),
            "it did not finish within 5 s"
        );
    }
}
