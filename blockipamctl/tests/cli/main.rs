//! Integration tests of the real `blockipamctl` binary against sled, redb and a real etcd: every
//! command's table and JSON output, every exit status and error path.

mod common;

mod check;
mod config;
mod demo_checks;
mod durability;
mod errors;
mod format_upgrade;
mod gc;
mod guarded_release;
mod import;
mod install_cni;
mod leaks;
mod library;
mod lifecycle;
mod migrate;
mod node;
mod node_inventory;
mod node_labels;
mod pod_pools;
mod pool_selection;
mod pools;
mod release;
mod reservations;
mod resize;
mod security;
mod show;
mod store_presence;
mod store_selection;
mod tunnel;
