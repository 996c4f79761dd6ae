//! Fuzzes the stored-object decoder (`ipam_core::model::decode`) for every type the store holds.
//!
//! The first byte picks the type (block, handle, pool, IPAM config, block claim entry of any
//! format, pool generation counter, an owner key's attribute); the rest is the stored value.
//! Decoding never panics; whatever decodes encodes back to bytes that decode to the same object;
//! a decoded block's own consistency check (what `check` runs on every stored block) never panics
//! either.
#![no_main]

use std::fmt::Debug;

use ipam_core::model::{
    decode, decode_claim, encode, Attribute, Block, Claim, ClaimEntry, Handle, IpamConfig, Pool,
    FORMAT_VERSION,
};
use libfuzzer_sys::fuzz_target;
use serde::de::DeserializeOwned;
use serde::Serialize;

fn round_trip<T: Serialize + DeserializeOwned + PartialEq + Debug + 'static>(
    bytes: &[u8],
) -> Option<T> {
    let value: T = decode("fuzz", bytes).ok()?;
    let encoded = encode(&value).expect("a decoded object encodes again");
    let again: T = decode("fuzz", &encoded).expect("re-encoded bytes decode");
    assert_eq!(again, value, "decode(encode(x)) != x");
    Some(value)
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, bytes)) = data.split_first() else {
        return;
    };
    match kind % 7 {
        0 => {
            if let Some(block) = round_trip::<Block>(bytes) {
                let _ = block.self_check();
            }
        }
        1 => {
            round_trip::<Handle>(bytes);
        }
        2 => {
            round_trip::<Pool>(bytes);
        }
        3 => {
            round_trip::<IpamConfig>(bytes);
        }
        4 => {
            // A block claim entry, through the reader the allocator uses for every format (format
            // 1: the affine host alone; 2 and 3: with the free count; 4 on: `Claim`). One in this
            // build's format encodes back to the same entry.
            if let Ok(entry) = decode_claim("fuzz", bytes) {
                if bytes.first() == Some(&FORMAT_VERSION) {
                    let claim =
                        round_trip::<Claim>(bytes).expect("a decoded entry decodes as Claim");
                    let as_entry = ClaimEntry {
                        affinity: claim.affinity,
                        free: Some(claim.free),
                        emptied_at: claim.emptied_at,
                        last_cooling_release: claim.last_cooling_release,
                    };
                    assert_eq!(entry, as_entry, "decode_claim and Claim disagree");
                }
            }
        }
        5 => {
            // The pool generation counter.
            round_trip::<u64>(bytes);
        }
        _ => {
            // An owner key: the attribute of an address its block keeps apart.
            round_trip::<Attribute>(bytes);
        }
    }
});
