//! Byte-exact `pickle.dumps(x, protocol=5)` (the C pickler of Python 3.11) for what vLLM
//! hashes: the block tuple `(parent: bytes, tuple(token ids), extra_keys | None)` and the
//! bare seed `str`.
//!
//! The rules reproduced here, all observable in the output bytes:
//!
//! * `PROTO 5`, then everything up to and including `STOP` goes in frames. A frame is
//!   opened before the first byte after `PROTO` and committed (its `FRAME` opcode and
//!   8-byte length written in front) when, at the *start* of pickling any object, it
//!   already holds at least 64 KiB, and at the end. A frame of fewer than 4 bytes is
//!   written bare, without its header.
//! * `bytes`/`str` payloads of 64 KiB or more are written outside any frame: the
//!   current frame is committed first and a new one opens after the payload.
//! * Ints: `BININT1` (0..=255), `BININT2` (..=65535), `BININT` (the rest of the i32
//!   range, negatives included), else `LONG1`/`LONG4` with minimal two's-complement
//!   bytes.
//! * `str`, `bytes` and non-empty tuples are memoized (`MEMOIZE` after them, memo slots
//!   numbered in that order); a second occurrence of the same object is a `BINGET` /
//!   `LONG_BINGET` of its slot. `()`, ints and `None` are never memoized.
//! * Tuples of 1 to 3 items end with `TUPLE1..3`; longer ones are `MARK items TUPLE`.
//!
//! Output goes into a caller-owned `Vec<u8>`, which is cleared first, so a caller
//! hashing many blocks reuses one buffer and allocates nothing per block.

use rustc_hash::FxHashMap;

use super::value::{ObjectId, Value};
use super::words::{append_words, Cursor, WordLen};
use super::PLAIN_OVERHEAD;

const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const STOP: u8 = b'.';
const NONE: u8 = b'N';
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const LONG4: u8 = 0x8b;
const SHORT_BINBYTES: u8 = b'C';
const BINBYTES: u8 = b'B';
const BINBYTES8: u8 = 0x8e;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const BINUNICODE8: u8 = 0x8d;
const EMPTY_TUPLE: u8 = b')';
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';

/// The `FRAME` opcode plus its 8-byte length.
const FRAME_HEADER_SIZE: usize = 9;
/// Python commits a frame once it holds this much (`_FRAME_SIZE_TARGET`).
const FRAME_SIZE_TARGET: usize = 64 * 1024;
/// Frames shorter than this are written without a header (`_FRAME_SIZE_MIN`).
const FRAME_SIZE_MIN: usize = 4;
/// The most bytes one int token can take (`LONG1`, length, 8 bytes).
const MAX_TOKEN_SIZE: usize = 10;

/// Reusable pickling state: the memo slots of tagged objects. Keep one per thread
/// of hashing so that the table's storage is reused across blocks.
#[derive(Debug, Default)]
pub struct Memo {
    slots: FxHashMap<ObjectId, u32>,
}

/// `pickle.dumps(s, protocol=5)` into `out` (cleared first).
pub fn dumps_str(out: &mut Vec<u8>, s: &str) {
    let mut memo = Memo::default();
    let mut p = Pickler::begin(out, &mut memo);
    p.str(s.as_bytes());
    p.finish();
}

/// `pickle.dumps(value, protocol=5)` into `out` (cleared first), honouring the
/// identity tags of `value`.
pub fn dumps_value(out: &mut Vec<u8>, memo: &mut Memo, value: &Value) {
    memo.slots.clear();
    let mut p = Pickler::begin(out, memo);
    p.value(value);
    p.finish();
}

/// Which object is pickled as the parent of a block, so that extra-key nodes tagged
/// with the matching reserved [`ObjectId`] become references to memo slot 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParentObject {
    /// The caller's parent `bytes` ([`ObjectId::PARENT`]).
    Caller,
    /// The hasher's `none_hash` ([`ObjectId::NONE_HASH`]).
    NoneHash,
    /// An object nothing else can refer to (a hash computed during the same call).
    Fresh,
}

