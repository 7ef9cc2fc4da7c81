//! `BlockHasher` for Python: argument conversion around
//! `kvblocks_core::hashing::BlockHasher`, and vLLM's request hasher (`__call__`), whose
//! extra keys come from the request's extras (`crate::extra_keys::read_extras`).
//!
//! Speed: token ids of exact lists and tuples are read with no reference counting, and
//! a native `Request` is hashed from its `Vec` with no Python call per block.

// The Python-visible items' docs are the reference's docstrings (reST, from
// `docstrings.rs`), not rustdoc markdown, so the markdown lint does not apply.
#![allow(clippy::doc_markdown)]

use kvblocks_core::extra_keys::{block_extra_keys, new_blocks, MmWalk};
use kvblocks_core::hashing::{
    py_repr, resolve_seed, BlockHasher as CoreHasher, HashAlgo, ObjectId, Value,
};
use kvblocks_core::{BlockHash, Error};
use pyo3::exceptions::{PyIndexError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PySlice, PyString, PyTuple};

use crate::convert::{token_ids, type_name, Given};
use crate::errors::{to_py, IntoPyResult};
use crate::extra_keys::{
    attr_or_none, extra_key, read_extras, ExtrasAttrs, Identities, KeyedBlocks,
};
use crate::imports::OS_ENVIRON;
use crate::num_tokens::vllm_num_tokens;

/// `parent` as the reference's `_check_parent` takes it: `None` or exact `bytes`.
fn parent_arg<'a, 'py>(parent: &'a Bound<'py, PyAny>) -> PyResult<Option<&'a Bound<'py, PyBytes>>> {
    if parent.is_none() {
        return Ok(None);
    }
    parent.cast_exact::<PyBytes>().map(Some).map_err(|_| {
        PyTypeError::new_err(format!(
            "parent hash must be bytes or None, got {}",
            type_name(parent)
        ))
    })
}

// ----------------------------------------------------------------------------- requests

/// A native request's state, as the hasher reads it.
pub struct NativeRequest<'a, 'py> {
    /// Prompt and output token ids.
    pub tokens: &'a [i64],
    /// The hashes of the blocks hashed so far.
    pub hashes: &'a [BlockHash],
    /// Where the extra keys come from.
    pub attrs: ExtrasAttrs<'py>,
    /// `prompt_embeds`: no block of a request that has them is hashed.
    pub prompt_embeds: Bound<'py, PyAny>,
}

/// The new blocks of a request and their extra keys, gathered (which may run Python
/// code: attribute reads) before anything is hashed.
pub struct RequestPlan {
    /// Token range of the new full blocks in `all_token_ids`.
    start: usize,
    end: usize,
    /// The last known hash, if any (else the chain starts at `none_hash`).
    parent: Option<BlockHash>,
    /// One entry per new block, or `None` when no block has extra keys.
    keys: Option<Vec<Option<Value>>>,
}

fn embeds_error() -> PyErr {
    PyTypeError::new_err(
        "requests with prompt_embeds are not supported: kvblocks hashes token ids only",
    )
}

/// vLLM 0.33.0's extra keys for `num_blocks` blocks of `block_size` tokens from token
/// `start` (the rules are the core's [`block_extra_keys`]). `None` when no block has any.
fn request_extra_keys(
    attrs: &ExtrasAttrs<'_>,
    start: usize,
    num_blocks: usize,
    block_size: usize,
    ids: &mut Identities,
) -> PyResult<Option<Vec<Option<Value>>>> {
    if num_blocks == 0 {
        return Ok(None);
    }
    let blocks = KeyedBlocks {
        start,
        num_blocks,
        block_size,
        walk: MmWalk::Hashing,
    };
    let mut keep = Vec::new();
    let extras = read_extras(attrs, blocks, ids, &mut keep)?;
    block_extra_keys(&extras, start, num_blocks, block_size).py()
}

// ----------------------------------------------------------------------------- the class

