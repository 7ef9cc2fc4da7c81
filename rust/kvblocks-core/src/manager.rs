//! The request-level KV cache manager for one full-attention group: vLLM 0.33.0's
//! `KVCacheManager` with a `UnitaryKVCacheCoordinator` and one `FullAttentionManager`.
//!
//! A request's block table is a `Vec<u32>` owned here, keyed by request id. Requests
//! are read through a [`RequestView`], whose block hashes come from a [`HashSource`]
//! asked only for the hashes a call needs, so a binding never converts a whole hash
//! list per step.
//!
//! With KV cache events enabled ([`KVCacheManager::enable_kv_cache_events`]) each
//! caching step records one `BlockStored` with the request's token ids for the blocks
//! it caches, read through the hash source's [`TokenSource`](crate::request::TokenSource) (only then: callers
//! without events never provide tokens); the pool records the removals.
//!
//! Every method validates first and mutates after: an `Err` (and an `Ok(None)` from
//! [`KVCacheManager::allocate_slots`]) means nothing changed.
//!
//! Counts are vLLM's: signed token counts, summed and capped as vLLM sums and caps
//! them, and turned into block counts with vLLM's floor and ceiling divisions. An
//! argument outside the documented domain is refused with the documented error.
//! (vLLM's scheduler gets the [`crate::hybrid`] manager, which does with such
//! arguments what vLLM does.)
//!
//! Invariants (checked by [`KVCacheManager::check_invariants`]):
//! * the pool's own invariants hold;
//! * tables never hold the null block, and each table entry is one reference: a
//!   block's ref count is at least the number of table entries naming it;
//! * a request's cached-block count never exceeds its table length.

use std::ops::Range;

use rustc_hash::FxHashMap;

use crate::block_hash::BlockHash;
use crate::error::{non_negative, positive, Error, Result};
use crate::events::{EventConfig, EventLog};
use crate::pool::{BlockPool, NULL_BLOCK_ID};
use crate::request::{HashSource, RequestView};

/// The KV cache group id of the single full-attention group.
const GROUP_ID: u32 = 0;

/// The optional arguments of [`KVCacheManager::allocate_slots`], vLLM's defaults
/// being `Default::default()` (with `num_new_tokens` set by the caller).
#[derive(Debug, Clone, Copy, Default)]
pub struct SlotRequest<'a> {
    /// Tokens to compute in this step.
    pub num_new_tokens: i64,
    /// Tokens newly found in the local prefix cache (`new_computed_blocks` hold them).
    pub num_new_computed_tokens: i64,
    /// The prefix-cache hits from [`KVCacheManager::get_computed_blocks`].
    pub new_computed_blocks: &'a [i64],
    /// Extra slots for speculative tokens.
    pub num_lookahead_tokens: i64,
    /// Tokens a KV connector will load.
    pub num_external_computed_tokens: i64,
    /// Skip caching the full blocks (an asynchronous KV load is pending).
    pub delay_cache_blocks: bool,
}

/// Prefix-cache counters since the last [`KVCacheManager::make_prefix_cache_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Whether the prefix cache was reset meanwhile.
    pub reset: bool,
    /// Requests recorded (not preempted before).
    pub requests: i64,
    /// Tokens looked up.
    pub queries: i64,
    /// Tokens found cached.
    pub hits: i64,
}

/// `allocate_slots` with nothing to place (vLLM's message).
const NOTHING_TO_PLACE: &str =
    "num_new_tokens must be greater than 0 when there are no computed tokens to adopt";

/// The token layout of one `allocate_slots` call, in vLLM's arithmetic.
#[derive(Debug, Clone, Copy)]
struct SlotCounts {
    /// The request's tokens.
    num_tokens: i64,
    /// Tokens a KV connector loads.
    num_external: i64,
    /// Computed + new computed + external, capped at `max_model_len`.
    total_computed: i64,
    /// `total_computed` + new tokens.
    main_tokens: i64,
    /// Blocks the table needs to hold the slots (lookahead included).
    required: usize,
}

/// vLLM's `cdiv(tokens, block_size)` as a block count: none for `tokens <= 0`.
fn blocks_for(tokens: i64, block_size: usize) -> usize {
    usize::try_from(tokens).map_or(0, |t| t.div_ceil(block_size))
}

