//! `BlockPool` for Python: argument conversion around
//! `kvblocks_core::pool::BlockPool`.

// The Python-visible items' docs are the reference's docstrings (reST, from
// `docstrings.rs`), not rustdoc markdown, so the markdown lint does not apply.
#![allow(clippy::doc_markdown)]

use kvblocks_core::pool::BlockPool as CorePool;
use std::sync::OnceLock;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::pyclass::boolean_struct::False;
use pyo3::PyClass;
use pyo3::{PyTraverseError, PyVisit};

use crate::convert::{block_hash, int_column, to_list, Flag, Given, HashSeq, IntColumn};
use crate::errors::{IntoPyResult, StashedError};
use crate::values::kv_cache_block;

/// A Python object whose state holds a core block pool (a manager), which block pool
/// views, block views and results reach through a [`PoolHandle`].
pub trait PoolHost: PyClass<Frozen = False> {
    /// The pool.
    fn pool(&self) -> &CorePool;
    /// The pool, mutably.
    fn pool_mut(&mut self) -> &mut CorePool;
}

/// A reference to a [`PoolHost`] of any type, borrowed for each call, so that every
/// holder sees the host's current state. If the host is itself in the middle of a
/// call (Python code it ran, such as a request's `block_hashes`, reached back into
/// the pool), a call raises `RuntimeError` instead of touching state that call is
/// changing.
pub struct PoolHandle {
    host: Py<PyAny>,
    read: ReadHost,
    write: WriteHost,
}

