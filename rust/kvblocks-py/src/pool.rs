//! `BlockPool` and `KVCacheBlock` for Python: argument conversion around
//! `kvblocks_core::pool::BlockPool`.

// The `///` comments of the Python-visible items are the reference's docstrings, copied
// verbatim (reST, Google style; `tests/test_parity.py` compares them), not rustdoc
// markdown, so the markdown lint does not apply to them.
#![allow(clippy::doc_markdown)]

use kvblocks_core::pool::{BlockInfo, BlockPool as CorePool};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use pyo3::{PyTraverseError, PyVisit};

use crate::convert::{
    block_hash, hash_bytes, int_column, to_list, Flag, Given, HashSeq, IntColumn,
};
use crate::errors::{IntoPyResult, StashedError};
use crate::manager::PyKVCacheManager;

/// A read-only snapshot of one block, as returned by ``BlockPool.get_block``.
///
/// Attributes:
///     block_id: The block's id, ``0 .. num_blocks - 1``.
///     ref_cnt: How many holders (block tables, touches) the block has. Always 0 for
///         the null block, whose count is not tracked.
///     block_hash: The prefix-cache hash of the block's tokens, or ``None`` when the
///         block is not cached.
///     group_id: The KV cache group the hash was cached for; ``None`` exactly when
///         ``block_hash`` is ``None``.
///     is_null: True only for block 0, the null block.
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
    fn new(
        block_id: u32,
        ref_cnt: u32,
        block_hash: Option<&Bound<'_, PyAny>>,
        group_id: Option<u32>,
        is_null: bool,
    ) -> PyResult<Self> {
        let block_hash = match block_hash {
            Some(h) if !h.is_none() => Some(hash_bytes(h)?.as_bytes().to_vec()),
            _ => None,
        };
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
}

/// A fixed set of KV cache blocks with ref counts, an LRU free queue and a prefix cache.
///
/// Block ids are ``0 .. num_blocks - 1``. Block 0 is the null block: it is never handed
/// out, never freed, never hashed and its ref count is not tracked, so a new pool has
/// ``num_blocks - 1`` free blocks, queued in ascending id order.
///
/// Args:
///     num_blocks: The number of blocks, including the null block. Must be positive.
///     enable_caching: Whether freed hashed blocks stay cached (appended to the free
///         queue, LRU) and lose their hash only when reallocated. With caching off every
///         freed block is prepended and reallocation keeps any hash, as in vLLM.
///     block_size: Tokens per block. Must be positive. Recorded for callers; the pool's
///         behaviour does not depend on it.
///
/// Raises:
///     TypeError: an argument is not an int.
///     ValueError: ``num_blocks must be positive, got {n}`` or
///         ``block_size must be positive, got {n}``.
///
/// Invariants (see :meth:`check_invariants`):
///     * the free queue holds exactly the non-null blocks with ``ref_cnt == 0``;
///     * every hashed block is in the prefix map under its key, and every map entry
///       points at a block holding that key;
///     * ref counts are never negative; the null block is never free, hashed or counted.
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

    /// Runs `f` on the pool. A manager's pool is borrowed from the manager for the
    /// call; if the manager is itself in the middle of a call (Python code it ran, such
    /// as a request's `block_hashes`, reached back into the pool), this raises
    /// `RuntimeError` instead of touching state that call is changing.
    fn with<R>(&self, py: Python<'_>, f: impl FnOnce(&CorePool) -> R) -> PyResult<R> {
        match &self.source {
            PoolSource::Own(pool) => Ok(f(pool)),
            PoolSource::Manager(m) => Ok(f(m.bind(py).try_borrow()?.inner.block_pool())),
        }
    }

    /// [`Self::with`] for calls that change the pool.
    fn with_mut<R>(&mut self, py: Python<'_>, f: impl FnOnce(&mut CorePool) -> R) -> PyResult<R> {
        match &mut self.source {
            PoolSource::Own(pool) => Ok(f(pool)),
            PoolSource::Manager(m) => Ok(f(m.bind(py).try_borrow_mut()?.inner.block_pool_mut())),
        }
    }
}

