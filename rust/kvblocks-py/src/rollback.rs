//! The rollback entry points for Python: gather columns, call
//! `kvblocks_core::rollback`, write the decided token counts back.
//!
//! The core decides everything before anything is written, so a call that raises
//! changes nothing. With a native `KVCacheManager` the block tables are read in place
//! from Rust; any other manager is asked through `get_block_ids`, once per request.

// The Python-visible items' docs are the reference's docstrings (reST, from
// `docstrings.rs`), not rustdoc markdown, so the markdown lint does not apply.
#![allow(clippy::doc_markdown)]

use std::collections::HashSet;

use kvblocks_core::manager::Tolerance;
use kvblocks_core::rollback::{
    self, Batch, BlockIds, Mode, Pass, Policy, Rollback, RollbackTarget,
};
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyDict, PyFrozenSet, PySet, PyString};
use pyo3::Borrowed;

use crate::convert::{
    index_uint, int_column, request_id, to_list, type_name, Flag, Given, IntColumn,
};
use crate::errors::{IntoPyResult, StashedError};
use crate::manager::PyKVCacheManager;

/// A keyword argument naming one value of a core enum (`mode=`, `policy=`).
/// Extraction never fails, so that a bad value is refused inside the call with the
/// reference's exact message (`PyO3` would annotate an extraction error with a note the
/// reference does not add).
pub struct ChoiceArg<T>(Result<T, String>);

/// A core enum taken by name.
pub trait Choice: Copy {
    /// The keyword.
    const ARGUMENT: &'static str;
    /// The names it takes, as the error message lists them.
    const EXPECTED: &'static str;
    /// The value of that name.
    fn from_name(name: &str) -> Option<Self>;
}

impl Choice for Mode {
    const ARGUMENT: &'static str = "mode";
    const EXPECTED: &'static str = "'vllm' or 'strict'";
    fn from_name(name: &str) -> Option<Self> {
        Mode::from_name(name)
    }
}

impl Choice for Policy {
    const ARGUMENT: &'static str = "policy";
    const EXPECTED: &'static str = "'fail' or 'recompute'";
    fn from_name(name: &str) -> Option<Self> {
        Policy::from_name(name)
    }
}

impl<T: Choice> ChoiceArg<T> {
    const fn default(value: T) -> Self {
        Self(Ok(value))
    }

    fn get(&self) -> PyResult<T> {
        self.0.clone().map_err(|got| {
            PyValueError::new_err(format!(
                "{} must be {}, got {got}",
                T::ARGUMENT,
                T::EXPECTED
            ))
        })
    }
}

impl<'a, 'py, T: Choice> FromPyObject<'a, 'py> for ChoiceArg<T> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let value = obj
            .cast::<PyString>()
            .ok()
            .and_then(|s| s.to_str().ok().and_then(T::from_name));
        Ok(Self(value.ok_or_else(|| repr(obj))))
    }
}

fn repr(obj: Borrowed<'_, '_, PyAny>) -> String {
    obj.repr()
        .map_or_else(|_| "<unrepresentable>".to_owned(), |r| r.to_string())
}

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
    failed_waiting: Vec<String>,
    failed_running: Vec<String>,
    rescheduled_req_ids: Vec<String>,
    retry_req_ids: Vec<String>,
    evicted_block_ids: Vec<i64>,
    #[pyo3(get)]
    total_affected_tokens: u128,
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
    Ok(request_id(id, "request_id")?.to_string())
}

