//! Earlier releases' binaries (plugin, CLI, agent), built by `scripts/build-previous`, for the tests that run them beside today's build.

use std::path::{Path, PathBuf};

/// The commit the previous release of the mixed-version suite is built from: the last one whose
/// binaries write stored-format version 3. `scripts/build-previous` pins the same commit.
pub const PREVIOUS_COMMIT: &str = "ff39a16";

/// Environment variable naming the directory that holds the previous release's executables
/// (what `scripts/build-previous` prints); `scripts/test` sets it.
pub const PREVIOUS_BIN_ENV: &str = "BLOCKIPAM_PREVIOUS_BIN";

/// The commit of the release before format 5: the last one whose binaries write (and read up
/// to) stored-format version 4. `scripts/build-previous 4` pins the same commit.
pub const FORMAT4_COMMIT: &str = "a17012b";

/// Environment variable naming the directory that holds the format-4 release's executables
/// (what `scripts/build-previous 4` prints); `scripts/test` sets it.
pub const FORMAT4_BIN_ENV: &str = "BLOCKIPAM_FORMAT4_BIN";

/// The commit of the release before format 6: the last one whose binaries write (and read up
/// to) stored-format version 5. `scripts/build-previous 5` pins the same commit.
pub const FORMAT5_COMMIT: &str = "49656b3";

/// Environment variable naming the directory that holds the format-5 release's executables
/// (what `scripts/build-previous 5` prints); `scripts/test` sets it.
pub const FORMAT5_BIN_ENV: &str = "BLOCKIPAM_FORMAT5_BIN";

/// The commit of the release before format 7: the last one whose binaries write (and read up
/// to) stored-format version 6. `scripts/build-previous 6` pins the same commit.
pub const FORMAT6_COMMIT: &str = "f787698";

/// Environment variable naming the directory that holds the format-6 release's executables
/// (what `scripts/build-previous 6` prints); `scripts/test` sets it.
pub const FORMAT6_BIN_ENV: &str = "BLOCKIPAM_FORMAT6_BIN";

/// The script that builds the previous release, relative to the workspace.
pub const BUILD_SCRIPT: &str = "scripts/build-previous";

/// An earlier release: which commit, how `scripts/build-previous` is asked for it, and the
/// environment variable that may name its directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pinned {
    commit: &'static str,
    build: &'static str,
    env: &'static str,
}

/// The previous release of the mixed-version suite (writes format 3).
const PREVIOUS: Pinned = Pinned {
    commit: PREVIOUS_COMMIT,
    build: BUILD_SCRIPT,
    env: PREVIOUS_BIN_ENV,
};

/// The release before format 5 (writes format 4).
const FORMAT4: Pinned = Pinned {
    commit: FORMAT4_COMMIT,
    build: "scripts/build-previous 4",
    env: FORMAT4_BIN_ENV,
};

/// The release before format 6 (writes format 5).
const FORMAT5: Pinned = Pinned {
    commit: FORMAT5_COMMIT,
    build: "scripts/build-previous 5",
    env: FORMAT5_BIN_ENV,
};

/// The release before format 7 (writes format 6).
const FORMAT6: Pinned = Pinned {
    commit: FORMAT6_COMMIT,
    build: "scripts/build-previous 6",
    env: FORMAT6_BIN_ENV,
};

/// An earlier release's executables, all three present.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreviousRelease {
    bin_dir: PathBuf,
    pinned: Pinned,
}

impl Pinned {
    fn bin_dir_to_use(self) -> PathBuf {
        if let Some(dir) = std::env::var_os(self.env).filter(|d| !d.is_empty()) {
            return PathBuf::from(dir);
        }
        let workspace = workspace_root();
        let target = match std::env::var_os("CARGO_TARGET_DIR").filter(|d| !d.is_empty()) {
            Some(dir) => workspace.join(dir),
            None => workspace.join("target"),
        };
        target.join("previous").join(self.commit).join("bin")
    }
}

impl PreviousRelease {
    /// The directory [`PREVIOUS_BIN_ENV`] names, else `previous/<commit>/bin` under
    /// `CARGO_TARGET_DIR` (when set) or the workspace's `target/`, as `scripts/build-previous`
    /// places it.
    pub fn bin_dir_to_use() -> PathBuf {
        PREVIOUS.bin_dir_to_use()
    }

    /// The previous release in [`bin_dir_to_use`](Self::bin_dir_to_use).
    ///
    /// # Errors
    /// A message naming the missing executables and the command that builds them.
    pub fn try_locate() -> Result<PreviousRelease, String> {
        Self::in_dir(&Self::bin_dir_to_use())
    }

    /// The release that writes format 4 (the one before format 5), in the directory
    /// [`FORMAT4_BIN_ENV`] names, else where `scripts/build-previous 4` places it.
    ///
    /// # Panics
    /// When a binary is missing, naming the command that builds them: a test that needs the
    /// release fails, never skips.
    pub fn locate_format4() -> PreviousRelease {
        Self::pinned_in(FORMAT4, &FORMAT4.bin_dir_to_use())
            .unwrap_or_else(|message| panic!("{message}"))
    }

