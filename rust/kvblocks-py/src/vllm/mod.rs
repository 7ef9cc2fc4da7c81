//! vLLM's `KVCacheManager` surface for `kvblocks.vllm`: the native manager with
//! the Scheduler's arguments and result shapes. Every decision is the core's; this
//! module reads vLLM's `Request` (its block hashes once each, kept per request until it
//! is freed) and hands block ids back in `KVCacheBlocks`, whose block views are built
//! only when a connector reads `.blocks`.
//!
//! One file per job: the request reader (`request.rs`), the result classes
//! (`blocks.rs`) and the manager, for every layout kvblocks manages (`manager.rs`).

mod blocks;
mod manager;
mod request;

pub use blocks::{PyBlockView, PyKVCacheBlocks};
pub use manager::PyVllmManager;
