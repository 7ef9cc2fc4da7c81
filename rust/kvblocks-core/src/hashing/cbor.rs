//! Byte-exact `cbor2.dumps(x, canonical=True)` for what vLLM hashes: the block tuple
//! `(parent: bytes, tuple(token ids), extra_keys | None)` and the bare seed `str`.
//!
//! Tuples are arrays, `bytes` byte strings, `str` text strings, `None` is `0xf6`, and
//! every length and integer uses the shortest head. Integers in `-2**64 .. 2**64` are
//! major types 0/1; beyond that cbor2 writes bignums, tag 2 (positive) or 3 (negative,
//! encoding `-1 - n`) around the big-endian magnitude without leading zero bytes.
//! Identity tags play no part: CBOR has no memo.

use super::value::{BigInt, Value};
use super::words::{append_words, Cursor, WordLen};
use super::PLAIN_OVERHEAD;

const UNSIGNED: u8 = 0;
const NEGATIVE: u8 = 1;
const BYTES: u8 = 2;
const TEXT: u8 = 3;
const ARRAY: u8 = 4;
const TAG: u8 = 6;
const NULL: u8 = 0xf6;
const TAG_POSITIVE_BIGNUM: u64 = 2;
/// Initial-byte values that say how many argument bytes follow.
const ARG_1: u8 = 24;
const ARG_2: u8 = 25;
const ARG_4: u8 = 26;
const ARG_8: u8 = 27;
const TAG_NEGATIVE_BIGNUM: u64 = 3;

/// `cbor2.dumps(s, canonical=True)` into `out` (cleared first).
pub fn dumps_str(out: &mut Vec<u8>, s: &str) {
    out.clear();
    write_head(out, TEXT, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// `cbor2.dumps(value, canonical=True)` into `out` (cleared first).
pub fn dumps_value(out: &mut Vec<u8>, value: &Value) {
    out.clear();
    write_value(out, value);
}

/// `cbor2.dumps((parent, tuple(tokens), extra), canonical=True)` into `out` (cleared
/// first); `extra: None` is Python `None`.
pub fn dumps_block(out: &mut Vec<u8>, parent: &[u8], tokens: &[i64], extra: Option<&Value>) {
    out.clear();
    out.reserve(parent.len() + tokens.len() * 9 + 32);
    write_head(out, ARRAY, 3);
    write_head(out, BYTES, parent.len() as u64);
    out.extend_from_slice(parent);
    write_head(out, ARRAY, tokens.len() as u64);
    if !write_u32_ints(out, tokens) {
        for &t in tokens {
            write_int(out, t);
        }
    }
    match extra {
        Some(v) => write_value(out, v),
        None => out.push(NULL),
    }
}

/// Where [`write_plain_block`] puts the bytes of a parent of `parent_len` bytes.
pub(super) fn plain_parent_offset(parent_len: usize) -> usize {
    // The array head, then the byte string's head.
    1 + head(BYTES, parent_len as u64).1
}

/// [`dumps_block`] with `extra: None` into the front of `out`, for the hot path:
/// returns the length written, or `None` (having written garbage) when a token is
/// outside `0 .. 2**32` or `out` is shorter than `parent.len() + 5 * tokens.len() +
/// PLAIN_OVERHEAD`.
pub(super) fn write_plain_block(out: &mut [u8], parent: &[u8], tokens: &[i64]) -> Option<usize> {
    if out.len() < parent.len() + 5 * tokens.len() + PLAIN_OVERHEAD || !all_fit_u32(tokens) {
        return None;
    }
    let mut w = Cursor::new(out);
    w.put(&[(ARRAY << 5) | 3]);
    let (bytes_head, len) = head(BYTES, parent.len() as u64);
    w.put(&bytes_head[..len]);
    w.put(parent);
    let (array_head, len) = head(ARRAY, tokens.len() as u64);
    w.put(&array_head[..len]);
    w.put_words(tokens, u32_word)?;
    w.put(&[NULL]);
    Some(w.pos())
}

fn write_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::None => out.push(NULL),
        Value::Int(n) => write_int(out, *n),
        Value::BigInt(b) => write_bigint(out, b),
        Value::Str(s, _) => {
            write_head(out, TEXT, s.len() as u64);
            out.extend_from_slice(s.as_bytes());
        }
        Value::Bytes(b, _) => {
            write_head(out, BYTES, b.len() as u64);
            out.extend_from_slice(b);
        }
        Value::Tuple(t) => {
            write_head(out, ARRAY, t.items().len() as u64);
            for item in t.items() {
                write_value(out, item);
            }
        }
    }
}

/// Per size class of an unsigned int (< 24, < 2^8, < 2^16, < 2^32): the initial byte
/// (bar the value itself for the first class), how far to shift the byte-swapped value
/// so that its lowest byte lands just after the head, and the encoded length.
const U32_HEAD: [u64; 4] = [0, 24, 25, 26];
const U32_SHIFT: [u32; 4] = [56, 48, 40, 24];
const U32_LENS: [WordLen; 4] = [WordLen::One, WordLen::Two, WordLen::Three, WordLen::Five];

/// Writes every token as [`write_int`] would, when all of them are in `0 .. 2^32` (the
/// normal case for token ids); returns false, writing nothing, otherwise.
///
/// The encoding's length depends unpredictably on each token, so it is picked by table
/// lookup rather than branches: the head byte and the big-endian argument form one
/// word, written as one 8-byte store into reserved slack, and the cursor advances by
/// the real length, so the unused bytes are simply overwritten by what follows.
fn write_u32_ints(out: &mut Vec<u8>, tokens: &[i64]) -> bool {
    if !all_fit_u32(tokens) {
        return false;
    }
    append_words(out, tokens, u32_word);
    true
}

