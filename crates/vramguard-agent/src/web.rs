//! Securing the agent's HTTP side beyond loopback, in the web config format Prometheus
//! exporters share (node_exporter's `--web.config.file`):
//!
//! ```yaml
//! tls_server_config:
//!   cert_file: server.crt      # relative paths are relative to this file
//!   key_file: server.key
//! basic_auth_users:
//!   prometheus: $2y$10$...     # bcrypt hashes (htpasswd -nBC 10 "" | tr -d ':\n')
//! ```
//!
//! Either part may be left out. Successful logins are remembered (by the SHA-256 of the user
//! and password), so a scraper costs one bcrypt verification, not one per scrape; wrong
//! passwords cost a bounded number (see [`crate::limits`]).

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::limits::{FailedLogins, Peer};

/// The largest web config file read.
const MAX_WEB_CONFIG: u64 = 1 << 20;
/// Logins remembered; beyond this, the set is cleared.
const REMEMBERED_LOGINS: usize = 64;

/// A web config, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct WebConfig {
    /// Certificate chain and key (PEM), when TLS is on.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// User name → bcrypt hash; empty: no authentication.
    pub users: BTreeMap<String, String>,
}

/// The largest bcrypt cost accepted (10 is htpasswd's usual; each step doubles the work).
const MAX_BCRYPT_COST: u32 = 14;

/// Refuses any key of the mapping `doc` (at `prefix`) other than `known`.
fn only_keys(
    path: &Path,
    doc: &yaml_rust2::Yaml,
    prefix: &str,
    known: &[&str],
) -> Result<(), WebConfigError> {
    if doc.is_badvalue() || doc.is_null() {
        return Ok(());
    }
    let Some(map) = doc.as_hash() else {
        return Err(err(
            path,
            format!("{}: a mapping of settings", prefix.trim_end_matches('.')),
        ));
    };
    for key in map.keys() {
        let name = key.as_str().unwrap_or("?");
        if !known.contains(&name) {
            return Err(err(
                path,
                format!(
                    "{prefix}{}: not supported (vramguard reads tls_server_config.cert_file, \
                     tls_server_config.key_file and basic_auth_users; client certificates are \
                     not: use basic_auth_users); remove it",
                    vramguard_core::sanitize::fit(name, 64)
                ),
            ));
        }
    }
    Ok(())
}

/// A web config (TLS, basic authentication) that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("web config {}: {reason}", path.display())]
pub struct WebConfigError {
    /// The file.
    pub path: std::path::PathBuf,
    /// What is wrong, and where in it.
    pub reason: String,
}

fn err(path: &Path, msg: impl std::fmt::Display) -> WebConfigError {
    WebConfigError {
        path: path.to_path_buf(),
        reason: msg.to_string(),
    }
}

