//! Rolling requests back past KV blocks whose load failed.
//!
//! A KV connector reports block ids whose KV failed to load. Every request holding such a
//! block among the tokens it had computed before this step must fall back to its longest
//! valid prefix. vLLM 0.33.0 does this in `Scheduler._update_requests_with_invalid_blocks`
//! and `_handle_invalid_blocks`; [`rollback_invalid_blocks`] is that logic as a batch
//! primitive over columns, and [`handle_invalid_blocks`] adds the two passes and the
//! policies on top. Both are pure: they return what to change and change nothing, so
//! an error can never leave a batch half-updated.
//!
//! Per request, in iteration order ([`Mode::Vllm`], vLLM exactly):
//!
//! * `before = num_computed_tokens - num_scheduled_tokens` were computed before this
//!   step; only their `cdiv(before, block_size)` blocks are scanned (blocks holding only
//!   this step's tokens were not loaded).
//! * At the first invalid block no earlier request of the batch has marked, the request
//!   truncates to `idx * block_size` and, when collecting, puts that block and every
//!   later block of its table up for eviction.
//! * Every invalid block met is marked, even after the request has truncated, so a later
//!   request sharing a *deeper* invalid block does not truncate for it.
//! * A request whose invalid blocks were all marked earlier only loses this step's
//!   tokens: it reverts to `before`, relying on the earlier request to rewrite them.
//!
//! [`Mode::Strict`] (kvblocks only) drops the sharing shortcut: every request truncates at
//! its own first invalid block and collects its own tail. Guarantee: afterwards no
//! invalid block lies within any request's tokens still counted as computed from before
//! this step.
//!
//! Cost: one pass over the tables (per scanned block: one test against a filter that
//! stays in L1, folded with the sign check), no hashing on the hot path, no allocation
//! per request beyond the outputs. 10,000 requests x 1,000 blocks take about 6 ms.

mod apply;
mod id_set;

pub use apply::{handle_failed_recving, FailedRecving, Pass, RollbackTarget};
use id_set::{Filter, IdSet};

use crate::error::{positive, Error, Result};

/// vLLM's message when block-level failures meet a model with several KV cache groups.
pub const MULTIPLE_GROUPS_MESSAGE: &str = "A KV connector reported block-level load failures \
     (invalid_block_ids) which is not supported for models with multiple KV cache groups. \
     Connectors must report failed requests via KVConnectorTransferResults.failed_recving \
     instead.";

/// What a rollback does with an argument outside the documented domain.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Tolerance {
    /// Refuse it with the documented error, changing nothing (the library API).
    #[default]
    Strict,
    /// Do what vLLM's own code does with it (its scheduler is the caller).
    Vllm,
}

/// Which rollback semantics to apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// vLLM 0.33.0 exactly: blocks shared within the batch are recomputed only by the
    /// first request (in iteration order) that meets them.
    #[default]
    Vllm,
    /// Every request truncates at its own first invalid block and collects its own tail;
    /// under the `recompute` policy those tails are evicted too (vLLM keeps them hashed
    /// until they are rewritten, so a prefix hit before that reads stale KV).
    Strict,
}

impl Mode {
    /// The mode named `"vllm"` or `"strict"`, as the Python API spells it.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "vllm" => Some(Self::Vllm),
            "strict" => Some(Self::Strict),
            _ => None,
        }
    }
}

/// vLLM's `kv_load_failure_policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Evict the sync pass's blocks and fail every affected request (vLLM's default).
    #[default]
    Fail,
    /// Evict nothing; reschedule the sync requests and retry the async ones.
    Recompute,
}

impl Policy {
    /// The policy named `"fail"` or `"recompute"`, as the Python API spells it.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "fail" => Some(Self::Fail),
            "recompute" => Some(Self::Recompute),
            _ => None,
        }
    }
}

