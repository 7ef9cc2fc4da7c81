//! `KVCacheManager` for Python: request conversion around
//! `kvblocks_core::manager::KVCacheManager`. Block tables stay in Rust.

// The Python-visible items' docs are the reference's docstrings (reST, from
// `docstrings.rs`), not rustdoc markdown, so the markdown lint does not apply.
#![allow(clippy::doc_markdown)]

use std::sync::OnceLock;

use kvblocks_core::events::EventLog;
use kvblocks_core::manager::{KVCacheManager as CoreManager, SlotRequest};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use pyo3::{PyTraverseError, PyVisit};

use crate::convert::{self, int_column, Flag};
use crate::errors::IntoPyResult;
use crate::events::{take_events, with_request, EventSource, EventState};
use crate::pool::{pool_view, PoolHost, PyBlockPool};
use crate::request_fields::{FieldSet, RequestFields};
use crate::values::prefix_cache_stats;

#[doc = docstring!(KVCacheManager)]
#[pyclass(module = "kvblocks._native", name = "KVCacheManager", subclass)]
pub struct PyKVCacheManager {
    pub inner: CoreManager,
    block_size: i64,
    /// `Some` iff KV cache events are on.
    pub(crate) events: Option<EventState>,
    /// The `block_pool` view, made on first access and then always the same object, as
    /// the reference's attribute is. It refers back to the manager: the cycle is the
    /// garbage collector's (`__traverse__` / `__clear__` below).
    pool_view: OnceLock<Py<PyBlockPool>>,
}

impl PoolHost for PyKVCacheManager {
    fn pool(&self) -> &kvblocks_core::pool::BlockPool {
        self.inner.block_pool()
    }

    fn pool_mut(&mut self) -> &mut kvblocks_core::pool::BlockPool {
        self.inner.block_pool_mut()
    }
}

impl EventSource for PyKVCacheManager {
    fn event_parts(&mut self) -> (Option<&mut EventState>, &EventLog) {
        (self.events.as_mut(), self.inner.events())
    }

    fn clear_event_log(&mut self) {
        self.inner.clear_events();
    }
}

