//! Who keeps a connection slot when the HTTP side is full, and what a failed login may cost.
//!
//! The red-team case (issue #26): one unprivileged local user holding every connection slot
//! (idle sockets, slowloris heads, keep-alive connections that sent one request, wrong
//! passwords) locked every other scraper out, and each wrong password cost a cost-10 bcrypt
//! verification on one of the two HTTP worker threads. The design:
//!
//! - **The cap is never a reason to turn a newcomer away.** At [`MAX_CONNECTIONS`], the server
//!   closes a connection already held to make room (evicts it) instead of refusing the new
//!   one. None inside a request handler is evicted (for at most [`BUSY_LIMIT`]), and the one
//!   first in line is evicted only once it has been held for [`MIN_HOLD`]; until then the
//!   newcomer waits (later ones wait in the kernel's accept queue), at most [`ADMIT_WAIT`]. So every admitted connection, an honest scraper's included, has
//!   [`MIN_HOLD`] to send its request (a local scraper needs well under a millisecond), and a
//!   burst of honest scrapers larger than the cap waits instead of evicting itself.
//! - **The victim** is chosen by [`victim`]: from the peer holding the most connections (a
//!   peer is an IPv4 address, an IPv6 /64, and *all* of loopback as one, since any local user
//!   can send from any 127.0.0.0/8 address); within it, a connection that has never had a
//!   request admitted (by the password, or by any request when no users are configured)
//!   before one that has; then the one whose last admitted request (or, never admitted, whose
//!   acceptance) is oldest. A remote Prometheus holds one or two connections and is never the
//!   heaviest peer; a local one shares loopback with a local attacker, but as the most recent
//!   connection it is the last one chosen, and a wrong password does not make a connection
//!   recent. A response the client does not read leaves the handler at once and does not keep
//!   the connection busy.
//! - **Bcrypt is bounded** in [`crate::web::BasicAuth`]: verified credentials are remembered by
//!   their SHA-256 (a correct password costs one verification per agent run), at most
//!   [`crate::web::VERIFYING`] verification runs at a time, off the HTTP worker threads, and
//!   each peer may spend [`FailedLogins`]' budget of failed verifications ([`FAILED_BURST`],
//!   then one per [`FAILED_EVERY`]); beyond it a guess is answered 429 without bcrypt.
//!
//! What this does not guarantee: with no users configured, a local attacker's requests are as
//! good as a scraper's, and an attacker who can open [`MAX_CONNECTIONS`] connections faster
//! than a scraper's request arrives can still evict it (the kernel's accept queue is shared,
//! too). A local scraper's *first* login may be answered 429 while a local attacker spends
//! loopback's failed-login budget; once its password has been verified, it never is.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Connections served at once, so that a flood of sockets cannot take the descriptors the
/// collector needs. At the cap a held connection is closed to make room (see [`victim`]).
pub const MAX_CONNECTIONS: usize = 128;
/// A connection is not closed to make room before it has been held this long: the time an
/// admitted client has, at the least, to send its request.
pub const MIN_HOLD: Duration = Duration::from_millis(50);
/// A connection inside a request handler (a password being verified) longer than this may be
/// closed to make room like any other.
pub const BUSY_LIMIT: Duration = Duration::from_secs(5);
/// At the cap with no connection that may be closed, how long accepting waits for one before
/// the newcomer is refused.
pub const ADMIT_WAIT: Duration = Duration::from_secs(1);
/// Failed logins a peer may cost at once...
pub const FAILED_BURST: f64 = 5.0;
/// ...and then one per this long.
pub const FAILED_EVERY: Duration = Duration::from_secs(1);
/// Peers whose failed logins are tracked; beyond this, those back at a full budget are
/// forgotten (and all of them if that is not enough).
const TRACKED_PEERS: usize = 4096;

/// Who a connection comes from, as far as sharing the slots and the login budget goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Peer {
    /// Any loopback address: every local user can use every one of them.
    Loopback,
    /// An IPv4 address.
    V4(u32),
    /// An IPv6 /64 (one host usually holds a whole one).
    V6(u64),
}

