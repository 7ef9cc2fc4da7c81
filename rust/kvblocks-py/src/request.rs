//! `Request` for Python: a request's tokens and block hashes kept in Rust, so the
//! native manager reads them in place and a native `BlockHasher` hashes them without a
//! Python call per block.

// The Python-visible items' docs are the reference's docstrings (reST, from
// `docstrings.rs`), not rustdoc markdown, so the markdown lint does not apply.
#![allow(clippy::doc_markdown)]

use kvblocks_core::{BlockHash, Error};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyString, PyTuple};
use pyo3::{PyTraverseError, PyVisit};
use std::sync::OnceLock;

use crate::convert::{self, block_hashes, to_list, token_id, token_ids, type_name, Given};
use crate::errors::to_py;
use crate::extra_keys::ExtrasAttrs;
use crate::hashing::{NativeRequest, PyBlockHasher};
use crate::imports::{INTEGRAL, ITERABLE};

#[doc = docstring!(Request)]
#[pyclass(module = "kvblocks._native", name = "Request")]
pub struct PyRequest {
    request_id: String,
    /// The `str` object given as the id, handed back as it was.
    request_id_obj: Py<PyString>,
    num_prompt_tokens: usize,
    /// Prompt then output token ids.
    all_token_ids: Vec<i64>,
    num_computed_tokens: i64,
    block_hashes: Vec<BlockHash>,
    // The Python attributes; `None` stands for Python `None` (and after `__clear__`).
    block_hasher: Option<Py<PyAny>>,
    #[doc = docstring!(Request.lora_request)]
    #[pyo3(get, set)]
    lora_request: Option<Py<PyAny>>,
    #[doc = docstring!(Request.cache_salt)]
    #[pyo3(get, set)]
    cache_salt: Option<Py<PyAny>>,
    #[doc = docstring!(Request.mm_features)]
    #[pyo3(get, set)]
    mm_features: Option<Py<PyAny>>,
    #[doc = docstring!(Request.prompt_embeds)]
    #[pyo3(get, set)]
    prompt_embeds: Option<Py<PyAny>>,
    /// The lists the getters hand out, one object each for the request's life: the
    /// reference hands out its own lists, so a scheduler reading `all_token_ids` or
    /// `block_hashes` every step gets one object and pays only for what changed.
    views: ListViews,
}

/// Python mirrors of a request's token and hash vectors (see [`PyRequest::views`]).
/// Each is made on first read; [`PyRequest::sync_views`] brings the existing ones in
/// step after every change, before any hasher runs, so a list handed out earlier and a
/// hasher reading the request both see the tokens being appended.
#[derive(Default)]
struct ListViews {
    prompt_token_ids: OnceLock<Py<PyList>>,
    all_token_ids: OnceLock<Py<PyList>>,
    output_token_ids: OnceLock<Py<PyList>>,
    block_hashes: OnceLock<Py<PyList>>,
}

/// The list in `cell`, or a new list of `items` (converted by `convert`) put there.
fn view<'py, T, O>(
    py: Python<'py>,
    cell: &OnceLock<Py<PyList>>,
    items: &[T],
    convert: impl Fn(&T) -> O,
) -> PyResult<Bound<'py, PyList>>
where
    O: IntoPyObject<'py>,
{
    if let Some(list) = cell.get() {
        return Ok(list.bind(py).clone());
    }
    // Building the list runs no Python code, so nothing can fill the cell meanwhile and
    // `set` cannot fail.
    let list = PyList::new(py, items.iter().map(convert))?;
    let _ = cell.set(list.clone().unbind());
    Ok(list)
}

