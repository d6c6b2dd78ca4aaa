//! The per-node agent.
#![deny(missing_docs)]

pub mod alerts;
pub mod config;
pub mod history;
pub mod metrics;
