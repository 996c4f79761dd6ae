//! Store flags that `blockipam-agent` and `blockipam-load` define alike (feature `clap`).

use std::path::PathBuf;

use crate::RawDatastoreSettings;

/// How to reach etcd: the endpoints and TLS files, with the same names, environment variables and
/// help in `blockipam-agent` and `blockipam-load`. (`blockipamctl` has flags of the same names,
/// but accepts them before or after its command and reads their environment variables itself.)
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct EtcdConnectionFlags {
    /// etcd endpoints, comma-separated (host:port, http://host:port or https://host:port)
    #[arg(
        long,
        value_name = "LIST",
        env = "ETCD_ENDPOINTS",
        help_heading = "Store"
    )]
    pub etcd_endpoints: Option<String>,
    /// etcd CA certificate (PEM)
    #[arg(
        long,
        value_name = "FILE",
        env = "ETCD_CA_CERT_FILE",
        help_heading = "Store"
    )]
    pub etcd_ca_cert_file: Option<PathBuf>,
    /// etcd client certificate (PEM)
    #[arg(
        long,
        value_name = "FILE",
        env = "ETCD_CERT_FILE",
        help_heading = "Store"
    )]
    pub etcd_cert_file: Option<PathBuf>,
    /// etcd client key (PEM)
    #[arg(
        long,
        value_name = "FILE",
        env = "ETCD_KEY_FILE",
        help_heading = "Store"
    )]
    pub etcd_key_file: Option<PathBuf>,
}

impl EtcdConnectionFlags {
    /// `raw` with these endpoints and files, as given (read by `DatastoreSettings::from_raw`).
    pub fn apply(&self, raw: RawDatastoreSettings) -> RawDatastoreSettings {
        RawDatastoreSettings {
            etcd_endpoints: self.etcd_endpoints.iter().cloned().collect(),
            etcd_ca_cert_file: self.etcd_ca_cert_file.clone(),
            etcd_cert_file: self.etcd_cert_file.clone(),
            etcd_key_file: self.etcd_key_file.clone(),
            ..raw
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::{DatastoreSettings, DatastoreType};

    #[derive(Debug, Parser)]
    struct Program {
        #[command(flatten)]
        etcd: EtcdConnectionFlags,
    }

    #[test]
    fn flags_reach_the_etcd_settings_through_from_raw() {
        let program = Program::try_parse_from([
            "program",
            "--etcd-endpoints",
            "h:1, h:2",
            "--etcd-cert-file",
            "/c.pem",
            "--etcd-key-file",
            "/k.pem",
        ])
        .expect("flags parse");
        let settings = DatastoreSettings::from_raw(program.etcd.apply(RawDatastoreSettings {
            datastore_type: Some(DatastoreType::Etcdv3),
            ..RawDatastoreSettings::default()
        }))
        .expect("etcd settings");
        let etcd = settings.etcd().expect("etcd");
        assert_eq!(etcd.endpoints, ["h:1", "h:2"]);
        assert_eq!(etcd.cert_file, Some(PathBuf::from("/c.pem")));
        assert_eq!(etcd.key_file, Some(PathBuf::from("/k.pem")));
        assert_eq!(etcd.ca_cert_file, None);
    }
}