/// `pickle.dumps((parent, tuple(tokens), extra), protocol=5)` into `out` (cleared
/// first). The token tuple is a fresh object; `extra: None` is Python `None`.
pub fn dumps_block(
    out: &mut Vec<u8>,
    memo: &mut Memo,
    parent: &[u8],
    parent_object: ParentObject,
    tokens: &[i64],
    extra: Option<&Value>,
) {
    memo.slots.clear();
    let mut p = Pickler::begin(out, memo);
    p.out
        .reserve(parent.len() + tokens.len() * MAX_TOKEN_SIZE + 64);
    // save(outer 3-tuple) is its items, then TUPLE3 + MEMOIZE. Nothing is written yet,
    // so the boundary checks of the tuple and of the parent cannot commit a frame.
    p.bytes(parent);
    match parent_object {
        ParentObject::Caller => p.remember(Some(ObjectId::PARENT)),
        ParentObject::NoneHash => p.remember(Some(ObjectId::NONE_HASH)),
        ParentObject::Fresh => {}
    }
    p.boundary();
    p.tokens(tokens);
    if let Some(v) = extra {
        p.value(v);
    } else {
        p.boundary();
        p.out.push(NONE);
    }
    p.out.push(TUPLE3);
    p.memoize();
    p.finish();
}

/// The most tokens [`write_plain_block`] takes. With at most 5 bytes a token and a
/// parent of at most 255 bytes the whole pickle stays well under 64 KiB, so its one
/// frame is never committed early and the bytes follow a fixed layout.
pub(super) const PLAIN_MAX_TOKENS: usize = 8192;

/// Where [`write_plain_block`] puts the parent's bytes.
pub(super) fn plain_parent_offset() -> usize {
    // PROTO 5, the frame header, SHORT_BINBYTES and its length.
    2 + FRAME_HEADER_SIZE + 2
}

/// [`dumps_block`] with `extra: None` into the front of `out`, for the hot path:
/// returns the length written, or `None` (having written garbage) when a token is
/// outside the `i32` range, the parent is longer than 255 bytes, there are more than
/// [`PLAIN_MAX_TOKENS`] tokens, or `out` is shorter than `parent.len() + 5 *
/// tokens.len() + PLAIN_OVERHEAD`.
///
/// Without extra keys nothing can refer back to the parent, so its identity does not
/// matter, and the output is the one frame
/// `PROTO 5 | FRAME n | SHORT_BINBYTES parent MEMOIZE | tokens | NONE TUPLE3 MEMOIZE STOP`.
pub(super) fn write_plain_block(out: &mut [u8], parent: &[u8], tokens: &[i64]) -> Option<usize> {
    let parent_len = u8::try_from(parent.len()).ok()?;
    if tokens.len() > PLAIN_MAX_TOKENS
        || out.len() < parent.len() + 5 * tokens.len() + PLAIN_OVERHEAD
        || !all_fit_i32(tokens)
    {
        return None;
    }
    let mut w = Cursor::new(out);
    // The frame length is filled in at the end.
    w.put(&[
        PROTO,
        5,
        FRAME,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        SHORT_BINBYTES,
        parent_len,
    ]);
    w.put(parent);
    w.put(&[MEMOIZE]);
    match tokens.len() {
        0 => w.put(&[EMPTY_TUPLE]),
        n => {
            if n > 3 {
                w.put(&[MARK]);
            }
            w.put_words(tokens, i32_word)?;
            w.put(&[match n {
                1 => TUPLE1,
                2 => TUPLE2,
                3 => TUPLE3,
                _ => TUPLE,
            }]);
            w.put(&[MEMOIZE]);
        }
    }
    w.put(&[NONE, TUPLE3, MEMOIZE, STOP]);
    let len = w.pos();
    // Everything after PROTO and the frame header is in the frame.
    let frame_len = (len - 2 - FRAME_HEADER_SIZE) as u64;
    w.put_at(3, &frame_len.to_le_bytes());
    Some(len)
}

