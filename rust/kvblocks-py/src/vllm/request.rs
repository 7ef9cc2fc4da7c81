//! What the vLLM managers read of vLLM's `Request`, once per call: its id, counts
//! and block hashes (converted once each and kept per request), and the token source
//! their events read.

use std::cell::RefCell;
use std::ops::Range;

use kvblocks_core::request::{HashSource, RequestView};
use kvblocks_core::BlockHash;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PySequence, PyString};

use crate::events::{EventSource, RequestTokens};
use crate::manager::PyHashes;

/// The block hashes of one request converted so far, and the `block_hashes` item the
/// last of them was read from.
#[derive(Default)]
pub(crate) struct HashCache {
    hashes: Vec<BlockHash>,
    last: Option<Py<PyAny>>,
}

impl HashCache {
    /// Keeps what is still current. vLLM appends to `request.block_hashes`, but also
    /// cuts its tail and regrows it (a streaming session's update) or rebuilds it: then
    /// the item the last cached hash came from is no longer in its place (an identity
    /// test, one item per call), and the cache starts over.
    pub(crate) fn sync(&mut self, source: &PyHashes<'_>) -> PyResult<()> {
        if self.hashes.len() > source.num_hashes() {
            self.hashes.truncate(source.num_hashes());
            self.last = self
                .hashes
                .len()
                .checked_sub(1)
                .map(|i| source.item(i))
                .transpose()?
                .flatten()
                .map(Bound::unbind);
        }
        let Some(i) = self.hashes.len().checked_sub(1) else {
            return Ok(());
        };
        let current = source.item(i)?;
        if current.as_ref().map(Bound::as_ptr) != self.last.as_ref().map(Py::as_ptr) {
            self.hashes.clear();
            self.last = None;
        }
        Ok(())
    }
}

/// A request's block hashes: those read before from its [`HashCache`], the rest
/// converted from `request.block_hashes` as the core asks for them and added to it.
pub(crate) struct CachedHashes<'a, 'py> {
    pub(crate) source: PyHashes<'py>,
    pub(crate) cache: RefCell<&'a mut HashCache>,
}

impl CachedHashes<'_, '_> {
    /// Converts the hashes up to `end` that the cache does not hold yet.
    fn fill(&self, end: usize) -> kvblocks_core::Result<()> {
        let mut cache = self.cache.borrow_mut();
        let start = cache.hashes.len();
        if start < end {
            self.source.hashes(start..end, &mut cache.hashes)?;
            match self.source.item(end - 1) {
                Ok(item) => cache.last = item.map(Bound::unbind),
                Err(err) => {
                    cache.hashes.truncate(start);
                    return Err(self.source.keep(err));
                }
            }
        }
        Ok(())
    }
}

/// Runs `f` on `manager` with a view of `request` (read as `req`): its hashes come from
/// `cache`, synced first and filled as the core asks; with events on, its tokens are
/// read as the core records `BlockStored`s, whose request fields are attached after.
pub(crate) fn with_request_view<M: EventSource, T>(
    manager: &mut M,
    cache: &mut HashCache,
    request: &Bound<'_, PyAny>,
    req: VllmRequest<'_>,
    f: impl FnOnce(&mut M, &RequestView<'_, dyn HashSource + '_>) -> kvblocks_core::Result<T>,
) -> PyResult<T> {
    cache.sync(&req.block_hashes)?;
    let id = req.request_id.to_str()?;
    let hashes = CachedHashes {
        source: req.block_hashes,
        cache: RefCell::new(cache),
    };
    let (state, log) = manager.event_parts();
    let tokens = RequestTokens::new(state.as_deref(), request);
    let before = log.len();
    let view = RequestView {
        request_id: id,
        num_tokens: req.num_tokens,
        num_computed_tokens: req.num_computed_tokens,
        block_hashes: &hashes as &dyn HashSource,
    };
    let result = hashes
        .source
        .finish(tokens.run(&view, |view| f(manager, view)));
    let (state, log) = manager.event_parts();
    tokens.finish(result, state, log, before)
}

impl HashSource for CachedHashes<'_, '_> {
    fn num_hashes(&self) -> usize {
        self.source.num_hashes()
    }

    fn hashes(&self, range: Range<usize>, out: &mut Vec<BlockHash>) -> kvblocks_core::Result<()> {
        self.fill(range.end)?;
        self.cache.borrow().hashes.as_slice().hashes(range, out)
    }

    fn hash(&self, i: usize) -> kvblocks_core::Result<BlockHash> {
        self.fill(i + 1)?;
        self.cache.borrow().hashes.as_slice().hash(i)
    }
}

/// What the manager reads of a vLLM `Request`, read once per call.
pub(crate) struct VllmRequest<'py> {
    pub(crate) request_id: Bound<'py, PyString>,
    pub(crate) num_tokens: i64,
    pub(crate) num_computed_tokens: i64,
    pub(crate) block_hashes: PyHashes<'py>,
}

impl<'py> VllmRequest<'py> {
    pub(crate) fn read(request: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = request.py();
        let attr = |name: &Bound<'py, PyString>| request.getattr(name).map_err(|e| named(name, &e));
        let hashes = intern!(py, "block_hashes");
        let id = intern!(py, "request_id");
        Ok(Self {
            block_hashes: PyHashes::of(
                attr(hashes)?
                    .cast_into::<PySequence>()
                    .map_err(|e| named(hashes, &e.into()))?,
            )?,
            request_id: attr(id)?
                .cast_into::<PyString>()
                .map_err(|e| named(id, &e.into()))?,
            num_tokens: request_attr(request, intern!(py, "num_tokens"))?,
            num_computed_tokens: request_attr(request, intern!(py, "num_computed_tokens"))?,
        })
    }
}

/// An int attribute of the request; an error names it.
pub(crate) fn request_attr(
    request: &Bound<'_, PyAny>,
    name: &Bound<'_, PyString>,
) -> PyResult<i64> {
    request
        .getattr(name)
        .and_then(|v| v.extract())
        .map_err(|e| named(name, &e))
}

/// `err`, of the same class, with a message that starts with the attribute it concerns.
fn named(name: &Bound<'_, PyString>, err: &PyErr) -> PyErr {
    let py = name.py();
    let message = format!("request.{name}: {}", err.value(py));
    match err.get_type(py).call1((message,)) {
        Ok(value) => PyErr::from_value(value),
        Err(_) => err.clone_ref(py),
    }
}

/// `request.request_id`.
pub(crate) fn request_id(request: &Bound<'_, PyAny>) -> PyResult<String> {
    request
        .getattr(intern!(request.py(), "request_id"))?
        .extract()
}

/// The request's `status` when the watermark can apply to this allocation (other
/// requests are scheduled and a watermark is set), else `None` without reading it. The
/// watermark applies when that status is an admission status (vLLM's waiting and
/// preempted ones).
pub(crate) fn admission_status(
    request: &Bound<'_, PyAny>,
    has_scheduled_reqs: bool,
    watermark_blocks: usize,
) -> PyResult<Option<i64>> {
    if !has_scheduled_reqs || watermark_blocks == 0 {
        return Ok(None);
    }
    request_attr(request, intern!(request.py(), "status")).map(Some)
}

/// `getattr(request, name, False)`, by truthiness.
pub(crate) fn request_flag(
    request: &Bound<'_, PyAny>,
    name: &Bound<'_, PyString>,
) -> PyResult<bool> {
    request
        .getattr_opt(name)?
        .map_or(Ok(false), |v| v.is_truthy())
}