/// A token count as vLLM's signed int (counts here never reach `i64::MAX`).
fn signed(tokens: usize) -> i64 {
    i64::try_from(tokens).unwrap_or(i64::MAX)
}

/// A checked caching step: which blocks of the table to cache, their hashes, and the
/// data of its `BlockStored` when events are on.
struct CachePlan {
    /// Block indices in the request's table.
    range: Range<usize>,
    hashes: Vec<BlockHash>,
    /// `(parent hash, token ids)` when events are on.
    event: Option<(Option<BlockHash>, Vec<i64>)>,
}

/// One request's state (vLLM's `req_to_blocks` and `num_cached_block` entries).
#[derive(Debug, Clone, Default)]
struct RequestBlocks {
    /// The block table, in token order.
    blocks: Vec<u32>,
    /// Leading blocks already cached; `None` while vLLM has no `num_cached_block`
    /// entry, which makes the request count as new for computed-block adoption.
    num_cached: Option<usize>,
}

/// vLLM 0.33.0's `KVCacheManager` for one full-attention KV cache group.
#[derive(Debug, Clone)]
pub struct KVCacheManager {
    pool: BlockPool,
    block_size: usize,
    max_model_len: Option<usize>,
    /// `Some` iff stats are logged.
    stats: Option<PrefixCacheStats>,
    requests: FxHashMap<String, RequestBlocks>,
}

impl KVCacheManager {
    /// A manager over a fresh pool of `num_blocks` blocks of `block_size` tokens.
    ///
    /// # Errors
    /// [`Error::NonPositive`] for `num_blocks`, `block_size` or `max_model_len` <= 0;
    /// pool construction errors.
    pub fn new(
        num_blocks: i64,
        block_size: i64,
        enable_caching: bool,
        max_model_len: Option<i64>,
        log_stats: bool,
    ) -> Result<Self> {
        positive("num_blocks", num_blocks)?;
        let block_size = positive("block_size", block_size)?;
        let max_model_len = max_model_len
            .map(|m| positive("max_model_len", m))
            .transpose()?;
        Ok(Self {
            pool: BlockPool::new(num_blocks, enable_caching)?,
            block_size,
            max_model_len,
            stats: log_stats.then(PrefixCacheStats::default),
            requests: FxHashMap::default(),
        })
    }

    /// Starts recording KV cache events: the pool's removals and clears, and one
    /// `BlockStored` per caching step. With `last_copy_removal` (router-grade, off in
    /// vLLM) a removal is recorded only when the last block cached under its hash goes.
    pub fn enable_kv_cache_events(&mut self, last_copy_removal: bool) {
        self.pool.enable_events(EventConfig {
            block_size: self.block_size,
            last_copy_removal,
        });
    }

    /// The KV cache events recorded since the last [`KVCacheManager::clear_events`].
    pub fn events(&self) -> &EventLog {
        self.pool.events()
    }

    /// Drops the recorded events (after they were taken), keeping their buffers.
    pub fn clear_events(&mut self) {
        self.pool.clear_events();
    }

    /// The block pool.
    pub fn block_pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The block pool, mutably. Holding references the manager does not know about
    /// (e.g. touching blocks) is allowed; freeing blocks a request table still holds
    /// makes a later [`KVCacheManager::free`] of that request fail.
    pub fn block_pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The maximum model length, if one was given.
    pub fn max_model_len(&self) -> Option<usize> {
        self.max_model_len
    }

    /// Whether prefix caching is enabled.
    pub fn enable_caching(&self) -> bool {
        self.pool.enable_caching()
    }

    /// Whether prefix-cache stats are logged.
    pub fn log_stats(&self) -> bool {
        self.stats.is_some()
    }

    /// Always 1: one full-attention group.
    pub fn num_kv_cache_groups(&self) -> usize {
        1
    }

