//! `BlockPool` and `KVCacheBlock` for Python: argument conversion around
//! `kvblocks_core::pool::BlockPool`.

// The Python-visible items' docs are the reference's docstrings (reST, from
// `docstrings.rs`), not rustdoc markdown, so the markdown lint does not apply.
#![allow(clippy::doc_markdown)]

use kvblocks_core::pool::{BlockInfo, BlockPool as CorePool};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use pyo3::{PyTraverseError, PyVisit};

use crate::convert::{
    block_hash, hash_bytes, int_column, to_list, BoolField, Flag, Given, HashSeq, IntColumn,
};
use crate::errors::{IntoPyResult, StashedError};
use crate::manager::PyKVCacheManager;
use crate::vllm::PyHybridManager;

#[doc = docstring!(KVCacheBlock)]
#[pyclass(module = "kvblocks._native", name = "KVCacheBlock", frozen, eq, hash)]
#[derive(PartialEq, Eq, Hash)]
pub struct PyKVCacheBlock {
    #[pyo3(get)]
    block_id: u32,
    #[pyo3(get)]
    ref_cnt: u32,
    block_hash: Option<Vec<u8>>,
    #[pyo3(get)]
    group_id: Option<u32>,
    #[pyo3(get)]
    is_null: bool,
}

impl From<BlockInfo> for PyKVCacheBlock {
    fn from(info: BlockInfo) -> Self {
        Self {
            block_id: info.block_id,
            ref_cnt: info.ref_cnt,
            block_hash: info.block_hash.map(|h| h.as_bytes().to_vec()),
            group_id: info.group_id,
            is_null: info.is_null,
        }
    }
}

#[pymethods]
impl PyKVCacheBlock {
    #[new]
    #[pyo3(signature = (block_id, ref_cnt, block_hash, group_id, is_null), text_signature = None)]
    fn new(
        block_id: u32,
        ref_cnt: u32,
        block_hash: Option<&Bound<'_, PyAny>>,
        group_id: Option<u32>,
        is_null: BoolField,
    ) -> PyResult<Self> {
        let BoolField(is_null) = is_null;
        let block_hash = block_hash
            .map(|h| hash_bytes(h).map(|hash| hash.as_bytes().to_vec()))
            .transpose()?;
        Ok(Self {
            block_id,
            ref_cnt,
            block_hash,
            group_id,
            is_null,
        })
    }

    #[getter]
    fn block_hash<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.block_hash.as_deref().map(|h| PyBytes::new(py, h))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let hash = match self.block_hash(py) {
            Some(h) => h.repr()?.to_string(),
            None => "None".to_owned(),
        };
        let group = self
            .group_id
            .map_or_else(|| "None".to_owned(), |g| g.to_string());
        let is_null = if self.is_null { "True" } else { "False" };
        Ok(format!(
            "KVCacheBlock(block_id={}, ref_cnt={}, block_hash={hash}, group_id={group}, is_null={is_null})",
            self.block_id, self.ref_cnt
        ))
    }
}

/// Where a Python `BlockPool` object's state lives.
// One per Python object, so the size of the inline pool costs nothing worth a box and
// the indirection it would add to every call.
#[allow(clippy::large_enum_variant)]
enum PoolSource {
    /// A pool created by `BlockPool(...)`.
    Own(CorePool),
    /// The pool inside a `KVCacheManager` (its `block_pool` attribute): a view that
    /// borrows the manager for each call, so both always see the same state.
    Manager(Py<PyKVCacheManager>),
    /// The pool inside `kvblocks.vllm`'s multi-group manager, viewed the same way.
    Hybrid(Py<PyHybridManager>),
}

#[doc = docstring!(BlockPool)]
#[pyclass(module = "kvblocks._native", name = "BlockPool")]
pub struct PyBlockPool {
    source: PoolSource,
    block_size: i64,
}

impl PyBlockPool {
    /// The view of a manager's pool.
    pub fn of_manager(manager: Py<PyKVCacheManager>, block_size: i64) -> Self {
        Self {
            source: PoolSource::Manager(manager),
            block_size,
        }
    }

    /// The view of a multi-group manager's pool.
    pub fn of_hybrid(manager: Py<PyHybridManager>, block_size: i64) -> Self {
        Self {
            source: PoolSource::Hybrid(manager),
            block_size,
        }
    }

    /// Runs `f` on the pool. A manager's pool is borrowed from the manager for the
    /// call; if the manager is itself in the middle of a call (Python code it ran, such
    /// as a request's `block_hashes`, reached back into the pool), this raises
    /// `RuntimeError` instead of touching state that call is changing.
    fn with<R>(&self, py: Python<'_>, f: impl FnOnce(&CorePool) -> R) -> PyResult<R> {
        match &self.source {
            PoolSource::Own(pool) => Ok(f(pool)),
            PoolSource::Manager(m) => Ok(f(m.bind(py).try_borrow()?.inner.block_pool())),
            PoolSource::Hybrid(m) => Ok(f(m.bind(py).try_borrow()?.core().block_pool())),
        }
    }

    /// [`Self::with`] for calls that change the pool.
    fn with_mut<R>(&mut self, py: Python<'_>, f: impl FnOnce(&mut CorePool) -> R) -> PyResult<R> {
        match &mut self.source {
            PoolSource::Own(pool) => Ok(f(pool)),
            PoolSource::Manager(m) => Ok(f(m.bind(py).try_borrow_mut()?.inner.block_pool_mut())),
            PoolSource::Hybrid(m) => {
                Ok(f(m.bind(py).try_borrow_mut()?.core_mut().block_pool_mut()))
            }
        }
    }
}

#[pymethods]
impl PyBlockPool {
    /// A manager's view refers to its manager (and the manager to its view).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        match &self.source {
            PoolSource::Manager(manager) => visit.call(manager)?,
            PoolSource::Hybrid(manager) => visit.call(manager)?,
            PoolSource::Own(_) => {}
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
    fn get_block(&self, py: Python<'_>, block_id: i64) -> PyResult<PyKVCacheBlock> {
        self.with(py, |p| p.block(block_id))?
            .py()
            .map(PyKVCacheBlock::from)
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
