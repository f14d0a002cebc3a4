//! Feishu / Lark (its international edition): events over the long connection the app opens
//! itself, so imgate works behind NAT.
//!
//! So far only the long connection's frame codec; the provider (config, binding, the
//! connection, events into the outbox, the tools) is still to come.

pub mod frame;
