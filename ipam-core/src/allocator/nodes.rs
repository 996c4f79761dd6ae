//! The allocator's operations on node labels: reading, setting and removing a node's labels by
//! compare-and-swap (the objects and their validation: `model::nodes`).

use crate::allocator::Attempt;
use crate::allocator::{Ipam, Plan};
use crate::model::error::IpamError;
use crate::model::nodes::{
    decode_node_labels, node_key, nodes_dir, validate_label_update, NodeLabels, StoredNode,
    MAX_NODE_LABELS,
};
use crate::model::{encode, validate_host};
use std::collections::BTreeMap;

impl Ipam {
    /// The labels of `host` (empty for a node never labelled).
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] for an invalid host name; a corrupt node object; store
    /// failures.
    pub async fn node_labels(&self, host: &str) -> Result<BTreeMap<String, String>, IpamError> {
        validate_host(host)?;
        let key = node_key(host);
        let read = self.store().get(&key).await?;
        decode_node_labels(&key, read.as_ref())
    }

    /// Sets the labels in `set` (replacing a label's value when it has one) and removes those in
    /// `remove` (a label the node does not have is no error), in one compare-and-swap write of the
    /// node's object: a concurrent update is re-read and this one applied on top, so none is
    /// lost. A node left without labels has no object. Returns the node's labels afterwards.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] for an invalid host name, label key or value, a key given
    /// twice, or more than [`MAX_NODE_LABELS`] labels; a corrupt node object;
    /// [`IpamError::RetriesExhausted`]; store failures. Nothing is written on error.
    pub async fn set_node_labels(
        &self,
        host: &str,
        set: &[(String, String)],
        remove: &[String],
    ) -> Result<BTreeMap<String, String>, IpamError> {
        validate_host(host)?;
        validate_label_update(set, remove)?;
        let key = node_key(host);
        self.retrying(|| async {
            let (read, generation) = self.read_with_generation(&key).await?;
            let before = decode_node_labels(&key, read.as_ref())?;
            let mut labels = before.clone();
            for name in remove {
                labels.remove(name);
            }
            for (name, value) in set {
                labels.insert(name.clone(), value.clone());
            }
            if labels.len() > MAX_NODE_LABELS {
                return Err(IpamError::InvalidArgument(format!(
                    "node {host:?} would have {} labels, more than the {MAX_NODE_LABELS} allowed",
                    labels.len()
                )));
            }
            if labels == before {
                return Ok(Attempt::Done(labels));
            }
            let mut plan = self.plan();
            plan.expect(&key, read.as_ref().map(|kv| kv.revision));
            write_node_labels(&mut plan, &key, &labels)?;
            self.bump_pool_generation(&mut plan, generation)?;
            self.commit_plan(plan, labels).await
        })
        .await
    }

    /// Replaces the labels of `host` whole with `labels` (none: the node's object is deleted),
    /// whatever it held before, an object that cannot be decoded included (the way out
    /// [`set_node_labels`](Self::set_node_labels) refuses to guess for): one write guarded by the
    /// revision read, so an update made meanwhile is re-read and replaced as well. Returns the
    /// node's labels afterwards.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] for an invalid host name, label key or value, a key given
    /// twice, or more than [`MAX_NODE_LABELS`] labels; [`IpamError::RetriesExhausted`]; store
    /// failures. Nothing is written on error.
    pub async fn replace_node_labels(
        &self,
        host: &str,
        labels: &[(String, String)],
    ) -> Result<BTreeMap<String, String>, IpamError> {
        validate_host(host)?;
        validate_label_update(labels, &[])?;
        if labels.len() > MAX_NODE_LABELS {
            return Err(IpamError::InvalidArgument(format!(
                "node {host:?} would have {} labels, more than the {MAX_NODE_LABELS} allowed",
                labels.len()
            )));
        }
        let labels: BTreeMap<String, String> = labels.iter().cloned().collect();
        let key = node_key(host);
        self.retrying(|| async {
            let (read, generation) = self.read_with_generation(&key).await?;
            if decode_node_labels(&key, read.as_ref()).is_ok_and(|before| before == labels) {
                return Ok(Attempt::Done(labels.clone()));
            }
            let mut plan = self.plan();
            plan.expect(&key, read.as_ref().map(|kv| kv.revision));
            write_node_labels(&mut plan, &key, &labels)?;
            self.bump_pool_generation(&mut plan, generation)?;
            self.commit_plan(plan, labels.clone()).await
        })
        .await
    }

    /// Every node that has labels, sorted by host name.
    ///
    /// # Errors
    /// A corrupt node object; store failures.
    pub async fn list_nodes_with_labels(&self) -> Result<Vec<NodeLabels>, IpamError> {
        self.list_nodes_labels_each()
            .await?
            .into_iter()
            .map(|(host, labels)| {
                Ok(NodeLabels {
                    host,
                    labels: labels?,
                })
            })
            .collect()
    }

    /// Every node that has a labels object, sorted by host name, each with its labels or, for an
    /// object that cannot be decoded, the corrupt-object error naming its key: one damaged object
    /// hides no other node.
    ///
    /// # Errors
    /// Store failures.
    pub async fn list_nodes_labels_each(
        &self,
    ) -> Result<Vec<(String, Result<BTreeMap<String, String>, IpamError>)>, IpamError> {
        let dir = nodes_dir();
        let listed = self.store().list(&dir).await?;
        Ok(listed
            .iter()
            .map(|kv| {
                let host = kv.key.strip_prefix(&dir).unwrap_or(&kv.key).to_owned();
                (host, decode_node_labels(&kv.key, Some(kv)))
            })
            .collect())
    }

    /// Deletes `host`'s labels object whatever it holds, one that cannot be decoded included (what
    /// retiring a node does), guarded by the revision read. Returns whether there was one.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] for an invalid host name; [`IpamError::RetriesExhausted`];
    /// store failures.
    pub async fn remove_node_labels(&self, host: &str) -> Result<bool, IpamError> {
        validate_host(host)?;
        let key = node_key(host);
        self.retrying(|| async {
            let (read, generation) = self.read_with_generation(&key).await?;
            let Some(read) = read else {
                return Ok(Attempt::Done(false));
            };
            let mut plan = self.plan();
            plan.expect(&key, Some(read.revision));
            plan.delete(&key);
            self.bump_pool_generation(&mut plan, generation)?;
            self.commit_plan(plan, true).await
        })
        .await
    }
}

/// Adds the write of a node's labels to `plan`: its object, or none when it has no labels.
fn write_node_labels(
    plan: &mut Plan,
    key: &str,
    labels: &BTreeMap<String, String>,
) -> Result<(), IpamError> {
    if labels.is_empty() {
        plan.delete(key);
    } else {
        plan.put(
            key,
            encode(&StoredNode {
                labels: labels.clone(),
            })?,
        );
    }
    Ok(())
}
