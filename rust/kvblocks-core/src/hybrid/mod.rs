//! vLLM's `KVCacheManager` for vLLM's scheduler, over every layout kvblocks manages:
//! one full-attention group, several groups (full, sliding-window and chunked-local
//! attention), or one local-attention group. It runs vLLM 0.33.0's coordinators
//! (`KVCacheCoordinatorNoPrefixCache`, `UnitaryKVCacheCoordinator`,
//! `HybridKVCacheCoordinator`) and single-type managers, with the [`ReleaseRules`] of
//! 0.31 and 0.32 where one full-attention group behaves differently there.
//!
//! One pool serves every group. A request has one table per group; a local-attention
//! table holds the null block where blocks left the window. Groups may have different
//! block sizes: requests are hashed at the hash block size, which divides every
//! group's, and a group reads the hash of its block's last hash block; hits and
//! caching align to the scheduler block size, which every group's divides. A
//! full-attention group whose blocks are larger than the hash block also keys the
//! block the prompt's last hash boundary falls in under that boundary's hash (vLLM's
//! partial tail, [`crate::partial_keys`]). Unlike the library's
//! [`KVCacheManager`](crate::manager::KVCacheManager), this manager follows vLLM's
//! order of effects, not validate-then-mutate: `allocate_slots` frees out-of-window
//! blocks before it may return `None`, as vLLM's does, and an assertion vLLM makes
//! midway leaves what vLLM would have changed by then.
//!
//! Invariants (checked by [`HybridManager::check_invariants`]):
//! * the pool's own invariants hold;
//! * each non-null table entry is one reference: a block's ref count is at least the
//!   number of table entries naming it;
//! * a full-attention table holds no null block.

mod attention;

use rustc_hash::FxBuildHasher;

pub use attention::Attention;
use attention::{cdiv, floor_div, index, signed};

use crate::block_hash::BlockHash;
use crate::error::{positive, Error, Result};
use crate::events::{EventConfig, EventLog};
use crate::index::ix;
use crate::pool::{BlockPool, NULL_BLOCK_ID};
use crate::request::{HashSource, RequestView};

/// One KV cache group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupSpec {
    /// Its attention type.
    pub attention: Attention,
    /// Tokens per block of the group.
    pub block_size: i64,
    /// The per-request block cap of the admission gate (vLLM's
    /// `max_admission_blocks_per_request`; local attention only).
    pub admission_cap: Option<i64>,
    /// Groups with the same class have equal vLLM specs and are looked up jointly.
    pub lookup_class: u32,
}

/// What builds a [`HybridManager`] (vLLM's `KVCacheConfig` and manager arguments).
#[derive(Debug, Clone)]
pub struct HybridConfig {
    /// Blocks in the pool, the null block included.
    pub num_blocks: i64,
    /// The scheduler's block size: the least common multiple of the groups' (hits
    /// and caching are aligned to it).
    pub scheduler_block_size: i64,
    /// The block size of the request's hashes: it divides every group's.
    pub hash_block_size: i64,
    /// The groups, in vLLM's group order.
    pub groups: Vec<GroupSpec>,
    /// Whether the prefix cache is on.
    pub enable_caching: bool,
    /// Token counts are capped at it.
    pub max_model_len: i64,
    /// vLLM's `prefix_cache_retention_interval` (`None`: dense).
    pub retention_interval: Option<i64>,
}

/// What the manager reads of a vLLM `Request` beyond a [`RequestView`].
#[derive(Debug, Clone, Copy)]
pub struct HybridRequest<'a, H: ?Sized> {
    /// The request id, token counts and hashes.
    pub view: RequestView<'a, H>,
    /// `request.num_prompt_tokens` (its replay boundary is the last prompt token).
    pub num_prompt_tokens: i64,
    /// `request.num_in_flight_tokens` (not yet processed, so not freed).
    pub num_in_flight_tokens: i64,
    /// `request.shared_prefix_boundary`, fed back from a lookup (0: none).
    pub shared_prefix_boundary: i64,
}

/// The arguments of `allocate_slots`, vLLM's defaults being `Default::default()`.
// One field per keyword argument of vLLM's `allocate_slots`, flags included.
#[allow(clippy::struct_excessive_bools)]
#[derive(Debug, Clone, Copy, Default)]
pub struct HybridSlots<'a> {
    /// Tokens to compute in this step.
    pub num_new_tokens: i64,
    /// Tokens newly found in the local prefix cache.
    pub num_new_computed_tokens: i64,
    /// The lookup's blocks, one list per group; `None` for vLLM's shared empty result.
    pub new_computed_blocks: Option<&'a [Vec<u32>]>,
    /// Extra slots for speculative tokens.
    pub num_lookahead_tokens: i64,
    /// Tokens a KV connector will load.
    pub num_external_computed_tokens: i64,
    /// Skip caching (an asynchronous KV load is pending).
    pub delay_cache_blocks: bool,
    /// vLLM's admission gate.
    pub full_sequence_must_fit: bool,
    /// Free blocks to leave to other in-flight sequences.
    pub reserved_blocks: i64,
    /// The request's `status` when [`HybridManager::reads_status`] says the watermark
    /// can apply (`None` otherwise): it applies to an admission status.
    pub status: Option<i64>,
}

/// A prefix-cache lookup: the blocks per group, the hit in tokens, and vLLM's
/// `shared_prefix_boundary` (the longest single-group hit when the groups disagree).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheHit {
    /// One list per group (null blocks where a window leaves blocks out).
    pub blocks: Vec<Vec<u32>>,
    /// The reconciled hit in tokens.
    pub hit_tokens: i64,
    /// 0, or the junction a sparse-retention group has not cached yet.
    pub shared_prefix_boundary: i64,
}

