//! Node labels in the store (`ipam/v1/nodes/<host>`): what pools' node selectors are evaluated
//! against. Calico keeps them on its Node resource; blockipam keeps one small object per labelled
//! node, written by compare-and-swap, and none for a node without labels.

use crate::kv::KeyValue;
use crate::model::decode;
use crate::model::error::IpamError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub use crate::model::keys::{node_key, nodes_dir};

/// Most labels one node may carry (Kubernetes has no count limit; this keeps one node's object
/// small, about 100 KiB at the longest keys and values).
pub const MAX_NODE_LABELS: usize = 256;
/// Longest label value, and longest name part of a label key (Kubernetes' limit).
pub const MAX_LABEL_NAME: usize = 63;
/// Longest prefix of a label key (a DNS subdomain, Kubernetes' limit).
pub const MAX_LABEL_PREFIX: usize = 253;

/// The stored node object (format as every object: a version byte, then bincode).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredNode {
    /// The node's labels, key to value.
    pub labels: BTreeMap<String, String>,
}

/// One labelled node, as [`Ipam::list_nodes_with_labels`] returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeLabels {
    /// The node (host) name.
    pub host: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
}

/// The labels in a node object read from `key` (`None`: no object, no labels). For callers that
/// read the node key inside their own batched read.
///
/// # Errors
/// [`IpamError::Corrupt`] naming the key when the value cannot be decoded.
pub fn decode_node_labels(
    key: &str,
    read: Option<&KeyValue>,
) -> Result<BTreeMap<String, String>, IpamError> {
    match read {
        None => Ok(BTreeMap::new()),
        Some(kv) => Ok(decode::<StoredNode>(key, &kv.value)?.labels),
    }
}

/// Whether `text` is a Kubernetes label name: 1 to 63 of `[A-Za-z0-9._-]`, starting and ending
/// with a letter or digit.
fn is_label_name(text: &str) -> bool {
    let bytes = text.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => {
            text.len() <= MAX_LABEL_NAME
                && first.is_ascii_alphanumeric()
                && last.is_ascii_alphanumeric()
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

/// Whether `text` is a DNS subdomain as Kubernetes checks it (`IsDNS1123Subdomain`): at most 253
/// characters, dot-separated parts of lower-case letters, digits and `-`, each starting and ending
/// with a letter or digit.
fn is_dns_subdomain(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= MAX_LABEL_PREFIX
        && text.split('.').all(|part| {
            let bytes = part.as_bytes();
            match (bytes.first(), bytes.last()) {
                (Some(first), Some(last)) => {
                    (first.is_ascii_lowercase() || first.is_ascii_digit())
                        && (last.is_ascii_lowercase() || last.is_ascii_digit())
                        && bytes
                            .iter()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
                }
                _ => false,
            }
        })
}

/// Checks a label key as Kubernetes does (a qualified name): an optional DNS-subdomain prefix
/// and `/`, then a name of 1 to 63 of `[A-Za-z0-9._-]` that starts and ends with a letter or
/// digit. Every such key is also a valid key in a Calico selector.
///
/// # Errors
/// [`IpamError::InvalidArgument`] saying which part is wrong.
pub fn validate_label_key(key: &str) -> Result<(), IpamError> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        if !is_dns_subdomain(prefix) {
            return Err(IpamError::InvalidArgument(format!(
                "label key {key:?}: the prefix before '/' must be a DNS subdomain (at most \
                 {MAX_LABEL_PREFIX} characters of lower-case letters, digits, '-' and '.', each \
                 dot-separated part starting and ending with a letter or digit)"
            )));
        }
    }
    if !is_label_name(name) {
        return Err(IpamError::InvalidArgument(format!(
            "label key {key:?}: the name{} must be 1 to {MAX_LABEL_NAME} characters of letters, \
             digits, '-', '_' and '.', starting and ending with a letter or digit",
            if prefix.is_some() { " after '/'" } else { "" }
        )));
    }
    Ok(())
}

/// Checks a label value as Kubernetes does: empty, or 1 to 63 of `[A-Za-z0-9._-]` starting and
/// ending with a letter or digit.
///
/// # Errors
/// [`IpamError::InvalidArgument`] naming the key and the value.
pub fn validate_label_value(key: &str, value: &str) -> Result<(), IpamError> {
    if value.is_empty() || is_label_name(value) {
        Ok(())
    } else {
        Err(IpamError::InvalidArgument(format!(
            "label {key:?}: value {value:?} must be empty or 1 to {MAX_LABEL_NAME} characters of \
             letters, digits, '-', '_' and '.', starting and ending with a letter or digit"
        )))
    }
}

