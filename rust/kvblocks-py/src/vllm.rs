//! vLLM 0.33.0's `KVCacheManager` surface for `kvblocks.vllm`: the native manager with
//! the Scheduler's arguments and result shapes. Every decision is the core's; this
//! module reads vLLM's `Request` (its block hashes once each, kept per request until it
//! is freed) and hands block ids back in `KVCacheBlocks`, whose block views are built
//! only when a connector reads `.blocks`.

// The `///` comments of the Python-visible items are docstrings (reST, Google style),
// not rustdoc markdown.
#![allow(clippy::doc_markdown)]

use std::cell::RefCell;
use std::ops::Range;

use hashbrown::HashMap;
use kvblocks_core::events::EventLog;
use kvblocks_core::manager::{Lookup, ReleaseRules, SlotRequest, Tolerance};
use kvblocks_core::pool::{BlockInfo, BlockPool, NULL_BLOCK_ID};
use kvblocks_core::request::{HashSource, RequestView};
use kvblocks_core::BlockHash;
use pyo3::exceptions::{PyAssertionError, PyIndexError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PySequence, PyString, PyTuple};
use rustc_hash::FxBuildHasher;

use crate::convert::{int_column, to_list, Flag};
use crate::errors::IntoPyResult;
use crate::events::{EventState, RequestTokens};
use crate::manager::{PyHashes, PyKVCacheManager};
use crate::vllm_hybrid::PyHybridManager;

/// The block hashes of one request converted so far, and the `block_hashes` item the
/// last of them was read from.
#[derive(Default)]
pub(crate) struct HashCache {
    hashes: Vec<BlockHash>,
    last: Option<Py<PyAny>>,
}

impl HashCache {
    /// Keeps what is still current. vLLM appends to `request.block_hashes`, but also
    /// cuts its tail and regrows it (a streaming session's update) or rebuilds it: then
    /// the item the last cached hash came from is no longer in its place (an identity
    /// test, one item per call), and the cache starts over.
    pub(crate) fn sync(&mut self, source: &PyHashes<'_>) -> PyResult<()> {
        if self.hashes.len() > source.num_hashes() {
            self.hashes.truncate(source.num_hashes());
            self.last = self
                .hashes
                .len()
                .checked_sub(1)
                .map(|i| source.item(i))
                .transpose()?
                .flatten()
                .map(Bound::unbind);
        }
        let Some(i) = self.hashes.len().checked_sub(1) else {
            return Ok(());
        };
        let current = source.item(i)?;
        if current.as_ref().map(Bound::as_ptr) != self.last.as_ref().map(Py::as_ptr) {
            self.hashes.clear();
            self.last = None;
        }
        Ok(())
    }
}

/// A request's block hashes: those read before from its [`HashCache`], the rest
/// converted from `request.block_hashes` as the core asks for them and added to it.
pub(crate) struct CachedHashes<'a, 'py> {
    pub(crate) source: PyHashes<'py>,
    pub(crate) cache: RefCell<&'a mut HashCache>,
}

impl CachedHashes<'_, '_> {
    /// Converts the hashes up to `end` that the cache does not hold yet.
    fn fill(&self, end: usize) -> kvblocks_core::Result<()> {
        let mut cache = self.cache.borrow_mut();
        let start = cache.hashes.len();
        if start < end {
            self.source.hashes(start..end, &mut cache.hashes)?;
            match self.source.item(end - 1) {
                Ok(item) => cache.last = item.map(Bound::unbind),
                Err(err) => {
                    cache.hashes.truncate(start);
                    return Err(self.source.keep(err));
                }
            }
        }
        Ok(())
    }
}

/// What [`with_request_view`] needs of a manager: its event state (`None` while events
/// are off) and the core's event log.
pub(crate) trait RequestEvents {
    fn event_parts(&mut self) -> (Option<&mut EventState>, &EventLog);
}

impl RequestEvents for PyKVCacheManager {
    fn event_parts(&mut self) -> (Option<&mut EventState>, &EventLog) {
        (self.events.as_mut(), self.inner.events())
    }
}

