//! The block pool: vLLM 0.33.0's `BlockPool` over flat per-block arrays.
//!
//! State:
//! * `ref_cnt[b]`: holders of block `b` (request block tables, retentions);
//! * the [`FreeQueue`]: exactly the non-null blocks with ref count 0, head = next to
//!   be allocated;
//! * the [`PrefixMap`]: hash + group id of every cached block, duplicates in
//!   insertion order;
//! * the [`PartialKeys`]: what vLLM's partial prompt-tail entries add to it.
//!
//! Block 0 is the null block: never free, never handed out, never hashed, ref count
//! never tracked. Once events are enabled ([`BlockPool::enable_events`]) the pool
//! records a `BlockRemoved` per prefix-cache entry it drops (lazy eviction in
//! [`BlockPool::get_new_blocks`], [`BlockPool::evict_blocks`]) and an
//! `AllBlocksCleared` per successful reset; `BlockStored` comes from the manager,
//! which knows the request's tokens. Every public method validates all of its input before it mutates
//! anything, so an `Err` means the pool is exactly as it was.
//!
//! Invariants (checked by [`BlockPool::check_invariants`]):
//! 1. the null block has ref count 0, is not queued and not cached;
//! 2. a non-null block is in the free queue iff its ref count is 0;
//! 3. the free queue and the prefix map are internally consistent;
//! 4. a block with partial entries is cached, its secondary keys distinct from its
//!    primary key and from each other.

use std::ops::Range;

use crate::block_hash::BlockHash;
use crate::error::{group_id, non_negative, positive, Error, Result};
use crate::events::{EventConfig, EventLog};
use crate::free_queue::{FreeQueue, MAX_CAPACITY};
use crate::index::{ix, try_filled_vec};
use crate::partial_keys::{Key, PartialKeys};
use crate::prefix_map::PrefixMap;

/// The id of the null block.
pub const NULL_BLOCK_ID: u32 = 0;

/// The largest pool [`BlockPool::new`] accepts.
pub const MAX_NUM_BLOCKS: u32 = MAX_CAPACITY;

/// A snapshot of one block, as `BlockPool.get_block` returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockInfo {
    /// The block id.
    pub block_id: u32,
    /// Its reference count (always 0 for the null block).
    pub ref_cnt: u32,
    /// The hash it is cached under, if any.
    pub block_hash: Option<BlockHash>,
    /// The KV cache group id it is cached under, if any.
    pub group_id: Option<u32>,
    /// Whether this is the null block (id 0).
    pub is_null: bool,
}

