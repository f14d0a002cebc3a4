//! The integration tests, one binary (ripgrep's pattern): a real `imgate` process on real
//! sockets against the simulators in `common/`. Separate targets: `faults` (needs root),
//! and the ignored `bench`, `budgets` and `soak`.

mod common;

mod cli;
mod crash;
mod dataplane;
mod deployment;
#[cfg(feature = "dingtalk")]
mod dingtalk;
#[cfg(feature = "discord")]
mod discord;
mod edge;
#[cfg(feature = "feishu")]
mod feishu;
mod layers;
mod limits;
#[cfg(feature = "matrix")]
mod matrix;
mod outbox;
mod readme;
mod secrets;
mod service;
#[cfg(feature = "slack")]
mod slack;
#[cfg(feature = "telegram")]
mod telegram;
mod tls;
mod uploads;
mod v2;
mod wal;
#[cfg(feature = "wechat")]
mod wechat;
#[cfg(feature = "wecom")]
mod wecom;
