//! The record layout of the embedded stores (sled, redb): each value is kept behind an 8-byte
//! big-endian revision header, and the store's revision counter is 8 big-endian bytes.

use super::{KvError, Revision};

/// Length of the revision header in front of every stored value.
pub const RECORD_HEADER: usize = 8;

/// The record for `value` written at `revision`: the header, then the value.
pub fn encode_record(revision: u64, value: &[u8]) -> Vec<u8> {
    let mut record = Vec::with_capacity(RECORD_HEADER + value.len());
    record.extend_from_slice(&revision.to_be_bytes());
    record.extend_from_slice(value);
    record
}

/// Splits a stored record of `key` into its revision and its value.
///
/// # Errors
/// [`KvError::Corrupt`] naming the key when the record is shorter than its header or carries
/// revision 0 (no write ever stores it).
pub fn decode_record<'a>(key: &str, record: &'a [u8]) -> Result<(Revision, &'a [u8]), KvError> {
    let Some((header, value)) = record.split_first_chunk::<RECORD_HEADER>() else {
        return Err(KvError::corrupt(
            Some(key),
            format!(
                "the stored record is {} bytes, shorter than its {RECORD_HEADER}-byte revision header",
                record.len()
            ),
        ));
    };
    match u64::from_be_bytes(*header) {
        0 => Err(KvError::corrupt(
            Some(key),
            "the stored record carries revision 0",
        )),
        revision => Ok((Revision(revision), value)),
    }
}

/// The revision counter stored under `counter_key` (0 when there is none yet).
///
/// # Errors
/// [`KvError::Corrupt`] naming the counter's key when it is not 8 bytes.
pub fn decode_counter(counter_key: &str, stored: Option<&[u8]>) -> Result<u64, KvError> {
    match stored {
        None => Ok(0),
        Some(bytes) => bytes.try_into().map(u64::from_be_bytes).map_err(|_| {
            KvError::corrupt(
                Some(counter_key),
                format!("the revision counter is {} bytes, not 8", bytes.len()),
            )
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_carries_its_revision_in_front_of_the_value() {
        let record = encode_record(7, b"value");
        assert_eq!(record.len(), RECORD_HEADER + 5);
        assert_eq!(
            decode_record("k", &record).expect("decode"),
            (Revision(7), &b"value"[..])
        );
    }

    #[test]
    fn short_records_revision_zero_and_odd_counters_are_corrupt_naming_the_key() {
        for record in [&b"short"[..], &[0u8; RECORD_HEADER][..]] {
            match decode_record("ipam/v1/x", record) {
                Err(KvError::Corrupt { key, .. }) => assert_eq!(key.as_deref(), Some("ipam/v1/x")),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(decode_counter("revision", None).expect("none"), 0);
        assert_eq!(
            decode_counter("revision", Some(&9u64.to_be_bytes())).expect("counter"),
            9
        );
        match decode_counter("revision", Some(b"abc")) {
            Err(KvError::Corrupt { key, message }) => {
                assert_eq!(key.as_deref(), Some("revision"));
                assert!(message.contains("3 bytes"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }
}