/// Runs `f` on `manager` with a view of `request` (read as `req`): its hashes come from
/// `cache`, synced first and filled as the core asks; with events on, its tokens are
/// read as the core records `BlockStored`s, whose request fields are attached after.
pub(crate) fn with_request_view<M: RequestEvents, T>(
    manager: &mut M,
    cache: &mut HashCache,
    request: &Bound<'_, PyAny>,
    req: VllmRequest<'_>,
    f: impl FnOnce(&mut M, &RequestView<'_, dyn HashSource + '_>) -> kvblocks_core::Result<T>,
) -> PyResult<T> {
    cache.sync(&req.block_hashes)?;
    let id = req.request_id.to_str()?;
    let hashes = CachedHashes {
        source: req.block_hashes,
        cache: RefCell::new(cache),
    };
    let (state, log) = manager.event_parts();
    let tokens = RequestTokens::new(state.as_deref(), request);
    let before = log.len();
    let view = RequestView {
        request_id: id,
        num_tokens: req.num_tokens,
        num_computed_tokens: req.num_computed_tokens,
        block_hashes: &hashes as &dyn HashSource,
    };
    let result = hashes
        .source
        .finish(tokens.run(&view, |view| f(manager, view)));
    let (state, log) = manager.event_parts();
    tokens.finish(result, state, log, before)
}

impl HashSource for CachedHashes<'_, '_> {
    fn num_hashes(&self) -> usize {
        self.source.num_hashes()
    }

    fn hashes(&self, range: Range<usize>, out: &mut Vec<BlockHash>) -> kvblocks_core::Result<()> {
        self.fill(range.end)?;
        self.cache.borrow().hashes.as_slice().hashes(range, out)
    }

    fn hash(&self, i: usize) -> kvblocks_core::Result<BlockHash> {
        self.fill(i + 1)?;
        self.cache.borrow().hashes.as_slice().hash(i)
    }
}

/// What the manager reads of a vLLM `Request`, read once per call.
pub(crate) struct VllmRequest<'py> {
    pub(crate) request_id: Bound<'py, PyString>,
    pub(crate) num_tokens: i64,
    pub(crate) num_computed_tokens: i64,
    pub(crate) block_hashes: PyHashes<'py>,
}

impl<'py> VllmRequest<'py> {
    pub(crate) fn read(request: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = request.py();
        let attr = |name: &Bound<'py, PyString>| request.getattr(name).map_err(|e| named(name, &e));
        let hashes = intern!(py, "block_hashes");
        let id = intern!(py, "request_id");
        Ok(Self {
            block_hashes: PyHashes::of(
                attr(hashes)?
                    .cast_into::<PySequence>()
                    .map_err(|e| named(hashes, &e.into()))?,
            )?,
            request_id: attr(id)?
                .cast_into::<PyString>()
                .map_err(|e| named(id, &e.into()))?,
            num_tokens: request_attr(request, intern!(py, "num_tokens"))?,
            num_computed_tokens: request_attr(request, intern!(py, "num_computed_tokens"))?,
        })
    }
}

/// An int attribute of the request; an error names it.
pub(crate) fn request_attr(
    request: &Bound<'_, PyAny>,
    name: &Bound<'_, PyString>,
) -> PyResult<i64> {
    request
        .getattr(name)
        .and_then(|v| v.extract())
        .map_err(|e| named(name, &e))
}

/// `err`, of the same class, with a message that starts with the attribute it concerns.
fn named(name: &Bound<'_, PyString>, err: &PyErr) -> PyErr {
    let py = name.py();
    let message = format!("request.{name}: {}", err.value(py));
    match err.get_type(py).call1((message,)) {
        Ok(value) => PyErr::from_value(value),
        Err(_) => err.clone_ref(py),
    }
}

/// `request.request_id`.
pub(crate) fn request_id(request: &Bound<'_, PyAny>) -> PyResult<String> {
    request
        .getattr(intern!(request.py(), "request_id"))?
        .extract()
}

