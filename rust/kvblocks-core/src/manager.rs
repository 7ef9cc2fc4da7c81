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
//! them, and turned into block counts with vLLM's floor and ceiling divisions, where
//! a count at or below zero asks for no block. A [`Tolerance`] says what happens to
//! an argument outside the documented domain: the library refuses it
//! ([`Tolerance::Strict`]); vLLM's scheduler gets exactly what vLLM's own manager
//! does with it ([`Tolerance::Vllm`]): nothing where vLLM does nothing, an
//! [`Error::Assertion`] where vLLM asserts.
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

/// What the manager does with an argument outside the documented domain.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Tolerance {
    /// Refuse it with the documented error, changing nothing (the library API).
    #[default]
    Strict,
    /// Do what vLLM 0.33.0's own manager does with it (its scheduler is the caller).
    Vllm,
}

/// The rules that differ between the vLLM releases a manager can stand in for (the
/// default is the newest's); each field names one difference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReleaseRules {
    /// vLLM 0.33 on: `cache_blocks` caches no block past the request's hashed tokens.
    /// Before, it counts every full block of `num_computed_tokens` as cached, and
    /// fails indexing the hash of a table block that has none, after caching those
    /// before it.
    pub caps_caching_at_hashed_tokens: bool,
    /// vLLM 0.31: `get_num_common_prefix_blocks` counts the blocks every request with a
    /// table shares (cascade attention); later releases answer 0.
    pub counts_common_prefix_blocks: bool,
}

impl ReleaseRules {
    /// The rules of vLLM `major.minor` (0.31 to 0.33; a later one gets the newest's).
    #[must_use]
    pub fn for_vllm((major, minor): (u32, u32)) -> Self {
        Self {
            caps_caching_at_hashed_tokens: (major, minor) >= (0, 33),
            counts_common_prefix_blocks: (major, minor) <= (0, 31),
        }
    }
}

impl Default for ReleaseRules {
    fn default() -> Self {
        Self::for_vllm((0, 33))
    }
}

/// The optional arguments of [`KVCacheManager::allocate_slots`], vLLM's defaults
/// being `Default::default()` (with `num_new_tokens` set by the caller).
// One field per keyword argument of vLLM's `allocate_slots`, flags included.
#[allow(clippy::struct_excessive_bools)]
#[derive(Debug, Clone, Copy, Default)]
pub struct SlotRequest<'a> {
    /// Tokens to compute in this step.
    pub num_new_tokens: i64,
    /// Tokens newly found in the local prefix cache (`new_computed_blocks` hold them).
    pub num_new_computed_tokens: i64,
    /// The prefix-cache hits from [`KVCacheManager::get_computed_blocks`].
    pub new_computed_blocks: &'a [i64],
    /// vLLM's identity test: the caller's `new_computed_blocks` is not vLLM's shared
    /// empty result, so a request not yet known adopts them even when there are none
    /// (and is known from then on).
    pub computed_blocks_given: bool,
    /// Extra slots for speculative tokens.
    pub num_lookahead_tokens: i64,
    /// Tokens a KV connector will load.
    pub num_external_computed_tokens: i64,
    /// Skip caching the full blocks (an asynchronous KV load is pending).
    pub delay_cache_blocks: bool,
    /// Admit only if the request's whole sequence (capped at `max_model_len`) fits
    /// in the free blocks (vLLM's admission gate, on by default in its scheduler).
    pub full_sequence_must_fit: bool,
    /// Free blocks to leave to other in-flight sequences.
    pub reserved_blocks: i64,
    /// Whether other requests are already scheduled in this step.
    pub has_scheduled_reqs: bool,
    /// Whether the request is being admitted (vLLM status `WAITING` or `PREEMPTED`).
    /// The watermark applies only to admissions while others are scheduled.
    pub admitting: bool,
}

/// How a request's prefix-cache lookup is bounded (vLLM's `get_computed_blocks`
/// arguments and the request's `skip_reading_prefix_cache`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Lookup {
    /// The longest hit in tokens; `None` for `num_tokens - 1` (the last token is
    /// always recomputed).
    pub max_cache_hit_length: Option<i64>,
    /// The request may not read the prefix cache (prompt logprobs, some poolings).
    pub skip_reading_prefix_cache: bool,
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
    /// Requests recorded again after a preemption (vLLM counts them apart).
    pub preempted_requests: i64,
    /// Tokens looked up by those requests.
    pub preempted_queries: i64,
    /// Tokens those requests found cached.
    pub preempted_hits: i64,
}

