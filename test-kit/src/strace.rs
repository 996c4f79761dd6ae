//! Reading `strace -f` output: which files a traced process wrote, synced and renamed, and when
//! it reported (wrote to standard output or to a connection it accepted, or exited), for tests of
//! what reaches the disk before a process says it is done. Needs `strace` (`scripts/setup`
//! installs it).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The system calls a trace must record for [`file_calls`] to see everything it reads.
pub const TRACED_CALLS: &str =
    "open,openat,close,fsync,fdatasync,rename,write,pwrite64,writev,pwritev,pwritev2,sendmsg,sendto,\
     accept,accept4,exit_group";

/// What the traced process did to files, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileCall {
    /// `fsync` or `fdatasync` of a descriptor opened on this path.
    Synced(String),
    /// A successful rename.
    Renamed { from: String, to: String },
    /// `write`, `pwrite64`, `writev` or `pwritev` to a descriptor opened on this path.
    Wrote(String),
    /// A write to standard output: what the command reports.
    Printed,
    /// A write to a connection the process accepted: a server's answer.
    Answered,
    /// The process ended (`exit_group`): a command that prints nothing reports by its status.
    Exited,
}

/// The calls that write to a descriptor, by the name strace gives them.
const WRITE_CALLS: [&str; 7] = [
    "write", "pwrite64", "writev", "pwritev", "pwritev2", "sendmsg", "sendto",
];

/// The quoted path that `call` (one line of strace's output) names first.
fn first_path(call: &str) -> Option<String> {
    let start = call.find('"')? + 1;
    let length = call[start..].find('"')?;
    Some(call[start..start + length].to_owned())
}

/// The descriptor a call returned (`... = 12`), when it succeeded.
fn returned_descriptor(call: &str) -> Option<u32> {
    call.rsplit_once(" = ")?.1.trim().parse().ok()
}