impl Peer {
    /// The peer of a connection from `ip`.
    pub fn of(ip: IpAddr) -> Peer {
        let ip = ip.to_canonical();
        if ip.is_loopback() {
            return Peer::Loopback;
        }
        match ip {
            IpAddr::V4(v4) => Peer::V4(u32::from(v4)),
            IpAddr::V6(v6) => Peer::V6((u128::from(v6) >> 64) as u64),
        }
    }
}

/// Milliseconds since the process's first call, never 0 (0 marks "not set").
pub fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// What the server knows about one connection while it is open; shared between the accept
/// loop (which picks victims) and the connection's requests (which update it).
#[derive(Debug)]
pub struct ConnState {
    /// The peer.
    pub peer: Peer,
    /// When it was accepted ([`now_ms`]).
    pub accepted: u64,
    /// Its place in the order of acceptance (ties within a millisecond).
    pub seq: u64,
    /// Whether a request on it has been admitted (the password, or no users configured).
    pub admitted: AtomicBool,
    /// When the last admitted request started ([`now_ms`]; 0: none yet).
    pub last_admitted: AtomicU64,
    /// When the request now in a handler started ([`now_ms`]; 0: none is).
    pub busy_since: AtomicU64,
}

impl ConnState {
    /// A connection from `peer`, accepted now.
    pub fn new(peer: Peer) -> ConnState {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        ConnState {
            peer,
            accepted: now_ms(),
            seq: SEQ.fetch_add(1, Ordering::Relaxed),
            admitted: AtomicBool::new(false),
            last_admitted: AtomicU64::new(0),
            busy_since: AtomicU64::new(0),
        }
    }

    /// A request on it passed authentication.
    pub fn admit(&self) {
        self.admitted.store(true, Ordering::Relaxed);
        self.last_admitted.store(now_ms(), Ordering::Relaxed);
    }

    /// The time its standing is measured from: the last admitted request, or acceptance.
    fn recent(&self) -> u64 {
        self.accepted
            .max(self.last_admitted.load(Ordering::Relaxed))
    }
}

/// The connection to close to make room for a newcomer, at `now` ([`now_ms`]): the first in
/// the order the module's documentation gives, of those not in a handler; None while that one
/// has been held for less than [`MIN_HOLD`] (or all are in a handler).
pub fn victim(conns: &[&ConnState], now: u64) -> Option<usize> {
    let mut per_peer: HashMap<Peer, usize> = HashMap::new();
    for c in conns {
        *per_peer.entry(c.peer).or_default() += 1;
    }
    let min_hold = MIN_HOLD.as_millis() as u64;
    let busy_limit = BUSY_LIMIT.as_millis() as u64;
    conns
        .iter()
        .enumerate()
        .filter(|(_, c)| {
            let busy = c.busy_since.load(Ordering::Relaxed);
            busy == 0 || now.saturating_sub(busy) >= busy_limit
        })
        .max_by_key(|(_, c)| {
            (
                per_peer[&c.peer],
                !c.admitted.load(Ordering::Relaxed),
                std::cmp::Reverse(c.recent()),
                std::cmp::Reverse(c.seq),
            )
        })
        // The first in line, once it has had its time: never a better-placed one instead.
        .filter(|(_, c)| now.saturating_sub(c.accepted) >= min_hold)
        .map(|(i, _)| i)
}

/// Each peer's budget of failed logins: a token bucket of [`FAILED_BURST`] tokens, one back
/// per [`FAILED_EVERY`].
#[derive(Debug, Default)]
pub struct FailedLogins {
    peers: Mutex<HashMap<Peer, (f64, Instant)>>,
}

impl FailedLogins {
    /// Takes one token for a verification by `peer`; false when its budget is spent.
    pub fn take(&self, peer: Peer, now: Instant) -> bool {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if peers.len() >= TRACKED_PEERS && !peers.contains_key(&peer) {
            peers.retain(|_, b| refill(*b, now) < FAILED_BURST);
            if peers.len() >= TRACKED_PEERS {
                peers.clear();
            }
        }
        let b = peers.entry(peer).or_insert((FAILED_BURST, now));
        let tokens = refill(*b, now);
        if tokens < 1.0 {
            *b = (tokens, now);
            return false;
        }
        *b = (tokens - 1.0, now);
        true
    }

