//! Extra-key values: the nested tuples of `str`, `int`, `bytes` and `None` that vLLM
//! mixes into a block hash (adapter, multimodal, cache-salt and prompt-embeds keys).
//!
//! Two properties of the Python objects survive the trip into this tree because the
//! serialisers need them:
//!
//! * **Integers of any size.** Python ints are unbounded; `i64` covers every real key,
//!   [`BigInt`] the rest, and a value that fits in an `i64` is always an [`Value::Int`]
//!   (the constructors normalise), so each number has exactly one representation.
//! * **Object identity.** Python's pickler memoizes `str`, `bytes` and non-empty
//!   `tuple` objects by identity: the second occurrence of the *same object* in one
//!   pickled value is written as a memo reference, not re-serialised. Equal but distinct
//!   objects are serialised twice. [`ObjectId`] tags carry that identity: nodes with the
//!   same tag stand for one Python object. CBOR ignores the tags.
//!
//! Nesting is bounded by [`MAX_DEPTH`] at construction, so the recursive serialisers
//! can never exhaust the stack, whatever a caller builds.

use crate::error::{Error, Result};

/// The deepest tuple nesting an extra key may have (a bare tuple is depth 1).
///
/// vLLM's keys are two levels deep; the bound keeps recursion in the serialisers (and in
/// the bindings' conversion) far from any stack limit. Both backends enforce it.
pub const MAX_DEPTH: usize = 64;

/// Identity of a Python object inside one hashed value: nodes carrying the same tag are
/// the same object. Untagged nodes are distinct objects.
///
/// Callers only need to tag objects that occur more than once; the tag values are
/// arbitrary except for the two reserved ones below.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectId(pub u32);

impl ObjectId {
    /// The `bytes` object passed as the parent hash. A node with this tag inside the
    /// extra keys of a block hashed with that parent is pickled as a reference to the
    /// parent (memo slot 0).
    pub const PARENT: Self = Self(u32::MAX);
    /// The hasher's own `none_hash` `bytes` object, which stands in for an empty parent.
    pub const NONE_HASH: Self = Self(u32::MAX - 1);
}

/// An integer outside the `i64` range, as the minimal little-endian two's-complement
/// bytes that Python's `int.to_bytes(n, "little", signed=True)` gives for the smallest
/// sufficient length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BigInt {
    le: Box<[u8]>,
}

impl BigInt {
    /// The minimal little-endian two's-complement bytes (at least 9 of them).
    pub fn to_le_bytes(&self) -> &[u8] {
        &self.le
    }

    /// Whether the number is negative.
    pub fn is_negative(&self) -> bool {
        self.le.last().is_some_and(|&b| b & 0x80 != 0)
    }
}

/// A tuple of extra-key values, with its nesting depth cached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tuple {
    items: Box<[Value]>,
    id: Option<ObjectId>,
    depth: usize,
}

impl Tuple {
    /// Builds a tuple.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the tuple would nest more than [`MAX_DEPTH`] deep.
    pub fn new(items: Vec<Value>, id: Option<ObjectId>) -> Result<Self> {
        let depth = 1 + items.iter().map(Value::depth).max().unwrap_or(0);
        if depth > MAX_DEPTH {
            return Err(too_deep_error());
        }
        Ok(Self {
            items: items.into_boxed_slice(),
            id,
            depth,
        })
    }

    /// The elements, in order.
    pub fn items(&self) -> &[Value] {
        &self.items
    }

    /// The identity tag, if any.
    pub fn id(&self) -> Option<ObjectId> {
        self.id
    }
}

/// The error both backends raise for extra keys nested deeper than [`MAX_DEPTH`]. A
/// binding converting Python tuples should check the depth on the way down and raise
/// this, rather than recurse through an arbitrarily deep value first.
pub fn too_deep_error() -> Error {
    Error::InvalidArgument(format!(
        "extra keys are nested more than {MAX_DEPTH} tuples deep"
    ))
}

/// One extra-key value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// Python `None`.
    None,
    /// A Python `int` that fits in an `i64`.
    Int(i64),
    /// A Python `int` outside the `i64` range; see [`Value::int_from_le_bytes`].
    BigInt(BigInt),
    /// A Python `str` (valid Unicode: strings with lone surrogates are rejected when
    /// they are converted, in both backends).
    Str(Box<str>, Option<ObjectId>),
    /// A Python `bytes`.
    Bytes(Box<[u8]>, Option<ObjectId>),
    /// A Python `tuple`.
    Tuple(Tuple),
}

