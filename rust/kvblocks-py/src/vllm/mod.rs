//! vLLM's `KVCacheManager` surface for `kvblocks.vllm`: the native manager with
//! the Scheduler's arguments and result shapes. Every decision is the core's; the
//! manager reads vLLM's `Request` through `crate::request_fields` (its block hashes
//! as the core asks for them, at each call) and hands block ids back in
//! `KVCacheBlocks`, whose block views are built only when a connector reads `.blocks`.
//!
//! One file per job: the result classes (`blocks.rs`) and the manager, for every
//! layout kvblocks manages (`manager.rs`).

mod blocks;
mod manager;

pub use blocks::{PyBlockView, PyKVCacheBlocks};
pub use manager::PyVllmManager;