/// Borrows a host (of the type the handle was made for) and runs a call on its pool.
type ReadHost = fn(&Bound<'_, PyAny>, &mut dyn FnMut(&CorePool)) -> PyResult<()>;
/// [`ReadHost`], mutably.
type WriteHost = fn(&Bound<'_, PyAny>, &mut dyn FnMut(&mut CorePool)) -> PyResult<()>;

fn read_host<H: PoolHost>(host: &Bound<'_, PyAny>, f: &mut dyn FnMut(&CorePool)) -> PyResult<()> {
    f(host.cast::<H>()?.try_borrow()?.pool());
    Ok(())
}

fn write_host<H: PoolHost>(
    host: &Bound<'_, PyAny>,
    f: &mut dyn FnMut(&mut CorePool),
) -> PyResult<()> {
    f(host.cast::<H>()?.try_borrow_mut()?.pool_mut());
    Ok(())
}

impl PoolHandle {
    /// The handle of `host`'s pool.
    pub fn new<H: PoolHost>(host: Py<H>) -> Self {
        Self {
            host: host.into_any(),
            read: read_host::<H>,
            write: write_host::<H>,
        }
    }

    /// Another handle of the same pool.
    pub fn clone_ref(&self, py: Python<'_>) -> Self {
        Self {
            host: self.host.clone_ref(py),
            ..*self
        }
    }

    /// Runs `f` on the pool.
    pub fn with<R>(&self, py: Python<'_>, f: impl FnOnce(&CorePool) -> R) -> PyResult<R> {
        let (mut f, mut out) = (Some(f), None);
        (self.read)(self.host.bind(py), &mut |pool| {
            out = f.take().map(|f| f(pool));
        })?;
        out.ok_or_else(not_run)
    }

    /// Runs `f` on the pool, mutably.
    pub fn with_mut<R>(&self, py: Python<'_>, f: impl FnOnce(&mut CorePool) -> R) -> PyResult<R> {
        let (mut f, mut out) = (Some(f), None);
        (self.write)(self.host.bind(py), &mut |pool| {
            out = f.take().map(|f| f(pool));
        })?;
        out.ok_or_else(not_run)
    }

    /// The host, for the garbage collector.
    pub fn host(&self) -> &Py<PyAny> {
        &self.host
    }
}

/// A host's borrow returned without running the call (no host does).
fn not_run() -> PyErr {
    PyRuntimeError::new_err("the block pool's manager did not run the call")
}

/// The `block_pool` view of `host`'s pool, made on first access and kept in `cell`, so
/// that it is always the same object, as the reference's attribute is. It refers back
/// to the host: the cycle is the garbage collector's (the host's `__traverse__`).
pub fn pool_view<H: PoolHost>(
    host: &Bound<'_, H>,
    cell: &OnceLock<Py<PyBlockPool>>,
    block_size: i64,
) -> PyResult<Py<PyBlockPool>> {
    let py = host.py();
    if let Some(view) = cell.get() {
        return Ok(view.clone_ref(py));
    }
    let source = PoolSource::Host(PoolHandle::new(host.clone().unbind()));
    let view = Py::new(py, PyBlockPool { source, block_size })?;
    // A collection inside `Py::new` may run Python code that got here first: the view
    // handed out is whichever was stored.
    Ok(cell.get_or_init(|| view).clone_ref(py))
}

/// Where a Python `BlockPool` object's state lives.
// One per Python object, so the size of the inline pool costs nothing worth a box and
// the indirection it would add to every call.
#[allow(clippy::large_enum_variant)]
enum PoolSource {
    /// A pool created by `BlockPool(...)`.
    Own(CorePool),
    /// The pool inside a manager (its `block_pool` attribute).
    Host(PoolHandle),
}

#[doc = docstring!(BlockPool)]
#[pyclass(module = "kvblocks._native", name = "BlockPool")]
pub struct PyBlockPool {
    source: PoolSource,
    block_size: i64,
}

impl PyBlockPool {
    /// Runs `f` on the pool.
    fn with<R>(&self, py: Python<'_>, f: impl FnOnce(&CorePool) -> R) -> PyResult<R> {
        match &self.source {
            PoolSource::Own(pool) => Ok(f(pool)),
            PoolSource::Host(handle) => handle.with(py, f),
        }
    }

    /// [`Self::with`] for calls that change the pool.
    fn with_mut<R>(&mut self, py: Python<'_>, f: impl FnOnce(&mut CorePool) -> R) -> PyResult<R> {
        match &mut self.source {
            PoolSource::Own(pool) => Ok(f(pool)),
            PoolSource::Host(handle) => handle.with_mut(py, f),
        }
    }
}

#[pymethods]
impl PyBlockPool {
    /// A manager's view refers to its manager (and the manager to its view).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let PoolSource::Host(handle) = &self.source {
            visit.call(handle.host())?;
        }
        Ok(())
    }

    #[new]
    #[pyo3(
        signature = (num_blocks, enable_caching=Flag::TRUE, *, block_size=16),
        text_signature = None
    )]
    fn new(num_blocks: i64, enable_caching: Flag, block_size: i64) -> PyResult<Self> {
        let Flag(enable_caching) = enable_caching;
        kvblocks_core::error::positive("block_size", block_size).py()?;
        Ok(Self {
            source: PoolSource::Own(CorePool::new(num_blocks, enable_caching).py()?),
            block_size,
        })
    }

    #[doc = docstring!(BlockPool.num_blocks)]
    #[getter]
    fn num_blocks(&self, py: Python<'_>) -> PyResult<u32> {
        self.with(py, CorePool::num_blocks)
    }

    #[doc = docstring!(BlockPool.enable_caching)]
    #[getter]
    fn enable_caching(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, CorePool::enable_caching)
    }

    #[doc = docstring!(BlockPool.block_size)]
    #[getter]
    fn block_size(&self) -> i64 {
        self.block_size
    }

    #[doc = docstring!(BlockPool.get_new_blocks)]
    #[pyo3(text_signature = None)]
    fn get_new_blocks(&mut self, py: Python<'_>, n: i64) -> PyResult<Vec<u32>> {
        self.with_mut(py, |p| p.get_new_blocks(n))?.py()
    }

    #[doc = docstring!(BlockPool.free_blocks)]
    #[pyo3(text_signature = None)]
    fn free_blocks(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = int_column(block_ids)?;
        self.with_mut(block_ids.py(), |p| p.free_blocks(&ids))?.py()
    }

    #[doc = docstring!(BlockPool.touch)]
    #[pyo3(text_signature = None)]
    fn touch(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = int_column(block_ids)?;
        self.with_mut(block_ids.py(), |p| p.touch(&ids))?.py()
    }

    #[doc = docstring!(BlockPool.cache_full_blocks)]
    #[pyo3(signature = (block_ids, block_hashes, num_cached_blocks, num_full_blocks, kv_cache_group_id=0), text_signature = None)]
    fn cache_full_blocks(
        &mut self,
        block_ids: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        num_cached_blocks: i64,
        num_full_blocks: i64,
        kv_cache_group_id: i64,
    ) -> PyResult<()> {
        // The core checks everything in the reference's order, then asks for the
        // hashes of the blocks to cache only (callers pass a request's whole hash list,
        // as vLLM does).
        let py = block_ids.py();
        let ids = int_column(block_ids)?;
        let seq = HashSeq::collect(block_hashes)?;
        let num_hashes = seq.len()?;
        let error = StashedError::default();
        let result = self.with_mut(py, |p| {
            p.cache_full_blocks_with(
                &ids,
                num_hashes,
                num_cached_blocks,
                num_full_blocks,
                kv_cache_group_id,
                |range| {
                    seq.range(range)
                        .map_err(|err| error.keep(err, "block hash conversion"))
                },
            )
        })?;
        error.finish(result)
    }

    #[doc = docstring!(BlockPool.get_cached_block)]
    #[pyo3(
        signature = (block_hash, kv_cache_group_ids=Given::Absent),
        text_signature = None
    )]
    fn get_cached_block(
        &self,
        block_hash: &Bound<'_, PyAny>,
        kv_cache_group_ids: Given<'_>,
    ) -> PyResult<Option<Vec<u32>>> {
        let hash = crate::convert::block_hash(block_hash)?;
        let group_ids = match kv_cache_group_ids {
            Given::Is(ids) => int_column(&ids)?,
            Given::Absent => IntColumn::Owned(vec![0]),
        };
        let groups = group_ids
            .iter()
            .map(|&g| kvblocks_core::error::group_id("kv_cache_group_ids", g).py())
            .collect::<PyResult<Vec<_>>>()?;
        self.with(block_hash.py(), |p| p.get_cached_block(&hash, &groups))
    }

    #[doc = docstring!(BlockPool.find_longest_cache_hit)]
    #[pyo3(signature = (block_hashes, kv_cache_group_id=0), text_signature = None)]
    fn find_longest_cache_hit(
        &self,
        block_hashes: &Bound<'_, PyAny>,
        kv_cache_group_id: i64,
    ) -> PyResult<Vec<u32>> {
        let group = kvblocks_core::error::group_id("kv_cache_group_id", kv_cache_group_id).py()?;
        let py = block_hashes.py();
        if let Some(seq) = HashSeq::list_or_tuple(block_hashes) {
            let hashes = (0..seq.len()?).map(|i| seq.get(i));
            return self.with(py, |p| p.find_longest_cache_hit(hashes, group))?;
        }
        // Any other iterable is materialised first; its hashes are still converted
        // only up to the first miss.
        let items = to_list(block_hashes)?;
        let hashes = items.iter().map(|item| block_hash(&item));
        self.with(py, |p| p.find_longest_cache_hit(hashes, group))?
    }

    #[doc = docstring!(BlockPool.evict_blocks)]
    #[pyo3(text_signature = None)]
    fn evict_blocks(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = int_column(block_ids)?;
        self.with_mut(block_ids.py(), |p| p.evict_blocks(&ids))?
            .py()
            .map(drop)
    }

    #[doc = docstring!(BlockPool.reset_prefix_cache)]
    #[pyo3(text_signature = None)]
    fn reset_prefix_cache(&mut self, py: Python<'_>) -> PyResult<bool> {
        self.with_mut(py, CorePool::reset_prefix_cache)
    }

    #[doc = docstring!(BlockPool.get_num_free_blocks)]
    #[pyo3(text_signature = None)]
    fn get_num_free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, CorePool::num_free_blocks)
    }

    #[doc = docstring!(BlockPool.get_usage)]
    #[pyo3(text_signature = None)]
    fn get_usage(&self, py: Python<'_>) -> PyResult<f64> {
        self.with(py, CorePool::usage)
    }

    #[doc = docstring!(BlockPool.get_block)]
    #[pyo3(text_signature = None)]
    fn get_block<'py>(&self, py: Python<'py>, block_id: i64) -> PyResult<Bound<'py, PyAny>> {
        let block = self.with(py, |p| p.block(block_id))?.py()?;
        kv_cache_block(py, block)
    }

    #[doc = docstring!(BlockPool.free_block_ids)]
    #[pyo3(text_signature = None)]
    fn free_block_ids(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        self.with(py, CorePool::free_block_ids)
    }

    #[doc = docstring!(BlockPool.check_invariants)]
    #[pyo3(text_signature = None)]
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, CorePool::check_invariants)?.py()
    }
}
