//! Times hashing a 131,072-token prompt in blocks of 16 with each `HashAlgo`, against
//! plain SHA-256 / xxh3 over the same serialised bytes (best of 20 runs each).
//!
//! Prints measurements only; nothing here asserts on time. Run in release mode:
//!
//! ```text
//! cargo run --release -p kvblocks-core --example timing_hashing
//! ```

use std::time::{Duration, Instant};

use kvblocks_core::hashing::{cbor, pickle, BlockHasher, HashAlgo, Memo, ParentObject};
use sha2::{Digest, Sha256};

/// The shortest wall-clock time of `runs` calls of `f`.
fn best_of<T>(runs: usize, mut f: impl FnMut() -> T) -> Duration {
    (0..runs)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(f());
            start.elapsed()
        })
        .min()
        .unwrap()
}

fn main() {
    let tokens: Vec<i64> = (0..131_072).map(|i| (i * 7919 + 13) % 150_000).collect();
    for algo in HashAlgo::ALL {
        let hasher = BlockHasher::new(16, algo, "timing").unwrap();
        let chain = hasher.hash_blocks(&tokens, None, None).unwrap();
        let full = best_of(20, || hasher.hash_blocks(&tokens, None, None).unwrap());

        // The same bytes, serialised up front, digested alone.
        let mut serialised = Vec::new();
        let mut memo = Memo::default();
        for (i, block) in tokens.chunks_exact(16).enumerate() {
            let parent = if i == 0 {
                hasher.none_hash()
            } else {
                chain[i - 1]
            };
            let mut buf = Vec::new();
            if algo.uses_pickle() {
                pickle::dumps_block(
                    &mut buf,
                    &mut memo,
                    parent.as_bytes(),
                    ParentObject::Fresh,
                    block,
                    None,
                );
            } else {
                cbor::dumps_block(&mut buf, parent.as_bytes(), block, None);
            }
            serialised.push(buf);
        }
        let digest_only = best_of(20, || {
            serialised
                .iter()
                .map(|b| {
                    if algo.is_xxhash() {
                        xxhash_rust::xxh3::xxh3_128(b).to_be_bytes()[0]
                    } else {
                        Sha256::digest(b)[0]
                    }
                })
                .fold(0u8, |a, b| a ^ b)
        });
        let bytes: usize = serialised.iter().map(Vec::len).sum();
        println!(
            "{:<12} {:>8.3} ms  (digest alone {:>7.3} ms, ratio {:.2}; {} blocks, {} bytes)",
            algo.name(),
            full.as_secs_f64() * 1e3,
            digest_only.as_secs_f64() * 1e3,
            full.as_secs_f64() / digest_only.as_secs_f64(),
            chain.len(),
            bytes,
        );
    }
}
