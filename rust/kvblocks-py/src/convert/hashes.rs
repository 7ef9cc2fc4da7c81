//! Block hashes: `bytes` (or an int, with int hashes on), one at a time or as a
//! sequence read lazily.

use kvblocks_core::BlockHash;
use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PySequence, PyTuple};
use pyo3::Borrowed;

use super::{to_list, type_name};
use crate::errors::IntoPyResult;

/// A Python block hash as `bytes` (the type check alone).
fn hash_bytes<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
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
