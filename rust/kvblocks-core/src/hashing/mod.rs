//! vLLM 0.33.0's prefix-caching block hashes, byte for byte.
//!
//! Block `i` of a request hashes the 3-tuple `(parent, tuple(tokens of block i),
//! extra_keys)`, where `parent` is block `i - 1`'s hash, or the chain seed `none_hash`
//! for block 0 (and for an empty parent). `none_hash` is the hash of the seed *string*.
//! The tuple is serialised with `pickle.dumps(x, protocol=5)` ([`pickle`]) or
//! `cbor2.dumps(x, canonical=True)` ([`cbor`]) and digested with SHA-256 (32 bytes) or
//! xxh3-128 (16 bytes, big-endian as `xxhash.xxh3_128_digest` returns them).
//!
//! The hot path (a long prompt without extra keys) serialises every block with
//! fixed-layout writers, the token ints straight from the slice: no allocation and no
//! [`Value`] tree per block. SHA-256 chains alternate between two buffers allocated per
//! call (the next block is written while the current one is hashed); xxh3 and blocks
//! the chain does not take reuse one buffer.
//!
//! Here: [`BlockHasher`]. Beside it: the algorithms and seed (`algo`), in-place
//! SHA-256 (`sha256`), the token word writer (`words`), the multimodal extra-key walk
//! (`mm_keys`) and Python's `repr()` for error messages (`repr`).

mod algo;
pub mod cbor;
mod mm_keys;
pub mod pickle;
mod repr;
mod sha256;
pub mod value;
mod words;

use std::fmt::Write as _;
use std::slice::ChunksExact;

use xxhash_rust::xxh3::xxh3_128;

use crate::block_hash::BlockHash;
use crate::error::{positive, Error, Result};

use algo::from_digest;
use sha256::{compress_blocks, sha256_in_place, sha256_pad, state_bytes, SHA256_IV, SHA256_PAD};

pub use algo::{resolve_seed, HashAlgo, DEFAULT_SEED};
pub use mm_keys::{mm_features_in_block, MmCursor, MmPosition};
pub use pickle::{Memo, ParentObject};
pub use repr::py_repr;
pub use value::{too_deep_error, BigInt, ObjectId, Tuple, Value, MAX_DEPTH};

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
        let block_size = positive("block_size", block_size)?;
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
        let mut done = 0;
        if extra_keys.is_none() && !self.algo.is_xxhash() {
            done = self.sha256_chain(out, tokens.chunks_exact(self.block_size), first);
            prev = out.last().copied().filter(|_| done > 0);
        }
        for (i, block) in tokens.chunks_exact(self.block_size).enumerate().skip(done) {
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

    /// Hashes the leading blocks that the plain writers take (all of them, normally)
    /// with SHA-256, without extra keys, chained from `parent`; returns how many.
    ///
    /// Compressing a message is one long chain of dependent SHA instructions that
    /// leaves most of the CPU idle. The next block is serialised (with a placeholder
    /// parent, overwritten once the hash is known) between the first compression of
    /// the current message and the rest, close enough in program order for the CPU to
    /// run it alongside instead of after them.
    fn sha256_chain(
        &self,
        out: &mut Vec<BlockHash>,
        blocks: ChunksExact<'_, i64>,
        parent: &[u8],
    ) -> usize {
        const PLACEHOLDER: [u8; 32] = [0; 32];
        let mut blocks = blocks;
        // Sized from a block that exists: `block_size` alone may be anything up to
        // `i64::MAX`, and there may be no full block at all. A block is a slice in
        // memory, so five bytes a token cannot overflow.
        let Some(first_block) = blocks.next() else {
            return 0;
        };
        if self.algo.uses_pickle() && first_block.len() > pickle::PLAIN_MAX_TOKENS {
            return 0;
        }
        let capacity = parent.len().max(32) + 5 * first_block.len() + PLAIN_OVERHEAD + SHA256_PAD;
        let (mut cur, mut next) = (vec![0u8; capacity], vec![0u8; capacity]);
        let parent_at = if self.algo.uses_pickle() {
            pickle::plain_parent_offset()
        } else {
            cbor::plain_parent_offset(PLACEHOLDER.len())
        };
        let Some(mut cur_len) = self.write_plain(&mut cur, parent, first_block) else {
            return 0;
        };
        let mut done = 0;
        loop {
            let Some(end) = sha256_pad(&mut cur, cur_len) else {
                return done;
            };
            // A message is at least one 64-byte block once padded.
            let Some((first, rest)) = cur.get(..end).and_then(|m| m.split_at_checked(64)) else {
                return done;
            };
            let mut state = SHA256_IV;
            compress_blocks(&mut state, first);
            let next_len = blocks
                .next()
                .and_then(|b| self.write_plain(&mut next, &PLACEHOLDER, b));
            compress_blocks(&mut state, rest);
            let digest = state_bytes(state);
            out.push(from_digest(&digest));
            done += 1;
            let (Some(len), Some(slot)) = (next_len, next.get_mut(parent_at..parent_at + 32))
            else {
                return done;
            };
            slot.copy_from_slice(&digest);
            std::mem::swap(&mut cur, &mut next);
            cur_len = len;
        }
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
        if extra.is_none() {
            if let Some(hash) = self.hash_plain(buf, parent, tokens) {
                return hash;
            }
        }
        if self.algo.uses_pickle() {
            pickle::dumps_block(buf, memo, parent, parent_object, tokens, extra);
        } else {
            cbor::dumps_block(buf, parent, tokens, extra);
        }
        self.algo.digest(buf)
    }

    /// The hot path: `hash((parent, tuple(tokens), None))` serialised by the
    /// fixed-layout writers into `buf` and, for SHA-256, padded and compressed in place,
    /// so no hasher state is set up, buffered or copied per block. `None` when the
    /// writers do not apply (see `write_plain_block`); `buf`'s contents are scratch.
    fn hash_plain(&self, buf: &mut Vec<u8>, parent: &[u8], tokens: &[i64]) -> Option<BlockHash> {
        // SHA256_PAD is the room padding may take past the message.
        let need = parent.len() + 5 * tokens.len() + PLAIN_OVERHEAD + SHA256_PAD;
        if buf.len() < need {
            buf.resize(need, 0);
        }
        let len = self.write_plain(buf, parent, tokens)?;
        Some(if self.algo.is_xxhash() {
            // xxh3 called here rather than through `HashAlgo::digest`, whose SHA-256 arm
            // kept the call out of line: 5 % slower over a 131,072-token prompt.
            from_digest(&xxh3_128(buf.get(..len)?).to_be_bytes())
        } else {
            from_digest(&sha256_in_place(buf, len)?)
        })
    }

    /// The algorithm's fixed-layout writer (`write_plain_block` of [`pickle`] or
    /// [`cbor`]): the block's length in `buf`, or `None` when the writer does not apply.
    fn write_plain(&self, buf: &mut [u8], parent: &[u8], tokens: &[i64]) -> Option<usize> {
        if self.algo.uses_pickle() {
            pickle::write_plain_block(buf, parent, tokens)
        } else {
            cbor::write_plain_block(buf, parent, tokens)
        }
    }
}