    /// The number of requests holding a block table.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// The pool's usage, `1 - free / (num_blocks - 1)`.
    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// The longest chain of cached block hashes from block 0, capped so that the last
    /// token is always recomputed: `(block ids, hit tokens)`. Touches nothing.
    ///
    /// # Errors
    /// [`Error::Negative`] (`num_tokens`); errors of the request's [`HashSource`].
    pub fn get_computed_blocks<H: HashSource + ?Sized>(
        &self,
        request: &RequestView<'_, H>,
    ) -> Result<(Vec<u32>, usize)> {
        let num_tokens = non_negative("num_tokens", request.num_tokens)?;
        if !self.pool.enable_caching() {
            return Ok((Vec::new(), 0));
        }
        let max_tokens = num_tokens.saturating_sub(1);
        let max_blocks = (max_tokens / self.block_size).min(request.block_hashes.num_hashes());
        // One hash at a time: the scan stops at the first miss, and a hash past it is
        // neither converted nor validated (as vLLM, which never reads it).
        let hashes = (0..max_blocks).map(|i| request.block_hashes.hash(i));
        let hits = self.pool.find_longest_cache_hit(hashes, GROUP_ID)?;
        let hit_tokens = hits.len() * self.block_size;
        Ok((hits, hit_tokens))
    }

    /// vLLM's `allocate_slots`: adopts the prefix-cache hits (touching them), allocates
    /// blocks for external and new tokens, and caches the request's full blocks unless
    /// `delay_cache_blocks`. Returns only the newly allocated block ids (not the hits),
    /// or `None` when they do not fit, in which case nothing changed.
    ///
    /// # Errors
    /// [`Error::Negative`] for a negative count (the request's too);
    /// [`Error::InvalidArgument`] when there are no tokens at all to place, or computed
    /// blocks are given to a request that cannot adopt them (it already holds blocks,
    /// or caching is off), or they include the null block; [`Error::UnknownBlock`] for
    /// a computed block out of range; [`Error::AlreadyHashed`] if a block to be cached
    /// was hashed behind the manager's back; errors of the [`HashSource`].
    pub fn allocate_slots<H: HashSource + ?Sized>(
        &mut self,
        request: &RequestView<'_, H>,
        args: &SlotRequest<'_>,
    ) -> Result<Option<Vec<u32>>> {
        let counts = self.slot_counts(request, args)?;
        let hits = self.check_hits(args.new_computed_blocks)?;
        let id = request.request_id;
        let state = self.requests.get(id);
        // vLLM asserts against adopting only after its capacity checks, which may
        // return None first; the library refuses before.
        let adopts = self.check_adoption(id, state, &hits, counts.num_external > 0)?;
        let held = state.map_or(0, |s| s.blocks.len());
        let required = counts.required;
        if self.blocks_to_take(held, &hits)(required) > self.pool.num_free_blocks() {
            return Ok(None);
        }

        // Everything the caching step needs is fetched and checked before mutating.
        // An adopting request holds nothing yet, another adopts no hits.
        let table_len = (held + hits.len()).max(required);
        let caches = self.pool.enable_caching() && !args.delay_cache_blocks;
        let cache_tokens = usize::try_from(counts.main_tokens.min(counts.num_tokens)).unwrap_or(0);
        let cache_plan = if caches {
            let num_cached = if adopts {
                hits.len()
            } else {
                state.and_then(|s| s.num_cached).unwrap_or(0)
            };
            self.plan_caching(
                request,
                state.map_or(&[][..], |s| &s.blocks),
                num_cached,
                cache_tokens,
                table_len,
            )?
        } else {
            None
        };
        if adopts {
            self.pool.touch_ids(hits.iter().copied(), hits.len())?;
        }

        // Validation done: from here on nothing can fail. (Look up before inserting, so
        // a running request's step does not allocate a key string.)
        if !self.requests.contains_key(id) {
            self.requests
                .insert(id.to_owned(), RequestBlocks::default());
        }
        let Some(entry) = self.requests.get_mut(id) else {
            return Err(Error::Invariant(format!("request {id} vanished")));
        };
        if adopts {
            entry.blocks.extend_from_slice(&hits);
            entry.num_cached = Some(entry.blocks.len());
            if counts.num_external > 0 {
                let n = blocks_for(counts.total_computed, self.block_size)
                    .saturating_sub(entry.blocks.len());
                self.pool.get_new_blocks_into(n, &mut entry.blocks)?;
            }
        }
        let first_new = entry.blocks.len();
        self.pool
            .get_new_blocks_into(required.saturating_sub(first_new), &mut entry.blocks)?;
        let allocated = entry.blocks[first_new..].to_vec();
        if let Some(plan) = cache_plan {
            // The plan never reaches past the table (`table_len` is its final length).
            let Some(blocks) = entry.blocks.get(plan.range.clone()) else {
                return Err(Error::Invariant(format!(
                    "request {id}: cache range past its table"
                )));
            };
            self.pool.cache_ids(blocks, &plan.hashes, GROUP_ID)?;
            entry.num_cached = Some(plan.range.end);
            Self::record_stored(self.pool.events_mut(), &plan);
        }
        Ok(Some(allocated))
    }

