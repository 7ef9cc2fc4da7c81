//! Random operation sequences against a small, obviously-correct model of vLLM 0.33.0's
//! `BlockPool` (plain `Vec`s, linear scans). After every step the free order, ref
//! counts, cached map, lookups and every return value (errors included) must agree,
//! and a call that errs must leave the pool exactly as it was.

use kvblocks_core::pool::BlockPool;
use kvblocks_core::{BlockHash, Error, Result};
use proptest::prelude::*;

/// The reference model. Every operation validates fully before mutating.
#[derive(Debug, Clone)]
struct Model {
    n: u32,
    caching: bool,
    refs: Vec<u32>,
    keys: Vec<Option<(BlockHash, u32)>>,
    /// Free queue, head first.
    free: Vec<u32>,
    /// (hash, group, block) in insertion order: lookups return the first match.
    inserted: Vec<(BlockHash, u32, u32)>,
}

impl Model {
    fn new(n: u32, caching: bool) -> Self {
        let size = n as usize;
        Self {
            n,
            caching,
            refs: vec![0; size],
            keys: vec![None; size],
            free: (1..n).collect(),
            inserted: Vec::new(),
        }
    }

    fn check_ids(&self, ids: &[i64]) -> Result<Vec<u32>> {
        ids.iter()
            .map(|&id| {
                u32::try_from(id)
                    .ok()
                    .filter(|&b| b < self.n)
                    .ok_or(Error::UnknownBlock {
                        block_id: id,
                        num_blocks: self.n as usize,
                    })
            })
            .collect()
    }

    fn uncache(&mut self, b: u32) -> Option<(BlockHash, u32)> {
        let key = self.keys[b as usize].take()?;
        self.inserted.retain(|e| e.2 != b);
        Some(key)
    }

    fn get_new_blocks(&mut self, n: i64) -> Result<Vec<u32>> {
        let n = usize::try_from(n).map_err(|_| Error::Negative {
            name: "n",
            value: n,
        })?;
        if n > self.free.len() {
            return Err(Error::NoFreeBlocks {
                requested: n,
                free: self.free.len(),
            });
        }
        let out: Vec<u32> = self.free.drain(..n).collect();
        for &b in &out {
            if self.caching {
                self.uncache(b);
            }
            self.refs[b as usize] = 1;
        }
        Ok(out)
    }

    fn free_blocks(&mut self, ids: &[i64]) -> Result<()> {
        let ids = self.check_ids(ids)?;
        let mut refs = self.refs.clone();
        for &b in ids.iter().filter(|&&b| b != 0) {
            if refs[b as usize] == 0 {
                return Err(Error::DoubleFree { block_id: b });
            }
            refs[b as usize] -= 1;
        }
        let mut first = Vec::new();
        for &b in ids.iter().filter(|&&b| b != 0) {
            self.refs[b as usize] -= 1;
            if self.refs[b as usize] == 0 {
                if self.caching && self.keys[b as usize].is_some() {
                    self.free.push(b);
                } else {
                    first.push(b);
                }
            }
        }
        first.append(&mut self.free);
        self.free = first;
        Ok(())
    }

    fn touch(&mut self, ids: &[i64]) -> Result<()> {
        let ids = self.check_ids(ids)?;
        for &b in ids.iter().filter(|&&b| b != 0) {
            if self.refs[b as usize] == 0 {
                self.free.retain(|&f| f != b);
            }
            self.refs[b as usize] += 1;
        }
        Ok(())
    }

    fn cache_full_blocks(
        &mut self,
        ids: &[i64],
        hashes: &[BlockHash],
        nc: i64,
        nf: i64,
        g: u32,
    ) -> Result<()> {
        // The reference's order: ids in range, counts, lengths, then state.
        let ids = self.check_ids(ids)?;
        let ncu = usize::try_from(nc).map_err(|_| Error::Negative {
            name: "num_cached_blocks",
            value: nc,
        })?;
        let nfu = usize::try_from(nf).map_err(|_| Error::Negative {
            name: "num_full_blocks",
            value: nf,
        })?;
        if nfu > ids.len() {
            return Err(Error::TooManyFullBlocks {
                num_full_blocks: nfu,
                num_block_ids: ids.len(),
            });
        }
        if hashes.len() < nfu {
            return Err(Error::TooFewHashes {
                needed: nfu,
                got: hashes.len(),
            });
        }
        if ncu >= nfu {
            return Ok(());
        }
        let mut seen = Vec::new();
        for &b in ids[ncu..nfu].iter().filter(|&&b| b != 0) {
            if self.keys[b as usize].is_some() || seen.contains(&b) {
                return Err(Error::AlreadyHashed { block_id: b });
            }
            seen.push(b);
        }
        for (&b, h) in ids[ncu..nfu].iter().zip(&hashes[ncu..nfu]) {
            if b != 0 {
                self.keys[b as usize] = Some((*h, g));
                self.inserted.push((*h, g, b));
            }
        }
        Ok(())
    }

