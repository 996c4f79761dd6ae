//! Fuzzes the `CNI_ARGS` parser with any text (lossily decoded, as the binary reads its environment).
//!
//! Never panics; an accepted value has unknown keys only with `IgnoreUnknown`.
#![no_main]

use blockipam::args::{parse_cni_args, KNOWN_KEYS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let Ok(args) = parse_cni_args(&text) else {
        return;
    };
    let _ = args.legacy_handle();
    if !args.ignore_unknown && !text.is_empty() {
        for pair in text.split(';') {
            let key = pair.split('=').next().unwrap_or_default();
            assert!(
                KNOWN_KEYS.contains(&key),
                "unknown key {key:?} accepted without IgnoreUnknown"
            );
        }
    }
});
