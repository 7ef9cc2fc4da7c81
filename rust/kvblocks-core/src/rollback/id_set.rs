//! Sets of block ids for the rollback: an exact set, and a small filter in front of it.
//!
//! Membership is the rollback's hot path (one test per scanned block), so:
//! * [`IdSet`] stores ids below [`DENSE_LIMIT`] in a flat bitset (one load and a shift, no
//!   hashing) and the rest in a hash set, so a hostile id such as 2^60 cannot make us
//!   allocate 2^57 bytes. The bitset is zero-allocated, so the OS only materialises the
//!   pages that actually hold members.
//! * [`Filter`] is a power-of-two bitset indexed by the low bits of an id, 32 KiB for up
//!   to thousands of ids. Ids beyond its range alias onto it, so it can answer "maybe"
//!   for an absent id but never "no" for a present one. It stays in L1 however large the
//!   pool and needs no range check per id; its rare "maybe"s are confirmed against the
//!   exact set.

use rustc_hash::FxHashSet;

use super::to_i64;

/// Ids below this are stored in the bitset (2^26 bits = 8 MiB); the rest are hashed.
const DENSE_LIMIT: u64 = 1 << 26;

/// Bits per bitset word.
const WORD_BITS: u64 = u64::BITS as u64;

/// A set of non-negative block ids (as `u64`).
#[derive(Debug, Default)]
pub(super) struct IdSet {
    /// Bit `id % 64` of word `id / 64` is set iff `id` (below [`DENSE_LIMIT`]) is present.
    words: Vec<u64>,
    /// Present ids at or above [`DENSE_LIMIT`].
    large: FxHashSet<u64>,
}

impl IdSet {
    /// An empty set whose bitset already covers every id up to `max_id` (capped at
    /// [`DENSE_LIMIT`]), so that inserting ids up to it never reallocates.
    pub(super) fn covering(max_id: u64) -> Self {
        Self {
            words: vec![0; word_index(max_id.min(DENSE_LIMIT - 1)) + 1],
            large: FxHashSet::default(),
        }
    }

    /// The set of `ids`, sized from the largest one.
    pub(super) fn from_ids(ids: &[u64]) -> Self {
        let mut set = Self::covering(ids.iter().copied().max().unwrap_or(0));
        for &id in ids {
            set.insert(id);
        }
        set
    }

    /// Whether `id` is present.
    #[inline]
    pub(super) fn contains(&self, id: u64) -> bool {
        match self.words.get(word_index(id)) {
            Some(word) => (word >> (id % WORD_BITS)) & 1 != 0,
            // Past the bitset: either a large id (rare) or simply absent.
            None => !self.large.is_empty() && self.large.contains(&id),
        }
    }

    /// Adds `id`; returns whether it was new. The bitset grows geometrically, so a run
    /// of increasing ids costs amortised O(1) each.
    #[inline]
    pub(super) fn insert(&mut self, id: u64) -> bool {
        if id >= DENSE_LIMIT {
            return self.large.insert(id);
        }
        let index = word_index(id);
        if index >= self.words.len() {
            let grown = (index + 1).max(self.words.len() * 2);
            self.words
                .resize(grown.min(word_index(DENSE_LIMIT - 1) + 1), 0);
        }
        match self.words.get_mut(index) {
            Some(word) => {
                let bit = 1 << (id % WORD_BITS);
                let new = *word & bit == 0;
                *word |= bit;
                new
            }
            // Unreachable: the bitset was just grown to cover every id below the limit.
            None => false,
        }
    }

    /// Adds every one of `ids`.
    ///
    /// Bits bound for the same word are gathered in a register first: a tail of
    /// consecutive ids would otherwise chain each update through the previous store.
    pub(super) fn extend(&mut self, ids: impl Iterator<Item = u64>) {
        let mut pending: Option<(u64, u64)> = None; // (word index, bits)
        for id in ids {
            let (index, bit) = (id / WORD_BITS, 1 << (id % WORD_BITS));
            pending = match pending {
                Some((current, bits)) if current == index => Some((current, bits | bit)),
                _ => {
                    if let Some((current, bits)) = pending {
                        self.insert_bits(current, bits);
                    }
                    Some((index, bit))
                }
            };
        }
        if let Some((current, bits)) = pending {
            self.insert_bits(current, bits);
        }
    }

