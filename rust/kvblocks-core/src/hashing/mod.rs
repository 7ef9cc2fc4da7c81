//! vLLM 0.33.0's prefix-caching block hashes, byte for byte.
//!
//! Block `i` of a request hashes the 3-tuple `(parent, tuple(tokens of block i),
//! extra_keys)`, where `parent` is block `i - 1`'s hash, or the chain seed `none_hash`
//! for block 0 (and for an empty parent). `none_hash` is the hash of the seed *string*.
//! The tuple is serialised with `pickle.dumps(x, protocol=5)` ([`pickle`]) or
//! `cbor2.dumps(x, canonical=True)` ([`cbor`]) and digested with SHA-256 (32 bytes) or
//! xxh3-128 (16 bytes, big-endian as `xxhash.xxh3_128_digest` returns them).
//!
//! The hot path (a long prompt without extra keys) serialises every block into one
//! reused buffer, writing the token ints straight from the slice: no allocation and no
//! [`Value`] tree per block.

pub mod cbor;
pub mod pickle;
pub mod value;

use std::fmt::Write as _;

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_128;

use crate::block_hash::{BlockHash, MAX_HASH_LEN};
use crate::error::{Error, Result};

pub use pickle::{Memo, ParentObject};
pub use value::{too_deep_error, BigInt, ObjectId, Tuple, Value, MAX_DEPTH};

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
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown hash algorithm {}; expected one of 'sha256', 'sha256_cbor', \
                 'xxhash', 'xxhash_cbor'",
                    py_repr(name)
                ))
            })
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

    fn digest(self, data: &[u8]) -> BlockHash {
        if self.is_xxhash() {
            from_digest(&xxh3_128(data).to_be_bytes())
        } else {
            from_digest(&Sha256::digest(data))
        }
    }
}

fn from_digest(digest: &[u8]) -> BlockHash {
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
    Ok(random.iter().fold(String::with_capacity(64), |mut hex, b| {
        // Writing to a String cannot fail.
        let _ = write!(hex, "{b:02x}");
        hex
    }))
}

/// Computes vLLM block hashes for one algorithm, block size and seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: usize,
    algo: HashAlgo,
    seed: String,
    none_hash: BlockHash,
}

