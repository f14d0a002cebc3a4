//! imgate's modules. The binary (src/main.rs) runs `cli::main`; the fuzz targets in fuzz/ reach
//! the parsers of outside bytes through `fuzzing`. Everything else is the crate's own.
// A build that leaves providers out (their Cargo features off) also leaves unused some shared
// code only they call; dead code is a finding of the full build, which CI lints with -D warnings.
#![cfg_attr(
    not(all(
        feature = "telegram",
        feature = "feishu",
        feature = "wechat",
        feature = "slack",
        feature = "discord",
        feature = "dingtalk",
        feature = "matrix",
        feature = "wecom"
    )),
    allow(dead_code, unused_imports)
)]

mod app;
mod atomic;
mod changed;
mod channels;
mod civil;
pub mod cli;
mod config;
mod cork;
mod dataplane;
mod faults;
mod files;
mod fit;
mod front;
pub mod fuzzing;
mod heap;
mod http;
mod hub;
mod ids;
mod json;
mod maintenance;
mod memory;
mod metrics;
mod outbox;
mod peer_wait;
mod probe;
mod protocol;
mod providers;
mod quiet;
mod runtime;
#[cfg(test)]
mod scratch;
mod service;
mod source;
mod status_view;
mod store;
#[cfg(test)]
mod testutil;
mod tls;
mod upstream;
mod wsclient;
mod y2038;
