//! The native half of `kvblocks.vllm.KVCacheManager`: vLLM's manager methods for one
//! full-attention group, with the Scheduler's arguments and result shapes, over the
//! core's manager.

// The `///` comments of the Python-visible items are docstrings (reST, Google style),
// not rustdoc markdown.
#![allow(clippy::doc_markdown)]

use hashbrown::HashMap;
use kvblocks_core::manager::{Lookup, ReleaseRules, SlotRequest, Tolerance};
use kvblocks_core::request::{HashSource, RequestView};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use rustc_hash::FxBuildHasher;

use super::blocks::{block_view, PyBlockView, PyKVCacheBlocks};
use super::request::{
    admission_status, request_attr, request_flag, request_id, with_request_view, HashCache,
    VllmRequest,
};
use crate::convert::{int_column, to_list, Flag};
use crate::errors::IntoPyResult;
use crate::manager::PyKVCacheManager;
use crate::pool::PoolHandle;

/// The native half of ``kvblocks.vllm.KVCacheManager``: vLLM's
/// ``KVCacheManager`` methods for one full-attention group, over the native manager.
///
/// Args:
///     num_blocks: Blocks in the pool, including the null block.
///     block_size: Tokens per block.
///     max_model_len: Token counts are capped at it, as vLLM does.
///     enable_caching: Whether to look up and fill the prefix cache.
///     log_stats: Whether to keep prefix-cache stats.
///     enable_kv_cache_events: Whether to record KV cache events.
///     watermark: The fraction of blocks admissions leave free while other requests
///         are scheduled (vLLM's ``watermark``).
///     admission_statuses: The ``request.status`` values of requests being admitted
///         (vLLM's ``WAITING`` and ``PREEMPTED``), to which the watermark applies.
///     event_structs: The module whose ``BlockStored``, ``BlockRemoved`` and
///         ``AllBlocksCleared`` the events are built as (vLLM's ``kv_events``: the
///         fields of ``kvblocks.events``, in the same order); ``None`` for kvblocks'.
///     kv_cache_spec_kind: ``BlockStored.kv_cache_spec_kind`` with ``event_structs``
///         (``"full_attention"`` when ``None``).
///     vllm_series: The vLLM release ``(major, minor)`` whose manager this one stands
///         in for (0.31 to 0.33), where their rules differ.
#[pyclass(
    extends = PyKVCacheManager,
    subclass,
    module = "kvblocks._native",
    name = "VllmKVCacheManager"
)]
pub struct PyVllmManager {
    /// Each known request's block hashes converted so far.
    hashes: HashMap<String, HashCache, FxBuildHasher>,
    admission_statuses: Vec<i64>,
    /// The result with no blocks, handed out whenever nothing was allocated or hit.
    empty: Py<PyKVCacheBlocks>,
}

impl PyVllmManager {
    /// Runs `f` on the core manager with a view of `request` whose hashes come from
    /// its cache entry, and `tokens` attached for events. Python errors met while
    /// reading come back as they were.
    fn with_request<T>(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        f: impl FnOnce(
            &mut PyKVCacheManager,
            &RequestView<'_, dyn HashSource + '_>,
        ) -> kvblocks_core::Result<T>,
    ) -> PyResult<T> {
        let req = VllmRequest::read(request)?;
        let id = req.request_id.to_str()?;
        let mut this = slf.try_borrow_mut()?;
        // Out of the manager while the base is borrowed; moving a map copies 3 words.
        let mut caches = std::mem::take(&mut this.hashes);
        let cache = caches.entry_ref(id).or_default();
        let base: &mut PyKVCacheManager = this.as_super();
        let result = with_request_view(base, cache, request, req, f);
        this.hashes = caches;
        result
    }

    /// `ids` as a result: the shared empty one when there are none.
    fn blocks_of(slf: &Bound<'_, Self>, ids: Vec<u32>) -> PyResult<Py<PyKVCacheBlocks>> {
        let py = slf.py();
        if ids.is_empty() {
            return Ok(slf.try_borrow()?.empty.clone_ref(py));
        }
        Py::new(
            py,
            PyKVCacheBlocks::single(ids, Some(PoolHandle::new(slf.as_super().clone().unbind()))),
        )
    }