/// A new Python set of `items`, added in this order.
fn ordered_set<'py, T: IntoPyObject<'py> + Copy>(
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

/// Every table of a batch, as integer columns borrowed or converted from Python.
fn table_columns(block_tables: &Bound<'_, PyAny>) -> PyResult<Vec<IntColumn>> {
    to_list(block_tables)?
        .iter()
        .map(|t| int_column(&t))
        .collect()
}

#[doc = docstring!(rollback_invalid_blocks)]
#[pyfunction]
#[pyo3(
    signature = (
        block_tables, num_computed_tokens, num_scheduled_tokens, invalid_block_ids, block_size,
        *, collect_evictions=Flag::TRUE, mode=ChoiceArg::default(Mode::Vllm)
    ),
    text_signature = None
)]
#[allow(clippy::needless_pass_by_value)]
pub fn rollback_invalid_blocks(
    block_tables: &Bound<'_, PyAny>,
    num_computed_tokens: &Bound<'_, PyAny>,
    num_scheduled_tokens: &Bound<'_, PyAny>,
    invalid_block_ids: &Bound<'_, PyAny>,
    block_size: i64,
    collect_evictions: Flag,
    mode: ChoiceArg<Mode>,
) -> PyResult<PyRollbackResult> {
    let mode = mode.get()?;
    let tables = table_columns(block_tables)?;
    let computed = int_column(num_computed_tokens)?;
    let scheduled = int_column(num_scheduled_tokens)?;
    let invalid = int_column(invalid_block_ids)?;
    let views: Vec<&[i64]> = tables.iter().map(|t| &**t).collect();
    let batch = Batch {
        block_tables: &views,
        num_computed_tokens: &computed,
        num_scheduled_tokens: &scheduled,
    };
    rollback::rollback_invalid_blocks(
        batch,
        &invalid,
        block_size,
        collect_evictions.0,
        mode,
        Tolerance::Strict,
    )
    .py()
    .map(PyRollbackResult::from)
}

/// The error for a request given twice in one call (its id shown as Python's `repr`).
fn appears_twice(py: Python<'_>, request_id: &str) -> PyErr {
    match PyString::new(py, request_id).repr() {
        Ok(id) => PyValueError::new_err(format!("request {id} appears more than once")),
        Err(err) => err,
    }
}

/// Refuses an id already in `seen` (the reference's `_check_unique`), adding each: a
/// request may appear once in a call, as in vLLM's scheduler.
fn check_unique<'a>(
    py: Python<'_>,
    ids: &'a [PyBackedStr],
    seen: &mut HashSet<&'a str>,
) -> PyResult<()> {
    for id in ids {
        if !seen.insert(id) {
            return Err(appears_twice(py, id));
        }
    }
    Ok(())
}

/// The requests of one pass, as the columns the core reads.
struct RequestColumns<'py> {
    requests: Vec<Bound<'py, PyAny>>,
    ids: Vec<PyBackedStr>,
    computed: Vec<i64>,
    scheduled: Vec<i64>,
}

impl<'py> RequestColumns<'py> {
    fn gather(
        requests: &Bound<'py, PyAny>,
        num_scheduled_tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Self> {
        let requests: Vec<Bound<'py, PyAny>> = to_list(requests)?.iter().collect();
        let scheduled_map = num_scheduled_tokens.cast::<PyDict>().ok();
        let mut cols = Self {
            ids: Vec::with_capacity(requests.len()),
            computed: Vec::with_capacity(requests.len()),
            scheduled: Vec::with_capacity(requests.len()),
            requests: Vec::new(),
        };
        for request in &requests {
            let id = request_id(&request.getattr("request_id")?, "request_id")?;
            cols.computed
                .push(request.getattr("num_computed_tokens")?.extract()?);
            let scheduled = match &scheduled_map {
                Some(map) => map.get_item(&*id)?,
                None => num_scheduled_tokens.call_method1("get", (&*id, 0))?.into(),
            };
            cols.scheduled
                .push(scheduled.map_or(Ok(0), |s| s.extract())?);
            cols.ids.push(id);
        }
        cols.requests = requests;
        Ok(cols)
    }

    /// The ids of the requests at `indices`.
    fn ids_of<'a>(&'a self, indices: &'a [usize]) -> impl Iterator<Item = String> + 'a {
        indices
            .iter()
            .filter_map(|&i| self.ids.get(i))
            .map(ToString::to_string)
    }

    /// The ids of the requests at `indices`, as the set vLLM builds: added in this order.
    fn id_set<'p>(&self, py: Python<'p>, indices: &[usize]) -> PyResult<Bound<'p, PySet>> {
        ordered_set(
            py,
            indices
                .iter()
                .filter_map(|&i| self.ids.get(i))
                .map(|id| &**id),
        )
    }
}