#[pymethods]
impl PyBlockPool {
    /// A manager's view refers to its manager (and the manager to its view).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let PoolSource::Manager(manager) = &self.source {
            visit.call(manager)?;
        }
        Ok(())
    }

    #[new]
    #[pyo3(
        signature = (num_blocks, enable_caching=Flag::TRUE, *, block_size=16),
        text_signature = "(num_blocks, enable_caching=True, *, block_size=16)"
    )]
    fn new(num_blocks: i64, enable_caching: Flag, block_size: i64) -> PyResult<Self> {
        let Flag(enable_caching) = enable_caching;
        kvblocks_core::error::positive("block_size", block_size).py()?;
        Ok(Self {
            source: PoolSource::Own(CorePool::new(num_blocks, enable_caching).py()?),
            block_size,
        })
    }

    /// The number of blocks, including the null block.
    #[getter]
    fn num_blocks(&self, py: Python<'_>) -> PyResult<u32> {
        self.with(py, CorePool::num_blocks)
    }

    /// Whether prefix caching is on (see the class docstring).
    #[getter]
    fn enable_caching(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, CorePool::enable_caching)
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> i64 {
        self.block_size
    }

    /// Takes ``n`` blocks from the head of the free queue.
    ///
    /// A taken block that still holds a hash loses it first when caching is on (lazy
    /// eviction). Each block's ref count becomes 1. The prefix cache is not consulted.
    ///
    /// Args:
    ///     n: How many blocks to take.
    ///
    /// Returns:
    ///     The ids taken, in free-queue order.
    ///
    /// Raises:
    ///     TypeError: ``n`` is not an int.
    ///     ValueError: ``n must be non-negative, got {n}``.
    ///     NoFreeBlocksError: ``Cannot get {n} free blocks from the pool ({free} free)``.
    fn get_new_blocks(&mut self, py: Python<'_>, n: i64) -> PyResult<Vec<u32>> {
        self.with_mut(py, |p| p.get_new_blocks(n))?.py()
    }

    /// Drops one reference to each block, in eviction-priority order.
    ///
    /// Blocks reaching ref count 0 go back to the free queue: unhashed ones (or all, with
    /// caching off) are prepended, hashed ones appended, each group keeping the order
    /// given, so the first block given is reused or evicted first. Callers free a
    /// request's blocks tail first. The null block is skipped.
    ///
    /// Args:
    ///     block_ids: The ids, first to be evicted first. Any iterable of ints (a NumPy
    ///         int array too). An id may repeat up to its ref count.
    ///
    /// Raises:
    ///     TypeError: an id is not an int.
    ///     UnknownBlockError: an id is out of range.
    ///     BlockStateError: ``block {id} is already free (ref count 0)``, also when an id
    ///         repeats more often than its ref count.
    fn free_blocks(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = int_column(block_ids)?;
        self.with_mut(block_ids.py(), |p| p.free_blocks(&ids))?.py()
    }

    /// Adds one reference to each block (a prefix-cache hit being adopted).
    ///
    /// A block at ref count 0 is first taken out of the free queue, so it can no longer be
    /// evicted. The null block is skipped.
    ///
    /// Args:
    ///     block_ids: The ids. Any iterable of ints.
    ///
    /// Raises:
    ///     TypeError: an id is not an int.
    ///     UnknownBlockError: an id is out of range.
    fn touch(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = int_column(block_ids)?;
        self.with_mut(block_ids.py(), |p| p.touch(&ids))?.py()
    }

    /// Enters a request's newly full blocks into the prefix cache.
    ///
    /// Blocks ``block_ids[num_cached_blocks:num_full_blocks]`` get the hashes at the same
    /// positions of ``block_hashes`` under ``kv_cache_group_id`` and are added to the
    /// prefix map after any blocks already cached under the same key (duplicates are
    /// kept, as in vLLM). Ref counts and the free queue do not change. Null blocks are
    /// skipped. A no-op when ``num_cached_blocks >= num_full_blocks``.
    ///
    /// Args:
    ///     block_ids: The request's whole block table.
    ///     block_hashes: The request's block hashes, block 0 first (at least
    ///         ``num_full_blocks`` of them, each ``bytes`` of at most 32 bytes).
    ///     num_cached_blocks: Blocks of the table already cached.
    ///     num_full_blocks: Blocks of the table that are now full.
    ///     kv_cache_group_id: The KV cache group the blocks belong to.
    ///
    /// Raises:
    ///     TypeError: an id or count is not an int, or a hash is not ``bytes``.
    ///     UnknownBlockError: an id is out of range.
    ///     ValueError: a hash is longer than 32 bytes, a count or the group id is
    ///         negative, ``num_full_blocks {nf} exceeds the {len} block ids given``, or
    ///         ``need {nf} block hashes, got {len}``.
    ///     BlockStateError: ``block {id} already has a hash`` (also when a block occurs
    ///         twice among the blocks to cache).
    #[pyo3(signature = (block_ids, block_hashes, num_cached_blocks, num_full_blocks, kv_cache_group_id=0))]
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
        error.take().map_or_else(|| result.py(), Err)
    }

    /// Looks a block hash up in the prefix cache, one block per group.
    ///
    /// Nothing changes: hits are neither touched nor moved in the free queue.
    ///
    /// Args:
    ///     block_hash: The hash to look up.
    ///     kv_cache_group_ids: The groups to look it up in.
    ///
    /// Returns:
    ///     For each group, the earliest-inserted block still cached under
    ///     ``(block_hash, group)``; ``None`` if any group misses.
    ///
    /// Raises:
    ///     TypeError: the hash is not ``bytes`` or a group id is not an int.
    ///     ValueError: the hash is longer than 32 bytes or a group id is out of range.
    #[pyo3(
        signature = (block_hash, kv_cache_group_ids=Given::Absent),
        text_signature = "(self, block_hash, kv_cache_group_ids=(0,))"
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

    /// Finds the longest prefix of a hash chain that is cached, in one call.
    ///
    /// vLLM's ``find_longest_cache_hit`` for one full-attention group: looks the hashes up
    /// in order and stops at the first miss (the hashes are chained, so nothing later can
    /// hit). Nothing changes: pass the result to :meth:`touch` to adopt the hits.
    ///
    /// Args:
    ///     block_hashes: A request's block hashes, block 0 first.
    ///     kv_cache_group_id: The group to look them up in.
    ///
    /// Returns:
    ///     The earliest-inserted cached block of each hash of the longest cached prefix.
    ///
    /// Raises:
    ///     TypeError: a hash read is not ``bytes`` or the group id is not an int.
    ///     ValueError: a hash read is longer than 32 bytes or the group id is out of range.
    #[pyo3(signature = (block_hashes, kv_cache_group_id=0))]
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

    /// Removes the given blocks from the prefix cache.
    ///
    /// Only hashes are dropped: ref counts and free-queue positions do not change, so a
    /// free block stays where it is (now unhashed) and a block in use is prepended, as an
    /// unhashed block, when it is freed later. Unhashed and null blocks are skipped.
    ///
    /// Args:
    ///     block_ids: The ids. Any iterable of ints (vLLM passes a set).
    ///
    /// Raises:
    ///     TypeError: an id is not an int.
    ///     UnknownBlockError: an id is out of range.
    fn evict_blocks(&mut self, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = int_column(block_ids)?;
        self.with_mut(block_ids.py(), |p| p.evict_blocks(&ids))?
            .py()
            .map(drop)
    }

    /// Empties the prefix cache, if no block is in use.
    ///
    /// Returns:
    ///     True when every non-null block was free: all hashes are dropped (the free
    ///     queue order is kept). False, with nothing changed, otherwise.
    fn reset_prefix_cache(&mut self, py: Python<'_>) -> PyResult<bool> {
        self.with_mut(py, CorePool::reset_prefix_cache)
    }

    /// The number of free blocks, cached ones with ref count 0 included.
    fn get_num_free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, CorePool::num_free_blocks)
    }

    /// The fraction of usable (non-null) blocks in use: ``1 - free / (num_blocks - 1)``.
    ///
    /// 0.0 for a pool with no usable block.
    fn get_usage(&self, py: Python<'_>) -> PyResult<f64> {
        self.with(py, CorePool::usage)
    }

    /// A frozen snapshot of one block.
    ///
    /// Raises:
    ///     TypeError: ``block_id`` is not an int.
    ///     UnknownBlockError: ``block_id`` is out of range.
    fn get_block(&self, py: Python<'_>, block_id: i64) -> PyResult<PyKVCacheBlock> {
        self.with(py, |p| p.block(block_id))?
            .py()
            .map(PyKVCacheBlock::from)
    }

    /// The free queue, head (next to be allocated) first.
    fn free_block_ids(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        self.with(py, CorePool::free_block_ids)
    }

    /// Walks the whole state and checks every invariant of the class docstring.
    ///
    /// Raises:
    ///     InvariantError: naming the first broken rule.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, CorePool::check_invariants)?.py()
    }
}
