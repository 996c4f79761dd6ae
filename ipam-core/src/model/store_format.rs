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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generations_cover_only_a_record_that_decodes_and_names_their_format_or_later() {
        let at = |writes: u8| FormatRecord { writes }.encode().expect("encode");
        assert!(!FormatRecord::generations_cover(&at(
            GENERATIONS_COVER_FORMAT - 1
        )));
        assert!(FormatRecord::generations_cover(&at(
            GENERATIONS_COVER_FORMAT
        )));
        assert!(FormatRecord::generations_cover(&at(FORMAT_VERSION)));
        // A later release may add fields to the record: what it names still counts.
        let extended = format!(r#"{{"writes":{GENERATIONS_COVER_FORMAT},"later":true}}"#);
        assert!(FormatRecord::generations_cover(extended.as_bytes()));
        // Anything that is not a record: every key keeps its own validator.
        for garbage in [
            &b""[..],
            b"\x07",
            b"{}",
            b"null",
            b"{\"writes\":\"7\"}",
            b"{\"writes\":-7}",
            b"{\"writes\":700}",
            b"{\"writes\":7",
            b"\xff\xfe",
        ] {
            assert!(
                !FormatRecord::generations_cover(garbage),
                "{}",
                String::from_utf8_lossy(garbage)
            );
        }
    }

    #[test]
    fn a_record_that_does_not_decode_or_names_a_format_before_records_is_corrupt_naming_its_key() {
        let key = &crate::model::keys::store_format();
        for bad in [&b"{}"[..], b"garbage", b"{\"writes\":2}"] {
            match FormatRecord::decode(key, bad) {
                Err(IpamError::Corrupt { key: named, .. }) => assert_eq!(&named, key),
                other => panic!("{}: {other:?}", String::from_utf8_lossy(bad)),
            }
        }
        let record = FormatRecord {
            writes: FORMAT_OF_UNRECORDED_STORES,
        };
        let bytes = record.encode().expect("encode");
        assert_eq!(FormatRecord::decode(key, &bytes).expect("decode"), record);
    }

    #[test]
    fn a_writer_writes_what_the_record_names_and_refuses_a_newer_one() {
        let newer = FormatRecord {
            writes: FORMAT_VERSION + 1,
        };
        assert!(matches!(
            newer.writable(),
            Err(IpamError::FormatTooNew { writes, newest })
                if writes == FORMAT_VERSION + 1 && newest == FORMAT_VERSION
        ));
        for writes in OLDEST_WRITABLE_FORMAT..=FORMAT_VERSION {
            assert_eq!(
                FormatRecord { writes }.writable().expect("writable"),
                writes
            );
        }
    }
}