    /// Gives back the token of a verification that succeeded: only failures are limited.
    pub fn refund(&self, peer: Peer) {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = peers.get_mut(&peer) {
            b.0 = (b.0 + 1.0).min(FAILED_BURST);
        }
    }
}

fn refill((tokens, at): (f64, Instant), now: Instant) -> f64 {
    let back = now.saturating_duration_since(at).as_secs_f64() / FAILED_EVERY.as_secs_f64();
    (tokens + back).min(FAILED_BURST)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn conn(peer: Peer, accepted: u64, admitted_at: Option<u64>) -> ConnState {
        let c = ConnState::new(peer);
        let c = ConnState { accepted, ..c };
        if let Some(t) = admitted_at {
            c.admitted.store(true, Ordering::Relaxed);
            c.last_admitted.store(t, Ordering::Relaxed);
        }
        c
    }

    #[test]
    fn every_loopback_address_is_one_peer_and_an_ipv6_host_is_its_64() {
        assert_eq!(Peer::of(Ipv4Addr::new(127, 0, 0, 1).into()), Peer::Loopback);
        assert_eq!(Peer::of(Ipv4Addr::new(127, 9, 8, 7).into()), Peer::Loopback);
        assert_eq!(Peer::of(Ipv6Addr::LOCALHOST.into()), Peer::Loopback);
        assert_eq!(
            Peer::of(Ipv4Addr::new(127, 0, 0, 2).to_ipv6_mapped().into()),
            Peer::Loopback
        );
        let a: Ipv6Addr = "2001:db8:1:2::1".parse().unwrap();
        let b: Ipv6Addr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let c: Ipv6Addr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(Peer::of(a.into()), Peer::of(b.into()));
        assert_ne!(Peer::of(a.into()), Peer::of(c.into()));
        assert_ne!(
            Peer::of(Ipv4Addr::new(10, 0, 0, 1).into()),
            Peer::of(Ipv4Addr::new(10, 0, 0, 2).into())
        );
    }

    #[test]
    fn the_victim_is_from_the_heaviest_peer_never_admitted_and_oldest() {
        let remote = Peer::V4(0x0a00_0001);
        let now = 10_000;
        // A remote scraper (admitted long ago) and three local connections.
        let scraper = conn(remote, 100, Some(200));
        let local_admitted = conn(Peer::Loopback, 100, Some(9_000));
        let local_old_silent = conn(Peer::Loopback, 5_000, None);
        let local_new_silent = conn(Peer::Loopback, 9_500, None);
        let all = [
            &scraper,
            &local_admitted,
            &local_old_silent,
            &local_new_silent,
        ];
        assert_eq!(
            victim(&all, now),
            Some(2),
            "loopback is heavier; never admitted; oldest"
        );
        let all = [&scraper, &local_admitted, &local_new_silent];
        assert_eq!(victim(&all, now), Some(2));
        let all = [&scraper, &local_admitted];
        // One each: the never-admitted rule ties, the older standing goes.
        assert_eq!(victim(&all, now), Some(0));
        // The first in line too young to close: none, not the next one.
        let young = conn(Peer::Loopback, now - 10, None);
        assert_eq!(victim(&[&young], now), None);
        assert_eq!(victim(&[&scraper, &young], now), None);
        let busy = conn(Peer::Loopback, 100, None);
        busy.busy_since.store(now - 100, Ordering::Relaxed);
        assert_eq!(victim(&[&busy], now), None);
        busy.busy_since.store(now - 6_000, Ordering::Relaxed);
        assert_eq!(victim(&[&busy], now), Some(0), "stuck in a handler");
    }

    #[test]
    fn failed_logins_are_a_burst_then_one_a_second_per_peer() {
        let f = FailedLogins::default();
        let t = Instant::now();
        let p = Peer::Loopback;
        for _ in 0..5 {
            assert!(f.take(p, t));
        }
        assert!(!f.take(p, t));
        assert!(f.take(Peer::V4(1), t), "another peer has its own budget");
        assert!(!f.take(p, t + Duration::from_millis(500)));
        assert!(f.take(p, t + Duration::from_millis(1600)));
        assert!(!f.take(p, t + Duration::from_millis(1700)));
        f.refund(p);
        assert!(
            f.take(p, t + Duration::from_millis(1700)),
            "a success gives its token back"
        );
    }
}