/// Brings the list in `cell`, if it was made, in step with `items`: appends what
/// `items` gained, deletes the tail it lost (an append taken back).
fn sync<'py, T, O>(
    py: Python<'py>,
    cell: &OnceLock<Py<PyList>>,
    items: &[T],
    convert: impl Fn(&T) -> O,
) -> PyResult<()>
where
    O: IntoPyObject<'py>,
{
    let Some(list) = cell.get().map(|l| l.bind(py)) else {
        return Ok(());
    };
    let len = list.len();
    match items.get(len..) {
        Some(new) => new.iter().try_for_each(|item| list.append(convert(item))),
        None => list.del_slice(items.len(), len),
    }
}

impl PyRequest {
    /// Brings the handed-out lists in step with the token and hash vectors.
    fn sync_views(&self, py: Python<'_>) -> PyResult<()> {
        let views = &self.views;
        sync(py, &views.all_token_ids, &self.all_token_ids, |&t| t)?;
        sync(py, &views.output_token_ids, self.output(), |&t| t)?;
        sync(py, &views.block_hashes, &self.block_hashes, |h| {
            PyBytes::new(py, h.as_bytes())
        })
    }

    /// The prompt's token ids.
    fn prompt(&self) -> &[i64] {
        self.all_token_ids
            .get(..self.num_prompt_tokens)
            .unwrap_or_default()
    }

    /// The output token ids.
    fn output(&self) -> &[i64] {
        self.all_token_ids
            .get(self.num_prompt_tokens..)
            .unwrap_or_default()
    }

    /// The request id.
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The request id, as the `str` object it was given as.
    pub fn request_id_str<'py>(&self, py: Python<'py>) -> Bound<'py, PyString> {
        self.request_id_obj.bind(py).clone()
    }

    /// The token ids of `range` (fewer when the request holds fewer, as a slice).
    pub fn tokens(&self, range: std::ops::Range<usize>) -> &[i64] {
        let end = range.end.min(self.all_token_ids.len());
        self.all_token_ids
            .get(range.start.min(end)..end)
            .unwrap_or_default()
    }

    /// Prompt plus output tokens.
    pub fn num_tokens(&self) -> i64 {
        i64::try_from(self.all_token_ids.len()).unwrap_or(i64::MAX)
    }

    /// Tokens whose KV is computed.
    pub fn num_computed_tokens(&self) -> i64 {
        self.num_computed_tokens
    }

    /// The hashes of the full blocks, block 0 first.
    pub fn block_hashes(&self) -> &[BlockHash] {
        &self.block_hashes
    }

    /// What a native `BlockHasher` reads of the request.
    pub fn hash_view<'a, 'py>(&'a self, py: Python<'py>) -> NativeRequest<'a, 'py> {
        NativeRequest {
            tokens: &self.all_token_ids,
            hashes: &self.block_hashes,
            attrs: ExtrasAttrs {
                lora_request: bind_or_none(py, self.lora_request.as_ref()),
                mm_features: bind_or_none(py, self.mm_features.as_ref()),
                cache_salt: bind_or_none(py, self.cache_salt.as_ref()),
            },
            prompt_embeds: bind_or_none(py, self.prompt_embeds.as_ref()),
        }
    }
}

fn bind_or_none<'py>(py: Python<'py>, obj: Option<&Py<PyAny>>) -> Bound<'py, PyAny> {
    obj.map_or_else(|| py.None().into_bound(py), |o| o.bind(py).clone())
}

/// `Some(obj)` unless `obj` is Python `None`.
fn non_none(obj: Option<&Bound<'_, PyAny>>) -> Option<Py<PyAny>> {
    obj.filter(|o| !o.is_none()).map(|o| o.clone().unbind())
}

/// Whether `append_output_token_ids` takes `obj` as one id, as the reference decides:
/// an `numbers.Integral`, or anything that is not an `Iterable`.
fn is_single_id(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    // The common cases, without the ABC checks.
    if obj.is_instance_of::<PyInt>() {
        return Ok(true);
    }
    if obj.is_exact_instance_of::<PyList>() || obj.is_exact_instance_of::<PyTuple>() {
        return Ok(false);
    }
    let py = obj.py();
    Ok(obj.is_instance(INTEGRAL.get(py)?)? || !obj.is_instance(ITERABLE.get(py)?)?)
}

