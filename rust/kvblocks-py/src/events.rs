//! KV cache events for Python: the core records compact events; `take_events()` turns
//! them into msgspec structs (the only place Python event objects are built): those of
//! `kvblocks.events`, or, for the vLLM adapter, vLLM's own classes of the same fields,
//! with the hash form (int or bytes) chosen when the manager was created.
//!
//! While the manager caches a request's blocks, the core asks for their token ids
//! through [`RequestTokens`], which reads them (`crate::request_fields::token_slice`)
//! and, at the same point (before anything changes), the request's extras
//! (`crate::extra_keys::read_extras`); the core derives the blocks' event keys from
//! them. A request with any gets its `LoRA` fields and keys
//! kept beside the core's record, as Python objects, until the events are taken.

use std::cell::RefCell;
use std::ops::Range;

use kvblocks_core::events::{hash_as_u64, EventLog, EventRecord};
use kvblocks_core::extra_keys::{event_extra_keys, MmWalk, RequestExtras};
use kvblocks_core::hashing::Value;
use kvblocks_core::manager::KVCacheManager;
use kvblocks_core::request::{HashSource, RequestView, TokenSource};
use kvblocks_core::BlockHash;
use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::errors::{IntoPyResult, StashedError};
use crate::extra_keys::{
    attr_or_none, read_extras, value_to_py, ExtrasAttrs, Identities, KeyedBlocks,
};
use crate::imports::{ALL_BLOCKS_CLEARED, BLOCK_REMOVED, BLOCK_STORED, USE_INT_BLOCK_HASHES};
use crate::request_fields::{token_slice, RequestFields};

/// `kv_cache_spec_kind` of the manager's one group.
const FULL_ATTENTION: &str = "full_attention";
/// `medium` of every event.
const MEDIUM_GPU: &str = "GPU";
/// The fields each `BlockStored` and `BlockRemoved` is built with, positionally.
const STORED_ARGS: usize = 11;
const REMOVED_ARGS: usize = 3;

/// The classes events are built as, and the `kv_cache_spec_kind` of `BlockStored`.
struct EventStructs {
    stored: Py<PyAny>,
    removed: Py<PyAny>,
    cleared: Py<PyAny>,
    spec_kind: String,
    /// Per group, `(kv_cache_spec_kind, kv_cache_spec_sliding_window)` when the groups
    /// differ (vLLM's `kv_cache_event_metadata`); `spec_kind` and no window otherwise.
    groups: Vec<(String, Option<i64>)>,
}

impl EventStructs {
    /// `BlockStored`, `BlockRemoved` and `AllBlocksCleared` of `module`, whose fields
    /// must be those of `kvblocks.events` (as vLLM's are), in the same order.
    fn of(module: &Bound<'_, PyAny>, spec_kind: String) -> PyResult<Self> {
        let py = module.py();
        Ok(Self {
            stored: module.getattr(intern!(py, "BlockStored"))?.unbind(),
            removed: module.getattr(intern!(py, "BlockRemoved"))?.unbind(),
            cleared: module.getattr(intern!(py, "AllBlocksCleared"))?.unbind(),
            spec_kind,
            groups: Vec::new(),
        })
    }
}

/// A manager's event settings and the Python side of its `BlockStored` records.
pub struct EventState {
    /// Hashes go out as ints (low 8 bytes, big-endian) rather than bytes.
    int_hashes: bool,
    structs: EventStructs,
    /// `(record index, (lora_id, lora_name, extra_keys))` for the `BlockStored` records
    /// of requests with `LoRA`, multimodal items or a cache salt, in record order.
    fields: Vec<(usize, Py<PyAny>)>,
}

impl EventState {
    /// Switches events on for `manager`, reading `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`
    /// through `kvblocks.events` (which needs `msgspec`: its `ImportError` is raised
    /// here, when the manager is created).
    pub fn enable(
        py: Python<'_>,
        manager: &mut KVCacheManager,
        last_copy_removal: bool,
    ) -> PyResult<Self> {
        let state = Self::new(py)?;
        manager.enable_kv_cache_events(last_copy_removal);
        Ok(state)
    }

    /// The settings alone, for a manager that switches its own core events on.
    pub fn new(py: Python<'_>) -> PyResult<Self> {
        let int_hashes = USE_INT_BLOCK_HASHES.get(py)?.call0()?.extract()?;
        let structs = EventStructs {
            stored: BLOCK_STORED.get(py)?.clone().unbind(),
            removed: BLOCK_REMOVED.get(py)?.clone().unbind(),
            cleared: ALL_BLOCKS_CLEARED.get(py)?.clone().unbind(),
            spec_kind: FULL_ATTENTION.to_owned(),
            groups: Vec::new(),
        };
        Ok(Self {
            int_hashes,
            structs,
            fields: Vec::new(),
        })
    }

