//! vLLM 0.33.0's partial prefix-cache entries: keys for a prompt that ends inside a
//! block (`BlockPool.cache_partial_block`).
//!
//! A full-attention group whose blocks are larger than the hash block registers the
//! hash at the prompt's last hash boundary as a key of the block that boundary falls
//! in. A block without a hash takes it as its primary key, which records the prefix
//! length it stands for (vLLM's `block_hash_num_tokens`); a block with one keeps it as
//! a secondary key (vLLM's `cached_block_hashes_by_block`). The primary key lives in
//! the [`PrefixMap`](crate::prefix_map::PrefixMap) with every other; this side table
//! holds only what partial entries add, so pools that never see one pay an empty map.
//!
//! Without partial lookups (vLLM enables them only with Mamba groups) no lookup asks
//! for these keys: they matter for events, eviction, promotion and the cached-token
//! estimate.
//!
//! Invariants (checked by [`crate::pool::BlockPool::check_invariants`]): every block
//! named here is cached under a primary key; a secondary key differs from its block's
//! primary key and from its other secondary keys.

use rustc_hash::FxHashMap;

use crate::block_hash::{map_heap_bytes, BlockHash};

/// One (hash, group id) key.
pub type Key = (BlockHash, u32);

/// What partial entries add to the prefix map.
#[derive(Debug, Clone, Default)]
pub struct PartialKeys {
    /// Blocks whose primary key is a partial entry, with the prefix length it stands
    /// for (a full block's is its end, so it is not kept).
    primary_tokens: FxHashMap<u32, i64>,
    /// Keys of blocks beside their primary key, in insertion order.
    secondary: FxHashMap<u32, Vec<Key>>,
}

impl PartialKeys {
    /// Whether no block has a partial entry (the fast path of every eviction).
    pub fn is_empty(&self) -> bool {
        self.primary_tokens.is_empty() && self.secondary.is_empty()
    }

    /// The prefix length of `block`'s primary key when that key is a partial entry.
    pub fn primary_tokens(&self, block: u32) -> Option<i64> {
        self.primary_tokens.get(&block).copied()
    }

    /// Records that `block`'s new primary key is a partial entry of `tokens` tokens.
    pub fn set_primary_tokens(&mut self, block: u32, tokens: i64) {
        self.primary_tokens.insert(block, tokens);
    }

    /// Whether `key` is one of `block`'s secondary keys.
    pub fn has_secondary(&self, block: u32, key: &Key) -> bool {
        self.secondary
            .get(&block)
            .is_some_and(|keys| keys.contains(key))
    }

    /// Adds `key` to `block`'s secondary keys.
    pub fn add_secondary(&mut self, block: u32, key: Key) {
        self.secondary.entry(block).or_default().push(key);
    }

    /// Whether some block other than those already dropped has `key` as a secondary
    /// key (a scan: only the router-grade last-copy option asks).
    pub fn any_secondary(&self, key: &Key) -> bool {
        self.secondary.values().any(|keys| keys.contains(key))
    }

    /// Forgets `block`'s partial entries, returning its secondary keys.
    pub fn take(&mut self, block: u32) -> Vec<Key> {
        self.primary_tokens.remove(&block);
        self.secondary.remove(&block).unwrap_or_default()
    }

    /// Forgets every partial entry.
    pub fn clear(&mut self) {
        self.primary_tokens.clear();
        self.secondary.clear();
    }

    /// The blocks named here, each with its secondary keys.
    pub fn blocks(&self) -> impl Iterator<Item = (u32, &[Key])> + '_ {
        let primaries = self
            .primary_tokens
            .keys()
            .filter(|b| !self.secondary.contains_key(b))
            .map(|&b| (b, &[][..]));
        primaries.chain(self.secondary.iter().map(|(&b, keys)| (b, keys.as_slice())))
    }

    /// Heap bytes held, counting hash-map buckets at their allocated size.
    pub fn heap_bytes(&self) -> usize {
        map_heap_bytes(
            self.primary_tokens.capacity(),
            std::mem::size_of::<(u32, i64)>(),
        ) + map_heap_bytes(
            self.secondary.capacity(),
            std::mem::size_of::<(u32, Vec<Key>)>(),
        ) + self
            .secondary
            .values()
            .map(|keys| keys.capacity() * std::mem::size_of::<Key>())
            .sum::<usize>()
    }
}
