//! Feishu / Lark (its international edition): events over the long connection the app opens
//! itself, so imgate works behind NAT.
//!
//! So far the long connection's frame codec (`frame`) and its protocol without I/O
//! (`longconn`); the provider (config, binding, the connection task, events into the outbox,
//! the tools) is still to come.

pub mod frame;
pub mod longconn;