/// vLLM's `BlockPool`: ref-counted blocks, an LRU free queue and the prefix cache.
#[derive(Debug, Clone)]
pub struct BlockPool {
    num_blocks: u32,
    enable_caching: bool,
    /// `ref_cnt[b]`: holders of block `b`.
    ref_cnt: Vec<u32>,
    free_queue: FreeQueue,
    prefix: PrefixMap,
    partial: PartialKeys,
    /// Reused buffer for the blocks `free_blocks` prepends, so frees do not allocate.
    scratch: Vec<u32>,
    /// KV cache events since they were last taken (nothing while disabled).
    events: EventLog,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks; block 0 is the null block, the others are free in
    /// ascending id order.
    ///
    /// # Errors
    /// [`Error::NonPositive`] when `num_blocks <= 0`; [`Error::InvalidArgument`] when it
    /// exceeds [`MAX_NUM_BLOCKS`] or memory for it cannot be allocated.
    pub fn new(num_blocks: i64, enable_caching: bool) -> Result<Self> {
        positive("num_blocks", num_blocks)?;
        let n = u32::try_from(num_blocks)
            .ok()
            .filter(|&n| n <= MAX_NUM_BLOCKS)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "num_blocks must be at most {MAX_NUM_BLOCKS}, got {num_blocks}"
                ))
            })?;
        let mut free_queue = FreeQueue::new(n)?;
        for id in 1..n {
            let pushed = free_queue.push_back(id);
            debug_assert!(pushed, "a fresh queue holds each id once");
        }
        Ok(Self {
            num_blocks: n,
            enable_caching,
            ref_cnt: try_filled_vec(0, ix(n))?,
            free_queue,
            prefix: PrefixMap::new(n)?,
            partial: PartialKeys::default(),
            scratch: Vec::new(),
            events: EventLog::default(),
        })
    }

    /// The number of blocks, the null block included.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Whether prefix caching is enabled (it decides lazy eviction and free order).
    pub fn enable_caching(&self) -> bool {
        self.enable_caching
    }

    /// Blocks in the free queue, cached ones with ref count 0 included.
    pub fn num_free_blocks(&self) -> usize {
        self.free_queue.len()
    }

    /// `1 - free / (num_blocks - 1)`, or 0.0 for a pool with only the null block.
    pub fn usage(&self) -> f64 {
        let total = self.num_blocks - 1;
        if total == 0 {
            return 0.0;
        }
        // The free count never exceeds num_blocks - 1, so it fits in a u32.
        let free = u32::try_from(self.free_queue.len()).unwrap_or(total);
        1.0 - f64::from(free) / f64::from(total)
    }

    /// Pops `n` blocks from the head of the free queue, each with ref count 1. With
    /// caching on, a popped block that still has a hash loses it (lazy eviction).
    ///
    /// # Errors
    /// [`Error::Negative`] (`n`) for `n < 0`; [`Error::NoFreeBlocks`] when
    /// fewer than `n` blocks are free.
    pub fn get_new_blocks(&mut self, n: i64) -> Result<Vec<u32>> {
        let count = non_negative("n", n)?;
        let mut out = Vec::new();
        self.get_new_blocks_into(count, &mut out)?;
        Ok(out)
    }

    /// [`BlockPool::get_new_blocks`] appending the ids to `out`.
    ///
    /// # Errors
    /// [`Error::NoFreeBlocks`] when fewer than `n` blocks are free; `out` and the pool
    /// are then unchanged.
    pub fn get_new_blocks_into(&mut self, n: usize, out: &mut Vec<u32>) -> Result<()> {
        let free = self.free_queue.len();
        if n > free {
            return Err(Error::NoFreeBlocks { requested: n, free });
        }
        out.reserve(n);
        for _ in 0..n {
            let Some(id) = self.free_queue.pop_front() else {
                break;
            };
            if self.enable_caching {
                self.evict_cached(id, None);
            }
            // Queued blocks have ref count 0 (invariant 2).
            self.ref_cnt[ix(id)] = 1;
            out.push(id);
        }
        Ok(())
    }

    /// Drops one reference per id, in the order given ("the first block is evicted
    /// first"). Blocks reaching 0 are prepended to the free queue when unhashed or when
    /// caching is off (LIFO reuse), appended when hashed (LRU eviction); each group
    /// keeps the given order. Null ids are skipped.
    ///
    /// # Errors
    /// [`Error::UnknownBlock`] for an id out of range (checked for all ids first), then
    /// [`Error::DoubleFree`] for the first id whose ref count would go below 0 (an id
    /// repeated more often than its ref count included).
    pub fn free_blocks(&mut self, block_ids: &[i64]) -> Result<()> {
        self.check_ids(block_ids)?;
        self.free_ids(block_ids.iter().filter_map(|&id| u32::try_from(id).ok()))
    }

    /// Adds one reference per id; a block at ref count 0 first leaves the free queue
    /// (it becomes a prefix-cache hit). Null ids are skipped.
    ///
    /// # Errors
    /// [`Error::UnknownBlock`] for an id out of range; [`Error::InvalidArgument`] if a
    /// ref count could overflow `u32`.
    pub fn touch(&mut self, block_ids: &[i64]) -> Result<()> {
        self.check_ids(block_ids)?;
        self.touch_ids(
            block_ids.iter().filter_map(|&id| u32::try_from(id).ok()),
            block_ids.len(),
        )
    }

    /// Caches the blocks `block_ids[num_cached_blocks .. num_full_blocks]` under
    /// `block_hashes[i]` (same index) and `group_id`. `block_ids` is a request's whole
    /// block table and `block_hashes` its hash list. Null blocks are skipped; nothing
    /// happens when `num_cached_blocks >= num_full_blocks`. Caching happens whether or
    /// not `enable_caching` is set (vLLM's pool does not look at it here).
    ///
    /// # Errors
    /// Those of [`Self::cache_full_blocks_with`].
    pub fn cache_full_blocks(
        &mut self,
        block_ids: &[i64],
        block_hashes: &[BlockHash],
        num_cached_blocks: i64,
        num_full_blocks: i64,
        group_id: u32,
    ) -> Result<()> {
        self.cache_full_blocks_with(
            block_ids,
            block_hashes.len(),
            num_cached_blocks,
            num_full_blocks,
            i64::from(group_id),
            |range| Ok(block_hashes[range].to_vec()),
        )
    }

    /// [`Self::cache_full_blocks`] for a caller whose `num_hashes` hashes are not
    /// converted yet (the Python binding): once every argument is checked, and only if
    /// there is something to cache, `new_hashes(num_cached_blocks..num_full_blocks)`
    /// converts the hashes of the blocks to cache, as vLLM reads only those.
    ///
    /// # Errors
    /// In this order (the reference's): [`Error::UnknownBlock`] for any id in
    /// `block_ids`; [`Error::Negative`] (`num_cached_blocks`, then `num_full_blocks`,
    /// then `kv_cache_group_id`) and [`Error::InvalidArgument`] for a group id past
    /// `u32::MAX`; [`Error::TooManyFullBlocks`]; [`Error::TooFewHashes`]; whatever
    /// `new_hashes` returns; [`Error::AlreadyHashed`] for the first block in range that
    /// has a hash or appears twice in the range. Nothing changes on error.
    pub fn cache_full_blocks_with(
        &mut self,
        block_ids: &[i64],
        num_hashes: usize,
        num_cached_blocks: i64,
        num_full_blocks: i64,
        kv_cache_group_id: i64,
        new_hashes: impl FnOnce(Range<usize>) -> Result<Vec<BlockHash>>,
    ) -> Result<()> {
        self.check_ids(block_ids)?;
        let num_cached = non_negative("num_cached_blocks", num_cached_blocks)?;
        let num_full = non_negative("num_full_blocks", num_full_blocks)?;
        let group = group_id("kv_cache_group_id", kv_cache_group_id)?;
        if num_full > block_ids.len() {
            return Err(Error::TooManyFullBlocks {
                num_full_blocks: num_full,
                num_block_ids: block_ids.len(),
            });
        }
        if num_hashes < num_full {
            return Err(Error::TooFewHashes {
                needed: num_full,
                got: num_hashes,
            });
        }
        if num_cached >= num_full {
            return Ok(());
        }
        let hashes = new_hashes(num_cached..num_full)?;
        if hashes.len() != num_full - num_cached {
            return Err(Error::TooFewHashes {
                needed: num_full,
                got: num_cached + hashes.len(),
            });
        }
        // Every id was checked above, so none is dropped here.
        let blocks: Vec<u32> = block_ids[num_cached..num_full]
            .iter()
            .filter_map(|&id| u32::try_from(id).ok())
            .collect();
        self.cache_ids(&blocks, &hashes, group)
    }

    /// One block per group id cached under `block_hash` (the earliest-inserted one for
    /// duplicates), or `None` if any group misses. Changes nothing.
    pub fn get_cached_block(&self, block_hash: &BlockHash, group_ids: &[u32]) -> Option<Vec<u32>> {
        self.prefix.first_in_groups(block_hash, group_ids)
    }

    /// The longest prefix of a hash chain cached under `group_id`: the earliest-inserted
    /// block of each hash, stopping at the first miss (the hashes are chained, so nothing
    /// later can hit), as vLLM's `find_longest_cache_hit`. Hashes are pulled lazily, so a
    /// caller converting them pays only for those looked up; the first conversion error
    /// is returned as it is. Changes nothing.
    ///
    /// # Errors
    /// Whatever the `hashes` iterator yields as an error.
    pub fn find_longest_cache_hit<E>(
        &self,
        hashes: impl IntoIterator<Item = std::result::Result<BlockHash, E>>,
        group_id: u32,
    ) -> std::result::Result<Vec<u32>, E> {
        let mut hits = Vec::new();
        for hash in hashes {
            match self.prefix.first(&hash?, group_id) {
                Some(block) => hits.push(block),
                None => break,
            }
        }
        Ok(hits)
    }

    /// Removes the given blocks' hashes from the prefix cache. Ref counts and free-queue
    /// positions are unchanged; null and uncached ids are skipped. Returns the
    /// (hash, group id) keys removed, in input order.
    ///
    /// # Errors
    /// [`Error::UnknownBlock`] for an id out of range.
    pub fn evict_blocks(&mut self, block_ids: &[i64]) -> Result<Vec<(BlockHash, u32)>> {
        self.check_ids(block_ids)?;
        let mut removed = Vec::new();
        for id in block_ids.iter().filter_map(|&id| u32::try_from(id).ok()) {
            if id != NULL_BLOCK_ID {
                self.evict_cached(id, Some(&mut removed));
            }
        }
        Ok(removed)
    }

    /// Drops every hash if no block is in use and returns true; otherwise returns false
    /// and changes nothing. The free-queue order is kept.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if ix(self.num_blocks) - self.free_queue.len() != 1 {
            return false;
        }
        self.prefix.clear();
        self.partial.clear();
        self.events.record_cleared();
        true
    }

    /// Starts recording KV cache events (see the module docs).
    pub fn enable_events(&mut self, config: EventConfig) {
        self.events.enable(config);
    }

    /// The KV cache events recorded since the last [`BlockPool::clear_events`].
    pub fn events(&self) -> &EventLog {
        &self.events
    }

    /// Drops the recorded events (after they were taken), keeping their buffers.
    pub fn clear_events(&mut self) {
        self.events.clear();
    }

    /// A snapshot of block `block_id`.
    ///
    /// # Errors
    /// [`Error::UnknownBlock`] for an id out of range.
    pub fn block(&self, block_id: i64) -> Result<BlockInfo> {
        let id = self.check_id(block_id)?;
        let key = self.prefix.key_of(id);
        Ok(BlockInfo {
            block_id: id,
            ref_cnt: self.ref_cnt[ix(id)],
            block_hash: key.map(|(h, _)| *h),
            group_id: key.map(|(_, g)| g),
            is_null: id == NULL_BLOCK_ID,
        })
    }

    /// The free queue, head (next to be allocated) first.
    pub fn free_block_ids(&self) -> Vec<u32> {
        self.free_queue.iter().collect()
    }

    /// Every cached block as (block id, hash, group id), in block id order.
    pub fn cached_blocks(&self) -> Vec<(u32, BlockHash, u32)> {
        self.prefix.cached().map(|(b, h, g)| (b, *h, g)).collect()
    }

    /// The number of distinct (hash, group id) keys in the prefix cache.
    pub fn num_cached_keys(&self) -> usize {
        self.prefix.num_keys()
    }

    /// Heap bytes held by the pool. With every block cached under a distinct hash this
    /// stays below 100 bytes per block (measured by a counting allocator in `tests/memory.rs`).
    pub fn heap_bytes(&self) -> usize {
        (self.ref_cnt.capacity() + self.scratch.capacity()) * std::mem::size_of::<u32>()
            + self.free_queue.heap_bytes()
            + self.prefix.heap_bytes()
            + self.partial.heap_bytes()
            + self.events.heap_bytes()
    }

    /// Walks every structure and reports the first broken rule.
    ///
    /// # Errors
    /// [`Error::Invariant`] naming the rule.
    pub fn check_invariants(&self) -> Result<()> {
        let fail = |msg: String| Err(Error::Invariant(msg));
        let null = ix(NULL_BLOCK_ID);
        if self.ref_cnt[null] != 0 {
            return fail(format!("null block has ref count {}", self.ref_cnt[null]));
        }
        if self.free_queue.contains(NULL_BLOCK_ID) {
            return fail("null block is in the free queue".to_owned());
        }
        if self.prefix.is_cached(NULL_BLOCK_ID) {
            return fail("null block has a hash".to_owned());
        }
        if let Err(e) = self.free_queue.check() {
            return fail(format!("free queue: {e}"));
        }
        for (id, &rc) in (0u32..).zip(&self.ref_cnt).skip(1) {
            if (rc == 0) != self.free_queue.contains(id) {
                return fail(format!(
                    "block {id} has ref count {rc} but is{} in the free queue",
                    if rc == 0 { " not" } else { "" }
                ));
            }
        }
        if let Err(e) = self.prefix.check() {
            return fail(format!("prefix cache: {e}"));
        }
        for (id, secondary) in self.partial.blocks() {
            let Some((hash, group)) = self.prefix.key_of(id) else {
                return fail(format!("block {id} has partial entries but no hash"));
            };
            let primary = (*hash, group);
            for (i, key) in secondary.iter().enumerate() {
                if *key == primary || secondary[..i].contains(key) {
                    return fail(format!("block {id} has a secondary key twice"));
                }
            }
        }
        Ok(())
    }

    /// Checks request block tables against the ref counts: each non-null entry is one
    /// reference, so a block's ref count is at least the number of entries naming it.
    ///
    /// # Errors
    /// [`Error::Invariant`] for an entry past the pool or a block referenced fewer
    /// times than tables name it.
    pub(crate) fn check_table_references<'a>(
        &self,
        tables: impl IntoIterator<Item = (&'a str, &'a [u32])>,
    ) -> Result<()> {
        let mut holders = vec![0u32; ix(self.num_blocks)];
        for (id, table) in tables {
            for &block in table.iter().filter(|&&b| b != NULL_BLOCK_ID) {
                let Some(count) = holders.get_mut(ix(block)) else {
                    return Err(Error::Invariant(format!(
                        "request {id} holds unknown block {block}"
                    )));
                };
                *count += 1;
            }
        }
        for (block, &count) in (0u32..).zip(&holders) {
            if self.ref_cnt_of(block) < count {
                return Err(Error::Invariant(format!(
                    "block {block} is in {count} block tables but has ref count {}",
                    self.ref_cnt_of(block)
                )));
            }
        }
        Ok(())
    }

    /// The ref count of block `id` (trusted id).
    pub(crate) fn ref_cnt_of(&self, id: u32) -> u32 {
        self.ref_cnt[ix(id)]
    }

    /// [`BlockPool::touch`] on ids known to be in range.
    pub(crate) fn touch_ids<I>(&mut self, ids: I, count: usize) -> Result<()>
    where
        I: Iterator<Item = u32> + Clone,
    {
        // Each id is touched at most `count` times in this call, so a ref count at or
        // below this headroom cannot overflow.
        let headroom = u32::MAX - u32::try_from(count).unwrap_or(u32::MAX);
        if let Some(id) = ids.clone().find(|&id| self.ref_cnt[ix(id)] > headroom) {
            return Err(Error::InvalidArgument(format!(
                "block {id} ref count would overflow"
            )));
        }
        for id in ids {
            if id == NULL_BLOCK_ID {
                continue;
            }
            let rc = &mut self.ref_cnt[ix(id)];
            if *rc == 0 {
                let removed = self.free_queue.remove(id);
                // Invariant: a non-null block with ref count 0 is queued.
                debug_assert!(removed, "block {id} has ref count 0 but is not free");
            }
            *rc += 1;
        }
        Ok(())
    }

    /// [`BlockPool::free_blocks`] on ids known to be in range.
    pub(crate) fn free_ids<I>(&mut self, ids: I) -> Result<()>
    where
        I: Iterator<Item = u32> + Clone,
    {
        // Validate by decrementing tentatively, then restore: this catches ids repeated
        // more often than their ref count without a per-call map.
        let mut done = 0usize;
        let mut failed = None;
        for id in ids.clone() {
            if id != NULL_BLOCK_ID {
                let rc = &mut self.ref_cnt[ix(id)];
                if *rc == 0 {
                    failed = Some(id);
                    break;
                }
                *rc -= 1;
            }
            done += 1;
        }
        for id in ids.clone().take(done) {
            if id != NULL_BLOCK_ID {
                self.ref_cnt[ix(id)] += 1;
            }
        }
        if let Some(block_id) = failed {
            return Err(Error::DoubleFree { block_id });
        }
        let mut evict_first = std::mem::take(&mut self.scratch);
        evict_first.clear();
        for id in ids {
            if id == NULL_BLOCK_ID {
                continue;
            }
            let rc = &mut self.ref_cnt[ix(id)];
            *rc -= 1;
            if *rc == 0 {
                if self.enable_caching && self.prefix.is_cached(id) {
                    let pushed = self.free_queue.push_back(id);
                    debug_assert!(pushed, "block {id} was in use, so not queued");
                } else {
                    evict_first.push(id);
                }
            }
        }
        let pushed = self.free_queue.push_front_run(&evict_first);
        debug_assert!(pushed, "blocks just freed were not queued");
        self.scratch = evict_first;
        Ok(())
    }

    /// Caches `blocks[i]` under (`hashes[i]`, `group`) for ids known to be in range.
    /// Null blocks are skipped.
    ///
    /// # Errors
    /// [`Error::AlreadyHashed`] for the first block that has a hash (or repeats); the
    /// blocks inserted before it are removed again, so nothing changes.
    pub(crate) fn cache_ids(
        &mut self,
        blocks: &[u32],
        hashes: &[BlockHash],
        group: u32,
    ) -> Result<()> {
        for (done, (&id, hash)) in blocks.iter().zip(hashes).enumerate() {
            if id != NULL_BLOCK_ID && !self.prefix.insert(id, hash, group) {
                // Undo in reverse, so the per-key lists and interner slots are restored.
                for &undo in blocks[..done].iter().rev() {
                    if undo != NULL_BLOCK_ID {
                        self.prefix.remove(undo);
                    }
                }
                return Err(Error::AlreadyHashed { block_id: id });
            }
        }
        Ok(())
    }

    /// The event log, for the manager to record the `BlockStored` of what it caches.
    pub(crate) fn events_mut(&mut self) -> &mut EventLog {
        &mut self.events
    }

    /// vLLM's `cache_full_blocks` insertions in vLLM's order of effects, for the
    /// hybrid manager: a block whose primary key is a partial entry first loses its
    /// keys, each recorded as removed (vLLM's promotion). Null blocks are skipped.
    ///
    /// # Errors
    /// [`Error::AlreadyHashed`] for a block with a full key, where vLLM's assertion
    /// fails: the blocks before it stay cached, as in vLLM.
    pub(crate) fn cache_ids_promoting(
        &mut self,
        blocks: &[u32],
        hashes: &[BlockHash],
        group: u32,
    ) -> Result<()> {
        for (&id, hash) in blocks.iter().zip(hashes) {
            if id == NULL_BLOCK_ID {
                continue;
            }
            if self.prefix.is_cached(id) && self.partial.primary_tokens(id).is_some() {
                self.evict_cached(id, None);
            }
            if !self.prefix.insert(id, hash, group) {
                return Err(Error::AlreadyHashed { block_id: id });
            }
        }
        Ok(())
    }

    /// vLLM's `cache_partial_block` (without replacement) on a trusted non-null block:
    /// registers `key` for the prefix of `tokens` tokens ending inside block `id`.
    /// A block without a hash takes it as its primary key; one whose primary key is a
    /// shorter partial entry loses its keys first (each recorded as removed); one with
    /// a longer key keeps it and adds `key` beside it. Returns whether the block did
    /// not have `key` yet (vLLM then records a `BlockStored` for it).
    pub(crate) fn cache_partial_key(&mut self, id: u32, key: Key, tokens: i64) -> bool {
        let (hash, group) = key;
        let primary = self.prefix.key_of(id).map(|(h, g)| (*h, g));
        if primary == Some(key) || self.partial.has_secondary(id, &key) {
            return false;
        }
        if primary.is_some() && self.partial.primary_tokens(id).is_some_and(|t| t < tokens) {
            self.evict_cached(id, None);
        }
        if self.prefix.is_cached(id) {
            self.partial.add_secondary(id, key);
        } else if self.prefix.insert(id, &hash, group) {
            self.partial.set_primary_tokens(id, tokens);
        }
        true
    }

    /// The prefix length block `id`'s primary key stands for when it is a partial
    /// entry (vLLM's `block_hash_num_tokens`; a full key's is the block's end).
    pub(crate) fn partial_hash_tokens(&self, id: u32) -> Option<i64> {
        self.partial.primary_tokens(id)
    }

    /// Drops block `id`'s (trusted) prefix-cache keys, its primary key first, records
    /// a `BlockRemoved` per key and appends the keys to `removed` (vLLM's
    /// `_maybe_evict_cached_block`).
    fn evict_cached(&mut self, id: u32, mut removed: Option<&mut Vec<Key>>) {
        // Partial entries exist only beside a primary key.
        let Some(primary) = self.prefix.remove(id) else {
            return;
        };
        let secondary = if self.partial.is_empty() {
            Vec::new()
        } else {
            self.partial.take(id)
        };
        for (hash, group) in std::iter::once(primary).chain(secondary) {
            if let Some(config) = self.events.config() {
                // Only the router-grade option needs the lookup.
                let still_cached = config.last_copy_removal
                    && (self.prefix.first(&hash, group).is_some()
                        || self.partial.any_secondary(&(hash, group)));
                self.events.record_removed(hash, group, still_cached);
            }
            if let Some(out) = removed.as_deref_mut() {
                out.push((hash, group));
            }
        }
    }

    /// Whether block `id` is cached under some key (false for an id out of range).
    pub fn block_is_cached(&self, id: u32) -> bool {
        self.prefix.is_cached(id)
    }

    /// `id` as a block id of this pool.
    ///
    /// # Errors
    /// [`Error::UnknownBlock`] for an id outside `0 .. num_blocks`.
    pub fn check_id(&self, id: i64) -> Result<u32> {
        u32::try_from(id)
            .ok()
            .filter(|&b| b < self.num_blocks)
            .ok_or(Error::UnknownBlock {
                block_id: id,
                num_blocks: ix(self.num_blocks),
            })
    }

    fn check_ids(&self, ids: &[i64]) -> Result<()> {
        ids.iter().try_for_each(|&id| self.check_id(id).map(drop))
    }
}