#[pymethods]
impl PyKVCacheManager {
    #[new]
    #[pyo3(
        signature = (
            num_blocks, block_size, *, enable_caching=Flag::TRUE, max_model_len=None,
            log_stats=Flag::FALSE, enable_kv_cache_events=Flag::FALSE,
            kv_events_last_copy_removal=Flag::FALSE
        ),
        text_signature = None
    )]
    #[allow(clippy::too_many_arguments, clippy::needless_pass_by_value)]
    pub(crate) fn new(
        py: Python<'_>,
        num_blocks: i64,
        block_size: i64,
        enable_caching: Flag,
        max_model_len: Option<i64>,
        log_stats: Flag,
        enable_kv_cache_events: Flag,
        kv_events_last_copy_removal: Flag,
    ) -> PyResult<Self> {
        let (Flag(enable_caching), Flag(log_stats)) = (enable_caching, log_stats);
        let (Flag(enable_kv_cache_events), Flag(kv_events_last_copy_removal)) =
            (enable_kv_cache_events, kv_events_last_copy_removal);
        let mut inner = CoreManager::new(
            num_blocks,
            block_size,
            enable_caching,
            max_model_len,
            log_stats,
        )
        .py()?;
        let events = if enable_kv_cache_events {
            Some(EventState::enable(
                py,
                &mut inner,
                kv_events_last_copy_removal,
            )?)
        } else {
            None
        };
        Ok(Self {
            inner,
            block_size,
            events,
            pool_view: OnceLock::new(),
        })
    }

    #[doc = docstring!(KVCacheManager.block_pool)]
    #[getter]
    fn block_pool(slf: &Bound<'_, Self>) -> PyResult<Py<PyBlockPool>> {
        let this = slf.try_borrow()?;
        pool_view(slf, &this.pool_view, this.block_size)
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(view) = self.pool_view.get() {
            visit.call(view)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.pool_view.take();
    }

    #[doc = docstring!(KVCacheManager.block_size)]
    #[getter]
    fn block_size(&self) -> i64 {
        self.block_size
    }

    #[doc = docstring!(KVCacheManager.num_kv_cache_groups)]
    #[getter]
    fn num_kv_cache_groups(&self) -> usize {
        self.inner.num_kv_cache_groups()
    }

    #[doc = docstring!(KVCacheManager.enable_caching)]
    #[getter]
    fn enable_caching(&self) -> bool {
        self.inner.enable_caching()
    }

    #[doc = docstring!(KVCacheManager.usage)]
    #[getter]
    fn usage(&self) -> f64 {
        self.inner.usage()
    }

    #[doc = docstring!(KVCacheManager.get_computed_blocks)]
    #[pyo3(text_signature = None)]
    fn get_computed_blocks(&self, request: &Bound<'_, PyAny>) -> PyResult<(Vec<u32>, usize)> {
        RequestFields::read(request, FieldSet::MANAGER)?
            .view(|view| self.inner.get_computed_blocks(view))
    }

    #[doc = docstring!(KVCacheManager.allocate_slots)]
    #[pyo3(
        signature = (
            request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
            num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=Flag::FALSE
        ),
        text_signature = None
    )]
    #[allow(clippy::too_many_arguments, clippy::needless_pass_by_value)]
    fn allocate_slots(
        &mut self,
        request: &Bound<'_, PyAny>,
        num_new_tokens: i64,
        num_new_computed_tokens: i64,
        new_computed_blocks: Option<&Bound<'_, PyAny>>,
        num_lookahead_tokens: i64,
        num_external_computed_tokens: i64,
        delay_cache_blocks: Flag,
    ) -> PyResult<Option<Vec<u32>>> {
        // Copied, not borrowed: reading the request below runs Python code, which must
        // not see (or change) an array the call still reads.
        let hits: Vec<i64> = match new_computed_blocks {
            Some(blocks) => int_column(blocks)?.into_vec(),
            None => Vec::new(),
        };
        let slots = SlotRequest {
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks: &hits,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks: delay_cache_blocks.0,
        };
        let fields = RequestFields::read(request, FieldSet::MANAGER)?;
        with_request(self, request, &fields, |this, view| {
            this.inner.allocate_slots(view, &slots)
        })
    }

    #[doc = docstring!(KVCacheManager.free)]
    #[pyo3(text_signature = None)]
    fn free(&mut self, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let fields = RequestFields::read(request, FieldSet::ID)?;
        self.inner.free(fields.id()).py()
    }

    #[doc = docstring!(KVCacheManager.cache_blocks)]
    #[pyo3(text_signature = None)]
    fn cache_blocks(
        &mut self,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: i64,
    ) -> PyResult<()> {
        let fields = RequestFields::read(request, FieldSet::MANAGER)?;
        with_request(self, request, &fields, |this, view| {
            this.inner.cache_blocks(view, num_computed_tokens)
        })
    }

    #[doc = docstring!(KVCacheManager.get_block_ids)]
    #[pyo3(text_signature = None)]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let request_id = convert::request_id(request_id.clone(), "request_id")?;
        let table = PyList::new(py, self.inner.get_block_ids(&request_id))?;
        PyTuple::new(py, [table])
    }

    #[doc = docstring!(KVCacheManager.evict_blocks)]
    #[pyo3(text_signature = None)]
    fn evict_blocks(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner
            .evict_blocks(&int_column(block_ids)?)
            .py()
            .map(drop)
    }

    #[doc = docstring!(KVCacheManager.reset_prefix_cache)]
    #[pyo3(text_signature = None)]
    fn reset_prefix_cache(&mut self) -> bool {
        self.inner.reset_prefix_cache()
    }

    #[doc = docstring!(KVCacheManager.take_events)]
    #[pyo3(text_signature = None)]
    fn take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        take_events(py, self)
    }

    #[doc = docstring!(KVCacheManager.record_prefix_cache_stats)]
    #[pyo3(text_signature = None)]
    fn record_prefix_cache_stats(
        &mut self,
        request: &Bound<'_, PyAny>,
        num_hits: i64,
    ) -> PyResult<()> {
        RequestFields::read(request, FieldSet::MANAGER)?
            .view(|view| self.inner.record_prefix_cache_stats(view, num_hits))
    }

    #[doc = docstring!(KVCacheManager.make_prefix_cache_stats)]
    #[pyo3(text_signature = None)]
    fn make_prefix_cache_stats<'py>(
        &mut self,
        py: Python<'py>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        self.inner
            .make_prefix_cache_stats()
            .map(|stats| prefix_cache_stats(py, stats))
            .transpose()
    }
}
