//! `KVCacheManager` and `PrefixCacheStats` for Python: request conversion around
//! `kvblocks_core::manager::KVCacheManager`. Block tables stay in Rust.

use std::cell::RefCell;
use std::ops::Range;

use kvblocks_core::manager::{
    HashSource, KVCacheManager as CoreManager, PrefixCacheStats, RequestView, SlotRequest,
};
use kvblocks_core::{BlockHash, Error};
use pyo3::prelude::*;
use pyo3::types::{PyList, PySequence, PyTuple};

use crate::convert::{int_column, IntColumn};
use crate::errors::IntoPyResult;
use crate::pool::{block_hash, PyBlockPool};
use crate::request::PyRequest;

/// A duck-typed request's `block_hashes`, converted lazily: the manager asks only for
/// the ranges a call needs. A Python error met while converting is kept and re-raised
/// as it was, after the core call returned (having changed nothing).
struct PyHashes<'py> {
    seq: Bound<'py, PySequence>,
    len: usize,
    error: RefCell<Option<PyErr>>,
}

impl<'py> PyHashes<'py> {
    fn new(request: &Bound<'py, PyAny>) -> PyResult<Self> {
        let seq = request.getattr("block_hashes")?.cast_into::<PySequence>()?;
        let len = seq.len()?;
        Ok(Self { seq, len, error: RefCell::new(None) })
    }

    /// The core result, or the Python error the conversion hit.
    fn finish<T>(&self, result: kvblocks_core::Result<T>) -> PyResult<T> {
        if let Some(err) = self.error.borrow_mut().take() {
            return Err(err);
        }
        result.py()
    }
}

impl HashSource for PyHashes<'_> {
    fn num_hashes(&self) -> usize {
        self.len
    }

    fn hashes(&self, range: Range<usize>, out: &mut Vec<BlockHash>) -> kvblocks_core::Result<()> {
        for i in range {
            match self.seq.get_item(i).and_then(|h| block_hash(&h)) {
                Ok(h) => out.push(h),
                Err(err) => {
                    *self.error.borrow_mut() = Some(err);
                    return Err(Error::InvalidArgument("block hash conversion failed".to_owned()));
                }
            }
        }
        Ok(())
    }
}

/// A native request's hashes, already converted.
struct SliceHashes<'a>(&'a [BlockHash]);

impl HashSource for SliceHashes<'_> {
    fn num_hashes(&self) -> usize {
        self.0.num_hashes()
    }

    fn hashes(&self, range: Range<usize>, out: &mut Vec<BlockHash>) -> kvblocks_core::Result<()> {
        self.0.hashes(range, out)
    }
}

