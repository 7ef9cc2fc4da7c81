//! Times `rollback_invalid_blocks` on 1,000 and 10,000 requests with 1,000-block tables
//! each (distinct or random ids; one invalid id per 100 or per 10 requests), for i64,
//! i32 and u32 block ids, without collecting evictions, and in strict mode (best of 7
//! runs each). Checks that the result does not depend on the id width.
//!
//! Prints measurements only; nothing here asserts on time. Run in release mode:
//!
//! ```text
//! cargo run --release -p kvblocks-core --example timing_rollback
//! ```

use std::time::{Duration, Instant};

use kvblocks_core::rollback::Tolerance;
use kvblocks_core::rollback::{rollback_invalid_blocks, Batch, BlockIds, Mode, Rollback};

#[path = "../tests/common/mod.rs"]
mod common;
use common::{as_i32, as_u32};

/// A deterministic xorshift stream (no extra dependency for the timing data).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Best of 7 wall-clock times of one rollback of `tables`, and its result.
fn best_time(
    tables: &[BlockIds<'_>],
    computed: &[i64],
    scheduled: &[i64],
    invalid: &[i64],
    collect: bool,
    mode: Mode,
) -> (Duration, Rollback) {
    let batch = Batch {
        block_tables: tables,
        num_computed_tokens: computed,
        num_scheduled_tokens: scheduled,
    };
    let mut best = Duration::MAX;
    let mut result = Rollback::default();
    for _ in 0..7 {
        let start = Instant::now();
        result = std::hint::black_box(
            rollback_invalid_blocks(batch, invalid, 16, collect, mode, Tolerance::Strict)
                .unwrap_or_else(|e| panic!("{e}")),
        );
        best = best.min(start.elapsed());
    }
    (best, result)
}

fn main() {
    const BLOCKS: usize = 1000;
    for requests in [1_000_usize, 10_000] {
        let pool = u64::try_from(requests * BLOCKS).unwrap_or(u64::MAX);
        // "distinct": every request owns consecutive ids of its own; "random": ids drawn
        // from the whole pool, so the lookups have no locality.
        for random in [false, true] {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
            let tables: Vec<Vec<i64>> = (0..requests)
                .map(|r| {
                    (0..BLOCKS)
                        .map(|j| {
                            let id = if random {
                                rng.below(pool)
                            } else {
                                u64::try_from(r * BLOCKS + j).unwrap_or(0)
                            };
                            i64::try_from(id).unwrap_or(0)
                        })
                        .collect()
                })
                .collect();
            let narrow = as_i32(&tables);
            let unsigned = as_u32(&tables);
            let wide_views: Vec<BlockIds<'_>> = tables.iter().map(|t| BlockIds::I64(t)).collect();
            let narrow_views: Vec<BlockIds<'_>> = narrow.iter().map(|t| BlockIds::I32(t)).collect();
            let unsigned_views: Vec<BlockIds<'_>> =
                unsigned.iter().map(|t| BlockIds::U32(t)).collect();
            // Every request computed its whole table before this step, less 3 tokens,
            // and has 13 tokens scheduled in it.
            let computed = vec![i64::try_from(BLOCKS * 16).unwrap_or(0) - 3; requests];
            let scheduled = vec![13_i64; requests];
            for per_invalid in [100, 10] {
                // Scattered invalid ids: one per `per_invalid` requests, over the whole pool.
                let invalid: Vec<i64> = (0..requests / per_invalid)
                    .map(|_| i64::try_from(rng.below(pool)).unwrap_or(0))
                    .collect();
                let time = |views: &[BlockIds<'_>], collect, mode| {
                    best_time(views, &computed, &scheduled, &invalid, collect, mode)
                };
                let (wide, result) = time(&wide_views, true, Mode::Vllm);
                let (wide_no_evict, _) = time(&wide_views, false, Mode::Vllm);
                let (narrow_time, narrow_result) = time(&narrow_views, true, Mode::Vllm);
                let (unsigned_time, unsigned_result) = time(&unsigned_views, true, Mode::Vllm);
                let (strict, _) = time(&wide_views, true, Mode::Strict);
                assert_eq!(narrow_result, result);
                assert_eq!(unsigned_result, result);
                assert!(!result.affected.is_empty());
                println!(
                    "{requests:>6} x {BLOCKS} {} ids, {:>4} invalid ({:>4} affected, {:>6} to \
                     evict): i64 {wide:>9.2?} (no evictions {wide_no_evict:>9.2?}), \
                     i32 {narrow_time:>9.2?}, u32 {unsigned_time:>9.2?}, strict {strict:>9.2?}",
                    if random { "random  " } else { "distinct" },
                    invalid.len(),
                    result.affected.len(),
                    result.blocks_to_evict.len(),
                );
            }
        }
    }
}
