//! Block hashes as fixed-size values, and the interner that stores each distinct
//! hash once however many blocks carry it.

use rustc_hash::FxHashMap;

use crate::error::{Error, Result};

/// The longest hash kvblocks stores: a SHA-256 digest. xxh3-128 digests are 16 bytes.
pub const MAX_HASH_LEN: usize = 32;

/// A block hash of 0 to 32 bytes, stored inline so that it never allocates.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash {
    bytes: [u8; MAX_HASH_LEN],
    len: u8,
}

impl BlockHash {
    /// Wraps `bytes`.
    ///
    /// # Errors
    /// [`Error::HashTooLong`] when `bytes` is longer than [`MAX_HASH_LEN`].
    pub fn new(bytes: &[u8]) -> Result<Self> {
        let len = bytes.len();
        if len > MAX_HASH_LEN {
            return Err(Error::HashTooLong { len });
        }
        let mut out = [0u8; MAX_HASH_LEN];
        out[..len].copy_from_slice(bytes);
        // len <= 32 was checked above, so it fits in a u8.
        #[allow(clippy::cast_possible_truncation)]
        Ok(Self { bytes: out, len: len as u8 })
    }

    /// The hash's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl std::fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}