    /// Adds the ids `index * 64 + b` for every bit `b` set in `bits`.
    fn insert_bits(&mut self, index: u64, bits: u64) {
        if let Some(word) = self.words.get_mut(word_index(index * WORD_BITS)) {
            *word |= bits;
            return;
        }
        // Past the bitset: grow it, or hash the (large) ids.
        let mut rest = bits;
        while rest != 0 {
            self.insert(index * WORD_BITS + u64::from(rest.trailing_zeros()));
            rest &= rest - 1;
        }
    }

    /// The ids in increasing order.
    pub(super) fn into_sorted_vec(self) -> Vec<i64> {
        let mut large: Vec<u64> = self.large.into_iter().collect();
        large.sort_unstable();
        // Sized exactly up front: the list can run to millions of ids, and growing it
        // would copy them and fault in fresh pages several times over.
        let dense: usize = self.words.iter().map(|w| w.count_ones() as usize).sum();
        let mut out = Vec::with_capacity(dense + large.len());
        let mut base = 0_u64;
        for &word in &self.words {
            if word == u64::MAX {
                // A run of 64 (common: tails are runs of consecutive blocks).
                out.extend((base..base + WORD_BITS).map(to_i64));
                base += WORD_BITS;
                continue;
            }
            let mut bits = word;
            while bits != 0 {
                out.push(to_i64(base + u64::from(bits.trailing_zeros())));
                bits &= bits - 1;
            }
            base += WORD_BITS;
        }
        // Every large id is >= DENSE_LIMIT > every bitset id, so appending keeps the order.
        out.extend(large.into_iter().map(to_i64));
        out
    }
}

/// A one-sided membership filter: [`Filter::bit`] is 1 for every member, and for few
/// others (see the module docs).
#[derive(Debug)]
pub(super) struct Filter {
    /// A power-of-two number of words; id `x` maps to bit `x % 64` of word
    /// `(x / 64) & mask`.
    words: Vec<u64>,
    mask: usize,
}

impl Filter {
    /// Smallest filter: 32 Ki bits (4 KiB).
    const MIN_BITS: usize = 1 << 15;
    /// Largest filter that stays in L1 beside the streamed tables: 256 Ki bits (32 KiB).
    /// (At 256 KiB, L2-bound lookups made random tables twice as slow.)
    const L1_BITS: usize = 1 << 18;
    /// Largest filter at all: 8 Mi bits (1 MiB, L2), for failures of many blocks.
    const MAX_BITS: usize = 1 << 23;

    /// A filter admitting every one of `ids`.
    ///
    /// Sized for a false "maybe" once per 1,024 absent ids while that fits in L1; with
    /// more ids, once per 64 (at most [`Filter::MAX_BITS`]), as a saturated filter would
    /// send every chunk to the exact set.
    pub(super) fn new(ids: &[u64]) -> Self {
        let n = ids.len();
        let bits = if n.saturating_mul(1 << 10) <= Self::L1_BITS {
            (n << 10).max(Self::MIN_BITS)
        } else {
            n.saturating_mul(1 << 6)
                .clamp(Self::L1_BITS, Self::MAX_BITS)
        }
        .next_power_of_two();
        let len = bits / u64::BITS as usize;
        let mut filter = Self {
            words: vec![0; len],
            mask: len - 1,
        };
        for &id in ids {
            if let Some(word) = filter.words.get_mut(word_index(id) & filter.mask) {
                *word |= 1 << (id % WORD_BITS);
            }
        }
        filter
    }

