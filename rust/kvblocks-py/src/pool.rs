//! `BlockPool` and `KVCacheBlock` for Python: argument conversion around
//! `kvblocks_core::pool::BlockPool`.

use kvblocks_core::pool::{BlockInfo, BlockPool as CorePool};
use kvblocks_core::BlockHash;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::convert::int_column;
use crate::errors::IntoPyResult;
use crate::manager::PyKVCacheManager;

/// Converts one Python block hash (`bytes`) into a core `BlockHash`.
pub fn block_hash(obj: &Bound<'_, PyAny>) -> PyResult<BlockHash> {
    let bytes = obj.cast::<PyBytes>().map_err(|_| {
        PyTypeError::new_err(format!(
            "block hash must be bytes, got {}",
            obj.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string())
        ))
    })?;
    BlockHash::new(bytes.as_bytes()).py()
}

/// Converts a group id, with the reference's messages for values outside `u32`.
fn group_id(value: i64, name: &'static str) -> PyResult<u32> {
    if value < 0 {
        return Err(kvblocks_core::Error::Negative { name, value }).py();
    }
    u32::try_from(value).map_err(|_| {
        pyo3::exceptions::PyValueError::new_err(format!("{name} must be at most {}, got {value}", u32::MAX))
    })
}

/// A read-only snapshot of one block, as returned by ``BlockPool.get_block``.
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
    #[pyo3(signature = (block_id, ref_cnt, block_hash, group_id, is_null))]
    fn new(block_id: u32, ref_cnt: u32, block_hash: Option<Vec<u8>>, group_id: Option<u32>, is_null: bool) -> Self {
        Self { block_id, ref_cnt, block_hash, group_id, is_null }
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
        let group = self.group_id.map_or_else(|| "None".to_owned(), |g| g.to_string());
        let is_null = if self.is_null { "True" } else { "False" };
        Ok(format!(
            "KVCacheBlock(block_id={}, ref_cnt={}, block_hash={hash}, group_id={group}, is_null={is_null})",
            self.block_id, self.ref_cnt
        ))
    }
}

/// Where a Python `BlockPool` object's state lives.
enum PoolSource {
    /// A pool created by `BlockPool(...)`.
    Own(CorePool),
    /// The pool inside a `KVCacheManager` (its `block_pool` attribute): a view that
    /// borrows the manager for each call, so both always see the same state.
    Manager(Py<PyKVCacheManager>),
}

/// A fixed set of KV cache blocks with ref counts, an LRU free queue and a prefix cache.
#[pyclass(module = "kvblocks._native", name = "BlockPool")]
pub struct PyBlockPool {
    source: PoolSource,
    block_size: i64,
}

impl PyBlockPool {
    /// The view of a manager's pool.
    pub fn of_manager(manager: Py<PyKVCacheManager>, block_size: i64) -> Self {
        Self { source: PoolSource::Manager(manager), block_size }
    }

    fn with<R>(&self, py: Python<'_>, f: impl FnOnce(&CorePool) -> R) -> R {
        match &self.source {
            PoolSource::Own(pool) => f(pool),
            PoolSource::Manager(m) => f(m.bind(py).borrow().inner.block_pool()),
        }
    }

    fn with_mut<R>(&mut self, py: Python<'_>, f: impl FnOnce(&mut CorePool) -> R) -> R {
        match &mut self.source {
            PoolSource::Own(pool) => f(pool),
            PoolSource::Manager(m) => f(m.bind(py).borrow_mut().inner.block_pool_mut()),
        }
    }
}

#[pymethods]
impl PyBlockPool {
    #[new]
    #[pyo3(signature = (num_blocks, enable_caching=true, *, block_size=16))]
    fn new(num_blocks: i64, enable_caching: bool, block_size: i64) -> PyResult<Self> {
        if block_size <= 0 {
            return Err(kvblocks_core::Error::NonPositive { name: "block_size", value: block_size }).py();
        }
        Ok(Self { source: PoolSource::Own(CorePool::new(num_blocks, enable_caching).py()?), block_size })
    }

    /// The number of blocks, including the null block.
    #[getter]
    fn num_blocks(&self, py: Python<'_>) -> u32 {
        self.with(py, CorePool::num_blocks)
    }

    /// Whether prefix caching is on (see the class docstring).
    #[getter]
    fn enable_caching(&self, py: Python<'_>) -> bool {
        self.with(py, CorePool::enable_caching)
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> i64 {
        self.block_size
    }

    fn get_new_blocks(&mut self, py: Python<'_>, n: i64) -> PyResult<Vec<u32>> {
        self.with_mut(py, |p| p.get_new_blocks(n)).py()
    }

    fn free_blocks(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = int_column(block_ids)?;
        self.with_mut(block_ids.py(), |p| p.free_blocks(&ids)).py()
    }

    fn touch(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = int_column(block_ids)?;
        self.with_mut(block_ids.py(), |p| p.touch(&ids)).py()
    }

    #[pyo3(signature = (block_ids, block_hashes, num_cached_blocks, num_full_blocks, kv_cache_group_id=0))]
    fn cache_full_blocks(
        &mut self,
        block_ids: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        num_cached_blocks: i64,
        num_full_blocks: i64,
        kv_cache_group_id: i64,
    ) -> PyResult<()> {
        let ids = int_column(block_ids)?;
        let group = group_id(kv_cache_group_id, "kv_cache_group_id")?;
        let hashes = block_hashes
            .try_iter()?
            .map(|h| block_hash(&h?))
            .collect::<PyResult<Vec<_>>>()?;
        self.with_mut(block_ids.py(), |p| p.cache_full_blocks(&ids, &hashes, num_cached_blocks, num_full_blocks, group)).py()
    }

    #[pyo3(
        signature = (block_hash, kv_cache_group_ids=vec![0]),
        text_signature = "(self, block_hash, kv_cache_group_ids=(0,))"
    )]
    fn get_cached_block(&self, block_hash: &Bound<'_, PyAny>, kv_cache_group_ids: Vec<i64>) -> PyResult<Option<Vec<u32>>> {
        let hash = self::block_hash(block_hash)?;
        let groups = kv_cache_group_ids
            .iter()
            .map(|&g| group_id(g, "kv_cache_group_ids"))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(self.with(block_hash.py(), |p| p.get_cached_block(&hash, &groups)))
    }

    fn evict_blocks(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = int_column(block_ids)?;
        self.with_mut(block_ids.py(), |p| p.evict_blocks(&ids)).py().map(drop)
    }

    fn reset_prefix_cache(&mut self, py: Python<'_>) -> bool {
        self.with_mut(py, CorePool::reset_prefix_cache)
    }

    fn get_num_free_blocks(&self, py: Python<'_>) -> usize {
        self.with(py, CorePool::num_free_blocks)
    }

    fn get_usage(&self, py: Python<'_>) -> f64 {
        self.with(py, CorePool::usage)
    }

    fn get_block(&self, py: Python<'_>, block_id: i64) -> PyResult<PyKVCacheBlock> {
        self.with(py, |p| p.block(block_id)).py().map(PyKVCacheBlock::from)
    }

    fn free_block_ids(&self, py: Python<'_>) -> Vec<u32> {
        self.with(py, CorePool::free_block_ids)
    }

    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, CorePool::check_invariants).py()
    }
}
