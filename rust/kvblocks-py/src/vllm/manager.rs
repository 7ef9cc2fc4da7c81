//! The native half of `kvblocks.vllm`'s managers, for every layout they manage (one
//! full-attention group; several full, sliding-window and chunked-local groups; one
//! local-attention group): vLLM's `KVCacheManager` methods with the Scheduler's
//! arguments and result shapes, over the core's [`HybridManager`]. Requests are read
//! by `crate::request_fields`.

// The `///` comments of the Python-visible items are docstrings (reST, Google style),
// not rustdoc markdown.
#![allow(clippy::doc_markdown)]

use std::sync::OnceLock;

use kvblocks_core::events::EventLog;
use kvblocks_core::hybrid::{
    Attention, GroupSpec, HybridConfig, HybridManager, HybridRequest, HybridSlots, ReleaseRules,
};
use kvblocks_core::request::HashSource;
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyTuple};
use pyo3::{PyTraverseError, PyVisit};

use super::blocks::{block_view, PyBlockView, PyKVCacheBlocks};
use crate::convert::{int_column, to_list, Flag};
use crate::errors::IntoPyResult;
use crate::events::{take_events, with_request, EventSource, EventState};
use crate::pool::{pool_view, PoolHandle, PoolHost, PyBlockPool};
use crate::request_fields::{
    reports_full, skips_prefix_cache, status_of, FieldSet, LayoutFields, RequestFields,
};

/// The native half of ``kvblocks.vllm.KVCacheManager`` and
/// ``HybridKVCacheManager``: vLLM's ``KVCacheManager`` methods over one or several KV
/// cache groups of one block size.
///
/// Args:
///     num_blocks: Blocks in the pool, including the null block.
///     scheduler_block_size: vLLM's scheduler block size (hits and caching align to
///         it).
///     hash_block_size: The block size of the requests' block hashes.
///     max_model_len: Token counts are capped at it, as vLLM does.
///     groups: One ``(kind, block_size, window, extra_retained_tokens,
///         admission_cap, lookup_class)`` per group, in vLLM's order: ``kind`` is ``"full"``,
///         ``"sliding_window"`` or ``"chunked_local"``; groups with the same
///         ``lookup_class`` have equal specs and are looked up jointly.
///     enable_caching: Whether to look up and fill the prefix cache.
///     retention_interval: vLLM's ``prefix_cache_retention_interval``.
///     enable_kv_cache_events: Whether to record KV cache events.
///     watermark: vLLM's ``watermark``.
///     admission_statuses: The ``request.status`` values the watermark applies to.
///     event_structs: The module whose event classes the events are built as.
///     event_metadata: Per group, ``(kv_cache_spec_kind, sliding_window)`` for
///         ``BlockStored``.
///     vllm_series: The vLLM release ``(major, minor)`` whose manager this one stands
///         in for (0.31 to 0.33), where their rules differ.
#[pyclass(subclass, module = "kvblocks._native", name = "VllmKVCacheManager")]
pub struct PyVllmManager {
    inner: HybridManager,
    /// `Some` iff KV cache events are on.
    events: Option<EventState>,
    /// The result with no blocks in any group, handed out whenever nothing was
    /// allocated or hit.
    empty: Py<PyKVCacheBlocks>,
    /// The `block_pool` view, made on first access.
    pool_view: OnceLock<Py<PyBlockPool>>,
}

impl PoolHost for PyVllmManager {
    fn pool(&self) -> &kvblocks_core::pool::BlockPool {
        self.inner.block_pool()
    }

    fn pool_mut(&mut self) -> &mut kvblocks_core::pool::BlockPool {
        self.inner.block_pool_mut()
    }
}

impl EventSource for PyVllmManager {
    fn event_parts(&mut self) -> (Option<&mut EventState>, &EventLog) {
        (self.events.as_mut(), self.inner.events())
    }

    fn clear_event_log(&mut self) {
        self.inner.clear_events();
    }
}