struct Pickler<'a> {
    out: &'a mut Vec<u8>,
    /// Where the open frame's reserved header starts. A frame is open at every point
    /// between `begin` and `finish` except inside the write of a large payload.
    frame_start: usize,
    /// Memo slots handed out so far (every memoized object takes the next one).
    memo_len: u32,
    memo: &'a mut Memo,
}

impl<'a> Pickler<'a> {
    fn begin(out: &'a mut Vec<u8>, memo: &'a mut Memo) -> Self {
        out.clear();
        out.extend_from_slice(&[PROTO, 5]);
        let mut p = Self {
            out,
            frame_start: 0,
            memo_len: 0,
            memo,
        };
        p.open_frame();
        p
    }

    fn finish(mut self) {
        self.out.push(STOP);
        self.commit_frame();
    }

    fn open_frame(&mut self) {
        self.frame_start = self.out.len();
        self.out.extend_from_slice(&[0; FRAME_HEADER_SIZE]);
    }

    fn frame_len(&self) -> usize {
        self.out.len() - self.frame_start - FRAME_HEADER_SIZE
    }

    /// Fills in the open frame's header, or removes it if the frame is too short.
    fn commit_frame(&mut self) {
        let len = self.frame_len();
        let header_end = self.frame_start + FRAME_HEADER_SIZE;
        if len >= FRAME_SIZE_MIN {
            let mut header = [0u8; FRAME_HEADER_SIZE];
            header[0] = FRAME;
            header[1..].copy_from_slice(&(len as u64).to_le_bytes());
            if let Some(slot) = self.out.get_mut(self.frame_start..header_end) {
                slot.copy_from_slice(&header);
            }
        } else {
            self.out.drain(self.frame_start..header_end);
        }
    }

    /// Python's `_Pickler_OpcodeBoundary`, run at the start of saving every object.
    #[inline]
    fn boundary(&mut self) {
        if self.frame_len() >= FRAME_SIZE_TARGET {
            self.commit_frame();
            self.open_frame();
        }
    }

    fn memoize(&mut self) {
        self.out.push(MEMOIZE);
        self.memo_len += 1;
    }

    /// Writes a memo reference if `id` was memoized; returns whether it did.
    fn try_get(&mut self, id: Option<ObjectId>) -> bool {
        let Some(slot) = id.and_then(|id| self.memo.slots.get(&id).copied()) else {
            return false;
        };
        if let Ok(short) = u8::try_from(slot) {
            self.out.extend_from_slice(&[BINGET, short]);
        } else {
            self.out.push(LONG_BINGET);
            self.out.extend_from_slice(&slot.to_le_bytes());
        }
        true
    }

    /// Records that the object just memoized is also known by `id` (if it has one).
    fn remember(&mut self, id: Option<ObjectId>) {
        if let Some(id) = id {
            self.memo.slots.insert(id, self.memo_len - 1);
        }
    }

    fn value(&mut self, v: &Value) {
        self.boundary();
        match v {
            Value::None => self.out.push(NONE),
            Value::Int(n) => write_int(self.out, *n),
            Value::BigInt(b) => write_long(self.out, b.to_le_bytes()),
            Value::Str(s, id) => {
                if !self.try_get(*id) {
                    self.str(s.as_bytes());
                    self.remember(*id);
                }
            }
            Value::Bytes(b, id) => {
                if !self.try_get(*id) {
                    self.bytes(b);
                    self.remember(*id);
                }
            }
            Value::Tuple(t) => {
                let items = t.items();
                // The empty tuple is never memoized, so it is never a reference either.
                if items.is_empty() {
                    self.out.push(EMPTY_TUPLE);
                } else if !self.try_get(t.id()) {
                    if items.len() > 3 {
                        self.out.push(MARK);
                    }
                    for item in items {
                        self.value(item);
                    }
                    self.out.push(match items.len() {
                        1 => TUPLE1,
                        2 => TUPLE2,
                        3 => TUPLE3,
                        _ => TUPLE,
                    });
                    self.memoize();
                    self.remember(t.id());
                }
            }
        }
    }

