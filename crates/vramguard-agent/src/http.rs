//! The agent's HTTP endpoints. Every response is rendered from what the collector published
//! after its last sample, by the first request that wants it, and kept for the next ones: a
//! scrape costs a lock and an `Arc` clone (and, once per sample, a rendering), never a driver
//! call.
//!
//! - `GET /metrics`: OpenMetrics text.
//! - `GET /`: the status page.
//! - `GET /api/status`: the last report as JSON (the `status --json` schema).
//! - `GET /healthz`: 200 while collections are recent, 503 when they stall.

use crate::AgentError;
use crate::history::Timelines;
use crate::limits::{ADMIT_WAIT, ConnState, MAX_CONNECTIONS, Peer, now_ms, victim};
use crate::web::{BasicAuth, Verdict, WebConfig};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, Instant};
use vramguard_core::report::Report;

/// What the HTTP side serves, replaced after every sample. The metrics, the page and the
/// JSON are rendered by the first request after a sample and kept for the next ones: a
/// sample nobody scrapes (Prometheus scrapes every 15 s or so, the agent samples every
/// second) costs no rendering.
#[derive(Debug)]
pub struct Published {
    /// The live metrics, rendered on the first scrape.
    pub metrics: Option<Arc<crate::metrics::Metrics>>,
    /// The last report.
    pub report: Option<Arc<Report>>,
    /// (time, used, ghost) per GPU, for the page.
    pub timelines: Arc<Timelines>,
    /// Firing incidents.
    pub firing: Vec<(String, u32)>,
    /// The page's refresh period.
    pub refresh_secs: u64,
    /// When the last collection finished.
    pub updated: Instant,
    /// Collections so far.
    pub samples: u64,
    /// Collections older than this make `/healthz` fail.
    pub stale_after: Duration,
    pub(crate) page: OnceLock<Bytes>,
    pub(crate) status: OnceLock<Bytes>,
    /// OpenMetrics text and the same in Prometheus' text format 0.0.4.
    pub(crate) rendered: OnceLock<(Bytes, Bytes)>,
    /// Whether a scraper asked for the metrics of this sample.
    pub(crate) scraped: std::sync::atomic::AtomicBool,
}

impl Default for Published {
    fn default() -> Self {
        Published {
            metrics: None,
            report: None,
            timelines: Arc::default(),
            firing: Vec::new(),
            refresh_secs: 5,
            updated: Instant::now(),
            samples: 0,
            stale_after: Duration::from_secs(10),
            page: OnceLock::new(),
            status: OnceLock::new(),
            rendered: OnceLock::new(),
            scraped: Default::default(),
        }
    }
}

impl Published {
    /// (OpenMetrics, Prometheus text) for a scraper, rendered once per sample.
    pub fn rendered(&self) -> (Bytes, Bytes) {
        self.scraped_text().clone()
    }

    /// The same, borrowed: a scrape clones only the form it sends.
    fn scraped_text(&self) -> &(Bytes, Bytes) {
        // Written once per sample, not per scrape: every scraper reads the flag's line.
        if !self.scraped.load(Ordering::Relaxed) {
            self.scraped.store(true, Ordering::Relaxed);
        }
        self.prerendered()
    }

    /// For the collector: renders without counting as a scrape.
    pub(crate) fn prerender(&self) {
        let _ = self.prerendered();
    }

    fn prerendered(&self) -> &(Bytes, Bytes) {
        self.rendered.get_or_init(|| match &self.metrics {
            Some(m) => {
                let openmetrics = m.render();
                let text = crate::metrics::as_prometheus_text(&openmetrics);
                (Bytes::from(openmetrics), Bytes::from(text))
            }
            None => (Bytes::new(), Bytes::new()),
        })
    }

    fn page(&self) -> Bytes {
        self.page
            .get_or_init(|| match &self.report {
                Some(r) => Bytes::from(crate::page::render(
                    r,
                    &self.timelines,
                    &self.firing,
                    self.refresh_secs,
                )),
                None => Bytes::from_static(
                    b"<!doctype html><title>vramguard</title><p>starting: no collection yet</p>",
                ),
            })
            .clone()
    }

    fn status(&self) -> Bytes {
        self.status
            .get_or_init(|| match &self.report {
                Some(r) => Bytes::from(serde_json::to_vec(&**r).expect("report serialises")),
                None => Bytes::from_static(b"{}"),
            })
            .clone()
    }
}

/// Shared between the collector and the server.
pub type Shared = Arc<RwLock<Arc<Published>>>;

fn read(s: &Shared) -> Arc<Published> {
    s.read().unwrap_or_else(|p| p.into_inner()).clone()
}