/// [`BlockPool::check_invariants`] against one broken private field at a time: each
/// rule it names must be caught as [`Error::Invariant`], or a corrupted pool would pass.
#[cfg(test)]
pub(crate) mod corruption_tests {
    use super::*;
    use crate::free_queue::corruption_tests::overstate_len;
    use crate::prefix_map::corruption_tests::overstate_num_cached;

    /// Overwrites block `id`'s ref count, for the manager's checker tests.
    pub(crate) fn set_ref_cnt(pool: &mut BlockPool, id: u32, rc: u32) {
        pool.ref_cnt[ix(id)] = rc;
    }

    fn h(b: u8) -> BlockHash {
        BlockHash::new(&[b; 32]).unwrap()
    }

    /// 8 blocks: 1 and 3 in use, 1 and 2 cached, 2 freed (queued at the tail, still
    /// cached), 4 to 7 never used. Checked valid before any corruption.
    fn valid_pool() -> BlockPool {
        let mut pool = BlockPool::new(8, true).unwrap();
        assert_eq!(pool.get_new_blocks(3).unwrap(), [1, 2, 3]);
        pool.cache_full_blocks(&[1, 2, 3], &[h(1), h(2)], 0, 2, 0)
            .unwrap();
        pool.free_blocks(&[2]).unwrap();
        assert_eq!(pool.free_block_ids(), [4, 5, 6, 7, 2]);
        pool.check_invariants().unwrap();
        pool
    }

