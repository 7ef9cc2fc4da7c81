//! Helpers shared by the tests (and the timing examples): reading
//! `tests/golden/*.jsonl`, hex, a request driven the way the golden generator drove
//! vLLM's, and block tables narrowed to other id widths.
// Each test binary compiles this module and uses a different part of it.
#![allow(dead_code)]

use std::ops::Range;

use kvblocks_core::hashing::BlockHasher;
use kvblocks_core::request::{HashSource, RequestView, TokenSource};
use kvblocks_core::BlockHash;
use serde_json::Value;

/// Every case of `tests/golden/<name>` (a JSON Lines file), in file order.
pub fn golden(name: &str) -> Vec<Value> {
    let path = format!("{}/../../tests/golden/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The bytes of a lowercase hex string.
pub fn hex_decode(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// A request's tokens and block hashes, as the manager reads them.
pub struct Source {
    pub hashes: Vec<BlockHash>,
    pub tokens: Vec<i64>,
}

impl HashSource for Source {
    fn num_hashes(&self) -> usize {
        self.hashes.len()
    }

    fn hashes(&self, range: Range<usize>, out: &mut Vec<BlockHash>) -> kvblocks_core::Result<()> {
        self.hashes[..].hashes(range, out)
    }

    fn token_source(&self) -> Option<&dyn TokenSource> {
        Some(&self.tokens)
    }
}

/// A request as the golden generator drove it: tokens, hashes kept current, and the
/// number of computed tokens.
pub struct TestRequest {
    pub id: String,
    pub source: Source,
    pub num_computed: i64,
}

impl TestRequest {
    pub fn new(id: &str, tokens: &[i64], hasher: &BlockHasher) -> Self {
        let mut r = Self {
            id: id.to_owned(),
            source: Source {
                hashes: Vec::new(),
                tokens: Vec::new(),
            },
            num_computed: 0,
        };
        r.append(tokens, hasher);
        r
    }

    /// vLLM's block hasher: hash every new full block, chained on the previous one.
    pub fn append(&mut self, tokens: &[i64], hasher: &BlockHasher) {
        let s = &mut self.source;
        s.tokens.extend(tokens);
        let unhashed = &s.tokens[s.hashes.len() * hasher.block_size()..];
        let parent = s.hashes.last().copied();
        hasher
            .extend_hashes(
                &mut s.hashes,
                unhashed,
                parent.as_ref().map(BlockHash::as_bytes),
                None,
            )
            .unwrap();
    }

    pub fn view(&self) -> RequestView<'_, Source> {
        RequestView {
            request_id: &self.id,
            num_tokens: i64::try_from(self.source.tokens.len()).unwrap(),
            num_computed_tokens: self.num_computed,
            block_hashes: &self.source,
        }
    }
}

/// `tables` with i32 ids (-1 for an id that does not fit).
pub fn as_i32(tables: &[Vec<i64>]) -> Vec<Vec<i32>> {
    tables
        .iter()
        .map(|t| t.iter().map(|&b| i32::try_from(b).unwrap_or(-1)).collect())
        .collect()
}

/// `tables` with u32 ids (0 for an id that does not fit).
pub fn as_u32(tables: &[Vec<i64>]) -> Vec<Vec<u32>> {
    tables
        .iter()
        .map(|t| t.iter().map(|&b| u32::try_from(b).unwrap_or(0)).collect())
        .collect()
}