/// `getattr(request, name, False)`, by truthiness.
pub(crate) fn request_flag(
    request: &Bound<'_, PyAny>,
    name: &Bound<'_, PyString>,
) -> PyResult<bool> {
    request
        .getattr_opt(name)?
        .map_or(Ok(false), |v| v.is_truthy())
}

/// The manager whose pool a result's blocks are in.
pub(crate) enum PoolOwner {
    Single(Py<PyVllmManager>),
    Hybrid(Py<PyHybridManager>),
}

impl PoolOwner {
    fn clone_ref(&self, py: Python<'_>) -> Self {
        match self {
            Self::Single(m) => Self::Single(m.clone_ref(py)),
            Self::Hybrid(m) => Self::Hybrid(m.clone_ref(py)),
        }
    }

    /// Runs `f` on the owner's pool.
    fn with_pool<R>(&self, py: Python<'_>, f: impl FnOnce(&BlockPool) -> R) -> PyResult<R> {
        match self {
            Self::Single(m) => Ok(f(m.bind(py).try_borrow()?.as_super().inner.block_pool())),
            Self::Hybrid(m) => Ok(f(m.bind(py).try_borrow()?.core().block_pool())),
        }
    }

    /// A live view of block `block_id`.
    pub(crate) fn view(&self, py: Python<'_>, block_id: u32) -> PyBlockView {
        PyBlockView {
            manager: self.clone_ref(py),
            block_id,
        }
    }
}

/// The blocks of one allocation or lookup, for vLLM's Scheduler and connectors.
///
/// ``get_block_ids()`` answers from the ids held here; ``blocks`` builds one
/// :class:`KVCacheBlock` snapshot per block (with its current hash state) when read.
#[pyclass(module = "kvblocks._native", name = "KVCacheBlocks", frozen)]
pub struct PyKVCacheBlocks {
    /// Every group's ids, group after group.
    ids: Vec<u32>,
    /// Where each group's ids end in `ids`; empty for one group (all of `ids`).
    ends: Vec<usize>,
    /// The manager whose pool the blocks are in (`None` for results with no blocks).
    manager: Option<PoolOwner>,
}

impl PyKVCacheBlocks {
    /// One group's ids.
    pub(crate) fn single(ids: Vec<u32>, manager: Option<PoolOwner>) -> Self {
        Self {
            ids,
            ends: Vec::new(),
            manager,
        }
    }

    /// Several groups' ids.
    pub(crate) fn grouped<'a>(
        groups: impl IntoIterator<Item = &'a [u32]>,
        manager: Option<PoolOwner>,
    ) -> Self {
        let mut ids = Vec::new();
        let mut ends = Vec::new();
        for group in groups {
            ids.extend_from_slice(group);
            ends.push(ids.len());
        }
        Self { ids, ends, manager }
    }

    /// Each group's ids.
    pub(crate) fn groups(&self) -> Vec<&[u32]> {
        if self.ends.is_empty() {
            return vec![&self.ids];
        }
        let mut start = 0;
        self.ends
            .iter()
            .map(|&end| {
                let group = &self.ids[start..end];
                start = end;
                group
            })
            .collect()
    }

    /// Whether each block of `ids` is cached, read from the manager's pool.
    fn hashed(&self, py: Python<'_>, ids: &[u32]) -> PyResult<Vec<bool>> {
        let Some(manager) = &self.manager else {
            return Ok(vec![false; ids.len()]);
        };
        manager.with_pool(py, |pool| {
            ids.iter().map(|&b| pool.block_is_cached(b)).collect()
        })
    }

    /// The ids of the non-null blocks of `ids` without a hash, after its leading nulls.
    fn unhashed(&self, py: Python<'_>, ids: &[u32]) -> PyResult<Vec<u32>> {
        let first = ids
            .iter()
            .position(|&b| b != NULL_BLOCK_ID)
            .unwrap_or(ids.len());
        let ids = &ids[first..];
        let hashed = self.hashed(py, ids)?;
        Ok(ids
            .iter()
            .zip(hashed)
            .filter_map(|(&id, h)| (!h && id != NULL_BLOCK_ID).then_some(id))
            .collect())
    }
}