/// OpenMetrics to scrapers that ask for it (Prometheus does, in `Accept`), Prometheus' text
/// format 0.0.4 to everyone else.
async fn metrics(State(s): State<Shared>, headers: axum::http::HeaderMap) -> Response {
    let published = read(&s);
    let (metrics, metrics_text) = published.scraped_text();
    let openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    if openmetrics {
        (
            [
                (
                    header::CONTENT_TYPE,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            ],
            metrics.clone(),
        )
            .into_response()
    } else {
        // Label values carry other users' process names: never sniffed as HTML.
        (
            [
                (
                    header::CONTENT_TYPE,
                    "text/plain; version=0.0.4; charset=utf-8",
                ),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            ],
            metrics_text.clone(),
        )
            .into_response()
    }
}

/// The page is self-contained (inline styles and SVG, no script): nothing else may load,
/// whatever text a process managed to put into it.
pub const PAGE_CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; \
                            base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

async fn page(State(s): State<Shared>) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, PAGE_CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        read(&s).page(),
    )
        .into_response()
}

async fn status(State(s): State<Shared>) -> Response {
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        read(&s).status(),
    )
        .into_response()
}

async fn healthz(State(s): State<Shared>) -> Response {
    let p = read(&s);
    let age = p.updated.elapsed();
    if p.samples == 0 {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "starting: no collection yet\n",
        )
            .into_response();
    }
    if age > p.stale_after {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("stale: last collection {:.1}s ago\n", age.as_secs_f64()),
        )
            .into_response();
    }
    (
        StatusCode::OK,
        format!(
            "ok: {} collections, last {:.1}s ago\n",
            p.samples,
            age.as_secs_f64()
        ),
    )
        .into_response()
}

/// The router; every endpoint behind `auth` when users are configured. A request that passes
/// marks its connection admitted (see [`crate::limits`]).
pub fn router(shared: Shared, auth: Arc<BasicAuth>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/", get(page))
        .route("/api/status", get(status))
        .route("/healthz", get(healthz))
        .with_state(shared)
        .layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let auth = auth.clone();
                async move {
                    let conn = req.extensions().get::<Arc<ConnState>>().cloned();
                    let header = req
                        .headers()
                        .get(header::AUTHORIZATION)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string);
                    let peer = conn.as_ref().map_or(Peer::Loopback, |c| c.peer);
                    let challenge = (header::WWW_AUTHENTICATE, "Basic realm=\"vramguard\"");
                    match auth.check(header.as_deref(), peer).await {
                        Verdict::Allowed => {
                            if let Some(c) = &conn {
                                c.admit();
                            }
                            next.run(req).await
                        }
                        Verdict::Denied => (
                            StatusCode::UNAUTHORIZED,
                            [challenge],
                            "authentication required\n",
                        )
                            .into_response(),
                        Verdict::Limited => (
                            StatusCode::TOO_MANY_REQUESTS,
                            [challenge, (header::RETRY_AFTER, "1")],
                            "too many failed logins from this address\n",
                        )
                            .into_response(),
                        Verdict::Busy => (
                            StatusCode::SERVICE_UNAVAILABLE,
                            [(header::RETRY_AFTER, "1")],
                            "too many logins being checked\n",
                        )
                            .into_response(),
                    }
                }
            },
        ))
}

/// A client must send a request's headers within this time (slowloris).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(2);
/// A connection is closed after this long, busy or not (keep-alive scrapers reconnect).
pub const MAX_CONNECTION_AGE: Duration = Duration::from_secs(120);
/// Request heads larger than this are refused.
pub const MAX_REQUEST_HEAD: usize = 16 * 1024;

/// A connection being served: what the server knows of it, and how to close it.
struct Live {
    state: Arc<ConnState>,
    abort: tokio::task::AbortHandle,
}

/// How room was made at the cap.
#[derive(PartialEq)]
enum Room {
    /// A connection ended.
    Freed,
    /// One was closed.
    Evicted,
    /// None could be.
    None,
}

