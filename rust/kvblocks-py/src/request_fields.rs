//! The one reader of a request's own fields for the managers and the rollback. A call
//! that takes a request reads it here: `request_id` first, then the fields of the
//! call's [`FieldSet`] in one order (`num_tokens`, `num_computed_tokens`,
//! `block_hashes`), each converted as it is read. Every error names the field: the id's
//! message starts with `request_id`, any other field's `TypeError` or `OverflowError`
//! with `request.{field}: `. A native `Request` is read in place.
//!
//! The fields only vLLM's `Request` has (its layout counts, `status`, flags) and a
//! request's token slice are read here too. The extras have their own reader
//! (`extra_keys.rs`), and the hasher, which reads no id, its own (`hashing.rs`): a
//! native `Request` drives its hasher, so the hasher cannot depend on this module.

use std::ops::Range;

use kvblocks_core::request::{HashSource, RequestView};
use kvblocks_core::BlockHash;
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PySequence, PySlice, PyString};

use crate::convert::{int_column, request_id, type_name, HashSeq};
use crate::errors::{IntoPyResult, StashedError};
use crate::num_tokens::vllm_num_tokens;
use crate::request::PyRequest;

/// The fields a call reads besides `request_id`, which every call reads first.
#[derive(Clone, Copy)]
pub(crate) struct FieldSet {
    num_tokens: bool,
    num_computed_tokens: bool,
    block_hashes: bool,
}

impl FieldSet {
    /// `request_id` alone.
    pub(crate) const ID: Self = Self {
        num_tokens: false,
        num_computed_tokens: false,
        block_hashes: false,
    };
    /// The rollback's: the request's progress.
    pub(crate) const PROGRESS: Self = Self {
        num_computed_tokens: true,
        ..Self::ID
    };
    /// The managers': every field.
    pub(crate) const MANAGER: Self = Self {
        num_tokens: true,
        num_computed_tokens: true,
        block_hashes: true,
    };
}

/// A request's fields as one call read them. A native `Request` has them all; any
/// other object's fields outside the call's set are 0 and empty.
pub(crate) struct RequestFields<'py> {
    pub(crate) num_tokens: i64,
    pub(crate) num_computed_tokens: i64,
    source: Source<'py>,
}

enum Source<'py> {
    /// A native `Request`, borrowed for the call: its id and hashes are read in place.
    Native(PyRef<'py, PyRequest>),
    /// Any other object's id, and its hashes when the set has them.
    Read {
        request_id: PyBackedStr,
        block_hashes: Option<PyHashes<'py>>,
    },
}

impl<'py> RequestFields<'py> {
    /// Reads `request`'s fields of `fields`, in the one order.
    pub(crate) fn read(request: &Bound<'py, PyAny>, fields: FieldSet) -> PyResult<Self> {
        let py = request.py();
        // Exact: a native `Request` cannot be subclassed, and the test is one comparison.
        if let Ok(native) = request.cast_exact::<PyRequest>() {
            let native = native.try_borrow()?;
            return Ok(Self {
                num_tokens: native.num_tokens(),
                num_computed_tokens: native.num_computed_tokens(),
                source: Source::Native(native),
            });
        }
        // Evaluated as written: this is the read order.
        let request_id = id_field(request)?;
        let num_tokens = if fields.num_tokens {
            num_tokens_field(request)?
        } else {
            0
        };
        let num_computed_tokens = if fields.num_computed_tokens {
            int_field(request, intern!(py, "num_computed_tokens"))?
        } else {
            0
        };
        let block_hashes = if fields.block_hashes {
            let value = request.getattr(intern!(py, "block_hashes"))?;
            let seq = value.cast_into::<PySequence>().map_err(|e| {
                let got = type_name(e.into_inner().as_any());
                PyTypeError::new_err(format!(
                    "request.block_hashes: must be a sequence, got {got}"
                ))
            })?;
            Some(PyHashes::of(seq)?)
        } else {
            None
        };
        Ok(Self {
            num_tokens,
            num_computed_tokens,
            source: Source::Read {
                request_id,
                block_hashes,
            },
        })
    }

