//! Fuzzes the plugin's netconf parsing: any stdin through `parse_header` then `parse_netconf`.
//!
//! Never panics; an accepted header names a valid network, and an accepted netconf carries it.
#![no_main]

use blockipam::netconf::{is_valid_cni_name, parse_header, parse_netconf};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|stdin: &[u8]| {
    let Ok((value, name, version)) = parse_header(stdin) else {
        return;
    };
    assert!(is_valid_cni_name(&name), "accepted network name {name:?}");
    assert!(!version.is_empty(), "empty cniVersion accepted as is");
    if let Ok(conf) = parse_netconf(&value, name.clone(), version.clone()) {
        assert_eq!(conf.name, name);
        assert_eq!(conf.cni_version, version);
        assert!(!conf.timeout.is_zero(), "a zero deadline was accepted");
    }
});