/// `allocate_slots` with nothing to place (vLLM's message).
const NOTHING_TO_PLACE: &str =
    "num_new_tokens must be greater than 0 when there are no computed tokens to adopt";

/// vLLM's `int(watermark * num_blocks)`, where vLLM first asserts `watermark >= 0.0`
/// ([`Error::Assertion`], also for NaN) and `int(inf)` overflows ([`Error::Overflow`]).
///
/// # Errors
/// As said.
pub(crate) fn watermark_blocks(watermark: f64, num_blocks: u32) -> Result<usize> {
    if watermark == f64::INFINITY {
        return Err(Error::Overflow(
            "cannot convert float infinity to integer".to_owned(),
        ));
    }
    if !watermark.is_finite() || watermark < 0.0 {
        return Err(Error::Assertion(format!(
            "watermark must be a finite non-negative fraction, got {watermark}"
        )));
    }
    // Truncation toward zero is vLLM's `int()`; the product is non-negative.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    Ok((watermark * f64::from(num_blocks)) as usize)
}

/// vLLM's `block_pool.evict_blocks`: it evicts in the given order and stops at the
/// first id it refuses, the ones before it evicted. An id past the pool fails its
/// assert, and a negative one counts from the end.
///
/// # Errors
/// [`Error::Assertion`] for an id of `num_blocks` or more; [`Error::UnknownBlock`] for
/// one below `-num_blocks`.
pub(crate) fn evict_as_vllm(
    pool: &mut BlockPool,
    block_ids: &[i64],
) -> Result<Vec<(BlockHash, u32)>> {
    let n = i64::from(pool.num_blocks());
    let mut removed = Vec::new();
    for &id in block_ids {
        if id >= n {
            return Err(Error::Assertion(format!(
                "Invalid block_id {id} >= {n}. This indicates a bug in the KV connector - \
                 workers should only report block IDs that were allocated by the scheduler."
            )));
        }
        let id = if id < 0 { id.saturating_add(n) } else { id };
        removed.extend(pool.evict_blocks(&[id])?);
    }
    Ok(removed)
}

/// The token layout of one `allocate_slots` call, in vLLM's signed arithmetic.
#[derive(Debug, Clone, Copy)]
struct SlotCounts {
    /// The request's tokens.
    num_tokens: i64,
    /// Tokens a KV connector loads.
    num_external: i64,
    /// Computed + new computed + external, capped at `max_model_len`.
    total_computed: i64,
    /// Computed + new computed + external, uncapped (vLLM sizes external blocks by it).
    adopted_tokens: i64,
    /// `total_computed` + new tokens.
    main_tokens: i64,
    /// Blocks the table needs to hold the slots (lookahead included).
    required: usize,
    /// Blocks the whole sequence needs (`num_tokens`, capped at `max_model_len`).
    full_sequence: usize,
    /// Free blocks to leave to other sequences.
    reserved: i64,
}

/// vLLM's `cdiv(tokens, block_size)` as a block count: none for `tokens <= 0`.
fn blocks_for(tokens: i64, block_size: usize) -> usize {
    usize::try_from(tokens).map_or(0, |t| t.div_ceil(block_size))
}

/// vLLM's `tokens // block_size` as a block count: none for `tokens <= 0`.
fn full_blocks_in(tokens: i64, block_size: usize) -> usize {
    usize::try_from(tokens).map_or(0, |t| t / block_size)
}