    /// The id's contents.
    pub(crate) fn id(&self) -> &str {
        match &self.source {
            Source::Native(request) => request.request_id(),
            Source::Read { request_id, .. } => request_id,
        }
    }

    /// The id, to keep beyond the call.
    pub(crate) fn into_id(self) -> PyResult<PyBackedStr> {
        match self.source {
            Source::Native(request) => PyBackedStr::try_from(request.request_id_str(request.py())),
            Source::Read { request_id, .. } => Ok(request_id),
        }
    }

    /// Runs `f` on a view of the request; a Python error met converting its hashes is
    /// raised in place of the core's.
    pub(crate) fn view<T>(
        &self,
        f: impl FnOnce(&RequestView<'_, dyn HashSource + '_>) -> kvblocks_core::Result<T>,
    ) -> PyResult<T> {
        let (native, python) = match &self.source {
            Source::Native(request) => (request.block_hashes(), None),
            Source::Read { block_hashes, .. } => (&[][..], block_hashes.as_ref()),
        };
        let slice = SliceHashes(native);
        let hashes: &dyn HashSource = match python {
            Some(source) => source,
            None => &slice,
        };
        let result = f(&RequestView {
            request_id: self.id(),
            num_tokens: self.num_tokens,
            num_computed_tokens: self.num_computed_tokens,
            block_hashes: hashes,
        });
        match python {
            Some(source) => source.finish(result),
            None => result.py(),
        }
    }
}

/// The fields only vLLM's `Request` has, which layouts with local attention (or
/// scheduler blocks larger than the hash blocks) read after the others, in this order.
#[derive(Default)]
pub(crate) struct LayoutFields {
    pub(crate) num_prompt_tokens: i64,
    pub(crate) shared_prefix_boundary: i64,
    pub(crate) num_in_flight_tokens: i64,
}

impl LayoutFields {
    /// Reads them when the layout uses them (`num_in_flight_tokens` only when
    /// `in_flight`: `allocate_slots` alone needs it); 0 otherwise.
    #[inline]
    pub(crate) fn read(request: &Bound<'_, PyAny>, used: bool, in_flight: bool) -> PyResult<Self> {
        if !used {
            return Ok(Self::default());
        }
        let py = request.py();
        Ok(Self {
            num_prompt_tokens: int_field(request, intern!(py, "num_prompt_tokens"))?,
            shared_prefix_boundary: int_field(request, intern!(py, "shared_prefix_boundary"))?,
            num_in_flight_tokens: if in_flight {
                int_field(request, intern!(py, "num_in_flight_tokens"))?
            } else {
                0
            },
        })
    }
}

/// `request.request_id`, an exact `str`'s contents.
#[inline]
fn id_field(request: &Bound<'_, PyAny>) -> PyResult<PyBackedStr> {
    request_id(
        request.getattr(intern!(request.py(), "request_id"))?,
        "request_id",
    )
}

/// `request.num_tokens`: vLLM's `Request`'s natively where it can be (see
/// `crate::num_tokens`).
#[inline]
fn num_tokens_field(request: &Bound<'_, PyAny>) -> PyResult<i64> {
    match vllm_num_tokens(request)? {
        Some(n) => Ok(n),
        None => int_field(request, intern!(request.py(), "num_tokens")),
    }
}

/// `request.num_computed_tokens` read alone (`handle_failed_recving` reads it of the
/// matched requests only, after every id).
pub(crate) fn num_computed_tokens_of(request: &Bound<'_, PyAny>) -> PyResult<i64> {
    int_field(request, intern!(request.py(), "num_computed_tokens"))
}

/// vLLM's `request.status` (read only when the watermark can apply).
pub(crate) fn status_of(request: &Bound<'_, PyAny>) -> PyResult<i64> {
    int_field(request, intern!(request.py(), "status"))
}

/// `getattr(request, "skip_reading_prefix_cache", False)`, by truthiness.
pub(crate) fn skips_prefix_cache(request: &Bound<'_, PyAny>) -> PyResult<bool> {
    request
        .getattr_opt(intern!(request.py(), "skip_reading_prefix_cache"))?
        .map_or(Ok(false), |v| v.is_truthy())
}