#[pymethods]
impl PyRequest {
    // Builds a request and hashes its full prompt blocks (the hasher gets the finished
    // object, so `#[new]` returns it rather than a struct to wrap).
    #[new]
    #[pyo3(
        signature = (
            request_id,
            prompt_token_ids,
            *,
            block_hasher = None,
            lora_request = None,
            cache_salt = None,
            mm_features = Given::Absent,
            prompt_embeds = None,
        ),
        text_signature = None
    )]
    #[allow(clippy::too_many_arguments)] // the reference's keyword arguments
    fn new<'py>(
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
        prompt_token_ids: &Bound<'py, PyAny>,
        block_hasher: Option<&Bound<'py, PyAny>>,
        lora_request: Option<&Bound<'py, PyAny>>,
        cache_salt: Option<&Bound<'py, PyAny>>,
        mm_features: Given<'py>,
        prompt_embeds: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, Self>> {
        let id = convert::request_id(request_id.clone(), "request_id")?;
        // An exact `str`, so a subclass's dunders never run later.
        let request_id_obj = match request_id.cast_exact::<PyString>() {
            Ok(exact) => exact.clone().unbind(),
            Err(_) => PyString::new(py, &id).unbind(),
        };
        let request_id = id.to_string();
        let block_hasher = non_none(block_hasher);
        if let Some(hasher) = &block_hasher {
            if !hasher.bind(py).is_callable() {
                return Err(PyTypeError::new_err(format!(
                    "block_hasher must be callable or None, got {}",
                    type_name(hasher.bind(py))
                )));
            }
        }
        let prompt = token_ids(prompt_token_ids)?.into_vec();
        let mm_features = match mm_features {
            Given::Absent => Some(PyTuple::empty(py).into_any().unbind()),
            Given::Is(obj) => non_none(Some(&obj)),
        };
        let request = Bound::new(
            py,
            Self {
                request_id_obj,
                request_id,
                num_prompt_tokens: prompt.len(),
                all_token_ids: prompt,
                num_computed_tokens: 0,
                block_hashes: Vec::new(),
                block_hasher,
                lora_request: non_none(lora_request),
                cache_salt: non_none(cache_salt),
                mm_features,
                prompt_embeds: non_none(prompt_embeds),
                views: ListViews::default(),
            },
        )?;
        Self::update_block_hashes(&request)?;
        Ok(request)
    }

    #[doc = docstring!(Request.request_id)]
    #[getter(request_id)]
    fn request_id_py(&self, py: Python<'_>) -> Py<PyString> {
        self.request_id_obj.clone_ref(py)
    }

    #[doc = docstring!(Request.prompt_token_ids)]
    #[getter]
    fn prompt_token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        view(py, &self.views.prompt_token_ids, self.prompt(), |&t| t)
    }

    #[doc = docstring!(Request.all_token_ids)]
    #[getter]
    fn all_token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        view(py, &self.views.all_token_ids, &self.all_token_ids, |&t| t)
    }

    #[doc = docstring!(Request.output_token_ids)]
    #[getter]
    fn output_token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        view(py, &self.views.output_token_ids, self.output(), |&t| t)
    }

    #[doc = docstring!(Request.block_hashes)]
    #[getter(block_hashes)]
    fn block_hashes_list<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        view(py, &self.views.block_hashes, &self.block_hashes, |h| {
            PyBytes::new(py, h.as_bytes())
        })
    }

    #[doc = docstring!(Request.num_tokens)]
    #[getter(num_tokens)]
    fn num_tokens_py(&self) -> usize {
        self.all_token_ids.len()
    }

    #[doc = docstring!(Request.num_prompt_tokens)]
    #[getter]
    fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
    }

    #[doc = docstring!(Request.num_output_tokens)]
    #[getter]
    fn num_output_tokens(&self) -> usize {
        self.all_token_ids
            .len()
            .saturating_sub(self.num_prompt_tokens)
    }

    #[doc = docstring!(Request.num_computed_tokens)]
    #[getter(num_computed_tokens)]
    fn num_computed_tokens_py(&self) -> i64 {
        self.num_computed_tokens
    }

    #[setter]
    fn set_num_computed_tokens(&mut self, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let count: i64 = value.extract()?;
        if count < 0 {
            return Err(to_py(&Error::Negative {
                name: "num_computed_tokens",
                value: count,
            }));
        }
        self.num_computed_tokens = count;
        Ok(())
    }

    #[doc = docstring!(Request.block_hasher)]
    #[getter]
    fn block_hasher(&self, py: Python<'_>) -> Py<PyAny> {
        bind_or_none(py, self.block_hasher.as_ref()).unbind()
    }

    #[doc = docstring!(Request.append_output_token_ids)]
    #[pyo3(text_signature = None)]
    fn append_output_token_ids(
        slf: &Bound<'_, Self>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let new_ids = if is_single_id(token_ids)? {
            vec![token_id(token_ids)?]
        } else {
            self::token_ids(token_ids)?.into_vec()
        };
        let py = slf.py();
        slf.try_borrow_mut()?
            .all_token_ids
            .extend_from_slice(&new_ids);
        slf.try_borrow()?.sync_views(py)?;
        Self::update_block_hashes(slf).or_else(|err| {
            // All or nothing: take the tokens back out.
            let mut request = slf.try_borrow_mut()?;
            let keep = request.all_token_ids.len().saturating_sub(new_ids.len());
            request.all_token_ids.truncate(keep);
            request.sync_views(py)?;
            Err(err)
        })
    }

    #[doc = docstring!(Request.update_block_hashes)]
    #[pyo3(text_signature = None)]
    fn update_block_hashes(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let Some(hasher) = slf
            .try_borrow()?
            .block_hasher
            .as_ref()
            .map(|h| h.clone_ref(py))
        else {
            return Ok(());
        };
        if let Ok(native) = hasher.bind(py).cast::<PyBlockHasher>() {
            let native = native.get();
            // Planning may read the extra-key attributes through Python, which may read
            // this request: only a shared borrow is held meanwhile.
            let plan = {
                let request = slf.try_borrow()?;
                native.plan(&request.hash_view(py))?
            };
            if let Some(plan) = plan {
                let mut request = slf.try_borrow_mut()?;
                let Self {
                    all_token_ids,
                    block_hashes,
                    ..
                } = &mut *request;
                native.run(&plan, all_token_ids, block_hashes)?;
            }
            return slf.try_borrow()?.sync_views(py);
        }
        // Any other callable gets the request itself, with no borrow held, and may
        // read anything on it.
        let result = hasher.bind(py).call1((slf,))?;
        let new_hashes = block_hashes(to_list(&result)?.iter())?;
        slf.try_borrow_mut()?.block_hashes.extend(new_hashes);
        slf.try_borrow()?.sync_views(py)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Request(request_id={}, num_tokens={}, num_computed_tokens={}, num_block_hashes={})",
            self.request_id_obj.bind(py).repr()?,
            self.all_token_ids.len(),
            self.num_computed_tokens,
            self.block_hashes.len()
        ))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for obj in [
            &self.block_hasher,
            &self.lora_request,
            &self.cache_salt,
            &self.mm_features,
            &self.prompt_embeds,
        ]
        .into_iter()
        .flatten()
        {
            visit.call(obj)?;
        }
        let views = &self.views;
        let cells = [
            &views.prompt_token_ids,
            &views.all_token_ids,
            &views.output_token_ids,
            &views.block_hashes,
        ];
        for list in cells.into_iter().filter_map(OnceLock::get) {
            visit.call(list)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.block_hasher = None;
        self.lora_request = None;
        self.cache_salt = None;
        self.mm_features = None;
        self.prompt_embeds = None;
        self.views = ListViews::default();
    }
}
