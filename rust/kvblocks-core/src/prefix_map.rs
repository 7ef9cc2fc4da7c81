//! The prefix cache index: (block hash, KV cache group id) → cached blocks.
//!
//! vLLM's `BlockHashToBlockMap` keeps duplicates on purpose (identical full blocks
//! computed twice are both cached, so block tables stay append-only) and a lookup
//! returns the earliest-inserted block still cached under the key. Here each key
//! maps to the first block of a per-key list threaded through two flat per-block
//! arrays, so insert, remove (from anywhere) and lookup are all O(1):
//!
//! * `dup_next[b]`: the block inserted after `b` under the same key, or [`NO_BLOCK`];
//! * `dup_prev[b]`: the block inserted before `b`; for the first block of a key it is
//!   the key's *last* block (the list is circular backwards), which makes appending
//!   O(1) without storing a tail per key.
//!
//! The hash bytes are interned ([`HashInterner`]): a block stores a 4-byte slot id.
//!
//! Invariants (checked by [`PrefixMap::check`]):
//! * a block is cached iff `slot_of[b] != NO_BLOCK`; uncached blocks have no links;
//! * every cached block is in the list of its own key exactly once, and every list
//!   holds only blocks of its key, in insertion order;
//! * the interner's count of a slot equals the number of cached blocks using it.

use rustc_hash::FxHashMap;

use crate::block_hash::{map_heap_bytes, BlockHash, HashInterner};
use crate::error::Result;
use crate::free_queue::{ix, try_filled_vec};

/// "No block" in the per-block link arrays, and "no hash" in `slot_of`.
pub const NO_BLOCK: u32 = u32::MAX;

/// Cached blocks by (hash, group id), duplicates kept in insertion order.
#[derive(Debug, Clone)]
pub struct PrefixMap {
    interner: HashInterner,
    /// (interned hash slot, group id) → the earliest-inserted block still cached.
    heads: FxHashMap<(u32, u32), u32>,
    /// `slot_of[b]`: the interned hash slot of block `b`, or [`NO_BLOCK`].
    slot_of: Vec<u32>,
    /// `group_of[b]`: the group id of block `b`; meaningful only while it is cached.
    group_of: Vec<u32>,
    dup_prev: Vec<u32>,
    dup_next: Vec<u32>,
    /// Number of cached blocks.
    num_cached: usize,
}

impl PrefixMap {
    /// An empty map for the block ids `0 .. num_blocks`.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] when the per-block arrays cannot be allocated.
    pub fn new(num_blocks: u32) -> Result<Self> {
        let n = ix(num_blocks);
        Ok(Self {
            interner: HashInterner::new(),
            heads: FxHashMap::default(),
            slot_of: try_filled_vec(NO_BLOCK, n)?,
            group_of: try_filled_vec(0, n)?,
            dup_prev: try_filled_vec(NO_BLOCK, n)?,
            dup_next: try_filled_vec(NO_BLOCK, n)?,
            num_cached: 0,
        })
    }

    /// The number of distinct (hash, group) keys.
    pub fn num_keys(&self) -> usize {
        self.heads.len()
    }

    /// The number of cached blocks (duplicates counted).
    pub fn num_cached_blocks(&self) -> usize {
        self.num_cached
    }

    /// Whether `block` is cached under some key (false for unknown ids).
    pub fn is_cached(&self, block: u32) -> bool {
        self.slot_of.get(ix(block)).is_some_and(|&s| s != NO_BLOCK)
    }

    /// The (hash, group id) `block` is cached under.
    pub fn key_of(&self, block: u32) -> Option<(&BlockHash, u32)> {
        let slot = *self.slot_of.get(ix(block))?;
        let hash = self.interner.get(slot)?;
        Some((hash, self.group_of[ix(block)]))
    }