/// The binding's one [`RollbackTarget`]: the manager the eviction goes to (none for
/// `handle_failed_recving`, which evicts nothing) and the requests of both passes.
/// Python errors are kept in `error` for the caller to raise.
struct Target<'a, 'py> {
    manager: Option<&'a Bound<'py, PyAny>>,
    waiting: &'a [Bound<'py, PyAny>],
    running: &'a [Bound<'py, PyAny>],
    error: &'a StashedError,
}

impl Target<'_, '_> {
    fn keep<T>(&self, result: PyResult<T>) -> kvblocks_core::Result<T> {
        result.map_err(|err| self.error.keep(err, "writing the rollback"))
    }
}

impl RollbackTarget for Target<'_, '_> {
    /// Evicts in the order vLLM does: by iterating the set it built from `block_ids`,
    /// so the removal events come out alike.
    fn evict_blocks(&mut self, block_ids: &[i64]) -> kvblocks_core::Result<()> {
        let Some(manager) = self.manager else {
            return Ok(());
        };
        let evicted = (|| {
            let to_evict = ordered_set(manager.py(), block_ids.iter().copied())?;
            match manager.cast::<PyKVCacheManager>() {
                Ok(native) => {
                    let order = to_evict
                        .iter()
                        .map(|id| id.extract())
                        .collect::<PyResult<Vec<i64>>>()?;
                    native.try_borrow_mut()?.inner.evict_blocks(&order).py()?;
                }
                Err(_) => {
                    manager.call_method1("evict_blocks", (to_evict,))?;
                }
            }
            Ok(())
        })();
        self.keep(evicted)
    }

    fn set_num_computed_tokens(
        &mut self,
        pass: Pass,
        index: usize,
        value: i64,
    ) -> kvblocks_core::Result<()> {
        let requests = match pass {
            Pass::Waiting => self.waiting,
            Pass::Running => self.running,
        };
        let written = match requests.get(index) {
            Some(request) => request.setattr("num_computed_tokens", value),
            None => Ok(()),
        };
        self.keep(written)
    }
}

/// The block tables of one pass: borrowed from a native manager, or fetched through
/// `get_block_ids` from any other.
enum Tables<'m> {
    Native(Vec<&'m [u32]>),
    Python(Vec<IntColumn>),
}

fn fetch_tables<'m>(
    manager: &Bound<'_, PyAny>,
    native: Option<&'m PyKVCacheManager>,
    cols: &RequestColumns<'_>,
) -> PyResult<Tables<'m>> {
    if let Some(native) = native {
        return Ok(Tables::Native(
            cols.ids
                .iter()
                .map(|id| native.inner.get_block_ids(id))
                .collect(),
        ));
    }
    let mut tables = Vec::with_capacity(cols.ids.len());
    for id in &cols.ids {
        let groups = manager.call_method1("get_block_ids", (&**id,))?;
        // The same rule as `num_kv_cache_groups`: one group's table per request.
        rollback::check_single_group(i64::try_from(groups.len()?).unwrap_or(i64::MAX)).py()?;
        tables.push(int_column(&groups.get_item(0)?)?);
    }
    Ok(Tables::Python(tables))
}

impl Tables<'_> {
    fn ids(&self) -> Vec<BlockIds<'_>> {
        match self {
            Self::Native(t) => t.iter().map(|t| BlockIds::U32(t)).collect(),
            Self::Python(t) => t.iter().map(|t| BlockIds::I64(t)).collect(),
        }
    }
}

/// The manager's tolerance: vLLM's for the manager built for vLLM's scheduler.
fn tolerance(native: Option<&PyKVCacheManager>) -> Tolerance {
    native.map_or(Tolerance::Strict, |m| m.inner.tolerance())
}

fn num_kv_cache_groups(manager: &Bound<'_, PyAny>) -> PyResult<i64> {
    match manager.getattr_opt("num_kv_cache_groups")? {
        Some(n) => n.extract(),
        None => Ok(1),
    }
}

fn check_single_group(manager: &Bound<'_, PyAny>) -> PyResult<()> {
    rollback::check_single_group(num_kv_cache_groups(manager)?).py()
}