#[pymethods]
impl PyKVCacheBlocks {
    /// The block ids, one list per KV cache group: ``([ids...], ...)``.
    ///
    /// Args:
    ///     allow_none: Return ``None`` when every selected group is empty.
    ///     group_ids: The groups to include; all by default.
    #[pyo3(
        signature = (allow_none=Flag::FALSE, *, group_ids=None),
        text_signature = "(self, allow_none=False, *, group_ids=None)"
    )]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        allow_none: Flag,
        group_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let groups = self.groups();
        let selected: Vec<&[u32]> = match group_ids {
            None => groups,
            Some(ids) => {
                let n = i64::try_from(groups.len()).unwrap_or(i64::MAX);
                let mut selected = Vec::new();
                for id in ids.try_iter()? {
                    let id: i64 = id?.extract()?;
                    // Python's tuple indexing: a negative index counts from the end.
                    let at = if id < 0 { id + n } else { id };
                    let group = usize::try_from(at)
                        .ok()
                        .and_then(|i| groups.get(i))
                        .ok_or_else(|| PyIndexError::new_err("tuple index out of range"))?;
                    selected.push(*group);
                }
                selected
            }
        };
        if allow_none.0 && selected.iter().all(|g| g.is_empty()) {
            return Ok(None);
        }
        let lists = selected
            .into_iter()
            .map(|g| PyList::new(py, g))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Some(PyTuple::new(py, lists)?))
    }

    /// The ids of the blocks that have no hash (one group only, as vLLM asserts).
    fn get_unhashed_block_ids(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let groups = self.groups();
        if groups.len() != 1 {
            return Err(PyAssertionError::new_err("Only one group is supported"));
        }
        let hashed = self.hashed(py, groups[0])?;
        Ok(groups[0]
            .iter()
            .zip(hashed)
            .filter_map(|(&id, h)| (!h).then_some(id))
            .collect())
    }

    /// Per group, the ids of the blocks without a hash, leading nulls and nulls
    /// skipped.
    fn get_unhashed_block_ids_all_groups(&self, py: Python<'_>) -> PyResult<Vec<Vec<u32>>> {
        self.groups()
            .into_iter()
            .map(|g| self.unhashed(py, g))
            .collect()
    }

    /// One sequence of block views per group, built now.
    #[getter]
    fn blocks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let groups = self.groups();
        let Some(manager) = &self.manager else {
            return PyTuple::new(py, groups.iter().map(|_| PyTuple::empty(py)));
        };
        let lists = groups
            .into_iter()
            .map(|g| PyList::new(py, g.iter().map(|&b| manager.view(py, b))))
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, lists)
    }

    /// The blocks of both, group by group.
    fn __add__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        let Ok(other) = other.cast::<Self>() else {
            return Err(PyTypeError::new_err("can only add KVCacheBlocks"));
        };
        let other = other.get();
        let manager = self
            .manager
            .as_ref()
            .or(other.manager.as_ref())
            .map(|m| m.clone_ref(py));
        let (ours, theirs) = (self.groups(), other.groups());
        let joined: Vec<Vec<u32>> = ours
            .iter()
            .zip(&theirs)
            .map(|(a, b)| a.iter().chain(b.iter()).copied().collect())
            .collect();
        if self.ends.is_empty() && other.ends.is_empty() {
            let ids = joined.into_iter().next().unwrap_or_default();
            return Ok(Self::single(ids, manager));
        }
        Ok(Self::grouped(joined.iter().map(Vec::as_slice), manager))
    }

    /// A result with no blocks, with as many groups (a method, as vLLM's).
    fn new_empty(&self) -> Self {
        Self {
            ids: Vec::new(),
            ends: vec![0; self.ends.len()],
            manager: None,
        }
    }

    fn __repr__(&self) -> String {
        let groups: Vec<String> = self.groups().iter().map(|g| format!("{g:?}")).collect();
        format!("KVCacheBlocks(block_ids=({},))", groups.join(", "))
    }
}