/// Whether every token is in `0 .. 2**32`. Written as a reduction without early exit
/// so that it vectorises.
fn all_fit_u32(tokens: &[i64]) -> bool {
    // A negative t reinterpreted as u64 has its high bits set.
    #[allow(clippy::cast_sign_loss)]
    let high = tokens.iter().fold(0u64, |acc, &t| acc | (t as u64 >> 32));
    high == 0
}

/// The encoding of a token already known to be in `0 .. 2**32`, in the first bytes of
/// an 8-byte word.
#[inline]
fn u32_word(t: i64) -> ([u8; 8], WordLen) {
    // The caller checked that `t` is non-negative.
    #[allow(clippy::cast_sign_loss)]
    let v = t as u64;
    let class = usize::from(v >= 24) + usize::from(v > 0xff) + usize::from(v > 0xffff);
    // Stored little-endian: the head in byte 0, then the argument big-endian (the
    // swap puts v's lowest byte at the top; the shift brings it down to byte
    // `arg_len`). Below 24 the shift leaves v itself in byte 0, as the head.
    let word = U32_HEAD[class] | (v.swap_bytes() >> U32_SHIFT[class]);
    (word.to_le_bytes(), U32_LENS[class])
}

#[inline]
fn write_int(out: &mut Vec<u8>, n: i64) {
    // A negative n is encoded as -1 - n = |n| - 1, which cannot overflow.
    match u64::try_from(n) {
        Ok(u) => write_head(out, UNSIGNED, u),
        Err(_) => write_head(out, NEGATIVE, n.unsigned_abs() - 1),
    }
}

fn write_bigint(out: &mut Vec<u8>, b: &BigInt) {
    let negative = b.is_negative();
    // The magnitude cbor2 encodes: n for n >= 0, -1 - n (the complement) for n < 0,
    // big-endian without leading zero bytes.
    let mut magnitude: Vec<u8> = b
        .to_le_bytes()
        .iter()
        .rev()
        .map(|&x| if negative { !x } else { x })
        .skip_while(|&x| x == 0)
        .collect();
    let major = if negative { NEGATIVE } else { UNSIGNED };
    if magnitude.len() <= 8 {
        // 2**63 <= n < 2**64 or -2**64 <= n < -2**63: still a plain major-0/1 integer.
        let mut be = [0u8; 8];
        be[8 - magnitude.len()..].copy_from_slice(&magnitude);
        write_head(out, major, u64::from_be_bytes(be));
        return;
    }
    let tag = if negative {
        TAG_NEGATIVE_BIGNUM
    } else {
        TAG_POSITIVE_BIGNUM
    };
    write_head(out, TAG, tag);
    write_head(out, BYTES, magnitude.len() as u64);
    out.append(&mut magnitude);
}

/// A CBOR head: major type and argument, in the shortest form.
#[inline]
fn write_head(out: &mut Vec<u8>, major: u8, arg: u64) {
    let (bytes, len) = head(major, arg);
    out.extend_from_slice(&bytes[..len]);
}

/// The bytes of a CBOR head (in the first `len` of the array) and `len`.
#[inline]
fn head(major: u8, arg: u64) -> ([u8; 9], usize) {
    // The initial byte: major type in the top 3 bits, then the argument itself (< 24)
    // or how many bytes of it follow (24: 1, 25: 2, 26: 4, 27: 8).
    let major = major << 5;
    let mut bytes = [0u8; 9];
    let (info, arg_len) = match arg {
        0..=23 => (0, 0),
        24..=0xff => (ARG_1, 1),
        0x100..=0xffff => (ARG_2, 2),
        0x1_0000..=0xffff_ffff => (ARG_4, 4),
        _ => (ARG_8, 8),
    };
    // Below 24 the argument is the additional information itself.
    let small = if arg_len == 0 {
        u8::try_from(arg).unwrap_or_default()
    } else {
        info
    };
    bytes[0] = major | small;
    bytes[1..=arg_len].copy_from_slice(&arg.to_be_bytes()[8 - arg_len..]);
    (bytes, 1 + arg_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::hashing::hex;

    fn int_hex(le: &[u8]) -> String {
        let mut out = Vec::new();
        dumps_value(&mut out, &Value::int_from_le_bytes(le));
        hex(&out)
    }

    #[test]
    fn seed_string() {
        let mut out = Vec::new();
        dumps_str(&mut out, "vllm-none-hash");
        assert_eq!(hex(&out), "6e766c6c6d2d6e6f6e652d68617368");
    }

    #[test]
    fn integer_boundaries_match_cbor2() {
        // Expected bytes from cbor2.dumps(n, canonical=True).
        let two_64 = [0, 0, 0, 0, 0, 0, 0, 0, 1];
        assert_eq!(int_hex(&two_64), "c249010000000000000000");
        assert_eq!(int_hex(&[0xff; 8]), "20"); // -1
        let u64_max = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0];
        assert_eq!(int_hex(&u64_max), "1bffffffffffffffff");
        let minus_two_64 = [0, 0, 0, 0, 0, 0, 0, 0, 0xff];
        assert_eq!(int_hex(&minus_two_64), "3bffffffffffffffff");
        let below = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe];
        assert_eq!(int_hex(&below), "c349010000000000000000"); // -2**64 - 1
        assert_eq!(int_hex(&i64::MIN.to_le_bytes()), "3b7fffffffffffffff");
        for (n, want) in [(23, "17"), (24, "1818"), (255, "18ff"), (256, "190100")] {
            let mut out = Vec::new();
            dumps_value(&mut out, &Value::Int(n));
            assert_eq!(hex(&out), want);
        }
    }
}
