//! `--create-on-first-start`: create a missing embedded store only if this node never had one,
//! known by a marker file the agent writes beside the store.
//!
//! A store created silently where one was deleted (or sits on a volume not mounted) would hand
//! out addresses that running pods still hold; a fresh node has no such pods. The marker tells
//! the two apart: it is written once the store is open, whether the agent created it or found it.

use std::io::Write;
use std::path::{Path, PathBuf};

use blockipam_store::DatastoreSettings;

use crate::AgentError;

/// The marker of the store at `store`: `<store>.created` in the same directory (the plugin and
/// `blockipamctl` read the same marker before they create a store).
pub fn marker_path(store: &Path) -> PathBuf {
    blockipam_store::store_marker_path(store)
}

/// What is left to do once the store is open: write its marker, when it is missing.
#[derive(Debug)]
#[must_use = "write the marker once the store is open"]
pub struct PendingMarker {
    store: PathBuf,
    marker: PathBuf,
    created: bool,
}

/// Decides whether the embedded store `settings` name may be created: when the store exists,
/// it is opened as is; when it is missing and its marker is not there, it is created; when it is
/// missing and its marker is there, the agent refuses to start. etcd stores are never created
/// and have no marker (`None`).
///
/// # Errors
/// [`AgentError`] naming the store, its marker and what to do, when the marker says this node
/// had a store that is gone; or when the paths cannot be inspected.
pub fn prepare(settings: &mut DatastoreSettings) -> Result<Option<PendingMarker>, AgentError> {
    let Some(store) = settings.resolved_path() else {
        return Ok(None);
    };
    let marker = marker_path(&store);
    let store_exists = exists(&store)?;
    if !store_exists && exists(&marker)? {
        return Err(AgentError::new(format!(
            "the store {} does not exist, but its marker {} says this node created it before: \
             it was deleted or its volume is not mounted, and addresses recorded in it may still \
             be held by running pods. Put the store back (or mount its volume). Only if no pod \
             on this node holds an address from it, remove the marker to start from a new empty \
             store",
            store.display(),
            marker.display()
        )));
    }
    settings.create_if_missing = !store_exists;
    Ok(Some(PendingMarker {
        store,
        marker,
        created: !store_exists,
    }))
}

impl PendingMarker {
    /// Writes the marker (synced, with its directory) unless it is there already.
    ///
    /// # Errors
    /// [`AgentError`] naming the marker when it cannot be written.
    pub fn write(self) -> Result<(), AgentError> {
        if exists(&self.marker)? {
            return Ok(());
        }
        let failed = |e: std::io::Error| {
            AgentError::new(format!(
                "cannot write the store's marker {}: {e}",
                self.marker.display()
            ))
        };
        let seconds = ipam_core::model::timestamp::unix_now();
        let how = if self.created { "created" } else { "found" };
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&self.marker)
            .map_err(failed)?;
        writeln!(
            file,
            "blockipam-agent {how} the store {} on this node at {seconds} (Unix time). While \
             this file exists, --create-on-first-start refuses to create that store again.",
            self.store.display()
        )
        .map_err(failed)?;
        file.sync_all().map_err(failed)?;
        ipam_core::kv::durable::sync_directory_of(&self.marker).map_err(failed)?;
        tracing::info!(marker = %self.marker.display(), "wrote the store's marker");
        Ok(())
    }
}

fn exists(path: &Path) -> Result<bool, AgentError> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(AgentError::new(format!(
            "cannot inspect {}: {e}",
            path.display()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A path that is there (a marker, a store) and one that is not are told apart; a path that
    /// cannot be looked at is an error, never taken for a missing store or marker.
    #[test]
    fn a_path_that_cannot_be_inspected_is_an_error_not_a_missing_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("store.sled");
        assert!(!exists(&file).expect("a missing path"));
        std::fs::write(&file, b"x").expect("write");
        assert!(exists(&file).expect("a present path"));
        assert_eq!(
            marker_path(&file),
            dir.path().join("store.sled.created"),
            "the marker sits beside the store"
        );
        let under_a_file = file.join("store");
        match exists(&under_a_file) {
            Err(e) => assert!(e.to_string().contains("cannot inspect"), "{e}"),
            Ok(found) => panic!("a path under a regular file was taken as found={found}"),
        }
    }
}