/// One request's block table, borrowed in whichever integer type its owner stores.
///
/// `NumPy` hands over `int64` (or `int32`) buffers, the Rust manager holds `u32` ids; the
/// scan is monomorphised for each, so no table is ever copied or converted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockIds<'a> {
    /// `int64` ids (`NumPy`'s default, Python lists).
    I64(&'a [i64]),
    /// `int32` ids.
    I32(&'a [i32]),
    /// `uint32` ids (the Rust manager's own tables).
    U32(&'a [u32]),
}

impl BlockIds<'_> {
    /// Number of blocks in the table.
    pub fn len(&self) -> usize {
        match self {
            Self::I64(ids) => ids.len(),
            Self::I32(ids) => ids.len(),
            Self::U32(ids) => ids.len(),
        }
    }

    /// Whether the table has no blocks.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Anything that can lend a request's block table: `[i64]`, `[i32]`, `[u32]`, `Vec`s and
/// references of those, and [`BlockIds`] (for batches mixing integer types).
pub trait BlockTable {
    /// The table's block ids, in order.
    fn block_ids(&self) -> BlockIds<'_>;
}

impl BlockTable for [i64] {
    fn block_ids(&self) -> BlockIds<'_> {
        BlockIds::I64(self)
    }
}

impl BlockTable for [i32] {
    fn block_ids(&self) -> BlockIds<'_> {
        BlockIds::I32(self)
    }
}

impl BlockTable for [u32] {
    fn block_ids(&self) -> BlockIds<'_> {
        BlockIds::U32(self)
    }
}

impl<T> BlockTable for Vec<T>
where
    [T]: BlockTable,
{
    fn block_ids(&self) -> BlockIds<'_> {
        self.as_slice().block_ids()
    }
}

impl<T: BlockTable + ?Sized> BlockTable for &T {
    fn block_ids(&self) -> BlockIds<'_> {
        (**self).block_ids()
    }
}

impl BlockTable for BlockIds<'_> {
    fn block_ids(&self) -> BlockIds<'_> {
        *self
    }
}

/// The columns of a batch of requests, one entry per request in iteration order.
#[derive(Debug)]
pub struct Batch<'a, B> {
    /// Each request's block table.
    pub block_tables: &'a [B],
    /// Each request's `num_computed_tokens`, this step's tokens included.
    pub num_computed_tokens: &'a [i64],
    /// Tokens scheduled for each request in this step (0 when not scheduled).
    pub num_scheduled_tokens: &'a [i64],
}

// Derived `Clone`/`Copy` would demand `B: Copy`; the batch only holds references.
impl<B> Clone for Batch<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Batch<'_, B> {}

impl<B> Default for Batch<'_, B> {
    /// The empty batch.
    fn default() -> Self {
        Self {
            block_tables: &[],
            num_computed_tokens: &[],
            num_scheduled_tokens: &[],
        }
    }
}

/// What [`rollback_invalid_blocks`] decided for a batch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rollback {
    /// The new `num_computed_tokens` of every request, in batch order (unchanged for
    /// requests that were not affected).
    pub num_computed_tokens: Vec<i64>,
    /// Indices of the affected requests, in iteration order.
    pub affected: Vec<usize>,
    /// Tokens rolled back, as vLLM counts them for its log line: a truncating request's
    /// loss from `before`, a reverting request's scheduled tokens. `u128` because the sum
    /// of `i64` counts cannot overflow it.
    pub total_affected_tokens: u128,
    /// Block ids to evict from the prefix cache, sorted and unique; empty unless
    /// evictions were collected.
    pub blocks_to_evict: Vec<i64>,
    /// `(request index, first block index)` of each tail collected for eviction, in
    /// collection order (see [`Rollback::eviction_sequence`]).
    pub eviction_tails: Vec<(usize, usize)>,
}

impl Rollback {
    /// The ids in the order vLLM adds them to its `blocks_to_evict` set
    /// (`update(req_block_ids[idx:])` per truncated request, duplicates included).
    /// vLLM evicts by iterating that set, so a caller that must emit the evictions'
    /// events in vLLM's order rebuilds the set from this sequence.
    pub fn eviction_sequence<B: BlockTable>(&self, tables: &[B]) -> Vec<i64> {
        let mut out = Vec::new();
        for &(i, idx) in &self.eviction_tails {
            match tables.get(i).map(|t| t.block_ids()) {
                Some(BlockIds::I64(ids)) => out.extend(ids.iter().skip(idx)),
                Some(BlockIds::I32(ids)) => out.extend(ids.iter().skip(idx).map(|&b| i64::from(b))),
                Some(BlockIds::U32(ids)) => out.extend(ids.iter().skip(idx).map(|&b| i64::from(b))),
                None => {}
            }
        }
        out
    }
}

