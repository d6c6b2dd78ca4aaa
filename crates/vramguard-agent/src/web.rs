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
//! Either part may be left out. Successful logins are remembered (by their exact header), so
//! a scraper costs one bcrypt verification, not one per scrape.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

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

/// Checks `Authorization` headers against the configured users.
#[derive(Debug, Default)]
pub struct BasicAuth {
    users: BTreeMap<String, String>,
    remembered: Mutex<HashSet<String>>,
}

impl BasicAuth {
    /// Checks for `users` (none: everything passes).
    pub fn new(users: BTreeMap<String, String>) -> BasicAuth {
        BasicAuth {
            users,
            remembered: Mutex::new(HashSet::new()),
        }
    }

    /// Whether a request with this `Authorization` header may pass.
    pub fn allows(&self, header: Option<&str>) -> bool {
        use base64::Engine;
        if self.users.is_empty() {
            return true;
        }
        let Some(header) = header else {
            return false;
        };
        if self
            .remembered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(header)
        {
            return true;
        }
        let Some(encoded) = header.strip_prefix("Basic ") else {
            return false;
        };
        let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(encoded.trim()) else {
            return false;
        };
        let Ok(text) = String::from_utf8(decoded) else {
            return false;
        };
        let Some((user, password)) = text.split_once(':') else {
            return false;
        };
        let ok = self
            .users
            .get(user)
            .is_some_and(|hash| bcrypt::verify(password, hash).unwrap_or(false));
        if ok {
            let mut seen = self.remembered.lock().unwrap_or_else(|p| p.into_inner());
            if seen.len() >= REMEMBERED_LOGINS {
                seen.clear();
            }
            seen.insert(header.to_string());
        }
        ok
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
        assert!(auth.allows(Some(&basic("prom:s3cret"))));
        assert!(auth.allows(Some(&basic("prom:s3cret"))), "remembered");
        assert!(!auth.allows(Some(&basic("prom:wrong"))));
        assert!(!auth.allows(Some(&basic("other:s3cret"))));
        assert!(!auth.allows(None));
        assert!(!auth.allows(Some("Bearer x")));
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