/// Whether `getattr(request, "kv_cache_report_mode", None) == "full"`.
pub(crate) fn reports_full(request: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(request
        .getattr_opt(intern!(request.py(), "kv_cache_report_mode"))?
        .is_some_and(|mode| mode.eq("full").unwrap_or(false)))
}

/// An int field, its conversion error naming it.
#[inline]
fn int_field(request: &Bound<'_, PyAny>, name: &Bound<'_, PyString>) -> PyResult<i64> {
    request
        .getattr(name)?
        .extract()
        .map_err(|e| named(name, &e))
}

/// A conversion's `TypeError` or `OverflowError` for field `name`, its message
/// prefixed with `request.{name}: `; any other error as it is.
#[cold]
fn named(name: &Bound<'_, PyString>, err: &PyErr) -> PyErr {
    let py = name.py();
    if !(err.is_instance_of::<PyTypeError>(py) || err.is_instance_of::<PyOverflowError>(py)) {
        return err.clone_ref(py);
    }
    let message = format!("request.{name}: {}", err.value(py));
    match err.get_type(py).call1((message,)) {
        Ok(value) => PyErr::from_value(value),
        Err(_) => err.clone_ref(py),
    }
}

/// Appends the token ids of `range` to `out`: a native request's in place, any
/// other's as the slice `request.all_token_ids[range]` (fewer when it holds fewer), as
/// plain ints.
pub(crate) fn token_slice(
    request: &Bound<'_, PyAny>,
    range: Range<usize>,
    out: &mut Vec<i64>,
) -> PyResult<()> {
    if let Ok(native) = request.cast_exact::<PyRequest>() {
        out.extend_from_slice(native.try_borrow()?.tokens(range));
        return Ok(());
    }
    let py = request.py();
    let bound = |i: usize| isize::try_from(i).unwrap_or(isize::MAX);
    let slice = PySlice::new(py, bound(range.start), bound(range.end), 1);
    let tokens = request
        .getattr(intern!(py, "all_token_ids"))?
        .get_item(slice)?;
    out.extend_from_slice(&int_column(&tokens)?);
    Ok(())
}

/// A request's `block_hashes`, converted lazily: the manager asks only for the ranges
/// a call needs. A Python error met while converting is kept and re-raised as it was,
/// after the core call returned (having changed nothing).
struct PyHashes<'py> {
    seq: HashSeq<'py>,
    len: usize,
    error: StashedError,
}

impl<'py> PyHashes<'py> {
    #[inline]
    fn of(seq: Bound<'py, PySequence>) -> PyResult<Self> {
        let seq = HashSeq::new(seq);
        let len = seq.len()?;
        Ok(Self {
            seq,
            len,
            error: StashedError::default(),
        })
    }

    /// Keeps `err` to be raised by [`Self::finish`]; the core's placeholder error.
    fn keep(&self, err: PyErr) -> kvblocks_core::Error {
        self.error.keep(err, "block hash conversion")
    }

    /// The core result, or the Python error the conversion hit.
    fn finish<T>(&self, result: kvblocks_core::Result<T>) -> PyResult<T> {
        self.error.finish(result)
    }
}

impl HashSource for PyHashes<'_> {
    fn num_hashes(&self) -> usize {
        self.len
    }

    fn hashes(&self, range: Range<usize>, out: &mut Vec<BlockHash>) -> kvblocks_core::Result<()> {
        self.seq
            .extend_range(range, out)
            .map_err(|err| self.keep(err))
    }

    fn hash(&self, i: usize) -> kvblocks_core::Result<BlockHash> {
        self.seq.get(i).map_err(|err| self.keep(err))
    }
}

/// Hashes already converted (a native request's).
struct SliceHashes<'a>(&'a [BlockHash]);

impl HashSource for SliceHashes<'_> {
    fn num_hashes(&self) -> usize {
        self.0.num_hashes()
    }

    fn hashes(&self, range: Range<usize>, out: &mut Vec<BlockHash>) -> kvblocks_core::Result<()> {
        self.0.hashes(range, out)
    }

    fn hash(&self, i: usize) -> kvblocks_core::Result<BlockHash> {
        self.0.hash(i)
    }
}