/// Rolls a batch of requests back past the blocks in `invalid_block_ids`.
///
/// vLLM's `_update_requests_with_invalid_blocks` over columns (see the module docs for
/// the semantics of each [`Mode`]). `collect_evictions` is vLLM's `evict_blocks`. Ids
/// that no table holds are ignored, as are duplicates.
///
/// # Errors
///
/// The first failing check, in this order (the Python reference raises the same
/// messages in the same order); nothing is returned but the error:
/// * [`Error::NonPositive`] — `block_size <= 0`;
/// * [`Error::InvalidArgument`] — the three columns differ in length;
/// * [`Error::Negative`] — a negative invalid id (the smallest is named);
/// * [`Error::InvalidArgument`] — for the first request `i` at fault: a negative
///   `num_computed_tokens[i]` or `num_scheduled_tokens[i]`, more tokens scheduled than
///   computed, or a table shorter than the `cdiv(before, block_size)` blocks it must
///   cover (vLLM would silently stop at its end);
/// * [`Error::InvalidArgument`] — the first negative id in the first table holding one.
///
/// With [`Tolerance::Vllm`] (vLLM's scheduler is the caller) only the first two: vLLM
/// scans what it is given, no block for a request whose count before this step is not
/// positive, and at most its table.
pub fn rollback_invalid_blocks<B: BlockTable>(
    batch: Batch<'_, B>,
    invalid_block_ids: &[i64],
    block_size: i64,
    collect_evictions: bool,
    mode: Mode,
    tolerance: Tolerance,
) -> Result<Rollback> {
    let block_size = validate(batch, invalid_block_ids, block_size, tolerance)?;
    // A negative id matches no table (vLLM's never hold one); a strict caller's were
    // refused above.
    let keys: Vec<u64> = invalid_block_ids
        .iter()
        .filter(|&&id| id >= 0)
        .map(|&id| id.key())
        .collect();
    let invalid = IdSet::from_ids(&keys);
    // `marked` is a subset of the invalid ids: sized like them, it never regrows, and
    // its zero-allocated pages cost nothing until touched. The evictions grow with the
    // largest id evicted, which bounds the walk that sorts them.
    let max_invalid = keys.iter().copied().max().unwrap_or(0);
    let mut scanner = Scanner {
        invalid: &invalid,
        filter: Filter::new(&keys),
        marked: IdSet::covering(if mode == Mode::Vllm { max_invalid } else { 0 }),
        evictions: collect_evictions.then(IdSet::default),
        strict: mode == Mode::Strict,
        check_signs: tolerance == Tolerance::Strict,
    };
    let mut out = Rollback {
        num_computed_tokens: batch.num_computed_tokens.to_vec(),
        ..Rollback::default()
    };
    let requests = batch
        .block_tables
        .iter()
        .zip(batch.num_computed_tokens)
        .zip(batch.num_scheduled_tokens);
    for (i, ((table, &computed), &scheduled)) in requests.enumerate() {
        // Strict: validated, 0 <= scheduled <= computed. vLLM: a count at or below zero
        // scans no block (`range(cdiv(before, block_size))` is empty).
        let before = computed.saturating_sub(scheduled);
        let num_blocks = scanned_blocks(before.max(0), block_size);
        let outcome = match table.block_ids() {
            BlockIds::I64(ids) => scanner.scan(i, ids, num_blocks)?,
            BlockIds::I32(ids) => scanner.scan(i, ids, num_blocks)?,
            BlockIds::U32(ids) => scanner.scan(i, ids, num_blocks)?,
        };
        // vLLM measures a truncation's loss from `before`, not from `computed`; both
        // losses are non-negative.
        let (new, lost) = match outcome {
            Scan::Unaffected => continue,
            // Block-aligned; idx < cdiv(before, bs), so 0 <= new < before.
            Scan::Truncated { idx } => {
                if collect_evictions {
                    out.eviction_tails.push((i, idx));
                }
                let new = to_i64(idx as u64 * block_size);
                (new, before - new)
            }
            // Every invalid block was marked earlier: only this step's tokens are lost.
            Scan::Reverted => (before, scheduled),
        };
        out.affected.push(i);
        if let Some(slot) = out.num_computed_tokens.get_mut(i) {
            *slot = new;
        }
        out.total_affected_tokens += u128::from(lost.unsigned_abs());
    }
    out.blocks_to_evict = scanner
        .evictions
        .map_or_else(Vec::new, IdSet::into_sorted_vec);
    Ok(out)
}