impl Value {
    /// An untagged `str`.
    pub fn str(s: &str) -> Self {
        Self::Str(s.into(), None)
    }

    /// An untagged `bytes`.
    pub fn bytes(b: &[u8]) -> Self {
        Self::Bytes(b.into(), None)
    }

    /// An untagged tuple.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when it would nest more than [`MAX_DEPTH`] deep.
    pub fn tuple(items: Vec<Value>) -> Result<Self> {
        Tuple::new(items, None).map(Self::Tuple)
    }

    /// An integer from little-endian two's-complement bytes of any length (as
    /// `int.to_bytes(n, "little", signed=True)` writes; no bytes means 0). Redundant sign
    /// bytes are dropped, and a value that fits in an `i64` becomes [`Value::Int`].
    pub fn int_from_le_bytes(bytes: &[u8]) -> Self {
        let minimal = minimal_twos_complement(bytes);
        if minimal.len() <= 8 {
            let fill = if minimal.last().is_some_and(|&b| b & 0x80 != 0) {
                0xff
            } else {
                0
            };
            let mut le = [fill; 8];
            for (dst, &src) in le.iter_mut().zip(minimal) {
                *dst = src;
            }
            Self::Int(i64::from_le_bytes(le))
        } else {
            Self::BigInt(BigInt { le: minimal.into() })
        }
    }

    /// Tuple nesting depth: 0 for scalars, 1 for a tuple of scalars, and so on.
    pub fn depth(&self) -> usize {
        match self {
            Self::Tuple(t) => t.depth,
            _ => 0,
        }
    }
}

impl From<i64> for Value {
    fn from(n: i64) -> Self {
        Self::Int(n)
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Self::str(s)
    }
}

impl From<&[u8]> for Value {
    fn from(b: &[u8]) -> Self {
        Self::bytes(b)
    }
}

/// The shortest prefix of little-endian two's-complement `bytes` with the same value:
/// a top byte is redundant when it only repeats the sign bit of the byte below it.
pub(crate) fn minimal_twos_complement(bytes: &[u8]) -> &[u8] {
    let mut len = bytes.len();
    while len >= 2 {
        let (top, below) = (bytes[len - 1], bytes[len - 2]);
        let redundant = (top == 0x00 && below & 0x80 == 0) || (top == 0xff && below & 0x80 != 0);
        if !redundant {
            break;
        }
        len -= 1;
    }
    if len == 1 && bytes[0] == 0 {
        // Zero is the empty byte string, as in pickle's LONG1 encoding of 0.
        len = 0;
    }
    &bytes[..len]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints_normalise_to_i64_when_they_fit() {
        assert_eq!(Value::int_from_le_bytes(&[]), Value::Int(0));
        assert_eq!(Value::int_from_le_bytes(&[0xff; 20]), Value::Int(-1));
        assert_eq!(Value::int_from_le_bytes(&[0x80, 0xff]), Value::Int(-128));
        let min = i64::MIN.to_le_bytes();
        assert_eq!(Value::int_from_le_bytes(&min), Value::Int(i64::MIN));
        let mut max = i64::MAX.to_le_bytes().to_vec();
        max.extend([0, 0, 0]);
        assert_eq!(Value::int_from_le_bytes(&max), Value::Int(i64::MAX));
    }

    #[test]
    fn big_ints_keep_minimal_bytes() {
        // 2**63 needs a ninth byte for its sign.
        let mut le = vec![0u8; 8];
        le[7] = 0x80;
        le.push(0);
        le.push(0);
        let Value::BigInt(b) = Value::int_from_le_bytes(&le) else {
            panic!("not big")
        };
        assert_eq!(b.to_le_bytes(), &le[..9]);
        assert!(!b.is_negative());
        // -(2**63) - 1 = ...ff 7f ff ff ff ff ff ff ff
        let le = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 0xff, 0xff];
        let Value::BigInt(b) = Value::int_from_le_bytes(&le) else {
            panic!("not big")
        };
        assert_eq!(b.to_le_bytes(), &le[..9]);
        assert!(b.is_negative());
    }

    #[test]
    fn depth_is_bounded() {
        let mut v = Value::None;
        for _ in 0..MAX_DEPTH {
            v = Value::tuple(vec![v]).unwrap();
        }
        assert_eq!(v.depth(), MAX_DEPTH);
        let err = Value::tuple(vec![v]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "extra keys are nested more than 64 tuples deep"
        );
    }
}
