//! Making a name just created or renamed in a directory survive a power loss: syncing that directory.

use std::path::Path;

/// The directory holding `path`: its parent, or the working directory for a bare file name
/// (whose parent is the empty path, which cannot be opened).
pub fn directory_of(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

/// Syncs the directory holding `path` ([`directory_of`]), so that a file just created or renamed
/// there keeps its name after a power loss.
///
/// # Errors
/// The directory cannot be opened or synced.
pub fn sync_directory_of(path: &Path) -> std::io::Result<()> {
    std::fs::File::open(directory_of(path)).and_then(|directory| directory.sync_all())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directory_of_a_bare_file_name_is_the_working_directory() {
        assert_eq!(directory_of(Path::new("store.redb")), Path::new("."));
        assert_eq!(directory_of(Path::new("lab/store.redb")), Path::new("lab"));
        assert_eq!(
            directory_of(Path::new("/var/lib/x/store")),
            Path::new("/var/lib/x")
        );
        assert_eq!(directory_of(Path::new("/")), Path::new("."));
    }

    #[test]
    fn syncs_the_directory_of_a_bare_file_name_and_of_a_path() {
        sync_directory_of(Path::new("no-such-file-needed")).expect("the working directory");
        let dir = tempfile::tempdir().expect("a temporary directory");
        sync_directory_of(&dir.path().join("store")).expect("the temporary directory");
        let gone = dir.path().join("gone");
        let error = sync_directory_of(&gone.join("store")).expect_err("no such directory");
        assert_eq!(error.kind(), std::io::ErrorKind::NotFound);
    }
}