/// Which vLLM coordinator the configuration gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Coordinator {
    NoPrefixCache,
    Unitary,
    Hybrid,
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

/// vLLM's `int(watermark * num_blocks)`, where vLLM first asserts `watermark >= 0.0`
/// ([`Error::Assertion`], also for NaN) and `int(inf)` overflows ([`Error::Overflow`]).
///
/// # Errors
/// As said.
fn watermark_blocks(watermark: f64, num_blocks: u32) -> Result<usize> {
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

/// Where Python's `items[:end]` ends in a list of `len` items: a negative `end` counts
/// from the end.
fn slice_end(end: i64, len: usize) -> usize {
    let len_signed = signed(len);
    let end = if end < 0 {
        len_signed.saturating_add(end)
    } else {
        end
    };
    usize::try_from(end.clamp(0, len_signed)).unwrap_or(0)
}

/// Each known request's tables, one per group, by request id.
type Requests = hashbrown::HashMap<String, Vec<GroupTable>, FxBuildHasher>;

/// One group's state of a request (vLLM's `req_to_blocks` and `num_cached_block`
/// entries of that group's manager).
#[derive(Debug, Clone, Default)]
struct GroupTable {
    /// `Some` once vLLM's defaultdict has an entry (it may be empty).
    blocks: Option<Vec<u32>>,
    num_cached: Option<usize>,
}

impl GroupTable {
    fn len(&self) -> usize {
        self.blocks.as_ref().map_or(0, Vec::len)
    }

    fn blocks(&self) -> &[u32] {
        self.blocks.as_deref().unwrap_or_default()
    }

    /// The table, created empty if absent (vLLM's `req_to_blocks[id]`).
    fn entry(&mut self) -> &mut Vec<u32> {
        self.blocks.get_or_insert_with(Vec::new)
    }
}

/// vLLM's `KVCacheManager` with its coordinator over the layout's groups.
#[derive(Debug, Clone)]
pub struct HybridManager {
    pool: BlockPool,
    scheduler_block_size: i64,
    hash_block_size: i64,
    groups: Vec<GroupSpec>,
    /// Spec groups for the hybrid lookup: full attention first, then by first member.
    lookup_groups: Vec<(Attention, Vec<u32>)>,
    coordinator: Coordinator,
    max_model_len: i64,
    retention_interval: Option<i64>,
    watermark_blocks: usize,
    /// The `request.status` values the watermark applies to (vLLM's waiting and
    /// preempted ones).
    admission_statuses: Vec<i64>,
    release_rules: ReleaseRules,
    requests: Requests,
}

impl HybridManager {
    /// A manager over a fresh pool.
    ///
    /// # Errors
    /// [`Error::NonPositive`] for `num_blocks`, a block size or a window;
    /// [`Error::InvalidArgument`] without groups, or for block sizes that do not
    /// divide each other as vLLM requires (the hash block size divides every
    /// group's, which divides the scheduler's).
    pub fn new(config: HybridConfig) -> Result<Self> {
        positive("num_blocks", config.num_blocks)?;
        positive("scheduler_block_size", config.scheduler_block_size)?;
        positive("hash_block_size", config.hash_block_size)?;
        if config.groups.is_empty() {
            return Err(Error::InvalidArgument(
                "a hybrid manager needs at least one KV cache group".to_owned(),
            ));
        }
        for group in &config.groups {
            positive("block_size", group.block_size)?;
            if group.block_size % config.hash_block_size != 0
                || config.scheduler_block_size % group.block_size != 0
            {
                return Err(Error::InvalidArgument(format!(
                    "block size {} is not a multiple of the hash block size {} or does not \
                     divide the scheduler block size {}",
                    group.block_size, config.hash_block_size, config.scheduler_block_size
                )));
            }
            match group.attention {
                Attention::Full => {}
                Attention::SlidingWindow { window, .. } => {
                    positive("sliding_window", window)?;
                }
                Attention::ChunkedLocal { chunk } => {
                    positive("attention_chunk_size", chunk)?;
                }
            }
        }
        let mut lookup_groups: Vec<(Attention, u32, Vec<u32>)> = Vec::new();
        for (gid, group) in (0u32..).zip(&config.groups) {
            match lookup_groups
                .iter_mut()
                .find(|(_, class, _)| *class == group.lookup_class)
            {
                Some((_, _, members)) => members.push(gid),
                None => lookup_groups.push((group.attention, group.lookup_class, vec![gid])),
            }
        }
        // A stable sort: full attention first, the rest in first-member order.
        lookup_groups.sort_by_key(|(attention, _, _)| !attention.is_full());
        let coordinator = if !config.enable_caching {
            Coordinator::NoPrefixCache
        } else if config.groups.len() == 1 {
            Coordinator::Unitary
        } else {
            Coordinator::Hybrid
        };
        Ok(Self {
            pool: BlockPool::new(config.num_blocks, config.enable_caching)?,
            scheduler_block_size: config.scheduler_block_size,
            hash_block_size: config.hash_block_size,
            groups: config.groups,
            lookup_groups: lookup_groups
                .into_iter()
                .map(|(attention, _, members)| (attention, members))
                .collect(),
            coordinator,
            max_model_len: config.max_model_len,
            retention_interval: config.retention_interval,
            watermark_blocks: 0,
            admission_statuses: Vec::new(),
            release_rules: ReleaseRules::default(),
            requests: Requests::default(),
        })
    }

    /// Sets the rules of the vLLM release the manager stands in for.
    pub fn set_release_rules(&mut self, rules: ReleaseRules) {
        self.release_rules = rules;
    }

    /// Keeps `int(watermark * num_blocks)` blocks free for admissions (vLLM's): requests
    /// whose `status` is one of `admission_statuses`.
    ///
    /// # Errors
    /// [`Error::Assertion`] for a negative or NaN fraction, [`Error::Overflow`] for an
    /// infinite one (vLLM's assert and `int(inf)`).
    pub fn set_watermark(&mut self, watermark: f64, admission_statuses: Vec<i64>) -> Result<()> {
        self.watermark_blocks = watermark_blocks(watermark, self.pool.num_blocks())?;
        self.admission_statuses = admission_statuses;
        Ok(())
    }

    /// Whether `allocate_slots` needs the request's `status`: only while other
    /// requests are scheduled and a watermark is set, so it is read only then.
    pub fn reads_status(&self, has_scheduled_reqs: bool) -> bool {
        has_scheduled_reqs && self.watermark_blocks > 0
    }

    /// Blocks admissions leave free while other requests are scheduled.
    pub fn watermark_blocks(&self) -> usize {
        self.watermark_blocks
    }

    /// Starts recording KV cache events (vLLM's: a `BlockRemoved` per key).
    pub fn enable_kv_cache_events(&mut self) {
        self.pool.enable_events(EventConfig {
            block_size: index(self.scheduler_block_size),
            last_copy_removal: false,
        });
    }

    /// The events recorded since the last [`Self::clear_events`].
    pub fn events(&self) -> &EventLog {
        self.pool.events()
    }

    /// Drops the recorded events.
    pub fn clear_events(&mut self) {
        self.pool.clear_events();
    }

    /// The block pool.
    pub fn block_pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The block pool, mutably (for vLLM's `block_pool` surface).
    pub fn block_pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }

    /// The scheduler's block size.
    pub fn scheduler_block_size(&self) -> i64 {
        self.scheduler_block_size
    }

    /// The request's hashes seen at group `gid`'s block size (vLLM's
    /// `resolve_block_hashes`).
    fn view<'a, H: HashSource + ?Sized>(&self, hashes: &'a H, gid: usize) -> HashView<'a, H> {
        HashView {
            hashes,
            scale: index(self.groups[gid].block_size / self.hash_block_size).max(1),
        }
    }

    /// Whether calls use a request's `num_prompt_tokens`, `num_in_flight_tokens` and
    /// `shared_prefix_boundary`: local-attention groups do, and full-attention groups
    /// whose blocks are larger than the hash block (their partial prompt tail).
    pub fn uses_layout_fields(&self) -> bool {
        self.groups
            .iter()
            .any(|g| !g.attention.is_full() || g.block_size != self.hash_block_size)
    }

    /// The groups, in vLLM's order.
    pub fn groups(&self) -> &[GroupSpec] {
        &self.groups
    }

    /// Whether the prefix cache is on.
    pub fn enable_caching(&self) -> bool {
        self.pool.enable_caching()
    }

    /// The pool's usage.
    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// vLLM's `find_longest_cache_hit` of the configuration's coordinator, bounded by
    /// `max_cache_hit_length` (`None`: `num_tokens - 1`). Touches nothing.
    ///
    /// # Errors
    /// Those of [`Attention::find_longest_cache_hit`].
    pub fn get_computed_blocks<H: HashSource + ?Sized>(
        &self,
        request: &RequestView<'_, H>,
        max_cache_hit_length: Option<i64>,
    ) -> Result<CacheHit> {
        let max_length = max_cache_hit_length.unwrap_or(request.num_tokens - 1);
        let hashes = request.block_hashes;
        let (blocks, hit_tokens, uncached) = match self.coordinator {
            Coordinator::NoPrefixCache => (vec![Vec::new(); self.groups.len()], 0, 0),
            Coordinator::Unitary => {
                // The unitary coordinator aligns hits to the group's block size.
                let group = self.groups[0];
                let (blocks, hit) = group.attention.find_longest_cache_hit(
                    &self.pool,
                    &self.view(hashes, 0),
                    max_length,
                    &[0],
                    group.block_size,
                    group.block_size,
                )?;
                (blocks, hit, 0)
            }
            Coordinator::Hybrid => self.fixed_point_hit(hashes, max_length)?,
        };
        Ok(CacheHit {
            blocks,
            hit_tokens,
            shared_prefix_boundary: if uncached == 0 {
                0
            } else {
                hit_tokens + uncached
            },
        })
    }

    /// The hybrid coordinator's fixed point: each spec group in turn accepts the
    /// candidate length or lowers it, until a pass changes nothing. Full attention is
    /// looked up once (its hits are downward-closed) and truncated at the end.
    fn fixed_point_hit<H: HashSource + ?Sized>(
        &self,
        hashes: &H,
        max_length: i64,
    ) -> Result<(Vec<Vec<u32>>, i64, i64)> {
        let mut hit_length = max_length;
        let mut longest = 0i64;
        let mut blocks: Vec<Option<Vec<u32>>> = vec![None; self.groups.len()];
        let mut lengths = vec![0i64; self.groups.len()];
        let simple = self.lookup_groups.len() == 2 && self.lookup_groups[0].0.is_full();
        loop {
            let mut current = hit_length;
            for (attention, members) in &self.lookup_groups {
                let first = ix(members[0]);
                if attention.is_full() && blocks[first].is_some() {
                    current = current.min(lengths[first]);
                    continue;
                }
                let block_size = self.groups[first].block_size;
                let (hits, new_length) = attention.find_longest_cache_hit(
                    &self.pool,
                    &self.view(hashes, first),
                    current,
                    members,
                    block_size,
                    self.scheduler_block_size,
                )?;
                current = new_length;
                for (&gid, group_hits) in members.iter().zip(hits) {
                    blocks[ix(gid)] = Some(group_hits);
                    lengths[ix(gid)] = new_length;
                }
                longest = longest.max(current);
            }
            if current >= hit_length {
                break;
            }
            hit_length = current;
            if simple {
                break;
            }
        }
        for (attention, members) in &self.lookup_groups {
            if attention.is_full() {
                let keep = index(cdiv(hit_length, self.groups[ix(members[0])].block_size));
                for &gid in members {
                    if let Some(hits) = &mut blocks[ix(gid)] {
                        hits.truncate(keep);
                    }
                }
            }
        }
        let blocks = blocks.into_iter().map(Option::unwrap_or_default).collect();
        Ok((blocks, hit_length, longest - hit_length))
    }

    /// vLLM's `allocate_slots`: frees what left the windows, checks capacity, adopts
    /// the lookup's blocks, allocates, and caches unless `delay_cache_blocks`.
    /// Returns the new blocks per group, or `None` when they do not fit (after the
    /// out-of-window frees, as vLLM).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when there is nothing to place (vLLM's
    /// `ValueError`); [`Error::Assertion`] where vLLM asserts; pool and hash-source
    /// errors.
    pub fn allocate_slots<H: HashSource + ?Sized>(
        &mut self,
        request: &HybridRequest<'_, H>,
        args: &HybridSlots<'_>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        let view = &request.view;
        if args.num_new_tokens == 0
            && args.num_external_computed_tokens == 0
            && args.num_new_computed_tokens == 0
        {
            return Err(Error::InvalidArgument(
                "num_new_tokens must be greater than 0 when there are no computed tokens \
                 to adopt"
                    .to_owned(),
            ));
        }
        // No hits (vLLM's shared empty result) is an empty list of groups: a group
        // past the list has none, so a running request's step allocates nothing here.
        let hits = args.new_computed_blocks.unwrap_or_default();
        if args.new_computed_blocks.is_some() && hits.len() != self.groups.len() {
            return Err(Error::InvalidArgument(format!(
                "new_computed_blocks has {} groups, not {}",
                hits.len(),
                self.groups.len()
            )));
        }
        let local = view.num_computed_tokens + args.num_new_computed_tokens;
        let adopted = local + args.num_external_computed_tokens;
        let total_computed = adopted.min(self.max_model_len);
        let watermark = if args
            .status
            .is_some_and(|s| self.admission_statuses.contains(&s))
        {
            signed(self.watermark_blocks)
        } else {
            0
        };
        let id = view.request_id;
        if args.full_sequence_must_fit {
            let full = view.num_tokens.min(self.max_model_len);
            let need = self.num_blocks_to_allocate(id, full, hits, total_computed, true)?;
            if need + watermark > signed(self.pool.num_free_blocks()) {
                return Ok(None);
            }
        }
        let main_tokens = total_computed + args.num_new_tokens;
        let slot_tokens = (main_tokens + args.num_lookahead_tokens).min(self.max_model_len);
        self.remove_skipped_blocks(id, (total_computed - request.num_in_flight_tokens).max(0));
        let need = self.num_blocks_to_allocate(id, slot_tokens, hits, adopted, false)?;
        let available =
            i128::from(signed(self.pool.num_free_blocks())) - i128::from(args.reserved_blocks);
        if i128::from(need + watermark) > available {
            return Ok(None);
        }
        if args.new_computed_blocks.is_some() || args.num_external_computed_tokens > 0 {
            self.allocate_new_computed_blocks(id, hits, local, args.num_external_computed_tokens)?;
        }
        let tables = tables_of(&mut self.requests, id, self.groups.len());
        let mut new_blocks = Vec::with_capacity(tables.len());
        for (group, table) in self.groups.iter().zip(tables.iter_mut()) {
            let table = table.entry();
            let n = cdiv(slot_tokens, group.block_size) - signed(table.len());
            let first = table.len();
            if n > 0 {
                self.pool.get_new_blocks_into(index(n), table)?;
            }
            new_blocks.push(table[first..].to_vec());
        }
        if !args.delay_cache_blocks {
            self.cache_blocks(
                request,
                (total_computed + args.num_new_tokens).min(view.num_tokens),
            )?;
        }
        Ok(Some(new_blocks))
    }

    /// vLLM's `coordinator.get_num_blocks_to_allocate`: the blocks giving the request
    /// `num_tokens` slots takes from the pool, summed over groups (with
    /// `apply_admission_cap`, local groups count at most their cap).
    ///
    /// # Errors
    /// [`Error::Assertion`] for hits given to a running request, as vLLM asserts.
    pub fn num_blocks_to_allocate(
        &self,
        request_id: &str,
        num_tokens: i64,
        hits: &[Vec<u32>],
        total_computed_tokens: i64,
        apply_admission_cap: bool,
    ) -> Result<i64> {
        let tables = self.requests.get(request_id);
        let mut total = 0i64;
        for (gid, group) in self.groups.iter().enumerate() {
            let group_hits = hits.get(gid).map_or(&[][..], Vec::as_slice);
            let table = tables.and_then(|t| t.get(gid));
            let mut required = cdiv(num_tokens, group.block_size);
            if let (true, Some(cap)) = (apply_admission_cap, group.admission_cap) {
                required = required.min(cap);
            }
            let held = signed(table.map_or(0, GroupTable::len));
            if table.is_some_and(|t| t.num_cached.is_some()) {
                if !group_hits.is_empty() {
                    return Err(Error::Assertion(format!(
                        "request {request_id} is running, so it has no new prefix-cache hits"
                    )));
                }
                total += (required - held).max(0);
                continue;
            }
            let skipped = floor_div(
                group.attention.skipped_tokens(total_computed_tokens),
                group.block_size,
            );
            let new = (required - skipped.max(signed(group_hits.len()) + held)).max(0);
            let first_kept = index((skipped - held).max(0));
            let evictable = group_hits
                .iter()
                .skip(first_kept)
                .filter(|&&b| b != NULL_BLOCK_ID && self.pool.ref_cnt_of(b) == 0)
                .count();
            total += new + signed(evictable);
        }
        Ok(total)
    }

    /// vLLM's `allocate_new_computed_blocks`: a request not yet running adopts its
    /// hits in every group (touching them all first), then gets blocks for its
    /// external tokens in every group.
    fn allocate_new_computed_blocks(
        &mut self,
        request_id: &str,
        hits: &[Vec<u32>],
        local: i64,
        external: i64,
    ) -> Result<()> {
        let running = self
            .requests
            .get(request_id)
            .is_some_and(|t| t.iter().any(|g| g.num_cached.is_some()));
        if running {
            if hits.iter().any(|h| !h.is_empty()) {
                return Err(Error::Assertion(format!(
                    "request {request_id} is running, so it has no new prefix-cache hits"
                )));
            }
            return Ok(());
        }
        let caching = self.pool.enable_caching();
        let tables = tables_of(&mut self.requests, request_id, self.groups.len());
        for (gid, (group, table)) in self.groups.iter().zip(tables.iter_mut()).enumerate() {
            if table.len() != 0 {
                return Err(Error::Assertion(format!(
                    "request {request_id} already holds blocks in group {gid}"
                )));
            }
            let skipped = floor_div(
                group.attention.skipped_tokens(local + external),
                group.block_size,
            );
            let group_hits = hits.get(gid).map_or(&[][..], Vec::as_slice);
            let kept = group_hits
                .get(index(skipped).min(group_hits.len())..)
                .unwrap_or_default();
            if caching {
                self.pool.touch_ids(kept.iter().copied(), kept.len())?;
            } else if !kept.is_empty() {
                // vLLM tests the blocks' truthiness: the null block counts too.
                return Err(Error::Assertion(
                    "Computed blocks should be empty when prefix caching is disabled".to_owned(),
                ));
            }
            let blocks = table.entry();
            blocks.resize(index(skipped), NULL_BLOCK_ID);
            blocks.extend_from_slice(kept);
            table.num_cached = Some(table.len());
        }
        if external > 0 {
            let total = local + external;
            for (group, table) in self.groups.iter().zip(tables.iter_mut()) {
                let skipped = group.attention.skipped_tokens(total);
                let group_external = if skipped > 0 {
                    (total - skipped).min(external)
                } else {
                    external
                };
                if group_external <= 0 {
                    continue;
                }
                let blocks = table.entry();
                let n = (cdiv(total, group.block_size) - signed(blocks.len())).max(0);
                self.pool.get_new_blocks_into(index(n), blocks)?;
            }
        }
        Ok(())
    }

    /// vLLM's `coordinator.remove_skipped_blocks`: in each group, the blocks no later
    /// token attends to once `processed_tokens` are processed go back to the pool,
    /// highest index first, and become null blocks in the table.
    pub fn remove_skipped_blocks(&mut self, request_id: &str, processed_tokens: i64) {
        let num_groups = self.groups.len();
        for (gid, group) in self.groups.iter().enumerate() {
            let skipped = group.attention.skipped_tokens(processed_tokens);
            if skipped <= 0 {
                continue;
            }
            let table = tables_of(&mut self.requests, request_id, num_groups)[gid].entry();
            let last = index(floor_div(skipped, group.block_size)).min(table.len());
            let mut freed = Vec::new();
            for i in (0..last).rev() {
                if table[i] == NULL_BLOCK_ID {
                    break;
                }
                freed.push(table[i]);
                table[i] = NULL_BLOCK_ID;
            }
            if !freed.is_empty() {
                // Table entries are references, so this cannot fail.
                let _ = self.pool.free_ids(freed.into_iter());
            }
        }
    }

    /// vLLM's `coordinator.cache_blocks`: each group hashes its full blocks within
    /// `num_computed_tokens` (rounded down to whole blocks), local groups only those
    /// a later hit can reach under the retention interval. A no-op with caching off.
    ///
    /// # Errors
    /// [`Error::Index`] where vLLM indexes past a table (events on); the hash and
    /// token sources' errors; [`Error::AlreadyHashed`] for a block hashed behind the
    /// manager's back.
    pub fn cache_blocks<H: HashSource + ?Sized>(
        &mut self,
        request: &HybridRequest<'_, H>,
        num_computed_tokens: i64,
    ) -> Result<()> {
        if !self.pool.enable_caching() {
            return Ok(());
        }
        let tokens = match self.coordinator {
            Coordinator::Hybrid => {
                floor_div(num_computed_tokens, self.scheduler_block_size)
                    * self.scheduler_block_size
            }
            _ => num_computed_tokens.max(0),
        };
        // The replay boundary, and the shared-prefix junction when there is one.
        let both = [
            request.num_prompt_tokens - 1,
            request.shared_prefix_boundary,
        ];
        let boundaries = &both[..if request.shared_prefix_boundary == 0 {
            1
        } else {
            2
        }];
        for gid in 0..self.groups.len() {
            self.cache_group_blocks(request, gid, tokens, boundaries)?;
            if self.groups[gid].attention.is_full()
                && self.groups[gid].block_size != self.hash_block_size
            {
                self.cache_partial_tail(request, gid, tokens)?;
            }
        }
        Ok(())
    }

    /// One group's part of [`Self::cache_blocks`] (vLLM's base `cache_blocks`): its full
    /// blocks within `tokens` that a later hit can reach.
    fn cache_group_blocks<H: HashSource + ?Sized>(
        &mut self,
        request: &HybridRequest<'_, H>,
        gid: usize,
        tokens: i64,
        boundaries: &[i64],
    ) -> Result<()> {
        let view = &request.view;
        let num_hashed = signed(view.block_hashes.num_hashes()) * self.hash_block_size;
        let group = self.groups[gid];
        let state = self.requests.get(view.request_id).and_then(|t| t.get(gid));
        let num_cached = state.and_then(|t| t.num_cached).unwrap_or(0);
        let cap = if self.release_rules.caps_caching_at_hashed_tokens {
            num_hashed
        } else {
            i64::MAX
        };
        let full = index(floor_div(tokens.min(cap), group.block_size));
        // Before vLLM 0.33 the count is not capped: a block past the hashed ones
        // fails the indexing of its hash, after those before it are cached.
        let num_group_hashes = index(floor_div(num_hashed, group.block_size));
        if num_cached >= full {
            return Ok(());
        }
        let mask = group.attention.reachable_mask(
            num_cached,
            full,
            group.block_size,
            self.scheduler_block_size,
            self.retention_interval,
            boundaries,
        );
        let table = state.map_or(&[][..], GroupTable::blocks);
        if mask.is_some() && table.len() < full {
            return Err(Error::Assertion(format!(
                "request {}: {full} full blocks but a table of {}",
                view.request_id,
                table.len()
            )));
        }
        let group_hashes = self.view(view.block_hashes, gid);
        let mut ids = Vec::new();
        let mut hashes = Vec::new();
        let mut positions = Vec::new();
        for i in num_cached..full {
            let Some(&block) = table.get(i) else {
                // vLLM slices the table, so a count past it caches what is there;
                // its event then indexes past the table.
                if self.pool.events().is_enabled() {
                    self.pool.cache_ids_promoting(&ids, &hashes, gid_u32(gid))?;
                    return Err(Error::Index("list index out of range".to_owned()));
                }
                break;
            };
            if block == NULL_BLOCK_ID || mask.as_ref().is_some_and(|m| !m[i - num_cached]) {
                continue;
            }
            if i >= num_group_hashes {
                self.pool.cache_ids_promoting(&ids, &hashes, gid_u32(gid))?;
                return Err(Error::Index("list index out of range".to_owned()));
            }
            ids.push(block);
            hashes.push(group_hashes.hash(i)?);
            positions.push(i);
        }
        let event = if self.pool.events().is_enabled() {
            Some((
                group_hashes.parent(num_cached)?,
                view.block_tokens(num_cached..full, index(group.block_size))?,
            ))
        } else {
            None
        };
        self.pool.cache_ids_promoting(&ids, &hashes, gid_u32(gid))?;
        if let Some((parent, tokens)) = event {
            self.pool.events_mut().record_stored_at(
                &hashes,
                &positions,
                parent,
                &tokens,
                num_cached..full,
                gid_u32(gid),
                index(group.block_size),
            );
        }
        let table = &mut tables_of(&mut self.requests, view.request_id, self.groups.len())[gid];
        table.entry();
        table.num_cached = Some(full);
        Ok(())
    }

    /// vLLM's `FullAttentionManager._cache_partial_tail_block`, for a full-attention
    /// group whose blocks are larger than the hash block: once `tokens` reach the
    /// prompt's last hash boundary (before its last token) and that boundary falls
    /// inside a block, the block is keyed under the boundary's hash too, with its own
    /// `BlockStored` of one hash block.
    ///
    /// # Errors
    /// [`Error::Assertion`] and [`Error::Index`] where vLLM's code fails on a request
    /// without prompt tokens; the sources' errors.
    fn cache_partial_tail<H: HashSource + ?Sized>(
        &mut self,
        request: &HybridRequest<'_, H>,
        gid: usize,
        tokens: i64,
    ) -> Result<()> {
        let view = &request.view;
        let hash_bs = self.hash_block_size;
        let block_size = self.groups[gid].block_size;
        let num_hashes = signed(view.block_hashes.num_hashes());
        let boundary = floor_div(request.num_prompt_tokens - 1, hash_bs).min(num_hashes) * hash_bs;
        if boundary == 0 || boundary > tokens || boundary.rem_euclid(block_size) == 0 {
            return Ok(());
        }
        let num_groups = self.groups.len();
        let table = tables_of(&mut self.requests, view.request_id, num_groups)[gid].entry();
        let at = floor_div(boundary, block_size);
        let block = match usize::try_from(at) {
            Ok(i) if i >= table.len() => return Ok(()),
            Ok(i) => table[i],
            // A negative boundary (no prompt tokens) indexes from the end, as in Python.
            Err(_) => *table
                .last()
                .ok_or_else(|| Error::Index("list index out of range".to_owned()))?,
        };
        if block == NULL_BLOCK_ID {
            return Ok(());
        }
        let num_hash_blocks = boundary / hash_bs;
        if num_hash_blocks <= 0 {
            return Err(Error::Assertion(format!(
                "request {}: a partial block of {boundary} tokens",
                view.request_id
            )));
        }
        let last = index(num_hash_blocks - 1);
        let key = view.block_hashes.hash(last)?;
        let stored = self
            .pool
            .cache_partial_key(block, (key, gid_u32(gid)), boundary);
        if stored && self.pool.events().is_enabled() {
            let parent = view.block_hashes.parent(last)?;
            let tokens = view.block_tokens(last..last + 1, index(hash_bs))?;
            self.pool.events_mut().record_stored_sized(
                &[key],
                parent,
                &tokens,
                last,
                gid_u32(gid),
                index(hash_bs),
            );
        }
        Ok(())
    }

    /// vLLM's `emit_cached_block_events` for a lookup reported in "full" mode: one
    /// `BlockStored` per group with a hit, covering as many blocks as the group's hit
    /// list holds (its nulls included), parent `None`.
    ///
    /// # Errors
    /// [`Error::TooFewHashes`] when the request has fewer hashes; the sources' errors.
    pub fn record_cached_block_events<H: HashSource + ?Sized>(
        &mut self,
        request: &RequestView<'_, H>,
        hits: &[Vec<u32>],
    ) -> Result<()> {
        if !self.pool.events().is_enabled() {
            return Ok(());
        }
        for (gid, group_hits) in hits.iter().enumerate() {
            let n = group_hits.len();
            if n == 0 {
                continue;
            }
            let block_size = self.groups[gid].block_size;
            let group_hashes = self.view(request.block_hashes, gid);
            if group_hashes.num_hashes() < n {
                return Err(Error::TooFewHashes {
                    needed: n,
                    got: group_hashes.num_hashes(),
                });
            }
            let mut hashes = Vec::with_capacity(n);
            group_hashes.hashes(0..n, &mut hashes)?;
            let tokens = request.block_tokens(0..n, index(block_size))?;
            self.pool.events_mut().record_stored_sized(
                &hashes,
                None,
                &tokens,
                0,
                gid_u32(gid),
                index(block_size),
            );
        }
        Ok(())
    }

    /// vLLM's `coordinator.free`: each group in order frees its table, tail first,
    /// leading nulls dropped. Unknown requests are a no-op.
    ///
    /// # Errors
    /// [`Error::DoubleFree`] if blocks were freed behind the manager's back.
    pub fn free(&mut self, request_id: &str) -> Result<()> {
        let Some(tables) = self.requests.remove(request_id) else {
            return Ok(());
        };
        for table in &tables {
            self.pool
                .free_ids(trim_null_head(table.blocks()).iter().rev().copied())?;
        }
        Ok(())
    }

    /// vLLM's `coordinator.pop_blocks_for_free`: forgets the request and returns its
    /// tables concatenated in group order, each without its leading nulls.
    pub fn pop_blocks_for_free(&mut self, request_id: &str) -> Vec<u32> {
        let Some(tables) = self.requests.remove(request_id) else {
            return Vec::new();
        };
        tables
            .iter()
            .flat_map(|t| trim_null_head(t.blocks()).iter().copied())
            .collect()
    }

    /// vLLM's `get_num_common_prefix_blocks`, one count per group: 0, except under
    /// vLLM 0.31's rules with prefix caching on, where a full-attention group counts
    /// the leading blocks of the request's table whose ref count is the number of
    /// tables in the group (for cascade attention); an unknown request then gets empty
    /// tables first, as vLLM's `defaultdict` gives it one.
    pub fn num_common_prefix_blocks(&mut self, request_id: &str) -> Vec<usize> {
        let mut counts = vec![0; self.groups.len()];
        if !self.release_rules.counts_common_prefix_blocks || !self.enable_caching() {
            return counts;
        }
        for table in tables_of(&mut self.requests, request_id, self.groups.len()) {
            table.entry();
        }
        for (gid, count) in counts.iter_mut().enumerate() {
            if !self.groups[gid].attention.is_full() {
                continue;
            }
            let holders = u32::try_from(self.request_ids(gid).count()).unwrap_or(u32::MAX);
            let table = self.requests[request_id][gid].blocks();
            *count = table
                .iter()
                .take_while(|&&b| self.pool.ref_cnt_of(b) == holders)
                .count();
        }
        counts
    }

    /// How many blocks of each group's lookup result (of `num_hits` blocks) cover its
    /// first `num_computed_tokens` tokens (vLLM's `truncate_computed_blocks`).
    ///
    /// # Errors
    /// [`Error::Assertion`] where vLLM asserts: a count that is not a multiple of a
    /// group's block size, or more blocks than the lookup found.
    pub fn truncated_hits(
        &self,
        num_hits: &[usize],
        num_computed_tokens: i64,
    ) -> Result<Vec<usize>> {
        (self.groups.iter().zip(num_hits))
            .map(|(group, &found)| {
                let size = group.block_size;
                if num_computed_tokens.rem_euclid(size) != 0 {
                    return Err(Error::Assertion(format!(
                        "num_computed_tokens {num_computed_tokens} is not a multiple of the \
                         block size {size}"
                    )));
                }
                let blocks = num_computed_tokens.div_euclid(size);
                if blocks > signed(found) {
                    return Err(Error::Assertion(format!(
                        "{blocks} blocks asked of a lookup that found {found}"
                    )));
                }
                Ok(slice_end(blocks, found))
            })
            .collect()
    }

    /// The request's table in each group (empty for an unknown request).
    pub fn get_block_ids(&self, request_id: &str) -> Vec<&[u32]> {
        match self.requests.get(request_id) {
            Some(tables) => tables.iter().map(GroupTable::blocks).collect(),
            None => vec![&[][..]; self.groups.len()],
        }
    }

    /// vLLM's `get_block_ids_for_computed_tokens`: each table's first
    /// `cdiv(num_computed_tokens, block_size)` blocks (a negative end counting from
    /// the table's end, as Python slices).
    pub fn block_ids_for_computed_tokens(
        &self,
        request_id: &str,
        num_computed_tokens: i64,
    ) -> Vec<&[u32]> {
        self.get_block_ids(request_id)
            .into_iter()
            .zip(&self.groups)
            .map(|(table, group)| {
                let end = cdiv(num_computed_tokens, group.block_size);
                let len = signed(table.len());
                let end = if end < 0 {
                    (len + end).max(0)
                } else {
                    end.min(len)
                };
                &table[..index(end)]
            })
            .collect()
    }

    /// vLLM's `estimate_cached_tokens`: per group, the prefix the last hashed block of
    /// the request's table stands for (its end, or a partial entry's boundary); the
    /// smallest over groups.
    pub fn estimate_cached_tokens(&self, request_id: &str) -> i64 {
        self.get_block_ids(request_id)
            .iter()
            .zip(&self.groups)
            .map(|(table, group)| {
                table
                    .iter()
                    .rposition(|&b| b != NULL_BLOCK_ID && self.pool.block_is_cached(b))
                    .map_or(0, |i| {
                        self.pool
                            .partial_hash_tokens(table[i])
                            .unwrap_or(signed(i + 1) * group.block_size)
                    })
            })
            .min()
            .unwrap_or(0)
    }

    /// The requests with a table in group `gid` (vLLM's `req_to_blocks` keys).
    pub fn request_ids(&self, gid: usize) -> impl Iterator<Item = &str> + '_ {
        self.requests
            .iter()
            .filter(move |(_, t)| t.get(gid).is_some_and(|g| g.blocks.is_some()))
            .map(|(id, _)| id.as_str())
    }

    /// The request's table in group `gid`, if it has one.
    pub fn group_table(&self, request_id: &str, gid: usize) -> Option<&[u32]> {
        self.requests
            .get(request_id)
            .and_then(|t| t.get(gid))
            .and_then(|g| g.blocks.as_deref())
    }

    /// Each request's cached-block count in group `gid` (vLLM's `num_cached_block`).
    pub fn cached_block_counts(&self, gid: usize) -> impl Iterator<Item = (&str, usize)> + '_ {
        self.requests
            .iter()
            .filter_map(move |(id, t)| t.get(gid)?.num_cached.map(|n| (id.as_str(), n)))
    }

    /// vLLM's `block_pool.evict_blocks`: it evicts in the given order and stops at the
    /// first id it refuses, the ones before it evicted. An id past the pool fails its
    /// assert, and a negative one counts from the end.
    ///
    /// # Errors
    /// [`Error::Assertion`] for an id of `num_blocks` or more; [`Error::UnknownBlock`] for
    /// one below `-num_blocks`.
    pub fn evict_blocks(&mut self, block_ids: &[i64]) -> Result<Vec<(BlockHash, u32)>> {
        let n = i64::from(self.pool.num_blocks());
        let mut removed = Vec::new();
        for &id in block_ids {
            if id >= n {
                return Err(Error::Assertion(format!(
                    "Invalid block_id {id} >= {n}. This indicates a bug in the KV connector - \
                     workers should only report block IDs that were allocated by the scheduler."
                )));
            }
            let id = if id < 0 { id.saturating_add(n) } else { id };
            removed.extend(self.pool.evict_blocks(&[id])?);
        }
        Ok(removed)
    }

    /// Empties the prefix cache if no block is in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// Checks the pool's invariants and the tables against it.
    ///
    /// # Errors
    /// [`Error::Invariant`] naming the first broken rule.
    pub fn check_invariants(&self) -> Result<()> {
        self.pool.check_invariants()?;
        for (id, tables) in &self.requests {
            for (gid, (group, table)) in self.groups.iter().zip(tables).enumerate() {
                if group.attention.is_full() && table.blocks().contains(&NULL_BLOCK_ID) {
                    return Err(Error::Invariant(format!(
                        "request {id} holds the null block in full-attention group {gid}"
                    )));
                }
            }
        }
        self.pool.check_table_references(
            self.requests
                .iter()
                .flat_map(|(id, tables)| tables.iter().map(move |t| (id.as_str(), t.blocks()))),
        )
    }
}