/// The descriptor a call's first argument names (`fsync(12)`, `fdatasync(12 <unfinished ...>`).
fn argument_descriptor(call: &str, name: &str) -> Option<u32> {
    let rest = call.split_once(&format!(" {name}("))?.1;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The file calls of a trace written by `strace -f -e trace=`[`TRACED_CALLS`]: each descriptor
/// followed from its `openat` or `accept` to its `close` (a call another thread cut in on,
/// `<unfinished ...>` then `<... openat resumed>`, completed by its thread's next line).
pub fn file_calls(trace: &str) -> Vec<FileCall> {
    let mut open: BTreeMap<u32, String> = BTreeMap::new();
    let mut opening: BTreeMap<String, String> = BTreeMap::new();
    let mut connections: BTreeSet<u32> = BTreeSet::new();
    let mut accepting: BTreeSet<String> = BTreeSet::new();
    let mut calls = Vec::new();
    for line in trace.lines() {
        let Some((thread, call)) = line.split_once(' ') else {
            continue;
        };
        let call = format!(" {}", call.trim_start());
        // A static musl build opens with `open`, a glibc one with `openat`.
        if call.contains(" openat(") || call.contains(" open(") {
            let Some(path) = first_path(&call) else {
                continue;
            };
            match returned_descriptor(&call) {
                Some(fd) => {
                    open.insert(fd, path);
                }
                None if call.ends_with("<unfinished ...>") => {
                    opening.insert(thread.to_owned(), path);
                }
                None => {}
            }
        } else if call.contains("<... openat resumed>") || call.contains("<... open resumed>") {
            if let (Some(path), Some(fd)) = (opening.remove(thread), returned_descriptor(&call)) {
                open.insert(fd, path);
            }
        } else if call.contains(" accept(") || call.contains(" accept4(") {
            match returned_descriptor(&call) {
                Some(fd) => {
                    connections.insert(fd);
                }
                None if call.ends_with("<unfinished ...>") => {
                    accepting.insert(thread.to_owned());
                }
                None => {}
            }
        } else if call.contains("<... accept resumed>") || call.contains("<... accept4 resumed>") {
            if let (true, Some(fd)) = (accepting.remove(thread), returned_descriptor(&call)) {
                connections.insert(fd);
            }
        } else if let Some(fd) = argument_descriptor(&call, "close") {
            open.remove(&fd);
            connections.remove(&fd);
        } else if let Some(fd) =
            argument_descriptor(&call, "fsync").or_else(|| argument_descriptor(&call, "fdatasync"))
        {
            if let Some(path) = open.get(&fd) {
                calls.push(FileCall::Synced(path.clone()));
            }
        } else if let Some(fd) = WRITE_CALLS
            .iter()
            .find_map(|name| argument_descriptor(&call, name))
        {
            if fd == 1 {
                calls.push(FileCall::Printed);
            } else if connections.contains(&fd) {
                calls.push(FileCall::Answered);
            } else if let Some(path) = open.get(&fd) {
                calls.push(FileCall::Wrote(path.clone()));
            }
        } else if call.contains(" exit_group(") {
            calls.push(FileCall::Exited);
        } else if call.contains(" rename(") && call.trim_end().ends_with("= 0") {
            let mut paths = call.split('"').skip(1).step_by(2);
            if let (Some(from), Some(to)) = (paths.next(), paths.next()) {
                calls.push(FileCall::Renamed {
                    from: from.to_owned(),
                    to: to.to_owned(),
                });
            }
        }
    }
    calls
}

/// The files under `store` that `calls` wrote and had not synced since when the process reported
/// (each write to standard output or to a connection it accepted, and its exit): each once, in
/// the order of their last write.
///
/// # Panics
/// When the trace shows no report, or no write under `store` before its last report (it could
/// then tell nothing).
pub fn written_and_not_synced_at_a_report(calls: &[FileCall], store: &str) -> Vec<String> {
    let mut unsynced: Vec<String> = Vec::new();
    let mut found: Vec<String> = Vec::new();
    let mut wrote_any = false;
    let mut reported_after_a_write = false;
    for call in calls {
        match call {
            FileCall::Wrote(path) if path.starts_with(store) => {
                wrote_any = true;
                unsynced.retain(|p| p != path);
                unsynced.push(path.clone());
            }
            FileCall::Synced(path) => unsynced.retain(|p| p != path),
            FileCall::Printed | FileCall::Answered | FileCall::Exited => {
                reported_after_a_write |= wrote_any;
                for path in &unsynced {
                    if !found.contains(path) {
                        found.push(path.clone());
                    }
                }
            }
            _ => {}
        }
    }
    assert!(
        reported_after_a_write,
        "no report after a write to the store: the trace cannot tell\n{calls:#?}"
    );
    found
}

/// How many of the process's answers and writes to standard output (its exit aside) came after
/// a sync of a file under `store` made since its previous report: a commit answered as durable
/// must be one of them (a store that writes nothing until it closes leaves no unsynced write to
/// find, and no sync either).
pub fn reports_after_a_sync(calls: &[FileCall], store: &str) -> usize {
    let mut synced_since_report = false;
    let mut count = 0;
    for call in calls {
        match call {
            FileCall::Synced(path) if path.starts_with(store) => synced_since_report = true,
            FileCall::Printed | FileCall::Answered => {
                count += usize::from(synced_since_report);
                synced_since_report = false;
            }
            FileCall::Exited => synced_since_report = false,
            _ => {}
        }
    }
    count
}

/// Where `strace` is, found on `PATH` (a test that clears its child's environment needs the
/// path itself).
///
/// # Panics
/// When strace is not installed: the test fails loudly rather than skip.
pub fn strace_path() -> PathBuf {
    crate::find_on_path("strace").unwrap_or_else(|| {
        panic!("strace is needed to see the system calls (scripts/setup installs it)")
    })
}

/// The arguments that run `program` under `strace -f`, every thread's [`TRACED_CALLS`] written
/// to `trace`.
pub fn traced_args(trace: &Path, program: &Path) -> Vec<String> {
    vec![
        "-f".to_owned(),
        "-qq".to_owned(),
        "-e".to_owned(),
        format!("trace={TRACED_CALLS}"),
        "-o".to_owned(),
        trace.display().to_string(),
        program.display().to_string(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trace_reader_follows_descriptors_across_threads_and_their_reuse() {
        let trace = "\
7 openat(AT_FDCWD, \"/d/a\", O_RDONLY|O_CLOEXEC) = 11
7 fsync(11)                         = 0
7 close(11)                         = 0
7 open(\"/d/m\", O_RDWR|O_CLOEXEC)   = 12
7 fdatasync(12)                     = 0
7 close(12)                         = 0
8 openat(AT_FDCWD, \"/d/b\", O_RDONLY|O_CLOEXEC <unfinished ...>
7 fdatasync(3)                      = 0
8 <... openat resumed>)             = 11
7 fdatasync(11 <unfinished ...>
8 rename(\"/d/b\", \"/d/c\")        = 0
8 rename(\"/d/x\", \"/d/y\")        = -1 ENOENT (No such file or directory)
7 <... fdatasync resumed>)          = 0
8 pwrite64(11, \"abc\", 3, 4096)     = 3
7 write(1, \"done\\n\", 5 <unfinished ...>
8 write(9, \"x\", 1)                 = 1
7 <... write resumed>)              = 5
9 accept4(5, NULL, NULL, SOCK_CLOEXEC <unfinished ...>
8 accept4(5, NULL, NULL, SOCK_CLOEXEC) = 15
9 <... accept4 resumed>)            = 14
9 writev(14, [{iov_base=\"ok\", iov_len=2}], 1) = 2
8 sendmsg(15, {msg_name=NULL}, MSG_NOSIGNAL) = 2
9 close(14)                         = 0
9 write(14, \"x\", 1)                = 1
7 exit_group(0)                     = ?
";
        assert_eq!(
            file_calls(trace),
            vec![
                FileCall::Synced("/d/a".into()),
                FileCall::Synced("/d/m".into()),
                FileCall::Synced("/d/b".into()),
                FileCall::Renamed {
                    from: "/d/b".into(),
                    to: "/d/c".into()
                },
                FileCall::Wrote("/d/b".into()),
                FileCall::Printed,
                FileCall::Answered,
                FileCall::Answered,
                FileCall::Exited,
            ]
        );
    }

    #[test]
    fn the_sync_check_finds_a_write_reported_before_it_was_synced() {
        let wrote = |path: &str| FileCall::Wrote(path.into());
        let synced = |path: &str| FileCall::Synced(path.into());
        let calls = [
            wrote("/s/db"),
            synced("/s/db"),
            wrote("/s/blobs/7"),
            wrote("/s/db"),
            synced("/s/blobs/7"),
            FileCall::Printed,
            wrote("/s/db"),
        ];
        assert_eq!(
            written_and_not_synced_at_a_report(&calls, "/s"),
            vec!["/s/db".to_owned()]
        );
        // Synced after its last write before the report: nothing left.
        let mut all_synced = calls[..5].to_vec();
        all_synced.extend([synced("/s/db"), FileCall::Printed]);
        assert!(written_and_not_synced_at_a_report(&all_synced, "/s").is_empty());
        // A command that prints nothing reports by its exit; files outside the store do not count.
        let exiting = [wrote("/s/db"), wrote("/elsewhere"), FileCall::Exited];
        assert_eq!(
            written_and_not_synced_at_a_report(&exiting, "/s"),
            vec!["/s/db".to_owned()]
        );
        // A server answers many times: each answer counts, the later ones too.
        let serving = [
            FileCall::Answered,
            wrote("/s/db"),
            synced("/s/db"),
            FileCall::Answered,
            wrote("/s/blobs/8"),
            FileCall::Answered,
            synced("/s/blobs/8"),
            FileCall::Exited,
        ];
        assert_eq!(
            written_and_not_synced_at_a_report(&serving, "/s"),
            vec!["/s/blobs/8".to_owned()]
        );
        // Only the second answer followed a sync of the store made since the one before it.
        assert_eq!(reports_after_a_sync(&serving, "/s"), 1);
        assert_eq!(reports_after_a_sync(&serving, "/elsewhere"), 0);
        // Two files unsynced at one report: both named, in the order of their last write.
        let two = [
            wrote("/s/a"),
            wrote("/s/b"),
            wrote("/s/a"),
            FileCall::Answered,
        ];
        assert_eq!(
            written_and_not_synced_at_a_report(&two, "/s"),
            vec!["/s/b".to_owned(), "/s/a".to_owned()]
        );
        // A sync before a traced child's exit counts for no later answer.
        let child_exit = [synced("/s/db"), FileCall::Exited, FileCall::Answered];
        assert_eq!(reports_after_a_sync(&child_exit, "/s"), 0);
    }
}