    /// Caches the request's full blocks covering its first `num_computed_tokens`
    /// tokens (vLLM's `cache_blocks`). A no-op with caching off, and for a count that
    /// covers no block beyond those cached. Blocks past the request's hashes are not
    /// full yet.
    ///
    /// # Errors
    /// [`Error::Negative`]; [`Error::TooManyFullBlocks`] when those tokens reach past
    /// the request's block table; [`Error::AlreadyHashed`] if a block was hashed
    /// behind the manager's back; errors of the [`HashSource`].
    pub fn cache_blocks<H: HashSource + ?Sized>(
        &mut self,
        request: &RequestView<'_, H>,
        num_computed_tokens: i64,
    ) -> Result<()> {
        let num_computed_tokens = non_negative("num_computed_tokens", num_computed_tokens)?;
        if !self.pool.enable_caching() {
            return Ok(());
        }
        let state = self.requests.get(request.request_id);
        let blocks = state.map_or(&[][..], |s| &s.blocks);
        let num_cached = state.and_then(|s| s.num_cached).unwrap_or(0);
        let full = (num_computed_tokens / self.block_size).min(request.block_hashes.num_hashes());
        if num_cached >= full {
            return Ok(());
        }
        if full > blocks.len() {
            return Err(Error::TooManyFullBlocks {
                num_full_blocks: full,
                num_block_ids: blocks.len(),
            });
        }
        let tokens = full.saturating_mul(self.block_size);
        let plan = self.plan_caching(request, blocks, num_cached, tokens, blocks.len())?;
        if let Some(plan) = &plan {
            let Some(to_cache) = blocks.get(plan.range.clone()) else {
                return Err(Error::TooManyFullBlocks {
                    num_full_blocks: plan.range.end,
                    num_block_ids: blocks.len(),
                });
            };
            self.pool.cache_ids(to_cache, &plan.hashes, GROUP_ID)?;
            Self::record_stored(self.pool.events_mut(), plan);
        }
        // vLLM records the count even for a request it does not know yet.
        if let Some(entry) = self.requests.get_mut(request.request_id) {
            entry.num_cached = Some(full);
        } else {
            let entry = RequestBlocks {
                blocks: Vec::new(),
                num_cached: Some(full),
            };
            self.requests.insert(request.request_id.to_owned(), entry);
        }
        Ok(())
    }

    /// Frees the request's blocks, tail first (so a chain's tail is evicted before its
    /// parents). Unknown requests are a no-op.
    ///
    /// # Errors
    /// [`Error::DoubleFree`] if blocks of the table were freed behind the manager's
    /// back; the request then keeps its table.
    pub fn free(&mut self, request_id: &str) -> Result<()> {
        let Some((key, state)) = self.requests.remove_entry(request_id) else {
            return Ok(());
        };
        if let Err(e) = self.pool.free_ids(state.blocks.iter().rev().copied()) {
            self.requests.insert(key, state);
            return Err(e);
        }
        Ok(())
    }

    /// The request's block table (empty for an unknown request).
    pub fn get_block_ids(&self, request_id: &str) -> &[u32] {
        self.requests.get(request_id).map_or(&[], |s| &s.blocks)
    }