    /// Caches `block` under (`hash`, `group`), after any blocks already under that key.
    ///
    /// Returns false (changing nothing) if `block` is out of range or already cached.
    pub fn insert(&mut self, block: u32, hash: &BlockHash, group: u32) -> bool {
        let b = ix(block);
        if b >= self.slot_of.len() || self.slot_of[b] != NO_BLOCK {
            return false;
        }
        let Some(slot) = self.interner.intern(hash) else {
            return false;
        };
        self.slot_of[b] = slot;
        self.group_of[b] = group;
        self.dup_next[b] = NO_BLOCK;
        match self.heads.get(&(slot, group)).copied() {
            None => {
                self.heads.insert((slot, group), block);
                self.dup_prev[b] = block;
            }
            Some(head) => {
                let last = self.dup_prev[ix(head)];
                self.dup_next[ix(last)] = block;
                self.dup_prev[b] = last;
                self.dup_prev[ix(head)] = block;
            }
        }
        self.num_cached += 1;
        true
    }

    /// Uncaches `block` and returns the key it was cached under, or `None` if it was
    /// not cached.
    pub fn remove(&mut self, block: u32) -> Option<(BlockHash, u32)> {
        let b = ix(block);
        let slot = *self.slot_of.get(b)?;
        let hash = *self.interner.get(slot)?;
        let group = self.group_of[b];
        let key = (slot, group);
        let (prev, next) = (self.dup_prev[b], self.dup_next[b]);
        if self.heads.get(&key) == Some(&block) {
            if next == NO_BLOCK {
                self.heads.remove(&key);
            } else {
                // `prev` is the key's last block; it stays the last one.
                self.dup_prev[ix(next)] = prev;
                self.heads.insert(key, next);
            }
        } else {
            self.dup_next[ix(prev)] = next;
            if next == NO_BLOCK {
                // `block` was the last one: the first block's back link moves to prev.
                if let Some(&head) = self.heads.get(&key) {
                    self.dup_prev[ix(head)] = prev;
                }
            } else {
                self.dup_prev[ix(next)] = prev;
            }
        }
        self.dup_prev[b] = NO_BLOCK;
        self.dup_next[b] = NO_BLOCK;
        self.slot_of[b] = NO_BLOCK;
        self.interner.release(slot);
        self.num_cached -= 1;
        Some((hash, group))
    }

    /// The earliest-inserted block still cached under (`hash`, `group`).
    pub fn first(&self, hash: &BlockHash, group: u32) -> Option<u32> {
        let slot = self.interner.lookup(hash)?;
        self.heads.get(&(slot, group)).copied()
    }

    /// One block per group id (see [`PrefixMap::first`]), or `None` if any group misses.
    pub fn first_in_groups(&self, hash: &BlockHash, groups: &[u32]) -> Option<Vec<u32>> {
        let slot = self.interner.lookup(hash);
        groups
            .iter()
            .map(|&g| slot.and_then(|s| self.heads.get(&(s, g)).copied()))
            .collect()
    }

