//! `KVCacheBlocks` and `KVCacheBlockView`: the managers' results, block ids whose
//! views are built only when a connector reads `.blocks`.

// The `///` comments of the Python-visible items are docstrings (reST, Google style),
// not rustdoc markdown.
#![allow(clippy::doc_markdown)]

use kvblocks_core::pool::{BlockInfo, NULL_BLOCK_ID};
use pyo3::exceptions::{PyAssertionError, PyIndexError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::convert::Flag;
use crate::errors::IntoPyResult;
use crate::pool::PoolHandle;

/// A live view of block `block_id` of `pool`.
pub(crate) fn block_view(py: Python<'_>, pool: &PoolHandle, block_id: u32) -> PyBlockView {
    PyBlockView {
        pool: pool.clone_ref(py),
        block_id,
    }
}

/// The blocks of one allocation or lookup, for vLLM's Scheduler and connectors.
///
/// ``get_block_ids()`` answers from the ids held here; ``blocks`` builds one
/// :class:`KVCacheBlock` snapshot per block (with its current hash state) when read.
#[pyclass(module = "kvblocks._native", name = "KVCacheBlocks", frozen)]
pub struct PyKVCacheBlocks {
    /// Every group's ids, group after group.
    pub(super) ids: Vec<u32>,
    /// Where each group's ids end in `ids`; empty for one group (all of `ids`).
    ends: Vec<usize>,
    /// The manager whose pool the blocks are in (`None` for results with no blocks).
    pool: Option<PoolHandle>,
}

impl PyKVCacheBlocks {
    /// The groups' ids.
    pub(crate) fn grouped<'a>(
        groups: impl IntoIterator<Item = &'a [u32]>,
        pool: Option<PoolHandle>,
    ) -> Self {
        let mut ids = Vec::new();
        let mut ends = Vec::new();
        for group in groups {
            ids.extend_from_slice(group);
            ends.push(ids.len());
        }
        // One group needs no ends: the common layout's results stay one vector.
        if ends.len() == 1 {
            ends.clear();
        }
        Self { ids, ends, pool }
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
        let Some(pool) = &self.pool else {
            return Ok(vec![false; ids.len()]);
        };
        pool.with(py, |pool| {
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
        // Every group is empty exactly when `ids` is: a decoding step's result.
        if allow_none.0 && group_ids.is_none() && self.ids.is_empty() {
            return Ok(None);
        }
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
        let Some(pool) = &self.pool else {
            return PyTuple::new(py, groups.iter().map(|_| PyTuple::empty(py)));
        };
        let lists = groups
            .into_iter()
            .map(|g| PyList::new(py, g.iter().map(|&b| block_view(py, pool, b))))
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, lists)
    }

    /// The blocks of both, group by group.
    fn __add__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Self> {
        let Ok(other) = other.cast::<Self>() else {
            return Err(PyTypeError::new_err("can only add KVCacheBlocks"));
        };
        let other = other.get();
        let pool = self
            .pool
            .as_ref()
            .or(other.pool.as_ref())
            .map(|p| p.clone_ref(py));
        let (ours, theirs) = (self.groups(), other.groups());
        let joined: Vec<Vec<u32>> = ours
            .iter()
            .zip(&theirs)
            .map(|(a, b)| a.iter().chain(b.iter()).copied().collect())
            .collect();
        Ok(Self::grouped(joined.iter().map(Vec::as_slice), pool))
    }

    /// A result with no blocks, with as many groups (a method, as vLLM's).
    fn new_empty(&self) -> Self {
        Self {
            ids: Vec::new(),
            ends: vec![0; self.ends.len()],
            pool: None,
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
    pool: PoolHandle,
    #[pyo3(get)]
    block_id: u32,
}

impl PyBlockView {
    fn read<T>(&self, py: Python<'_>, f: impl FnOnce(BlockInfo) -> T) -> PyResult<T> {
        let info = self
            .pool
            .with(py, |pool| pool.block(i64::from(self.block_id)))?
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
