//! `RollbackResult` and `InvalidBlocksOutcome`: what the entry points return.

// The Python-visible items' docs are the reference's docstrings (reST, from
// `docstrings.rs`), not rustdoc markdown, so the markdown lint does not apply.
#![allow(clippy::doc_markdown)]

use std::collections::HashSet;

use kvblocks_core::rollback::Rollback;
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyFrozenSet, PySet};

use crate::convert::{index_uint, int_column, request_id, to_list, type_name};

#[doc = docstring!(RollbackResult)]
#[pyclass(module = "kvblocks._native", name = "RollbackResult", frozen, eq)]
#[derive(PartialEq, Eq)]
pub struct PyRollbackResult {
    #[pyo3(get)]
    num_computed_tokens: Vec<i64>,
    #[pyo3(get)]
    affected: Vec<usize>,
    #[pyo3(get)]
    total_affected_tokens: u128,
    #[pyo3(get)]
    blocks_to_evict: Vec<i64>,
}

#[pymethods]
impl PyRollbackResult {
    #[new]
    #[pyo3(signature = (num_computed_tokens, affected, total_affected_tokens, blocks_to_evict), text_signature = None)]
    fn new(
        num_computed_tokens: &Bound<'_, PyAny>,
        affected: &Bound<'_, PyAny>,
        total_affected_tokens: &Bound<'_, PyAny>,
        blocks_to_evict: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let num_computed_tokens = int_column(num_computed_tokens)?.into_vec();
        let affected = int_column(affected)?
            .iter()
            .map(|&i| {
                usize::try_from(i)
                    .map_err(|_| PyOverflowError::new_err("can't convert negative int to unsigned"))
            })
            .collect::<PyResult<_>>()?;
        Ok(Self {
            num_computed_tokens,
            affected,
            total_affected_tokens: index_uint(total_affected_tokens)?,
            blocks_to_evict: int_column(blocks_to_evict)?.into_vec(),
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "RollbackResult(num_computed_tokens={:?}, affected={:?}, total_affected_tokens={}, blocks_to_evict={:?})",
            self.num_computed_tokens, self.affected, self.total_affected_tokens, self.blocks_to_evict
        )
    }
}

impl From<Rollback> for PyRollbackResult {
    fn from(r: Rollback) -> Self {
        Self {
            num_computed_tokens: r.num_computed_tokens,
            affected: r.affected,
            total_affected_tokens: r.total_affected_tokens,
            blocks_to_evict: r.blocks_to_evict,
        }
    }
}

#[doc = docstring!(InvalidBlocksOutcome)]
#[pyclass(module = "kvblocks._native", name = "InvalidBlocksOutcome", frozen, eq)]
pub struct PyInvalidBlocksOutcome {
    // Each set's members in the order vLLM adds them to its own: a set of strings
    // iterates in an order that depends on it, and vLLM's scheduler frees and reports
    // requests in that order. `failed_req_ids` is vLLM's `async | sync`.
    pub(super) failed_waiting: Vec<String>,
    pub(super) failed_running: Vec<String>,
    pub(super) rescheduled_req_ids: Vec<String>,
    pub(super) retry_req_ids: Vec<String>,
    pub(super) evicted_block_ids: Vec<i64>,
    #[pyo3(get)]
    pub(super) total_affected_tokens: u128,
}

/// The outcomes are equal as the reference's dataclasses are: set by set.
impl PartialEq for PyInvalidBlocksOutcome {
    fn eq(&self, other: &Self) -> bool {
        fn set<T: std::hash::Hash + Eq + Clone>(items: &[T]) -> HashSet<T> {
            items.iter().cloned().collect()
        }
        let failed = |o: &Self| set(&[o.failed_waiting.clone(), o.failed_running.clone()].concat());
        failed(self) == failed(other)
            && set(&self.rescheduled_req_ids) == set(&other.rescheduled_req_ids)
            && set(&self.retry_req_ids) == set(&other.retry_req_ids)
            && set(&self.evicted_block_ids) == set(&other.evicted_block_ids)
            && self.total_affected_tokens == other.total_affected_tokens
    }
}

/// A set field, read as the reference's `to_field_set(value, item)`: a `set` or
/// `frozenset`, each member converted by `item`.
fn set_field<T: std::hash::Hash + Eq>(
    value: &Bound<'_, PyAny>,
    item: impl Fn(&Bound<'_, PyAny>) -> PyResult<T>,
) -> PyResult<Vec<T>> {
    if !(value.is_instance_of::<PySet>() || value.is_instance_of::<PyFrozenSet>()) {
        return Err(PyTypeError::new_err(format!(
            "'{}' object is not an instance of 'set'",
            type_name(value)
        )));
    }
    let members = to_list(value)?
        .iter()
        .map(|member| item(&member))
        .collect::<PyResult<HashSet<T>>>()?;
    Ok(members.into_iter().collect())
}

/// A request id of a set field, as an owned `String`.
fn owned_id(id: &Bound<'_, PyAny>) -> PyResult<String> {
    Ok(request_id(id.clone(), "request_id")?.to_string())
}

/// A new Python set of `items`, added in this order.
pub(super) fn ordered_set<'py, T: IntoPyObject<'py> + Copy>(
    py: Python<'py>,
    items: impl IntoIterator<Item = T>,
) -> PyResult<Bound<'py, PySet>> {
    let set = PySet::empty(py)?;
    for item in items {
        set.add(item)?;
    }
    Ok(set)
}

#[pymethods]
impl PyInvalidBlocksOutcome {
    #[new]
    #[pyo3(signature = (failed_req_ids, rescheduled_req_ids, retry_req_ids, evicted_block_ids, total_affected_tokens), text_signature = None)]
    fn new(
        failed_req_ids: &Bound<'_, PyAny>,
        rescheduled_req_ids: &Bound<'_, PyAny>,
        retry_req_ids: &Bound<'_, PyAny>,
        evicted_block_ids: &Bound<'_, PyAny>,
        total_affected_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let failed_waiting = set_field(failed_req_ids, owned_id)?;
        let rescheduled_req_ids = set_field(rescheduled_req_ids, owned_id)?;
        let retry_req_ids = set_field(retry_req_ids, owned_id)?;
        let evicted_block_ids = set_field(evicted_block_ids, |id| id.extract::<i64>())?;
        let total_affected_tokens = index_uint(total_affected_tokens)?;
        Ok(Self {
            failed_waiting,
            failed_running: Vec::new(),
            rescheduled_req_ids,
            retry_req_ids,
            evicted_block_ids,
            total_affected_tokens,
        })
    }

