//! The `blockipam` plugin binary for tests: building it beside a test's own binary, and pinning a
//! private link to it for the length of a test.

use std::path::{Path, PathBuf};
use std::process::Command;

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
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let mut build = Command::new(cargo);
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
