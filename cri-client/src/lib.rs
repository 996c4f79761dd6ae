//! A client of the container runtime's CRI (`runtime.v1.RuntimeService`) over its unix socket: which pod sandboxes the runtime holds on this node, with their pods and addresses.
//!
//! The node agent asks it what is live before it compares the store with the node. Every call has
//! a deadline; a runtime that does not answer, answers an error, or answers something this client
//! cannot read is a [`CriError`], never a guess: the caller then knows nothing about the node.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// The generated runtime.v1 messages and the RuntimeService client.
#[allow(missing_docs, missing_debug_implementations, clippy::all)]
pub mod runtime_v1 {
    tonic::include_proto!("runtime.v1");
}

use runtime_v1::runtime_service_client::RuntimeServiceClient;
use runtime_v1::{ListPodSandboxRequest, PodSandboxState, PodSandboxStatusRequest, VersionRequest};

/// containerd's CRI socket (its default `grpc.address`).
pub const CONTAINERD_SOCKET: &str = "/run/containerd/containerd.sock";
/// CRI-O's socket.
pub const CRIO_SOCKET: &str = "/var/run/crio/crio.sock";
/// The CRI version this client speaks (the kubelet's `version` field).
const CRI_API_VERSION: &str = "v1";

/// Why the runtime could not be asked.
#[derive(Debug, thiserror::Error)]
pub enum CriError {
    /// Nothing listens at the socket (or it cannot be opened).
    #[error("cannot connect to the container runtime at {socket}: {reason}")]
    Connect {
        /// The socket.
        socket: PathBuf,
        /// What failed.
        reason: String,
    },
    /// A call failed or went past its deadline.
    #[error("the container runtime at {socket} failed {method}: {status}")]
    Call {
        /// The socket.
        socket: PathBuf,
        /// The RuntimeService method.
        method: &'static str,
        /// The gRPC status.
        status: Box<tonic::Status>,
    },
    /// The runtime answered something this client cannot use.
    #[error("the container runtime at {socket} answered {method} with {what}")]
    Answer {
        /// The socket.
        socket: PathBuf,
        /// The RuntimeService method.
        method: &'static str,
        /// What was wrong with the answer.
        what: String,
    },
}

/// What the runtime says of itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeVersion {
    /// Its name (`containerd`, `cri-o`).
    pub name: String,
    /// Its version.
    pub version: String,
    /// The CRI version it speaks.
    pub api_version: String,
}

/// One pod sandbox the runtime holds, in whatever state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sandbox {
    /// The sandbox id: the container id the runtime passed to the CNI plugin.
    pub id: String,
    /// The pod's name.
    pub pod: String,
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's uid.
    pub uid: String,
    /// Whether the sandbox is ready (its network set up); a stopped sandbox is not.
    pub ready: bool,
    /// The addresses of its network (none for a host-network pod or a stopped sandbox).
    pub addresses: Vec<IpAddr>,
}

/// A connection to the runtime's CRI.
#[derive(Debug, Clone)]
pub struct CriClient {
    socket: PathBuf,
    client: RuntimeServiceClient<Channel>,
    deadline: Duration,
}

impl CriClient {
    /// Connects to the CRI at `socket`; every later call must answer within `deadline`.
    ///
    /// # Errors
    /// [`CriError::Connect`] when nothing accepts at the socket within the deadline.
    pub async fn connect(socket: &Path, deadline: Duration) -> Result<Self, CriError> {
        let path = socket.to_path_buf();
        let connect_to = path.clone();
        // The URI is required by tonic and unused: the connector below dials the socket.
        let endpoint = Endpoint::try_from("http://cri.invalid")
            .map_err(|e| connect_error(&path, &e))?
            .connect_timeout(deadline)
            .timeout(deadline);
        let channel = tokio::time::timeout(
            deadline,
            endpoint.connect_with_connector(tower::service_fn(move |_: Uri| {
                let socket = connect_to.clone();
                async move { UnixStream::connect(socket).await.map(TokioIo::new) }
            })),
        )
        .await
        .map_err(|_| CriError::Connect {
            socket: path.clone(),
            reason: format!("no answer within {deadline:?}"),
        })?
        .map_err(|e| connect_error(&path, &e))?;
        Ok(Self {
            socket: path,
            client: RuntimeServiceClient::new(channel),
            deadline,
        })
    }

    /// The socket this client talks to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The runtime's name and versions (the CRI's `Version` call).
    ///
    /// # Errors
    /// [`CriError::Call`] when the call fails or passes its deadline.
    pub async fn version(&self) -> Result<RuntimeVersion, CriError> {
        let answer = self
            .call(
                "Version",
                |mut client, request| async move { client.version(request).await },
                VersionRequest {
                    version: CRI_API_VERSION.to_owned(),
                },
            )
            .await?;
        Ok(RuntimeVersion {
            name: answer.runtime_name,
            version: answer.runtime_version,
            api_version: answer.runtime_api_version,
        })
    }