    fn get_cached_block(&self, h: &BlockHash, groups: &[u32]) -> Option<Vec<u32>> {
        groups
            .iter()
            .map(|&g| {
                self.inserted
                    .iter()
                    .find(|e| e.0 == *h && e.1 == g)
                    .map(|e| e.2)
            })
            .collect()
    }

    fn evict_blocks(&mut self, ids: &[i64]) -> Result<Vec<(BlockHash, u32)>> {
        let ids = self.check_ids(ids)?;
        Ok(ids
            .into_iter()
            .filter(|&b| b != 0)
            .filter_map(|b| self.uncache(b))
            .collect())
    }

    fn reset_prefix_cache(&mut self) -> bool {
        if self.free.len() + 1 != self.n as usize {
            return false;
        }
        self.keys.iter_mut().for_each(|k| *k = None);
        self.inserted.clear();
        true
    }

    fn cached(&self) -> Vec<(u32, BlockHash, u32)> {
        (0..self.n)
            .filter_map(|b| self.keys[b as usize].map(|(h, g)| (b, h, g)))
            .collect()
    }
}

fn hash_of(i: u8) -> BlockHash {
    // A few short hashes of different lengths, so duplicates and length handling occur.
    BlockHash::new(&vec![i; usize::from(i % 3) * 8 + 4]).unwrap()
}

/// One step. Seeds (`usize`) pick among the currently relevant blocks when applied.
#[derive(Debug, Clone)]
enum Op {
    GetNew(i64),
    FreeHeld(Vec<usize>),
    FreeRaw(Vec<i64>),
    TouchCached(Vec<usize>),
    TouchRaw(Vec<i64>),
    CacheHeld {
        seeds: Vec<usize>,
        num_cached: i64,
        num_full: i64,
        hashes: Vec<u8>,
        group: u32,
    },
    CacheRaw {
        ids: Vec<i64>,
        num_cached: i64,
        num_full: i64,
        hashes: Vec<u8>,
        group: u32,
    },
    Lookup(u8, Vec<u32>),
    Evict(Vec<i64>),
    Reset,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let raw_ids = || prop::collection::vec(-2i64..18, 0..6);
    let seeds = || prop::collection::vec(any::<usize>(), 0..6);
    prop_oneof![
        4 => (-1i64..6).prop_map(Op::GetNew),
        4 => seeds().prop_map(Op::FreeHeld),
        1 => raw_ids().prop_map(Op::FreeRaw),
        2 => seeds().prop_map(Op::TouchCached),
        1 => raw_ids().prop_map(Op::TouchRaw),
        4 => (seeds(), -1i64..4, -1i64..7, prop::collection::vec(0u8..3, 0..8), 0u32..2).prop_map(
            |(seeds, num_cached, num_full, hashes, group)| Op::CacheHeld { seeds, num_cached, num_full, hashes, group }
        ),
        1 => (raw_ids(), -1i64..3, -1i64..6, prop::collection::vec(0u8..5, 0..7), 0u32..2).prop_map(
            |(ids, num_cached, num_full, hashes, group)| Op::CacheRaw { ids, num_cached, num_full, hashes, group }
        ),
        2 => (0u8..5, prop::collection::vec(0u32..2, 0..3)).prop_map(|(h, g)| Op::Lookup(h, g)),
        2 => raw_ids().prop_map(Op::Evict),
        1 => Just(Op::Reset),
    ]
}

fn pick(seeds: &[usize], from: &[u32]) -> Vec<i64> {
    if from.is_empty() {
        return Vec::new();
    }
    seeds
        .iter()
        .map(|s| i64::from(from[s % from.len()]))
        .collect()
}

#[derive(Debug, PartialEq)]
struct Snapshot {
    free: Vec<u32>,
    refs: Vec<u32>,
    cached: Vec<(u32, BlockHash, u32)>,
}

fn snapshot(p: &BlockPool) -> Snapshot {
    Snapshot {
        free: p.free_block_ids(),
        refs: (0..i64::from(p.num_blocks()))
            .map(|b| p.block(b).unwrap().ref_cnt)
            .collect(),
        cached: p.cached_blocks(),
    }
}

fn model_snapshot(m: &Model) -> Snapshot {
    Snapshot {
        free: m.free.clone(),
        refs: m.refs.clone(),
        cached: m.cached(),
    }
}