#[doc = docstring!(BlockHasher)]
#[pyclass(module = "kvblocks._native", name = "BlockHasher", frozen)]
pub struct PyBlockHasher {
    inner: CoreHasher,
    /// `none_hash` as one `bytes` object, so that the object callers see is the one that
    /// extra keys can refer to ([`ObjectId::NONE_HASH`]).
    none_hash: Py<PyBytes>,
}

impl PyBlockHasher {
    /// Identities for hashing blocks whose first parent is `parent` (`None` or empty:
    /// the hasher's `none_hash` object).
    fn identities(&self, py: Python<'_>, parent: Option<&Bound<'_, PyBytes>>) -> Identities {
        match parent {
            Some(p) if !p.as_bytes().is_empty() => {
                Identities::new(Some((p.as_any(), ObjectId::PARENT)))
            }
            _ => Identities::new(Some((
                self.none_hash.bind(py).as_any(),
                ObjectId::NONE_HASH,
            ))),
        }
    }

    /// The new blocks of a native request (`None`: nothing to hash). Reads only the
    /// request's extra-key attributes through Python.
    ///
    /// # Errors
    /// `TypeError` for `prompt_embeds` when a block is to be hashed, and whatever
    /// reading or checking the extra keys raises.
    pub fn plan(&self, request: &NativeRequest<'_, '_>) -> PyResult<Option<RequestPlan>> {
        let py = request.prompt_embeds.py();
        let block_size = self.inner.block_size();
        let Some((start, num_blocks)) =
            new_blocks(request.hashes.len(), request.tokens.len(), block_size)
        else {
            return Ok(None);
        };
        if !request.prompt_embeds.is_none() {
            return Err(embeds_error());
        }
        let parent = request
            .hashes
            .last()
            .copied()
            .filter(|h| !h.as_bytes().is_empty());
        let mut ids = if parent.is_some() {
            // The parent is a Rust value: no Python object can be it.
            Identities::new(None)
        } else {
            self.identities(py, None)
        };
        let keys = request_extra_keys(&request.attrs, start, num_blocks, block_size, &mut ids)?;
        Ok(Some(RequestPlan {
            start,
            end: start + num_blocks * block_size,
            parent,
            keys,
        }))
    }

    /// Appends the hashes of a plan's blocks of `tokens` (the request's token ids) to
    /// `out`, continuing the chain from the plan's parent. No Python code runs.
    ///
    /// # Errors
    /// `IndexError` when `tokens` is shorter than at planning time.
    pub fn run(
        &self,
        plan: &RequestPlan,
        tokens: &[i64],
        out: &mut Vec<BlockHash>,
    ) -> PyResult<()> {
        let block = tokens
            .get(plan.start..plan.end)
            .ok_or_else(|| PyIndexError::new_err("the request's tokens changed while hashing"))?;
        let parent = plan.parent.as_ref().map(BlockHash::as_bytes);
        self.inner
            .extend_hashes(out, block, parent, plan.keys.as_deref())
            .py()
    }

