//! The rules of vLLM 0.33.0's single-type managers that differ by attention type:
//! which tokens leave the attention window, how a prefix-cache hit is found, and
//! which full blocks are worth hashing.
//!
//! Counts are vLLM's signed Python ints; [`floor_div`] and [`cdiv`] are Python's `//`
//! and `cdiv` for a positive divisor.

use crate::block_hash::BlockHash;
use crate::error::{Error, Result};
use crate::pool::{BlockPool, NULL_BLOCK_ID};
use crate::request::HashSource;

/// Python's `a // b` for `b > 0`.
pub(crate) fn floor_div(a: i64, b: i64) -> i64 {
    a.div_euclid(b)
}

/// vLLM's `cdiv(a, b)`, `-(-a // b)`, for `b > 0`.
pub(crate) fn cdiv(a: i64, b: i64) -> i64 {
    -(a.saturating_neg().div_euclid(b))
}

/// A non-negative count as an index (a negative one as 0).
pub(crate) fn index(n: i64) -> usize {
    usize::try_from(n).unwrap_or(0)
}

/// A length as vLLM's int.
pub(crate) fn signed(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The attention type of a KV cache group (its vLLM spec class).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Attention {
    /// `FullAttentionSpec` (and MLA, or a promoted local spec): every block is kept.
    Full,
    /// `SlidingWindowSpec`: tokens before the window are skipped.
    SlidingWindow {
        /// The window in tokens.
        window: i64,
        /// Tokens kept below the window (multi-module MTP; 0 otherwise).
        extra_retained: i64,
    },
    /// `ChunkedLocalAttentionSpec`: tokens before the current chunk are skipped.
    ChunkedLocal {
        /// The chunk in tokens.
        chunk: i64,
    },
}

impl Attention {
    /// Whether this is full attention (looked up first, and once, by the hybrid
    /// coordinator).
    pub fn is_full(self) -> bool {
        self == Self::Full
    }

    /// vLLM's `get_num_skipped_tokens`: the leading tokens no later token attends to
    /// once `num_computed_tokens` are computed.
    pub fn skipped_tokens(self, num_computed_tokens: i64) -> i64 {
        match self {
            Self::Full => 0,
            Self::SlidingWindow {
                window,
                extra_retained,
            } => (num_computed_tokens - window + 1 - extra_retained).max(0),
            Self::ChunkedLocal { chunk } => floor_div(num_computed_tokens, chunk) * chunk,
        }
    }

    /// vLLM's `find_longest_cache_hit` of this type for the groups `group_ids` (looked
    /// up jointly): one table per group, with null blocks where the window leaves
    /// blocks out, and the hit in tokens, a multiple of `alignment` (the
    /// coordinator's: the scheduler block size). `hashes` are the request's, seen at
    /// the group's `block_size`.
    ///
    /// # Errors
    /// [`Error::Index`] where vLLM indexes past the request's hashes (a bound past
    /// them, for local attention); [`Error::InvalidArgument`] where vLLM's `islice`
    /// refuses a negative bound (full attention); [`Error::Assertion`] for
    /// chunked-local groups whose block size is not the alignment, as vLLM asserts;
    /// the hash source's errors.
    pub fn find_longest_cache_hit<H: HashSource + ?Sized>(
        self,
        pool: &BlockPool,
        hashes: &H,
        max_length: i64,
        group_ids: &[u32],
        block_size: i64,
        alignment: i64,
    ) -> Result<(Vec<Vec<u32>>, i64)> {
        let groups = group_ids.len();
        let max_blocks = floor_div(max_length, block_size);
        let hash_at = |i: i64| -> Result<BlockHash> {
            if index(i) >= hashes.num_hashes() {
                return Err(Error::Index("list index out of range".to_owned()));
            }
            hashes.hash(index(i))
        };
        match self {
            Self::Full => {
                if max_blocks < 0 {
                    return Err(Error::InvalidArgument(
                        "Stop argument for islice() must be None or an integer: \
                         0 <= x <= sys.maxsize."
                            .to_owned(),
                    ));
                }
                let mut out = vec![Vec::new(); groups];
                for i in 0..index(max_blocks).min(hashes.num_hashes()) {
                    let Some(blocks) = pool.get_cached_block(&hashes.hash(i)?, group_ids) else {
                        break;
                    };
                    push_each(&mut out, &blocks);
                }
                // Round down to the alignment, then drop the blocks past it.
                let mut hit = signed(out[0].len()) * block_size;
                hit -= hit % alignment;
                for table in &mut out {
                    table.truncate(index(cdiv(hit, block_size)));
                }
                Ok((out, hit))
            }
            Self::SlidingWindow { window, .. } => {
                // A hit needs the run of blocks the window reaches back over.
                let need = cdiv(window - 1, block_size);
                let mut out = vec![vec![NULL_BLOCK_ID; index(max_blocks)]; groups];
                let mut run = 0i64;
                let mut found = false;
                for i in (0..max_blocks).rev() {
                    if let Some(blocks) = pool.get_cached_block(&hash_at(i)?, group_ids) {
                        // A run must end on an aligned boundary.
                        if run == 0
                            && block_size != alignment
                            && ((i + 1) * block_size) % alignment != 0
                        {
                            continue;
                        }
                        for (table, block) in out.iter_mut().zip(blocks) {
                            table[index(i)] = block;
                        }
                        run += 1;
                        if run >= need {
                            for table in &mut out {
                                table.truncate(index(i + run));
                            }
                            found = true;
                            break;
                        }
                    } else {
                        run = 0;
                    }
                }
                if !found {
                    // A run from block 0 shorter than the window still hits: the
                    // window reaches back before token 0.
                    let mut keep = run;
                    while block_size != alignment && (keep * block_size) % alignment != 0 {
                        keep -= 1;
                    }
                    for table in &mut out {
                        table.truncate(index(keep));
                    }
                }
                let hit = signed(out.first().map_or(0, Vec::len)) * block_size;
                Ok((out, hit))
            }
            Self::ChunkedLocal { chunk } => {
                if block_size != alignment {
                    return Err(Error::Assertion(
                        "KV cache groups with different block sizes are not compatible with \
                         chunked local attention now"
                            .to_owned(),
                    ));
                }
                // Blocks before the last chunk boundary are out of every window:
                // computed, as nulls, without a lookup.
                let start = if max_length > 0 {
                    floor_div(max_length, chunk) * chunk
                } else {
                    0
                };
                let mut out =
                    vec![vec![NULL_BLOCK_ID; index(floor_div(start, block_size))]; groups];
                for i in floor_div(start, block_size)..max_blocks {
                    let Some(blocks) = pool.get_cached_block(&hash_at(i)?, group_ids) else {
                        break;
                    };
                    push_each(&mut out, &blocks);
                }
                let hit = signed(out.first().map_or(0, Vec::len)) * block_size;
                Ok((out, hit))
            }
        }
    }

    /// vLLM's `reachable_block_mask` for blocks `start .. end` (equal block sizes,
    /// no EAGLE): `None` caches every block; otherwise `true` marks a block a later
    /// hit can use. `retention` is the coordinator's retention interval (`None`:
    /// dense, 0: only the boundaries' tails, positive: one tail per segment).
    pub fn reachable_mask(
        self,
        start: usize,
        end: usize,
        block_size: i64,
        alignment: i64,
        retention: Option<i64>,
        boundaries: &[i64],
    ) -> Option<Vec<bool>> {
        let Self::SlidingWindow { window, .. } = self else {
            return None;
        };
        if alignment % block_size != 0 {
            return None;
        }
        let need = cdiv(window - 1, block_size);
        let mut mask = vec![false; end.saturating_sub(start)];
        let segment = match retention {
            None => Some(alignment),
            Some(0) => None,
            Some(interval) => Some(interval),
        };
        if let Some(segment) = segment {
            let per_segment = floor_div(segment, block_size);
            if need >= per_segment {
                return None;
            }
            for i in start..end {
                if signed(i) % per_segment >= per_segment - need {
                    mask[i - start] = true;
                }
            }
        }
        if retention.is_some() {
            for &boundary in boundaries {
                let aligned = floor_div(boundary, alignment) * alignment;
                let tail_end = floor_div(aligned, block_size);
                let from = signed(start).max(tail_end - need);
                let to = signed(end).min(tail_end);
                for j in from..to {
                    mask[index(j) - start] = true;
                }
            }
        }
        Some(mask)
    }
}

/// Appends `blocks[g]` to `tables[g]` for each group.
fn push_each(tables: &mut [Vec<u32>], blocks: &[u32]) {
    for (table, &block) in tables.iter_mut().zip(blocks) {
        table.push(block);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SWA8: Attention = Attention::SlidingWindow {
        window: 8,
        extra_retained: 0,
    };

    /// vLLM's examples: window 4 at 7 computed tokens skips 4; chunks of 8 skip 8 at
    /// 13 and at 8 computed tokens, nothing at 7.
    #[test]
    fn skipped_tokens_as_vllm_documents() {
        let window4 = Attention::SlidingWindow {
            window: 4,
            extra_retained: 0,
        };
        assert_eq!(window4.skipped_tokens(7), 4);
        assert_eq!(window4.skipped_tokens(2), 0);
        let chunk8 = Attention::ChunkedLocal { chunk: 8 };
        assert_eq!(chunk8.skipped_tokens(13), 8);
        assert_eq!(chunk8.skipped_tokens(8), 8);
        assert_eq!(chunk8.skipped_tokens(7), 0);
        assert_eq!(Attention::Full.skipped_tokens(1000), 0);
    }

    #[test]
    fn python_division() {
        assert_eq!(cdiv(-5, 4), -1);
        assert_eq!(cdiv(5, 4), 2);
        assert_eq!(cdiv(0, 4), 0);
        assert_eq!(floor_div(-1, 4), -1);
    }

    /// Dense retention with the alignment equal to the block size caches every block;
    /// retention 0 caches only the `cdiv(W - 1, bs)` blocks ending at each boundary.
    #[test]
    fn reachable_masks() {
        assert_eq!(SWA8.reachable_mask(0, 6, 4, 4, None, &[21]), None);
        // Boundary 21 aligns to 20: blocks 3 and 4 (tokens 12..20).
        assert_eq!(
            SWA8.reachable_mask(0, 6, 4, 4, Some(0), &[21]),
            Some(vec![false, false, false, true, true, false])
        );
        // One tail per 16-token segment (blocks 2-3, 6-7), plus the boundary's.
        assert_eq!(
            SWA8.reachable_mask(0, 8, 4, 4, Some(16), &[9]),
            Some(vec![true, true, true, true, false, false, true, true])
        );
        assert_eq!(
            Attention::Full.reachable_mask(0, 3, 4, 4, Some(0), &[]),
            None
        );
    }
}

#[cfg(test)]
mod lookup_tests {
    use super::*;

    fn hashes(n: u8) -> Vec<BlockHash> {
        (1..=n).map(|i| BlockHash::new(&[i; 32]).unwrap()).collect()
    }

    /// vLLM's documented case: chunks of 8, blocks of 4, a bound of 18 tokens and an
    /// empty cache: the blocks before the last chunk boundary (16) "hit" as nulls.
    #[test]
    fn chunked_local_hits_nulls_before_the_chunk() {
        let pool = BlockPool::new(8, true).unwrap();
        let chunk8 = Attention::ChunkedLocal { chunk: 8 };
        let (blocks, hit) = chunk8
            .find_longest_cache_hit(&pool, hashes(5).as_slice(), 18, &[0], 4, 4)
            .unwrap();
        assert_eq!((blocks, hit), (vec![vec![0, 0, 0, 0]], 16));
        // A bound at or below 0 starts at block 0 and finds nothing.
        let (blocks, hit) = chunk8
            .find_longest_cache_hit(&pool, hashes(5).as_slice(), 0, &[0], 4, 4)
            .unwrap();
        assert_eq!((blocks, hit), (vec![vec![]], 0));
    }

    /// Groups looked up jointly hit only where every member has the block; a
    /// sliding-window run shorter than the window counts only from block 0.
    #[test]
    fn joint_lookup_needs_every_group() {
        let mut pool = BlockPool::new(16, true).unwrap();
        let h = hashes(4);
        pool.get_new_blocks(6).unwrap();
        // Group 0 has blocks for hashes 0..4, group 1 only for hashes 2 and 3.
        pool.cache_ids(&[1, 2, 3, 4], &h, 0).unwrap();
        pool.cache_ids(&[5, 6], &h[2..], 1).unwrap();
        let swa = Attention::SlidingWindow {
            window: 8,
            extra_retained: 0,
        };
        let (blocks, hit) = swa
            .find_longest_cache_hit(&pool, h.as_slice(), 16, &[0, 1], 4, 4)
            .unwrap();
        assert_eq!(hit, 16, "hashes 2 and 3 form the 2-block run ending at 16");
        assert_eq!(blocks, vec![vec![0, 0, 3, 4], vec![0, 0, 5, 6]]);
        let (blocks, hit) = swa
            .find_longest_cache_hit(&pool, h.as_slice(), 12, &[0, 1], 4, 4)
            .unwrap();
        assert_eq!(
            (blocks, hit),
            (vec![vec![], vec![]], 0),
            "group 1 misses hash 1"
        );
        // Full attention stops at the first joint miss.
        let (_, hit) = Attention::Full
            .find_longest_cache_hit(&pool, h.as_slice(), 16, &[0, 1], 4, 4)
            .unwrap();
        assert_eq!(hit, 0);
    }

    /// A lookup past the request's hashes fails as vLLM's list indexing does.
    #[test]
    fn a_bound_past_the_hashes_is_an_index_error() {
        let pool = BlockPool::new(8, true).unwrap();
        let swa = Attention::SlidingWindow {
            window: 8,
            extra_retained: 0,
        };
        let err = swa
            .find_longest_cache_hit(&pool, hashes(2).as_slice(), 16, &[0], 4, 4)
            .unwrap_err();
        assert!(matches!(err, Error::Index(_)), "{err:?}");
    }
}