#[doc = docstring!(update_requests_with_invalid_blocks)]
#[pyfunction]
#[pyo3(
    signature = (kv_cache_manager, requests, invalid_block_ids, num_scheduled_tokens, *, evict_blocks=Flag::TRUE, mode=ChoiceArg::default(Mode::Vllm)),
    text_signature = None
)]
#[allow(clippy::needless_pass_by_value)]
pub fn update_requests_with_invalid_blocks<'py>(
    py: Python<'py>,
    kv_cache_manager: &Bound<'py, PyAny>,
    requests: &Bound<'py, PyAny>,
    invalid_block_ids: &Bound<'py, PyAny>,
    num_scheduled_tokens: &Bound<'py, PyAny>,
    evict_blocks: Flag,
    mode: ChoiceArg<Mode>,
) -> PyResult<(Bound<'py, PySet>, u128, Bound<'py, PySet>)> {
    let mode = mode.get()?;
    check_single_group(kv_cache_manager)?;
    let cols = RequestColumns::gather(requests, num_scheduled_tokens)?;
    check_unique(requests.py(), &cols.ids, &mut HashSet::new())?;
    let native = kv_cache_manager
        .cast::<PyKVCacheManager>()
        .ok()
        .map(Bound::try_borrow)
        .transpose()?;
    let tables = fetch_tables(kv_cache_manager, native.as_deref(), &cols)?;
    let invalid = int_column(invalid_block_ids)?;
    let block_size: i64 = kv_cache_manager.getattr("block_size")?.extract()?;
    let ids = tables.ids();
    let batch = Batch {
        block_tables: &ids,
        num_computed_tokens: &cols.computed,
        num_scheduled_tokens: &cols.scheduled,
    };
    let result = rollback::rollback_invalid_blocks(
        batch,
        &invalid,
        block_size,
        evict_blocks.0,
        mode,
        tolerance(native.as_deref()),
    )
    .py()?;
    let sequence = result.eviction_sequence(&ids);
    drop(native);
    let to_evict = ordered_set(py, sequence.iter().copied())?;
    let stash = StashedError::default();
    let mut target = Target {
        manager: Some(kv_cache_manager),
        waiting: &[],
        running: &cols.requests,
        error: &stash,
    };
    let written = result.write(Pass::Running, &mut target);
    stash.finish(written)?;
    let affected = cols.id_set(py, &result.affected)?;
    Ok((affected, result.total_affected_tokens, to_evict))
}

#[doc = docstring!(handle_invalid_blocks)]
#[pyfunction]
#[pyo3(
    signature = (
        kv_cache_manager, invalid_block_ids, num_scheduled_tokens, *, running,
        waiting_for_remote_kvs=Given::Absent, policy=ChoiceArg::default(Policy::Fail), mode=ChoiceArg::default(Mode::Vllm)
    ),
    text_signature = None
)]
// The arguments are the Python signature (vLLM's, plus `py`); PyO3 extracts them by value.
#[allow(clippy::needless_pass_by_value, clippy::too_many_arguments)]
pub fn handle_invalid_blocks<'py>(
    py: Python<'py>,
    kv_cache_manager: &Bound<'py, PyAny>,
    invalid_block_ids: &Bound<'py, PyAny>,
    num_scheduled_tokens: &Bound<'py, PyAny>,
    running: &Bound<'py, PyAny>,
    waiting_for_remote_kvs: Given<'py>,
    policy: ChoiceArg<Policy>,
    mode: ChoiceArg<Mode>,
) -> PyResult<PyInvalidBlocksOutcome> {
    let (policy, mode) = (policy.get()?, mode.get()?);
    // Fail closed before any request is looked at, as vLLM does.
    check_single_group(kv_cache_manager)?;
    let waiting = match waiting_for_remote_kvs {
        Given::Is(requests) => requests,
        Given::Absent => pyo3::types::PyTuple::empty(py).into_any(),
    };
    let waiting = RequestColumns::gather(&waiting, num_scheduled_tokens)?;
    let sync = RequestColumns::gather(running, num_scheduled_tokens)?;
    let mut seen = HashSet::new();
    check_unique(py, &waiting.ids, &mut seen)?;
    check_unique(py, &sync.ids, &mut seen)?;

    let native = kv_cache_manager
        .cast::<PyKVCacheManager>()
        .ok()
        .map(Bound::try_borrow)
        .transpose()?;
    let waiting_tables = fetch_tables(kv_cache_manager, native.as_deref(), &waiting)?;
    let sync_tables = fetch_tables(kv_cache_manager, native.as_deref(), &sync)?;
    let invalid = int_column(invalid_block_ids)?;
    let block_size: i64 = kv_cache_manager.getattr("block_size")?.extract()?;
    let (waiting_ids, sync_ids) = (waiting_tables.ids(), sync_tables.ids());
    let outcome = rollback::handle_invalid_blocks(
        Batch {
            block_tables: &waiting_ids,
            num_computed_tokens: &waiting.computed,
            num_scheduled_tokens: &waiting.scheduled,
        },
        Batch {
            block_tables: &sync_ids,
            num_computed_tokens: &sync.computed,
            num_scheduled_tokens: &sync.scheduled,
        },
        &invalid,
        block_size,
        policy,
        mode,
        tolerance(native.as_deref()),
    )
    .py()?;
    let sequence = outcome.eviction_sequence(&sync_ids);
    drop(native);

    let stash = StashedError::default();
    let mut target = Target {
        manager: Some(kv_cache_manager),
        waiting: &waiting.requests,
        running: &sync.requests,
        error: &stash,
    };
    let applied = outcome.apply(&sequence, &mut target);
    stash.finish(applied)?;
    Ok(PyInvalidBlocksOutcome {
        failed_waiting: waiting.ids_of(outcome.failed_waiting()).collect(),
        failed_running: sync.ids_of(outcome.failed_running()).collect(),
        rescheduled_req_ids: sync.ids_of(outcome.rescheduled_running()).collect(),
        retry_req_ids: waiting.ids_of(outcome.retry_waiting()).collect(),
        evicted_block_ids: sequence,
        total_affected_tokens: outcome.total_affected_tokens(),
    })
}

