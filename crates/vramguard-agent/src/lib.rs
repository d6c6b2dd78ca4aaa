//! The per-node agent: `vramguard agent`.
//!
//! A collector thread ([`agent`]) samples the GPUs and `/proc` on its own schedule and wakes at
//! once when a GPU holder exits; each sample is classified by the core, fed to the leak
//! [`history`] and the [`alerts`] rules, and rendered into [`metrics`] text, a status [`page`]
//! and JSON, which the [`http`] server hands out as they are. Notifications go out on their own
//! thread ([`notify`]). The Slurm heal's steps are followed in the audit log ([`heal`]). The [`config`] module reads the config file every command shares.
#![deny(missing_docs)]

pub mod agent;
pub mod alerts;
/// The config file (its own crate: every command reads it).
pub use vramguard_config as config;
pub mod heal;
pub mod history;
pub mod http;
pub mod limits;
pub mod metrics;
pub mod notify;
pub mod page;
pub mod web;

pub use agent::{AgentError, AgentSetup, AutoReclaimError, run};