/// Checks one label update as [`Ipam::set_node_labels`] does before it reads anything: valid keys
/// and values, no key given twice.
///
/// # Errors
/// [`IpamError::InvalidArgument`] saying what is wrong.
pub fn validate_label_update(set: &[(String, String)], remove: &[String]) -> Result<(), IpamError> {
    let mut seen = BTreeMap::new();
    for (key, value) in set {
        validate_label_key(key)?;
        validate_label_value(key, value)?;
        if seen.insert(key.as_str(), "set").is_some() {
            return Err(IpamError::InvalidArgument(format!(
                "label {key:?} is set twice in one update"
            )));
        }
    }
    for key in remove {
        validate_label_key(key)?;
        match seen.insert(key.as_str(), "removed") {
            Some("removed") => {
                return Err(IpamError::InvalidArgument(format!(
                    "label {key:?} is removed twice in one update"
                )))
            }
            Some(earlier) => {
                return Err(IpamError::InvalidArgument(format!(
                    "label {key:?} is {earlier} and removed in one update"
                )))
            }
            None => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubernetes_label_keys_are_accepted() {
        for key in [
            "rack",
            "a",
            "topology.kubernetes.io/zone",
            "node-role.kubernetes.io/control-plane",
            "example.com/Mixed_Case.name-1",
            &"k".repeat(63),
            &format!("{}/{}", "p".repeat(253), "n".repeat(63)),
        ] {
            assert!(validate_label_key(key).is_ok(), "{key:?}");
        }
    }

    #[test]
    fn malformed_label_keys_are_refused_saying_which_part() {
        for (key, part) in [
            ("", "the name"),
            ("-rack", "the name"),
            ("rack-", "the name"),
            ("ra ck", "the name"),
            ("räck", "the name"),
            (&*"k".repeat(64), "the name"),
            ("example.com/", "the name after '/'"),
            ("/rack", "prefix"),
            ("Example.com/rack", "prefix"),
            ("a..b/rack", "prefix"),
            ("-a.com/rack", "prefix"),
            ("a-.com/rack", "prefix"),
            ("a.-b/rack", "prefix"),
            ("a.b-/rack", "prefix"),
            ("a_b.com/rack", "prefix"),
            ("a/b/c", "the name after '/'"),
            (&*format!("{}/n", "p".repeat(254)), "prefix"),
        ] {
            match validate_label_key(key) {
                Err(IpamError::InvalidArgument(message)) => {
                    assert!(message.contains(part), "{key:?}: {message}")
                }
                other => panic!("{key:?} should be refused, got {other:?}"),
            }
        }
    }

    #[test]
    fn label_values_follow_kubernetes() {
        for value in ["", "r1", "A.b_c-9", &"v".repeat(63)] {
            assert!(validate_label_value("k", value).is_ok(), "{value:?}");
        }
        for value in ["-r1", "r1.", "with space", "é", &"v".repeat(64)] {
            assert!(
                matches!(
                    validate_label_value("k", value),
                    Err(IpamError::InvalidArgument(_))
                ),
                "{value:?}"
            );
        }
    }

    #[test]
    fn one_update_may_not_name_a_key_twice() {
        let set = vec![
            ("a".to_owned(), "1".to_owned()),
            ("a".to_owned(), "2".to_owned()),
        ];
        assert!(validate_label_update(&set, &[]).is_err());
        let set = vec![("a".to_owned(), "1".to_owned())];
        let refused = validate_label_update(&set, &["a".to_owned()]);
        assert!(
            matches!(&refused, Err(IpamError::InvalidArgument(m)) if m.contains("set and removed")),
            "{refused:?}"
        );
        assert!(validate_label_update(&set, &["b".to_owned()]).is_ok());
        let twice = validate_label_update(&[], &["b".to_owned(), "b".to_owned()]);
        assert!(
            matches!(&twice, Err(IpamError::InvalidArgument(m)) if m.contains("\"b\" is removed twice")),
            "{twice:?}"
        );
    }
}