/// Where Python's `items[:end]` ends in a list of `len` items: a negative `end` counts
/// from the end.
pub(crate) fn slice_end(end: i64, len: usize) -> usize {
    let len_signed = signed(len);
    let end = if end < 0 {
        len_signed.saturating_add(end)
    } else {
        end
    };
    usize::try_from(end.clamp(0, len_signed)).unwrap_or(0)
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
    /// Free blocks admissions leave untouched while other requests are scheduled.
    watermark_blocks: usize,
    tolerance: Tolerance,
    release_rules: ReleaseRules,
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
            watermark_blocks: 0,
            tolerance: Tolerance::Strict,
            release_rules: ReleaseRules::default(),
            requests: FxHashMap::default(),
        })
    }

    /// Sets the rules of the vLLM release the manager stands in for.
    pub fn set_release_rules(&mut self, rules: ReleaseRules) {
        self.release_rules = rules;
    }

    /// Sets what the manager does with arguments outside the documented domain.
    pub fn set_tolerance(&mut self, tolerance: Tolerance) {
        self.tolerance = tolerance;
    }

    /// What the manager does with arguments outside the documented domain.
    pub fn tolerance(&self) -> Tolerance {
        self.tolerance
    }

    /// Whether arguments outside the documented domain are refused.
    fn strict(&self) -> bool {
        self.tolerance == Tolerance::Strict
    }

    /// A refusal of what vLLM asserts against: [`Error::InvalidArgument`] for the
    /// library, [`Error::Assertion`] (vLLM's `AssertionError`) for vLLM's scheduler.
    fn refuse(&self, message: String) -> Error {
        if self.strict() {
            Error::InvalidArgument(message)
        } else {
            Error::Assertion(message)
        }
    }

    /// Keeps `int(watermark * num_blocks)` blocks free when admitting requests while
    /// others are scheduled (vLLM's `watermark`).
    ///
    /// # Errors
    /// A refusal ([`Self::refuse`]) of a negative or non-finite fraction.
    pub fn set_watermark(&mut self, watermark: f64) -> Result<()> {
        if self.strict() && !(watermark.is_finite() && watermark >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "watermark must be a finite non-negative fraction, got {watermark}"
            )));
        }
        self.watermark_blocks = watermark_blocks(watermark, self.pool.num_blocks())?;
        Ok(())
    }

    /// The blocks kept free for admissions (see [`KVCacheManager::set_watermark`]).
    pub fn watermark_blocks(&self) -> usize {
        self.watermark_blocks
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
        self.get_computed_blocks_with(request, Lookup::default())
    }

    /// [`KVCacheManager::get_computed_blocks`] bounded as `lookup` says: nothing when
    /// the request skips the prefix cache, at most `max_cache_hit_length` tokens.
    ///
    /// # Errors
    /// As [`KVCacheManager::get_computed_blocks`].
    pub fn get_computed_blocks_with<H: HashSource + ?Sized>(
        &self,
        request: &RequestView<'_, H>,
        lookup: Lookup,
    ) -> Result<(Vec<u32>, usize)> {
        if self.strict() {
            non_negative("num_tokens", request.num_tokens)?;
        }
        if !self.pool.enable_caching() || lookup.skip_reading_prefix_cache {
            return Ok((Vec::new(), 0));
        }
        // vLLM slices the hashes with `islice`, which refuses a negative stop
        // (`ValueError`); a request without tokens has a bound of -1.
        let max_tokens = match lookup.max_cache_hit_length {
            Some(m) => non_negative("max_cache_hit_length", m)?,
            None if self.strict() => usize::try_from(request.num_tokens)
                .unwrap_or(0)
                .saturating_sub(1),
            None => non_negative("max_cache_hit_length", request.num_tokens.saturating_sub(1))?,
        };
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
        let adoption = self.check_adoption(
            id,
            state,
            &hits,
            args.computed_blocks_given || counts.num_external > 0,
        );
        if self.strict() || (adoption.is_err() && state.is_some_and(|s| s.num_cached.is_some())) {
            adoption.clone()?;
        }
        let held = state.map_or(0, |s| s.blocks.len());
        let required = counts.required;
        let to_allocate = self.blocks_to_take(held, &hits);
        let watermark = if args.has_scheduled_reqs && args.admitting {
            self.watermark_blocks
        } else {
            0
        };
        let free = self.pool.num_free_blocks();
        // The admission gate compares against all free blocks, the step against what
        // the reservation leaves, as vLLM does (a negative reservation adds room).
        if args.full_sequence_must_fit
            && to_allocate(counts.full_sequence).saturating_add(watermark) > free
        {
            return Ok(None);
        }
        let available = i128::from(signed(free)) - i128::from(counts.reserved);
        if i128::from(signed(to_allocate(required).saturating_add(watermark))) > available {
            return Ok(None);
        }
        let adopts = adoption?;

        // Everything the caching step needs is fetched and checked before mutating.
        // An adopting request holds nothing yet, another adopts no hits.
        let table_len = (held + hits.len()).max(required);
        let caches = self.pool.enable_caching() && !args.delay_cache_blocks;
        // vLLM sizes the blocks of external tokens by the uncapped count.
        let adopted = if self.strict() {
            counts.total_computed
        } else {
            counts.adopted_tokens
        };
        // A negative count caches nothing, as vLLM's floor division makes it.
        let cache_tokens = usize::try_from(counts.main_tokens.min(counts.num_tokens)).unwrap_or(0);
        // vLLM caches past the table (a negative lookahead, or slots capped at
        // max_model_len) as `cache_blocks` does: that caching runs after the allocation.
        let caches_past_table = caches
            && !self.strict()
            && (cache_tokens / self.block_size).min(request.block_hashes.num_hashes()) > table_len;
        let cache_plan = if caches && !caches_past_table {
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

        // Validation done: from here on nothing can fail, except the pool running short
        // after a vLLM caller's negative reservation, where vLLM fails at the same
        // point, hits adopted. (Look up before inserting, so
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
                let n = blocks_for(adopted, self.block_size).saturating_sub(entry.blocks.len());
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
        if caches_past_table {
            self.cache_blocks(request, signed(cache_tokens))?;
        }
        Ok(Some(allocated))
    }

    /// Caches the request's full blocks covering its first `num_computed_tokens`
    /// tokens (vLLM's `cache_blocks`). A no-op with caching off, and for a count that
    /// covers no block beyond those cached (vLLM's, negative ones included).
    ///
    /// Tokens reaching past the request's block table are refused by a strict
    /// manager; vLLM's caches the blocks the table has and counts the rest as cached.
    ///
    /// # Errors
    /// [`Error::Negative`] (strict); [`Error::TooManyFullBlocks`] (strict) when those
    /// tokens reach past the request's block table; [`Error::AlreadyHashed`] if a
    /// block was hashed behind the manager's back; errors of the [`HashSource`].
    pub fn cache_blocks<H: HashSource + ?Sized>(
        &mut self,
        request: &RequestView<'_, H>,
        num_computed_tokens: i64,
    ) -> Result<()> {
        if self.strict() {
            non_negative("num_computed_tokens", num_computed_tokens)?;
        }
        if !self.pool.enable_caching() {
            return Ok(());
        }
        let state = self.requests.get(request.request_id);
        let blocks = state.map_or(&[][..], |s| &s.blocks);
        let num_cached = state.and_then(|s| s.num_cached).unwrap_or(0);
        let num_hashes = request.block_hashes.num_hashes();
        let cap = if self.release_rules.caps_caching_at_hashed_tokens {
            signed(num_hashes.saturating_mul(self.block_size))
        } else {
            i64::MAX
        };
        let full = full_blocks_in(num_computed_tokens.min(cap), self.block_size);
        if num_cached >= full {
            return Ok(());
        }
        if full > blocks.len() && self.strict() {
            return Err(Error::TooManyFullBlocks {
                num_full_blocks: full,
                num_block_ids: blocks.len(),
            });
        }
        let tokens = full.saturating_mul(self.block_size);
        let plan = self.plan_caching(request, blocks, num_cached, tokens, blocks.len())?;
        // Before vLLM 0.33, a table block without a hash fails the indexing of its hash.
        let unhashed_in_table = full.min(blocks.len()) > num_hashes;
        if (full > blocks.len() && self.pool.events().is_enabled()) || unhashed_in_table {
            // vLLM caches the blocks there, then fails indexing the missing ones (for
            // its BlockStored event, or their hashes): nothing recorded, the count not
            // updated.
            if let Some(plan) = &plan {
                let to_cache = blocks.get(plan.range.clone()).unwrap_or_default();
                self.pool.cache_ids(to_cache, &plan.hashes, GROUP_ID)?;
            }
            return Err(Error::Index("list index out of range".to_owned()));
        }
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
        // vLLM records the count even for blocks past the table, and for a request
        // it does not know yet.
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

    /// Records one `BlockStored` for the request's first `num_blocks` blocks, already
    /// cached (vLLM's `emit_cached_block_events` for a prefix hit reported in "full"
    /// mode: parent `None`, the hit's tokens). A no-op with events off.
    ///
    /// # Errors
    /// [`Error::TooFewHashes`] when the request has fewer hashes; the errors of its
    /// hash and token sources. Nothing is recorded then.
    pub fn record_cached_block_events<H: HashSource + ?Sized>(
        &mut self,
        request: &RequestView<'_, H>,
        num_blocks: usize,
    ) -> Result<()> {
        if num_blocks == 0 || !self.pool.events().is_enabled() {
            return Ok(());
        }
        let mut hashes = Vec::with_capacity(num_blocks.min(request.block_hashes.num_hashes()));
        request.block_hashes.hashes(0..num_blocks, &mut hashes)?;
        if hashes.len() != num_blocks {
            return Err(Error::TooFewHashes {
                needed: num_blocks,
                got: hashes.len(),
            });
        }
        let (_, tokens) = self.stored_event_data(request, 0, num_blocks)?;
        self.pool
            .events_mut()
            .record_stored(&hashes, None, &tokens, 0, GROUP_ID);
        Ok(())
    }

    /// Forgets the request and hands its table over without freeing it (vLLM's
    /// `pop_blocks_for_free`, for frees deferred until a step in flight lands): the
    /// caller frees the blocks later, tail first. Unknown requests give `[]`.
    pub fn pop_blocks_for_free(&mut self, request_id: &str) -> Vec<u32> {
        self.requests
            .remove(request_id)
            .map(|s| s.blocks)
            .unwrap_or_default()
    }

    /// The tokens covered by the request's cached blocks: up to the end of its last
    /// table block that has a hash (vLLM's `estimate_cached_tokens`, the largest
    /// `block_hash_num_tokens`). A block is hashed only at its own table position,
    /// so that end is the hash's token count.
    pub fn estimate_cached_tokens(&self, request_id: &str) -> usize {
        self.get_block_ids(request_id)
            .iter()
            .rposition(|&b| self.pool.block_is_cached(b))
            .map_or(0, |i| (i + 1).saturating_mul(self.block_size))
    }

    /// The blocks an allocation giving the request `num_tokens` slots would take
    /// from the free pool, with `new_computed_blocks` as its prefix hits (vLLM's
    /// `coordinator.get_num_blocks_to_allocate` for one full-attention group; a
    /// count at or below zero needs no block).
    ///
    /// # Errors
    /// [`Error::Negative`] for `num_tokens` (strict); the errors of the hits' checks
    /// in [`KVCacheManager::allocate_slots`].
    pub fn num_blocks_to_allocate(
        &self,
        request_id: &str,
        num_tokens: i64,
        new_computed_blocks: &[i64],
    ) -> Result<usize> {
        if self.strict() {
            non_negative("num_tokens", num_tokens)?;
        }
        let hits = self.check_hits(new_computed_blocks)?;
        let state = self.requests.get(request_id);
        if self.strict() {
            self.check_adoption(request_id, state, &hits, false)?;
        } else if !hits.is_empty() && state.is_some_and(|s| s.num_cached.is_some()) {
            // vLLM's only assert here: a running request has no new prefix hits.
            return Err(Error::Assertion(format!(
                "request {request_id} is running, so it has no new prefix-cache hits"
            )));
        }
        let held = state.map_or(0, |s| s.blocks.len());
        Ok(self.blocks_to_take(held, &hits)(blocks_for(
            num_tokens,
            self.block_size,
        )))
    }

    /// The leading blocks of the request's table that hold its first
    /// `num_computed_tokens` tokens (vLLM's `get_block_ids_for_computed_tokens`:
    /// `table[:cdiv(num_computed_tokens, block_size)]`, a negative end counting from
    /// the table's end as Python's slices do).
    pub fn block_ids_for_computed_tokens(
        &self,
        request_id: &str,
        num_computed_tokens: i64,
    ) -> &[u32] {
        let table = self.get_block_ids(request_id);
        let size = signed(self.block_size);
        // Python's ceiling division: -(-n // size).
        let blocks = num_computed_tokens.div_euclid(size)
            + i64::from(num_computed_tokens.rem_euclid(size) != 0);
        &table[..slice_end(blocks, table.len())]
    }

    /// How many of a lookup's `num_hits` blocks cover its first `num_computed_tokens`
    /// tokens (vLLM's `truncate_computed_blocks`: `blocks[:num_computed_tokens //
    /// block_size]`).
    ///
    /// # Errors
    /// [`Error::Assertion`] where vLLM asserts: a count that is not a multiple of the
    /// block size, or more blocks than the lookup found.
    pub fn truncated_hits(&self, num_hits: usize, num_computed_tokens: i64) -> Result<usize> {
        let size = signed(self.block_size);
        if num_computed_tokens.rem_euclid(size) != 0 {
            return Err(Error::Assertion(format!(
                "num_computed_tokens {num_computed_tokens} is not a multiple of the block \
                 size {size}"
            )));
        }
        let blocks = num_computed_tokens.div_euclid(size);
        if blocks > signed(num_hits) {
            return Err(Error::Assertion(format!(
                "{blocks} blocks asked of a lookup that found {num_hits}"
            )));
        }
        Ok(slice_end(blocks, num_hits))
    }

    /// vLLM's `get_num_common_prefix_blocks` for the group: 0, except under vLLM 0.31's
    /// rules with prefix caching on, where it counts the leading blocks of the
    /// request's table whose ref count is the number of tables (for cascade
    /// attention); an unknown request then gets an empty table first, as vLLM's
    /// `defaultdict` gives it one.
    pub fn num_common_prefix_blocks(&mut self, request_id: &str) -> usize {
        if !self.release_rules.counts_common_prefix_blocks || !self.enable_caching() {
            return 0;
        }
        if !self.requests.contains_key(request_id) {
            self.requests
                .insert(request_id.to_owned(), RequestBlocks::default());
        }
        let holders = u32::try_from(self.requests.len()).unwrap_or(u32::MAX);
        self.get_block_ids(request_id)
            .iter()
            .take_while(|&&b| self.pool.ref_cnt_of(b) == holders)
            .count()
    }

    /// The request's block table (empty for an unknown request).
    pub fn get_block_ids(&self, request_id: &str) -> &[u32] {
        self.requests.get(request_id).map_or(&[], |s| &s.blocks)
    }

    /// Every request with a cached-block count (vLLM's `num_cached_block` entries), in
    /// no particular order.
    pub fn cached_block_counts(&self) -> impl Iterator<Item = (&str, usize)> + '_ {
        self.requests
            .iter()
            .filter_map(|(id, s)| s.num_cached.map(|n| (id.as_str(), n)))
    }

    /// Every request with its block table, in no particular order.
    pub fn block_tables(&self) -> impl Iterator<Item = (&str, &[u32])> + '_ {
        self.requests
            .iter()
            .map(|(id, s)| (id.as_str(), s.blocks.as_slice()))
    }

    /// [`BlockPool::evict_blocks`]. vLLM indexes its block list with each id: an id
    /// past the pool fails its assert, and a negative one counts from the end.
    ///
    /// # Errors
    /// [`Error::UnknownBlock`] for an id out of range (vLLM: an id below
    /// `-num_blocks`); [`Error::Assertion`] (vLLM) for an id of `num_blocks` or more.
    /// A strict manager evicts nothing then; vLLM's has evicted the ids before it.
    pub fn evict_blocks(&mut self, block_ids: &[i64]) -> Result<Vec<(BlockHash, u32)>> {
        if self.strict() {
            return self.pool.evict_blocks(block_ids);
        }
        evict_as_vllm(&mut self.pool, block_ids)
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
        self.record_lookup(request, num_hits, false, false)
    }

    /// [`KVCacheManager::record_prefix_cache_stats`] as vLLM's scheduler records:
    /// nothing for a request whose lookup was skipped (caching off, or the request's
    /// `skip_reading_prefix_cache`), and a request that was `preempted` before into the
    /// `preempted_*` counters.
    ///
    /// # Errors
    /// As [`KVCacheManager::record_prefix_cache_stats`].
    pub fn record_prefix_cache_stats_with<H: HashSource + ?Sized>(
        &mut self,
        request: &RequestView<'_, H>,
        num_hits: i64,
        skip_reading_prefix_cache: bool,
        preempted: bool,
    ) -> Result<()> {
        let skipped = !self.records_lookup(skip_reading_prefix_cache);
        self.record_lookup(request, num_hits, skipped, preempted)
    }

    /// Whether an admission's lookup counts in the prefix-cache stats: stats are
    /// logged, and the lookup ran (caching on, and the request may read the cache).
    pub fn records_lookup(&self, skip_reading_prefix_cache: bool) -> bool {
        self.stats.is_some() && self.pool.enable_caching() && !skip_reading_prefix_cache
    }

    /// Validates one recorded lookup (strict) and counts it unless `skipped`; vLLM
    /// adds whatever it is given.
    fn record_lookup<H: HashSource + ?Sized>(
        &mut self,
        request: &RequestView<'_, H>,
        num_hits: i64,
        skipped: bool,
        preempted: bool,
    ) -> Result<()> {
        let queries = request.num_tokens;
        if self.strict() {
            non_negative("num_tokens", queries)?;
            non_negative("num_hits", num_hits)?;
            if num_hits > queries {
                return Err(Error::InvalidArgument(format!(
                    "num_hits {num_hits} exceeds the request's {queries} tokens"
                )));
            }
        }
        if let (Some(stats), false) = (&mut self.stats, skipped) {
            let (requests, total_queries, total_hits) = if preempted {
                (
                    &mut stats.preempted_requests,
                    &mut stats.preempted_queries,
                    &mut stats.preempted_hits,
                )
            } else {
                (&mut stats.requests, &mut stats.queries, &mut stats.hits)
            };
            // Saturating keeps a pathological run panic-free.
            *requests = requests.saturating_add(1);
            *total_queries = total_queries.saturating_add(queries);
            *total_hits = total_hits.saturating_add(num_hits);
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
            // vLLM's own count may run past the table (see `cache_blocks`).
            if self.strict() && state.num_cached.is_some_and(|c| c > state.blocks.len()) {
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
    /// `max_model_len`. Strict callers' counts must be non-negative.
    fn slot_counts<H: HashSource + ?Sized>(
        &self,
        request: &RequestView<'_, H>,
        args: &SlotRequest<'_>,
    ) -> Result<SlotCounts> {
        if self.strict() {
            non_negative("num_new_tokens", args.num_new_tokens)?;
            non_negative("num_new_computed_tokens", args.num_new_computed_tokens)?;
            non_negative("num_lookahead_tokens", args.num_lookahead_tokens)?;
            non_negative(
                "num_external_computed_tokens",
                args.num_external_computed_tokens,
            )?;
            non_negative("reserved_blocks", args.reserved_blocks)?;
            non_negative("num_tokens", request.num_tokens)?;
            non_negative("num_computed_tokens", request.num_computed_tokens)?;
        }
        let num_new = args.num_new_tokens;
        let num_external = args.num_external_computed_tokens;
        if num_new == 0 && num_external == 0 && args.num_new_computed_tokens == 0 {
            return Err(Error::InvalidArgument(NOTHING_TO_PLACE.to_owned()));
        }
        let cap = |n: i64| self.max_model_len.map_or(n, |m| n.min(signed(m)));
        let adopted_tokens = request
            .num_computed_tokens
            .saturating_add(args.num_new_computed_tokens)
            .saturating_add(num_external);
        let total_computed = cap(adopted_tokens);
        let main_tokens = total_computed.saturating_add(num_new);
        let slot_tokens = cap(main_tokens.saturating_add(args.num_lookahead_tokens));
        Ok(SlotCounts {
            num_tokens: request.num_tokens,
            num_external,
            total_computed,
            adopted_tokens,
            main_tokens,
            required: blocks_for(slot_tokens, self.block_size),
            full_sequence: blocks_for(cap(request.num_tokens), self.block_size),
            reserved: args.reserved_blocks,
        })
    }

    /// Whether this call adopts computed tokens (vLLM's `allocate_new_computed_blocks`
    /// for a request without a cached-block entry): it does with hits, and with none
    /// when `adopts_anyway` (external tokens, or computed blocks given that are not
    /// vLLM's shared empty result). Refuses the cases vLLM asserts against: hits for a
    /// request that holds blocks or with caching off, and an adoption by a request that
    /// holds blocks but has no cached-block entry.
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
            return Err(self.refuse(
                "new_computed_blocks must be empty when prefix caching is disabled".to_owned(),
            ));
        }
        let adopts = !known && (!hits.is_empty() || adopts_anyway);
        if (known && !hits.is_empty()) || (adopts && held > 0) {
            return Err(self.refuse(format!(
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
        // past the table (reachable when max_model_len caps the slots, or, for vLLM's
        // callers, with a negative lookahead; those cache after the allocation instead).
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
            return Err(if self.strict() {
                Error::AlreadyHashed { block_id: block }
            } else {
                Error::Assertion(format!("block {block} already has a hash"))
            });
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
