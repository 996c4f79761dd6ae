//! blockipam's default local store: the [`KvStore`](ipam_core::KvStore) trait on an embedded sled database.
//!
//! The store is a directory holding a sled database with two trees: [`DATA_TREE`] maps each key
//! to its record (the 8-byte big-endian revision of the write that last changed it, then the
//! value bytes), and [`META_TREE`] holds the store-wide revision counter ([`REVISION_KEY`]) and
//! the format marker ([`FORMAT_KEY`] = [`FORMAT`]). Every commit checks its conditions, bumps the
//! counter and writes its records in one sled transaction, then flushes and `fdatasync`s sled's
//! log (sled's own flush stops at `sync_file_range`), then `fsync`s every file sled wrote under
//! `blobs/` since the last commit, and that directory when it gained an entry, before it returns:
//! sled writes a page over about a quarter of a segment (128 KiB) to a file of its own there and
//! syncs neither the file nor the directory. (No sled setting keeps every page below that size:
//! a leaf holds up to 16 records whatever their size, and segments are at most 16 MiB.)
//!
//! A store is created only when the configuration allows it ([`SledConfig::creating`]); opening
//! a missing store (or an empty directory, such as the mount point of an unmounted volume)
//! otherwise fails and creates nothing.
//!
//! Processes are serialised by an exclusive lock on the sibling file `<path>.lock`, taken before
//! sled is opened and held until the store is dropped. A new store is built in `<path>.creating`
//! and renamed into place, so a directory at `path` is always either a complete blockipam store or
//! refused. Files are private to their owner (directories 0700, files 0600).

mod config;
mod error;
mod store;

pub use config::SledConfig;
pub use store::{SledStore, DATA_TREE, FORMAT, FORMAT_KEY, META_TREE, REVISION_KEY};