/// What [`handle_invalid_blocks`] decided; indices refer to the batch they name.
///
/// The policy's verdicts are views of the two passes (no list is copied): under
/// `fail` every affected request fails; under `recompute` the running ones are
/// rescheduled and the waiting ones retried.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct InvalidBlocksOutcome {
    /// The async pass over the requests waiting for remote KVs (no evictions collected).
    pub waiting: Rollback,
    /// The sync pass over the running requests (evictions collected when the outcome
    /// has any: under `fail`, or in strict mode).
    pub running: Rollback,
    /// What happens to the affected requests; the verdict views below read it.
    pub policy: Policy,
    /// The rollback semantics both passes ran with.
    pub mode: Mode,
}

/// Whether an outcome under `policy` and `mode` evicts blocks: `fail` evicts the
/// invalid blocks' holders' tails, and so does `strict`; `recompute` in `vllm` mode
/// keeps the hashes, as vLLM.
const fn evicts(policy: Policy, mode: Mode) -> bool {
    matches!(policy, Policy::Fail) || matches!(mode, Mode::Strict)
}

impl InvalidBlocksOutcome {
    fn if_policy<'a, T>(&self, policy: Policy, items: &'a [T]) -> &'a [T] {
        if self.policy == policy {
            items
        } else {
            &[]
        }
    }

    /// Waiting requests to fail (`fail`: every affected one).
    pub fn failed_waiting(&self) -> &[usize] {
        self.if_policy(Policy::Fail, &self.waiting.affected)
    }

    /// Running requests to fail (`fail`: every affected one).
    pub fn failed_running(&self) -> &[usize] {
        self.if_policy(Policy::Fail, &self.running.affected)
    }

    /// Running requests to reschedule from their new count (`recompute`).
    pub fn rescheduled_running(&self) -> &[usize] {
        self.if_policy(Policy::Recompute, &self.running.affected)
    }

    /// Waiting requests whose load must be retried once it finishes (`recompute`;
    /// vLLM's `failed_recving_kv_req_ids`).
    pub fn retry_waiting(&self) -> &[usize] {
        self.if_policy(Policy::Recompute, &self.waiting.affected)
    }

    /// [`Rollback::eviction_sequence`] of the blocks [`InvalidBlocksOutcome::evicted_block_ids`]
    /// names, for the running batch's `tables`.
    pub fn eviction_sequence<B: BlockTable>(&self, tables: &[B]) -> Vec<i64> {
        if evicts(self.policy, self.mode) {
            self.running.eviction_sequence(tables)
        } else {
            Vec::new()
        }
    }

    /// Blocks the caller must evict: the sync pass's under `fail`; under `recompute`,
    /// none in vLLM mode (the blocks keep their hashes and are rewritten in place) and
    /// the sync pass's in strict mode (no stale block stays reachable meanwhile).
    pub fn evicted_block_ids(&self) -> &[i64] {
        if evicts(self.policy, self.mode) {
            &self.running.blocks_to_evict
        } else {
            &[]
        }
    }

    /// Tokens rolled back over both passes.
    pub fn total_affected_tokens(&self) -> u128 {
        self.waiting.total_affected_tokens + self.running.total_affected_tokens
    }
}

/// Fails closed when block-level failures cannot be mapped to requests: block ids are
/// unique only within a KV cache group, so more than one group is refused (vLLM's
/// `_handle_invalid_blocks` raises the same), before anything else is looked at.
///
/// # Errors
/// [`Error::UnsupportedLayout`] with vLLM's message when `num_kv_cache_groups > 1`.
pub fn check_single_group(num_kv_cache_groups: i64) -> Result<()> {
    if num_kv_cache_groups > 1 {
        return Err(Error::UnsupportedLayout(MULTIPLE_GROUPS_MESSAGE.to_owned()));
    }
    Ok(())
}