    /// `__call__`: the hashes of a request's new full blocks, its attributes read step
    /// for step as the reference reads them (a native `Request` too).
    fn request_hashes(&self, request: &Bound<'_, PyAny>) -> PyResult<Vec<BlockHash>> {
        let py = request.py();
        let block_size = self.inner.block_size();
        // vLLM's read order: a decoding step that fills no block reads two fields.
        let known = request.getattr(intern!(py, "block_hashes"))?;
        let num_known = known.len()?;
        let num_tokens: i64 = match vllm_num_tokens(request)? {
            Some(n) => n,
            None => request.getattr(intern!(py, "num_tokens"))?.extract()?,
        };
        // A negative count has no blocks.
        let Some((start, num_blocks)) = new_blocks(
            num_known,
            usize::try_from(num_tokens).unwrap_or(0),
            block_size,
        ) else {
            return Ok(Vec::new());
        };
        if !attr_or_none(request, intern!(py, "prompt_embeds"))?.is_none() {
            return Err(embeds_error());
        }
        let last = if num_known > 0 {
            Some(known.get_item(-1)?)
        } else {
            None
        };
        let parent = match &last {
            Some(obj) => parent_arg(obj)?,
            None => None,
        };
        let end = start + num_blocks * block_size;
        let slice = PySlice::new(
            py,
            isize::try_from(start).unwrap_or(isize::MAX),
            isize::try_from(end).unwrap_or(isize::MAX),
            1,
        );
        let tokens = token_ids(
            &request
                .getattr(intern!(py, "all_token_ids"))?
                .get_item(slice)?,
        )?;

        let attrs = ExtrasAttrs::of(request)?;
        // A request claiming more tokens than its slice holds hashes the blocks it has,
        // as the reference does: keys are planned for those only, never for the claim.
        let hashed = (tokens.len() / block_size).min(num_blocks);
        let mut ids = self.identities(py, parent);
        let keys = request_extra_keys(&attrs, start, hashed, block_size, &mut ids)?;
        let tokens = tokens.get(..hashed * block_size).unwrap_or_default();
        self.inner
            .hash_blocks(
                tokens,
                parent.map(PyBytesMethods::as_bytes),
                keys.as_deref(),
            )
            .py()
    }
}

/// Hashes as a list of `bytes`.
fn hash_list<'py>(py: Python<'py>, hashes: &[BlockHash]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, h.as_bytes())))
}

