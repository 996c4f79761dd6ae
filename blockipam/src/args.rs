//! `CNI_ARGS` parsed as libcni's `LoadArgs` does.
//!
//! `CNI_ARGS` parsed as libcni's `LoadArgs` does: `K=V;K=V`, exact key names, unknown keys an
//! error unless `IgnoreUnknown` is `1` or `true`.

use std::net::IpAddr;

use crate::protocol::{codes, parse_ip_maybe_prefixed, CniError};

/// The `CNI_ARGS` keys blockipam understands.
pub const KNOWN_KEYS: [&str; 6] = [
    "IgnoreUnknown",
    "IP",
    "K8S_POD_NAMESPACE",
    "K8S_POD_NAME",
    "K8S_POD_INFRA_CONTAINER_ID",
    "K8S_POD_UID",
];

/// The parsed `CNI_ARGS`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniArgs {
    /// `IgnoreUnknown`.
    pub ignore_unknown: bool,
    /// `IP=a,b`: specific addresses to assign (prefix lengths dropped).
    pub ips: Vec<IpAddr>,
    /// `K8S_POD_NAMESPACE`.
    pub pod_namespace: Option<String>,
    /// `K8S_POD_NAME`.
    pub pod_name: Option<String>,
    /// `K8S_POD_INFRA_CONTAINER_ID`.
    pub infra_container_id: Option<String>,
    /// `K8S_POD_UID`.
    pub pod_uid: Option<String>,
}

impl CniArgs {
    /// Calico's legacy handle `<namespace>.<pod>`, when both are known.
    pub fn legacy_handle(&self) -> Option<String> {
        match (&self.pod_namespace, &self.pod_name) {
            (Some(ns), Some(pod)) if !ns.is_empty() && !pod.is_empty() => {
                Some(format!("{ns}.{pod}"))
            }
            _ => None,
        }
    }
}

fn env_error(msg: String) -> CniError {
    CniError::new(codes::INVALID_ENVIRONMENT, msg)
}

/// Parses a `CNI_ARGS` value.
///
/// # Errors
/// Code 4 (naming `CNI_ARGS`, the pair and the problem) for a pair that is not exactly one
/// `K=V`, a value that does not parse (`IgnoreUnknown`, `IP`), or unknown keys without
/// `IgnoreUnknown`.
pub fn parse_cni_args(text: &str) -> Result<CniArgs, CniError> {
    let mut args = CniArgs::default();
    if text.is_empty() {
        return Ok(args);
    }
    let mut unknown = Vec::new();
    for pair in text.split(';') {
        let parts: Vec<&str> = pair.split('=').collect();
        let [key, value] = parts.as_slice() else {
            return Err(env_error(format!(
                "CNI_ARGS: invalid pair {pair:?} (expected KEY=VALUE)"
            )));
        };
        match *key {
            "IgnoreUnknown" => {
                args.ignore_unknown = match value.to_ascii_lowercase().as_str() {
                    "1" | "true" => true,
                    "0" | "false" => false,
                    _ => {
                        return Err(env_error(format!(
                    "CNI_ARGS: error parsing value of pair {pair:?}: expected 1, true, 0 or false"
                )))
                    }
                }
            }
            "IP" => {
                for item in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                    let ip = parse_ip_maybe_prefixed(item).map_err(|e| {
                        env_error(format!(
                            "CNI_ARGS: error parsing value of pair {pair:?}: {e}"
                        ))
                    })?;
                    args.ips.push(ip);
                }
            }
            "K8S_POD_NAMESPACE" => args.pod_namespace = Some((*value).to_owned()),
            "K8S_POD_NAME" => args.pod_name = Some((*value).to_owned()),
            "K8S_POD_INFRA_CONTAINER_ID" => args.infra_container_id = Some((*value).to_owned()),
            "K8S_POD_UID" => args.pod_uid = Some((*value).to_owned()),
            _ => unknown.push(pair.to_owned()),
        }
    }
    if !unknown.is_empty() && !args.ignore_unknown {
        return Err(env_error(format!(
            "CNI_ARGS: unknown args {unknown:?} (known keys: {}; add IgnoreUnknown=1 to ignore the others)",
            KNOWN_KEYS.join(", ")
        )));
    }
    Ok(args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubernetes_args_and_addresses_parse() {
        let args = parse_cni_args(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod;IP=10.0.0.5,fd00::5/64;FOO=bar",
        )
        .expect("parse");
        assert!(args.ignore_unknown);
        assert_eq!(args.legacy_handle().as_deref(), Some("ns.pod"));
        assert_eq!(args.ips.len(), 2);
    }

    #[test]
    fn unknown_key_without_ignore_unknown_names_the_pair() {
        let err = parse_cni_args("FOO=bar").expect_err("unknown");
        assert_eq!(err.code, codes::INVALID_ENVIRONMENT);
        assert!(err.msg.contains("FOO=bar"), "{}", err.msg);
    }

    #[test]
    fn ignore_unknown_counts_wherever_it_appears() {
        assert!(parse_cni_args("FOO=bar;IgnoreUnknown=true").is_ok());
        assert!(parse_cni_args("FOO=bar;IgnoreUnknown=0").is_err());
    }

    #[test]
    fn malformed_pairs_and_values_are_refused_as_libcni_does() {
        for bad in ["IP", "IP=1=2", "a=b;", "IP=not-an-ip", "IgnoreUnknown=yes"] {
            let err = parse_cni_args(bad).expect_err(bad);
            assert_eq!(err.code, codes::INVALID_ENVIRONMENT, "{bad}");
            assert!(err.msg.starts_with("CNI_ARGS"), "{bad}: {}", err.msg);
        }
    }

    #[test]
    fn every_kubernetes_key_is_known_and_read() {
        let args = parse_cni_args(
            "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod;K8S_POD_INFRA_CONTAINER_ID=c0ffee;K8S_POD_UID=u-1",
        )
        .expect("every key is known");
        assert_eq!(
            args,
            CniArgs {
                ignore_unknown: false,
                ips: Vec::new(),
                pod_namespace: Some("ns".into()),
                pod_name: Some("pod".into()),
                infra_container_id: Some("c0ffee".into()),
                pod_uid: Some("u-1".into()),
            }
        );
    }

    #[test]
    fn ignore_unknown_may_be_said_off() {
        for off in ["0", "false", "FALSE"] {
            let args = parse_cni_args(&format!("IgnoreUnknown={off};K8S_POD_NAME=p")).expect(off);
            assert!(!args.ignore_unknown, "{off}");
        }
    }

    /// Calico's `<namespace>.<pod>` handle needs both, neither empty.
    #[test]
    fn the_legacy_handle_needs_a_namespace_and_a_pod_name() {
        for (text, handle) in [
            ("K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod", Some("ns.pod")),
            ("K8S_POD_NAMESPACE=;K8S_POD_NAME=pod", None),
            ("K8S_POD_NAMESPACE=ns;K8S_POD_NAME=", None),
            ("K8S_POD_NAMESPACE=;K8S_POD_NAME=", None),
            ("K8S_POD_NAME=pod", None),
            ("K8S_POD_NAMESPACE=ns", None),
        ] {
            let args = parse_cni_args(text).expect(text);
            assert_eq!(args.legacy_handle().as_deref(), handle, "{text}");
        }
    }
}
