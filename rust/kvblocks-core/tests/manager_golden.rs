//! Replays every case of `tests/golden/manager.jsonl` (vLLM 0.33.0 `KVCacheManager`
//! traces, one full-attention group) and checks allocated ids, the free count, every
//! block table and the ref counts after every operation. Request hashes come from
//! `kvblocks_core::hashing`, seeded as the case says (its `none_hash` is checked). Also covers the manager's
//! argument validation, stats and all-or-nothing behaviour.

mod common;

use std::collections::BTreeMap;

use common::{golden, hex_decode, TestRequest};
use kvblocks_core::hashing::{BlockHasher, HashAlgo};
use kvblocks_core::manager::{KVCacheManager, PrefixCacheStats, SlotRequest};
use kvblocks_core::request::{HashSource, RequestView};
use kvblocks_core::{BlockHash, Error};
use serde_json::Value;

fn as_ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| u32::try_from(x.as_u64().unwrap()).unwrap())
        .collect()
}

type Tables = BTreeMap<String, Vec<u32>>;

fn tables(mgr: &KVCacheManager) -> Tables {
    mgr.block_tables()
        .map(|(id, t)| (id.to_owned(), t.to_vec()))
        .collect()
}

/// Ref counts must equal table occurrences exactly (the manager is the only holder).
fn check_refs(mgr: &KVCacheManager, ctx: &str) {
    let pool = mgr.block_pool();
    let mut holders = vec![0u32; pool.num_blocks() as usize];
    for (_, table) in mgr.block_tables() {
        for &b in table {
            holders[b as usize] += 1;
        }
    }
    for (b, &want) in holders.iter().enumerate() {
        let got = pool.block(i64::try_from(b).unwrap()).unwrap().ref_cnt;
        assert_eq!(got, want, "{ctx}: ref count of block {b}");
    }
}

/// `allocate_slots` as the generator called it; compares the result with the op's
/// `allocated` and checks that a `None` changed nothing.
fn allocate_and_compare(
    mgr: &mut KVCacheManager,
    req: &TestRequest,
    args: &SlotRequest<'_>,
    op: &Value,
    ctx: &str,
) -> bool {
    let before = (tables(mgr), mgr.block_pool().free_block_ids());
    let got = mgr.allocate_slots(&req.view(), args).unwrap();
    let want = (!op["allocated"].is_null()).then(|| as_ids(&op["allocated"]));
    assert_eq!(got, want, "{ctx}: allocated");
    if got.is_none() {
        let after = (tables(mgr), mgr.block_pool().free_block_ids());
        assert_eq!(after, before, "{ctx}: None changed state");
    }
    got.is_some()
}

fn apply(
    mgr: &mut KVCacheManager,
    live: &mut BTreeMap<String, TestRequest>,
    hasher: &BlockHasher,
    op: &Value,
    ctx: &str,
) {
    let id = op["req_id"].as_str().unwrap();
    match op["op"].as_str().unwrap() {
        "add" => {
            let tokens: Vec<i64> = op["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_i64().unwrap())
                .collect();
            let mut req = TestRequest::new(id, &tokens, hasher);
            let (hits, hit_tokens) = mgr.get_computed_blocks(&req.view()).unwrap();
            assert_eq!(hits, as_ids(&op["computed_block_ids"]), "{ctx}: hits");
            let hit_tokens = i64::try_from(hit_tokens).unwrap();
            assert_eq!(
                Some(hit_tokens),
                op["num_computed_tokens"].as_i64(),
                "{ctx}"
            );
            let num_new = op["num_new_tokens"].as_i64().unwrap();
            assert_eq!(num_new, req.view().num_tokens - hit_tokens, "{ctx}");
            let hit_ids: Vec<i64> = hits.iter().map(|&b| i64::from(b)).collect();
            let args = SlotRequest {
                num_new_tokens: num_new,
                num_new_computed_tokens: hit_tokens,
                new_computed_blocks: &hit_ids,
                ..SlotRequest::default()
            };
            if allocate_and_compare(mgr, &req, &args, op, ctx) {
                req.num_computed = req.view().num_tokens;
                live.insert(id.to_owned(), req);
            }
        }
        "decode" => {
            let req = live.get_mut(id).expect("decode of a live request");
            req.append(&[op["token_id"].as_i64().unwrap()], hasher);
            let args = SlotRequest {
                num_new_tokens: 1,
                ..SlotRequest::default()
            };
            if allocate_and_compare(mgr, req, &args, op, ctx) {
                req.num_computed += 1;
            }
        }
        "free" => {
            mgr.free(id).unwrap();
            live.remove(id);
        }
        other => panic!("{ctx}: unknown op {other}"),
    }
}

fn check_state(mgr: &KVCacheManager, op: &Value, ctx: &str) {
    let want_tables: Tables = op["block_ids"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), as_ids(v)))
        .collect();
    assert_eq!(tables(mgr), want_tables, "{ctx}: block tables");
    for (k, v) in &want_tables {
        assert_eq!(mgr.get_block_ids(k), v.as_slice(), "{ctx}");
    }
    assert_eq!(
        mgr.block_pool().num_free_blocks() as u64,
        op["num_free"].as_u64().unwrap(),
        "{ctx}: num_free"
    );
    check_refs(mgr, ctx);
    mgr.check_invariants()
        .unwrap_or_else(|e| panic!("{ctx}: {e}"));
}

