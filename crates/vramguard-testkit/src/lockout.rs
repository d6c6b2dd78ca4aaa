//! Honest scrapers and a hostile local user against an HTTP endpoint (issue #26, "scrapers
//! cannot be locked out"); the agent's tests and its lockout benchmark share them.
//!
//! The hostile user holds as many connections as it can, three ways at once, and opens a
//! new one as soon as one of its own is closed: idle connections (connect, say nothing),
//! slowloris ones (a request head that never ends, one header line at a time), and busy
//! keep-alive ones that send request after request (with a wrong password, where one is
//! asked for). Every thread it starts stops when it is dropped.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How the hostile user holds connections.
#[derive(Debug, Clone)]
pub struct Mix {
    /// Connections that say nothing.
    pub idle: usize,
    /// Connections that send a request head one header line every 300 ms, never ending it.
    pub slowloris: usize,
    /// Keep-alive connections sending requests back to back.
    pub busy: usize,
    /// The `Authorization` header value of the busy requests (a wrong password), if any.
    pub busy_auth: Option<String>,
    /// The busy requests' path.
    pub busy_path: String,
}

/// A hostile local user, running until dropped.
pub struct Hostile {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// Connections it holds now.
    pub held: Arc<AtomicUsize>,
    /// Connections it has opened.
    pub opened: Arc<AtomicU64>,
    /// Busy requests answered, by status: 401, 429, 503, other.
    pub answers: Arc<[AtomicU64; 4]>,
}

fn connect(addr: SocketAddr) -> Option<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    s.set_nodelay(true).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    s.set_write_timeout(Some(Duration::from_secs(1))).ok()?;
    Some(s)
}

/// Whether the server is done with `s`, a connection that never sent a whole request (end of
/// stream, an error, or an answer, which it only sends such a connection when closing it),
/// without waiting.
fn closed(s: &TcpStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return true;
    }
    let mut buf = [0u8; 256];
    let gone = match s.peek(&mut buf) {
        Ok(_) => true,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    gone || s.set_nonblocking(false).is_err()
}

/// Reads one response (head and `Content-Length` body) off a keep-alive connection: its
/// status, or None when the connection failed.
fn read_response(r: &mut BufReader<TcpStream>) -> Option<u16> {
    let mut status = String::new();
    if r.read_line(&mut status).ok()? == 0 {
        return None;
    }
    let mut len = 0;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if line == "\r\n" {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().ok()?;
        }
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body).ok()?;
    status.split_whitespace().nth(1)?.parse().ok()
}