    /// Every request with its block table, in no particular order.
    pub fn block_tables(&self) -> impl Iterator<Item = (&str, &[u32])> + '_ {
        self.requests
            .iter()
            .map(|(id, s)| (id.as_str(), s.blocks.as_slice()))
    }

    /// [`BlockPool::evict_blocks`].
    ///
    /// # Errors
    /// [`Error::UnknownBlock`] for an id out of range; nothing is evicted then.
    pub fn evict_blocks(&mut self, block_ids: &[i64]) -> Result<Vec<(BlockHash, u32)>> {
        self.pool.evict_blocks(block_ids)
    }

    /// [`BlockPool::reset_prefix_cache`]; on success also marks the stats as reset.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.pool.reset_prefix_cache() {
            return false;
        }
        if let Some(stats) = &mut self.stats {
            stats.reset = true;
        }
        true
    }

    /// Records one admitted request: `queries += num_tokens`, `hits += num_hits`. A
    /// no-op (after validation) without stats logging.
    ///
    /// # Errors
    /// [`Error::Negative`] for a negative `num_hits` or token count;
    /// [`Error::InvalidArgument`] when `num_hits` exceeds the request's tokens.
    pub fn record_prefix_cache_stats<H: HashSource + ?Sized>(
        &mut self,
        request: &RequestView<'_, H>,
        num_hits: i64,
    ) -> Result<()> {
        let queries = request.num_tokens;
        non_negative("num_tokens", queries)?;
        non_negative("num_hits", num_hits)?;
        if num_hits > queries {
            return Err(Error::InvalidArgument(format!(
                "num_hits {num_hits} exceeds the request's {queries} tokens"
            )));
        }
        if let Some(stats) = &mut self.stats {
            // Saturating keeps a pathological run panic-free.
            stats.requests = stats.requests.saturating_add(1);
            stats.queries = stats.queries.saturating_add(queries);
            stats.hits = stats.hits.saturating_add(num_hits);
        }
        Ok(())
    }

    /// The stats since the last call, zeroing them; `None` without stats logging.
    pub fn make_prefix_cache_stats(&mut self) -> Option<PrefixCacheStats> {
        self.stats.as_mut().map(std::mem::take)
    }

    /// Checks the pool's invariants and the tables against it.
    ///
    /// # Errors
    /// [`Error::Invariant`] naming the first broken rule.
    pub fn check_invariants(&self) -> Result<()> {
        self.pool.check_invariants()?;
        for (id, state) in &self.requests {
            if state.num_cached.is_some_and(|c| c > state.blocks.len()) {
                return Err(Error::Invariant(format!(
                    "request {id} has more cached blocks than table entries"
                )));
            }
            if state.blocks.contains(&NULL_BLOCK_ID) {
                return Err(Error::Invariant(format!(
                    "request {id} holds the null block"
                )));
            }
        }
        self.pool.check_table_references(
            self.requests
                .iter()
                .map(|(id, s)| (id.as_str(), s.blocks.as_slice())),
        )
    }

    /// Lays out the tokens of an `allocate_slots` call as vLLM does:
    /// `| computed | new computed | external | new | lookahead |`, capped at
    /// `max_model_len`. Every count must be non-negative.
    fn slot_counts<H: HashSource + ?Sized>(
        &self,
        request: &RequestView<'_, H>,
        args: &SlotRequest<'_>,
    ) -> Result<SlotCounts> {
        non_negative("num_new_tokens", args.num_new_tokens)?;
        non_negative("num_new_computed_tokens", args.num_new_computed_tokens)?;
        non_negative("num_lookahead_tokens", args.num_lookahead_tokens)?;
        non_negative(
            "num_external_computed_tokens",
            args.num_external_computed_tokens,
        )?;
        non_negative("num_tokens", request.num_tokens)?;
        non_negative("num_computed_tokens", request.num_computed_tokens)?;
        let num_new = args.num_new_tokens;
        let num_external = args.num_external_computed_tokens;
        if num_new == 0 && num_external == 0 && args.num_new_computed_tokens == 0 {
            return Err(Error::InvalidArgument(NOTHING_TO_PLACE.to_owned()));
        }
        let cap = |n: i64| self.max_model_len.map_or(n, |m| n.min(signed(m)));
        let total_computed = cap(request
            .num_computed_tokens
            .saturating_add(args.num_new_computed_tokens)
            .saturating_add(num_external));
        let main_tokens = total_computed.saturating_add(num_new);
        let slot_tokens = cap(main_tokens.saturating_add(args.num_lookahead_tokens));
        Ok(SlotCounts {
            num_tokens: request.num_tokens,
            num_external,
            total_computed,
            main_tokens,
            required: blocks_for(slot_tokens, self.block_size),
        })
    }

    /// Whether this call adopts computed tokens (vLLM's `allocate_new_computed_blocks`
    /// for a request without a cached-block entry): it does with hits, and with none
    /// when `adopts_anyway` (external tokens). Refuses the cases vLLM asserts against:
    /// hits for a request that holds blocks or with caching off, and an adoption by a
    /// request that holds blocks but has no cached-block entry.
    fn check_adoption(
        &self,
        id: &str,
        state: Option<&RequestBlocks>,
        hits: &[u32],
        adopts_anyway: bool,
    ) -> Result<bool> {
        let held = state.map_or(0, |s| s.blocks.len());
        let known = state.is_some_and(|s| s.num_cached.is_some());
        if !hits.is_empty() && !self.pool.enable_caching() {
            return Err(Error::InvalidArgument(
                "new_computed_blocks must be empty when prefix caching is disabled".to_owned(),
            ));
        }
        let adopts = !known && (!hits.is_empty() || adopts_anyway);
        if (known && !hits.is_empty()) || (adopts && held > 0) {
            return Err(Error::InvalidArgument(format!(
                "request {id} already holds blocks, so it cannot adopt computed tokens"
            )));
        }
        Ok(adopts)
    }

    /// vLLM's `get_num_blocks_to_allocate` for one full-attention group: how many
    /// blocks giving a request that holds `held` blocks, with prefix hits `hits`
    /// (checked by [`Self::check_adoption`]), a table of `blocks` blocks takes from the
    /// pool. Touching a hit that is free takes it out of the free queue too.
    fn blocks_to_take(&self, held: usize, hits: &[u32]) -> impl Fn(usize) -> usize {
        let evictable = hits
            .iter()
            .filter(|&&b| self.pool.ref_cnt_of(b) == 0)
            .count();
        let table = held + hits.len();
        move |blocks| blocks.saturating_sub(table).saturating_add(evictable)
    }

    /// Range-checks the computed blocks and rejects the null block.
    fn check_hits(&self, ids: &[i64]) -> Result<Vec<u32>> {
        // Every id in range first, then the null check, as the reference orders them.
        let blocks = ids
            .iter()
            .map(|&id| self.pool.check_id(id))
            .collect::<Result<Vec<u32>>>()?;
        if blocks.contains(&NULL_BLOCK_ID) {
            return Err(Error::InvalidArgument(
                "new_computed_blocks must not contain the null block 0".to_owned(),
            ));
        }
        Ok(blocks)
    }

    /// Which blocks caching `num_tokens` tokens would hash, with their hashes:
    /// `None` when nothing new is full. `table` is the current table, which will have
    /// `table_len` entries when the caching happens (entries past `table` are fresh,
    /// unhashed allocations). With events on, also the parent hash and the token ids
    /// of the `BlockStored` to record.
    ///
    /// # Errors
    /// [`Error::AlreadyHashed`] for an existing block in the range that has a hash;
    /// [`Error::TooFewHashes`] if the hash source returns too few; its own errors;
    /// with events on, [`Error::InvalidArgument`] when it has no
    /// [`TokenSource`](crate::request::TokenSource), and
    /// the token source's errors.
    fn plan_caching<H: HashSource + ?Sized>(
        &self,
        request: &RequestView<'_, H>,
        table: &[u32],
        num_cached: usize,
        num_tokens: usize,
        table_len: usize,
    ) -> Result<Option<CachePlan>> {
        let num_hashes = request.block_hashes.num_hashes();
        // vLLM: min(num_tokens, len(block_hashes) * block_size) // block_size, never
        // past the table (reachable when max_model_len caps the slots).
        let full = (num_tokens / self.block_size)
            .min(num_hashes)
            .min(table_len);
        if num_cached >= full {
            return Ok(None);
        }
        if let Some(&block) = table
            .get(num_cached..full.min(table.len()))
            .and_then(|existing| existing.iter().find(|&&b| self.pool.block_is_cached(b)))
        {
            return Err(Error::AlreadyHashed { block_id: block });
        }
        let mut hashes = Vec::with_capacity(full - num_cached);
        request.block_hashes.hashes(num_cached..full, &mut hashes)?;
        if hashes.len() != full - num_cached {
            return Err(Error::TooFewHashes {
                needed: full,
                got: num_cached + hashes.len(),
            });
        }
        let event = if self.pool.events().is_enabled() {
            Some(self.stored_event_data(request, num_cached, full)?)
        } else {
            None
        };
        Ok(Some(CachePlan {
            range: num_cached..full,
            hashes,
            event,
        }))
    }

    /// The parent hash (vLLM's logical parent: the request's hash before block
    /// `num_cached`) and the token ids of blocks `num_cached .. full`, for a
    /// `BlockStored`.
    fn stored_event_data<H: HashSource + ?Sized>(
        &self,
        request: &RequestView<'_, H>,
        num_cached: usize,
        full: usize,
    ) -> Result<(Option<BlockHash>, Vec<i64>)> {
        Ok((
            request.block_hashes.parent(num_cached)?,
            request.block_tokens(num_cached..full, self.block_size)?,
        ))
    }

    /// Records the `BlockStored` of an applied caching step (events on).
    fn record_stored(events: &mut EventLog, plan: &CachePlan) {
        if let Some((parent, tokens)) = &plan.event {
            events.record_stored(&plan.hashes, *parent, tokens, plan.range.start, GROUP_ID);
        }
    }
}