    // Sets are handed out as new Python sets, built as vLLM builds its own: the outcome
    // itself stays immutable.
    #[getter]
    fn failed_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let waiting = ordered_set(py, self.failed_waiting.iter().map(String::as_str))?;
        let running = ordered_set(py, self.failed_running.iter().map(String::as_str))?;
        waiting.bitor(running)
    }

    #[getter]
    fn rescheduled_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PySet>> {
        ordered_set(py, self.rescheduled_req_ids.iter().map(String::as_str))
    }

    #[getter]
    fn retry_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PySet>> {
        ordered_set(py, self.retry_req_ids.iter().map(String::as_str))
    }

    #[getter]
    fn evicted_block_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PySet>> {
        ordered_set(py, self.evicted_block_ids.iter().copied())
    }

    /// The reference's repr: the sets as Python shows them.
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "InvalidBlocksOutcome(failed_req_ids={}, rescheduled_req_ids={}, retry_req_ids={}, evicted_block_ids={}, total_affected_tokens={})",
            self.failed_req_ids(py)?.repr()?,
            self.rescheduled_req_ids(py)?.repr()?,
            self.retry_req_ids(py)?.repr()?,
            self.evicted_block_ids(py)?.repr()?,
            self.total_affected_tokens
        ))
    }
}
