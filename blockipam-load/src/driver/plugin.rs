//! Plugin mode: a node's ADD and DEL as a runtime makes them, by running the real `blockipam`
//! binary with the CNI environment and the node's netconf (its own `nodename` and
//! `ipam_lock_file`) on stdin.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;

use blockipam_store::plugin_call::{run_plugin, PluginCall};
use blockipam_store::DatastoreSettings;
use serde_json::{json, Value};

use crate::config::LoadConfig;
use crate::pods;

/// The plugin binary and the directory of the nodes' lock files.
#[derive(Debug)]
pub struct PluginRunner {
    binary: PathBuf,
    lock_dir: PathBuf,
}

/// One node's netconf, ready to send.
#[derive(Debug, Clone)]
pub struct PluginNode {
    runner: Arc<PluginRunner>,
    netconf: Arc<Vec<u8>>,
}

impl PluginRunner {
    /// Runs `binary`; node lock files go in `lock_dir`.
    pub fn new(binary: PathBuf, lock_dir: PathBuf) -> Self {
        PluginRunner { binary, lock_dir }
    }

    /// The netconf of node `host`: the run's pool (created on first use by the plugin, as a real
    /// netconf would), the store `settings`, the node's name and lock file. No gateway: addresses
    /// are reported with their block's prefix.
    pub fn netconf(&self, config: &LoadConfig, settings: &DatastoreSettings, host: &str) -> Value {
        let mut pool = json!({"cidr": config.pool.to_string()});
        if let Some(size) = config.block_size {
            pool["block_size"] = json!(size);
        }
        let mut ipam = json!({
            "type": "blockipam",
            "nodename": host,
            "ipam_lock_file": self.lock_dir.join(format!("{host}.lock")),
            "ipam_lock_timeout_seconds": settings.lock_wait.as_secs_f64(),
            "log_level": "error",
            "pools": [pool],
            "datastore_type": settings.datastore_type().as_str(),
        });
        let mut set = |key: &str, value: Value| ipam[key] = value;
        match settings.etcd() {
            None => {
                if let Some(path) = settings.resolved_path() {
                    set("datastore_path", json!(path));
                }
            }
            Some(etcd) => {
                set("etcd_endpoints", json!(etcd.endpoints));
                if let Some(prefix) = &etcd.prefix {
                    set("etcd_prefix", json!(prefix));
                }
                for (key, file) in [
                    ("etcd_ca_cert_file", &etcd.ca_cert_file),
                    ("etcd_cert_file", &etcd.cert_file),
                    ("etcd_key_file", &etcd.key_file),
                ] {
                    if let Some(file) = file {
                        set(key, json!(file));
                    }
                }
                if let (Some(user), Some(password)) = (&etcd.username, &etcd.password) {
                    set("etcd_username", json!(user));
                    set("etcd_password", json!(password.expose()));
                }
            }
        }
        json!({"cniVersion": "1.0.0", "name": config.network, "type": "ptp", "ipam": ipam})
    }
}

impl PluginNode {
    /// A node sending `netconf` through `runner`.
    pub fn new(runner: Arc<PluginRunner>, netconf: &Value) -> Self {
        PluginNode {
            runner,
            netconf: Arc::new(netconf.to_string().into_bytes()),
        }
    }

    /// Runs one CNI command for `container` and returns its standard output.
    async fn call(&self, command: &str, container: &str) -> Result<Vec<u8>, String> {
        let cni_args = pods::cni_args(container);
        let call = PluginCall {
            plugin: &self.runner.binary,
            command,
            container_id: container,
            extra_env: &[("CNI_ARGS", &cni_args)],
        };
        let output = run_plugin(&call, &self.netconf, None).await.map_err(|e| {
            format!(
                "{command} {container}: {}: {e}",
                self.runner.binary.display()
            )
        })?;
        if output.status.success() {
            Ok(output.stdout)
        } else {
            Err(format!(
                "{command} {container} failed ({}): {} {}",
                output.status,
                String::from_utf8_lossy(&output.stdout).trim(),
                String::from_utf8_lossy(&output.stderr).trim()
            ))
        }
    }

    /// ADD: the addresses of the result's `ips`.
    pub async fn add(&self, container: &str) -> Result<Vec<IpAddr>, String> {
        let stdout = self.call("ADD", container).await?;
        parse_result_ips(&stdout).map_err(|e| format!("ADD {container}: {e}"))
    }

    /// DEL (the plugin reports nothing on success).
    pub async fn del(&self, container: &str) -> Result<(), String> {
        self.call("DEL", container).await.map(drop)
    }
}

/// The addresses of a CNI 1.0.0 result (`ips[].address`, `10.0.0.5/26`).
///
/// # Errors
/// A message when the output is not such a result, or holds no address.
pub fn parse_result_ips(stdout: &[u8]) -> Result<Vec<IpAddr>, String> {
    let result: Value = serde_json::from_slice(stdout).map_err(|e| {
        format!(
            "the plugin's output is not JSON ({e}): {}",
            String::from_utf8_lossy(stdout)
        )
    })?;
    let ips: Vec<IpAddr> = result["ips"]
        .as_array()
        .map(|ips| {
            ips.iter()
                .filter_map(|ip| ip["address"].as_str())
                .filter_map(|address| address.parse::<ipnet::IpNet>().ok())
                .map(|net| net.addr())
                .collect()
        })
        .unwrap_or_default();
    if ips.is_empty() {
        return Err(format!("the result holds no address: {result}"));
    }
    Ok(ips)
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockipam_store::{Backend, EtcdSettings};

    #[test]
    fn result_addresses_are_read_from_ips_and_an_empty_result_is_an_error() {
        let ok = br#"{"cniVersion":"1.0.0","ips":[{"address":"10.0.0.5/26"}]}"#;
        assert_eq!(
            parse_result_ips(ok),
            Ok(vec!["10.0.0.5".parse::<IpAddr>().expect("ip")])
        );
        assert!(parse_result_ips(br#"{"ips":[]}"#).is_err());
        assert!(parse_result_ips(b"oops").is_err());
    }

    #[test]
    fn each_node_gets_its_own_name_and_lock_file() {
        let runner = PluginRunner::new("/x/blockipam".into(), "/locks".into());
        let settings = DatastoreSettings {
            backend: Backend::Etcd(EtcdSettings {
                endpoints: vec!["http://127.0.0.1:1".into()],
                prefix: Some("/p/".into()),
                ..EtcdSettings::default()
            }),
            ..DatastoreSettings::default()
        };
        let config = LoadConfig {
            block_size: Some(28),
            ..LoadConfig::default()
        };
        let a = runner.netconf(&config, &settings, "node-a");
        let b = runner.netconf(&config, &settings, "node-b");
        assert_eq!(a["ipam"]["nodename"], "node-a");
        assert_eq!(a["ipam"]["ipam_lock_file"], "/locks/node-a.lock");
        assert_eq!(b["ipam"]["ipam_lock_file"], "/locks/node-b.lock");
        assert_eq!(a["ipam"]["etcd_prefix"], "/p/");
        assert_eq!(a["ipam"]["pools"][0]["block_size"], 28);
        assert_eq!(a["name"], "load");
    }
}