/// vLLM's `_handle_invalid_blocks`: the async pass over `waiting` (the requests in
/// `WAITING_FOR_REMOTE_KVS`, whose blocks were never hashed, so no eviction is
/// collected), then the sync pass over `running`, each with its own marked set, then
/// the policy.
///
/// The caller checks [`check_single_group`] before it reads anything else (block ids
/// are unique only within a group), and applies the outcome with
/// [`InvalidBlocksOutcome::apply`].
///
/// # Errors
///
/// The errors of [`rollback_invalid_blocks`], the waiting batch's first.
pub fn handle_invalid_blocks<W: BlockTable, R: BlockTable>(
    waiting: Batch<'_, W>,
    running: Batch<'_, R>,
    invalid_block_ids: &[i64],
    block_size: i64,
    policy: Policy,
    mode: Mode,
    tolerance: Tolerance,
) -> Result<InvalidBlocksOutcome> {
    let (ids, collect) = (invalid_block_ids, evicts(policy, mode));
    let waiting = rollback_invalid_blocks(waiting, ids, block_size, false, mode, tolerance)?;
    let running = rollback_invalid_blocks(running, ids, block_size, collect, mode, tolerance)?;
    Ok(InvalidBlocksOutcome {
        waiting,
        running,
        policy,
        mode,
    })
}

/// Every check of [`rollback_invalid_blocks`] that needs no table contents; returns the
/// block size as `u64`. vLLM's scheduler gets only the checks its columns could fail
/// (they are built from its own requests): vLLM scans what it is given.
fn validate<B: BlockTable>(
    batch: Batch<'_, B>,
    invalid_block_ids: &[i64],
    block_size: i64,
    tolerance: Tolerance,
) -> Result<u64> {
    let block_size_u64 = positive("block_size", block_size)? as u64;
    let (n_tables, n_computed, n_scheduled) = (
        batch.block_tables.len(),
        batch.num_computed_tokens.len(),
        batch.num_scheduled_tokens.len(),
    );
    if n_tables != n_computed || n_tables != n_scheduled {
        return Err(Error::InvalidArgument(format!(
            "block_tables, num_computed_tokens and num_scheduled_tokens must have the same \
             length, got {n_tables}, {n_computed} and {n_scheduled}"
        )));
    }
    if tolerance == Tolerance::Vllm {
        return Ok(block_size_u64);
    }
    if let Some(&min) = invalid_block_ids.iter().min() {
        if min < 0 {
            return Err(Error::Negative {
                name: "invalid_block_ids",
                value: min,
            });
        }
    }
    let requests = batch
        .block_tables
        .iter()
        .zip(batch.num_computed_tokens)
        .zip(batch.num_scheduled_tokens);
    for (i, ((table, &c), &s)) in requests.enumerate() {
        let message = if c < 0 {
            format!("num_computed_tokens[{i}] must be non-negative, got {c}")
        } else if s < 0 {
            format!("num_scheduled_tokens[{i}] must be non-negative, got {s}")
        } else if s > c {
            format!("num_scheduled_tokens[{i}] = {s} exceeds num_computed_tokens[{i}] = {c}")
        } else {
            let len = table.block_ids().len();
            let needed = scanned_blocks(c - s, block_size_u64);
            if len >= needed {
                continue;
            }
            format!(
                "block_tables[{i}] has {len} blocks, fewer than the {needed} holding its {} \
                 tokens computed before this step",
                c - s
            )
        };
        return Err(Error::InvalidArgument(message));
    }
    Ok(block_size_u64)
}

/// `cdiv(before, block_size)`: the blocks holding the tokens computed before this step
/// (`before >= 0`). Saturates where it cannot fit, which no table can cover.
fn scanned_blocks(before: i64, block_size: u64) -> usize {
    usize::try_from(before.unsigned_abs().div_ceil(block_size)).unwrap_or(usize::MAX)
}

/// A `u64` that came from a non-negative `i64` (a count below `i64::MAX`, an id that
/// entered an id set) back as `i64`; it always fits.
pub(crate) fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// What scanning one request found.
enum Scan {
    /// No invalid block among the scanned ones.
    Unaffected,
    /// Truncate at the request's first invalid block that it owns.
    Truncated { idx: usize },
    /// Invalid blocks met, all marked by earlier requests (vLLM mode only).
    Reverted,
}

/// The state one batch shares across its requests.
struct Scanner<'a> {
    invalid: &'a IdSet,
    /// A cheap first test in front of `invalid`.
    filter: Filter,
    /// Invalid ids some request of this batch has met (vLLM mode); the first to meet
    /// one owns its recomputation.
    marked: IdSet,
    /// Blocks to evict, when collecting.
    evictions: Option<IdSet>,
    strict: bool,
    /// Whether a negative id in a table is refused (vLLM's tables never hold one).
    check_signs: bool,
}

