//! The rollback entry points for Python: gather columns, call
//! `kvblocks_core::rollback`, write the decided token counts back.
//!
//! The core decides everything before anything is written, so a call that raises
//! changes nothing. With a native `KVCacheManager` the block tables are read in place
//! from Rust; any other manager is asked through `get_block_ids`, once per request.
//!
//! One file per job: the entry points here, and the requests' columns and write-back
//! target the core reads (`columns.rs`).

// The Python-visible items' docs are the reference's docstrings (reST, from
// `docstrings.rs`), not rustdoc markdown, so the markdown lint does not apply.
#![allow(clippy::doc_markdown)]

mod columns;

use std::collections::HashSet;

use kvblocks_core::rollback::{self, Batch, Mode, Pass, Policy, Tolerance};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PySet;

use crate::convert::{int_column, request_id, to_list, ChoiceArg, Flag, Given, IntColumn};
use crate::errors::{IntoPyResult, StashedError};
use crate::manager::PyKVCacheManager;
use crate::request_fields::{num_computed_tokens_of, FieldSet, RequestFields};
use crate::values::{ordered_set, rollback_result, InvalidBlocksOutcome};
use crate::vllm::PyVllmManager;
use columns::{check_unique, fetch_tables, NativeManager, RequestColumns, Target};

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
pub fn rollback_invalid_blocks<'py>(
    block_tables: &Bound<'py, PyAny>,
    num_computed_tokens: &Bound<'_, PyAny>,
    num_scheduled_tokens: &Bound<'_, PyAny>,
    invalid_block_ids: &Bound<'_, PyAny>,
    block_size: i64,
    collect_evictions: Flag,
    mode: ChoiceArg<Mode>,
) -> PyResult<Bound<'py, PyAny>> {
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
    .and_then(|rollback| rollback_result(block_tables.py(), rollback))
}

fn num_kv_cache_groups(manager: &Bound<'_, PyAny>) -> PyResult<i64> {
    match manager.getattr_opt(intern!(manager.py(), "num_kv_cache_groups"))? {
        Some(n) => n.extract(),
        None => Ok(1),
    }
}

fn check_single_group(manager: &Bound<'_, PyAny>) -> PyResult<()> {
    rollback::check_single_group(num_kv_cache_groups(manager)?).py()
}

/// The manager as one of kvblocks' native ones, borrowed, if it is one (its tables
/// and its tolerance are then read in place).
fn native_manager<'py>(manager: &Bound<'py, PyAny>) -> PyResult<Option<NativeManager<'py>>> {
    if let Ok(library) = manager.cast::<PyKVCacheManager>() {
        return Ok(Some(NativeManager::Library(library.try_borrow()?)));
    }
    if let Ok(vllm) = manager.cast::<PyVllmManager>() {
        return Ok(Some(NativeManager::Vllm(vllm.try_borrow()?)));
    }
    Ok(None)
}

/// The manager's tolerance: vLLM's for the manager built for vLLM's scheduler.
fn tolerance(native: Option<&NativeManager<'_>>) -> Tolerance {
    match native {
        Some(NativeManager::Vllm(_)) => Tolerance::Vllm,
        Some(NativeManager::Library(_)) | None => Tolerance::Strict,
    }
}

/// `manager.block_size`.
fn block_size_of(manager: &Bound<'_, PyAny>) -> PyResult<i64> {
    manager
        .getattr(intern!(manager.py(), "block_size"))?
        .extract()
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
    let native = native_manager(kv_cache_manager)?;
    let tables = fetch_tables(kv_cache_manager, native.as_ref(), &cols)?;
    let invalid = int_column(invalid_block_ids)?;
    let block_size = block_size_of(kv_cache_manager)?;
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
        tolerance(native.as_ref()),
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
) -> PyResult<Bound<'py, PyAny>> {
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

    let native = native_manager(kv_cache_manager)?;
    let waiting_tables = fetch_tables(kv_cache_manager, native.as_ref(), &waiting)?;
    let sync_tables = fetch_tables(kv_cache_manager, native.as_ref(), &sync)?;
    let invalid = int_column(invalid_block_ids)?;
    let block_size = block_size_of(kv_cache_manager)?;
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
        tolerance(native.as_ref()),
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
    InvalidBlocksOutcome {
        failed_waiting: waiting.ids_of(outcome.failed_waiting()).collect(),
        failed_running: sync.ids_of(outcome.failed_running()).collect(),
        rescheduled_req_ids: sync.ids_of(outcome.rescheduled_running()).collect(),
        retry_req_ids: waiting.ids_of(outcome.retry_waiting()).collect(),
        evicted_block_ids: sequence,
        total_affected_tokens: outcome.total_affected_tokens(),
    }
    .into_value(py)
}

#[doc = docstring!(handle_failed_recving)]
#[pyfunction]
#[pyo3(
    signature = (failed_req_ids, waiting_for_remote_kvs, *, policy=ChoiceArg::default(Policy::Fail)),
    text_signature = None
)]
#[allow(clippy::needless_pass_by_value)]
pub fn handle_failed_recving<'py>(
    py: Python<'py>,
    failed_req_ids: &Bound<'py, PyAny>,
    waiting_for_remote_kvs: &Bound<'py, PyAny>,
    policy: ChoiceArg<Policy>,
) -> PyResult<Bound<'py, PyAny>> {
    let policy = policy.get()?;
    // Every id is read once, as its exact contents: ids compare by content, never by a
    // subclass's `__eq__` or `__hash__`.
    let reported = to_list(failed_req_ids)?
        .iter()
        .map(|id| request_id(id, "failed_req_ids item"))
        .collect::<PyResult<Vec<_>>>()?;
    let waiting: Vec<Bound<'_, PyAny>> = to_list(waiting_for_remote_kvs)?.iter().collect();
    let ids = waiting
        .iter()
        .map(|r| RequestFields::read(r, FieldSet::ID)?.into_id())
        .collect::<PyResult<Vec<_>>>()?;
    check_unique(py, &ids, &mut HashSet::with_capacity(ids.len()))?;
    let stash = StashedError::default();
    let read = |i: usize| {
        num_computed_tokens_of(&waiting[i])
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
    InvalidBlocksOutcome {
        failed_waiting,
        failed_running: Vec::new(),
        rescheduled_req_ids: Vec::new(),
        retry_req_ids,
        evicted_block_ids: Vec::new(),
        total_affected_tokens: decided.total_affected_tokens,
    }
    .into_value(py)
}
