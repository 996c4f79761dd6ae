//! How a node's operation reaches the store: through the allocator API ([`api`]) or the real
//! plugin binary ([`plugin`]); both give back the same measurement.

pub mod api;
pub mod plugin;

use std::net::IpAddr;
use std::time::Instant;

use crate::schedule::{OpKind, PlannedOp};
use crate::stats::OpSample;

/// One node's way to the store.
#[derive(Debug, Clone)]
pub enum NodeDriver {
    /// The allocator API.
    Api(api::ApiNode),
    /// The plugin binary.
    Plugin(plugin::PluginNode),
}

impl NodeDriver {
    /// Makes `op` for the pod handle `handle` and measures it.
    pub async fn perform(
        &self,
        op: &PlannedOp,
        handle: &str,
    ) -> (Result<Vec<IpAddr>, String>, OpSample) {
        let started = Instant::now();
        let (result, work) = match (self, op.kind) {
            (NodeDriver::Api(node), OpKind::FirstAdd | OpKind::Add) => {
                let (result, work) = node.add(handle, &op.pod.container).await;
                (result, Some(work))
            }
            (NodeDriver::Api(node), OpKind::Del) => {
                let (result, work) = node.del(handle, &op.pod.ips).await;
                (result, Some(work))
            }
            (NodeDriver::Plugin(node), OpKind::FirstAdd | OpKind::Add) => {
                (node.add(&op.pod.container).await, None)
            }
            (NodeDriver::Plugin(node), OpKind::Del) => (
                node.del(&op.pod.container)
                    .await
                    .map(|()| op.pod.ips.clone()),
                None,
            ),
        };
        let sample = OpSample {
            kind: op.kind,
            latency: started.elapsed(),
            ok: result.is_ok(),
            round_trips: work.map(|w| w.round_trips),
            commits: work.map(|w| w.commits),
        };
        (result, sample)
    }
}
