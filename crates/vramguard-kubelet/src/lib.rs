//! The kubelet's pod-resources API: which pod and container each GPU is allocated to.
//!
//! `v1.PodResourcesLister/List` over the kubelet's Unix socket
//! (`/var/lib/kubelet/pod-resources/kubelet.sock`), the source dcgm-exporter uses too. A
//! process's cgroup names its pod only by UID; this names it by namespace and name. The
//! messages below are the fields of the upstream `api.proto` (k8s.io/kubelet,
//! `pkg/apis/podresources/v1`) that vramguard reads; prost skips the others.
#![deny(missing_docs)]

use std::path::Path;
use std::time::Duration;
use vramguard_core::snapshot::{KubeContainer, KubePod};

#[cfg(feature = "fake")]
pub mod fake;

/// The socket kubelets serve the API on.
pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

/// The gRPC method.
pub const LIST_PATH: &str = "/v1.PodResourcesLister/List";

/// `message ListPodResourcesRequest {}`
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListPodResourcesRequest {}

/// `message ListPodResourcesResponse { repeated PodResources pod_resources = 1; }`
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListPodResourcesResponse {
    /// Every pod with resources on this node.
    #[prost(message, repeated, tag = "1")]
    pub pod_resources: Vec<PodResources>,
}

/// `message PodResources { string name = 1; string namespace = 2; repeated ContainerResources containers = 3; }`
#[derive(Clone, PartialEq, prost::Message)]
pub struct PodResources {
    /// Pod name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Its namespace.
    #[prost(string, tag = "2")]
    pub namespace: String,
    /// Its containers.
    #[prost(message, repeated, tag = "3")]
    pub containers: Vec<ContainerResources>,
}

/// `message ContainerResources { string name = 1; repeated ContainerDevices devices = 2; … }`
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerResources {
    /// Container name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Devices allocated to it by device plugins.
    #[prost(message, repeated, tag = "2")]
    pub devices: Vec<ContainerDevices>,
}

/// `message ContainerDevices { string resource_name = 1; repeated string device_ids = 2; … }`
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerDevices {
    /// `nvidia.com/gpu`, `nvidia.com/mig-1g.10gb`, …
    #[prost(string, tag = "1")]
    pub resource_name: String,
    /// GPU or MIG UUIDs (`GPU-…`, `MIG-…`; with time-slicing `GPU-…::N`).
    #[prost(string, repeated, tag = "2")]
    pub device_ids: Vec<String>,
}

/// Why the kubelet could not be asked.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    /// Connecting to the socket failed.
    #[error("kubelet pod-resources socket {socket}: {cause}")]
    Connect {
        /// The socket.
        socket: String,
        /// What failed.
        cause: String,
    },
    /// The call failed.
    #[error("kubelet pod-resources List: {0}")]
    Call(String),
    /// No answer within the timeout.
    #[error("kubelet pod-resources: no answer within {0:?}")]
    Timeout(Duration),
}

/// The pods on this node with the NVIDIA devices each container was given, asked of the
/// kubelet at `socket` within `timeout` (connection included).
pub fn list_pods(socket: &Path, timeout: Duration) -> Result<Vec<KubePod>, KubeletError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|e| KubeletError::Call(format!("starting the client: {e}")))?;
    let socket = socket.to_path_buf();
    runtime.block_on(async move {
        tokio::time::timeout(timeout, list(socket))
            .await
            .map_err(|_| KubeletError::Timeout(timeout))?
    })
}

async fn list(socket: std::path::PathBuf) -> Result<Vec<KubePod>, KubeletError> {
    let shown = socket.display().to_string();
    let connect_error = |cause: String| KubeletError::Connect {
        socket: shown.clone(),
        cause,
    };
    // The URI is required by the API but unused: every connection goes to the socket.
    let channel = tonic::transport::Endpoint::from_static("http://kubelet.invalid")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let socket = socket.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .map_err(|e| connect_error(error_chain(&e)))?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| connect_error(error_chain(&e)))?;
    let response: tonic::Response<ListPodResourcesResponse> = grpc
        .unary(
            tonic::Request::new(ListPodResourcesRequest {}),
            tonic::codegen::http::uri::PathAndQuery::from_static(LIST_PATH),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .map_err(|s| KubeletError::Call(format!("{:?}: {}", s.code(), s.message())))?;
    Ok(pods(response.into_inner()))
}

/// What a response says, kept to NVIDIA devices.
pub fn pods(response: ListPodResourcesResponse) -> Vec<KubePod> {
    response
        .pod_resources
        .into_iter()
        .map(|p| KubePod {
            namespace: p.namespace,
            name: p.name,
            containers: p
                .containers
                .into_iter()
                .map(|c| KubeContainer {
                    name: c.name,
                    devices: c
                        .devices
                        .into_iter()
                        .filter(|d| d.resource_name.starts_with("nvidia.com/"))
                        .flat_map(|d| d.device_ids)
                        .collect(),
                })
                .collect(),
        })
        .collect()
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
