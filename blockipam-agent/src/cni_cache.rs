//! libcni's cache of each ADD's result (`<cache dir>/results/<network>-<container id>-<ifname>`, JSON of kind `cniCacheV1`): what the runtime believes a sandbox holds, the witness from which the agent records a live pod's lost address again.

use std::net::IpAddr;
use std::path::Path;

use ipam_core::allocator::leaks::{handle_id, Attachment, Reassertion};
use serde::Deserialize;

/// The libcni cache directory containerd and CRI-O use unless configured otherwise.
pub const DEFAULT_CNI_CACHE_DIR: &str = "/var/lib/cni";
/// The cache entries' `kind`.
const CACHE_KIND: &str = "cniCacheV1";

/// One cached ADD, as libcni writes it (the fields this reader needs).
#[derive(Debug, Deserialize)]
struct CachedAdd {
    kind: String,
    #[serde(rename = "containerId")]
    container_id: String,
    #[serde(rename = "ifName")]
    if_name: String,
    #[serde(rename = "networkName")]
    network_name: String,
    #[serde(rename = "cniArgs", default)]
    cni_args: Vec<(String, String)>,
    #[serde(default)]
    result: Option<CachedResult>,
}

#[derive(Debug, Deserialize)]
struct CachedResult {
    #[serde(default)]
    ips: Vec<CachedIp>,
}

#[derive(Debug, Deserialize)]
struct CachedIp {
    address: String,
}

/// What the cache says sandbox `container` got `address` from: the record the plugin made at
/// that ADD (its handle and attributes, stamped `now`), for `host`. `None` when no cache entry of
/// that sandbox lists that address (then nothing can be re-asserted: it is only reported).
pub fn reassertion_for(
    cache_dir: &Path,
    container: &str,
    address: IpAddr,
    host: &str,
    now: &str,
) -> Option<Reassertion> {
    let entries = std::fs::read_dir(cache_dir.join("results")).ok()?;
    let marker = format!("-{container}-");
    for entry in entries.filter_map(Result::ok) {
        if !entry.file_name().to_string_lossy().contains(&marker) {
            continue;
        }
        let Ok(bytes) = std::fs::read(entry.path()) else {
            continue;
        };
        let Ok(cached) = serde_json::from_slice::<CachedAdd>(&bytes) else {
            continue;
        };
        let lists_it = cached.result.as_ref().is_some_and(|result| {
            result.ips.iter().any(|ip| {
                ip.address
                    .split('/')
                    .next()
                    .and_then(|a| a.parse::<IpAddr>().ok())
                    == Some(address)
            })
        });
        if cached.kind != CACHE_KIND || cached.container_id != container || !lists_it {
            continue;
        }
        let arg = |key: &str| {
            cached
                .cni_args
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
        };
        let attributes = Attachment {
            network: &cached.network_name,
            container_id: container,
            interface: &cached.if_name,
            namespace: arg("K8S_POD_NAMESPACE"),
            pod: arg("K8S_POD_NAME"),
        }
        .attributes(now);
        return Some(Reassertion {
            address,
            handle: handle_id(&cached.network_name, container),
            host: host.to_owned(),
            attributes,
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_entry(dir: &Path, name: &str, body: &serde_json::Value) {
        std::fs::create_dir_all(dir.join("results")).expect("mkdir");
        std::fs::write(dir.join("results").join(name), body.to_string()).expect("write");
    }

    #[test]
    fn a_cached_add_gives_the_plugins_record_of_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        write_entry(
            dir.path(),
            "pods-abc-eth0",
            &serde_json::json!({
                "kind": "cniCacheV1",
                "containerId": "abc",
                "config": "e30=",
                "ifName": "eth0",
                "networkName": "pods",
                "cniArgs": [["IgnoreUnknown", "1"], ["K8S_POD_NAMESPACE", "team"], ["K8S_POD_NAME", "web"]],
                "result": {"cniVersion": "1.0.0", "ips": [{"address": "10.1.0.5/26"}]}
            }),
        );
        let address: IpAddr = "10.1.0.5".parse().expect("address");
        let found = reassertion_for(dir.path(), "abc", address, "node-a", "2026-01-01T00:00:00Z")
            .expect("found");
        assert_eq!(found.handle, "pods.abc");
        assert_eq!(found.host, "node-a");
        assert_eq!(found.attributes["pod"], "web");
        assert_eq!(found.attributes["namespace"], "team");
        assert_eq!(found.attributes["interface"], "eth0");
        assert_eq!(found.attributes["network"], "pods");
        // Another address, another container, or no cache at all: nothing to re-assert.
        let other: IpAddr = "10.1.0.6".parse().expect("address");
        assert!(reassertion_for(dir.path(), "abc", other, "node-a", "t").is_none());
        assert!(reassertion_for(dir.path(), "abd", address, "node-a", "t").is_none());
        let empty = tempfile::tempdir().expect("tempdir");
        assert!(reassertion_for(empty.path(), "abc", address, "node-a", "t").is_none());
    }

    #[test]
    fn entries_of_another_kind_or_unreadable_are_not_witnesses() {
        let dir = tempfile::tempdir().expect("tempdir");
        write_entry(
            dir.path(),
            "pods-abc-eth0",
            &serde_json::json!({
                "kind": "cniCacheV2",
                "containerId": "abc",
                "ifName": "eth0",
                "networkName": "pods",
                "result": {"ips": [{"address": "10.1.0.5/26"}]}
            }),
        );
        std::fs::write(dir.path().join("results/pods-abc-eth1"), b"{not json").expect("write");
        let address: IpAddr = "10.1.0.5".parse().expect("address");
        assert!(reassertion_for(dir.path(), "abc", address, "node-a", "t").is_none());
    }
}