    /// The prefix hits passed back to `allocate_slots`: ours, or any object with
    /// vLLM's `.blocks` (a tuple holding one sequence of blocks with `block_id`).
    fn hit_ids(blocks: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<i64>> {
        let Some(blocks) = blocks else {
            return Ok(Vec::new());
        };
        if let Ok(ours) = blocks.cast::<PyKVCacheBlocks>() {
            return Ok(ours.get().ids.iter().map(|&b| i64::from(b)).collect());
        }
        let groups = blocks.getattr(intern!(blocks.py(), "blocks"))?;
        block_ids_of(&groups.get_item(0)?)
    }
}

/// The `block_id`s of a sequence of block objects.
pub(crate) fn block_ids_of(blocks: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let py = blocks.py();
    to_list(blocks)?
        .iter()
        .map(|b| b.getattr(intern!(py, "block_id"))?.extract())
        .collect()
}

// Receivers that reach the base class come as `PyRef`/`PyRefMut`, by value (PyO3's
// `as_super` needs one).
#[allow(clippy::needless_pass_by_value)]
#[pymethods]
impl PyVllmManager {
    #[new]
    #[pyo3(
        signature = (
            num_blocks, block_size, max_model_len, *, enable_caching=Flag::TRUE,
            log_stats=Flag::FALSE, enable_kv_cache_events=Flag::FALSE, watermark=0.0,
            admission_statuses, event_structs=None, kv_cache_spec_kind=None,
            vllm_series=(0, 33)
        ),
        text_signature = "(num_blocks, block_size, max_model_len, *, enable_caching=True, log_stats=False, enable_kv_cache_events=False, watermark=0.0, admission_statuses, event_structs=None, kv_cache_spec_kind=None, vllm_series=(0, 33))"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: i64,
        block_size: i64,
        max_model_len: i64,
        enable_caching: Flag,
        log_stats: Flag,
        enable_kv_cache_events: Flag,
        watermark: f64,
        admission_statuses: &Bound<'_, PyAny>,
        event_structs: Option<&Bound<'_, PyAny>>,
        kv_cache_spec_kind: Option<String>,
        vllm_series: (u32, u32),
    ) -> PyResult<PyClassInitializer<Self>> {
        // Converted by the binding's own reader: never sized from a claimed length.
        let admission_statuses = int_column(admission_statuses)?.into_vec();
        let mut base = PyKVCacheManager::new(
            py,
            num_blocks,
            block_size,
            enable_caching,
            Some(max_model_len),
            log_stats,
            enable_kv_cache_events,
            Flag::FALSE,
        )?;
        base.inner.set_tolerance(Tolerance::Vllm);
        base.inner
            .set_release_rules(ReleaseRules::for_vllm(vllm_series));
        base.inner.set_watermark(watermark).py()?;
        if let (Some(events), Some(module)) = (base.events.as_mut(), event_structs) {
            events.build_as(module, kv_cache_spec_kind)?;
        }
        let empty = Py::new(py, PyKVCacheBlocks::single(Vec::new(), None))?;
        Ok(PyClassInitializer::from(base).add_subclass(Self {
            hashes: HashMap::default(),
            admission_statuses,
            empty,
        }))
    }

    /// The result with no blocks (always the same object).
    #[getter]
    fn empty_kv_cache_blocks(slf: PyRef<'_, Self>) -> Py<PyKVCacheBlocks> {
        slf.empty.clone_ref(slf.py())
    }

    /// Blocks admissions leave free while other requests are scheduled.
    #[getter]
    fn watermark_blocks(slf: PyRef<'_, Self>) -> usize {
        slf.as_super().inner.watermark_blocks()
    }

    /// vLLM's ``get_computed_blocks``: the longest cached prefix of the request's
    /// blocks, capped at ``max_cache_hit_length`` tokens (``num_tokens - 1`` by
    /// default); nothing when the request skips the prefix cache. Touches nothing.
    ///
    /// Returns:
    ///     ``(blocks, num_computed_tokens, 0)``: the third value is vLLM's shared-prefix
    ///     boundary, always 0 for one group.
    #[pyo3(signature = (request, max_cache_hit_length=None))]
    fn get_computed_blocks(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        max_cache_hit_length: Option<i64>,
    ) -> PyResult<(Py<PyKVCacheBlocks>, usize, usize)> {
        let py = slf.py();
        let lookup = Lookup {
            max_cache_hit_length,
            skip_reading_prefix_cache: request_flag(
                request,
                intern!(py, "skip_reading_prefix_cache"),
            )?,
        };
        let events_on = slf.try_borrow()?.as_super().events.is_some();
        let full_report = events_on
            && request
                .getattr_opt(intern!(py, "kv_cache_report_mode"))?
                .is_some_and(|mode| mode.eq("full").unwrap_or(false));
        let (hits, tokens) = Self::with_request(slf, request, |base, view| {
            let (hits, tokens) = base.inner.get_computed_blocks_with(view, lookup)?;
            if full_report {
                base.inner.record_cached_block_events(view, hits.len())?;
            }
            Ok((hits, tokens))
        })?;
        Ok((Self::blocks_of(slf, hits)?, tokens, 0))
    }