/// What the manager reads of a request: a native `Request` is read in place, any other
/// object through `request_id`, `num_tokens`, `num_computed_tokens` and `block_hashes`.
enum RequestArg<'py> {
    Native(PyRef<'py, PyRequest>),
    Duck { request_id: String, num_tokens: i64, num_computed_tokens: i64, hashes: PyHashes<'py> },
}

impl<'py> RequestArg<'py> {
    fn new(request: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(native) = request.cast::<PyRequest>() {
            return Ok(Self::Native(native.borrow()));
        }
        Ok(Self::Duck {
            request_id: request.getattr("request_id")?.extract()?,
            num_tokens: request.getattr("num_tokens")?.extract()?,
            num_computed_tokens: request.getattr("num_computed_tokens")?.extract()?,
            hashes: PyHashes::new(request)?,
        })
    }

    /// Runs `f` on the request's view and maps its result (or a conversion error).
    fn with<T>(
        &self,
        f: impl FnOnce(&RequestView<'_, dyn HashSource + '_>) -> kvblocks_core::Result<T>,
    ) -> PyResult<T> {
        match self {
            Self::Native(r) => {
                let hashes = SliceHashes(r.block_hashes());
                f(&RequestView {
                    request_id: r.request_id(),
                    num_tokens: r.num_tokens(),
                    num_computed_tokens: r.num_computed_tokens(),
                    block_hashes: &hashes as &dyn HashSource,
                })
                .py()
            }
            Self::Duck { request_id, num_tokens, num_computed_tokens, hashes } => {
                let view = RequestView {
                    request_id,
                    num_tokens: *num_tokens,
                    num_computed_tokens: *num_computed_tokens,
                    block_hashes: hashes as &dyn HashSource,
                };
                hashes.finish(f(&view))
            }
        }
    }
}

/// Prefix-cache counters since the last ``KVCacheManager.make_prefix_cache_stats()``.
#[pyclass(module = "kvblocks._native", name = "PrefixCacheStats", frozen, eq)]
#[derive(PartialEq, Eq)]
pub struct PyPrefixCacheStats {
    #[pyo3(get)]
    requests: u64,
    #[pyo3(get)]
    queries: u64,
    #[pyo3(get)]
    hits: u64,
}

#[pymethods]
impl PyPrefixCacheStats {
    #[new]
    #[pyo3(signature = (requests=0, queries=0, hits=0))]
    fn new(requests: u64, queries: u64, hits: u64) -> Self {
        Self { requests, queries, hits }
    }

    fn __repr__(&self) -> String {
        format!(
            "PrefixCacheStats(requests={}, queries={}, hits={})",
            self.requests, self.queries, self.hits
        )
    }
}

impl From<PrefixCacheStats> for PyPrefixCacheStats {
    fn from(s: PrefixCacheStats) -> Self {
        Self { requests: s.requests, queries: s.queries, hits: s.hits }
    }
}

/// Block tables of running requests over a :class:`BlockPool`, with prefix caching.
#[pyclass(module = "kvblocks._native", name = "KVCacheManager")]
pub struct PyKVCacheManager {
    pub inner: CoreManager,
    block_size: i64,
}

#[pymethods]
impl PyKVCacheManager {
    #[new]
    #[pyo3(signature = (
        num_blocks, block_size, *, enable_caching=true, max_model_len=None, log_stats=false,
        enable_kv_cache_events=false
    ))]
    fn new(
        num_blocks: i64,
        block_size: i64,
        enable_caching: bool,
        max_model_len: Option<i64>,
        log_stats: bool,
        enable_kv_cache_events: bool,
    ) -> PyResult<Self> {
        // Events arrive with the KV-cache-events work; the flag is accepted for vLLM's
        // signature and `take_events()` returns nothing until then.
        let _ = enable_kv_cache_events;
        let inner =
            CoreManager::new(num_blocks, block_size, enable_caching, max_model_len, log_stats)
                .py()?;
        Ok(Self { inner, block_size })
    }

    /// The pool the block tables draw from.
    #[getter]
    fn block_pool(slf: &Bound<'_, Self>) -> PyBlockPool {
        let block_size = slf.borrow().block_size;
        PyBlockPool::of_manager(slf.clone().unbind(), block_size)
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> i64 {
        self.block_size
    }

    /// Always 1: one full-attention group.
    #[getter]
    fn num_kv_cache_groups(&self) -> usize {
        self.inner.num_kv_cache_groups()
    }

    /// Whether prefix caching is on.
    #[getter]
    fn enable_caching(&self) -> bool {
        self.inner.enable_caching()
    }

    /// The pool's usage, ``1 - free / (num_blocks - 1)``.
    #[getter]
    fn usage(&self) -> f64 {
        self.inner.usage()
    }

    fn get_computed_blocks(&self, request: &Bound<'_, PyAny>) -> PyResult<(Vec<u32>, usize)> {
        RequestArg::new(request)?.with(|view| self.inner.get_computed_blocks(view))
    }

    #[pyo3(signature = (
        request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
        num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots(
        &mut self,
        request: &Bound<'_, PyAny>,
        num_new_tokens: i64,
        num_new_computed_tokens: i64,
        new_computed_blocks: Option<&Bound<'_, PyAny>>,
        num_lookahead_tokens: i64,
        num_external_computed_tokens: i64,
        delay_cache_blocks: bool,
    ) -> PyResult<Option<Vec<u32>>> {
        let hits = match new_computed_blocks {
            Some(blocks) => int_column(blocks)?,
            None => IntColumn::Owned(Vec::new()),
        };
        let slots = SlotRequest {
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks: &hits,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
        };
        RequestArg::new(request)?.with(|view| self.inner.allocate_slots(view, &slots))
    }

    fn free(&mut self, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let request_id = match request.cast::<PyRequest>() {
            Ok(native) => native.borrow().request_id().to_owned(),
            Err(_) => request.getattr("request_id")?.extract()?,
        };
        self.inner.free(&request_id).py()
    }

    fn cache_blocks(&mut self, request: &Bound<'_, PyAny>, num_computed_tokens: i64) -> PyResult<()> {
        RequestArg::new(request)?.with(|view| self.inner.cache_blocks(view, num_computed_tokens))
    }

    fn get_block_ids<'py>(&self, py: Python<'py>, request_id: &str) -> PyResult<Bound<'py, PyTuple>> {
        let table = PyList::new(py, self.inner.get_block_ids(request_id))?;
        PyTuple::new(py, [table])
    }

    fn evict_blocks(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.evict_blocks(&int_column(block_ids)?).py().map(drop)
    }

    fn reset_prefix_cache(&mut self) -> bool {
        self.inner.reset_prefix_cache()
    }

    fn take_events<'py>(&self, py: Python<'py>) -> Bound<'py, PyList> {
        PyList::empty(py)
    }

    fn record_prefix_cache_stats(&mut self, request: &Bound<'_, PyAny>, num_hits: i64) -> PyResult<()> {
        RequestArg::new(request)?.with(|view| self.inner.record_prefix_cache_stats(view, num_hits))
    }

    fn make_prefix_cache_stats(&mut self) -> Option<PyPrefixCacheStats> {
        self.inner.make_prefix_cache_stats().map(PyPrefixCacheStats::from)
    }
}