    /// The token tuple: a fresh object, so never a memo reference.
    fn tokens(&mut self, tokens: &[i64]) {
        match tokens.len() {
            0 => {
                self.out.push(EMPTY_TUPLE);
                return;
            }
            1..=3 => {}
            _ => self.out.push(MARK),
        }
        // No frame can fill up while the tokens are written if even the largest
        // encoding of all of them fits: then the per-token boundary check is skipped.
        if self.frame_len() + tokens.len() * MAX_TOKEN_SIZE < FRAME_SIZE_TARGET {
            if !write_i32_ints(self.out, tokens) {
                for &t in tokens {
                    write_int(self.out, t);
                }
            }
        } else {
            for &t in tokens {
                self.boundary();
                write_int(self.out, t);
            }
        }
        self.out.push(match tokens.len() {
            1 => TUPLE1,
            2 => TUPLE2,
            3 => TUPLE3,
            _ => TUPLE,
        });
        self.memoize();
    }

    fn bytes(&mut self, data: &[u8]) {
        let len = data.len();
        if let Ok(short) = u8::try_from(len) {
            self.payload(&[SHORT_BINBYTES, short], data);
        } else if let Ok(len32) = u32::try_from(len) {
            let mut header = [BINBYTES, 0, 0, 0, 0];
            header[1..].copy_from_slice(&len32.to_le_bytes());
            self.payload(&header, data);
        } else {
            let mut header = [BINBYTES8, 0, 0, 0, 0, 0, 0, 0, 0];
            header[1..].copy_from_slice(&(len as u64).to_le_bytes());
            self.payload(&header, data);
        }
        self.memoize();
    }

    /// A `str` given as its UTF-8 bytes.
    fn str(&mut self, utf8: &[u8]) {
        let len = utf8.len();
        if let Ok(short) = u8::try_from(len) {
            self.payload(&[SHORT_BINUNICODE, short], utf8);
        } else if let Ok(len32) = u32::try_from(len) {
            let mut header = [BINUNICODE, 0, 0, 0, 0];
            header[1..].copy_from_slice(&len32.to_le_bytes());
            self.payload(&header, utf8);
        } else {
            let mut header = [BINUNICODE8, 0, 0, 0, 0, 0, 0, 0, 0];
            header[1..].copy_from_slice(&(len as u64).to_le_bytes());
            self.payload(&header, utf8);
        }
        self.memoize();
    }

    /// Python's `_Pickler_write_bytes`: large payloads bypass the frame.
    fn payload(&mut self, header: &[u8], data: &[u8]) {
        if data.len() >= FRAME_SIZE_TARGET {
            self.commit_frame();
            self.out.extend_from_slice(header);
            self.out.extend_from_slice(data);
            // The MEMOIZE that always follows opens the next frame in CPython.
            self.open_frame();
        } else {
            self.out.extend_from_slice(header);
            self.out.extend_from_slice(data);
        }
    }
}

/// An int that fits in an `i64`, Python's `save_long`.
#[inline]
fn write_int(out: &mut Vec<u8>, n: i64) {
    if let Ok(small) = u8::try_from(n) {
        out.extend_from_slice(&[BININT1, small]);
    } else if let Ok(mid) = u16::try_from(n) {
        let [lo, hi] = mid.to_le_bytes();
        out.extend_from_slice(&[BININT2, lo, hi]);
    } else if let Ok(word) = i32::try_from(n) {
        let mut op = [BININT, 0, 0, 0, 0];
        op[1..].copy_from_slice(&word.to_le_bytes());
        out.extend_from_slice(&op);
    } else {
        let le = n.to_le_bytes();
        write_long(out, super::value::minimal_twos_complement(&le));
    }
}