    /// Annotates each group's `BlockStored` with its `(kind, sliding window)`.
    pub fn set_groups(&mut self, groups: Vec<(String, Option<i64>)>) {
        self.structs.groups = groups;
    }

    /// Builds the events as the classes of `module` (vLLM's `kv_events`), with
    /// `BlockStored.kv_cache_spec_kind` set to `spec_kind` (`"full_attention"` if none).
    ///
    /// # Errors
    /// `TypeError` when a class's `__struct_fields__` are not `kvblocks.events`' or a
    /// prefix of them that holds every field the events are built with (they are built
    /// positionally; an older vLLM's `BlockStored` lacks the trailing
    /// `lookahead_token_ids`, which stays at its default).
    pub fn build_as(
        &mut self,
        module: &Bound<'_, PyAny>,
        spec_kind: Option<String>,
    ) -> PyResult<()> {
        let py = module.py();
        let spec_kind = spec_kind.unwrap_or_else(|| FULL_ATTENTION.to_owned());
        let structs = EventStructs::of(module, spec_kind)?;
        let classes = [
            (&structs.stored, &self.structs.stored, STORED_ARGS),
            (&structs.removed, &self.structs.removed, REMOVED_ARGS),
            (&structs.cleared, &self.structs.cleared, 0),
        ];
        for (theirs, ours, num_args) in classes {
            let (theirs, ours) = (theirs.bind(py), ours.bind(py));
            let their_fields: Vec<String> = theirs
                .getattr(intern!(py, "__struct_fields__"))?
                .extract()?;
            let our_fields: Vec<String> =
                ours.getattr(intern!(py, "__struct_fields__"))?.extract()?;
            if their_fields.len() < num_args || !our_fields.starts_with(&their_fields) {
                return Err(PyTypeError::new_err(format!(
                    "{theirs} has the fields {their_fields:?}, not those of {ours}, \
                     {our_fields:?} (or their first {num_args} or more)"
                )));
            }
        }
        let groups = std::mem::take(&mut self.structs.groups);
        self.structs = EventStructs { groups, ..structs };
        Ok(())
    }

    fn hash<'py>(&self, py: Python<'py>, hash: &BlockHash) -> PyResult<Bound<'py, PyAny>> {
        if self.int_hashes {
            Ok(hash_as_u64(hash).into_pyobject(py)?.into_any())
        } else {
            Ok(PyBytes::new(py, hash.as_bytes()).into_any())
        }
    }
}

/// A manager whose events Python takes: its event state (`None` while events are off)
/// with its core's event log, and the emptying of that log.
pub(crate) trait EventSource {
    fn event_parts(&mut self) -> (Option<&mut EventState>, &EventLog);
    fn clear_event_log(&mut self);
}

/// The events recorded since the last call as the manager's event structs
/// (`kvblocks.events`' unless [`EventState::build_as`] chose others), oldest first; the
/// log is then emptied. `[]` with events off.
pub(crate) fn take_events<'py, M: EventSource>(
    py: Python<'py>,
    manager: &mut M,
) -> PyResult<Bound<'py, PyList>> {
    let (state, log) = manager.event_parts();
    let Some(state) = state else {
        return Ok(PyList::empty(py));
    };
    let out = build_events(py, log, state)?;
    // Only once every object was built: a failure above loses no event.
    state.fields.clear();
    manager.clear_event_log();
    Ok(out)
}

