//! Helpers for the core's arrays indexed by `u32` ids (block ids, table slots), shared by
//! the free queue, the pool, the prefix map, the hash interner and the manager.

use crate::error::{Error, Result};

/// A `Vec` of `len` copies of `value`, or an error instead of an allocation abort.
pub(crate) fn try_filled_vec<T: Clone>(value: T, len: usize) -> Result<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(len)
        .map_err(|_| Error::InvalidArgument(format!("not enough memory for {len} block slots")))?;
    out.resize(len, value);
    Ok(out)
}

/// Widens a block id (or any other `u32` slot number) to an index. Lossless on every
/// platform Rust supports with 32-bit or wider pointers.
#[inline]
pub(crate) const fn ix(id: u32) -> usize {
    id as usize
}
