//! Properties of the block-hash serialisers and of `BlockHasher` that need no Python:
//! pickles decode back to their input with well-formed frames and correct memo
//! references, identity tags only matter when they repeat, CBOR and pickle pick the
//! shortest int encodings, chains compose, and bad calls change nothing.
//!
//! Byte-exactness against Python's own serialisers is `hashing_golden.rs`'s job.

use kvblocks_core::hashing::{
    cbor, pickle, BlockHasher, HashAlgo, Memo, ObjectId, ParentObject, Tuple, Value,
};
use kvblocks_core::BlockHash;
use proptest::prelude::*;

/// A decoded pickle value. Ints are minimal little-endian two's-complement bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Dec {
    None,
    Int(Vec<u8>),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<Dec>),
}

fn int_dec(le: &[u8]) -> Dec {
    match Value::int_from_le_bytes(le) {
        Value::Int(n) => {
            let bytes = n.to_le_bytes();
            let mut len = 8;
            while len > 1
                && ((bytes[len - 1] == 0 && bytes[len - 2] & 0x80 == 0)
                    || (bytes[len - 1] == 0xff && bytes[len - 2] & 0x80 != 0))
            {
                len -= 1;
            }
            if n == 0 {
                len = 0;
            }
            Dec::Int(bytes[..len].to_vec())
        }
        Value::BigInt(b) => Dec::Int(b.to_le_bytes().to_vec()),
        other => unreachable!("{other:?}"),
    }
}

fn to_dec(v: &Value) -> Dec {
    match v {
        Value::None => Dec::None,
        Value::Int(n) => int_dec(&n.to_le_bytes()),
        Value::BigInt(b) => Dec::Int(b.to_le_bytes().to_vec()),
        Value::Str(s, _) => Dec::Str(s.to_string()),
        Value::Bytes(b, _) => Dec::Bytes(b.to_vec()),
        Value::Tuple(t) => Dec::Tuple(t.items().iter().map(to_dec).collect()),
    }
}

const FRAME_SIZE_TARGET: usize = 64 * 1024;

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        let out = &self.data[self.pos..self.pos + n];
        self.pos += n;
        out
    }
    fn u8(&mut self) -> u8 {
        self.take(1)[0]
    }
    fn le(&mut self, n: usize) -> u64 {
        let mut buf = [0u8; 8];
        buf[..n].copy_from_slice(self.take(n));
        u64::from_le_bytes(buf)
    }
    fn len(&mut self, n: usize) -> usize {
        usize::try_from(self.le(n)).unwrap()
    }
}

/// Decodes the subset of pickle protocol 5 kvblocks writes, asserting that frames tile
/// the stream as Python lays them out: outside frames lie only `PROTO`, payloads of
/// 64 KiB or more (with their headers), and runs of under 4 bytes (frames too short for
/// a header) that end at such a payload or at the end; no opcode straddles a frame
/// end, every frame holds at least 4 bytes, and every frame but the last ends at
/// 64 KiB or more or right before an out-of-frame payload.
fn decode(data: &[u8]) -> Dec {
    let mut d = Decoder {
        r: Reader { data, pos: 0 },
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Vec::new(),
    };
    assert_eq!(d.r.take(2), &[0x80, 5], "PROTO 5");
    // Bytes of the current run of small opcodes outside any frame.
    let mut unframed_run = 0;
    let mut frame_end: Option<usize> = None;
    let mut frames: Vec<(usize, usize)> = Vec::new();
    loop {
        if frame_end == Some(d.r.pos) {
            frame_end = None;
        }
        let start = d.r.pos;
        let op = d.r.u8();
        if op == 0x95 {
            assert!(frame_end.is_none(), "FRAME inside a frame at {start}");
            assert_eq!(
                unframed_run, 0,
                "a short unframed run before a frame at {start}"
            );
            let len = d.r.len(8);
            assert!(len >= 4, "frame of {len} bytes at {start}");
            frame_end = Some(d.r.pos + len);
            frames.push((d.r.pos, d.r.pos + len));
            continue;
        }
        if op == b'.' {
            assert_eq!(
                frame_end.unwrap_or(d.r.pos),
                d.r.pos,
                "STOP ends the last frame"
            );
            assert_eq!(d.r.pos, data.len(), "nothing after STOP");
            assert_eq!(d.stack.len(), 1);
            break;
        }
        let payload_len = d.op(op, start);
        match frame_end {
            Some(end) => assert!(d.r.pos <= end, "opcode at {start} straddles a frame end"),
            None if payload_len.is_some_and(|n| n >= FRAME_SIZE_TARGET) => unframed_run = 0,
            None => {
                unframed_run += d.r.pos - start;
                assert!(
                    unframed_run < 4,
                    "opcode {op:#x} at {start} outside any frame"
                );
            }
        }
    }
    for pair in frames.windows(2) {
        let ((s0, e0), (s1, _)) = (pair[0], pair[1]);
        let next_frame_header = s1 - 9;
        assert!(
            e0 - s0 >= FRAME_SIZE_TARGET || e0 < next_frame_header,
            "frame {s0}..{e0} was committed early"
        );
    }
    d.stack.pop().unwrap()
}