/// The events of `log` as the state's event structs, oldest first; the caller
/// clears the log and `state.fields` once this succeeded.
fn build_events<'py>(
    py: Python<'py>,
    log: &EventLog,
    state: &EventState,
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    if log.is_empty() {
        return Ok(out);
    }
    let EventStructs {
        stored,
        removed,
        cleared,
        spec_kind,
        groups,
    } = &state.structs;
    let (stored, removed, cleared) = (stored.bind(py), removed.bind(py), cleared.bind(py));
    let mut fields = state.fields.iter().peekable();
    for (index, record) in log.records().iter().enumerate() {
        let event = match record {
            EventRecord::Stored(s) => {
                let hashes = log.stored_hashes(s);
                let hash_list = PyList::empty(py);
                for h in hashes {
                    hash_list.append(state.hash(py, h)?)?;
                }
                let parent = match &s.parent {
                    Some(h) => state.hash(py, h)?,
                    None => py.None().into_bound(py),
                };
                let (lora_id, lora_name, extra_keys) = match fields.next_if(|(at, _)| *at == index)
                {
                    Some((_, f)) => {
                        let (lora_id, lora_name, extra_keys) = f.bind(py).extract::<(
                            Bound<'py, PyAny>,
                            Bound<'py, PyAny>,
                            Bound<'py, PyAny>,
                        )>(
                        )?;
                        // The helper gives one entry per block of the range; a window
                        // that skipped blocks reports the stored ones only, as vLLM.
                        let extra_keys = match log.stored_positions(s) {
                            // vLLM publishes no list for a record that stored nothing.
                            _ if hashes.is_empty() => py.None().into_bound(py),
                            Some(positions) => PyList::new(
                                py,
                                positions
                                    .iter()
                                    .map(|&p| extra_keys.get_item(p - s.first_block))
                                    .collect::<PyResult<Vec<_>>>()?,
                            )?
                            .into_any(),
                            None => extra_keys,
                        };
                        (lora_id, lora_name, extra_keys)
                    }
                    // vLLM publishes no list for a record that stored nothing.
                    None if hashes.is_empty() => (
                        py.None().into_bound(py),
                        py.None().into_bound(py),
                        py.None().into_bound(py),
                    ),
                    None => (
                        py.None().into_bound(py),
                        py.None().into_bound(py),
                        PyList::new(py, hashes.iter().map(|_| py.None()))?.into_any(),
                    ),
                };
                stored.call1((
                    hash_list,
                    parent,
                    PyList::new(py, log.stored_tokens(s))?,
                    s.block_size,
                    lora_id,
                    MEDIUM_GPU,
                    lora_name,
                    extra_keys,
                    s.group,
                    groups
                        .get(ix(s.group))
                        .map_or(spec_kind.as_str(), |(kind, _)| kind.as_str()),
                    groups.get(ix(s.group)).and_then(|(_, window)| *window),
                ))?
            }
            EventRecord::Removed { hash, group } => removed.call1((
                PyList::new(py, [state.hash(py, hash)?])?,
                MEDIUM_GPU,
                *group,
            ))?,
            EventRecord::AllCleared => cleared.call0()?,
        };
        out.append(event)?;
    }
    Ok(out)
}

/// A group id as an index.
fn ix(group: u32) -> usize {
    usize::try_from(group).unwrap_or(usize::MAX)
}

/// Runs `f` on `manager` with a view of `request` (read as `fields`). With events on,
/// the request's tokens and extras are read as the core plans each `BlockStored`, and
/// its request fields are attached to the records after.
pub(crate) fn with_request<M: EventSource, T>(
    manager: &mut M,
    request: &Bound<'_, PyAny>,
    fields: &RequestFields<'_>,
    f: impl FnOnce(&mut M, &RequestView<'_, dyn HashSource + '_>) -> kvblocks_core::Result<T>,
) -> PyResult<T> {
    let (state, log) = manager.event_parts();
    let tokens = RequestTokens::new(state.as_deref(), request);
    let before = log.len();
    let result = fields.view(|view| tokens.run(view, |view| f(manager, view)));
    let (state, log) = manager.event_parts();
    tokens.finish(result, state, log, before)
}

/// A request's token ids (and `BlockStored` request fields) for the core, collected
/// while it plans a caching step. Inert when events are off.
struct RequestTokens<'py> {
    /// The request, or `None` when events are off.
    request: Option<Bound<'py, PyAny>>,
    /// A Python error met while reading, re-raised in place of the core's error.
    error: StashedError,
    /// The request fields of each planned `BlockStored`, in the order the core asked
    /// for their tokens (one `BlockStored` per ask): `None` for a request without any.
    fields: RefCell<Vec<Option<Py<PyAny>>>>,
}

impl<'py> RequestTokens<'py> {
    /// Tokens of `request` when `state` says events are on.
    fn new(state: Option<&EventState>, request: &Bound<'py, PyAny>) -> Self {
        Self {
            request: state.map(|_| request.clone()),
            error: StashedError::default(),
            fields: RefCell::new(Vec::new()),
        }
    }

    /// Runs `f` on `view`, with this token source attached to it when events are on.
    fn run<T>(
        &self,
        view: &RequestView<'_, dyn HashSource + '_>,
        f: impl FnOnce(&RequestView<'_, dyn HashSource + '_>) -> kvblocks_core::Result<T>,
    ) -> kvblocks_core::Result<T> {
        if self.request.is_none() {
            return f(view);
        }
        let hashes = WithTokens {
            hashes: view.block_hashes,
            tokens: self,
        };
        f(&RequestView {
            block_hashes: &hashes as &dyn HashSource,
            ..*view
        })
    }