/// A request's hashes seen at a group's block size, `scale` times the hash block
/// size: block `i`'s hash is the last hash it covers (vLLM's
/// `BlockHashListWithBlockSize`, hashes being chained over their prefix).
struct HashView<'a, H: ?Sized> {
    hashes: &'a H,
    scale: usize,
}

impl<H: HashSource + ?Sized> HashSource for HashView<'_, H> {
    fn num_hashes(&self) -> usize {
        self.hashes.num_hashes() / self.scale
    }

    fn hashes(&self, range: std::ops::Range<usize>, out: &mut Vec<BlockHash>) -> Result<()> {
        if self.scale == 1 {
            return self.hashes.hashes(range, out);
        }
        for i in range {
            out.push(self.hash(i)?);
        }
        Ok(())
    }

    fn hash(&self, i: usize) -> Result<BlockHash> {
        self.hashes.hash((i + 1) * self.scale - 1)
    }

    fn token_source(&self) -> Option<&dyn crate::request::TokenSource> {
        self.hashes.token_source()
    }
}

/// The request's per-group state, created empty if unknown (vLLM's managers create
/// their entries on first use).
fn tables_of<'a>(
    requests: &'a mut Requests,
    request_id: &str,
    num_groups: usize,
) -> &'a mut Vec<GroupTable> {
    // One lookup; the key string is made only for a new request.
    requests
        .entry_ref(request_id)
        .or_insert_with(|| vec![GroupTable::default(); num_groups])
}

/// A group index as vLLM's group id.
fn gid_u32(gid: usize) -> u32 {
    u32::try_from(gid).unwrap_or(u32::MAX)
}

/// The table without its leading null blocks (vLLM's `trim_null_head`).
fn trim_null_head(table: &[u32]) -> &[u32] {
    let first = table
        .iter()
        .position(|&b| b != NULL_BLOCK_ID)
        .unwrap_or(table.len());
    &table[first..]
}