impl Hostile {
    /// Starts holding connections to `addr` as `mix` says.
    pub fn start(addr: SocketAddr, mix: &Mix) -> Hostile {
        let stop = Arc::new(AtomicBool::new(false));
        let held = Arc::new(AtomicUsize::new(0));
        let opened = Arc::new(AtomicU64::new(0));
        let answers: Arc<[AtomicU64; 4]> = Arc::new(Default::default());
        let mut threads = Vec::new();
        // Idle and slowloris: one thread each, reopening what the server closed.
        for (n, slow) in [(mix.idle, false), (mix.slowloris, true)] {
            if n == 0 {
                continue;
            }
            let (stop, held, opened) = (stop.clone(), held.clone(), opened.clone());
            threads.push(std::thread::spawn(move || {
                let mut conns: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
                let mut next_line = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    let trickle = slow && Instant::now() >= next_line;
                    if trickle {
                        next_line = Instant::now() + Duration::from_millis(300);
                    }
                    for slot in conns.iter_mut() {
                        if let Some(s) = slot {
                            let dead =
                                closed(s) || (trickle && s.write_all(b"X-a: b\r\n").is_err());
                            if dead {
                                *slot = None;
                                held.fetch_sub(1, Ordering::Relaxed);
                            }
                        }
                        if slot.is_none()
                            && let Some(mut s) = connect(addr)
                        {
                            opened.fetch_add(1, Ordering::Relaxed);
                            if slow {
                                let _ = s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n");
                            }
                            *slot = Some(s);
                            held.fetch_add(1, Ordering::Relaxed);
                        }
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                held.fetch_sub(conns.iter().flatten().count(), Ordering::Relaxed);
            }));
        }
        // Busy: four threads, each with its share of keep-alive connections.
        let per = mix.busy.div_ceil(4);
        for t in 0..4 {
            let n = per.min(mix.busy.saturating_sub(t * per));
            if n == 0 {
                continue;
            }
            let (stop, held, opened, answers) =
                (stop.clone(), held.clone(), opened.clone(), answers.clone());
            let auth = mix
                .busy_auth
                .as_ref()
                .map(|a| format!("Authorization: {a}\r\n"))
                .unwrap_or_default();
            let request = format!("GET {} HTTP/1.1\r\nHost: x\r\n{auth}\r\n", mix.busy_path);
            threads.push(std::thread::spawn(move || {
                let mut conns: Vec<Option<BufReader<TcpStream>>> = (0..n).map(|_| None).collect();
                while !stop.load(Ordering::Relaxed) {
                    for slot in conns.iter_mut() {
                        if slot.is_none()
                            && let Some(s) = connect(addr)
                        {
                            opened.fetch_add(1, Ordering::Relaxed);
                            *slot = Some(BufReader::new(s));
                            held.fetch_add(1, Ordering::Relaxed);
                        }
                        let Some(r) = slot else { continue };
                        let ok = r.get_mut().write_all(request.as_bytes()).is_ok();
                        match ok.then(|| read_response(r)).flatten() {
                            Some(code) => {
                                let i = match code {
                                    401 => 0,
                                    429 => 1,
                                    503 => 2,
                                    _ => 3,
                                };
                                answers[i].fetch_add(1, Ordering::Relaxed);
                            }
                            None => {
                                *slot = None;
                                held.fetch_sub(1, Ordering::Relaxed);
                            }
                        }
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                    }
                    if conns.iter().all(Option::is_none) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                held.fetch_sub(conns.iter().flatten().count(), Ordering::Relaxed);
            }));
        }
        Hostile {
            stop,
            threads,
            held,
            opened,
            answers,
        }
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// How one honest scrape ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scrape {
    /// 200 and a body.
    Ok,
    /// The connection could not be made, or was closed (or reset) before any answer.
    Refused,
    /// An answer other than 200.
    Status(u16),
    /// No whole answer within the timeout.
    TimedOut,
}

/// One scrape of `path` on a new connection, as a scraper without keep-alive makes it, with
/// `auth` as the `Authorization` header, within `timeout` (Prometheus' default is 10 s).
pub fn scrape(addr: SocketAddr, path: &str, auth: Option<&str>, timeout: Duration) -> Scrape {
    let start = Instant::now();
    let Ok(mut s) = TcpStream::connect_timeout(&addr, timeout) else {
        return Scrape::Refused;
    };
    let auth = auth
        .map(|a| format!("Authorization: {a}\r\n"))
        .unwrap_or_default();
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n");
    if s.write_all(request.as_bytes()).is_err() {
        return Scrape::Refused;
    }
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let left = timeout.saturating_sub(start.elapsed());
        if left.is_zero() || s.set_read_timeout(Some(left)).is_err() {
            return Scrape::TimedOut;
        }
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Scrape::TimedOut;
            }
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&buf);
    let Some(code) = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse::<u16>().ok())
    else {
        return Scrape::Refused;
    };
    let body = text.split_once("\r\n\r\n").map_or("", |x| x.1);
    match code {
        200 if !body.is_empty() => Scrape::Ok,
        200 => Scrape::Refused,
        c => Scrape::Status(c),
    }
}

/// What a round of honest scrapes saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// Scrapes made.
    pub scrapes: usize,
    /// Scrapes that failed, for any reason.
    pub failed: usize,
    /// Of those, refused (no connection, or closed before any answer).
    pub refused: usize,
    /// Up to five failures, as seen.
    pub examples: Vec<Scrape>,
}

/// `scrapers` honest scrapers, each scraping `path` `rounds` times, `every` apart, all
/// starting together (with the `Authorization` value `auth`).
pub fn honest(
    addr: SocketAddr,
    scrapers: usize,
    rounds: usize,
    every: Duration,
    path: &str,
    auth: Option<&str>,
) -> Tally {
    let barrier = Arc::new(std::sync::Barrier::new(scrapers));
    let threads: Vec<_> = (0..scrapers)
        .map(|_| {
            let barrier = barrier.clone();
            let (path, auth) = (path.to_string(), auth.map(str::to_string));
            std::thread::spawn(move || {
                barrier.wait();
                let mut seen = Vec::new();
                for r in 0..rounds {
                    let t = Instant::now();
                    seen.push(scrape(
                        addr,
                        &path,
                        auth.as_deref(),
                        Duration::from_secs(10),
                    ));
                    if r + 1 < rounds {
                        std::thread::sleep(every.saturating_sub(t.elapsed()));
                    }
                }
                seen
            })
        })
        .collect();
    let mut tally = Tally::default();
    for t in threads {
        for s in t.join().expect("a scraper thread") {
            tally.scrapes += 1;
            if s != Scrape::Ok {
                tally.failed += 1;
                if s == Scrape::Refused {
                    tally.refused += 1;
                }
                if tally.examples.len() < 5 {
                    tally.examples.push(s);
                }
            }
        }
    }
    tally
}