    /// 1 if `id` may be a member, 0 if it surely is not; no data-dependent branch.
    #[inline]
    pub(super) fn bit(&self, id: u64) -> u64 {
        // `index & mask < len` always holds, so the lookup never misses.
        let word = self
            .words
            .get(word_index(id) & self.mask)
            .copied()
            .unwrap_or(0);
        (word >> (id % WORD_BITS)) & 1
    }
}

/// Index of the word holding `id`'s bit (saturates on targets where it cannot fit).
#[inline]
fn word_index(id: u64) -> usize {
    usize::try_from(id / WORD_BITS).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_and_large_ids_round_trip_sorted() {
        let ids = [5_u64, DENSE_LIMIT + 7, 0, 63, 64, DENSE_LIMIT, 5, 1 << 40];
        let set = IdSet::from_ids(&ids);
        for id in ids {
            assert!(set.contains(id));
        }
        for id in [1, 62, 65, DENSE_LIMIT - 1, DENSE_LIMIT + 1, u64::MAX] {
            assert!(!set.contains(id));
        }
        let expected: Vec<i64> = vec![0, 5, 63, 64, 1 << 26, (1 << 26) + 7, 1 << 40];
        assert_eq!(set.into_sorted_vec(), expected);
    }

    #[test]
    fn insert_grows_and_reports_new_ids() {
        let mut set = IdSet::default();
        assert!(!set.contains(0));
        assert!(set.insert(1000));
        assert!(!set.insert(1000));
        assert!(set.insert(3));
        assert!(set.insert(DENSE_LIMIT - 1));
        assert!(set.insert(DENSE_LIMIT + 1));
        assert!(!set.insert(DENSE_LIMIT + 1));
        assert!(set.contains(DENSE_LIMIT - 1) && set.contains(3) && !set.contains(4));
        assert_eq!(set.words.len(), word_index(DENSE_LIMIT - 1) + 1);
        assert_eq!(
            set.into_sorted_vec(),
            vec![3, 1000, (1 << 26) - 1, (1 << 26) + 1]
        );
    }

    #[test]
    fn extend_gathers_runs_and_still_grows() {
        let mut set = IdSet::covering(100);
        let ids = [3_u64, 4, 5, 64, 63, 3, 200, 201, DENSE_LIMIT + 9, 130];
        set.extend(ids.iter().copied());
        for id in ids {
            assert!(set.contains(id), "{id}");
        }
        assert!(!set.contains(6) && !set.contains(202));
        let run: Vec<u64> = (128..320).collect();
        set.extend(run.iter().copied());
        let sorted = set.into_sorted_vec();
        let mut expected: Vec<i64> = vec![3, 4, 5, 63, 64];
        expected.extend(128..320);
        expected.push((1 << 26) + 9);
        assert_eq!(sorted, expected);
    }

    #[test]
    fn the_filter_admits_every_member_and_aliases_only_by_low_bits() {
        let ids = [0_u64, 7, 1 << 30, DENSE_LIMIT + 3, u64::MAX >> 1];
        let filter = Filter::new(&ids);
        assert_eq!(filter.words.len(), Filter::MIN_BITS / 64);
        for id in ids {
            assert_eq!(filter.bit(id), 1, "{id}");
        }
        assert_eq!(filter.bit(8), 0);
        // 7 + 32 Ki shares 7's low 15 bits: a false "maybe", confirmed against the set.
        assert_eq!(filter.bit(7 + (1 << 15)), 1);
        // Up to 256 members fit L1 at 1,024 bits each; more get 64 bits each, capped.
        for (n, bits) in [
            (256, Filter::L1_BITS),
            (257, Filter::L1_BITS),
            (10_000, 1 << 20),
        ] {
            assert_eq!(Filter::new(&vec![1; n]).words.len(), bits / 64, "{n}");
        }
        let many: Vec<u64> = (0..1_000_000).map(|i| i * 977).collect();
        let filter = Filter::new(&many);
        assert_eq!(filter.words.len(), Filter::MAX_BITS / 64);
        assert!(many.iter().all(|&id| filter.bit(id) == 1));
    }
}