impl PyVllmManager {
    /// Runs `f` on the core manager with a view of `request` (and its tokens attached
    /// for events). The hashes are converted as the core asks for them, on every call:
    /// a decoding step asks for at most its new block's. `in_flight` reads
    /// `request.num_in_flight_tokens` (only `allocate_slots` needs it).
    fn with_request<T>(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        in_flight: bool,
        f: impl FnOnce(
            &mut HybridManager,
            &HybridRequest<'_, dyn HashSource + '_>,
        ) -> kvblocks_core::Result<T>,
    ) -> PyResult<T> {
        let fields = RequestFields::read(request, FieldSet::MANAGER)?;
        let uses_layout = slf.try_borrow()?.inner.uses_layout_fields();
        let layout = LayoutFields::read(request, uses_layout, in_flight)?;
        let mut this = slf.try_borrow_mut()?;
        with_request(&mut *this, request, &fields, |this, view| {
            let request = HybridRequest {
                view: *view,
                num_prompt_tokens: layout.num_prompt_tokens,
                num_in_flight_tokens: layout.num_in_flight_tokens,
                shared_prefix_boundary: layout.shared_prefix_boundary,
            };
            f(&mut this.inner, &request)
        })
    }

    /// The request's table in group 0 (empty without one), for the rollback.
    pub(crate) fn first_group_table(&self, request_id: &str) -> &[u32] {
        self.inner.group_table(request_id, 0).unwrap_or_default()
    }

    /// `groups` as a result: the shared empty one when every group is empty.
    fn blocks_of<'a>(
        slf: &Bound<'_, Self>,
        groups: impl IntoIterator<Item = &'a [u32]> + Clone,
    ) -> PyResult<Py<PyKVCacheBlocks>> {
        let py = slf.py();
        if groups.clone().into_iter().all(<[u32]>::is_empty) {
            return Ok(slf.try_borrow()?.empty.clone_ref(py));
        }
        Py::new(
            py,
            PyKVCacheBlocks::grouped(groups, Some(PoolHandle::new(slf.clone().unbind()))),
        )
    }

    /// The ids of a `KVCacheBlocks` (ours, or any object with vLLM's `.blocks`: one
    /// sequence of blocks with `block_id` per group), checked against the pool.
    fn group_ids(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
        if let Ok(ours) = blocks.cast::<PyKVCacheBlocks>() {
            return Ok(ours
                .get()
                .groups()
                .into_iter()
                .map(<[u32]>::to_vec)
                .collect());
        }
        let groups = blocks.getattr(intern!(blocks.py(), "blocks"))?;
        Self::checked_ids(slf, &groups)
    }

    /// The ids of a sequence of per-group block sequences, checked against the pool.
    fn checked_ids(slf: &Bound<'_, Self>, groups: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
        let this = slf.try_borrow()?;
        let pool = this.inner.block_pool();
        to_list(groups)?
            .iter()
            .map(|group| {
                block_ids_of(&group)?
                    .into_iter()
                    .map(|b| pool.check_id(b))
                    .collect::<kvblocks_core::Result<Vec<u32>>>()
                    .py()
            })
            .collect()
    }
}

/// The ids of a sequence of blocks: block objects (with `block_id`) or ints.
fn block_ids_of(blocks: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let py = blocks.py();
    to_list(blocks)?
        .iter()
        .map(|b| match b.cast::<PyInt>() {
            Ok(id) => id.extract(),
            Err(_) => b.getattr(intern!(py, "block_id"))?.extract(),
        })
        .collect()
}

/// One group of the constructor's `groups` argument.
fn group_spec(item: &Bound<'_, PyAny>) -> PyResult<GroupSpec> {
    let (kind, block_size, window, extra_retained, admission_cap, lookup_class): (
        String,
        i64,
        Option<i64>,
        i64,
        Option<i64>,
        u32,
    ) = item.extract()?;
    let window =
        || window.ok_or_else(|| PyValueError::new_err(format!("a {kind} group needs its window")));
    let attention = match kind.as_str() {
        "full" => Attention::Full,
        "sliding_window" => Attention::SlidingWindow {
            window: window()?,
            extra_retained,
        },
        "chunked_local" => Attention::ChunkedLocal { chunk: window()? },
        _ => {
            return Err(PyValueError::new_err(format!(
                "unknown KV cache group kind {kind:?}"
            )))
        }
    };
    Ok(GroupSpec {
        attention,
        block_size,
        admission_cap,
        lookup_class,
    })
}

