//! Columns of `i64`s from lists, tuples and integer buffers, and token ids.

use std::ops::Deref;

use pyo3::exceptions::{PyOverflowError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use super::buffer::{BufferView, ItemKind};
use super::to_list;
use crate::imports::OPERATOR_INDEX;

/// A column of `i64`s borrowed from a Python buffer or converted into a `Vec`.
pub enum IntColumn {
    /// Converted items.
    Owned(Vec<i64>),
    /// Native `i64` items read in place from a buffer, released on drop.
    Borrowed(BufferView),
}

impl Deref for IntColumn {
    type Target = [i64];

    fn deref(&self) -> &[i64] {
        match self {
            Self::Owned(v) => v,
            Self::Borrowed(b) => b.as_i64(),
        }
    }
}

impl IntColumn {
    /// The values as an owned `Vec`, copying only a borrowed buffer.
    pub fn into_vec(self) -> Vec<i64> {
        match self {
            Self::Owned(v) => v,
            Self::Borrowed(b) => b.as_i64().to_vec(),
        }
    }
}

/// Converts `obj` (an iterable of ints or an integer buffer) into a column of `i64`.
///
/// # Errors
/// `TypeError` when an item is not an int, `OverflowError` when it does not fit in 64 bits.
pub fn int_column(obj: &Bound<'_, PyAny>) -> PyResult<IntColumn> {
    int_column_with(obj, |item| item.extract::<i64>())
}

/// [`int_column`] with `convert` turning each item that is not an exact `int` within
/// 64 bits into an `i64` (or the caller's error for it): the first bad item decides.
///
/// The items are those the iterable held when it was read, as the reference's
/// `materialise` gives them: a list is snapshotted ([`to_list`]) before any item that may
/// run Python code is converted.
fn int_column_with(
    obj: &Bound<'_, PyAny>,
    convert: impl Fn(&Bound<'_, PyAny>) -> PyResult<i64>,
) -> PyResult<IntColumn> {
    if obj.is_exact_instance_of::<PyList>() || obj.is_exact_instance_of::<PyTuple>() {
        return sequence_ints(obj, false, &convert).map(IntColumn::Owned);
    }
    if let Some(view) = BufferView::get(obj) {
        if view.kind == ItemKind::I64 && view.is_aligned() {
            return Ok(IntColumn::Borrowed(view));
        }
        if let Some(values) = view.to_vec() {
            return Ok(IntColumn::Owned(values));
        }
        // Unsigned values past i64::MAX: iterate, so the error names the real value.
    }
    // A list of our own: nothing else can change it.
    sequence_ints(to_list(obj)?.as_any(), true, &convert).map(IntColumn::Owned)
}

/// Item `i` of an exact list or tuple `seq`, borrowed; null with `IndexError` set when
/// `i` is out of range.
fn borrowed_item(seq: &Bound<'_, PyAny>, is_list: bool, i: usize) -> *mut ffi::PyObject {
    let i = isize::try_from(i).unwrap_or(isize::MAX);
    // SAFETY: GIL held and `seq` is an exact list (or tuple); each call returns a
    // borrowed item or null with IndexError set.
    unsafe {
        if is_list {
            ffi::PyList_GetItem(seq.as_ptr(), i)
        } else {
            ffi::PyTuple_GetItem(seq.as_ptr(), i)
        }
    }
}

/// Reads the items of an exact list or tuple. Exact `int` items are read through
/// borrowed references with no reference counting (reading one runs no Python code, so
/// the container cannot change meanwhile). Before the first other item goes through
/// `convert` (whose `__index__` may change a list), a list's items are snapshotted by
/// [`to_list`] and the rest are read from the snapshot: what is read is the list as it
/// was when the call read it. A tuple cannot change and is read in place, as is a list
/// that is `private` (made by [`to_list`] for this call).
fn sequence_ints(
    seq: &Bound<'_, PyAny>,
    private: bool,
    convert: impl Fn(&Bound<'_, PyAny>) -> PyResult<i64>,
) -> PyResult<Vec<i64>> {
    let py = seq.py();
    let len = seq.len()?;
    let mut out = Vec::with_capacity(len);
    let is_list = seq.is_exact_instance_of::<PyList>();
    let mut snapshot = None;
    for i in 0..len {
        let container = snapshot.as_ref().unwrap_or(seq);
        let item = borrowed_item(container, is_list, i);
        // SAFETY: `item` is null or a borrowed reference to a live object; GIL held.
        let exact = !item.is_null() && unsafe { ffi::PyLong_CheckExact(item) } != 0;
        // SAFETY: an exact int: reads its value without running Python code.
        let value = if exact {
            unsafe { ffi::PyLong_AsLongLong(item) }
        } else {
            -1
        };
        // SAFETY: GIL held.
        if exact && (value != -1 || unsafe { ffi::PyErr_Occurred() }.is_null()) {
            out.push(value);
            continue;
        }
        if exact {
            // SAFETY: GIL held; `convert` reports the overflow in its own terms.
            unsafe { ffi::PyErr_Clear() };
        }
        // SAFETY: `item` is null (error set) or borrowed; this takes a strong reference.
        let item = unsafe { Bound::from_borrowed_ptr_or_err(py, item) }?;
        if is_list && !private && snapshot.is_none() {
            // No Python code has run since `len` was read: the copy holds the same items.
            // Nothing else holds the copy, so no code run later can change it.
            snapshot = Some(to_list(seq)?.into_any());
        }
        out.push(convert(&item)?);
    }
    Ok(out)
}

/// One token id, as the reference's `check_token_ids` takes it: `operator.index`, then
/// the signed 64-bit range.
pub fn token_id(item: &Bound<'_, PyAny>) -> PyResult<i64> {
    item.extract::<i64>().or_else(|err| {
        if !err.is_instance_of::<PyOverflowError>(item.py()) {
            return Err(err);
        }
        // An integer beyond 64 bits: the message names its value.
        let value = OPERATOR_INDEX.get(item.py())?.call1((item,))?;
        Err(PyValueError::new_err(format!(
            "token id {value} does not fit in a signed 64-bit integer"
        )))
    })
}

/// Token ids from a list, tuple, integer buffer (`NumPy` array) or any iterable, with the
/// reference's errors: the first bad id decides, `operator.index`'s `TypeError` for a
/// non-integer and `token id {x} does not fit in a signed 64-bit integer` past 64 bits.
pub fn token_ids(obj: &Bound<'_, PyAny>) -> PyResult<IntColumn> {
    int_column_with(obj, token_id)
}
