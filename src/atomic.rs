//! The crate's one `AtomicU64`. 32-bit MIPS has no 64-bit atomic instructions, so std offers
//! no `AtomicU64` there; `portable-atomic` stands in (a lock per access) on exactly those
//! targets, and every other target keeps std's.

#[cfg(target_has_atomic = "64")]
pub use std::sync::atomic::AtomicU64;

#[cfg(not(target_has_atomic = "64"))]
pub use portable_atomic::AtomicU64;
