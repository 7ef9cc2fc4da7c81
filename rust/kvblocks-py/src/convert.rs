//! Argument conversion: Python ints, lists of ints and NumPy-style int arrays into
//! Rust slices, without a Python object per element where it can be avoided.
//!
//! * a `list` or `tuple` of ints is read item by item (one C call per item, no copy of
//!   the objects while every item is an exact `int`; a list is snapshotted before the
//!   first other item is converted, see [`to_list`]);
//! * anything exporting a one-dimensional C-contiguous integer buffer (`NumPy` arrays,
//!   `array.array`, `memoryview`) is read in place when its items are native `i64`, and
//!   widened into a `Vec<i64>` otherwise;
//! * any other iterable is materialised by [`to_list`], and each item converted as
//!   `operator.index` would.
//!
//! Token ids and block hashes are read here too, so the classes' modules share one
//! reader each. The one import cycle left in the binding is inherent: a manager's
//! `block_pool` view (`pool.rs`) and the manager (`manager.rs`) refer to each other.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ops::Deref;
use std::ptr;

use kvblocks_core::BlockHash;
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyBool, PyBytes, PyList, PySequence, PyString, PyTuple};
use pyo3::Borrowed;

use crate::errors::IntoPyResult;

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

/// `operator.index(obj)` as an unsigned `T`: `TypeError` for a non-integer,
/// `OverflowError` for a negative or too large one.
pub fn index_uint<T: for<'a, 'py> FromPyObject<'a, 'py, Error = PyErr>>(
    obj: &Bound<'_, PyAny>,
) -> PyResult<T> {
    // SAFETY: GIL held; returns a new reference or null with an error set.
    let index =
        unsafe { Bound::from_owned_ptr_or_err(obj.py(), ffi::PyNumber_Index(obj.as_ptr())) }?;
    index.extract()
}