impl WebConfig {
    /// Reads and checks `path`.
    pub fn load(path: &Path) -> Result<WebConfig, WebConfigError> {
        let text = vramguard_fs::read_root_config_to_string(path, MAX_WEB_CONFIG)
            .map_err(|e| err(path, e.reason()))?;
        let docs = yaml_rust2::YamlLoader::load_from_str(&text).map_err(|e| err(path, e))?;
        let doc = docs.into_iter().next().unwrap_or(yaml_rust2::Yaml::Null);
        // Fail closed: a key this reader does not act on (a typo, node_exporter's client
        // certificates or TLS versions) would otherwise leave the agent open without a word.
        // node_exporter's http_server_config (response headers, HTTP/2) opens nothing: it is
        // accepted, not applied (said at start).
        only_keys(
            path,
            &doc,
            "",
            &[
                "tls_server_config",
                "basic_auth_users",
                "http_server_config",
            ],
        )?;
        if !doc["http_server_config"].is_badvalue() && !doc["http_server_config"].is_null() {
            tracing::warn!(
                "web config {}: http_server_config is not applied (vramguard sets its own \
                 response headers)",
                path.display()
            );
        }
        only_keys(
            path,
            &doc["tls_server_config"],
            "tls_server_config.",
            &["cert_file", "key_file"],
        )?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let resolve = |p: &str| {
            let p = Path::new(p);
            if p.is_absolute() {
                p.to_path_buf()
            } else {
                dir.join(p)
            }
        };
        let mut tls = None;
        if !doc["tls_server_config"].is_badvalue() && !doc["tls_server_config"].is_null() {
            let t = &doc["tls_server_config"];
            let (Some(cert), Some(key)) = (t["cert_file"].as_str(), t["key_file"].as_str()) else {
                return Err(err(path, "tls_server_config needs cert_file and key_file"));
            };
            tls = Some((resolve(cert), resolve(key)));
        }
        let mut users = BTreeMap::new();
        let listed = &doc["basic_auth_users"];
        if !listed.is_badvalue() && !listed.is_null() && listed.as_hash().is_none() {
            return Err(err(
                path,
                "basic_auth_users: a mapping of `name: bcrypt-hash` entries",
            ));
        }
        if let Some(map) = listed.as_hash() {
            for (k, v) in map {
                let (Some(user), Some(hash)) = (k.as_str(), v.as_str()) else {
                    return Err(err(
                        path,
                        "basic_auth_users: each entry is `name: bcrypt-hash`",
                    ));
                };
                if !hash.starts_with("$2") {
                    return Err(err(
                        path,
                        format!("basic_auth_users.{user}: not a bcrypt hash"),
                    ));
                }
                // Each wrong guess costs one verification: a cost above 14 (over a second of
                // CPU each) turns the limit on guesses into a way to burn the node's CPU.
                let cost = hash.split('$').nth(2).and_then(|c| c.parse::<u32>().ok());
                if cost.is_none_or(|c| c > MAX_BCRYPT_COST) {
                    return Err(err(
                        path,
                        format!(
                            "basic_auth_users.{user}: a bcrypt cost of at most {MAX_BCRYPT_COST} \
                             (htpasswd -nBC 10)"
                        ),
                    ));
                }
                users.insert(user.to_string(), hash.to_string());
            }
        }
        Ok(WebConfig { tls, users })
    }

    /// The TLS acceptor, when TLS is on.
    pub fn acceptor(
        &self,
        path: &Path,
    ) -> Result<Option<tokio_rustls::TlsAcceptor>, WebConfigError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let Some((cert, key)) = &self.tls else {
            return Ok(None);
        };
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .and_then(|it| it.collect::<Result<_, _>>())
            .map_err(|e| err(path, format!("cert_file {}: {e}", cert.display())))?;
        if certs.is_empty() {
            return Err(err(
                path,
                format!("cert_file {}: no certificate", cert.display()),
            ));
        }
        let key = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| err(path, format!("key_file {}: {e}", key.display())))?;
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| err(path, e))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| err(path, e))?;
        Ok(Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))))
    }
}

/// Verifications (bcrypt) that run at once; more wait for their turn (at most
/// [`VERIFY_WAIT`]). Each runs on a blocking thread, never on the HTTP workers.
pub const VERIFYING: usize = 1;
/// How long a login waits for a verification's turn before it is answered 503.
pub const VERIFY_WAIT: Duration = Duration::from_secs(2);

/// What [`BasicAuth::check`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The request may pass.
    Allowed,
    /// No credentials, or wrong ones: 401.
    Denied,
    /// The peer has spent its failed-login budget: 429, no bcrypt spent.
    Limited,
    /// No verification's turn came in time: 503.
    Busy,
}

/// Checks `Authorization` headers against the configured users, at a bounded bcrypt cost (see
/// [`crate::limits`]): credentials verified once are remembered by their SHA-256, never in
/// the clear; at most [`VERIFYING`] verifications run at once; each peer's failed ones are
/// limited by [`FailedLogins`].
#[derive(Debug)]
pub struct BasicAuth {
    users: BTreeMap<String, String>,
    /// A hash no password matches, at the users' cost: an unknown name costs a verification
    /// too, so the time of a 401 does not tell which names exist.
    no_such_user: Option<String>,
    remembered: Mutex<HashSet<[u8; 32]>>,
    verifying: Arc<tokio::sync::Semaphore>,
    failed: FailedLogins,
}

impl Default for BasicAuth {
    fn default() -> Self {
        BasicAuth::new(BTreeMap::new())
    }
}

