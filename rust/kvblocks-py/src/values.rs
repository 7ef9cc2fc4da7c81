//! The value classes both backends return (`kvblocks.values`), built from the core's
//! results. Python defines each once, with its docs, `repr`, equality and the
//! conversion of a caller's arguments; the binding only fills in the fields.

use kvblocks_core::manager::PrefixCacheStats;
use kvblocks_core::pool::BlockInfo;
use kvblocks_core::rollback::Rollback;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PySet};
use pyo3::IntoPyObjectExt;
use pyo3::{ffi, intern};

use crate::imports::{
    LazyImport, INVALID_BLOCKS_OUTCOME, KV_CACHE_BLOCK, OBJECT, PREFIX_CACHE_STATS, ROLLBACK_RESULT,
};

/// An instance of `class` with `fields` set as they are, in the order its constructor
/// takes them (`__match_args__`). The core's results already hold the fields' types,
/// so the conversion `__post_init__` gives a caller's arguments is skipped, and a set
/// keeps the order it was built in.
fn build<'py, const N: usize>(
    py: Python<'py>,
    class: &LazyImport,
    fields: [Bound<'py, PyAny>; N],
) -> PyResult<Bound<'py, PyAny>> {
    let class = class.get(py)?;
    let value = OBJECT
        .get(py)?
        .call_method1(intern!(py, "__new__"), (class,))?;
    let names = class.getattr(intern!(py, "__match_args__"))?;
    if names.len()? != N {
        // A field added in Python and not here: refused, not left unset.
        return Err(PyTypeError::new_err(format!(
            "{} has the fields {}, the binding sets {N}",
            class.repr()?,
            names.repr()?
        )));
    }
    for (name, field) in names.try_iter()?.zip(fields) {
        let name = name?;
        // `object.__setattr__`, as a frozen dataclass's own `__post_init__` sets a field.
        // SAFETY: GIL held; the three objects are held for the call; returns -1 with an
        // error set on failure.
        let status =
            unsafe { ffi::PyObject_GenericSetAttr(value.as_ptr(), name.as_ptr(), field.as_ptr()) };
        if status < 0 {
            return Err(PyErr::fetch(py));
        }
    }
    Ok(value)
}

/// A `KVCacheBlock` snapshot of a block.
pub fn kv_cache_block(py: Python<'_>, block: BlockInfo) -> PyResult<Bound<'_, PyAny>> {
    let hash = block.block_hash.map(|h| PyBytes::new(py, h.as_bytes()));
    let fields = [
        block.block_id.into_bound_py_any(py)?,
        block.ref_cnt.into_bound_py_any(py)?,
        hash.into_bound_py_any(py)?,
        block.group_id.into_bound_py_any(py)?,
        block.is_null.into_bound_py_any(py)?,
    ];
    build(py, &KV_CACHE_BLOCK, fields)
}

/// The `PrefixCacheStats` of the core's counters.
pub fn prefix_cache_stats(py: Python<'_>, stats: PrefixCacheStats) -> PyResult<Bound<'_, PyAny>> {
    // A strict manager's counters never go negative.
    let count = |n: i64| u64::try_from(n).unwrap_or_default().into_bound_py_any(py);
    let fields = [
        count(stats.requests)?,
        count(stats.queries)?,
        count(stats.hits)?,
        stats.reset.into_bound_py_any(py)?,
    ];
    build(py, &PREFIX_CACHE_STATS, fields)
}

/// The `RollbackResult` of the core's decision.
pub fn rollback_result(py: Python<'_>, rollback: Rollback) -> PyResult<Bound<'_, PyAny>> {
    let fields = [
        rollback.num_computed_tokens.into_bound_py_any(py)?,
        rollback.affected.into_bound_py_any(py)?,
        rollback.total_affected_tokens.into_bound_py_any(py)?,
        rollback.blocks_to_evict.into_bound_py_any(py)?,
    ];
    build(py, &ROLLBACK_RESULT, fields)
}

/// What a load-failure handler did, for an `InvalidBlocksOutcome`. Each set's members
/// are in the order vLLM adds them to its own: a set of strings iterates in an order
/// that depends on it, and vLLM's scheduler frees and reports requests in that order.
/// `failed_req_ids` is vLLM's `async | sync`.
pub struct InvalidBlocksOutcome {
    pub failed_waiting: Vec<String>,
    pub failed_running: Vec<String>,
    pub rescheduled_req_ids: Vec<String>,
    pub retry_req_ids: Vec<String>,
    pub evicted_block_ids: Vec<i64>,
    pub total_affected_tokens: u128,
}

impl InvalidBlocksOutcome {
    /// The `InvalidBlocksOutcome`.
    pub fn into_value(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        let ids = |ids: &[String]| ordered_set(py, ids.iter().map(String::as_str));
        let fields = [
            ids(&self.failed_waiting)?.bitor(ids(&self.failed_running)?)?,
            ids(&self.rescheduled_req_ids)?.into_any(),
            ids(&self.retry_req_ids)?.into_any(),
            ordered_set(py, self.evicted_block_ids)?.into_any(),
            self.total_affected_tokens.into_bound_py_any(py)?,
        ];
        build(py, &INVALID_BLOCKS_OUTCOME, fields)
    }
}

/// A new Python set of `items`, added in this order.
pub fn ordered_set<'py, T: IntoPyObject<'py>>(
    py: Python<'py>,
    items: impl IntoIterator<Item = T>,
) -> PyResult<Bound<'py, PySet>> {
    let set = PySet::empty(py)?;
    for item in items {
        set.add(item)?;
    }
    Ok(set)
}