    fn assert_caught(pool: &BlockPool, fragment: &str) {
        match pool.check_invariants() {
            Err(Error::Invariant(msg)) => {
                assert!(msg.contains(fragment), "{msg:?} does not name {fragment:?}");
            }
            other => panic!("expected an invariant error naming {fragment:?}, got {other:?}"),
        }
    }

    #[test]
    fn partial_entries_of_an_uncached_block() {
        let mut pool = valid_pool();
        pool.partial.add_secondary(3, (h(9), 0));
        assert_caught(&pool, "block 3 has partial entries but no hash");
        let mut pool = valid_pool();
        pool.partial.set_primary_tokens(4, 12);
        assert_caught(&pool, "block 4 has partial entries but no hash");
    }

    #[test]
    fn secondary_key_repeated() {
        let mut pool = valid_pool();
        pool.partial.add_secondary(1, (h(1), 0));
        assert_caught(&pool, "block 1 has a secondary key twice");
        let mut pool = valid_pool();
        assert!(pool.cache_partial_key(1, (h(9), 0), 12));
        assert!(!pool.cache_partial_key(1, (h(9), 0), 12), "already keyed");
        pool.check_invariants().unwrap();
        pool.partial.add_secondary(1, (h(9), 0));
        assert_caught(&pool, "block 1 has a secondary key twice");
    }