/// [`KVCacheManager::check_invariants`] against one broken private field at a time:
/// each rule it names must be caught as [`Error::Invariant`], or a corrupted manager
/// would pass.
#[cfg(test)]
mod corruption_tests {
    use super::*;
    use crate::pool::corruption_tests::set_ref_cnt;

    /// 8 blocks of 4 tokens. Request `a` (8 tokens, 2 hashes) holds blocks 1 and 2,
    /// both cached; request `b` (4 tokens, no hash) holds block 3 and has no cached
    /// count.
    /// Checked valid before any corruption.
    fn valid_manager() -> KVCacheManager {
        let mut mgr = KVCacheManager::new(8, 4, true, None, false).unwrap();
        let hashes = [
            BlockHash::new(&[1; 32]).unwrap(),
            BlockHash::new(&[2; 32]).unwrap(),
        ];
        for (id, num_tokens, hashes, want) in [
            ("a", 8, &hashes[..], vec![1, 2]),
            ("b", 4, &[][..], vec![3]),
        ] {
            let request = RequestView {
                request_id: id,
                num_tokens,
                num_computed_tokens: 0,
                block_hashes: hashes,
            };
            let args = SlotRequest {
                num_new_tokens: num_tokens,
                ..SlotRequest::default()
            };
            assert_eq!(mgr.allocate_slots(&request, &args).unwrap(), Some(want));
        }
        assert_eq!(mgr.requests["a"].num_cached, Some(2));
        assert_eq!(mgr.requests["b"].num_cached, None);
        mgr.check_invariants().unwrap();
        mgr
    }