/// Makes room for a newcomer at the cap: closes the connection [`victim`] picks, waiting (at
/// most [`ADMIT_WAIT`]) while none may be closed yet.
async fn make_room(live: &mut Vec<Live>) -> Room {
    let deadline = tokio::time::Instant::now() + ADMIT_WAIT;
    loop {
        live.retain(|c| !c.abort.is_finished());
        if live.len() < MAX_CONNECTIONS {
            return Room::Freed;
        }
        let states: Vec<&ConnState> = live.iter().map(|c| &*c.state).collect();
        if let Some(i) = victim(&states, now_ms()) {
            live.swap_remove(i).abort.abort();
            return Room::Evicted;
        }
        if tokio::time::Instant::now() >= deadline {
            return Room::None;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Accepts connections until `stopped`, each under the limits above and in
/// [`crate::limits`].
async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    stopped: &mut tokio::sync::watch::Receiver<bool>,
) {
    let mut live: Vec<Live> = Vec::new();
    let (mut refused, mut evicted): (u64, u64) = (0, 0);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stopped.wait_for(|s| *s) => return,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors (EMFILE) or the like: wait instead of spinning.
                tracing::warn!("HTTP accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        live.retain(|c| !c.abort.is_finished());
        if live.len() >= MAX_CONNECTIONS {
            // Meanwhile nothing else is accepted: later newcomers wait in the accept queue.
            let room = tokio::select! {
                r = make_room(&mut live) => r,
                _ = stopped.wait_for(|s| *s) => return,
            };
            match room {
                Room::Freed => {}
                Room::Evicted => {
                    evicted += 1;
                    if evicted.is_power_of_two() {
                        tracing::warn!(
                            "{evicted} HTTP connection(s) closed to make room: {MAX_CONNECTIONS} were open"
                        );
                    }
                }
                Room::None => {
                    refused += 1;
                    if refused.is_power_of_two() {
                        tracing::warn!(
                            "{refused} HTTP connection(s) refused: {MAX_CONNECTIONS} are inside a handler"
                        );
                    }
                    drop(stream);
                    continue;
                }
            }
        }
        let state = Arc::new(ConnState::new(Peer::of(peer.ip())));
        let app = app.clone();
        let tls = tls.clone();
        let conn = state.clone();
        let task = tokio::spawn(async move {
            let inner = hyper_util::service::TowerToHyperService::new(app);
            let service = hyper::service::service_fn(move |mut req: hyper::Request<_>| {
                let conn = conn.clone();
                req.extensions_mut().insert(conn.clone());
                conn.busy_since.store(now_ms(), Ordering::Relaxed);
                let call = hyper::service::Service::call(&inner, req);
                async move {
                    let response = call.await;
                    conn.busy_since.store(0, Ordering::Relaxed);
                    response
                }
            });
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(MAX_REQUEST_HEAD);
            match tls {
                None => {
                    let conn = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                    let _ = tokio::time::timeout(MAX_CONNECTION_AGE, conn).await;
                }
                Some(acceptor) => {
                    // The handshake is bounded like the headers that follow it.
                    let Ok(Ok(stream)) =
                        tokio::time::timeout(HEADER_TIMEOUT, acceptor.accept(stream)).await
                    else {
                        return;
                    };
                    let conn = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                    let _ = tokio::time::timeout(MAX_CONNECTION_AGE, conn).await;
                }
            }
        });
        live.push(Live {
            state,
            abort: task.abort_handle(),
        });
    }
}

/// A running server.
pub struct Server {
    stop: tokio::sync::watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The address actually bound (port 0 picks one).
    pub addr: SocketAddr,
}

impl Server {
    /// Binds `listen` and serves on a thread of its own, with TLS and basic authentication
    /// from the web config at `web` when given; binding and config errors are returned here.
    pub fn start(listen: &str, shared: Shared, web: Option<&Path>) -> Result<Server, AgentError> {
        let (tls, auth) = match web {
            None => (None, BasicAuth::default()),
            Some(path) => {
                let w = WebConfig::load(path)?;
                (w.acceptor(path)?, BasicAuth::new(w.users))
            }
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("vramguard-http")
            .enable_io()
            .enable_time()
            .build()
            .map_err(AgentError::starting("the HTTP runtime"))?;
        let listening = |cause| AgentError::Listen {
            listen: listen.to_string(),
            cause,
        };
        let std_listener = std::net::TcpListener::bind(listen).map_err(listening)?;
        std_listener.set_nonblocking(true).map_err(listening)?;
        let addr = std_listener.local_addr().map_err(listening)?;
        if !addr.ip().is_loopback() && !auth.enabled() {
            tracing::warn!(
                %addr,
                tls = tls.is_some(),
                "listening beyond loopback without basic_auth_users: anyone who reaches the \
                 port reads the node's holders, users and command names (give a web config \
                 with --web.config.file)"
            );
        }
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let app = router(shared, Arc::new(auth));
        let thread = std::thread::Builder::new()
            .name("vramguard-http".into())
            .spawn(move || {
                rt.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(std_listener) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!("HTTP listener: {e}");
                            return;
                        }
                    };
                    serve(listener, app, tls, &mut stopped).await;
                });
            })
            .map_err(AgentError::starting("the HTTP thread"))?;
        Ok(Server {
            stop,
            thread: Some(thread),
            addr,
        })
    }

    /// Stops serving (in-flight requests finish).
    pub fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
