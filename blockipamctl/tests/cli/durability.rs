//! A new embedded store survives a power loss: each of its files is synced before it takes the store's name, and the directory holding that name after (seen in the system calls, under strace).

use std::collections::BTreeMap;

use crate::common::{Backend, Lab};

/// What the traced process did to files, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum FileCall {
    /// `fsync` or `fdatasync` of a descriptor opened on this path.
    Synced(String),
    /// A successful rename.
    Renamed { from: String, to: String },
}

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

/// The syncs and renames of a trace written by `strace -f -e trace=openat,close,fsync,fdatasync,
/// rename`: each descriptor followed from its `openat` to its `close` (a call another thread cut
/// in on, `<unfinished ...>` then `<... openat resumed>`, completed by its thread's next line).
fn file_calls(trace: &str) -> Vec<FileCall> {
    let mut open: BTreeMap<u32, String> = BTreeMap::new();
    let mut opening: BTreeMap<String, String> = BTreeMap::new();
    let mut calls = Vec::new();
    for line in trace.lines() {
        let Some((thread, call)) = line.split_once(' ') else {
            continue;
        };
        let call = format!(" {}", call.trim_start());
        if call.contains(" openat(") {
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
        } else if call.contains("<... openat resumed>") {
            if let (Some(path), Some(fd)) = (opening.remove(thread), returned_descriptor(&call)) {
                open.insert(fd, path);
            }
        } else if let Some(fd) = argument_descriptor(&call, "close") {
            open.remove(&fd);
        } else if let Some(fd) =
            argument_descriptor(&call, "fsync").or_else(|| argument_descriptor(&call, "fdatasync"))
        {
            if let Some(path) = open.get(&fd) {
                calls.push(FileCall::Synced(path.clone()));
            }
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

#[test]
fn the_trace_reader_follows_descriptors_across_threads_and_their_reuse() {
    let trace = "\
7 openat(AT_FDCWD, \"/d/a\", O_RDONLY|O_CLOEXEC) = 11
7 fsync(11)                         = 0
7 close(11)                         = 0
8 openat(AT_FDCWD, \"/d/b\", O_RDONLY|O_CLOEXEC <unfinished ...>
7 fdatasync(3)                      = 0
8 <... openat resumed>)             = 11
7 fdatasync(11 <unfinished ...>
8 rename(\"/d/b\", \"/d/c\")        = 0
8 rename(\"/d/x\", \"/d/y\")        = -1 ENOENT (No such file or directory)
7 <... fdatasync resumed>)          = 0
";
    assert_eq!(
        file_calls(trace),
        vec![
            FileCall::Synced("/d/a".into()),
            FileCall::Synced("/d/b".into()),
            FileCall::Renamed {
                from: "/d/b".into(),
                to: "/d/c".into()
            },
        ]
    );
}

/// Creating the store (the first `pool add`) under strace: the files synced before it was renamed
/// to its name, and those synced after.
fn creation_syncs(lab: &Lab) -> (Vec<String>, Vec<String>) {
    let trace_path = lab.dir.path().join("creation.strace");
    lab.ctl_traced(
        &trace_path,
        "openat,close,fsync,fdatasync,rename",
        &["pool", "add", "10.9.0.0/24"],
    )
    .ok();
    let trace = std::fs::read_to_string(&trace_path).expect("the trace");
    let calls = file_calls(&trace);
    let store = lab.path().display().to_string();
    let named = FileCall::Renamed {
        from: format!("{store}.creating"),
        to: store.clone(),
    };
    let at = calls.iter().position(|c| *c == named).unwrap_or_else(|| {
        panic!("the store was not built beside its name and renamed to it:\n{calls:#?}")
    });
    let synced = |calls: &[FileCall]| -> Vec<String> {
        calls
            .iter()
            .filter_map(|c| match c {
                FileCall::Synced(path) => Some(path.clone()),
                FileCall::Renamed { .. } => None,
            })
            .collect()
    };
    (synced(&calls[..at]), synced(&calls[at + 1..]))
}

#[test]
fn a_new_embedded_store_is_synced_whole_before_it_takes_its_name_and_its_directory_after() {
    for backend in [Backend::Redb, Backend::Sled] {
        let lab = Lab::new(backend);
        let (before, after) = creation_syncs(&lab);
        let staging = format!("{}.creating", lab.path().display());
        let staged: Vec<String> = match backend {
            Backend::Redb => vec![staging],
            // sled's configuration file, its log, the directory of its blobs and the directory
            // naming them.
            _ => ["", "/conf", "/db", "/blobs"]
                .iter()
                .map(|file| format!("{staging}{file}"))
                .collect(),
        };
        for file in &staged {
            assert!(
                before.contains(file),
                "{backend:?}: {file} was not synced before the store took its name: {before:?}"
            );
        }
        let directory = lab.dir.path().display().to_string();
        assert!(
            after.contains(&directory),
            "{backend:?}: the directory {directory} was not synced after the store took its \
             name there (a power loss could lose the name): {after:?}"
        );
        assert!(lab.path().exists(), "{backend:?}: no store at its path");
    }
}
