//! kvblocks-core: vLLM 0.33.0's KV-cache block management in plain Rust.
//!
//! No Python here: `cargo test` exercises all of it. The `PyO3` crate `kvblocks-py`
//! only converts arguments and delegates to these modules.
//!
//! * [`free_queue`] — the index-linked LRU free list with head/tail sentinels.
//! * [`block_hash`] — fixed-size block hash values.
//! * [`prefix_map`] — hash + group id → cached blocks, duplicates in insertion order.
//! * [`partial_keys`] — vLLM's partial prompt-tail keys beside the prefix map.
//! * [`pool`] — the block pool: ref counts, allocation, frees, touch, caching, eviction.
//! * [`hashing`] — vLLM-identical block hashing (pickle / CBOR serialisation, SHA-256, xxh3).
//! * [`extra_keys`] — a request's new blocks and their extra keys, from its extras.
//! * [`manager`] — the request-level KV cache manager for one full-attention group.
//! * [`hybrid`] — vLLM's manager over several groups (full, sliding-window and
//!   chunked-local attention) or one local-attention group.
//! * [`request`] — what the manager reads of a request, behind two small traits.
//! * [`rollback`] — rolling requests back past KV blocks whose load failed.
//! * [`events`] — KV cache events (vLLM's `BlockStored` / `BlockRemoved` /
//!   `AllBlocksCleared`) as compact records.

pub mod block_hash;
pub mod error;
pub mod events;
pub mod extra_keys;
pub mod free_queue;
pub mod hashing;
pub mod hybrid;
mod index;
pub mod manager;
pub mod partial_keys;
pub mod pool;
pub mod prefix_map;
pub mod request;
pub mod rollback;

pub use block_hash::BlockHash;
pub use error::{Error, ErrorKind, Result};