// Receivers that reach the manager come as `PyRef`/`PyRefMut` or `&Bound`.
#[allow(clippy::needless_pass_by_value)]
#[pymethods]
impl PyVllmManager {
    #[new]
    #[pyo3(
        signature = (
            num_blocks, scheduler_block_size, hash_block_size, max_model_len, groups, *,
            enable_caching=Flag::TRUE,
            retention_interval=None, enable_kv_cache_events=Flag::FALSE, watermark=0.0,
            admission_statuses, event_structs=None, event_metadata=None, vllm_series=(0, 33)
        ),
        text_signature = "(num_blocks, scheduler_block_size, hash_block_size, max_model_len, groups, *, enable_caching=True, retention_interval=None, enable_kv_cache_events=False, watermark=0.0, admission_statuses, event_structs=None, event_metadata=None, vllm_series=(0, 33))"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: i64,
        scheduler_block_size: i64,
        hash_block_size: i64,
        max_model_len: i64,
        groups: &Bound<'_, PyAny>,
        enable_caching: Flag,
        retention_interval: Option<i64>,
        enable_kv_cache_events: Flag,
        watermark: f64,
        admission_statuses: &Bound<'_, PyAny>,
        event_structs: Option<&Bound<'_, PyAny>>,
        event_metadata: Option<Vec<(String, Option<i64>)>>,
        vllm_series: (u32, u32),
    ) -> PyResult<Self> {
        let groups = to_list(groups)?
            .iter()
            .map(|g| group_spec(&g))
            .collect::<PyResult<Vec<_>>>()?;
        let num_groups = groups.len();
        let mut inner = HybridManager::new(HybridConfig {
            num_blocks,
            scheduler_block_size,
            hash_block_size,
            groups,
            enable_caching: enable_caching.0,
            max_model_len,
            retention_interval,
        })
        .py()?;
        inner
            .set_watermark(watermark, int_column(admission_statuses)?.into_vec())
            .py()?;
        inner.set_release_rules(ReleaseRules::for_vllm(vllm_series));
        let events = if enable_kv_cache_events.0 {
            inner.enable_kv_cache_events();
            let mut state = EventState::new(py)?;
            if let Some(module) = event_structs {
                state.build_as(module, None)?;
            }
            if let Some(metadata) = event_metadata {
                state.set_groups(metadata);
            }
            Some(state)
        } else {
            None
        };
        let empty = Py::new(
            py,
            PyKVCacheBlocks::grouped(vec![&[][..]; num_groups], None),
        )?;
        Ok(Self {
            inner,
            events,
            empty,
            pool_view: OnceLock::new(),
        })
    }

    /// The pool, as ``kvblocks._native.BlockPool`` (always the same object).
    #[getter]
    fn native_pool(slf: &Bound<'_, Self>) -> PyResult<Py<PyBlockPool>> {
        let this = slf.try_borrow()?;
        pool_view(slf, &this.pool_view, this.inner.scheduler_block_size())
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(view) = self.pool_view.get() {
            visit.call(view)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.pool_view = OnceLock::new();
    }

    /// The result with no blocks (always the same object).
    #[getter]
    fn empty_kv_cache_blocks(slf: PyRef<'_, Self>) -> Py<PyKVCacheBlocks> {
        slf.empty.clone_ref(slf.py())
    }

    /// Blocks admissions leave free while other requests are scheduled.
    #[getter]
    fn watermark_blocks(&self) -> usize {
        self.inner.watermark_blocks()
    }

    /// The scheduler's block size (the one group's block size, for the rollback).
    #[getter]
    fn block_size(&self) -> i64 {
        self.inner.scheduler_block_size()
    }

    /// Whether the prefix cache is on.
    #[getter]
    fn enable_caching(&self) -> bool {
        self.inner.enable_caching()
    }

    /// The number of KV cache groups.
    #[getter]
    fn num_kv_cache_groups(&self) -> usize {
        self.inner.groups().len()
    }

    /// The pool's usage, ``1 - free / (num_blocks - 1)``.
    #[getter]
    fn usage(&self) -> f64 {
        self.inner.usage()
    }

    /// vLLM's ``get_computed_blocks``: the coordinator's longest hit, capped at
    /// ``max_cache_hit_length`` tokens (``num_tokens - 1`` by default). Touches
    /// nothing.
    ///
    /// Returns:
    ///     ``(blocks, num_computed_tokens, shared_prefix_boundary)``.
    #[pyo3(signature = (request, max_cache_hit_length=None))]
    fn get_computed_blocks(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        max_cache_hit_length: Option<i64>,
    ) -> PyResult<(Py<PyKVCacheBlocks>, i64, i64)> {
        let py = slf.py();
        let skip = skips_prefix_cache(request)?;
        let (caching, events_on) = {
            let this = slf.try_borrow()?;
            (this.inner.enable_caching(), this.events.is_some())
        };
        if !caching || skip {
            return Ok((slf.try_borrow()?.empty.clone_ref(py), 0, 0));
        }
        let full_report = events_on && reports_full(request)?;
        let hit = Self::with_request(slf, request, false, |core, req| {
            let hit = core.get_computed_blocks(&req.view, max_cache_hit_length)?;
            if full_report && hit.hit_tokens > 0 {
                core.record_cached_block_events(&req.view, &hit.blocks)?;
            }
            Ok(hit)
        })?;
        let blocks = Self::blocks_of(slf, hit.blocks.iter().map(Vec::as_slice))?;
        Ok((blocks, hit.hit_tokens, hit.shared_prefix_boundary))
    }

    /// vLLM's ``allocate_slots`` (see ``kvblocks.vllm.HybridKVCacheManager``).
    ///
    /// Returns:
    ///     The newly allocated blocks per group, or ``None`` when they do not fit.
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
    #[allow(clippy::too_many_arguments)]
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
        // No cross-attention group, and nothing to zero.
        let _ = (num_encoder_tokens, skip_zeroing_group_ids);
        let py = slf.py();
        // vLLM tests `new_computed_blocks` against its shared empty result by identity.
        let hits = match new_computed_blocks {
            Some(blocks) if !blocks.is(slf.try_borrow()?.empty.bind(py)) => {
                Some(Self::group_ids(slf, blocks)?)
            }
            _ => None,
        };
        // `status` is read only when the core's watermark can apply.
        let reads_status = slf.try_borrow()?.inner.reads_status(has_scheduled_reqs.0);
        let status = if reads_status {
            Some(status_of(request)?)
        } else {
            None
        };
        let slots = HybridSlots {
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks: hits.as_deref(),
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks: delay_cache_blocks.0,
            full_sequence_must_fit: full_sequence_must_fit.0,
            reserved_blocks,
            status,
        };
        let allocated = Self::with_request(slf, request, true, |core, req| {
            core.allocate_slots(req, &slots)
        })?;
        allocated
            .map(|groups| Self::blocks_of(slf, groups.iter().map(Vec::as_slice)))
            .transpose()
    }

    /// Frees the request's blocks, group by group, tail first (unknown: a no-op).
    fn free(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let fields = RequestFields::read(request, FieldSet::ID)?;
        slf.try_borrow_mut()?.inner.free(fields.id()).py()
    }

    /// Forgets the request and returns its blocks, group after group, each without
    /// its leading nulls, unfreed.
    fn pop_blocks_for_free<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let fields = RequestFields::read(request, FieldSet::ID)?;
        let mut this = slf.try_borrow_mut()?;
        let blocks = this.inner.pop_blocks_for_free(fields.id());
        let pool = PoolHandle::new(slf.clone().unbind());
        PyList::new(
            slf.py(),
            blocks.into_iter().map(|b| block_view(slf.py(), &pool, b)),
        )
    }

    /// Caches the request's full blocks within ``num_computed_tokens`` tokens.
    fn cache_blocks(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: i64,
    ) -> PyResult<()> {
        Self::with_request(slf, request, false, |core, req| {
            core.cache_blocks(req, num_computed_tokens)
        })
    }

    /// Frees the blocks that left each group's window once
    /// ``processed_computed_tokens`` are processed.
    #[pyo3(signature = (request_id, processed_computed_tokens, num_prompt_tokens=None))]
    fn remove_skipped_blocks(
        &mut self,
        request_id: &str,
        processed_computed_tokens: i64,
        num_prompt_tokens: Option<i64>,
    ) {
        let _ = num_prompt_tokens;
        self.inner
            .remove_skipped_blocks(request_id, processed_computed_tokens);
    }

    /// A result holding the given blocks, one sequence per group; the shared empty
    /// result when every group is empty.
    fn create_kv_cache_blocks(
        slf: &Bound<'_, Self>,
        blocks: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyKVCacheBlocks>> {
        let groups = Self::checked_ids(slf, blocks)?;
        Self::blocks_of(slf, groups.iter().map(Vec::as_slice))
    }

    /// vLLM's ``truncate_computed_blocks``: the lookup result's blocks that cover its
    /// first ``num_computed_tokens`` tokens, group by group.
    fn truncate_computed_blocks(
        slf: &Bound<'_, Self>,
        blocks: &Bound<'_, PyKVCacheBlocks>,
        num_computed_tokens: i64,
    ) -> PyResult<Py<PyKVCacheBlocks>> {
        let groups = blocks.get().groups();
        let found: Vec<usize> = groups.iter().map(|g| g.len()).collect();
        let kept = slf
            .try_borrow()?
            .inner
            .truncated_hits(&found, num_computed_tokens)
            .py()?;
        Self::blocks_of(slf, groups.iter().zip(kept).map(|(g, n)| &g[..n]))
    }

    /// vLLM's ``get_num_common_prefix_blocks``: per group, under vLLM 0.31 the leading
    /// blocks of the request's table that every request holding a table shares (an
    /// unknown request gets empty tables first, as vLLM's ``defaultdict`` gives it
    /// one); 0 under later releases.
    fn num_common_prefix_blocks(&mut self, request_id: &str) -> Vec<usize> {
        self.inner.num_common_prefix_blocks(request_id)
    }

    /// The ids of the requests with a table in group ``group_id``.
    fn request_ids(&self, group_id: usize) -> Vec<String> {
        self.inner
            .request_ids(group_id)
            .map(str::to_owned)
            .collect()
    }

    /// The request's table in group ``group_id`` (``None`` without one).
    fn group_table(&self, request_id: &str, group_id: usize) -> Option<Vec<u32>> {
        self.inner
            .group_table(request_id, group_id)
            .map(<[u32]>::to_vec)
    }

    /// Each request's cached-block count in group ``group_id``, as pairs.
    fn cached_block_counts(&self, group_id: usize) -> Vec<(String, usize)> {
        self.inner
            .cached_block_counts(group_id)
            .map(|(id, n)| (id.to_owned(), n))
            .collect()
    }

    /// Block ``block_id`` of the pool, as vLLM's ``KVCacheBlock`` reads (live).
    fn block(slf: &Bound<'_, Self>, block_id: i64) -> PyResult<PyBlockView> {
        let block_id = slf
            .try_borrow()?
            .inner
            .block_pool()
            .check_id(block_id)
            .py()?;
        Ok(block_view(
            slf.py(),
            &PoolHandle::new(slf.clone().unbind()),
            block_id,
        ))
    }

    /// The request's tables, one per group.
    fn get_blocks(slf: &Bound<'_, Self>, request_id: &str) -> PyResult<Py<PyKVCacheBlocks>> {
        let groups: Vec<Vec<u32>> = slf
            .try_borrow()?
            .inner
            .get_block_ids(request_id)
            .into_iter()
            .map(<[u32]>::to_vec)
            .collect();
        Self::blocks_of(slf, groups.iter().map(Vec::as_slice))
    }

    /// The blocks covering the first ``num_computed_tokens`` tokens, per group.
    fn get_block_ids_for_computed_tokens<'py>(
        slf: PyRef<'py, Self>,
        request_id: &str,
        num_computed_tokens: i64,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let lists = slf
            .inner
            .block_ids_for_computed_tokens(request_id, num_computed_tokens)
            .into_iter()
            .map(|ids| PyList::new(py, ids))
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, lists)
    }

    /// The tokens the request's cached blocks cover (vLLM's ``estimate_cached_tokens``).
    fn estimate_cached_tokens(&self, request: &Bound<'_, PyAny>) -> PyResult<i64> {
        let fields = RequestFields::read(request, FieldSet::ID)?;
        Ok(self.inner.estimate_cached_tokens(fields.id()))
    }

    /// vLLM's ``coordinator.get_num_blocks_to_allocate`` (``new_computed_blocks`` as
    /// block objects or ids, one sequence per group).
    #[pyo3(signature = (
        request_id, num_tokens, new_computed_blocks, total_computed_tokens=0,
        apply_admission_cap=false
    ))]
    fn num_blocks_to_allocate(
        slf: &Bound<'_, Self>,
        request_id: &str,
        num_tokens: i64,
        new_computed_blocks: &Bound<'_, PyAny>,
        total_computed_tokens: i64,
        apply_admission_cap: bool,
    ) -> PyResult<i64> {
        let hits = Self::checked_ids(slf, new_computed_blocks)?;
        slf.try_borrow()?
            .inner
            .num_blocks_to_allocate(
                request_id,
                num_tokens,
                &hits,
                total_computed_tokens,
                apply_admission_cap,
            )
            .py()
    }

    /// Drops the given blocks' hashes from the prefix cache, as vLLM's pool does.
    fn evict_blocks(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = int_column(block_ids)?;
        self.inner.evict_blocks(&ids).py().map(drop)
    }

    /// Empties the prefix cache if no block is in use.
    fn reset_prefix_cache(&mut self) -> bool {
        self.inner.reset_prefix_cache()
    }

    /// The KV cache events recorded since the last call, as vLLM's event classes.
    fn take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        take_events(py, self)
    }

    /// Checks the core's invariants (for tests).
    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().py()
    }
}