/// A block of the pool as vLLM's ``KVCacheBlock``: each member is read from the pool
/// when asked, so a block held across calls sees its ref count and hash change, as a
/// connector holding vLLM's own block objects does. ``block_hash`` is vLLM's
/// ``BlockHashWithGroupId`` (the hash, then the group id in 4 big-endian bytes).
#[pyclass(module = "kvblocks._native", name = "KVCacheBlockView", frozen)]
pub struct PyBlockView {
    manager: PoolOwner,
    #[pyo3(get)]
    block_id: u32,
}

impl PyBlockView {
    fn read<T>(&self, py: Python<'_>, f: impl FnOnce(BlockInfo) -> T) -> PyResult<T> {
        let info = self
            .manager
            .with_pool(py, |pool| pool.block(i64::from(self.block_id)))?
            .py()?;
        Ok(f(info))
    }
}

#[pymethods]
impl PyBlockView {
    /// References held (requests, and pins by connectors).
    #[getter]
    fn ref_cnt(&self, py: Python<'_>) -> PyResult<u32> {
        self.read(py, |b| b.ref_cnt)
    }

    /// vLLM's ``BlockHashWithGroupId`` while the block is cached, else ``None``.
    #[getter]
    fn block_hash<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let hash = self.read(py, |b| {
            b.block_hash
                .zip(b.group_id)
                .map(|(h, g)| h.with_group_id(g))
        })?;
        Ok(hash.map(|h| PyBytes::new(py, &h)))
    }

    /// Whether this is the null block (block 0).
    #[getter]
    fn is_null(&self) -> bool {
        self.block_id == NULL_BLOCK_ID
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let ref_cnt = self.ref_cnt(py)?;
        Ok(format!(
            "KVCacheBlockView(block_id={}, ref_cnt={ref_cnt})",
            self.block_id
        ))
    }
}

/// The native half of ``kvblocks.vllm.KVCacheManager``: vLLM 0.33.0's
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
///     caps_caching_at_hashed_tokens: vLLM 0.33 on: ``cache_blocks`` caches no block
///         past the request's hashed tokens (``False``: the rule of 0.31 and 0.32).
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
            PyKVCacheBlocks::single(ids, Some(PoolOwner::Single(slf.clone().unbind()))),
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
            caps_caching_at_hashed_tokens=Flag::TRUE
        ),
        text_signature = "(num_blocks, block_size, max_model_len, *, enable_caching=True, log_stats=False, enable_kv_cache_events=False, watermark=0.0, admission_statuses, event_structs=None, kv_cache_spec_kind=None, caps_caching_at_hashed_tokens=True)"
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
        caps_caching_at_hashed_tokens: Flag,
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
        base.inner.set_release_rules(ReleaseRules {
            caps_caching_at_hashed_tokens: caps_caching_at_hashed_tokens.0,
        });
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
        // The status matters only under a watermark: read it only then.
        let watermarked = slf.try_borrow()?.as_super().inner.watermark_blocks() > 0;
        let admitting = if has_scheduled_reqs.0 && watermarked {
            let status = request_attr(request, intern!(slf.py(), "status"))?;
            slf.try_borrow()?.admission_statuses.contains(&status)
        } else {
            false
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
        let owner = PoolOwner::Single(slf.clone().unbind());
        let views = blocks.into_iter().map(|b| owner.view(slf.py(), b));
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

    /// The leading blocks of the request's table that every request holding a table
    /// shares (vLLM 0.31's cascade-attention count); an unknown request gets an empty
    /// table first, as vLLM's ``defaultdict`` gives it one.
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
        Ok(PoolOwner::Single(slf.clone().unbind()).view(slf.py(), block_id))
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
