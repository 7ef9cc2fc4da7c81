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

pub mod cbor;
pub mod pickle;
pub mod value;

use std::fmt::Write as _;
use std::slice::ChunksExact;

use sha2::digest::generic_array::GenericArray;
use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_128;

use crate::block_hash::{BlockHash, MAX_HASH_LEN};
use crate::error::{positive, Error, Result};

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
    Ok(hex(&random))
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

/// The most bytes SHA-256 padding writes past a message: `0x80`, up to 63 zeros and
/// the 8-byte length.
const SHA256_PAD: usize = 72;

/// SHA-256's initial state (FIPS 180-4, 5.3.3).
const SHA256_IV: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

/// SHA-256 of `buf[..len]`, padding the message in place (FIPS 180-4, 5.1.1) and
/// running the compression function straight over `buf`: the `Digest` API would copy
/// the message through its block buffer and pad in a second one. `None` if `buf` is
/// shorter than `len + SHA256_PAD`.
fn sha256_in_place(buf: &mut [u8], len: usize) -> Option<[u8; 32]> {
    let end = sha256_pad(buf, len)?;
    let mut state = SHA256_IV;
    compress_blocks(&mut state, buf.get(..end)?);
    Some(state_bytes(state))
}

/// Pads the message `buf[..len]` in place (FIPS 180-4, 5.1.1); returns where the
/// padded message ends. `None` if `buf` is shorter than the padded message (at most
/// `len + SHA256_PAD` bytes), having written part of the padding.
fn sha256_pad(buf: &mut [u8], len: usize) -> Option<usize> {
    let end = (len + 9).div_ceil(64) * 64;
    // Zeroing a fixed 64 bytes (more than the at most 63 needed; the length then
    // overwrites the excess) compiles to a few vector stores instead of a memset call.
    buf.get_mut(len..len + 65)?.copy_from_slice(&PAD_START);
    let bits = (len as u64) * 8;
    buf.get_mut(end - 8..end)?
        .copy_from_slice(&bits.to_be_bytes());
    Some(end)
}

/// Runs the compression function over `data`, whose length is a multiple of 64, in
/// one call: a call per 64-byte block costs ~4 ns of state shuffling each.
fn compress_blocks(state: &mut [u32; 8], data: &[u8]) {
    debug_assert!(data.len() % 64 == 0);
    let blocks = data.len() / 64;
    // SAFETY: GenericArray<u8, U64> is #[repr(transparent)] over 64 bytes with
    // alignment 1 (sha2 relies on the same layout, casting back to [u8; 64]), and
    // `blocks * 64 <= data.len()` bytes are read from `data`, borrowed for the call.
    let blocks = unsafe {
        std::slice::from_raw_parts(
            data.as_ptr()
                .cast::<GenericArray<u8, sha2::digest::consts::U64>>(),
            blocks,
        )
    };
    sha2::compress256(state, blocks);
}

/// The digest: the final state, big-endian.
fn state_bytes(state: [u32; 8]) -> [u8; 32] {
    let mut digest = [0u8; 32];
    for (out, word) in digest.chunks_exact_mut(4).zip(state) {
        out.copy_from_slice(&word.to_be_bytes());
    }
    digest
}

/// The `0x80` that ends every message, then zeros.
const PAD_START: [u8; 65] = {
    let mut pad = [0u8; 65];
    pad[0] = 0x80;
    pad
};

/// How many leading bytes of a token's 8-byte word are its encoding. At most 5 by
/// construction, which the unchecked stores of [`Cursor::put_words`] rely on.
#[derive(Debug, Clone, Copy)]
#[repr(u8)]
enum WordLen {
    One = 1,
    Two = 2,
    Three = 3,
    Five = 5,
}

/// Writes into a buffer sized in advance, so the hot path has no growth checks. The
/// writers check the buffer's size before writing; a write that would not fit is
/// dropped (the bounds check stays, but never fails).
/// The bytes [`Cursor::put_words`] needs for `n` tokens: token i's word starts at most
/// 5 * i bytes in (every [`WordLen`] is at most 5) and is 8 long, so all of them lie in
/// the first `5 * n + 3` bytes.
const fn words_room(n: usize) -> usize {
    5 * n + 3
}

/// Appends `tokens` to `out` as [`Cursor::put_words`] writes them, sizing `out` for it.
fn append_words(out: &mut Vec<u8>, tokens: &[i64], encode: impl Fn(i64) -> ([u8; 8], WordLen)) {
    let start = out.len();
    out.resize(start + words_room(tokens.len()), 0);
    let mut w = Cursor::new(out.get_mut(start..).unwrap_or_default());
    // Sized just above, so the words fit.
    let _ = w.put_words(tokens, encode);
    let end = start + w.pos();
    out.truncate(end);
}

struct Cursor<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a mut [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    fn pos(&self) -> usize {
        self.pos
    }

    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        self.put_at(self.pos, bytes);
        self.pos += bytes.len();
    }

    /// Writes one encoding per token, `encode` giving each as the first `len` bytes of
    /// an 8-byte word. Every word is stored whole, the next one overwriting its slack:
    /// one fixed-size store per token instead of a copy of variable length.
    /// `None`, writing nothing, if fewer than [`words_room`] bytes are left.
    #[inline]
    fn put_words(
        &mut self,
        tokens: &[i64],
        encode: impl Fn(i64) -> ([u8; 8], WordLen),
    ) -> Option<()> {
        let end = self.pos + words_room(tokens.len());
        let region = self.buf.get_mut(self.pos..end)?;
        // Bounds-checking each store (the offset is data-dependent, so the compiler
        // cannot hoist the check) took a 16-token block from ~9 to ~17 ns.
        let base = region.as_mut_ptr();
        let mut offset = 0;
        for &t in tokens {
            let (word, len) = encode(t);
            // SAFETY: before token i is written, `offset` is the sum of i WordLens,
            // each at most 5, so `offset + 8 <= 5 * i + 8 <= 5 * n + 3 = region.len()`:
            // the store is inside `region`, and `write_unaligned` needs no alignment.
            unsafe { base.add(offset).cast::<[u8; 8]>().write_unaligned(word) };
            offset += len as usize;
        }
        self.pos += offset;
        Some(())
    }

    /// Overwrites bytes already written (a length filled in afterwards).
    #[inline]
    fn put_at(&mut self, at: usize, bytes: &[u8]) {
        if let Some(slot) = self.buf.get_mut(at..at + bytes.len()) {
            slot.copy_from_slice(bytes);
        }
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

    #[test]
    fn sha256_in_place_pads_every_length() {
        let data: Vec<u8> = (0..300u32).map(|i| (i * 37 % 251) as u8).collect();
        let mut buf = vec![0xa5; 300 + SHA256_PAD];
        for len in 0..=300 {
            buf[..len].copy_from_slice(&data[..len]);
            let got = sha256_in_place(&mut buf, len).unwrap();
            assert_eq!(got[..], Sha256::digest(&data[..len])[..], "length {len}");
            // Leave garbage behind, as the hot path does.
            buf.fill(0x5a);
        }
        assert_eq!(sha256_in_place(&mut [0; 65], 1), None);
    }

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