    /// Every cached block with its key, in block id order.
    pub fn cached(&self) -> impl Iterator<Item = (u32, &BlockHash, u32)> + '_ {
        (0u32..).zip(&self.slot_of).filter_map(|(block, &slot)| {
            let hash = self.interner.get(slot)?;
            Some((block, hash, self.group_of[ix(block)]))
        })
    }

    /// Uncaches every block.
    pub fn clear(&mut self) {
        self.interner.clear();
        self.heads.clear();
        self.slot_of.fill(NO_BLOCK);
        self.dup_prev.fill(NO_BLOCK);
        self.dup_next.fill(NO_BLOCK);
        self.num_cached = 0;
    }

    /// Heap bytes held, counting hash-map buckets at their allocated size.
    pub fn heap_bytes(&self) -> usize {
        let per_block = self.slot_of.capacity()
            + self.group_of.capacity()
            + self.dup_prev.capacity()
            + self.dup_next.capacity();
        per_block * std::mem::size_of::<u32>()
            + map_heap_bytes(
                self.heads.capacity(),
                std::mem::size_of::<((u32, u32), u32)>(),
            )
            + self.interner.heap_bytes()
    }

    /// Walks the whole structure and names the first broken rule.
    ///
    /// # Errors
    /// A description of the first inconsistency found.
    pub fn check(&self) -> std::result::Result<(), String> {
        self.interner
            .check()
            .map_err(|e| format!("hash interner: {e}"))?;
        let n = self.slot_of.len();
        let mut holders = vec![0u32; self.interner.slot_limit()];
        let mut cached = 0usize;
        for (block, &slot) in (0u32..).zip(&self.slot_of) {
            let b = ix(block);
            if slot == NO_BLOCK {
                if self.dup_prev[b] != NO_BLOCK || self.dup_next[b] != NO_BLOCK {
                    return Err(format!("uncached block {block} has duplicate links"));
                }
                continue;
            }
            if self.interner.get(slot).is_none() {
                return Err(format!("block {block} refers to free hash slot {slot}"));
            }
            holders[ix(slot)] += 1;
            cached += 1;
        }
        if cached != self.num_cached {
            return Err(format!(
                "{cached} blocks are cached but the count says {}",
                self.num_cached
            ));
        }
        for (slot, &count) in (0u32..).zip(&holders) {
            if count != self.interner.count(slot) {
                return Err(format!(
                    "hash slot {slot} has {count} blocks but an interner count of {}",
                    self.interner.count(slot)
                ));
            }
        }
        let mut listed = 0usize;
        for (&(slot, group), &head) in &self.heads {
            let mut before = self.dup_prev.get(ix(head)).copied().unwrap_or(NO_BLOCK);
            let mut block = head;
            while block != NO_BLOCK {
                let b = ix(block);
                if b >= n || self.slot_of[b] != slot || self.group_of[b] != group {
                    return Err(format!(
                        "block {block} is listed under a key it does not hold"
                    ));
                }
                if self.dup_prev[b] != before {
                    return Err(format!("block {block} has a broken back link"));
                }
                listed += 1;
                if listed > n {
                    return Err("a duplicate list has a cycle".to_owned());
                }
                before = block;
                block = self.dup_next[b];
            }
            if self.dup_prev.get(ix(head)) != Some(&before) {
                return Err(format!(
                    "first block {head} does not link back to its last block"
                ));
            }
        }
        if listed != cached {
            return Err(format!(
                "{listed} blocks are listed under keys but {cached} are cached"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(b: u8) -> BlockHash {
        BlockHash::new(&[b; 32]).unwrap()
    }

    #[test]
    fn duplicates_first_inserted_wins() {
        // vLLM's test_maybe_evict_cached_block: blocks 0 and 3 share hash0.
        let mut m = PrefixMap::new(8).unwrap();
        assert!(m.insert(0, &h(0), 0));
        assert!(m.insert(1, &h(1), 0));
        assert!(m.insert(2, &h(2), 0));
        assert!(m.insert(3, &h(0), 0));
        assert!(m.insert(4, &h(0), 0));
        assert!(!m.insert(4, &h(5), 0));
        assert_eq!(m.num_keys(), 3);
        assert_eq!(m.first(&h(0), 0), Some(0));
        assert_eq!(m.first(&h(0), 1), None);
        m.check().unwrap();
        assert_eq!(m.remove(3), Some((h(0), 0)));
        m.check().unwrap();
        assert_eq!(m.remove(0), Some((h(0), 0)));
        assert_eq!(m.first(&h(0), 0), Some(4));
        m.check().unwrap();
        assert!(m.insert(0, &h(0), 0));
        assert_eq!(m.first(&h(0), 0), Some(4));
        assert_eq!(m.remove(4), Some((h(0), 0)));
        assert_eq!(m.first(&h(0), 0), Some(0));
        assert_eq!(m.remove(4), None);
        m.check().unwrap();
        for b in [1, 2, 0] {
            assert!(m.remove(b).is_some());
        }
        assert_eq!(m.num_keys(), 0);
        assert_eq!(m.num_cached_blocks(), 0);
        m.check().unwrap();
    }

    #[test]
    fn groups_are_separate_keys() {
        let mut m = PrefixMap::new(4).unwrap();
        assert!(m.insert(1, &h(9), 0));
        assert!(m.insert(2, &h(9), 1));
        assert_eq!(m.first_in_groups(&h(9), &[0, 1]), Some(vec![1, 2]));
        assert_eq!(m.first_in_groups(&h(9), &[0, 2]), None);
        assert_eq!(m.first_in_groups(&h(8), &[]), Some(vec![]));
        assert_eq!(m.key_of(2), Some((&h(9), 1)));
        assert_eq!(m.cached().count(), 2);
        m.clear();
        assert_eq!(m.key_of(2), None);
        m.check().unwrap();
        assert!(!m.insert(4, &h(1), 0));
        assert_eq!(m.remove(99), None);
    }
}