fn credential_key(user: &str, password: &str) -> [u8; 32] {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(user.as_bytes());
    ctx.update(b":");
    ctx.update(password.as_bytes());
    ctx.finish()
        .as_ref()
        .try_into()
        .expect("SHA-256 is 32 bytes")
}

impl BasicAuth {
    /// Checks for `users` (none: everything passes).
    pub fn new(users: BTreeMap<String, String>) -> BasicAuth {
        let cost = users
            .values()
            .filter_map(|h| h.split('$').nth(2)?.parse::<u32>().ok())
            .max();
        let no_such_user = cost.and_then(|c| {
            let mut salt = [0u8; 16];
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut salt).ok()?;
            let secret: String = salt.iter().map(|b| format!("{b:02x}")).collect();
            bcrypt::hash(secret, c).ok()
        });
        BasicAuth {
            users,
            no_such_user,
            remembered: Mutex::new(HashSet::new()),
            verifying: Arc::new(tokio::sync::Semaphore::new(VERIFYING)),
            failed: FailedLogins::default(),
        }
    }

    /// Whether users are configured (requests need a password).
    pub fn enabled(&self) -> bool {
        !self.users.is_empty()
    }

    /// Whether a request from `peer` with this `Authorization` header may pass.
    pub async fn check(&self, header: Option<&str>, peer: Peer) -> Verdict {
        use base64::Engine;
        if self.users.is_empty() {
            return Verdict::Allowed;
        }
        let Some(encoded) = header.and_then(|h| h.strip_prefix("Basic ")) else {
            return Verdict::Denied;
        };
        let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(encoded.trim()) else {
            return Verdict::Denied;
        };
        let Ok(text) = String::from_utf8(decoded) else {
            return Verdict::Denied;
        };
        let Some((user, password)) = text.split_once(':') else {
            return Verdict::Denied;
        };
        let key = credential_key(user, password);
        if self.remembered().contains(&key) {
            return Verdict::Allowed;
        }
        let Some(hash) = self.users.get(user).or(self.no_such_user.as_ref()) else {
            return Verdict::Denied;
        };
        if !self.failed.take(peer, std::time::Instant::now()) {
            return Verdict::Limited;
        }
        let Ok(Ok(turn)) =
            tokio::time::timeout(VERIFY_WAIT, self.verifying.clone().acquire_owned()).await
        else {
            self.failed.refund(peer);
            return Verdict::Busy;
        };
        let (password, hash) = (password.to_string(), hash.clone());
        // The turn goes with the verification: a client that hangs up drops this future, not
        // the bcrypt already running, which must keep the next one waiting.
        let ok = tokio::task::spawn_blocking(move || {
            let _turn = turn;
            bcrypt::verify(password, &hash)
        })
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or(false);
        if !ok {
            return Verdict::Denied;
        }
        self.failed.refund(peer);
        let mut seen = self.remembered();
        if seen.len() >= REMEMBERED_LOGINS {
            seen.clear();
        }
        seen.insert(key);
        Verdict::Allowed
    }

    fn remembered(&self) -> std::sync::MutexGuard<'_, HashSet<[u8; 32]>> {
        self.remembered.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    /// Red-team finding: keys it did not act on were ignored, so a node_exporter web config
    /// with client certificates, or a typo, left the agent open. Every such key is refused.
    #[test]
    fn a_web_config_with_a_key_it_does_not_act_on_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("web.yml");
        let hash = bcrypt::hash("s3cret", 4).unwrap();
        for (text, says) in [
            (
                "tls_server_config:\n  cert_file: c.pem\n  key_file: k.pem\n  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.pem\n".to_string(),
                "tls_server_config.client_auth_type: not supported",
            ),
            (
                format!("tls_sever_config:\n  cert_file: c.pem\nbasic_auth_users:\n  prom: {hash}\n"),
                "tls_sever_config: not supported",
            ),
            (
                format!("basic_auth_user:\n  prom: {hash}\n"),
                "basic_auth_user: not supported",
            ),
            (
                format!("basic_auth_users:\n  - prom: {hash}\n"),
                "basic_auth_users: a mapping",
            ),
            (
                "basic_auth_users:\n  prom: $2y$17$abcdefghijklmnopqrstuu5tO2kwYrMmQ7R6vFcO2Hc2d3BdTOAnK\n".to_string(),
                "a bcrypt cost of at most 14",
            ),
            ("- a\n- b\n".to_string(), "a mapping of settings"),
        ] {
            std::fs::write(&path, &text).unwrap();
            let e = WebConfig::load(&path).unwrap_err().to_string();
            assert!(e.contains(says), "{text}: {e}");
        }
        std::fs::write(&path, "").unwrap();
        assert_eq!(WebConfig::load(&path).unwrap().users.len(), 0);
        // node_exporter's http_server_config opens nothing: accepted (second read: a reused
        // node_exporter config would otherwise stop the agent at an upgrade).
        std::fs::write(
            &path,
            format!("http_server_config:\n  http2: false\nbasic_auth_users:\n  prom: {hash}\n"),
        )
        .unwrap();
        assert_eq!(WebConfig::load(&path).unwrap().users.len(), 1);
    }

    /// Red-team finding: the verification's turn lived in the request, so a client that hung
    /// up mid-verification let the next bcrypt start while its own still ran: any number at
    /// once, from enough addresses. The turn is held until the verification itself ends.
    #[test]
    fn a_client_that_hangs_up_does_not_free_the_verifications_turn() {
        let users = BTreeMap::from([("prom".to_string(), bcrypt::hash("s3cret", 12).unwrap())]);
        let auth = BasicAuth::new(users);
        let header = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode("prom:wrong")
        );
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let hung_up = tokio::time::timeout(
                Duration::from_millis(20),
                auth.check(Some(&header), Peer::V4(7)),
            )
            .await;
            assert!(hung_up.is_err(), "a cost-12 bcrypt takes longer than 20 ms");
            assert_eq!(
                auth.verifying.available_permits(),
                0,
                "the abandoned verification still runs and holds its turn"
            );
        });
    }

    #[test]
    fn users_and_tls_files_relative_to_the_config() {
        let dir = tempfile::tempdir().unwrap();
        let hash = bcrypt::hash("s3cret", 4).unwrap();
        let path = dir.path().join("web.yml");
        std::fs::write(
            &path,
            format!("tls_server_config:\n  cert_file: c.pem\n  key_file: /k.pem\nbasic_auth_users:\n  prom: {hash}\n"),
        )
        .unwrap();
        let c = WebConfig::load(&path).unwrap();
        assert_eq!(
            c.tls,
            Some((dir.path().join("c.pem"), PathBuf::from("/k.pem")))
        );
        let auth = BasicAuth::new(c.users);
        let basic = |s: &str| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(s)
            )
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let check = |h: Option<&str>| rt.block_on(auth.check(h, Peer::Loopback));
        assert_eq!(check(Some(&basic("prom:s3cret"))), Verdict::Allowed);
        assert_eq!(
            check(Some(&basic("prom:s3cret"))),
            Verdict::Allowed,
            "remembered"
        );
        assert_eq!(check(Some(&basic("other:s3cret"))), Verdict::Denied);
        assert_eq!(check(None), Verdict::Denied);
        assert_eq!(check(Some("Bearer x")), Verdict::Denied);
        // Five wrong guesses cost five verifications (an unknown name above was one: it costs
        // a verification as a known one does, so a 401's timing tells no names); the sixth is
        // refused without one, and the remembered password still passes.
        for _ in 0..4 {
            assert_eq!(check(Some(&basic("prom:wrong"))), Verdict::Denied);
        }
        assert_eq!(check(Some(&basic("prom:wrong2"))), Verdict::Limited);
        assert_eq!(check(Some(&basic("prom:s3cret"))), Verdict::Allowed);
        assert_eq!(
            rt.block_on(auth.check(Some(&basic("prom:wrong")), Peer::V4(1))),
            Verdict::Denied,
            "another peer has its own budget"
        );
        std::fs::write(&path, "basic_auth_users:\n  prom: plaintext\n").unwrap();
        assert!(
            WebConfig::load(&path)
                .unwrap_err()
                .reason
                .contains("not a bcrypt hash")
        );
        std::fs::write(&path, "tls_server_config:\n  cert_file: c.pem\n").unwrap();
        assert!(
            WebConfig::load(&path)
                .unwrap_err()
                .reason
                .contains("cert_file and key_file")
        );
    }
}
