//! The versioned binary encoding of stored objects (one format-version byte, then bincode), and
//! the claim index entries written beside every block.

use ipnet::IpNet;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::model::error::IpamError;

use crate::model::{
    cooldown_end, keys, Block, FORMAT_VERSION, NEWEST_OBJECT_LAYOUT, OLDEST_READABLE_FORMAT_VERSION,
};

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<{ 16 * 1024 * 1024 }>()
}

/// Encodes a stored object: one format-version byte, then bincode.
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, IpamError> {
    let mut out = vec![FORMAT_VERSION];
    let body = bincode::serde::encode_to_vec(value, bincode_config())
        .map_err(|e| IpamError::Internal(format!("cannot encode: {e}")))?;
    out.extend_from_slice(&body);
    Ok(out)
}

/// Splits a stored value into its format version and body; a version this build cannot read is
/// [`IpamError::Corrupt`] naming the key.
pub(crate) fn versioned<'a>(key: &str, bytes: &'a [u8]) -> Result<(u8, &'a [u8]), IpamError> {
    let (&version, body) = bytes.split_first().ok_or_else(|| IpamError::Corrupt {
        key: key.to_owned(),
        message: "empty value".into(),
    })?;
    if !(OLDEST_READABLE_FORMAT_VERSION..=FORMAT_VERSION).contains(&version) {
        return Err(IpamError::Corrupt {
            key: key.to_owned(),
            message: format!(
                "format version {version}, this build reads versions {OLDEST_READABLE_FORMAT_VERSION} to {FORMAT_VERSION}"
            ),
        });
    }
    Ok((version, body))
}

/// Decodes one bincode body that must fill `body` exactly.
pub(crate) fn decode_body<T: DeserializeOwned>(key: &str, body: &[u8]) -> Result<T, IpamError> {
    let corrupt = |message: String| IpamError::Corrupt {
        key: key.to_owned(),
        message,
    };
    let (value, used) = bincode::serde::decode_from_slice(body, bincode_config())
        .map_err(|e| corrupt(format!("cannot decode: {e}")))?;
    if used != body.len() {
        return Err(corrupt(format!("{} trailing bytes", body.len() - used)));
    }
    Ok(value)
}

/// Decodes a stored object written by [`encode`]; any damage is a [`IpamError::Corrupt`] naming the key.
/// Claim index entries have their own reader, [`decode_claim`].
///
/// Objects whose layout changed since format 1 (pools, blocks, the IPAM config) are read from
/// whichever readable version they were written in ([`crate::model::formats`]).
pub fn decode<T: DeserializeOwned + 'static>(key: &str, bytes: &[u8]) -> Result<T, IpamError> {
    let (version, body) = versioned(key, bytes)?;
    if version < NEWEST_OBJECT_LAYOUT {
        if let Some(upgraded) = crate::model::formats::decode_older::<T>(key, version, body)? {
            return Ok(upgraded);
        }
    }
    decode_body(key, body)
}

/// What a block's claim index entry holds (format 2): the block's affine host and how many of its
/// addresses are free, so that new-block searches and borrowing read these small entries instead of
/// whole blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    /// The block's affine host; `None` for a block nobody owns.
    pub affinity: Option<String>,
    /// Free addresses in the block when it was last written (cooling addresses included).
    pub free: u32,
    /// The block's [`Block::emptied_at`] (format 4).
    pub emptied_at: Option<u64>,
    /// When the newest of the block's cooling addresses was released (format 4).
    pub last_cooling_release: Option<u64>,
}

/// A decoded claim index entry, of any format version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimEntry {
    /// The block's affine host; `None` for a block nobody owns.
    pub affinity: Option<String>,
    /// Free addresses; `None` in an entry written by format 1, which recorded only the host (the
    /// block's next write records it).
    pub free: Option<u32>,
    /// When the block last became empty; `None` while it holds allocations, or when the entry
    /// was written by format 3 or earlier.
    pub emptied_at: Option<u64>,
    /// When the newest of its cooling addresses was released; `None` when it has none.
    pub last_cooling_release: Option<u64>,
}

impl ClaimEntry {
    /// From when the block of `cidr` counts as empty given the cooldown (see
    /// [`Block::empty_from`]): `None` while it holds allocations, or when the entry does not say
    /// (format 1).
    pub fn empty_from(&self, cidr: &IpNet, cooldown_seconds: u32) -> Option<u64> {
        let probe = Block::new(*cidr, None, 0);
        if self.free? != probe.capacity() {
            return None;
        }
        let emptied = self.emptied_at.unwrap_or(0);
        Some(match self.last_cooling_release {
            Some(released) => emptied.max(cooldown_end(released, cooldown_seconds)),
            None => emptied,
        })
    }
}

/// The claim index entry of `block`, encoded.
pub fn encode_claim(block: &Block) -> Result<Vec<u8>, IpamError> {
    encode(&Claim {
        affinity: block.affinity.clone(),
        free: block.free(),
        emptied_at: block.emptied_at,
        last_cooling_release: block.cooling.iter().map(|c| c.released_at).max(),
    })
}

/// Decodes a claim index entry of format 1 (the host alone), 2 or 3 (host and free count) or 4
/// and later ([`Claim`]).
pub fn decode_claim(key: &str, bytes: &[u8]) -> Result<ClaimEntry, IpamError> {
    let (version, body) = versioned(key, bytes)?;
    if version < crate::model::formats::FORMAT_OF_COOLDOWN {
        return crate::model::formats::decode_older_claim(key, version, body);
    }
    let claim: Claim = decode_body(key, body)?;
    Ok(ClaimEntry {
        affinity: claim.affinity,
        free: Some(claim.free),
        emptied_at: claim.emptied_at,
        last_cooling_release: claim.last_cooling_release,
    })
}

/// The two entries that store `block` as it is: the block at its key, and its claim index entry.
/// For writers that create whole stores, recorded at [`FORMAT_VERSION`] (import, migration tools);
/// the allocator writes blocks through its own conditional transactions.
pub fn block_entries(block: &Block) -> Result<Vec<(String, Vec<u8>)>, IpamError> {
    Ok(vec![
        (keys::block_key_in(block, FORMAT_VERSION), encode(block)?),
        (keys::block_claim(&block.cidr), encode_claim(block)?),
    ])
}
