//! Argument conversion: Python ints, lists of ints and NumPy-style int arrays into
//! Rust slices, without a Python object per element where it can be avoided. One file
//! per job: the plain arguments here, integer columns and token ids (`ints.rs`), the
//! buffer protocol's raw `Py_buffer` views (`buffer.rs`), and block hashes
//! (`hashes.rs`).
//!
//! * a `list` or `tuple` of ints is read item by item (one C call per item, no copy of
//!   the objects while every item is an exact `int`; a list is snapshotted before the
//!   first other item is converted, see [`to_list`]);
//! * anything exporting a one-dimensional C-contiguous integer buffer (`NumPy` arrays,
//!   `array.array`, `memoryview`) is read in place when its items are native `i64`, and
//!   widened into a `Vec<i64>` otherwise;
//! * any other iterable is materialised by [`to_list`], and each item converted as
//!   `operator.index` would.

mod buffer;
mod choice;
mod hashes;
mod ints;

pub use choice::ChoiceArg;
pub use hashes::{block_hash, block_hashes, HashSeq};
pub use ints::{int_column, token_id, token_ids, IntColumn};

use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyList, PyString, PyTuple};
use pyo3::Borrowed;

/// An argument whose default is not `None`: absent, or exactly the object passed (so
/// that an explicit `None` is told apart from the default).
pub enum Given<'py> {
    /// The caller did not pass the argument.
    Absent,
    /// The object the caller passed.
    Is(Bound<'py, PyAny>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Given<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self::Is(obj.to_owned()))
    }
}

/// The items of any iterable as they are now, in a new list only the caller holds: the
/// one place the binding materialises a caller's iterable (the reference's
/// `materialise`).
///
/// * An exact list is copied (one pointer per item): a snapshot, which code run later
///   (an item's `__index__` growing, shrinking or rewriting the list) cannot change.
/// * Any other iterable is iterated and its items appended one by one. Its length is
///   what iteration yields: neither `__len__` nor `__length_hint__` is asked (Python's
///   `list()` would reserve memory from them), so a size a caller claims reserves
///   nothing and raises nothing.
pub fn to_list<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
    let py = obj.py();
    if obj.is_exact_instance_of::<PyList>() || obj.is_exact_instance_of::<PyTuple>() {
        // SAFETY: GIL held; an exact list or tuple is copied at its real size (no hint is
        // asked); returns a new reference or null with an error set.
        return unsafe {
            Bound::from_owned_ptr_or_err(py, ffi::PySequence_List(obj.as_ptr()))
                .map(|list| list.cast_into_unchecked())
        };
    }
    let list = PyList::empty(py);
    for item in obj.try_iter()? {
        list.append(item?)?;
    }
    Ok(list)
}

/// A request id: an exact `str`'s contents (a subclass is read as them), or the
/// reference's `TypeError("{name} must be a str, got {type}")`; `UnicodeEncodeError` for a
/// lone surrogate.
#[inline]
pub fn request_id(obj: Bound<'_, PyAny>, name: &str) -> PyResult<PyBackedStr> {
    match obj.cast_into::<PyString>() {
        Ok(id) => PyBackedStr::try_from(id),
        Err(err) => Err(PyTypeError::new_err(format!(
            "{name} must be a str, got {}",
            type_name(err.into_inner().as_any())
        ))),
    }
}

/// `type(obj).__name__`, for error messages.
pub fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string())
}

/// A flag read by truthiness, as the reference's `bool(x)` (`PyO3`'s `bool` accepts only
/// `True` and `False`).
#[derive(Clone, Copy)]
pub struct Flag(pub bool);

impl Flag {
    /// `True`, for signature defaults.
    pub const TRUE: Self = Self(true);
    /// `False`, for signature defaults.
    pub const FALSE: Self = Self(false);
}

impl<'a, 'py> FromPyObject<'a, 'py> for Flag {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        obj.is_truthy().map(Self)
    }
}