struct Decoder<'a> {
    r: Reader<'a>,
    stack: Vec<Dec>,
    marks: Vec<usize>,
    memo: Vec<Dec>,
}

impl Decoder<'_> {
    /// Runs one opcode other than FRAME and STOP; returns the length of a str or
    /// bytes payload it read.
    fn op(&mut self, op: u8, start: usize) -> Option<usize> {
        match op {
            b'N' => self.stack.push(Dec::None),
            b'K' => {
                let n = self.r.u8();
                self.stack.push(int_dec(&[n, 0]));
            }
            b'M' => {
                let mut le = self.r.take(2).to_vec();
                le.push(0);
                self.stack.push(int_dec(&le));
            }
            b'J' => {
                let dec = int_dec(self.r.take(4));
                self.stack.push(dec);
            }
            0x8a | 0x8b => {
                let n = if op == 0x8a {
                    self.r.len(1)
                } else {
                    self.r.len(4)
                };
                let le = self.r.take(n).to_vec();
                let dec = int_dec(&le);
                assert_eq!(dec, Dec::Int(le), "LONG bytes are minimal");
                assert!(n >= 5, "LONG only outside the i32 range");
                assert_eq!(
                    op == 0x8b,
                    n >= 256,
                    "LONG1 below 256 bytes, LONG4 from 256"
                );
                self.stack.push(dec);
            }
            b'C' | b'B' | 0x8e | 0x8c | b'X' | 0x8d => return Some(self.payload(op)),
            b')' => self.stack.push(Dec::Tuple(Vec::new())),
            b'(' => self.marks.push(self.stack.len()),
            b't' => {
                let mark = self.marks.pop().unwrap();
                let items = self.stack.split_off(mark);
                assert!(items.len() > 3, "MARK..TUPLE only for more than 3 items");
                self.stack.push(Dec::Tuple(items));
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                let items = self.stack.split_off(self.stack.len() - n);
                self.stack.push(Dec::Tuple(items));
            }
            0x94 => {
                let top = self.stack.last().unwrap().clone();
                assert!(
                    !matches!(&top, Dec::None | Dec::Int(_)) && top != Dec::Tuple(Vec::new()),
                    "only str, bytes and non-empty tuples are memoized"
                );
                self.memo.push(top);
            }
            b'h' | b'j' => {
                let idx = if op == b'h' {
                    self.r.len(1)
                } else {
                    self.r.len(4)
                };
                assert_eq!(op == b'j', idx >= 256, "BINGET below slot 256");
                self.stack.push(self.memo[idx].clone());
            }
            other => panic!("unexpected opcode {other:#x} at {start}"),
        }
        None
    }

    fn payload(&mut self, op: u8) -> usize {
        let width = match op {
            b'C' | 0x8c => 1,
            b'B' | b'X' => 4,
            _ => 8,
        };
        let n = self.r.len(width);
        assert_eq!(n < 256, width == 1, "short form exactly below 256 bytes");
        let bytes = self.r.take(n).to_vec();
        self.stack.push(if matches!(op, b'C' | b'B' | 0x8e) {
            Dec::Bytes(bytes)
        } else {
            Dec::Str(String::from_utf8(bytes).unwrap())
        });
        n
    }
}