impl Scanner<'_> {
    /// Scans the first `num_blocks` ids of request `i`'s table (validated to exist).
    fn scan<T: Id>(&mut self, i: usize, ids: &[T], num_blocks: usize) -> Result<Scan> {
        let scanned = ids.get(..num_blocks).unwrap_or(ids);
        let mut keys = 0;
        let (first, examined) = self.find_invalid(scanned, &mut keys);
        // The sign check of the whole table rides on the same pass over memory: the top
        // bit of a key is set iff its id is negative.
        let keys = ids
            .iter()
            .skip(examined)
            .fold(keys, |acc, &id| acc | id.key());
        if self.check_signs && keys & NEGATIVE != 0 {
            let (j, id) = ids
                .iter()
                .enumerate()
                .find(|(_, id)| id.key() & NEGATIVE != 0)
                .map_or((0, 0), |(j, &id)| (j, id.into()));
            return Err(Error::InvalidArgument(format!(
                "block_tables[{i}][{j}] must be non-negative, got {id}"
            )));
        }
        let Some(first) = first else {
            return Ok(Scan::Unaffected);
        };
        let truncate_at = if self.strict {
            Some(first)
        } else {
            self.mark(scanned, first)
        };
        let Some(idx) = truncate_at else {
            return Ok(Scan::Reverted);
        };
        if let Some(evictions) = &mut self.evictions {
            // The invalid block and everything after it, including blocks past the scanned
            // range (e.g. the one allocated for this step's tokens).
            evictions.extend(ids.iter().skip(idx).map(|&id| id.key()));
        }
        Ok(Scan::Truncated { idx })
    }

    /// The hot loop: the index of the first invalid id of `ids` (if any) and how many ids
    /// were examined, OR-ing their keys into `keys`.
    ///
    /// Ids go through the filter [`CHUNK`] at a time with no branch per id; a chunk is
    /// checked against the exact set only when the filter flags it, which most chunks
    /// of most requests never are.
    fn find_invalid<T: Id>(&self, ids: &[T], keys: &mut u64) -> (Option<usize>, usize) {
        for (c, chunk) in ids.chunks(CHUNK).enumerate() {
            let mut maybe = 0;
            for &id in chunk {
                *keys |= id.key();
                maybe |= self.filter.bit(id.key());
            }
            if maybe != 0 {
                let confirmed = |key: u64| self.filter.bit(key) != 0 && self.invalid.contains(key);
                if let Some(hit) = chunk.iter().position(|&id| confirmed(id.key())) {
                    return (Some(c * CHUNK + hit), c * CHUNK + chunk.len());
                }
            }
        }
        (None, ids.len())
    }

    /// vLLM's marking loop from the first invalid block on: marks every invalid id met
    /// and returns the index of the first one nobody had marked, if any.
    fn mark<T: Id>(&mut self, scanned: &[T], first: usize) -> Option<usize> {
        let mut truncate_at = None;
        let mut next = Some(first);
        while let Some(idx) = next {
            let key = scanned.get(idx).map_or(0, |&id| id.key());
            if self.marked.insert(key) && truncate_at.is_none() {
                truncate_at = Some(idx);
            }
            let rest = scanned.get(idx + 1..).unwrap_or_default();
            next = self.find_invalid(rest, &mut 0).0.map(|n| idx + 1 + n);
        }
        truncate_at
    }
}

/// Ids tested per branch in [`Scanner::find_invalid`].
const CHUNK: usize = 16;

/// The top bit of a key: set iff the id was negative.
const NEGATIVE: u64 = 1 << 63;

/// The integer types a block table may hold.
trait Id: Copy + Into<i64> {
    /// The id as a set key: its two's-complement bits, so a negative id has the top bit
    /// set ([`NEGATIVE`]) and lies outside every set (all members are below 2^63).
    fn key(self) -> u64;
}

impl Id for i64 {
    #[inline]
    #[allow(clippy::cast_sign_loss)] // the reinterpretation is the point: see `key`
    fn key(self) -> u64 {
        self as u64
    }
}

impl Id for i32 {
    #[inline]
    #[allow(clippy::cast_sign_loss)] // sign-extended first, so negatives keep the top bit
    fn key(self) -> u64 {
        i64::from(self) as u64
    }
}

impl Id for u32 {
    #[inline]
    fn key(self) -> u64 {
        u64::from(self)
    }
}
