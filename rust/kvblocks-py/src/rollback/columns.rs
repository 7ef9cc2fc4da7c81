//! The requests of one rollback pass as the columns the core reads, their block
//! tables, and the target the decided token counts are written back to.

use std::collections::HashSet;

use kvblocks_core::rollback::{self, BlockIds, Pass, RollbackTarget};
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyDict, PySet, PyString};

use crate::convert::{int_column, to_list, IntColumn};
use crate::errors::{IntoPyResult, StashedError};
use crate::manager::PyKVCacheManager;
use crate::request_fields::{FieldSet, RequestFields};
use crate::vllm::PyVllmManager;

use crate::values::ordered_set;

/// The error for a request given twice in one call (its id shown as Python's `repr`).
fn appears_twice(py: Python<'_>, request_id: &str) -> PyErr {
    match PyString::new(py, request_id).repr() {
        Ok(id) => PyValueError::new_err(format!("request {id} appears more than once")),
        Err(err) => err,
    }
}

/// Refuses an id already in `seen` (the reference's `_check_unique`), adding each: a
/// request may appear once in a call, as in vLLM's scheduler.
pub(super) fn check_unique<'a>(
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
pub(super) struct RequestColumns<'py> {
    pub(super) requests: Vec<Bound<'py, PyAny>>,
    pub(super) ids: Vec<PyBackedStr>,
    pub(super) computed: Vec<i64>,
    pub(super) scheduled: Vec<i64>,
}

impl<'py> RequestColumns<'py> {
    pub(super) fn gather(
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
            let fields = RequestFields::read(request, FieldSet::PROGRESS)?;
            cols.computed.push(fields.num_computed_tokens);
            let id = fields.into_id()?;
            let scheduled = match &scheduled_map {
                Some(map) => map.get_item(&*id)?,
                None => num_scheduled_tokens
                    .call_method1(intern!(num_scheduled_tokens.py(), "get"), (&*id, 0))?
                    .into(),
            };
            cols.scheduled
                .push(scheduled.map_or(Ok(0), |s| s.extract())?);
            cols.ids.push(id);
        }
        cols.requests = requests;
        Ok(cols)
    }

    /// The ids of the requests at `indices`.
    pub(super) fn ids_of<'a>(&'a self, indices: &'a [usize]) -> impl Iterator<Item = String> + 'a {
        indices
            .iter()
            .filter_map(|&i| self.ids.get(i))
            .map(ToString::to_string)
    }

    /// The ids of the requests at `indices`, as the set vLLM builds: added in this order.
    pub(super) fn id_set<'p>(
        &self,
        py: Python<'p>,
        indices: &[usize],
    ) -> PyResult<Bound<'p, PySet>> {
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
pub(super) struct Target<'a, 'py> {
    pub(super) manager: Option<&'a Bound<'py, PyAny>>,
    pub(super) waiting: &'a [Bound<'py, PyAny>],
    pub(super) running: &'a [Bound<'py, PyAny>],
    pub(super) error: &'a StashedError,
}

impl Target<'_, '_> {
    pub(super) fn keep<T>(&self, result: PyResult<T>) -> kvblocks_core::Result<T> {
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
                    manager.call_method1(intern!(manager.py(), "evict_blocks"), (to_evict,))?;
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

/// A native manager, borrowed for the call: its tables are read in place.
pub(super) enum NativeManager<'py> {
    Library(PyRef<'py, PyKVCacheManager>),
    Vllm(PyRef<'py, PyVllmManager>),
}

impl NativeManager<'_> {
    /// The request's table (group 0's: the rollback runs on one group).
    fn table(&self, request_id: &str) -> &[u32] {
        match self {
            Self::Library(m) => m.inner.get_block_ids(request_id),
            Self::Vllm(m) => m.first_group_table(request_id),
        }
    }
}

/// The block tables of one pass: borrowed from a native manager, or fetched through
/// `get_block_ids` from any other.
pub(super) enum Tables<'m> {
    Native(Vec<&'m [u32]>),
    Python(Vec<IntColumn>),
}

pub(super) fn fetch_tables<'m>(
    manager: &Bound<'_, PyAny>,
    native: Option<&'m NativeManager<'_>>,
    cols: &RequestColumns<'_>,
) -> PyResult<Tables<'m>> {
    if let Some(native) = native {
        return Ok(Tables::Native(
            cols.ids.iter().map(|id| native.table(id)).collect(),
        ));
    }
    let mut tables = Vec::with_capacity(cols.ids.len());
    for id in &cols.ids {
        let groups = manager.call_method1(intern!(manager.py(), "get_block_ids"), (&**id,))?;
        // The same rule as `num_kv_cache_groups`: one group's table per request.
        rollback::check_single_group(i64::try_from(groups.len()?).unwrap_or(i64::MAX)).py()?;
        tables.push(int_column(&groups.get_item(0)?)?);
    }
    Ok(Tables::Python(tables))
}

impl Tables<'_> {
    pub(super) fn ids(&self) -> Vec<BlockIds<'_>> {
        match self {
            Self::Native(t) => t.iter().map(|t| BlockIds::U32(t)).collect(),
            Self::Python(t) => t.iter().map(|t| BlockIds::I64(t)).collect(),
        }
    }
}
