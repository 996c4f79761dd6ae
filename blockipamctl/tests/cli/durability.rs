//! An embedded store survives a power loss: a new one's files are synced before it takes the store's name, and the directory holding that name after; a write is synced before the command that made it reports it (seen in the system calls, under strace).

use test_kit::strace::{file_calls, written_and_not_synced_at_a_report, FileCall};

use crate::common::{Backend, Lab};

/// Creating the store (the first `pool add`) under strace: the files synced before it was renamed
/// to its name, and those synced after.
fn creation_syncs(lab: &Lab) -> (Vec<String>, Vec<String>) {
    let trace_path = lab.dir.path().join("creation.strace");
    lab.ctl_traced(&trace_path, &["pool", "add", "10.9.0.0/24"])
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
                _ => None,
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

#[test]
fn a_write_is_synced_before_the_command_that_made_it_reports_it() {
    for backend in [Backend::Redb, Backend::Sled] {
        let lab = Lab::new(backend);
        lab.ctl(&["pool", "add", "10.9.0.0/24", "--name", "first"])
            .expect_code(0);
        // Each command writes to the existing store, then prints what it did.
        for (what, args) in [
            (
                "pool add",
                vec!["pool", "add", "10.10.0.0/24", "--name", "second"],
            ),
            (
                "reservation add",
                vec!["reservation", "add", "gateway", "10.9.0.1/32"],
            ),
            ("pool disable", vec!["pool", "disable", "second"]),
        ] {
            let trace_path = lab.dir.path().join("write.strace");
            lab.ctl_traced(&trace_path, &args).expect_code(0);
            let trace = std::fs::read_to_string(&trace_path).expect("the trace");
            let calls = file_calls(&trace);
            let store = lab.path().display().to_string();
            let unsynced = written_and_not_synced_at_a_report(&calls, &store);
            assert!(
                unsynced.is_empty(),
                "{backend:?} {what}: written and not synced before the command reported it \
                 (a power loss after the report could lose the write): {unsynced:?}"
            );
        }
    }
}
