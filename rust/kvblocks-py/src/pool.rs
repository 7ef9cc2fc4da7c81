//! `BlockPool` and `KVCacheBlock` for Python: argument conversion around
//! `kvblocks_core::pool::BlockPool`.

use kvblocks_core::pool::{BlockInfo, BlockPool as CorePool};
use kvblocks_core::BlockHash;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::convert::int_column;
use crate::errors::IntoPyResult;

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

/// Converts a group id, refusing negative values like the reference does.
fn group_id(value: i64, name: &'static str) -> PyResult<u32> {
    u32::try_from(value).map_err(|_| {
        kvblocks_core::Error::Negative { name, value }
    }).py()
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

/// A fixed set of KV cache blocks with ref counts, an LRU free queue and a prefix cache.
#[pyclass(module = "kvblocks._native", name = "BlockPool")]
pub struct PyBlockPool {
    pub inner: CorePool,
    block_size: i64,
}

#[pymethods]
impl PyBlockPool {
    #[new]
    #[pyo3(signature = (num_blocks, enable_caching=true, *, block_size=16))]
    fn new(num_blocks: i64, enable_caching: bool, block_size: i64) -> PyResult<Self> {
        if block_size <= 0 {
            return Err(kvblocks_core::Error::NonPositive { name: "block_size", value: block_size }).py();
        }
        Ok(Self { inner: CorePool::new(num_blocks, enable_caching).py()?, block_size })
    }

    /// The number of blocks, including the null block.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.num_blocks()
    }

    /// Whether prefix caching is on (see the class docstring).
    #[getter]
    fn enable_caching(&self) -> bool {
        self.inner.enable_caching()
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> i64 {
        self.block_size
    }

    fn get_new_blocks(&mut self, n: i64) -> PyResult<Vec<u32>> {
        self.inner.get_new_blocks(n).py()
    }

    fn free_blocks(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.free_blocks(&int_column(block_ids)?).py()
    }

    fn touch(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.touch(&int_column(block_ids)?).py()
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
        self.inner.cache_full_blocks(&ids, &hashes, num_cached_blocks, num_full_blocks, group).py()
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
        Ok(self.inner.get_cached_block(&hash, &groups))
    }

    fn evict_blocks(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.evict_blocks(&int_column(block_ids)?).py().map(drop)
    }

    fn reset_prefix_cache(&mut self) -> bool {
        self.inner.reset_prefix_cache()
    }

    fn get_num_free_blocks(&self) -> usize {
        self.inner.num_free_blocks()
    }

    fn get_usage(&self) -> f64 {
        self.inner.usage()
    }

    fn get_block(&self, block_id: i64) -> PyResult<PyKVCacheBlock> {
        self.inner.block(block_id).py().map(PyKVCacheBlock::from)
    }

    fn free_block_ids(&self) -> Vec<u32> {
        self.inner.free_block_ids()
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().py()
    }
}