    /// Every pod sandbox the runtime holds, in any state, with its pod and the addresses of its
    /// network (one `ListPodSandbox`, then one `PodSandboxStatus` per ready sandbox). A sandbox
    /// that disappears between the two calls is left out (it is gone).
    ///
    /// # Errors
    /// [`CriError`] when a call fails, passes its deadline, or answers without a pod's metadata
    /// or with an address that does not parse: then nothing is returned.
    pub async fn sandboxes(&self) -> Result<Vec<Sandbox>, CriError> {
        let listed = self
            .call(
                "ListPodSandbox",
                |mut client, request| async move { client.list_pod_sandbox(request).await },
                ListPodSandboxRequest { filter: None },
            )
            .await?;
        let mut sandboxes = Vec::with_capacity(listed.items.len());
        for item in listed.items {
            let Some(metadata) = item.metadata else {
                return Err(self.bad_answer(
                    "ListPodSandbox",
                    format!("sandbox {} without its pod's metadata", item.id),
                ));
            };
            let ready = item.state == PodSandboxState::SandboxReady as i32;
            let addresses = if ready {
                match self.sandbox_addresses(&item.id).await? {
                    Some(addresses) => addresses,
                    None => continue,
                }
            } else {
                Vec::new()
            };
            sandboxes.push(Sandbox {
                id: item.id,
                pod: metadata.name,
                namespace: metadata.namespace,
                uid: metadata.uid,
                ready,
                addresses,
            });
        }
        Ok(sandboxes)
    }

    /// Whether sandbox `id` is ready now (one `PodSandboxStatus`): `false` once it was stopped
    /// (its network torn down, or being torn down) or when the runtime no longer knows it.
    ///
    /// # Errors
    /// [`CriError`] when the call fails or passes its deadline: then nothing is known.
    pub async fn sandbox_is_ready(&self, id: &str) -> Result<bool, CriError> {
        let request = PodSandboxStatusRequest {
            pod_sandbox_id: id.to_owned(),
            verbose: false,
        };
        match self
            .call(
                "PodSandboxStatus",
                |mut client, request| async move { client.pod_sandbox_status(request).await },
                request,
            )
            .await
        {
            Ok(answer) => Ok(answer
                .status
                .is_some_and(|status| status.state == PodSandboxState::SandboxReady as i32)),
            Err(CriError::Call { status, .. }) if status.code() == tonic::Code::NotFound => {
                Ok(false)
            }
            Err(other) => Err(other),
        }
    }

    /// The addresses of one sandbox's network, or `None` when the runtime no longer knows it.
    async fn sandbox_addresses(&self, id: &str) -> Result<Option<Vec<IpAddr>>, CriError> {
        let request = PodSandboxStatusRequest {
            pod_sandbox_id: id.to_owned(),
            verbose: false,
        };
        let status = match self
            .call(
                "PodSandboxStatus",
                |mut client, request| async move { client.pod_sandbox_status(request).await },
                request,
            )
            .await
        {
            Ok(answer) => answer.status,
            Err(CriError::Call { status, .. }) if status.code() == tonic::Code::NotFound => {
                return Ok(None)
            }
            Err(other) => return Err(other),
        };
        let Some(network) = status.and_then(|s| s.network) else {
            return Ok(Some(Vec::new()));
        };
        let mut texts = vec![network.ip];
        texts.extend(network.additional_ips.into_iter().map(|extra| extra.ip));
        let mut addresses = Vec::new();
        for text in texts.into_iter().filter(|t| !t.is_empty()) {
            let address = text.parse::<IpAddr>().map_err(|_| {
                self.bad_answer(
                    "PodSandboxStatus",
                    format!("sandbox {id} address {text:?}, which is not an IP address"),
                )
            })?;
            addresses.push(address);
        }
        Ok(Some(addresses))
    }

    async fn call<Req, Resp, F, Fut>(
        &self,
        method: &'static str,
        send: F,
        request: Req,
    ) -> Result<Resp, CriError>
    where
        F: FnOnce(RuntimeServiceClient<Channel>, tonic::Request<Req>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let mut request = tonic::Request::new(request);
        request.set_timeout(self.deadline);
        let answer = tokio::time::timeout(self.deadline, send(self.client.clone(), request))
            .await
            .map_err(|_| CriError::Call {
                socket: self.socket.clone(),
                method,
                status: Box::new(tonic::Status::deadline_exceeded(format!(
                    "no answer within {:?}",
                    self.deadline
                ))),
            })?
            .map_err(|status| CriError::Call {
                socket: self.socket.clone(),
                method,
                status: Box::new(status),
            })?;
        Ok(answer.into_inner())
    }

    fn bad_answer(&self, method: &'static str, what: String) -> CriError {
        CriError::Answer {
            socket: self.socket.clone(),
            method,
            what,
        }
    }
}

fn connect_error(socket: &Path, error: &dyn std::error::Error) -> CriError {
    let mut reason = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        reason.push_str(": ");
        reason.push_str(&cause.to_string());
        source = cause.source();
    }
    CriError::Connect {
        socket: socket.to_path_buf(),
        reason,
    }
}
