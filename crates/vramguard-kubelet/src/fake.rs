//! A fake kubelet: `v1.PodResourcesLister/List` served on a Unix socket from a thread of its
//! own, answering with the pods the test gives it (optionally after a delay, to play a slow
//! kubelet). Stops when dropped.

use crate::{ListPodResourcesRequest, ListPodResourcesResponse, PodResources};
use std::convert::Infallible;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tonic::codegen::http;

/// A running fake kubelet.
pub struct FakeKubelet {
    socket: PathBuf,
    state: Arc<Mutex<State>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Default)]
struct State {
    pods: Vec<PodResources>,
    delay: Duration,
    calls: usize,
}

impl FakeKubelet {
    /// Serves `pods` on a new socket at `socket`.
    pub fn start(socket: &Path, pods: Vec<PodResources>) -> FakeKubelet {
        let state = Arc::new(Mutex::new(State {
            pods,
            ..State::default()
        }));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (path, served) = (socket.to_path_buf(), state.clone());
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async move {
                let listener = tokio::net::UnixListener::bind(&path).expect("bind the socket");
                ready_tx.send(()).expect("the test waits");
                let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
                let _ = tonic::transport::Server::builder()
                    .add_service(Lister { state: served })
                    .serve_with_incoming_shutdown(incoming, async {
                        let _ = stopped.await;
                    })
                    .await;
            });
        });
        ready_rx.recv().expect("the fake kubelet started");
        FakeKubelet {
            socket: socket.to_path_buf(),
            state,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Answers only after `delay` from now on.
    pub fn slow_down(&self, delay: Duration) {
        self.state.lock().unwrap().delay = delay;
    }

    /// How many List calls it answered (or began to).
    pub fn calls(&self) -> usize {
        self.state.lock().unwrap().calls
    }

    /// The socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for FakeKubelet {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// The service, written as tonic's code generator would write it for `List` alone.
#[derive(Clone)]
struct Lister {
    state: Arc<Mutex<State>>,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'static>>;

impl tonic::server::NamedService for Lister {
    const NAME: &'static str = "v1.PodResourcesLister";
}

impl<B> tower::Service<http::Request<B>> for Lister
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != crate::LIST_PATH {
            return Box::pin(async { Ok(tonic::Status::unimplemented("only List").into_http()) });
        }
        let state = self.state.clone();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
            Ok(grpc.unary(List { state }, req).await)
        })
    }
}

struct List {
    state: Arc<Mutex<State>>,
}

impl tonic::server::UnaryService<ListPodResourcesRequest> for List {
    type Response = ListPodResourcesResponse;
    type Future = BoxFuture<tonic::Response<Self::Response>, tonic::Status>;

    fn call(&mut self, _request: tonic::Request<ListPodResourcesRequest>) -> Self::Future {
        let (pods, delay) = {
            let mut s = self.state.lock().unwrap();
            s.calls += 1;
            (s.pods.clone(), s.delay)
        };
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            Ok(tonic::Response::new(ListPodResourcesResponse {
                pod_resources: pods,
            }))
        })
    }
}