/// A request id: an exact `str`'s contents (a subclass is read as them), or the
/// reference's `TypeError("{name} must be a str, got {type}")`; `UnicodeEncodeError` for a
/// lone surrogate.
pub fn request_id(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<PyBackedStr> {
    let id = obj.cast::<PyString>().map_err(|_| {
        PyTypeError::new_err(format!("{name} must be a str, got {}", type_name(obj)))
    })?;
    PyBackedStr::try_from(id.clone())
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

/// A `bool` field of a value class, as the reference's `to_flag` reads it: a `bool`, or
/// `NumPy`'s; anything else is a `TypeError` naming its type.
#[derive(Clone, Copy)]
pub struct BoolField(pub bool);

impl BoolField {
    /// `False`, for signature defaults.
    pub const FALSE: Self = Self(false);
}

impl<'a, 'py> FromPyObject<'a, 'py> for BoolField {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(flag) = obj.cast::<PyBool>() {
            return Ok(Self(flag.is_true()));
        }
        let kind = obj.get_type();
        let name = kind.name()?;
        if kind.module()?.to_str()? == "numpy" && matches!(name.to_str()?, "bool" | "bool_") {
            return obj.is_truthy().map(Self);
        }
        Err(PyTypeError::new_err(format!(
            "'{name}' object is not an instance of 'bool'"
        )))
    }
}

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
pub fn int_column_with(
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

/// The integer item types a buffer may hold.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ItemKind {
    I8,
    U8,
    I16,
    U16,
    I32,
    U32,
    I64,
    U64,
}

impl ItemKind {
    /// Decodes a `struct`-module format string of one native-order integer item.
    fn parse(format: &CStr, itemsize: isize) -> Option<Self> {
        let bytes = format.to_bytes();
        let code = match bytes {
            // No prefix, '@' and '=' are native order; '<' is native on the little-endian
            // targets this is built for; any other prefix is refused (read by iteration).
            [c] | [b'@' | b'=', c] => *c,
            [b'<', c] if cfg!(target_endian = "little") => *c,
            _ => return None,
        };
        let kind = match (code, itemsize) {
            (b'b', 1) => Self::I8,
            (b'B', 1) => Self::U8,
            (b'h', 2) => Self::I16,
            (b'H', 2) => Self::U16,
            (b'i' | b'l', 4) => Self::I32,
            (b'I' | b'L', 4) => Self::U32,
            (b'l' | b'q' | b'n', 8) => Self::I64,
            (b'L' | b'Q' | b'N', 8) => Self::U64,
            _ => return None,
        };
        Some(kind)
    }
}

/// `CPython`'s `Py_buffer`. Declared here because `PyO3` exposes the buffer protocol
/// only for the 3.11+ stable ABI, while kvblocks ships one abi3 wheel for 3.10+. The layout
/// and both functions are unchanged since Python 3.0 and exported by every `CPython`.
#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

const PYBUF_FORMAT: c_int = 0x0004;
const PYBUF_ND: c_int = 0x0008;
const PYBUF_STRIDES: c_int = 0x0010 | PYBUF_ND;
const PYBUF_C_CONTIGUOUS: c_int = 0x0020 | PYBUF_STRIDES;

/// A held, one-dimensional, C-contiguous integer buffer.
pub struct BufferView {
    raw: Box<RawBuffer>,
    kind: ItemKind,
    len: usize,
}

impl BufferView {
    /// Requests a buffer from `obj`; `None` (with no Python error set) when `obj` has
    /// none or it is not a 1-D contiguous array of integers.
    fn get(obj: &Bound<'_, PyAny>) -> Option<Self> {
        let mut raw = Box::new(RawBuffer {
            buf: ptr::null_mut(),
            obj: ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: ptr::null_mut(),
            shape: ptr::null_mut(),
            strides: ptr::null_mut(),
            suboffsets: ptr::null_mut(),
            internal: ptr::null_mut(),
        });
        // SAFETY: `obj` is a live object and we hold the GIL (we have a `Bound`); `raw`
        // is a writable Py_buffer-shaped struct that outlives the call.
        let rc = unsafe {
            PyObject_GetBuffer(
                obj.as_ptr(),
                &raw mut *raw,
                PYBUF_C_CONTIGUOUS | PYBUF_FORMAT,
            )
        };
        if rc != 0 {
            // Not a buffer, or not a contiguous one: the caller falls back to iteration.
            // SAFETY: GIL held; clears the BufferError/TypeError the request raised.
            unsafe { ffi::PyErr_Clear() };
            return None;
        }
        let kind = if raw.ndim == 1 && !raw.format.is_null() {
            // SAFETY: with PYBUF_FORMAT a non-null format is a NUL-terminated C string
            // owned by the exporter for the lifetime of the view.
            ItemKind::parse(unsafe { CStr::from_ptr(raw.format) }, raw.itemsize)
        } else {
            None
        };
        let len = usize::try_from(raw.len / raw.itemsize.max(1)).unwrap_or(0);
        let view = Self {
            raw,
            kind: kind.unwrap_or(ItemKind::I64),
            len,
        };
        // Dropping `view` releases the buffer when it is not an integer vector.
        kind.map(|_| view)
    }

    fn bytes(&self) -> &[u8] {
        if self.len == 0 || self.raw.buf.is_null() {
            return &[];
        }
        // SAFETY: the exporter guarantees `len` readable bytes at `buf` while the view
        // is held, and we hold it until drop.
        unsafe {
            std::slice::from_raw_parts(
                self.raw.buf.cast::<u8>(),
                usize::try_from(self.raw.len).unwrap_or(0),
            )
        }
    }

    fn as_i64(&self) -> &[i64] {
        debug_assert!(self.kind == ItemKind::I64);
        if self.len == 0 || self.raw.buf.is_null() {
            return &[];
        }
        // SAFETY: a C-contiguous buffer of `len` native i64 items, whose alignment
        // `int_column` checked before borrowing it.
        debug_assert!(self.is_aligned());
        unsafe { std::slice::from_raw_parts(self.raw.buf.cast::<i64>(), self.len) }
    }

    /// Whether the items are aligned for reading in place as `i64`.
    fn is_aligned(&self) -> bool {
        self.raw.buf.cast::<i64>().is_aligned()
    }

    /// The items widened to `i64`; `None` when an unsigned item exceeds `i64::MAX`.
    fn to_vec(&self) -> Option<Vec<i64>> {
        let b = self.bytes();
        let values = match self.kind {
            ItemKind::I8 => b
                .iter()
                .map(|&x| i64::from(i8::from_ne_bytes([x])))
                .collect(),
            ItemKind::U8 => b.iter().map(|&x| i64::from(x)).collect(),
            ItemKind::I16 => b
                .chunks_exact(2)
                .map(|c| i64::from(i16::from_ne_bytes([c[0], c[1]])))
                .collect(),
            ItemKind::U16 => b
                .chunks_exact(2)
                .map(|c| i64::from(u16::from_ne_bytes([c[0], c[1]])))
                .collect(),
            ItemKind::I32 => b
                .chunks_exact(4)
                .map(|c| i64::from(i32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
            ItemKind::U32 => b
                .chunks_exact(4)
                .map(|c| i64::from(u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
            ItemKind::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_ne_bytes(eight(c)))
                .collect(),
            ItemKind::U64 => {
                return b
                    .chunks_exact(8)
                    .map(|c| i64::try_from(u64::from_ne_bytes(eight(c))).ok())
                    .collect();
            }
        };
        Some(values)
    }
}

/// The first eight bytes of a `chunks_exact(8)` chunk.
fn eight(c: &[u8]) -> [u8; 8] {
    let mut out = [0u8; 8];
    out.copy_from_slice(&c[..8]);
    out
}

impl Drop for BufferView {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released
        // exactly once. Views are only created and dropped while the GIL is held.
        unsafe { PyBuffer_Release(&raw mut *self.raw) };
    }
}

// ----------------------------------------------------------------------------- token ids

/// One token id, as the reference's `check_token_ids` takes it: `operator.index`, then
/// the signed 64-bit range.
pub fn token_id(item: &Bound<'_, PyAny>) -> PyResult<i64> {
    item.extract::<i64>().or_else(|err| {
        if !err.is_instance_of::<PyOverflowError>(item.py()) {
            return Err(err);
        }
        // An integer beyond 64 bits: the message names its value.
        let index = item.py().import("operator")?.getattr("index")?;
        let value = index.call1((item,))?;
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

// ----------------------------------------------------------------------------- block hashes

/// A Python block hash as `bytes` (the type check alone).
pub fn hash_bytes<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    obj.cast::<PyBytes>().cloned().map_err(|_| {
        PyTypeError::new_err(format!("block hash must be bytes, got {}", type_name(obj)))
    })
}

/// One Python block hash: its type error at once (`Err`), its length error (the inner
/// result) for the caller to order.
fn read_hash(obj: &Bound<'_, PyAny>) -> PyResult<kvblocks_core::Result<BlockHash>> {
    Ok(BlockHash::new(hash_bytes(obj)?.as_bytes()))
}

/// Converts one Python block hash (`bytes`) into a core `BlockHash`.
pub fn block_hash(obj: &Bound<'_, PyAny>) -> PyResult<BlockHash> {
    read_hash(obj)?.py()
}

/// Block hashes converted as a batch, as the reference's ``to_block_hashes``: every
/// item's type is checked before any hash's length, so a `TypeError` anywhere wins
/// over a too-long hash before it. One pass: the first length error waits.
fn collect_hashes(
    items: impl Iterator<Item = PyResult<kvblocks_core::Result<BlockHash>>>,
) -> PyResult<Vec<BlockHash>> {
    let mut hashes = Vec::new();
    let mut too_long = None;
    for item in items {
        match item? {
            Ok(hash) => hashes.push(hash),
            Err(err) => {
                too_long.get_or_insert(err);
            }
        }
    }
    too_long.map_or(Ok(hashes), |err| Err(err).py())
}

/// [`collect_hashes`] over Python objects.
pub fn block_hashes<'py>(
    items: impl IntoIterator<Item = Bound<'py, PyAny>>,
) -> PyResult<Vec<BlockHash>> {
    collect_hashes(items.into_iter().map(|item| read_hash(&item)))
}

/// `block_hashes` to read by index: an exact list or tuple in place (reading its hashes
/// runs no Python code, so it cannot change meanwhile), any other iterable materialised
/// by [`to_list`]. Items are not converted yet.
fn hash_sequence<'py>(block_hashes: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PySequence>> {
    if block_hashes.is_exact_instance_of::<PyList>()
        || block_hashes.is_exact_instance_of::<PyTuple>()
    {
        return Ok(block_hashes.cast::<PySequence>()?.clone());
    }
    Ok(to_list(block_hashes)?
        .into_any()
        .cast_into::<PySequence>()?)
}

/// How a [`HashSeq`] reads its items.
#[derive(Clone, Copy)]
enum SeqKind {
    List,
    Tuple,
    Other,
}

/// A sequence of block hashes, converted one index at a time.
///
/// Exact `bytes` items of an exact list or tuple are read through borrowed references,
/// with one C call for their bytes: reading runs no Python code, so the container
/// cannot change meanwhile. Other items and sequences take the general path.
pub struct HashSeq<'py> {
    seq: Bound<'py, PySequence>,
    kind: SeqKind,
}

impl<'py> HashSeq<'py> {
    /// Reads `seq` by index.
    pub fn new(seq: Bound<'py, PySequence>) -> Self {
        let kind = if seq.is_exact_instance_of::<PyList>() {
            SeqKind::List
        } else if seq.is_exact_instance_of::<PyTuple>() {
            SeqKind::Tuple
        } else {
            SeqKind::Other
        };
        Self { seq, kind }
    }

    /// `obj` read by index when it is an exact list or tuple; `None` otherwise.
    pub(crate) fn list_or_tuple(obj: &Bound<'py, PyAny>) -> Option<Self> {
        let seq = Self::new(obj.cast::<PySequence>().ok()?.clone());
        (!matches!(seq.kind, SeqKind::Other)).then_some(seq)
    }

    /// `obj` when it is an exact list or tuple, else its items materialised by
    /// [`to_list`], as the reference's `materialise` reads them.
    pub(crate) fn collect(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        Ok(Self::new(hash_sequence(obj)?))
    }

    /// The number of items.
    pub fn len(&self) -> PyResult<usize> {
        self.seq.len()
    }

    /// Items `range` as block hashes, converted as a batch ([`block_hashes`]): every
    /// type is checked before any length.
    pub fn range(&self, range: std::ops::Range<usize>) -> PyResult<Vec<BlockHash>> {
        let mut hashes = Vec::new();
        self.extend_range(range, &mut hashes)?;
        Ok(hashes)
    }

    /// [`Self::range`] appended to `out`; on an error `out` is as it was.
    pub fn extend_range(
        &self,
        range: std::ops::Range<usize>,
        out: &mut Vec<BlockHash>,
    ) -> PyResult<()> {
        let start = out.len();
        out.reserve(range.len());
        for i in range.clone() {
            let Some(hash) = self.exact(i) else {
                // Anything unusual: the general path, from the start, decides which
                // error wins.
                out.truncate(start);
                let hashes = collect_hashes(range.map(|i| self.read(i)))?;
                out.extend(hashes);
                return Ok(());
            };
            out.push(hash);
        }
        Ok(())
    }

    /// Item `i` when it is an exact `bytes` of at most 32 bytes in an exact list or
    /// tuple (the common case, read with no intermediate results); `None` otherwise.
    // Always inlined, so that the hash is written straight into its destination: a
    // returned copy is read back while its stores are still pending, with wider loads
    // than they were written with, and the CPU stalls on every hash (this was 80 % of
    // `range`'s time in a profile of the pool churn).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn exact(&self, i: usize) -> Option<BlockHash> {
        if matches!(self.kind, SeqKind::Other) {
            return None;
        }
        // An index error is left to the general path, which raises it again.
        let item = self.borrowed(i).ok()?;
        if !item.is_exact_instance_of::<PyBytes>() {
            return None;
        }
        BlockHash::new(exact_bytes(&item)).ok()
    }

    /// Item `i` of an exact list or tuple, borrowed (reading it runs no Python code).
    fn borrowed(&self, i: usize) -> PyResult<Borrowed<'_, 'py, PyAny>> {
        let index = isize::try_from(i).unwrap_or(isize::MAX);
        let container = self.seq.as_ptr();
        let item = match self.kind {
            // SAFETY: GIL held; each returns a borrowed item, or null with IndexError set.
            SeqKind::List => unsafe { ffi::PyList_GetItem(container, index) },
            _ => unsafe { ffi::PyTuple_GetItem(container, index) },
        };
        // SAFETY: `item` is null (error set) or a borrowed reference to a live object
        // that the container keeps alive.
        unsafe { Borrowed::from_ptr_or_err(self.seq.py(), item) }
    }

    /// Item `i` itself, unconverted.
    pub fn item(&self, i: usize) -> PyResult<Bound<'py, PyAny>> {
        self.seq.get_item(i)
    }

    /// Item `i` as a block hash.
    pub fn get(&self, i: usize) -> PyResult<BlockHash> {
        match self.exact(i) {
            Some(hash) => Ok(hash),
            None => self.read(i)?.py(),
        }
    }

    /// Item `i`: its type error at once, its length error inside ([`read_hash`]).
    fn read(&self, i: usize) -> PyResult<kvblocks_core::Result<BlockHash>> {
        if matches!(self.kind, SeqKind::Other) {
            return read_hash(&self.seq.get_item(i)?);
        }
        let item = self.borrowed(i)?;
        if !item.is_exact_instance_of::<PyBytes>() {
            return read_hash(&item);
        }
        Ok(BlockHash::new(exact_bytes(&item)))
    }
}

/// The contents of an exact `bytes` object, with one C call.
fn exact_bytes<'a>(item: &'a Borrowed<'_, '_, PyAny>) -> &'a [u8] {
    let mut data: *mut std::ffi::c_char = std::ptr::null_mut();
    let mut len: ffi::Py_ssize_t = 0;
    // SAFETY: `item` is an exact bytes object, so this cannot fail; the buffer lives as
    // long as the object, which its container keeps alive while no Python code runs.
    unsafe {
        ffi::PyBytes_AsStringAndSize(item.as_ptr(), &raw mut data, &raw mut len);
        std::slice::from_raw_parts(data.cast::<u8>(), usize::try_from(len).unwrap_or(0))
    }
}
