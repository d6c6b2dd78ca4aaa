//! Delivers alert notifications to the configured sinks, on a thread of its own so that a slow
//! webhook never delays a collection: a log line, a webhook (a JSON POST, retried with
//! exponential backoff), and commands (argv without a shell, the alert in environment
//! variables).

use crate::alerts::Notification;
use crate::config::{AlertsConfig, Exec, Webhook};
use std::process::{Command, Stdio};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The notifier's end: send notifications here.
pub struct Notifier {
    tx: Option<Sender<Notification>>,
    handle: Option<JoinHandle<()>>,
}

impl Notifier {
    /// Starts the delivery thread; sinks are read from `config` at each delivery, so a reload
    /// takes effect for the next notification.
    pub fn start(config: Arc<RwLock<AlertsConfig>>) -> Notifier {
        let (tx, rx) = channel();
        let handle = std::thread::Builder::new()
            .name("vramguard-notify".into())
            .spawn(move || deliver_all(rx, config))
            .expect("spawn the notifier thread");
        Notifier {
            tx: Some(tx),
            handle: Some(handle),
        }
    }

    /// Queues a notification.
    pub fn send(&self, n: Notification) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(n);
        }
    }

    /// Delivers what is queued, then stops.
    pub fn stop(&mut self) {
        drop(self.tx.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn deliver_all(rx: Receiver<Notification>, config: Arc<RwLock<AlertsConfig>>) {
    while let Ok(n) = rx.recv() {
        let cfg = config.read().expect("alerts config").clone();
        if cfg.log {
            match n.status {
                "firing" => {
                    tracing::warn!(rule = %n.rule, gpu = n.gpu, value = n.value, "alert firing: {}", n.summary)
                }
                _ => tracing::info!(rule = %n.rule, gpu = n.gpu, "alert resolved: {}", n.summary),
            }
        }
        for w in &cfg.webhooks {
            if let Err(e) = post(w, &n) {
                tracing::error!(url = %w.url, rule = %n.rule, "webhook failed after {} attempt(s): {e}", w.retries + 1);
            }
        }
        for x in &cfg.execs {
            if let Err(e) = exec(x, &n) {
                tracing::error!(command = %x.argv.join(" "), rule = %n.rule, "alert command failed: {e}");
            }
        }
    }
}

/// The webhook body.
pub fn body(n: &Notification) -> String {
    serde_json::json!({
        "source": "vramguard",
        "status": n.status,
        "rule": n.rule,
        "gpu": n.gpu,
        "uuid": n.uuid,
        "host": n.host,
        "value": n.value,
        "summary": n.summary,
        "started_at": vramguard_ops::audit::rfc3339(n.started_at_ms),
        "at": vramguard_ops::audit::rfc3339(n.at_ms),
    })
    .to_string()
}

fn post(w: &Webhook, n: &Notification) -> Result<(), String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(w.timeout))
        .http_status_as_error(true)
        .build()
        .into();
    let payload = body(n);
    let mut backoff = Duration::from_millis(500);
    let mut last = String::new();
    for attempt in 0..=w.retries {
        if attempt > 0 {
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_secs(30));
        }
        match agent
            .post(&w.url)
            .header("content-type", "application/json")
            .send(payload.as_str())
        {
            Ok(_) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
    }
    Err(last)
}

fn exec(x: &Exec, n: &Notification) -> Result<(), String> {
    let mut child = Command::new(&x.argv[0])
        .args(&x.argv[1..])
        .env("VRAMGUARD_ALERT_STATUS", n.status)
        .env("VRAMGUARD_ALERT_RULE", &n.rule)
        .env("VRAMGUARD_ALERT_GPU", n.gpu.to_string())
        .env("VRAMGUARD_ALERT_UUID", n.uuid.as_deref().unwrap_or(""))
        .env("VRAMGUARD_ALERT_HOST", n.host.as_deref().unwrap_or(""))
        .env("VRAMGUARD_ALERT_VALUE", n.value.to_string())
        .env("VRAMGUARD_ALERT_SUMMARY", &n.summary)
        .env(
            "VRAMGUARD_ALERT_STARTED_AT",
            vramguard_ops::audit::rfc3339(n.started_at_ms),
        )
        .env("VRAMGUARD_ALERT_JSON", body(n))
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting {}: {e}", x.argv[0]))?;
    let deadline = Instant::now() + x.timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(format!("exited with {status}")),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("killed after {:?}", x.timeout));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e.to_string()),
        }
    }
}
