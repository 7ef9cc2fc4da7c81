//! The prefix cache index: (block hash, KV cache group id) → cached blocks.
//!
//! vLLM's `BlockHashToBlockMap` keeps duplicates on purpose (identical full blocks
//! computed twice are both cached, so block tables stay append-only) and a lookup
//! returns the earliest-inserted block still cached under the key. Here each key
//! maps to the first block of a per-key list threaded through the per-block records,
//! so insert, remove (from anywhere) and lookup are all O(1). Block `b`'s record holds
//!
//! * `next`: the block inserted after `b` under the same key, or [`NO_BLOCK`];
//! * `prev`: the block inserted before `b`; for the first block of a key it is the
//!   key's *last* block (the list is circular backwards), which makes appending O(1)
//!   without storing a tail per key.
//!
//! A block's links sit in one 16-byte record with its hash slot and group id, so
//! caching or evicting a random block touches one cache line of per-block state.
//!
//! The hash bytes are interned ([`HashInterner`]): a block stores a 4-byte slot id.
//! The head of a group-0 key (group 0 is the only group of a full-attention model) is
//! the interner's tag of the slot, in the record the lookup has just compared, so the
//! common lookup touches no other memory; other groups' heads are in a map.
//!
//! Invariants (checked by [`PrefixMap::check`]):
//! * a block is cached iff its slot is not [`NO_BLOCK`]; uncached blocks have no links;
//! * every cached block is in the list of its own key exactly once, and every list
//!   holds only blocks of its key (kept in insertion order, which the check cannot see:
//!   nothing records when a block was inserted; the golden traces verify the order);
//! * the interner's count of a slot equals the number of cached blocks using it.

use std::collections::hash_map::Entry as MapEntry;

use rustc_hash::FxHashMap;

use crate::block_hash::{map_heap_bytes, BlockHash, HashInterner, NO_TAG};
use crate::error::Result;
use crate::index::{ix, try_filled_vec};

/// "No block" in the per-block links, and "no hash" in a block's slot.
pub const NO_BLOCK: u32 = u32::MAX;

/// What the prefix map knows of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    /// The interned hash slot, or [`NO_BLOCK`] when the block is not cached.
    slot: u32,
    /// The group id; meaningful only while the block is cached.
    group: u32,
    prev: u32,
    next: u32,
}

const UNCACHED: Entry = Entry {
    slot: NO_BLOCK,
    group: 0,
    prev: NO_BLOCK,
    next: NO_BLOCK,
};

// The group-0 head lives in the interner's tag: the two "none" markers must agree.
const _: () = assert!(NO_TAG == NO_BLOCK);

/// Cached blocks by (hash, group id), duplicates kept in insertion order.
#[derive(Debug, Clone)]
pub struct PrefixMap {
    interner: HashInterner,
    /// (slot, group) → first block, for groups other than 0 (whose heads are tags).
    other_heads: FxHashMap<(u32, u32), u32>,
    entries: Vec<Entry>,
    /// Number of cached blocks.
    num_cached: usize,
}

impl PrefixMap {
    /// An empty map for the block ids `0 .. num_blocks`.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] when the per-block array cannot be allocated.
    pub fn new(num_blocks: u32) -> Result<Self> {
        Ok(Self {
            interner: HashInterner::new(),
            other_heads: FxHashMap::default(),
            entries: try_filled_vec(UNCACHED, ix(num_blocks))?,
            num_cached: 0,
        })
    }

    /// The number of distinct (hash, group) keys. Counts the group-0 heads, so it walks
    /// the interner (for tests and diagnostics, not hot paths).
    pub fn num_keys(&self) -> usize {
        self.interner.tags().count() + self.other_heads.len()
    }

    /// The number of cached blocks (duplicates counted).
    pub fn num_cached_blocks(&self) -> usize {
        self.num_cached
    }

    /// Whether `block` is cached under some key (false for unknown ids).
    pub fn is_cached(&self, block: u32) -> bool {
        self.entries
            .get(ix(block))
            .is_some_and(|e| e.slot != NO_BLOCK)
    }