    /// The release that writes format 5 (the one before format 6), in the directory
    /// [`FORMAT5_BIN_ENV`] names, else where `scripts/build-previous 5` places it.
    ///
    /// # Panics
    /// When a binary is missing, naming the command that builds them: a test that needs the
    /// release fails, never skips.
    pub fn locate_format5() -> PreviousRelease {
        Self::pinned_in(FORMAT5, &FORMAT5.bin_dir_to_use())
            .unwrap_or_else(|message| panic!("{message}"))
    }

    /// The release that writes format 6 (the one before format 7), in the directory
    /// [`FORMAT6_BIN_ENV`] names, else where `scripts/build-previous 6` places it.
    ///
    /// # Panics
    /// When a binary is missing, naming the command that builds them: a test that needs the
    /// release fails, never skips.
    pub fn locate_format6() -> PreviousRelease {
        Self::pinned_in(FORMAT6, &FORMAT6.bin_dir_to_use())
            .unwrap_or_else(|message| panic!("{message}"))
    }

    /// The previous release in `bin_dir`.
    ///
    /// # Errors
    /// As [`try_locate`](Self::try_locate).
    pub fn in_dir(bin_dir: &Path) -> Result<PreviousRelease, String> {
        Self::pinned_in(PREVIOUS, bin_dir)
    }

    fn pinned_in(pinned: Pinned, bin_dir: &Path) -> Result<PreviousRelease, String> {
        let release = PreviousRelease {
            bin_dir: bin_dir.to_owned(),
            pinned,
        };
        let missing: Vec<String> = [release.plugin(), release.cli(), release.agent()]
            .iter()
            .filter(|path| !path.is_file())
            .map(|path| path.display().to_string())
            .collect();
        if missing.is_empty() {
            return Ok(release);
        }
        let Pinned { commit, build, env } = pinned;
        Err(format!(
            "the binaries of the release at commit {commit} are missing: {}; build them with \
             `{build}` (it prints their directory; `scripts/test` runs it and sets {env}), or \
             point {env} at a directory holding blockipam, blockipamctl and blockipam-agent of \
             that commit",
            missing.join(", ")
        ))
    }

    /// As [`try_locate`](Self::try_locate).
    ///
    /// # Panics
    /// When a binary is missing, with the message of [`try_locate`](Self::try_locate): a test
    /// that needs the previous release fails, never skips.
    pub fn locate() -> PreviousRelease {
        Self::try_locate().unwrap_or_else(|message| panic!("{message}"))
    }

    /// The directory holding the executables.
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// The CNI plugin, `blockipam`.
    pub fn plugin(&self) -> PathBuf {
        self.bin_dir.join("blockipam")
    }

    /// The operator CLI, `blockipamctl`.
    pub fn cli(&self) -> PathBuf {
        self.bin_dir.join("blockipamctl")
    }

    /// The node agent, `blockipam-agent`.
    pub fn agent(&self) -> PathBuf {
        self.bin_dir.join("blockipam-agent")
    }

    /// The commit the binaries were built from.
    pub fn commit(&self) -> &'static str {
        self.pinned.commit
    }
}

/// The workspace's root directory (the test kit's parent).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the test kit sits in the workspace")
        .to_path_buf()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_build_script_pins_the_same_commit() {
        let script_path = workspace_root().join(BUILD_SCRIPT);
        let script = std::fs::read_to_string(&script_path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", script_path.display()));
        for (variable, commit) in [
            ("format3_commit=", PREVIOUS_COMMIT),
            ("format4_commit=", FORMAT4_COMMIT),
            ("format5_commit=", FORMAT5_COMMIT),
            ("format6_commit=", FORMAT6_COMMIT),
        ] {
            let pinned: Vec<&str> = script
                .lines()
                .filter_map(|line| line.strip_prefix(variable))
                .collect();
            assert_eq!(pinned, vec![commit], "{BUILD_SCRIPT} pins {pinned:?}");
        }
    }

    #[test]
    fn a_directory_without_the_binaries_is_refused_naming_the_build_script() {
        let empty = tempfile::tempdir().expect("a temp dir");
        let message = PreviousRelease::in_dir(empty.path()).expect_err("no binaries there");
        assert!(message.contains(BUILD_SCRIPT), "{message}");
        for name in ["blockipam", "blockipamctl", "blockipam-agent"] {
            let path = empty.path().join(name).display().to_string();
            assert!(message.contains(&path), "{message} does not name {path}");
        }
    }

    #[test]
    fn a_directory_with_all_three_binaries_is_the_previous_release() {
        let dir = tempfile::tempdir().expect("a temp dir");
        for name in ["blockipam", "blockipamctl", "blockipam-agent"] {
            std::fs::write(dir.path().join(name), b"").expect("write a stand-in");
        }
        let release = PreviousRelease::in_dir(dir.path()).expect("all three are there");
        assert_eq!(release.cli(), dir.path().join("blockipamctl"));
        assert_eq!(release.agent(), dir.path().join("blockipam-agent"));
        assert_eq!(release.plugin(), dir.path().join("blockipam"));
        assert_eq!(release.commit(), PREVIOUS_COMMIT);
    }
}