impl BlockHasher {
    /// A hasher whose chain starts at `none_hash = hash(seed)` (the seed as a `str`).
    ///
    /// # Errors
    /// [`Error::NonPositive`] when `block_size <= 0`.
    pub fn new(block_size: i64, algo: HashAlgo, seed: &str) -> Result<Self> {
        let block_size =
            usize::try_from(block_size)
                .ok()
                .filter(|&n| n > 0)
                .ok_or(Error::NonPositive {
                    name: "block_size",
                    value: block_size,
                })?;
        let mut buf = Vec::new();
        if algo.uses_pickle() {
            pickle::dumps_str(&mut buf, seed);
        } else {
            cbor::dumps_str(&mut buf, seed);
        }
        let none_hash = algo.digest(&buf);
        Ok(Self {
            block_size,
            algo,
            seed: seed.to_owned(),
            none_hash,
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The hash algorithm.
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// The seed string `none_hash` was computed from.
    pub fn seed(&self) -> &str {
        &self.seed
    }

    /// The chain seed: the parent of every first block.
    pub fn none_hash(&self) -> BlockHash {
        self.none_hash
    }

    /// `hash((parent or none_hash, tuple(tokens), extra))`. Any number of tokens is
    /// hashed, as vLLM's `hash_block_tokens` does. `None` and an empty parent both mean
    /// `none_hash`. In `extra`, nodes tagged [`ObjectId::PARENT`] are the `parent`
    /// object and nodes tagged [`ObjectId::NONE_HASH`] the hasher's `none_hash` object.
    pub fn hash_block(
        &self,
        parent: Option<&[u8]>,
        tokens: &[i64],
        extra: Option<&Value>,
    ) -> BlockHash {
        let mut buf = Vec::new();
        let mut memo = Memo::default();
        let (parent, object) = self.first_parent(parent);
        self.hash_one(&mut buf, &mut memo, parent, object, tokens, extra)
    }

    /// The hashes of the full blocks of `tokens` (a partial tail is not hashed),
    /// chained from `parent` (`None` or empty: `none_hash`). `extra_keys`, if given,
    /// holds one entry per full block.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `extra_keys` has the wrong length.
    pub fn hash_blocks(
        &self,
        tokens: &[i64],
        parent: Option<&[u8]>,
        extra_keys: Option<&[Option<Value>]>,
    ) -> Result<Vec<BlockHash>> {
        let mut out = Vec::new();
        self.extend_hashes(&mut out, tokens, parent, extra_keys)?;
        Ok(out)
    }

    /// [`hash_blocks`](Self::hash_blocks), appending to `out`. To continue a request's
    /// chain, pass the tokens from its first unhashed block and its last hash as
    /// `parent`. On error `out` is unchanged.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `extra_keys` has the wrong length.
    pub fn extend_hashes(
        &self,
        out: &mut Vec<BlockHash>,
        tokens: &[i64],
        parent: Option<&[u8]>,
        extra_keys: Option<&[Option<Value>]>,
    ) -> Result<()> {
        let num_blocks = tokens.len() / self.block_size;
        if let Some(keys) = extra_keys {
            if keys.len() != num_blocks {
                return Err(Error::InvalidArgument(format!(
                    "extra_keys must have one entry per full block: got {} for {num_blocks} \
                     full blocks",
                    keys.len()
                )));
            }
        }
        out.reserve(num_blocks);
        let mut buf = Vec::new();
        let mut memo = Memo::default();
        let (first, first_object) = self.first_parent(parent);
        let mut prev: Option<BlockHash> = None;
        for (i, block) in tokens.chunks_exact(self.block_size).enumerate() {
            let extra = extra_keys
                .and_then(|keys| keys.get(i))
                .and_then(Option::as_ref);
            let hash = match &prev {
                None => self.hash_one(&mut buf, &mut memo, first, first_object, block, extra),
                Some(p) => self.hash_one(
                    &mut buf,
                    &mut memo,
                    p.as_bytes(),
                    ParentObject::Fresh,
                    block,
                    extra,
                ),
            };
            out.push(hash);
            prev = Some(hash);
        }
        Ok(())
    }

    /// The parent bytes of a first block and which object they are.
    fn first_parent<'a>(&'a self, parent: Option<&'a [u8]>) -> (&'a [u8], ParentObject) {
        match parent {
            Some(p) if !p.is_empty() => (p, ParentObject::Caller),
            _ => (self.none_hash.as_bytes(), ParentObject::NoneHash),
        }
    }

    fn hash_one(
        &self,
        buf: &mut Vec<u8>,
        memo: &mut Memo,
        parent: &[u8],
        parent_object: ParentObject,
        tokens: &[i64],
        extra: Option<&Value>,
    ) -> BlockHash {
        if self.algo.uses_pickle() {
            pickle::dumps_block(buf, memo, parent, parent_object, tokens, extra);
        } else {
            cbor::dumps_block(buf, parent, tokens, extra);
        }
        self.algo.digest(buf)
    }
}

/// Where a multimodal item's placeholder tokens sit in the prompt (vLLM's
/// `PlaceholderRange`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmPosition {
    /// Index of the first placeholder token.
    pub offset: i64,
    /// Number of placeholder tokens.
    pub length: i64,
}

/// Where the multimodal walk of [`mm_features_in_block`] resumes: a feature index, or
/// `Last` for vLLM's `-1` ("only the last item can still overlap").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MmCursor {
    /// Resume at this feature.
    At(usize),
    /// The last feature (vLLM's `start_mm_idx == -1`, used once hashing starts past
    /// block 0).
    Last,
}

/// vLLM 0.33.0's `_gen_mm_extra_hash_keys` walk: which features (sorted by offset)
/// overlap the block `[start, end)`. Appends `(feature index, offset - start)` to
/// `out` for each, in order (each becomes the key `("mm", identifier, offset - start)`),
/// and returns the cursor for the next block.
pub fn mm_features_in_block(
    positions: &[MmPosition],
    start: i64,
    end: i64,
    cursor: MmCursor,
    out: &mut Vec<(usize, i64)>,
) -> MmCursor {
    let Some(last) = positions.last() else {
        return cursor;
    };
    if last.offset.saturating_add(last.length) <= start {
        // Past every item: vLLM returns the cursor unchanged.
        return cursor;
    }
    let mut idx = match cursor {
        MmCursor::At(i) => i,
        MmCursor::Last => positions.len() - 1,
    };
    while let Some(pos) = positions.get(idx) {
        if end <= pos.offset {
            // The block has not reached this item.
            break;
        }
        let item_end = pos.offset.saturating_add(pos.length);
        if start >= item_end {
            // The block is past this item.
            idx += 1;
            continue;
        }
        out.push((idx, pos.offset.saturating_sub(start)));
        if end >= item_end {
            // The item ends in this block; the next one may start in it too.
            idx += 1;
        } else {
            break;
        }
    }
    MmCursor::At(idx)
}