    /// The (hash, group id) `block` is cached under.
    pub fn key_of(&self, block: u32) -> Option<(&BlockHash, u32)> {
        let entry = self.entries.get(ix(block))?;
        Some((self.interner.get(entry.slot)?, entry.group))
    }

    fn head(&self, slot: u32, group: u32) -> Option<u32> {
        if group == 0 {
            Some(self.interner.tag(slot)).filter(|&b| b != NO_BLOCK)
        } else {
            self.other_heads.get(&(slot, group)).copied()
        }
    }

    /// Makes `block` the first block of an existing key, or of a new one.
    fn set_head(&mut self, slot: u32, group: u32, block: u32) {
        if group == 0 {
            self.interner.set_tag(slot, block);
        } else {
            self.other_heads.insert((slot, group), block);
        }
    }

    fn remove_head(&mut self, slot: u32, group: u32) {
        if group == 0 {
            self.interner.set_tag(slot, NO_TAG);
        } else {
            self.other_heads.remove(&(slot, group));
        }
    }

    /// Caches `block` under (`hash`, `group`), after any blocks already under that key.
    ///
    /// Returns false (changing nothing) if `block` is out of range or already cached.
    pub fn insert(&mut self, block: u32, hash: &BlockHash, group: u32) -> bool {
        let b = ix(block);
        if self.entries.get(b).is_none_or(|e| e.slot != NO_BLOCK) {
            return false;
        }
        let (slot, head) = if group == 0 {
            // The interner makes `block` the head if the key has none, in the probe
            // that finds the slot.
            let Some((slot, head)) = self.interner.intern_tagged(hash, block) else {
                return false;
            };
            (slot, Some(head).filter(|&h| h != NO_TAG))
        } else {
            let Some(slot) = self.interner.intern(hash) else {
                return false;
            };
            let head = match self.other_heads.entry((slot, group)) {
                MapEntry::Occupied(head) => Some(*head.get()),
                MapEntry::Vacant(place) => {
                    place.insert(block);
                    None
                }
            };
            (slot, head)
        };
        let prev = match head {
            None => block,
            Some(head) => {
                let last = self.entries[ix(head)].prev;
                self.entries[ix(last)].next = block;
                self.entries[ix(head)].prev = block;
                last
            }
        };
        self.entries[b] = Entry {
            slot,
            group,
            prev,
            next: NO_BLOCK,
        };
        self.num_cached += 1;
        true
    }

    /// Uncaches `block` and returns the key it was cached under, or `None` if it was
    /// not cached.
    pub fn remove(&mut self, block: u32) -> Option<(BlockHash, u32)> {
        let b = ix(block);
        let Entry {
            slot,
            group,
            prev,
            next,
        } = *self.entries.get(b)?;
        let hash = *self.interner.get(slot)?;
        let head = self.head(slot, group);
        if head == Some(block) {
            if next == NO_BLOCK {
                self.remove_head(slot, group);
            } else {
                // `prev` is the key's last block; it stays the last one.
                self.entries[ix(next)].prev = prev;
                self.set_head(slot, group, next);
            }
        } else {
            self.entries[ix(prev)].next = next;
            if next == NO_BLOCK {
                // `block` was the last one: the first block's back link moves to prev.
                if let Some(head) = head {
                    self.entries[ix(head)].prev = prev;
                }
            } else {
                self.entries[ix(next)].prev = prev;
            }
        }
        self.entries[b] = UNCACHED;
        self.interner.release(slot);
        self.num_cached -= 1;
        Some((hash, group))
    }

    /// The earliest-inserted block still cached under (`hash`, `group`).
    pub fn first(&self, hash: &BlockHash, group: u32) -> Option<u32> {
        self.head(self.interner.lookup(hash)?, group)
    }

    /// One block per group id (see [`PrefixMap::first`]), or `None` if any group misses.
    pub fn first_in_groups(&self, hash: &BlockHash, groups: &[u32]) -> Option<Vec<u32>> {
        let slot = self.interner.lookup(hash);
        groups
            .iter()
            .map(|&g| slot.and_then(|s| self.head(s, g)))
            .collect()
    }

