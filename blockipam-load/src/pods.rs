//! The names a simulated pod carries, as a Kubernetes node's runtime gives them: a 64-hex container id, a pod name and its namespace, recorded with each address as the plugin records them.

use std::collections::BTreeMap;

use ipam_core::allocator::leaks::Attachment;
use ipam_core::model::timestamp::now_rfc3339;

/// Which part of a run a container belongs to: the first two hex digits of its id, so that no
/// two parts ever name the same container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodKind {
    /// A pod of the measured run.
    Run = 0,
    /// A prefilled allocation (`--prefill`).
    Prefill = 1,
    /// A new node's pod in the borrow scenario.
    Borrow = 2,
    /// A pod of the node the node-release scenario removes.
    NodeRelease = 3,
}

/// The interface every simulated attachment names (`CNI_IFNAME`).
pub const INTERFACE: &str = "eth0";

/// The container id of pod `pod` of node `node` in `kind`: 64 hex digits, as runtimes name
/// sandboxes (the kind in 2, the node in 30, the pod in 32), so that every allocation's handle and
/// attributes are as long as a real one's.
pub fn container_id(kind: PodKind, node: u64, pod: u64) -> String {
    format!("{:02x}{node:030x}{pod:032x}", kind as u8)
}

/// The namespace of `container`'s pod: one of 97, as a cluster of a few teams has.
pub fn namespace(container: &str) -> String {
    let tail = container
        .get(container.len().saturating_sub(4)..)
        .unwrap_or("");
    let number = u32::from_str_radix(tail, 16).unwrap_or(0);
    format!("team-{:03}", number % 97)
}

/// The name of `container`'s pod, shaped like a Deployment's pod
/// (`<deployment>-<replica set hash>-<suffix>`).
pub fn pod_name(container: &str) -> String {
    let suffix = container
        .get(container.len().saturating_sub(6)..)
        .unwrap_or("");
    format!("frontend-7d9f8b6c5-{suffix}")
}

/// What the plugin records with the address of `container` on `network`, made now.
pub fn attributes(network: &str, container: &str) -> BTreeMap<String, String> {
    let namespace = namespace(container);
    let pod = pod_name(container);
    Attachment {
        network,
        container_id: container,
        interface: INTERFACE,
        namespace: Some(&namespace),
        pod: Some(&pod),
    }
    .attributes(&now_rfc3339())
}

/// The `CNI_ARGS` a kubelet's runtime passes the plugin for `container`'s pod.
pub fn cni_args(container: &str) -> String {
    format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={container}",
        namespace(container),
        pod_name(container)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipam_core::allocator::leaks::{ATTR_CONTAINER_ID, ATTR_NAMESPACE, ATTR_POD};

    #[test]
    fn container_ids_are_64_hex_digits_and_differ_by_kind_node_and_pod() {
        let ids = [
            container_id(PodKind::Run, 3, 12),
            container_id(PodKind::Prefill, 3, 12),
            container_id(PodKind::Run, 4, 12),
            container_id(PodKind::Run, 3, 13),
        ];
        for id in &ids {
            assert_eq!(id.len(), 64, "{id}");
            assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        }
        let distinct: std::collections::BTreeSet<_> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len(), "{ids:?}");
        assert_eq!(ids[1], format!("01{}3{}c", "0".repeat(29), "0".repeat(31)));
    }

    #[test]
    fn the_attributes_name_the_pod_the_cni_args_name() {
        let container = container_id(PodKind::Run, 7, 4_660);
        let recorded = attributes("k8s-pod-network", &container);
        let args = cni_args(&container);
        assert_eq!(recorded[ATTR_CONTAINER_ID], container);
        assert!(
            args.contains(&format!("K8S_POD_NAMESPACE={};", recorded[ATTR_NAMESPACE])),
            "{args}"
        );
        assert!(
            args.contains(&format!("K8S_POD_NAME={};", recorded[ATTR_POD])),
            "{args}"
        );
        assert_eq!(recorded[ATTR_POD], "frontend-7d9f8b6c5-001234");
        assert_eq!(recorded[ATTR_NAMESPACE], format!("team-{:03}", 0x1234 % 97));
    }
}