#[doc = docstring!(handle_failed_recving)]
#[pyfunction]
#[pyo3(
    signature = (failed_req_ids, waiting_for_remote_kvs, *, policy=ChoiceArg::default(Policy::Fail)),
    text_signature = None
)]
#[allow(clippy::needless_pass_by_value)]
pub fn handle_failed_recving(
    failed_req_ids: &Bound<'_, PyAny>,
    waiting_for_remote_kvs: &Bound<'_, PyAny>,
    policy: ChoiceArg<Policy>,
) -> PyResult<PyInvalidBlocksOutcome> {
    let policy = policy.get()?;
    let py = failed_req_ids.py();
    // Every id is read once, as its exact contents: ids compare by content, never by a
    // subclass's `__eq__` or `__hash__`.
    let reported = to_list(failed_req_ids)?
        .iter()
        .map(|id| request_id(&id, "failed_req_ids item"))
        .collect::<PyResult<Vec<_>>>()?;
    let waiting: Vec<Bound<'_, PyAny>> = to_list(waiting_for_remote_kvs)?.iter().collect();
    let ids = waiting
        .iter()
        .map(|r| request_id(&r.getattr("request_id")?, "request_id"))
        .collect::<PyResult<Vec<_>>>()?;
    check_unique(py, &ids, &mut HashSet::with_capacity(ids.len()))?;
    let stash = StashedError::default();
    let read = |i: usize| {
        waiting[i]
            .getattr("num_computed_tokens")
            .and_then(|n| n.extract::<i64>())
            .map_err(|err| stash.keep(err, "reading num_computed_tokens"))
    };
    let mut target = Target {
        manager: None,
        waiting: &waiting,
        running: &[],
        error: &stash,
    };
    let decided = rollback::handle_failed_recving(&reported, &ids, policy, read, &mut target);
    let decided = stash.finish(decided)?;
    let matched_ids: Vec<String> = decided
        .matched
        .iter()
        .map(|&i| ids[i].to_string())
        .collect();
    let (failed_waiting, retry_req_ids) = match policy {
        Policy::Recompute => (Vec::new(), matched_ids),
        Policy::Fail => (matched_ids, Vec::new()),
    };
    Ok(PyInvalidBlocksOutcome {
        failed_waiting,
        failed_running: Vec::new(),
        rescheduled_req_ids: Vec::new(),
        retry_req_ids,
        evicted_block_ids: Vec::new(),
        total_affected_tokens: decided.total_affected_tokens,
    })
}