    /// Every cached block with its key, in block id order.
    pub fn cached(&self) -> impl Iterator<Item = (u32, &BlockHash, u32)> + '_ {
        (0u32..).zip(&self.entries).filter_map(|(block, e)| {
            let hash = self.interner.get(e.slot)?;
            Some((block, hash, e.group))
        })
    }

    /// Uncaches every block.
    pub fn clear(&mut self) {
        self.interner.clear();
        self.other_heads.clear();
        self.entries.fill(UNCACHED);
        self.num_cached = 0;
    }

    /// Heap bytes held, counting hash-map buckets at their allocated size.
    pub fn heap_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry>()
            + map_heap_bytes(
                self.other_heads.capacity(),
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
        let n = self.entries.len();
        let mut holders = vec![0u32; self.interner.slot_limit()];
        let mut cached = 0usize;
        for (block, e) in (0u32..).zip(&self.entries) {
            if e.slot == NO_BLOCK {
                if e.prev != NO_BLOCK || e.next != NO_BLOCK {
                    return Err(format!("uncached block {block} has duplicate links"));
                }
                continue;
            }
            if self.interner.get(e.slot).is_none() {
                return Err(format!("block {block} refers to free hash slot {}", e.slot));
            }
            holders[ix(e.slot)] += 1;
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
        let heads = self
            .interner
            .tags()
            .map(|(slot, head)| ((slot, 0), head))
            .chain(self.other_heads.iter().map(|(&key, &head)| (key, head)));
        let mut listed = 0usize;
        for ((slot, group), head) in heads {
            let mut before = self.entries.get(ix(head)).map_or(NO_BLOCK, |e| e.prev);
            let mut block = head;
            while block != NO_BLOCK {
                let Some(e) = self.entries.get(ix(block)) else {
                    return Err(format!("block {block} is listed but out of range"));
                };
                if e.slot != slot || e.group != group {
                    return Err(format!(
                        "block {block} is listed under a key it does not hold"
                    ));
                }
                if e.prev != before {
                    return Err(format!("block {block} has a broken back link"));
                }
                listed += 1;
                if listed > n {
                    return Err("a duplicate list has a cycle".to_owned());
                }
                before = block;
                block = e.next;
            }
            if self.entries.get(ix(head)).map(|e| e.prev) != Some(before) {
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

/// [`PrefixMap::check`] against one broken private field at a time: each rule the
/// checker names must be caught, or a corrupted map would pass as valid.
#[cfg(test)]
pub(crate) mod corruption_tests {
    use super::*;
    use crate::block_hash::corruption_tests::unindex;

    /// Makes `m` count one more cached block than it holds, for the pool's tests.
    pub(crate) fn overstate_num_cached(m: &mut PrefixMap) {
        m.num_cached += 1;
    }

    fn h(b: u8) -> BlockHash {
        BlockHash::new(&[b; 32]).unwrap()
    }

    /// Blocks 1, 3, 4 under (hash 0, group 0) in that order, block 2 under (hash 1,
    /// group 0), block 5 under (hash 1, group 1); blocks 0, 6, 7 uncached. Hash 0 is
    /// slot 0, hash 1 slot 1, and slot 2 is free (block 6 was cached and evicted).
    /// Checked valid before any corruption.
    fn valid_map() -> PrefixMap {
        let mut m = PrefixMap::new(8).unwrap();
        for (block, hash, group) in [(1, 0, 0), (2, 1, 0), (3, 0, 0), (4, 0, 0), (5, 1, 1)] {
            assert!(m.insert(block, &h(hash), group));
        }
        assert!(m.insert(6, &h(9), 0));
        assert_eq!(m.remove(6), Some((h(9), 0)));
        assert_eq!(
            (0..3).map(|b| m.interner.lookup(&h(b))).collect::<Vec<_>>(),
            [Some(0), Some(1), None]
        );
        assert_eq!(m.interner.slot_limit(), 3);
        m.check().unwrap();
        m
    }

    fn assert_caught(m: &PrefixMap, fragment: &str) {
        let err = m.check().expect_err("the corruption went unnoticed");
        assert!(err.contains(fragment), "{err:?} does not name {fragment:?}");
    }

    #[test]
    fn interner_broken() {
        let mut m = valid_map();
        unindex(&mut m.interner, 1);
        assert_caught(&m, "hash interner: 2 slots are live but the index holds 1");
    }

    #[test]
    fn uncached_block_with_a_next_link() {
        let mut m = valid_map();
        m.entries[7].next = 1;
        assert_caught(&m, "uncached block 7 has duplicate links");
    }

    #[test]
    fn uncached_block_with_a_prev_link() {
        let mut m = valid_map();
        m.entries[0].prev = 4;
        assert_caught(&m, "uncached block 0 has duplicate links");
    }

    #[test]
    fn cached_block_on_a_free_hash_slot() {
        let mut m = valid_map();
        m.entries[2].slot = 2;
        assert_caught(&m, "block 2 refers to free hash slot 2");
    }

    #[test]
    fn cached_block_on_an_unknown_hash_slot() {
        let mut m = valid_map();
        m.entries[2].slot = 7;
        assert_caught(&m, "block 2 refers to free hash slot 7");
    }

    #[test]
    fn cached_count_overstated() {
        let mut m = valid_map();
        overstate_num_cached(&mut m);
        assert_caught(&m, "5 blocks are cached but the count says 6");
    }

    /// The interner stays consistent on its own; only the holder count is off.
    #[test]
    fn interner_count_above_the_blocks_using_the_slot() {
        let mut m = valid_map();
        assert_eq!(m.interner.intern(&h(0)), Some(0));
        assert_caught(&m, "hash slot 0 has 3 blocks but an interner count of 4");
    }

    #[test]
    fn cached_block_moved_to_another_live_slot() {
        let mut m = valid_map();
        m.entries[3].slot = 1;
        assert_caught(&m, "hash slot 0 has 2 blocks but an interner count of 3");
    }

    #[test]
    fn next_link_past_the_blocks() {
        let mut m = valid_map();
        m.entries[4].next = 99;
        assert_caught(&m, "block 99 is listed but out of range");
    }

    #[test]
    fn listed_block_holds_another_group() {
        let mut m = valid_map();
        m.entries[3].group = 1;
        assert_caught(&m, "block 3 is listed under a key it does not hold");
    }

    #[test]
    fn next_link_into_another_keys_list() {
        let mut m = valid_map();
        m.entries[4].next = 2;
        assert_caught(&m, "block 2 is listed under a key it does not hold");
    }

    /// The group-0 head lives in the interner's tag: pointing it at an uncached
    /// block must not pass.
    #[test]
    fn key_head_names_an_uncached_block() {
        let mut m = valid_map();
        assert!(m.interner.set_tag(1, 7));
        assert_caught(&m, "block 7 is listed under a key it does not hold");
    }

    #[test]
    fn back_link_not_mirroring_next() {
        let mut m = valid_map();
        m.entries[4].prev = 1;
        assert_caught(&m, "block 4 has a broken back link");
    }

    /// The first block's back link names the last one, so a last block linking
    /// forward to the first passes every back-link test: only the count stops it.
    #[test]
    fn last_block_links_forward_to_the_first() {
        let mut m = valid_map();
        m.entries[4].next = 1;
        assert_caught(&m, "a duplicate list has a cycle");
    }

    #[test]
    fn first_block_back_link_not_the_last_block() {
        let mut m = valid_map();
        m.entries[1].prev = 3;
        assert_caught(&m, "first block 1 does not link back to its last block");
    }

    #[test]
    fn group_zero_key_lost_its_head() {
        let mut m = valid_map();
        assert!(m.interner.set_tag(1, NO_TAG));
        assert_caught(&m, "4 blocks are listed under keys but 5 are cached");
    }

    #[test]
    fn other_group_key_lost_its_head() {
        let mut m = valid_map();
        assert_eq!(m.other_heads.remove(&(1, 1)), Some(5));
        assert_caught(&m, "4 blocks are listed under keys but 5 are cached");
    }

    #[test]
    fn list_cut_short_before_its_last_block() {
        let mut m = valid_map();
        m.entries[3].next = NO_BLOCK;
        assert_caught(&m, "first block 1 does not link back to its last block");
    }
}