fn block_dec(parent: &[u8], tokens: &[i64], extra: Option<&Value>) -> Dec {
    Dec::Tuple(vec![
        Dec::Bytes(parent.to_vec()),
        Dec::Tuple(tokens.iter().map(|&t| int_dec(&t.to_le_bytes())).collect()),
        extra.map_or(Dec::None, to_dec),
    ])
}

fn strip_tags(v: &Value) -> Value {
    match v {
        Value::Str(s, _) => Value::Str(s.clone(), None),
        Value::Bytes(b, _) => Value::Bytes(b.clone(), None),
        Value::Tuple(t) => Value::tuple(t.items().iter().map(strip_tags).collect()).unwrap(),
        other => other.clone(),
    }
}

/// Tags every str, bytes and tuple node with its own tag.
fn tag_uniquely(v: &Value, next: &mut u32) -> Value {
    *next += 1;
    let id = Some(ObjectId(*next));
    match v {
        Value::Str(s, _) => Value::Str(s.clone(), id),
        Value::Bytes(b, _) => Value::Bytes(b.clone(), id),
        Value::Tuple(t) => {
            let items = t.items().iter().map(|i| tag_uniquely(i, next)).collect();
            Value::Tuple(Tuple::new(items, id).unwrap())
        }
        other => other.clone(),
    }
}

fn any_int() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::Int),
        (-300i64..70_000).prop_map(Value::Int),
        prop::collection::vec(any::<u8>(), 9..300).prop_map(|le| Value::int_from_le_bytes(&le)),
    ]
}

fn any_scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::None),
        any_int(),
        "\\PC{0,12}".prop_map(|s| Value::str(&s)),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(|b| Value::bytes(&b)),
    ]
}

/// A tree whose leaves may be clones of a few shared objects (tags 0..n), so that
/// identical tags always stand for identical content, as for real Python objects.
fn any_extra() -> impl Strategy<Value = Value> {
    let shared = prop::collection::vec(
        prop_oneof![
            "\\PC{0,8}".prop_map(|s| (Value::str(&s), 0)),
            prop::collection::vec(any::<u8>(), 0..8).prop_map(|b| (Value::bytes(&b), 1)),
            prop::collection::vec(any_scalar(), 0..5)
                .prop_map(|items| (Value::tuple(items).unwrap(), 2)),
        ],
        0..4,
    )
    .prop_map(|objs| {
        objs.into_iter()
            .enumerate()
            .map(|(i, (v, _))| {
                let id = Some(ObjectId(u32::try_from(i).unwrap()));
                match v {
                    Value::Str(s, _) => Value::Str(s, id),
                    Value::Bytes(b, _) => Value::Bytes(b, id),
                    Value::Tuple(t) => Value::Tuple(Tuple::new(t.items().to_vec(), id).unwrap()),
                    other => other,
                }
            })
            .collect::<Vec<_>>()
    });
    shared.prop_flat_map(|shared| {
        let leaf = if shared.is_empty() {
            any_scalar().boxed()
        } else {
            prop_oneof![3 => any_scalar(), 2 => prop::sample::select(shared)].boxed()
        };
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop::collection::vec(inner, 0..7).prop_map(|items| Value::tuple(items).unwrap())
        })
    })
}

fn any_algo() -> impl Strategy<Value = HashAlgo> {
    prop::sample::select(HashAlgo::ALL.to_vec())
}

