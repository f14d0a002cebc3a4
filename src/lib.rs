//! imgate's modules. The binary (src/main.rs) runs `cli::main`; the fuzz targets in fuzz/ reach
//! the parsers of outside bytes through `fuzzing`. Everything else is the crate's own.

mod app;
mod channels;
pub mod cli;
mod config;
mod cork;
mod dataplane;
mod faults;
mod files;
mod front;
pub mod fuzzing;
mod heap;
mod http;
mod hub;
mod ids;
mod json;
mod maintenance;
mod outbox;
mod peer_wait;
mod protocol;
mod providers;
mod quiet;
mod runtime;
#[cfg(test)]
mod scratch;
mod service;
mod source;
mod store;
#[cfg(test)]
mod testutil;
mod tls;
mod upstream;
mod wsclient;
