//! imgate's modules. The binary (src/main.rs) is the CLI and the wiring; the library exists so that
//! the fuzz targets in fuzz/ can call the parsers of outside bytes directly.

pub mod app;
pub mod channels;
pub mod config;
pub mod dataplane;
pub mod faults;
pub mod files;
pub mod front;
pub mod http;
pub mod hub;
pub mod ids;
pub mod json;
pub mod maintenance;
pub mod outbox;
pub mod protocol;
pub mod providers;
pub mod quiet;
pub mod runtime;
pub mod service;
pub mod source;
pub mod store;
#[cfg(test)]
mod testutil;
pub mod wsclient;