#[test]
fn replays_every_manager_case() {
    let cases = golden("manager.jsonl");
    assert_eq!(cases.len(), 60);
    let mut ops = 0;
    for (ci, case) in cases.iter().enumerate() {
        let bs = case["block_size"].as_i64().unwrap();
        let algo = HashAlgo::from_name(case["hash_algo"].as_str().unwrap()).unwrap();
        let hasher = BlockHasher::new(bs, algo, case["seed"].as_str().unwrap()).unwrap();
        let none_hash = hex_decode(case["none_hash"].as_str().unwrap());
        assert_eq!(
            hasher.none_hash().as_bytes(),
            none_hash,
            "case {}: none_hash",
            ci + 1
        );
        let num_blocks = case["num_blocks"].as_i64().unwrap();
        let mut mgr = KVCacheManager::new(num_blocks, bs, true, None, false).unwrap();
        let mut live = BTreeMap::new();
        for (j, op) in case["ops"].as_array().unwrap().iter().enumerate() {
            let ctx = format!("case {} op {j} ({})", ci + 1, op["op"]);
            apply(&mut mgr, &mut live, &hasher, op, &ctx);
            check_state(&mgr, op, &ctx);
            ops += 1;
        }
    }
    assert!(ops > 1000, "replayed {ops} ops");
}

fn hashes(n: u8) -> Vec<BlockHash> {
    (0..n).map(|i| BlockHash::new(&[i; 32]).unwrap()).collect()
}

fn view<'a>(
    id: &'a str,
    num_tokens: i64,
    num_computed: i64,
    h: &'a [BlockHash],
) -> RequestView<'a, [BlockHash]> {
    RequestView {
        request_id: id,
        num_tokens,
        num_computed_tokens: num_computed,
        block_hashes: h,
    }
}

