//! blockipam's single-file store: the [`KvStore`](ipam_core::KvStore) trait on an embedded redb database.
//!
//! The store is one redb file with two tables: [`DATA_TABLE`] maps each key to its record (the
//! 8-byte big-endian revision of the write that last changed it, then the value bytes), and
//! [`META_TABLE`] holds the store-wide revision counter ([`REVISION_KEY`]) and the format marker
//! ([`FORMAT_KEY`] = [`FORMAT`]). Every commit checks its conditions, bumps the counter and writes
//! its records in one redb write transaction committed with `Durability::Immediate`.
//!
//! Processes are serialised by an exclusive lock on the sibling file `<path>.lock`, taken before
//! redb is opened and held until the store is dropped. The database file is created with mode 0600,
//! and only when the configuration allows it ([`RedbConfig::creating`]): opening a missing (or
//! empty) file otherwise fails and creates nothing.

mod config;
mod error;
mod store;

pub use config::RedbConfig;
pub use store::{RedbStore, DATA_TABLE, FORMAT, FORMAT_KEY, META_TABLE, REVISION_KEY};