    /// The call's result, with a Python error of ours in place of the core's error,
    /// and, on success, the planned request fields attached to the `BlockStored` the
    /// call recorded (among the records from index `before` on).
    fn finish<T>(
        &self,
        result: PyResult<T>,
        state: Option<&mut EventState>,
        log: &EventLog,
        before: usize,
    ) -> PyResult<T> {
        if result.is_err() {
            if let Some(err) = self.error.take() {
                return Err(err);
            }
            return result;
        }
        if let Some(state) = state {
            let planned = std::mem::take(&mut *self.fields.borrow_mut());
            let stored = (before..)
                .zip(log.records().get(before..).unwrap_or_default())
                .filter(|(_, r)| matches!(r, EventRecord::Stored(_)))
                .map(|(index, _)| index);
            for (index, fields) in stored.zip(planned) {
                if let Some(fields) = fields {
                    state.fields.push((index, fields));
                }
            }
        }
        result
    }

    /// Reads the tokens of `range` and the request's extras for its blocks, and plans
    /// the `BlockStored` fields of a request with any.
    fn read(
        &self,
        request: &Bound<'py, PyAny>,
        range: Range<usize>,
        block_size: usize,
        out: &mut Vec<i64>,
    ) -> PyResult<()> {
        let first_block = range.start / block_size.max(1);
        let num_blocks = range.len() / block_size.max(1);
        token_slice(request, range, out)?;
        let attrs = ExtrasAttrs::of(request)?;
        let blocks = KeyedBlocks {
            start: first_block * block_size,
            num_blocks,
            block_size,
            walk: MmWalk::Events,
        };
        let mut keep = Vec::new();
        let extras = read_extras(&attrs, blocks, &mut Identities::new(None), &mut keep)?;
        let keys = event_extra_keys(&extras, first_block, num_blocks, block_size).py()?;
        let planned = keys
            .map(|keys| stored_fields(&attrs.lora_request, &extras, keys.as_slice()))
            .transpose()?;
        self.fields.borrow_mut().push(planned);
        Ok(())
    }
}

/// `(lora_id, lora_name, extra_keys)` of a `BlockStored`: the adapter's `lora_int_id`,
/// or its `adapter_id` when it has one, and name; the keys as tuples.
fn stored_fields(
    lora_request: &Bound<'_, PyAny>,
    extras: &RequestExtras,
    keys: &[Option<Vec<Value>>],
) -> PyResult<Py<PyAny>> {
    let py = lora_request.py();
    let none = || py.None().into_bound(py);
    let (lora_id, lora_name) = match &extras.lora {
        Some(lora) => {
            let int_id = attr_or_none(lora_request, intern!(py, "lora_int_id"))?;
            let id = lora_request
                .getattr_opt(intern!(py, "adapter_id"))?
                .unwrap_or(int_id);
            (id, value_to_py(py, &lora.name)?)
        }
        None => (none(), none()),
    };
    let keys = keys
        .iter()
        .map(|block| match block {
            Some(values) => {
                let items = values
                    .iter()
                    .map(|v| value_to_py(py, v))
                    .collect::<PyResult<Vec<_>>>()?;
                Ok(PyTuple::new(py, items)?.into_any())
            }
            None => Ok(none()),
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok((lora_id, lora_name, PyList::new(py, keys)?)
        .into_pyobject(py)?
        .into_any()
        .unbind())
}

impl TokenSource for RequestTokens<'_> {
    fn token_ids(
        &self,
        range: Range<usize>,
        block_size: usize,
        out: &mut Vec<i64>,
    ) -> kvblocks_core::Result<()> {
        let Some(request) = &self.request else {
            return Ok(());
        };
        self.read(request, range, block_size, out)
            .map_err(|err| self.error.keep(err, "reading the request's token ids"))
    }
}

/// A request's hash source with its token source attached.
struct WithTokens<'a> {
    hashes: &'a (dyn HashSource + 'a),
    tokens: &'a dyn TokenSource,
}

impl HashSource for WithTokens<'_> {
    fn num_hashes(&self) -> usize {
        self.hashes.num_hashes()
    }

    fn hashes(&self, range: Range<usize>, out: &mut Vec<BlockHash>) -> kvblocks_core::Result<()> {
        self.hashes.hashes(range, out)
    }

    fn token_source(&self) -> Option<&dyn TokenSource> {
        Some(self.tokens)
    }
}