#[pymethods]
impl PyBlockHasher {
    #[new]
    #[pyo3(
        signature = (block_size, algo = Given::Absent, seed = None),
        text_signature = None
    )]
    fn new(
        py: Python<'_>,
        block_size: &Bound<'_, PyAny>,
        algo: Given<'_>,
        seed: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let block_size: i64 = block_size.extract()?;
        // Checked before the algorithm, in the reference's order.
        kvblocks_core::error::positive("block_size", block_size).py()?;
        let algo = match algo {
            Given::Absent => HashAlgo::Sha256,
            Given::Is(obj) => match obj.cast::<PyString>().map(|s| s.to_str()) {
                Ok(Ok(name)) => HashAlgo::from_name(name).py()?,
                // Not a (valid) string: the same message, quoting the object's repr().
                _ => return Err(to_py(&HashAlgo::unknown(&obj.repr()?.to_string()))),
            },
        };
        let explicit = match seed {
            Some(s) if !s.is_none() => {
                let s = s.cast::<PyString>().map_err(|_| {
                    PyTypeError::new_err(format!(
                        "seed must be a str or None, got {}",
                        type_name(s)
                    ))
                })?;
                Some(s.to_str()?.to_owned())
            }
            _ => None,
        };
        // Read through os.environ, as the reference does, so that changes made from
        // Python (monkeypatch.setenv) are seen.
        let env: Option<String> = if explicit.is_none() {
            OS_ENVIRON
                .get(py)?
                .call_method1(intern!(py, "get"), (intern!(py, "PYTHONHASHSEED"),))?
                .extract()?
        } else {
            None
        };
        let seed = resolve_seed(explicit.as_deref(), env.as_deref(), algo).py()?;
        let inner = CoreHasher::new(block_size, algo, &seed).py()?;
        let none_hash = PyBytes::new(py, inner.none_hash().as_bytes()).unbind();
        Ok(Self { inner, none_hash })
    }

    #[doc = docstring!(BlockHasher.block_size)]
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[doc = docstring!(BlockHasher.algo)]
    #[getter]
    fn algo(&self) -> &'static str {
        self.inner.algo().name()
    }

    #[doc = docstring!(BlockHasher.seed)]
    #[getter]
    fn seed(&self) -> &str {
        self.inner.seed()
    }

    #[doc = docstring!(BlockHasher.none_hash)]
    #[getter]
    fn none_hash(&self, py: Python<'_>) -> Py<PyBytes> {
        self.none_hash.clone_ref(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockHasher(block_size={}, algo={}, seed={})",
            self.inner.block_size(),
            py_repr(self.inner.algo().name()),
            py_repr(self.inner.seed())
        )
    }

    #[doc = docstring!(BlockHasher.hash_block)]
    #[pyo3(signature = (parent, token_ids, extra_keys = None), text_signature = None)]
    fn hash_block<'py>(
        &self,
        parent: &Bound<'py, PyAny>,
        token_ids: &Bound<'py, PyAny>,
        extra_keys: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let py = parent.py();
        let parent = parent_arg(parent)?;
        let tokens = crate::convert::token_ids(token_ids)?;
        let mut ids = self.identities(py, parent);
        let extra = extra_keys.map(|k| extra_key(k, &mut ids, 0)).transpose()?;
        let hash = self.inner.hash_block(
            parent.map(PyBytesMethods::as_bytes),
            &tokens,
            extra.as_ref(),
        );
        Ok(PyBytes::new(py, hash.as_bytes()))
    }

    #[doc = docstring!(BlockHasher.hash_blocks)]
    #[pyo3(signature = (token_ids, parent = None, extra_keys = None), text_signature = None)]
    fn hash_blocks<'py>(
        &self,
        token_ids: &Bound<'py, PyAny>,
        parent: Option<&Bound<'py, PyAny>>,
        extra_keys: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = token_ids.py();
        let tokens = crate::convert::token_ids(token_ids)?;
        let parent = match parent {
            Some(p) => parent_arg(p)?,
            None => None,
        };
        let num_blocks = tokens.len() / self.inner.block_size();
        let mut ids = self.identities(py, parent);
        let keys = match extra_keys {
            Some(keys) if !keys.is_none() => Some(block_keys(keys, num_blocks, &mut ids)?),
            _ => None,
        };
        let hashes = self
            .inner
            .hash_blocks(
                &tokens,
                parent.map(PyBytesMethods::as_bytes),
                keys.as_deref(),
            )
            .py()?;
        hash_list(py, &hashes)
    }

    #[doc = docstring!(BlockHasher.__call__)]
    #[pyo3(name = "_call")]
    fn call<'py>(&self, request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let hashes = self.request_hashes(request)?;
        hash_list(request.py(), &hashes)
    }

    /// `__call__` is `_call` (PyO3 would make a `__call__` method the `tp_call` slot,
    /// whose wrapper has CPython's generic docstring and `*args, **kwargs` signature).
    /// Setting it as a class attribute points `tp_call` at it, so instances are callable
    /// and `BlockHasher.__call__` has the reference's docstring and signature.
    #[classattr]
    #[pyo3(name = "__call__")]
    fn call_method(py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(py
            .get_type::<Self>()
            .getattr(intern!(py, "_call"))?
            .unbind())
    }
}

/// `hash_blocks`' `extra_keys`: a list or tuple with one entry per full block, each
/// checked in order.
fn block_keys(
    keys: &Bound<'_, PyAny>,
    num_blocks: usize,
    ids: &mut Identities,
) -> PyResult<Vec<Option<Value>>> {
    let items: Vec<Bound<'_, PyAny>> = if let Ok(list) = keys.cast::<PyList>() {
        list.iter().collect()
    } else if let Ok(tuple) = keys.cast::<PyTuple>() {
        tuple.iter().collect()
    } else {
        return Err(PyTypeError::new_err(format!(
            "extra_keys must be a list or tuple with one entry per full block, or None; got {}",
            type_name(keys)
        )));
    };
    if items.len() != num_blocks {
        return Err(to_py(&Error::InvalidArgument(format!(
            "extra_keys must have one entry per full block: got {} for {num_blocks} full blocks",
            items.len()
        ))));
    }
    items
        .iter()
        .map(|k| {
            if k.is_none() {
                Ok(None)
            } else {
                extra_key(k, ids, 0).map(Some)
            }
        })
        .collect()
}
