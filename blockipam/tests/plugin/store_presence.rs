//! Where a store is created: only a call whose netconf lists `ipam.pools` may create a missing embedded store.
//!
//! A store that vanished (deleted, or on a volume that is not mounted) must not come back empty
//! under a call that cannot know the network is new: the node would hand out addresses that its
//! running pods, or other nodes, still hold. Each case runs the real binary on sled and on redb.

use crate::common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use blockipam_store::DatastoreType;
use common::*;
use serde_json::{json, Value};

/// The CNI code of a store that cannot be opened for a permanent reason (`KvError::Other`).
const IO_FAILURE: u64 = 5;

const EMBEDDED: [DatastoreType; 2] = [DatastoreType::Sled, DatastoreType::Redb];

/// Every path under `dir`, recursively.
fn tree(dir: &Path) -> BTreeSet<PathBuf> {
    let mut found = BTreeSet::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next).expect("read a sandbox directory") {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                pending.push(path.clone());
            }
            found.insert(path);
        }
    }
    found
}

/// The netconf of `sandbox` without `ipam.pools` (the pools then come from the store).
fn netconf_without_pools(sandbox: &Sandbox) -> Value {
    sandbox.netconf("1.0.0", json!({"pools": null}))
}

/// Removes the store (directory or file), as a deleted store or an unmounted volume leaves it.
fn delete_store(sandbox: &Sandbox) {
    let path = sandbox.store_path();
    if path.is_dir() {
        std::fs::remove_dir_all(&path).expect("delete the sled store");
    } else {
        std::fs::remove_file(&path).expect("delete the redb store");
    }
}

/// Asserts that `outcome` is the missing-store error naming the store and how one is created.
fn assert_missing_store_error(outcome: &Outcome, sandbox: &Sandbox, what: &str) {
    let message = outcome.assert_error(IO_FAILURE, what);
    for needle in [
        sandbox.store_path().display().to_string(),
        "blockipamctl pool add".to_owned(),
        "ipam.pools".to_owned(),
    ] {
        assert!(
            message.contains(&needle),
            "{what}: {message:?} does not say {needle:?}"
        );
    }
}

#[test]
fn add_without_netconf_pools_on_a_deleted_store_fails_and_creates_nothing() {
    for store_type in EMBEDDED {
        let sandbox = Sandbox::with_store(store_type);
        // A node that ran: the store exists and holds an allocation.
        let with_pools = sandbox.netconf("1.0.0", json!({}));
        cni("ADD", "c1", "eth0", &with_pools, &[]).success_json("first ADD");
        assert!(sandbox.store_path().exists());

        delete_store(&sandbox);
        let before = tree(sandbox.dir.path());
        let add = cni("ADD", "c2", "eth0", &netconf_without_pools(&sandbox), &[]);
        assert_missing_store_error(&add, &sandbox, &format!("{store_type}: ADD"));
        // DEL cannot release what it cannot see: it fails too (a success would leak the address
        // once the volume is back) and creates nothing either.
        let del = cni("DEL", "c1", "eth0", &netconf_without_pools(&sandbox), &[]);
        assert_missing_store_error(&del, &sandbox, &format!("{store_type}: DEL"));
        assert_eq!(
            tree(sandbox.dir.path()),
            before,
            "{store_type}: a call without netconf pools changed the files beside the store"
        );
        assert!(
            !sandbox.store_path().exists(),
            "{store_type}: store re-created"
        );
    }
}

#[test]
fn add_without_netconf_pools_on_a_store_that_never_existed_fails_and_creates_nothing() {
    for store_type in EMBEDDED {
        let sandbox = Sandbox::with_store(store_type);
        let add = cni("ADD", "c1", "eth0", &netconf_without_pools(&sandbox), &[]);
        assert_missing_store_error(&add, &sandbox, &format!("{store_type}: ADD"));
        let store_name = sandbox
            .store_path()
            .file_name()
            .expect("a store name")
            .to_string_lossy()
            .into_owned();
        // The store, its lock file and its staging directory all start with the store's name.
        let beside_the_store: Vec<PathBuf> = tree(sandbox.dir.path())
            .into_iter()
            .filter(|path| {
                path.file_name()
                    .is_some_and(|name| name.to_string_lossy().starts_with(&store_name))
            })
            .collect();
        assert!(
            beside_the_store.is_empty(),
            "{store_type}: refusing a missing store created {beside_the_store:?}"
        );
    }
}

