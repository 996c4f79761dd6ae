//! The `blockipam` plugin binary for tests: building it beside a test's own binary (with a cargo command free of the variables cargo set for the test), and pinning a private link to it for the length of a test.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Whether `name` is one of the variables cargo sets for the process it runs (a test, a build
/// script): the package's name, version and manifest, the crate and binary names, the test's
/// temporary directory, `OUT_DIR`. Configuration variables (`CARGO_HOME`, `CARGO_INCREMENTAL`,
/// `CARGO_PROFILE_*`, ...) are not.
pub fn is_set_by_cargo_for_a_test(name: &OsStr) -> bool {
    let Some(name) = name.to_str() else {
        return false;
    };
    const EXACT: &[&str] = &[
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_MANIFEST_LINKS",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
        "OUT_DIR",
    ];
    const PREFIXES: &[&str] = &["CARGO_PKG_", "CARGO_BIN_EXE_"];
    EXACT.contains(&name) || PREFIXES.iter().any(|prefix| name.starts_with(prefix))
}

/// `cargo` (the one running this test, else the one on `PATH`), without the variables cargo set
/// for this test's process.
///
/// A nested build that inherited them would look, to build scripts that ask to rerun when one of
/// them changes (ring's asks for `CARGO_MANIFEST_DIR`, `CARGO_PKG_NAME`, ...), like a build with a
/// changed environment: it would compile those crates and every crate above them again, and the
/// next ordinary build once more.
pub fn cargo_command() -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    for (name, _) in std::env::vars_os() {
        if is_set_by_cargo_for_a_test(&name) {
            command.env_remove(name);
        }
    }
    command
}

/// Builds the `blockipam` plugin with the profile and target directory of `binary` (a test's
/// `CARGO_BIN_EXE_*`), into the directory `binary` is in, and returns its path. Built with the
/// `fault-injection` feature, as the workspace's own test build of the plugin is: its fault points
/// stay inert unless `BLOCKIPAM_FAULT` is set.
///
/// # Panics
/// When cargo cannot be run or the build fails: a test that needs the plugin fails, never skips.
pub fn build_plugin_beside(binary: &Path) -> PathBuf {
    let exe_dir = binary.parent().expect("the binary has a directory");
    let profile = exe_dir
        .file_name()
        .and_then(|n| n.to_str())
        .expect("a profile directory name")
        .to_owned();
    let above = exe_dir.parent().expect("a target directory");
    // target/<profile>/ or target/<triple>/<profile>/
    let (target_dir, triple) = if above.join("CACHEDIR.TAG").exists() {
        (above.to_path_buf(), None)
    } else {
        let triple = above
            .file_name()
            .and_then(|n| n.to_str())
            .map(str::to_owned);
        (
            above.parent().expect("a target directory").to_path_buf(),
            triple,
        )
    };
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let mut build = cargo_command();
    build
        .args([
            "build",
            "-p",
            "blockipam",
            "--bin",
            "blockipam",
            // The same feature set the workspace's test build gives the binary (its crash tests
            // need the fault points; they do nothing unless BLOCKIPAM_FAULT is set), so that a
            // test building the plugin never swaps a fault-less binary under the crash tests.
            "--features",
            "fault-injection",
            "--manifest-path",
        ])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target_dir);
    if profile != "debug" {
        build.args(["--profile", &profile]);
    }
    if let Some(triple) = &triple {
        build.args(["--target", triple]);
    }
    let output = build
        .output()
        .unwrap_or_else(|e| panic!("cannot run cargo to build the blockipam plugin: {e}"));
    assert!(
        output.status.success(),
        "this test needs the blockipam plugin, and `cargo build -p blockipam` failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let plugin = exe_dir.join("blockipam");
    assert!(
        plugin.is_file(),
        "`cargo build -p blockipam` succeeded but {} does not exist",
        plugin.display()
    );
    plugin
}

/// A private hard link (or copy) of a built plugin, removed on drop.
///
/// `CARGO_BIN_EXE_blockipam` is `target/debug/blockipam`, which any `cargo build -p blockipam`
/// replaces (without the `fault-injection` feature, for one). A test that runs the plugin for a
/// while pins its own link when it starts, so such a build cannot swap the binary under it.
#[derive(Debug)]
pub struct PinnedPlugin {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl PinnedPlugin {
    /// Links (or copies) `built` into a fresh directory under `beside` (the test's
    /// `CARGO_TARGET_TMPDIR`, on the build's own file system).
    ///
    /// # Panics
    /// When the directory cannot be made or the binary neither linked nor copied.
    pub fn pin(built: &Path, beside: &Path) -> PinnedPlugin {
        let dir = tempfile::Builder::new()
            .prefix("blockipam-plugin-")
            .tempdir_in(beside)
            .expect("a temporary directory next to the build");
        let path = dir.path().join("blockipam");
        if std::fs::hard_link(built, &path).is_err() {
            std::fs::copy(built, &path).unwrap_or_else(|e| {
                panic!("cannot copy {} to {}: {e}", built.display(), path.display())
            });
        }
        PinnedPlugin { _dir: dir, path }
    }

    /// The pinned binary.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variables_cargo_sets_for_a_test_are_recognised_and_its_configuration_is_not() {
        for set_by_cargo in [
            "CARGO_MANIFEST_DIR",
            "CARGO_MANIFEST_PATH",
            "CARGO_PKG_NAME",
            "CARGO_PKG_VERSION_MAJOR",
            "CARGO_CRATE_NAME",
            "CARGO_BIN_EXE_blockipam",
            "CARGO_TARGET_TMPDIR",
            "OUT_DIR",
        ] {
            assert!(
                is_set_by_cargo_for_a_test(OsStr::new(set_by_cargo)),
                "{set_by_cargo}"
            );
        }
        for configuration in [
            "CARGO",
            "CARGO_HOME",
            "CARGO_INCREMENTAL",
            "CARGO_TARGET_DIR",
            "CARGO_PROFILE_DEV_OPT_LEVEL",
            "CARGO_TERM_COLOR",
            "PATH",
        ] {
            assert!(
                !is_set_by_cargo_for_a_test(OsStr::new(configuration)),
                "{configuration}"
            );
        }
    }

    #[test]
    fn a_nested_cargo_does_not_inherit_this_tests_package_variables() {
        // Cargo set these for this very test process.
        for name in [
            "CARGO_MANIFEST_DIR",
            "CARGO_PKG_NAME",
            "CARGO_PKG_VERSION_MAJOR",
        ] {
            assert!(
                std::env::var_os(name).is_some(),
                "cargo sets {name} for a test"
            );
        }
        let command = cargo_command();
        let removed: Vec<&OsStr> = command
            .get_envs()
            .filter(|(_, value)| value.is_none())
            .map(|(name, _)| name)
            .collect();
        for name in [
            "CARGO_MANIFEST_DIR",
            "CARGO_PKG_NAME",
            "CARGO_PKG_VERSION_MAJOR",
        ] {
            assert!(
                removed.contains(&OsStr::new(name)),
                "{name} is passed on: {removed:?}"
            );
        }
        assert!(
            command
                .get_envs()
                .all(|(name, _)| is_set_by_cargo_for_a_test(name)),
            "only cargo's own variables for this test are touched"
        );
    }
}
