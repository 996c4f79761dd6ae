//! Where a store is created: only `pool add` (and `migrate` into a target, and `demo`) may create a missing embedded store.

use crate::common::{Backend, Lab};

/// Every path under the lab directory.
fn files_in(lab: &Lab) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![lab.dir.path().to_owned()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).expect("read the lab directory") {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                pending.push(path.clone());
            }
            found.push(path);
        }
    }
    found.sort();
    found
}

fn assert_missing_store_error(lab: &Lab, line: &str) {
    for needle in [
        lab.path().display().to_string(),
        "blockipamctl pool add".to_owned(),
        "ipam.pools".to_owned(),
    ] {
        assert!(line.contains(&needle), "{line:?} does not say {needle:?}");
    }
}

#[test]
fn show_and_config_set_on_a_missing_store_fail_clearly_and_create_nothing() {
    for backend in [Backend::Sled, Backend::Redb] {
        let lab = Lab::new(backend);
        for args in [
            &["show"][..],
            &["config", "set", "--max-blocks-per-host", "3"][..],
        ] {
            let run = lab.ctl(args);
            run.expect_code(1);
            assert_missing_store_error(&lab, &run.error_line());
            assert_eq!(
                files_in(&lab),
                Vec::<std::path::PathBuf>::new(),
                "{backend:?} {args:?} created files"
            );
        }
    }
}

#[test]
fn show_on_an_empty_directory_where_the_sled_store_was_fails_and_leaves_it_empty() {
    let lab = Lab::new(Backend::Sled);
    // What an unmounted volume leaves at the store path.
    std::fs::create_dir(lab.path()).expect("an empty mount point");
    let run = lab.ctl(&["show"]);
    run.expect_code(1);
    let line = run.error_line();
    assert_missing_store_error(&lab, &line);
    assert!(line.contains("empty directory"), "{line}");
    assert_eq!(
        files_in(&lab),
        vec![lab.path()],
        "show wrote into the empty directory"
    );
}

#[test]
fn a_store_path_beneath_a_regular_file_is_an_error_saying_so_not_a_missing_store() {
    for backend in [Backend::Sled, Backend::Redb] {
        let lab = Lab::new(backend);
        let file = lab.dir.path().join("not-a-directory");
        std::fs::write(&file, b"a file").expect("write");
        let beneath = file.join("store").display().to_string();
        let args: Vec<String> = [
            "--datastore-type",
            lab.type_name(),
            "--datastore-path",
            &beneath,
        ]
        .into_iter()
        .chain(["show"])
        .map(str::to_owned)
        .collect();
        let run = crate::common::ctl(&args, &[]);
        run.expect_code(1);
        let line = run.error_line();
        assert!(
            line.contains("cannot inspect the store path") && line.contains("Not a directory"),
            "{backend:?}: {line}"
        );
        assert!(!line.contains("store at"), "{backend:?}: {line}");
        assert_eq!(std::fs::read(&file).expect("the file"), b"a file");
    }
}

#[test]
fn a_store_named_by_its_file_name_alone_is_created_in_the_working_directory() {
    for backend in [Backend::Sled, Backend::Redb] {
        let lab = Lab::new(backend);
        lab.ctl_by_bare_file_name(&["pool", "add", "10.91.0.0/16", "--name", "here"])
            .ok();
        assert!(
            lab.path().exists(),
            "{backend:?}: no store in the working directory"
        );
        let shown = lab.ctl(&["-o", "json", "pool", "list"]).ok().json();
        assert!(
            shown.to_string().contains("10.91.0.0/16"),
            "{backend:?}: {shown}"
        );
    }
}

#[test]
fn pool_add_creates_a_missing_store_that_later_commands_use() {
    for backend in [Backend::Sled, Backend::Redb] {
        let lab = Lab::new(backend);
        assert!(!lab.path().exists());
        lab.ctl(&["pool", "add", "10.90.0.0/16", "--name", "first"])
            .ok();
        assert!(lab.path().exists(), "{backend:?}: pool add made no store");
        let shown = lab.ctl(&["-o", "json", "pool", "list"]).ok().json();
        assert!(
            shown.to_string().contains("10.90.0.0/16"),
            "{backend:?}: {shown}"
        );
        lab.ctl(&["config", "set", "--max-blocks-per-host", "3"])
            .ok();
    }
}