/// Lower-case hex of `bytes` (the random seed; test output).
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .fold(String::with_capacity(2 * bytes.len()), |mut out, b| {
            // Writing to a String cannot fail.
            let _ = write!(out, "{b:02x}");
            out
        })
}

/// Room the fixed-layout writers (`write_plain_block` of [`pickle`] and [`cbor`]) need
/// beyond the parent and five bytes a token: the fixed opcodes or heads around them,
/// `None`, and the slack of the last token's 8-byte store.
const PLAIN_OVERHEAD: usize = 32;

#[cfg(test)]
mod tests {
    use sha2::{Digest, Sha256};

    use super::*;

    /// The plain fast path against the general writers and the `Digest` API, at the
    /// edges of every encoding class, frame rule and padding length.
    #[test]
    fn plain_path_matches_general_path() {
        const EDGES: [i64; 20] = [
            0,
            1,
            23,
            24,
            255,
            256,
            65_535,
            65_536,
            149_999,
            i32::MAX as i64,
            i32::MAX as i64 + 1,
            u32::MAX as i64,
            u32::MAX as i64 + 1,
            -1,
            -24,
            -256,
            i32::MIN as i64,
            i32::MIN as i64 - 1,
            i64::MAX,
            i64::MIN,
        ];
        let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut plain_buf = Vec::new();
        let mut buf = Vec::new();
        let mut memo = Memo::default();
        for round in 0..2000 {
            let n = match round % 16 {
                0..=3 => usize::try_from(next() % 6).unwrap(),
                4..=9 => 16,
                10..=14 => usize::try_from(next() % 40).unwrap(),
                // Around PLAIN_MAX_TOKENS, and a pickle with a second frame.
                _ => [8191, 8192, 8193, 13_200][usize::try_from(next() % 4).unwrap()],
            };
            // Mostly in-range tokens, so that the plain path is taken, with an edge
            // value now and then.
            let wild = next() % 3 == 0;
            let tokens: Vec<i64> = (0..n)
                .map(|_| match next() % 8 {
                    0 if wild => EDGES[usize::try_from(next() % 20).unwrap()],
                    0..=2 => EDGES[usize::try_from(next() % 13).unwrap()],
                    _ => i64::try_from(next() % 150_000).unwrap(),
                })
                .collect();
            let parent_len = [0, 16, 32, 23, 24, 255, 256][round % 7];
            let parent: Vec<u8> = (0..parent_len).map(|_| next().to_le_bytes()[0]).collect();
            for algo in HashAlgo::ALL {
                let hasher = BlockHasher::new(16, algo, "plain").unwrap();
                if algo.uses_pickle() {
                    pickle::dumps_block(
                        &mut buf,
                        &mut memo,
                        &parent,
                        ParentObject::Fresh,
                        &tokens,
                        None,
                    );
                } else {
                    cbor::dumps_block(&mut buf, &parent, &tokens, None);
                }
                let want = if algo.is_xxhash() {
                    from_digest(&xxh3_128(&buf).to_be_bytes())
                } else {
                    from_digest(&Sha256::digest(&buf))
                };
                if let Some(got) = hasher.hash_plain(&mut plain_buf, &parent, &tokens) {
                    assert_eq!(got, want, "{algo:?} {tokens:?} parent {parent_len}");
                }
                assert_eq!(
                    hasher.hash_block(Some(&parent), &tokens, None),
                    if parent.is_empty() {
                        hasher.hash_block(None, &tokens, None)
                    } else {
                        want
                    }
                );
            }
        }
    }

    #[test]
    fn huge_block_sizes_allocate_nothing_without_a_full_block() {
        for block_size in [1_i64 << 40, 1 << 61, 1 << 62, i64::MAX] {
            for algo in HashAlgo::ALL {
                let hasher = BlockHasher::new(block_size, algo, "x").unwrap();
                assert!(hasher
                    .hash_blocks(&[1, 2, 3], None, None)
                    .unwrap()
                    .is_empty());
            }
        }
    }
}