/// Applies `op` to both, compares the return values, and says whether it erred.
fn run_op(
    pool: &mut BlockPool,
    model: &mut Model,
    op: &Op,
) -> std::result::Result<bool, TestCaseError> {
    Ok(match op {
        Op::GetNew(n) => {
            let (got, want) = (pool.get_new_blocks(*n), model.get_new_blocks(*n));
            prop_assert_eq!(&got, &want);
            got.is_err()
        }
        Op::FreeHeld(seeds) => {
            let held: Vec<u32> = (1..model.n)
                .filter(|&b| model.refs[b as usize] > 0)
                .collect();
            // Each block once: tail-first frees of distinct held blocks, as callers do.
            let mut ids = pick(seeds, &held);
            ids.dedup();
            let (got, want) = (pool.free_blocks(&ids), model.free_blocks(&ids));
            prop_assert_eq!(&got, &want);
            got.is_err()
        }
        Op::FreeRaw(ids) => {
            let (got, want) = (pool.free_blocks(ids), model.free_blocks(ids));
            prop_assert_eq!(&got, &want);
            got.is_err()
        }
        Op::TouchCached(seeds) => {
            let cached: Vec<u32> = model.cached().iter().map(|c| c.0).collect();
            let ids = pick(seeds, &cached);
            let (got, want) = (pool.touch(&ids), model.touch(&ids));
            prop_assert_eq!(&got, &want);
            got.is_err()
        }
        Op::TouchRaw(ids) => {
            let (got, want) = (pool.touch(ids), model.touch(ids));
            prop_assert_eq!(&got, &want);
            got.is_err()
        }
        Op::CacheHeld {
            seeds,
            num_cached,
            num_full,
            hashes,
            group,
        } => {
            let held: Vec<u32> = (1..model.n)
                .filter(|&b| model.refs[b as usize] > 0)
                .collect();
            let ids = pick(seeds, &held);
            let hashes: Vec<BlockHash> = hashes.iter().map(|&h| hash_of(h)).collect();
            let got = pool.cache_full_blocks(&ids, &hashes, *num_cached, *num_full, *group);
            let want = model.cache_full_blocks(&ids, &hashes, *num_cached, *num_full, *group);
            prop_assert_eq!(&got, &want);
            got.is_err()
        }
        Op::CacheRaw {
            ids,
            num_cached,
            num_full,
            hashes,
            group,
        } => {
            let hashes: Vec<BlockHash> = hashes.iter().map(|&h| hash_of(h)).collect();
            let got = pool.cache_full_blocks(ids, &hashes, *num_cached, *num_full, *group);
            let want = model.cache_full_blocks(ids, &hashes, *num_cached, *num_full, *group);
            prop_assert_eq!(&got, &want);
            got.is_err()
        }
        Op::Lookup(h, groups) => {
            prop_assert_eq!(
                pool.get_cached_block(&hash_of(*h), groups),
                model.get_cached_block(&hash_of(*h), groups)
            );
            false
        }
        Op::Evict(ids) => {
            let (got, want) = (pool.evict_blocks(ids), model.evict_blocks(ids));
            prop_assert_eq!(&got, &want);
            got.is_err()
        }
        Op::Reset => {
            prop_assert_eq!(pool.reset_prefix_cache(), model.reset_prefix_cache());
            false
        }
    })
}

fn step(
    pool: &mut BlockPool,
    model: &mut Model,
    op: &Op,
) -> std::result::Result<(), TestCaseError> {
    let before = snapshot(pool);
    let failed = run_op(pool, model, op)?;
    let after = snapshot(pool);
    if failed {
        prop_assert_eq!(&after, &before, "an erroring call changed the pool");
    }
    prop_assert_eq!(&after, &model_snapshot(model));
    prop_assert_eq!(pool.num_free_blocks(), model.free.len());
    for h in 0..5 {
        for g in 0..2 {
            prop_assert_eq!(
                pool.get_cached_block(&hash_of(h), &[g]),
                model.get_cached_block(&hash_of(h), &[g])
            );
        }
    }
    if let Err(e) = pool.check_invariants() {
        return Err(TestCaseError::fail(format!(
            "invariant broken after {op:?}: {e}"
        )));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn pool_matches_model(n in 1u32..17, caching in any::<bool>(), ops in prop::collection::vec(op_strategy(), 1..80)) {
        let mut pool = BlockPool::new(i64::from(n), caching).unwrap();
        let mut model = Model::new(n, caching);
        for op in &ops {
            step(&mut pool, &mut model, op)?;
        }
    }
}