#[test]
fn empty_mount_point_at_the_sled_store_path_is_refused_and_left_empty() {
    let sandbox = Sandbox::with_store(DatastoreType::Sled);
    std::fs::create_dir(sandbox.store_path()).expect("an empty mount point");
    let add = cni("ADD", "c1", "eth0", &netconf_without_pools(&sandbox), &[]);
    assert_missing_store_error(&add, &sandbox, "ADD on an empty directory");
    assert_eq!(
        std::fs::read_dir(sandbox.store_path())
            .expect("read the mount point")
            .count(),
        0,
        "the empty directory was filled"
    );
}

#[test]
fn add_with_netconf_pools_creates_a_missing_store_on_first_run() {
    for store_type in EMBEDDED {
        let sandbox = Sandbox::with_store(store_type);
        assert!(!sandbox.store_path().exists());
        let netconf = sandbox.netconf("1.0.0", json!({}));
        let result = cni("ADD", "c1", "eth0", &netconf, &[]).success_json("first run");
        let address = first_address(&result);
        assert!(sandbox.store_path().exists(), "{store_type}: no store made");
        let held: Vec<String> = sandbox
            .container_allocations()
            .into_iter()
            .map(|(ip, _, _)| ip)
            .collect();
        assert_eq!(held, vec![address], "{store_type}: allocations");
        // Once it exists, calls without pools use it.
        let second = cni("ADD", "c2", "eth0", &netconf_without_pools(&sandbox), &[]);
        second.success_json("ADD without pools on an existing store");
    }
}

/// A store the node agent marked (`<store>.created`, written once the agent opened it) and that
/// is gone is a lost store: the agent refuses to start on it, and a call whose netconf lists pools
/// must not create it anew either (it would hand out the addresses running pods hold). The call
/// fails naming the store and the marker and creates nothing; with the marker removed (the
/// operator's word that no pod holds an address from it) the same call creates the store. An
/// empty mount point at a marked sled store's path is refused the same way and left empty.
#[test]
fn add_with_netconf_pools_does_not_recreate_a_store_its_marker_says_was_lost() {
    for store_type in EMBEDDED {
        let sandbox = Sandbox::with_store(store_type);
        let with_pools = sandbox.netconf("1.0.0", json!({}));
        cni("ADD", "c1", "eth0", &with_pools, &[]).success_json("first ADD");
        let marker = blockipam_store::store_marker_path(&sandbox.store_path());
        std::fs::write(&marker, "created by the agent\n").expect("write the marker");

        delete_store(&sandbox);
        if store_type == DatastoreType::Sled {
            std::fs::create_dir(sandbox.store_path()).expect("an empty mount point");
        }
        let before = tree(sandbox.dir.path());
        let add = cni("ADD", "c2", "eth0", &with_pools, &[]);
        let message = add.assert_error(IO_FAILURE, &format!("{store_type}: ADD"));
        for needle in [
            sandbox.store_path().display().to_string(),
            marker.display().to_string(),
            "remove the marker".to_owned(),
        ] {
            assert!(
                message.contains(&needle),
                "{store_type}: {message:?} does not say {needle:?}"
            );
        }
        assert_eq!(
            tree(sandbox.dir.path()),
            before,
            "{store_type}: a refused call changed the files beside the store"
        );

        std::fs::remove_file(&marker).expect("remove the marker");
        cni("ADD", "c3", "eth0", &with_pools, &[]).success_json("ADD once the marker is gone");
        assert!(sandbox.store_path().exists(), "{store_type}: no store made");
    }
}
