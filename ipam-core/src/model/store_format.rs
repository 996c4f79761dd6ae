//! The store's format record: the stored-format version every writer writes, so that binaries of
//! the previous release keep reading the store until the operator finalizes an upgrade.
//!
//! A writer of this build reads every format from [`OLDEST_READABLE_FORMAT_VERSION`] to
//! [`FORMAT_VERSION`] and writes the one the record names (see [`crate::model::formats::downgrade`]).
//! A store without the record was written by a release that predates it: it counts as
//! [`FORMAT_OF_UNRECORDED_STORES`], and the first writer that finds it in use records that; an
//! empty store is new and is recorded at [`FORMAT_VERSION`].

use serde::{Deserialize, Serialize};

use crate::model::error::IpamError;
#[cfg(doc)]
use crate::model::OLDEST_READABLE_FORMAT_VERSION;
use crate::model::{FORMAT_VERSION, GENERATIONS_COVER_FORMAT};

/// The format a store that predates the record counts as: the newest format written before the
/// record existed (the previous release's).
pub const FORMAT_OF_UNRECORDED_STORES: u8 = 3;

/// The oldest format this build can write (see [`crate::model::formats::downgrade`]).
pub const OLDEST_WRITABLE_FORMAT: u8 = 3;

/// The record stored under [`crate::model::keys::store_format`], as JSON so that any later
/// release can read and extend it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FormatRecord {
    /// The stored-format version every writer writes.
    pub writes: u8,
}

impl FormatRecord {
    /// The record's bytes.
    ///
    /// # Errors
    /// [`IpamError::Internal`] if it cannot be encoded (it always can).
    pub fn encode(&self) -> Result<Vec<u8>, IpamError> {
        serde_json::to_vec(self)
            .map_err(|e| IpamError::Internal(format!("cannot encode the format record: {e}")))
    }

    /// Reads the record at `key`.
    ///
    /// # Errors
    /// [`IpamError::Corrupt`] when it is not a format record, or names a format older than any
    /// writer ever wrote.
    pub fn decode(key: &str, bytes: &[u8]) -> Result<FormatRecord, IpamError> {
        let record: FormatRecord =
            serde_json::from_slice(bytes).map_err(|e| IpamError::Corrupt {
                key: key.to_owned(),
                message: format!("not a format record: {e}"),
            })?;
        if record.writes < FORMAT_OF_UNRECORDED_STORES {
            return Err(IpamError::Corrupt {
                key: key.to_owned(),
                message: format!(
                    "format record names format {}, older than any store that has the record",
                    record.writes
                ),
            });
        }
        Ok(record)
    }

    /// True when `value`, the stored format record, names [`GENERATIONS_COVER_FORMAT`] or later:
    /// every writer then raises the generations with what an assignment decides from. False for
    /// anything else, a record that does not decode included.
    pub fn generations_cover(value: &[u8]) -> bool {
        serde_json::from_slice::<FormatRecord>(value)
            .is_ok_and(|record| record.writes >= GENERATIONS_COVER_FORMAT)
    }

    /// The format this build writes for a store with this record.
    ///
    /// # Errors
    /// [`IpamError::FormatTooNew`] when a newer release finalized the store at a format this
    /// build cannot write.
    pub fn writable(&self) -> Result<u8, IpamError> {
        if self.writes > FORMAT_VERSION {
            return Err(IpamError::FormatTooNew {
                writes: self.writes,
                newest: FORMAT_VERSION,
            });
        }
        Ok(self.writes.max(OLDEST_WRITABLE_FORMAT))
    }
}