    fn table<'a>(mgr: &'a mut KVCacheManager, id: &str) -> &'a mut RequestBlocks {
        mgr.requests.get_mut(id).expect("known request")
    }

    fn assert_caught(mgr: &KVCacheManager, fragment: &str) {
        match mgr.check_invariants() {
            Err(Error::Invariant(msg)) => {
                assert!(msg.contains(fragment), "{msg:?} does not name {fragment:?}");
            }
            other => panic!("expected an invariant error naming {fragment:?}, got {other:?}"),
        }
    }

    #[test]
    fn pool_broken() {
        let mut mgr = valid_manager();
        set_ref_cnt(&mut mgr.pool, 5, 1);
        assert_caught(&mgr, "block 5 has ref count 1 but is in the free queue");
    }

    #[test]
    fn cached_count_past_the_table() {
        let mut mgr = valid_manager();
        table(&mut mgr, "a").num_cached = Some(3);
        assert_caught(&mgr, "request a has more cached blocks than table entries");
    }

    #[test]
    fn table_holds_the_null_block() {
        let mut mgr = valid_manager();
        table(&mut mgr, "b").blocks.push(NULL_BLOCK_ID);
        assert_caught(&mgr, "request b holds the null block");
    }

    #[test]
    fn table_holds_a_block_past_the_pool() {
        let mut mgr = valid_manager();
        table(&mut mgr, "b").blocks.push(99);
        assert_caught(&mgr, "request b holds unknown block 99");
    }

    /// Block 1 named by both tables but referenced once.
    #[test]
    fn table_entry_without_a_reference() {
        let mut mgr = valid_manager();
        table(&mut mgr, "b").blocks.push(1);
        assert_caught(&mgr, "block 1 is in 2 block tables but has ref count 1");
    }

    /// The pool alone stays consistent; only the table still counts the reference.
    #[test]
    fn block_freed_behind_the_managers_back() {
        let mut mgr = valid_manager();
        mgr.block_pool_mut().free_blocks(&[3]).unwrap();
        mgr.pool.check_invariants().unwrap();
        assert_caught(&mgr, "block 3 is in 1 block tables but has ref count 0");
    }
}