/// Python's `repr()` of a `str`, for error messages that quote user input.
///
/// Exact for every assigned code point of Unicode 14 (Python 3.11); unassigned code
/// points, which Python escapes, are written as they are.
pub fn py_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for ch in s.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if is_py_printable(c) => out.push(c),
            c => {
                let code = u32::from(c);
                // Writing to a String cannot fail.
                let _ = if code <= 0xff {
                    write!(out, "\\x{code:02x}")
                } else if code <= 0xffff {
                    write!(out, "\\u{code:04x}")
                } else {
                    write!(out, "\\U{code:08x}")
                };
            }
        }
    }
    out.push(quote);
    out
}

/// `str.isprintable()` for one character: not a control, format, separator (other
/// than the space), private-use or noncharacter code point.
fn is_py_printable(c: char) -> bool {
    const NOT_PRINTABLE: &[(u32, u32)] = &[
        (0x00, 0x1f),
        (0x7f, 0xa0),
        (0xad, 0xad),
        (0x600, 0x605),
        (0x61c, 0x61c),
        (0x6dd, 0x6dd),
        (0x70f, 0x70f),
        (0x890, 0x891),
        (0x8e2, 0x8e2),
        (0x1680, 0x1680),
        (0x180e, 0x180e),
        (0x2000, 0x200f),
        (0x2028, 0x202f),
        (0x205f, 0x2064),
        (0x2066, 0x206f),
        (0x3000, 0x3000),
        (0xe000, 0xf8ff),
        (0xfeff, 0xfeff),
        (0xfff9, 0xfffb),
        (0x110bd, 0x110bd),
        (0x110cd, 0x110cd),
        (0x13430, 0x13438),
        (0x1bca0, 0x1bca3),
        (0x1d173, 0x1d17a),
        (0xe0001, 0xe0001),
        (0xe0020, 0xe007f),
        (0xf0000, 0xffffd),
        (0x10_0000, 0x10_fffd),
    ];
    let code = u32::from(c);
    // Noncharacters (U+FDD0..U+FDEF and the last two code points of every plane) are
    // unassigned in every Unicode version.
    let noncharacter = (0xfdd0..=0xfdef).contains(&code) || code & 0xfffe == 0xfffe;
    !noncharacter
        && !NOT_PRINTABLE
            .iter()
            .any(|&(lo, hi)| (lo..=hi).contains(&code))
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

    #[test]
    fn repr_matches_python() {
        // Expected values from Python's repr().
        assert_eq!(py_repr("it's"), "\"it's\"");
        assert_eq!(py_repr("'\""), "'\\'\"'");
        assert_eq!(
            py_repr("a\\b\tc\n\r\x00\x7f"),
            "'a\\\\b\\tc\\n\\r\\x00\\x7f'"
        );
        assert_eq!(
            py_repr("ü\u{a0}\u{ad}\u{2028}é\u{e000}\u{1f600}"),
            "'ü\\xa0\\xad\\u2028é\\ue000😀'"
        );
        assert_eq!(py_repr("\u{10ffff}"), "'\\U0010ffff'");
    }

    #[test]
    fn mm_walk_matches_behaviour_notes() {
        // Image at offset 2, length 5, block size 4 (behaviour notes §3.4).
        let positions = [MmPosition {
            offset: 2,
            length: 5,
        }];
        let mut out = Vec::new();
        let next = mm_features_in_block(&positions, 0, 4, MmCursor::At(0), &mut out);
        assert_eq!((out.as_slice(), next), (&[(0, 2)][..], MmCursor::At(0)));
        out.clear();
        let next = mm_features_in_block(&positions, 4, 8, next, &mut out);
        assert_eq!((out.as_slice(), next), (&[(0, -2)][..], MmCursor::At(1)));
        out.clear();
        let next = mm_features_in_block(&positions, 8, 12, next, &mut out);
        assert_eq!((out.as_slice(), next), (&[][..], MmCursor::At(1)));
    }
}