proptest! {
    #[test]
    fn pickled_blocks_decode_to_their_input(
        parent in prop::collection::vec(any::<u8>(), 0..40),
        tokens in prop::collection::vec(any::<i64>(), 0..40),
        extra in prop::option::of(any_extra()),
    ) {
        let mut buf = Vec::new();
        let mut memo = Memo::default();
        pickle::dumps_block(&mut buf, &mut memo, &parent, ParentObject::Fresh, &tokens, extra.as_ref());
        prop_assert_eq!(decode(&buf), block_dec(&parent, &tokens, extra.as_ref()));
    }

    #[test]
    fn only_repeated_tags_change_the_pickle(extra in any_extra()) {
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        let mut memo = Memo::default();
        pickle::dumps_value(&mut a, &mut memo, &strip_tags(&extra));
        pickle::dumps_value(&mut b, &mut memo, &tag_uniquely(&extra, &mut 100));
        prop_assert_eq!(&a, &b);
        // Shared objects can only make the pickle shorter (references replace copies),
        // and never change CBOR.
        pickle::dumps_value(&mut c, &mut memo, &extra);
        prop_assert!(c.len() <= a.len());
        cbor::dumps_value(&mut a, &extra);
        cbor::dumps_value(&mut b, &strip_tags(&extra));
        prop_assert_eq!(a, b);
    }

    #[test]
    fn pickle_ints_use_the_smallest_opcode(n in prop_oneof![any::<i64>(), -70_000i64..70_000]) {
        let mut buf = Vec::new();
        pickle::dumps_value(&mut buf, &mut Memo::default(), &Value::Int(n));
        let (op, len) = match n {
            0..=255 => (b'K', 2),
            256..=65_535 => (b'M', 3),
            _ if i32::try_from(n).is_ok() => (b'J', 5),
            _ => (0x8a, 2 + int_dec(&n.to_le_bytes()).len_bytes()),
        };
        // Bodies of 4 bytes or more are framed (9-byte header); STOP ends them.
        let framed = len + 1 >= 4;
        let body = if framed { &buf[11..] } else { &buf[2..] };
        prop_assert_eq!(body[0], op);
        prop_assert_eq!(body.len(), len + 1);
        prop_assert_eq!(decode(&buf), int_dec(&n.to_le_bytes()));
    }

    #[test]
    fn cbor_ints_use_the_shortest_head(n in prop_oneof![any::<i64>(), -70_000i64..70_000]) {
        let mut buf = Vec::new();
        cbor::dumps_value(&mut buf, &Value::Int(n));
        let (major, arg) = if n >= 0 { (0u8, n.unsigned_abs()) } else { (1, n.unsigned_abs() - 1) };
        let len = match arg {
            0..=23 => 1,
            24..=0xff => 2,
            0x100..=0xffff => 3,
            0x1_0000..=0xffff_ffff => 5,
            _ => 9,
        };
        prop_assert_eq!(buf[0] >> 5, major);
        prop_assert_eq!(buf.len(), len);
    }

    #[test]
    fn tagging_does_not_change_cbor_blocks(
        tokens in prop::collection::vec(any::<i64>(), 0..20),
        extra in any_extra(),
    ) {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        cbor::dumps_block(&mut a, &[1, 2], &tokens, Some(&extra));
        cbor::dumps_block(&mut b, &[1, 2], &tokens, Some(&strip_tags(&extra)));
        prop_assert_eq!(a, b);
    }

    #[test]
    fn int_values_ignore_sign_extension(
        le in prop::collection::vec(any::<u8>(), 0..24),
        extra in 0usize..6,
    ) {
        let fill = if le.last().is_some_and(|&b| b & 0x80 != 0) { 0xff } else { 0 };
        let mut longer = le.clone();
        longer.extend(std::iter::repeat_n(fill, extra));
        prop_assert_eq!(Value::int_from_le_bytes(&le), Value::int_from_le_bytes(&longer));
    }

    #[test]
    fn chains_compose(
        algo in any_algo(),
        block_size in 1i64..8,
        tokens in prop::collection::vec(any::<i64>(), 0..120),
        split_block in 0usize..20,
        parent in prop::option::of(prop::collection::vec(any::<u8>(), 0..33)),
    ) {
        let hasher = BlockHasher::new(block_size, algo, "props").unwrap();
        let bs = hasher.block_size();
        let all = hasher.hash_blocks(&tokens, parent.as_deref(), None).unwrap();
        prop_assert_eq!(all.len(), tokens.len() / bs);
        prop_assert!(all.iter().all(|h| h.as_bytes().len() == algo.digest_len()));

        // Block by block.
        let mut prev: Option<BlockHash> = None;
        for (i, block) in tokens.chunks_exact(bs).enumerate() {
            let p = prev.as_ref().map(BlockHash::as_bytes).or(parent.as_deref());
            let h = hasher.hash_block(p, block, None);
            prop_assert_eq!(h, all[i]);
            prev = Some(h);
        }
        // An explicit list of None keys is no keys.
        let nones = vec![None; all.len()];
        prop_assert_eq!(&hasher.hash_blocks(&tokens, parent.as_deref(), Some(&nones)).unwrap(), &all);
        // Two pieces, split at a block boundary.
        let split = split_block.min(all.len());
        let mut out = Vec::new();
        hasher.extend_hashes(&mut out, &tokens[..split * bs], parent.as_deref(), None).unwrap();
        let last = out.last().copied();
        let p = last.as_ref().map(BlockHash::as_bytes).or(parent.as_deref());
        hasher.extend_hashes(&mut out, &tokens[split * bs..], p, None).unwrap();
        prop_assert_eq!(&out, &all);
        // An empty parent is no parent.
        if parent.is_none() {
            prop_assert_eq!(&hasher.hash_blocks(&tokens, Some(&[]), None).unwrap(), &all);
        }
    }

    #[test]
    fn wrong_extra_keys_count_changes_nothing(
        algo in any_algo(),
        tokens in prop::collection::vec(any::<i64>(), 0..40),
        wrong in 0usize..12,
    ) {
        let hasher = BlockHasher::new(4, algo, "props").unwrap();
        let full = tokens.len() / 4;
        prop_assume!(wrong != full);
        let keys = vec![Some(Value::Int(1)); wrong];
        let mut out = vec![hasher.none_hash()];
        let err = hasher.extend_hashes(&mut out, &tokens, None, Some(&keys)).unwrap_err();
        prop_assert_eq!(
            err.to_string(),
            format!("extra_keys must have one entry per full block: got {wrong} for {full} full blocks")
        );
        prop_assert_eq!(out, vec![hasher.none_hash()]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Blocks and payloads large enough to commit frames and bypass them.
    #[test]
    fn large_pickles_frame_like_cpython(
        tokens in prop::collection::vec(any::<i64>(), 0..40_000),
        payload in 0usize..140_000,
        text in 0usize..70_000,
        items in 0usize..12_000,
    ) {
        let extra = Value::tuple(vec![
            Value::bytes(&vec![7u8; payload]),
            Value::str(&"é".repeat(text)),
            Value::tuple((0..items).map(|i| Value::Int(i64::try_from(i).unwrap() * 1_000_003)).collect())
                .unwrap(),
        ])
        .unwrap();
        let mut buf = Vec::new();
        pickle::dumps_block(&mut buf, &mut Memo::default(), &[9; 32], ParentObject::Fresh, &tokens, Some(&extra));
        prop_assert_eq!(decode(&buf), block_dec(&[9; 32], &tokens, Some(&extra)));
    }
}

impl Dec {
    fn len_bytes(&self) -> usize {
        match self {
            Dec::Int(le) => le.len(),
            _ => 0,
        }
    }
}

#[test]
fn errors_name_the_bad_argument() {
    let err = BlockHasher::new(0, HashAlgo::Sha256, "s").unwrap_err();
    assert_eq!(err.to_string(), "block_size must be positive, got 0");
    let err = BlockHasher::new(-3, HashAlgo::Sha256, "s").unwrap_err();
    assert_eq!(err.to_string(), "block_size must be positive, got -3");
    let err = HashAlgo::from_name("it's").unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown hash algorithm \"it's\"; expected one of 'sha256', 'sha256_cbor', 'xxhash', \
         'xxhash_cbor'"
    );
}

#[test]
fn seeds_resolve_as_vllm_does() {
    use kvblocks_core::hashing::resolve_seed;
    for algo in HashAlgo::ALL {
        assert_eq!(resolve_seed(Some("x"), Some("env"), algo).unwrap(), "x");
        assert_eq!(resolve_seed(None, Some("env"), algo).unwrap(), "env");
        assert_eq!(resolve_seed(Some(""), Some("env"), algo).unwrap(), "");
    }
    assert_eq!(
        resolve_seed(None, None, HashAlgo::Sha256).unwrap(),
        "vllm-none-hash"
    );
    assert_eq!(
        resolve_seed(None, None, HashAlgo::Sha256Cbor).unwrap(),
        "vllm-none-hash"
    );
    for algo in [HashAlgo::Xxhash, HashAlgo::XxhashCbor] {
        let a = resolve_seed(None, None, algo).unwrap();
        let b = resolve_seed(None, None, algo).unwrap();
        assert_eq!(a.len(), 64);
        assert!(a
            .bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(a, b, "a fresh random seed each time");
    }
}
