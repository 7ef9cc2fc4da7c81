//! The hash algorithms vLLM offers and the seed string a chain starts from: which
//! serialiser and digest each algorithm names, and how the seed is picked.

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_128;

use super::hex;
use super::repr::py_repr;
use crate::block_hash::{BlockHash, MAX_HASH_LEN};
use crate::error::{Error, Result};

/// The seed vLLM uses for the SHA-256 algorithms when `PYTHONHASHSEED` is unset.
pub const DEFAULT_SEED: &str = "vllm-none-hash";

// Both digests fit in a BlockHash, so building one from a digest cannot fail.
const _: () = assert!(32 <= MAX_HASH_LEN);

/// vLLM's `--prefix-caching-hash-algo` choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HashAlgo {
    /// pickle protocol 5 + SHA-256 (vLLM's default).
    Sha256,
    /// canonical CBOR + SHA-256.
    Sha256Cbor,
    /// pickle protocol 5 + xxh3-128.
    Xxhash,
    /// canonical CBOR + xxh3-128.
    XxhashCbor,
}

impl HashAlgo {
    /// Every algorithm, in the order error messages list them.
    pub const ALL: [Self; 4] = [
        Self::Sha256,
        Self::Sha256Cbor,
        Self::Xxhash,
        Self::XxhashCbor,
    ];

    /// The algorithm vLLM calls `name`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the accepted names for anything else.
    pub fn from_name(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| Self::unknown(&py_repr(name)))
    }

    /// The error for an algorithm name that is not one, shown as `repr` (Python's
    /// `repr()` of what was given).
    pub fn unknown(repr: &str) -> Error {
        Error::InvalidArgument(format!(
            "unknown hash algorithm {repr}; expected one of 'sha256', 'sha256_cbor', \
             'xxhash', 'xxhash_cbor'"
        ))
    }

    /// vLLM's name for the algorithm.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sha256 => "sha256",
            Self::Sha256Cbor => "sha256_cbor",
            Self::Xxhash => "xxhash",
            Self::XxhashCbor => "xxhash_cbor",
        }
    }

    /// Whether values are serialised with pickle (else CBOR).
    pub fn uses_pickle(self) -> bool {
        matches!(self, Self::Sha256 | Self::Xxhash)
    }

    /// Whether the digest is xxh3-128 (else SHA-256). vLLM seeds these randomly.
    pub fn is_xxhash(self) -> bool {
        matches!(self, Self::Xxhash | Self::XxhashCbor)
    }

    /// Digest length in bytes: 32 for SHA-256, 16 for xxh3-128.
    pub fn digest_len(self) -> usize {
        if self.is_xxhash() {
            16
        } else {
            32
        }
    }

    pub(super) fn digest(self, data: &[u8]) -> BlockHash {
        if self.is_xxhash() {
            from_digest(&xxh3_128(data).to_be_bytes())
        } else {
            from_digest(&Sha256::digest(data))
        }
    }
}

pub(super) fn from_digest(digest: &[u8]) -> BlockHash {
    match BlockHash::new(digest) {
        Ok(h) => h,
        // Digests are 16 or 32 bytes, within MAX_HASH_LEN (asserted at compile time).
        Err(_) => unreachable!("digests fit in a BlockHash"),
    }
}

/// The chain seed string, as vLLM's `init_none_hash` picks it: the explicit seed, else
/// `PYTHONHASHSEED` (pass its value), else [`DEFAULT_SEED`] for the SHA-256 algorithms
/// and 32 random bytes as hex for the xxhash ones.
///
/// # Errors
/// [`Error::InvalidArgument`] if the operating system cannot supply random bytes.
pub fn resolve_seed(
    explicit: Option<&str>,
    pythonhashseed_env: Option<&str>,
    algo: HashAlgo,
) -> Result<String> {
    if let Some(seed) = explicit.or(pythonhashseed_env) {
        return Ok(seed.to_owned());
    }
    if !algo.is_xxhash() {
        return Ok(DEFAULT_SEED.to_owned());
    }
    let mut random = [0u8; 32];
    getrandom::fill(&mut random).map_err(|e| {
        Error::InvalidArgument(format!("cannot read random bytes for the hash seed: {e}"))
    })?;
    Ok(hex(&random))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algo_names_round_trip() {
        for algo in HashAlgo::ALL {
            assert_eq!(HashAlgo::from_name(algo.name()), Ok(algo));
        }
        let err = HashAlgo::from_name("md5").unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown hash algorithm 'md5'; expected one of 'sha256', 'sha256_cbor', 'xxhash', \
             'xxhash_cbor'"
        );
    }
}