/// vLLM's `test_prefill` scenario: sharing, tail-first frees, and the free order.
#[test]
fn prefill_scenario() {
    let mut mgr = KVCacheManager::new(11, 16, true, None, false).unwrap();
    let h = hashes(3);
    let r0 = view("r0", 55, 0, &h);
    assert_eq!(mgr.get_computed_blocks(&r0).unwrap(), (vec![], 0));
    let got = mgr
        .allocate_slots(
            &r0,
            &SlotRequest {
                num_new_tokens: 55,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(got, Some(vec![1, 2, 3, 4]));
    let r1 = view("r1", 53, 0, &h);
    let (hits, n) = mgr.get_computed_blocks(&r1).unwrap();
    assert_eq!((hits.as_slice(), n), ([1, 2, 3].as_slice(), 48));
    let hit_ids: Vec<i64> = hits.iter().map(|&b| i64::from(b)).collect();
    let args = SlotRequest {
        num_new_tokens: 5,
        num_new_computed_tokens: 48,
        new_computed_blocks: &hit_ids,
        ..Default::default()
    };
    assert_eq!(mgr.allocate_slots(&r1, &args).unwrap(), Some(vec![5]));
    assert_eq!(mgr.block_pool().block(1).unwrap().ref_cnt, 2);
    mgr.free("r0").unwrap();
    assert_eq!(mgr.block_pool().free_block_ids(), [4, 6, 7, 8, 9, 10]);
    mgr.free("r1").unwrap();
    assert_eq!(
        mgr.block_pool().free_block_ids(),
        [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    );
    mgr.free("r1").unwrap();
    mgr.check_invariants().unwrap();
    // A whole-prompt hit is capped: the last token is always recomputed.
    let r2 = view("r2", 48, 0, &h);
    assert_eq!(mgr.get_computed_blocks(&r2).unwrap(), (vec![1, 2], 32));
}

/// `allocate_slots` arguments for `n` new tokens and nothing else.
fn new_tokens(n: i64) -> SlotRequest<'static> {
    SlotRequest {
        num_new_tokens: n,
        ..SlotRequest::default()
    }
}

/// A hash source whose conversion always fails, as a binding's would on a bad hash.
struct FailingSource;

impl HashSource for FailingSource {
    fn num_hashes(&self) -> usize {
        5
    }

    fn hashes(
        &self,
        _: std::ops::Range<usize>,
        _: &mut Vec<BlockHash>,
    ) -> kvblocks_core::Result<()> {
        Err(Error::HashTooLong { len: 40 })
    }
}

#[test]
fn allocate_validates_before_mutating() {
    let mut mgr = KVCacheManager::new(8, 4, true, None, false).unwrap();
    let h = hashes(4);
    let r = view("r", 10, 0, &h);
    let mut err = |args: SlotRequest<'_>| mgr.allocate_slots(&r, &args).unwrap_err();
    assert_eq!(
        err(SlotRequest::default()).to_string(),
        "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
    );
    assert_eq!(
        err(new_tokens(-1)),
        Error::Negative {
            name: "num_new_tokens",
            value: -1
        }
    );
    let lookahead = SlotRequest {
        num_lookahead_tokens: -3,
        ..new_tokens(1)
    };
    assert_eq!(
        err(lookahead).to_string(),
        "num_lookahead_tokens must be non-negative, got -3"
    );
    let unknown = SlotRequest {
        new_computed_blocks: &[8],
        ..new_tokens(1)
    };
    assert_eq!(
        err(unknown),
        Error::UnknownBlock {
            block_id: 8,
            num_blocks: 8
        }
    );
    let null = SlotRequest {
        new_computed_blocks: &[0],
        ..new_tokens(1)
    };
    assert!(matches!(err(null), Error::InvalidArgument(_)));
    assert_eq!(mgr.num_requests(), 0);
    assert_eq!(mgr.block_pool().num_free_blocks(), 7);
    // Too big: None, nothing changes.
    assert_eq!(mgr.allocate_slots(&r, &new_tokens(40)).unwrap(), None);
    assert_eq!(mgr.num_requests(), 0);
    let got = mgr.allocate_slots(&r, &new_tokens(10)).unwrap();
    assert_eq!(got, Some(vec![1, 2, 3]));
    assert_eq!(mgr.block_pool().cached_blocks().len(), 2, "two full blocks");
    // A running request cannot adopt computed blocks.
    let running = view("r", 11, 10, &h);
    let adopt = SlotRequest {
        num_new_computed_tokens: 4,
        new_computed_blocks: &[1],
        ..new_tokens(1)
    };
    let result = mgr.allocate_slots(&running, &adopt);
    assert!(
        matches!(result, Err(Error::InvalidArgument(_))),
        "{result:?}"
    );
    assert_eq!(mgr.get_block_ids("r"), [1, 2, 3]);
    mgr.check_invariants().unwrap();
}

#[test]
fn failing_hash_source_changes_nothing() {
    let mut mgr = KVCacheManager::new(8, 4, true, None, false).unwrap();
    let failing = RequestView {
        request_id: "f",
        num_tokens: 12,
        num_computed_tokens: 0,
        block_hashes: &FailingSource,
    };
    let before = mgr.block_pool().free_block_ids();
    assert_eq!(
        mgr.allocate_slots(&failing, &new_tokens(12)),
        Err(Error::HashTooLong { len: 40 })
    );
    assert_eq!(
        mgr.get_computed_blocks(&failing),
        Err(Error::HashTooLong { len: 40 })
    );
    assert_eq!(mgr.block_pool().free_block_ids(), before);
    assert!(mgr.get_block_ids("f").is_empty());
    assert_eq!(mgr.num_requests(), 0);
}

#[test]
fn caching_disabled() {
    // vLLM's test_basic_prefix_caching_disabled: 4 usable blocks, no hits ever.
    let h = hashes(4);
    let none: [BlockHash; 0] = [];
    let mut mgr = KVCacheManager::new(5, 16, false, None, false).unwrap();
    let first = view("a", 32, 0, &h);
    assert_eq!(
        mgr.allocate_slots(&first, &new_tokens(32)).unwrap(),
        Some(vec![1, 2])
    );
    let again = view("b", 40, 0, &h);
    assert_eq!(mgr.get_computed_blocks(&again).unwrap(), (vec![], 0));
    assert!(mgr.block_pool().cached_blocks().is_empty());
    let second = view("b", 32, 0, &none);
    assert_eq!(
        mgr.allocate_slots(&second, &new_tokens(32)).unwrap(),
        Some(vec![3, 4])
    );
    let third = view("c", 4, 0, &none);
    assert_eq!(mgr.allocate_slots(&third, &new_tokens(4)).unwrap(), None);
    let adopt = SlotRequest {
        num_new_computed_tokens: 16,
        new_computed_blocks: &[1],
        ..new_tokens(1)
    };
    let result = mgr.allocate_slots(&view("d", 17, 0, &none), &adopt);
    assert!(
        matches!(result, Err(Error::InvalidArgument(_))),
        "{result:?}"
    );
    mgr.check_invariants().unwrap();
}

#[test]
fn external_tokens_lookahead_and_max_model_len() {
    let mut mgr = KVCacheManager::new(20, 4, true, Some(16), false).unwrap();
    let h = hashes(5);
    // 8 external tokens + 4 new + 8 lookahead, capped at 16 slots: 4 blocks.
    let r = view("r", 12, 0, &h);
    let args = SlotRequest {
        num_new_tokens: 4,
        num_external_computed_tokens: 8,
        num_lookahead_tokens: 8,
        delay_cache_blocks: true,
        ..Default::default()
    };
    assert_eq!(mgr.allocate_slots(&r, &args).unwrap(), Some(vec![3, 4]));
    assert_eq!(mgr.get_block_ids("r"), [1, 2, 3, 4]);
    assert!(
        mgr.block_pool().cached_blocks().is_empty(),
        "delayed: nothing cached"
    );
    mgr.cache_blocks(&r, 12).unwrap();
    assert_eq!(mgr.block_pool().cached_blocks().len(), 3);
    assert_eq!(
        mgr.cache_blocks(&r, 24),
        Err(Error::TooManyFullBlocks {
            num_full_blocks: 5,
            num_block_ids: 4
        })
    );
    assert_eq!(
        mgr.cache_blocks(&r, -1),
        Err(Error::Negative {
            name: "num_computed_tokens",
            value: -1
        })
    );
    mgr.check_invariants().unwrap();
    assert!(!mgr.reset_prefix_cache());
    mgr.free("r").unwrap();
    assert!(mgr.reset_prefix_cache());
    assert_eq!(
        mgr.evict_blocks(&[20]),
        Err(Error::UnknownBlock {
            block_id: 20,
            num_blocks: 20
        })
    );
    assert!(
        KVCacheManager::new(4, 0, true, None, false)
            .unwrap_err()
            .to_string()
            == "block_size must be positive, got 0"
    );
    assert!(KVCacheManager::new(0, 4, true, None, false).is_err());
}

#[test]
fn prefix_cache_stats() {
    let h = hashes(2);
    let r = view("r", 10, 0, &h);
    let mut quiet = KVCacheManager::new(8, 4, true, None, false).unwrap();
    quiet.record_prefix_cache_stats(&r, 4).unwrap();
    assert_eq!(quiet.make_prefix_cache_stats(), None);
    let mut mgr = KVCacheManager::new(8, 4, true, None, true).unwrap();
    mgr.record_prefix_cache_stats(&r, 4).unwrap();
    mgr.record_prefix_cache_stats(&r, 0).unwrap();
    assert_eq!(
        mgr.record_prefix_cache_stats(&r, -1),
        Err(Error::Negative {
            name: "num_hits",
            value: -1
        })
    );
    assert_eq!(
        mgr.record_prefix_cache_stats(&r, 11)
            .unwrap_err()
            .to_string(),
        "num_hits 11 exceeds the request's 10 tokens"
    );
    assert!(mgr.reset_prefix_cache());
    assert_eq!(
        mgr.make_prefix_cache_stats(),
        Some(PrefixCacheStats {
            reset: true,
            requests: 2,
            queries: 20,
            hits: 4,
        })
    );
    assert_eq!(
        mgr.make_prefix_cache_stats(),
        Some(PrefixCacheStats::default())
    );
}

#[test]
fn free_after_pool_tampering_fails_cleanly() {
    let mut mgr = KVCacheManager::new(8, 4, true, None, false).unwrap();
    let h = hashes(2);
    let r = view("r", 8, 0, &h);
    assert_eq!(
        mgr.allocate_slots(
            &r,
            &SlotRequest {
                num_new_tokens: 8,
                ..Default::default()
            }
        )
        .unwrap(),
        Some(vec![1, 2])
    );
    mgr.block_pool_mut().free_blocks(&[1]).unwrap();
    assert_eq!(mgr.free("r"), Err(Error::DoubleFree { block_id: 1 }));
    assert_eq!(mgr.get_block_ids("r"), [1, 2]);
    mgr.block_pool_mut().touch(&[1]).unwrap();
    mgr.free("r").unwrap();
    mgr.check_invariants().unwrap();
    assert_eq!(mgr.num_requests(), 0);
}
