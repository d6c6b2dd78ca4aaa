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
        let text = vramguard_fs::read_regular_to_string(path, MAX_WEB_CONFIG)
            .map_err(|e| err(path, e.reason()))?;
        let docs = yaml_rust2::YamlLoader::load_from_str(&text).map_err(|e| err(path, e))?;
        let doc = docs.into_iter().next().unwrap_or(yaml_rust2::Yaml::Null);
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
        if let Some(map) = doc["basic_auth_users"].as_hash() {
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
    remembered: Mutex<HashSet<[u8; 32]>>,
    verifying: tokio::sync::Semaphore,
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
        BasicAuth {
            users,
            remembered: Mutex::new(HashSet::new()),
            verifying: tokio::sync::Semaphore::new(VERIFYING),
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
        let Some(hash) = self.users.get(user) else {
            return Verdict::Denied;
        };
        if !self.failed.take(peer, std::time::Instant::now()) {
            return Verdict::Limited;
        }
        let Ok(Ok(_turn)) = tokio::time::timeout(VERIFY_WAIT, self.verifying.acquire()).await
        else {
            self.failed.refund(peer);
            return Verdict::Busy;
        };
        let (password, hash) = (password.to_string(), hash.clone());
        let ok = tokio::task::spawn_blocking(move || bcrypt::verify(password, &hash))
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
        // Five wrong guesses cost five verifications; the sixth is refused without one, and
        // the remembered password still passes.
        for _ in 0..5 {
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
