//! The buffer protocol: one-dimensional C-contiguous integer buffers read in place,
//! through a `Py_buffer` view held for the call and released on drop.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr;

use pyo3::ffi;
use pyo3::prelude::*;

/// The integer item types a buffer may hold.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum ItemKind {
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
    pub(super) kind: ItemKind,
    len: usize,
}

impl BufferView {
    /// Requests a buffer from `obj`; `None` (with no Python error set) when `obj` has
    /// none or it is not a 1-D contiguous array of integers.
    pub(super) fn get(obj: &Bound<'_, PyAny>) -> Option<Self> {
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

    pub(super) fn as_i64(&self) -> &[i64] {
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
    pub(super) fn is_aligned(&self) -> bool {
        self.raw.buf.cast::<i64>().is_aligned()
    }

    /// The items widened to `i64`; `None` when an unsigned item exceeds `i64::MAX`.
    pub(super) fn to_vec(&self) -> Option<Vec<i64>> {
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