    /// vLLM's ``allocate_slots`` (see ``kvblocks.vllm.KVCacheManager``).
    ///
    /// Returns:
    ///     The newly allocated blocks, or ``None`` (nothing changed) when they do not
    ///     fit.
    #[pyo3(
        signature = (
            request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
            num_lookahead_tokens=0, num_external_computed_tokens=0,
            delay_cache_blocks=Flag::FALSE, num_encoder_tokens=0,
            full_sequence_must_fit=Flag::FALSE, reserved_blocks=0, has_scheduled_reqs=Flag::TRUE,
            skip_zeroing_group_ids=None
        ),
        text_signature = "(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None, num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False, num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0, has_scheduled_reqs=True, skip_zeroing_group_ids=None)"
    )]
    #[allow(clippy::too_many_arguments, clippy::needless_pass_by_value)]
    fn allocate_slots(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        num_new_tokens: i64,
        num_new_computed_tokens: i64,
        new_computed_blocks: Option<&Bound<'_, PyAny>>,
        num_lookahead_tokens: i64,
        num_external_computed_tokens: i64,
        delay_cache_blocks: Flag,
        num_encoder_tokens: i64,
        full_sequence_must_fit: Flag,
        reserved_blocks: i64,
        has_scheduled_reqs: Flag,
        skip_zeroing_group_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Py<PyKVCacheBlocks>>> {
        // One full-attention group: vLLM gives encoder tokens only to cross-attention
        // groups, and zeroes nothing.
        let _ = (num_encoder_tokens, skip_zeroing_group_ids);
        let hits = Self::hit_ids(new_computed_blocks)?;
        // vLLM tests `new_computed_blocks` against its shared empty result by identity.
        let computed_blocks_given = match new_computed_blocks {
            None => false,
            Some(blocks) => !blocks.is(slf.try_borrow()?.empty.bind(slf.py())),
        };
        let status = admission_status(
            request,
            has_scheduled_reqs.0,
            slf.try_borrow()?.as_super().inner.watermark_blocks(),
        )?;
        let admitting = match status {
            Some(status) => slf.try_borrow()?.admission_statuses.contains(&status),
            None => false,
        };
        let slots = SlotRequest {
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks: &hits,
            computed_blocks_given,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks: delay_cache_blocks.0,
            full_sequence_must_fit: full_sequence_must_fit.0,
            reserved_blocks,
            has_scheduled_reqs: has_scheduled_reqs.0,
            admitting,
        };
        let allocated = Self::with_request(slf, request, |base, view| {
            base.inner.allocate_slots(view, &slots)
        })?;
        allocated.map(|ids| Self::blocks_of(slf, ids)).transpose()
    }

    /// Frees the request's blocks, tail first, and forgets it (unknown: a no-op).
    fn free(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = request_id(request)?;
        let mut this = slf.try_borrow_mut()?;
        this.as_super().inner.free(&id).py()?;
        this.hashes.remove(&id);
        Ok(())
    }

    /// Forgets the request and returns its blocks, in table order, without freeing
    /// them: the caller frees them later with ``block_pool.free_blocks``, tail first.
    fn pop_blocks_for_free<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let id = request_id(request)?;
        let mut this = slf.try_borrow_mut()?;
        let blocks = this.as_super().inner.pop_blocks_for_free(&id);
        this.hashes.remove(&id);
        let pool = PoolHandle::new(slf.as_super().clone().unbind());
        let views = blocks.into_iter().map(|b| block_view(slf.py(), &pool, b));
        PyList::new(slf.py(), views)
    }

    /// Caches the request's full blocks within ``num_computed_tokens`` tokens.
    fn cache_blocks(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: i64,
    ) -> PyResult<()> {
        Self::with_request(slf, request, |base, view| {
            base.inner.cache_blocks(view, num_computed_tokens)
        })
    }

    /// A result holding the given blocks (objects with ``block_id``), one sequence per
    /// group; the shared empty result when they hold none.
    fn create_kv_cache_blocks(
        slf: &Bound<'_, Self>,
        blocks: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyKVCacheBlocks>> {
        let ids = block_ids_of(&blocks.get_item(0)?)?;
        let ids = {
            let this = slf.try_borrow()?;
            let pool = this.as_super().inner.block_pool();
            ids.into_iter()
                .map(|b| pool.check_id(b))
                .collect::<kvblocks_core::Result<Vec<u32>>>()
                .py()?
        };
        Self::blocks_of(slf, ids)
    }

    /// vLLM's ``truncate_computed_blocks``: the lookup result's blocks that cover its
    /// first ``num_computed_tokens`` tokens (a multiple of the block size).
    fn truncate_computed_blocks(
        slf: &Bound<'_, Self>,
        blocks: &Bound<'_, PyKVCacheBlocks>,
        num_computed_tokens: i64,
    ) -> PyResult<Py<PyKVCacheBlocks>> {
        let ids = &blocks.get().ids;
        let n = slf
            .try_borrow()?
            .as_super()
            .inner
            .truncated_hits(ids.len(), num_computed_tokens)
            .py()?;
        Self::blocks_of(slf, ids[..n].to_vec())
    }

    /// vLLM's ``get_num_common_prefix_blocks`` for the group: under vLLM 0.31 the
    /// leading blocks of the request's table that every request holding a table shares
    /// (an unknown request gets an empty table first, as vLLM's ``defaultdict`` gives
    /// it one); 0 under later releases.
    fn num_common_prefix_blocks(mut slf: PyRefMut<'_, Self>, request_id: &str) -> usize {
        slf.as_super().inner.num_common_prefix_blocks(request_id)
    }

    /// The ids of the requests that hold a block table (vLLM's ``req_to_blocks`` keys).
    fn request_ids(slf: PyRef<'_, Self>) -> Vec<String> {
        slf.as_super()
            .inner
            .block_tables()
            .map(|(id, _)| id.to_owned())
            .collect()
    }

    /// Each request's count of cached blocks (vLLM's ``num_cached_block``), as pairs.
    fn cached_block_counts(slf: PyRef<'_, Self>) -> Vec<(String, usize)> {
        slf.as_super()
            .inner
            .cached_block_counts()
            .map(|(id, n)| (id.to_owned(), n))
            .collect()
    }

    /// Block ``block_id`` of the pool, as vLLM's ``KVCacheBlock`` reads (live).
    fn block(slf: &Bound<'_, Self>, block_id: i64) -> PyResult<PyBlockView> {
        let block_id = slf
            .try_borrow()?
            .as_super()
            .inner
            .block_pool()
            .check_id(block_id)
            .py()?;
        Ok(block_view(
            slf.py(),
            &PoolHandle::new(slf.as_super().clone().unbind()),
            block_id,
        ))
    }

    /// The request's whole block table.
    fn get_blocks(slf: &Bound<'_, Self>, request_id: &str) -> PyResult<Py<PyKVCacheBlocks>> {
        let ids = slf
            .try_borrow()?
            .as_super()
            .inner
            .get_block_ids(request_id)
            .to_vec();
        Self::blocks_of(slf, ids)
    }

    /// The blocks covering the first ``num_computed_tokens`` tokens: ``([ids...],)``.
    fn get_block_ids_for_computed_tokens<'py>(
        slf: PyRef<'py, Self>,
        request_id: &str,
        num_computed_tokens: i64,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let ids = slf
            .as_super()
            .inner
            .block_ids_for_computed_tokens(request_id, num_computed_tokens);
        PyTuple::new(py, [PyList::new(py, ids)?])
    }

    /// The tokens the request's cached blocks cover (vLLM's ``estimate_cached_tokens``).
    fn estimate_cached_tokens(slf: PyRef<'_, Self>, request: &Bound<'_, PyAny>) -> PyResult<usize> {
        let id = request_id(request)?;
        Ok(slf.as_super().inner.estimate_cached_tokens(&id))
    }

    /// The blocks an allocation giving the request ``num_tokens`` slots would take
    /// from the pool, with ``new_computed_blocks`` (block ids) as its hits.
    fn num_blocks_to_allocate(
        slf: PyRef<'_, Self>,
        request_id: &str,
        num_tokens: i64,
        new_computed_blocks: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let hits = int_column(new_computed_blocks)?.into_vec();
        slf.as_super()
            .inner
            .num_blocks_to_allocate(request_id, num_tokens, &hits)
            .py()
    }

    /// What vLLM's ``record_prefix_cache_stats`` would record of one admission's
    /// lookup: ``(num_tokens, preempted)``, or ``None`` when it records nothing (stats
    /// off, caching off, or a request that may not read the prefix cache). The caller
    /// adds it to vLLM's own ``PrefixCacheStats``.
    fn prefix_cache_record(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(i64, bool)>> {
        let py = slf.py();
        let this = slf.try_borrow()?;
        let core = &this.as_super().inner;
        // vLLM returns at once without stats; nothing about the request is read then.
        if !core.records_lookup(false) {
            return Ok(None);
        }
        if !core.records_lookup(request_flag(
            request,
            intern!(py, "skip_reading_prefix_cache"),
        )?) {
            return Ok(None);
        }
        let num_tokens = request_attr(request, intern!(py, "num_tokens"))?;
        let preempted = request_attr(request, intern!(py, "num_preemptions"))? > 0;
        Ok(Some((num_tokens, preempted)))
    }
}