    #[test]
    fn null_block_with_a_ref_count() {
        let mut pool = valid_pool();
        set_ref_cnt(&mut pool, NULL_BLOCK_ID, 1);
        assert_caught(&pool, "null block has ref count 1");
    }

    #[test]
    fn null_block_in_the_free_queue() {
        let mut pool = valid_pool();
        assert!(pool.free_queue.push_front(NULL_BLOCK_ID));
        assert_caught(&pool, "null block is in the free queue");
    }

    #[test]
    fn null_block_cached() {
        let mut pool = valid_pool();
        assert!(pool.prefix.insert(NULL_BLOCK_ID, &h(9), 0));
        assert_caught(&pool, "null block has a hash");
    }

    #[test]
    fn free_queue_broken() {
        let mut pool = valid_pool();
        overstate_len(&mut pool.free_queue);
        assert_caught(&pool, "free queue: the list has 5 blocks but len is 6");
    }

    #[test]
    fn queued_block_with_a_ref_count() {
        let mut pool = valid_pool();
        set_ref_cnt(&mut pool, 4, 1);
        assert_caught(&pool, "block 4 has ref count 1 but is in the free queue");
    }

    #[test]
    fn block_in_use_dropped_to_ref_count_zero() {
        let mut pool = valid_pool();
        set_ref_cnt(&mut pool, 1, 0);
        assert_caught(
            &pool,
            "block 1 has ref count 0 but is not in the free queue",
        );
    }

    #[test]
    fn free_block_missing_from_the_free_queue() {
        let mut pool = valid_pool();
        assert!(pool.free_queue.remove(2));
        assert_caught(
            &pool,
            "block 2 has ref count 0 but is not in the free queue",
        );
    }

    #[test]
    fn prefix_cache_broken() {
        let mut pool = valid_pool();
        overstate_num_cached(&mut pool.prefix);
        assert_caught(
            &pool,
            "prefix cache: 2 blocks are cached but the count says 3",
        );
    }
}