/// Opcode and encoded length of an `i32` by size class: 0..=255, 256..=65535, the rest.
const I32_OPS: [u8; 3] = [BININT1, BININT2, BININT];
const I32_LENS: [WordLen; 3] = [WordLen::Two, WordLen::Three, WordLen::Five];

/// Writes every token as [`write_int`] would, when all of them fit in an `i32` (the
/// normal case for token ids); returns false, writing nothing, otherwise.
///
/// Token ids are spread over the vocabulary, so which of the three encodings a token
/// takes is unpredictable; picking it by table lookup instead of branching avoids a
/// mispredicted branch per token. Each token is written as one 8-byte store into
/// reserved slack and the cursor advanced by its real length, so the unused bytes are
/// simply overwritten by what follows.
fn write_i32_ints(out: &mut Vec<u8>, tokens: &[i64]) -> bool {
    if !all_fit_i32(tokens) {
        return false;
    }
    append_words(out, tokens, i32_word);
    true
}

/// Whether every token fits in an `i32`. Written as a reduction without early exit so
/// that it vectorises: as `.all()` it was a tenth of the plain hot path.
fn all_fit_i32(tokens: &[i64]) -> bool {
    // t fits iff t + 2**31 is in 0 .. 2**32, i.e. has no high bits; the sign-losing
    // cast is that reinterpretation.
    #[allow(clippy::cast_sign_loss)]
    let high = tokens
        .iter()
        .fold(0u64, |acc, &t| acc | (t.wrapping_add(1 << 31) as u64 >> 32));
    high == 0
}

/// The encoding of a token already known to fit in an `i32`, in the first bytes of an
/// 8-byte word.
#[inline]
fn i32_word(t: i64) -> ([u8; 8], WordLen) {
    // Truncation intended: the caller checked that `t` fits, and its low 32 bits read
    // as unsigned put negatives in the BININT class.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let unsigned = t as u32;
    let class = usize::from(unsigned > 0xff) + usize::from(unsigned > 0xffff);
    let word = u64::from(I32_OPS[class]) | (u64::from(unsigned) << 8);
    (word.to_le_bytes(), I32_LENS[class])
}

/// `LONG1`/`LONG4` with the given minimal two's-complement bytes.
fn write_long(out: &mut Vec<u8>, le: &[u8]) {
    if let Ok(short) = u8::try_from(le.len()) {
        out.extend_from_slice(&[LONG1, short]);
    } else {
        // Python refuses ints needing more than 2**31 - 1 bytes, so this cannot
        // truncate for any int Python could have handed over.
        let len = u32::try_from(le.len()).unwrap_or(u32::MAX);
        out.push(LONG4);
        out.extend_from_slice(&len.to_le_bytes());
    }
    out.extend_from_slice(le);
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::hashing::hex;

    #[test]
    fn seed_string() {
        let mut out = Vec::new();
        dumps_str(&mut out, "vllm-none-hash");
        assert_eq!(
            hex(&out),
            "80059512000000000000008c0e766c6c6d2d6e6f6e652d68617368942e"
        );
        // "" pickles to a 4-byte body, just long enough to be framed.
        dumps_str(&mut out, "");
        assert_eq!(hex(&out), "80059504000000000000008c00942e");
        // ...while "()" has a 2-byte body, so it goes bare.
        let empty = Value::tuple(Vec::new()).unwrap();
        dumps_value(&mut out, &mut Memo::default(), &empty);
        assert_eq!(hex(&out), "8005292e");
    }

    #[test]
    fn tiny_values_are_not_framed() {
        let mut out = Vec::new();
        dumps_value(&mut out, &mut Memo::default(), &Value::None);
        assert_eq!(hex(&out), "80054e2e");
        dumps_value(&mut out, &mut Memo::default(), &Value::Int(5));
        assert_eq!(hex(&out), "80054b052e");
    }
}
