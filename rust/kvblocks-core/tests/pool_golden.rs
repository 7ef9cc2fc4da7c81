//! Replays every case of `tests/golden/block_pool.jsonl` (vLLM 0.33.0 `BlockPool`
//! traces) and compares the full observable state after every operation.

mod common;

use std::collections::BTreeMap;

use common::{golden, hex, hex_decode};
use kvblocks_core::pool::BlockPool;
use kvblocks_core::{BlockHash, Error};
use serde_json::Value;

fn hash(v: &Value) -> BlockHash {
    BlockHash::new(&hex_decode(v.as_str().expect("hash is a hex string")))
        .expect("hash <= 32 bytes")
}

fn ids(v: &Value) -> Vec<i64> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_i64().expect("int id"))
        .collect()
}

fn u32s(v: &Value) -> Vec<u32> {
    ids(v)
        .into_iter()
        .map(|x| u32::try_from(x).expect("u32"))
        .collect()
}

fn int(op: &Value, key: &str) -> i64 {
    op[key]
        .as_i64()
        .unwrap_or_else(|| panic!("{key} is not an int in {op}"))
}

/// Everything observable about a pool, for exact before/after comparisons.
#[derive(Debug, PartialEq)]
struct Snapshot {
    free_order: Vec<u32>,
    ref_cnt: Vec<u32>,
    cached: Vec<(u32, BlockHash, u32)>,
}

fn snapshot(pool: &BlockPool) -> Snapshot {
    Snapshot {
        free_order: pool.free_block_ids(),
        ref_cnt: (0..i64::from(pool.num_blocks()))
            .map(|b| pool.block(b).unwrap().ref_cnt)
            .collect(),
        cached: pool.cached_blocks(),
    }
}

fn check_state(pool: &BlockPool, state: &Value, ctx: &str) {
    pool.check_invariants()
        .unwrap_or_else(|e| panic!("{ctx}: invariant: {e}"));
    assert_eq!(
        pool.num_free_blocks() as u64,
        state["num_free"].as_u64().unwrap(),
        "{ctx}: num_free"
    );
    // The generator rounded usage to 12 decimals (Python's `round(x, 12)`).
    let usage = state["usage"].as_f64().unwrap();
    let rounded: f64 = format!("{:.12}", pool.usage()).parse().unwrap();
    assert!(
        rounded.to_bits() == usage.to_bits(),
        "{ctx}: usage {} != {usage}",
        pool.usage()
    );

    let want_refs: BTreeMap<u32, u32> = state["ref_cnt"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            (
                k.parse().unwrap(),
                u32::try_from(v.as_u64().unwrap()).unwrap(),
            )
        })
        .collect();
    let got_refs: BTreeMap<u32, u32> = (1..i64::from(pool.num_blocks()))
        .map(|b| pool.block(b).unwrap())
        .filter(|info| info.ref_cnt != 0)
        .map(|info| (info.block_id, info.ref_cnt))
        .collect();
    assert_eq!(got_refs, want_refs, "{ctx}: ref counts");

    let want_cached: BTreeMap<u32, String> = state["cached"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.parse().unwrap(), v.as_str().unwrap().to_owned()))
        .collect();
    let got_cached: BTreeMap<u32, String> = pool
        .cached_blocks()
        .into_iter()
        .map(|(b, h, g)| (b, format!("{}:{g}", hex(h.as_bytes()))))
        .collect();
    assert_eq!(got_cached, want_cached, "{ctx}: cached");
    for (&b, key) in &got_cached {
        let info = pool.block(i64::from(b)).unwrap();
        let (h, g) = key.split_once(':').unwrap();
        assert_eq!(
            hex(info.block_hash.unwrap().as_bytes()),
            h,
            "{ctx}: block({b}).hash"
        );
        assert_eq!(
            info.group_id,
            Some(g.parse().unwrap()),
            "{ctx}: block({b}).group_id"
        );
    }

    if let Some(order) = state.get("free_order") {
        assert_eq!(pool.free_block_ids(), u32s(order), "{ctx}: free_order");
    }
}

fn apply(pool: &mut BlockPool, op: &Value, ctx: &str) {
    match op["op"].as_str().unwrap() {
        "get_new_blocks" => {
            let n = int(op, "n");
            if let Some(err) = op.get("error") {
                assert_eq!(err, "ValueError", "{ctx}");
                let before = snapshot(pool);
                let free = pool.num_free_blocks();
                let got = pool.get_new_blocks(n);
                assert_eq!(
                    got,
                    Err(Error::NoFreeBlocks {
                        requested: usize::try_from(n).unwrap(),
                        free
                    }),
                    "{ctx}"
                );
                assert_eq!(snapshot(pool), before, "{ctx}: failed call changed state");
            } else {
                assert_eq!(
                    pool.get_new_blocks(n).unwrap(),
                    u32s(&op["result"]),
                    "{ctx}: result"
                );
            }
        }
        "free_blocks" => pool.free_blocks(&ids(&op["ids"])).unwrap(),
        "touch" => pool.touch(&ids(&op["ids"])).unwrap(),
        "cache_full_blocks" => {
            let hashes: Vec<BlockHash> = op["block_hashes"]
                .as_array()
                .unwrap()
                .iter()
                .map(hash)
                .collect();
            pool.cache_full_blocks(
                &ids(&op["ids"]),
                &hashes,
                int(op, "num_cached_blocks"),
                int(op, "num_full_blocks"),
                u32::try_from(int(op, "group_id")).unwrap(),
            )
            .unwrap();
        }
        "get_cached_block" => {
            let groups = u32s(&op["group_ids"]);
            let got = pool.get_cached_block(&hash(&op["hash"]), &groups);
            let want = (!op["result"].is_null()).then(|| u32s(&op["result"]));
            assert_eq!(got, want, "{ctx}: result");
        }
        "evict_blocks" => {
            let evict = ids(&op["ids"]);
            let cached_before: BTreeMap<u32, (BlockHash, u32)> = pool
                .cached_blocks()
                .into_iter()
                .map(|(b, h, g)| (b, (h, g)))
                .collect();
            let removed = pool.evict_blocks(&evict).unwrap();
            let mut seen = std::collections::BTreeSet::new();
            let want: Vec<(BlockHash, u32)> = evict
                .iter()
                .filter_map(|&b| u32::try_from(b).ok())
                .filter(|&b| seen.insert(b))
                .filter_map(|b| cached_before.get(&b).copied())
                .collect();
            assert_eq!(removed, want, "{ctx}: removed keys");
        }
        "reset_prefix_cache" => {
            assert_eq!(
                pool.reset_prefix_cache(),
                op["result"].as_bool().unwrap(),
                "{ctx}: result"
            );
        }
        other => panic!("{ctx}: unknown op {other}"),
    }
}

#[test]
fn replays_every_block_pool_case() {
    let cases = golden("block_pool.jsonl");
    assert_eq!(cases.len(), 80, "the golden file has 80 cases");
    let mut ops = 0;
    for (i, case) in cases.iter().enumerate() {
        let mut pool = BlockPool::new(
            case["num_blocks"].as_i64().unwrap(),
            case["enable_caching"].as_bool().unwrap(),
        )
        .unwrap();
        pool.check_invariants().unwrap();
        assert_eq!(
            pool.free_block_ids(),
            (1..pool.num_blocks()).collect::<Vec<_>>()
        );
        for (j, op) in case["ops"].as_array().unwrap().iter().enumerate() {
            let ctx = format!("case {} op {j} ({})", i + 1, op["op"]);
            apply(&mut pool, op, &ctx);
            check_state(&pool, &op["state"], &ctx);
            ops += 1;
        }
    }
    assert!(ops > 2500, "replayed {ops} ops");
}

/// Hostile calls against every golden state: each must fail with the catalogue
/// error and leave the pool exactly as it was.
#[test]
fn hostile_calls_change_nothing_on_golden_states() {
    let h = BlockHash::new(&[1; 32]).unwrap();
    for case in golden("block_pool.jsonl").iter().take(20) {
        let mut pool = BlockPool::new(
            case["num_blocks"].as_i64().unwrap(),
            case["enable_caching"].as_bool().unwrap(),
        )
        .unwrap();
        for op in case["ops"].as_array().unwrap() {
            apply(&mut pool, op, "hostile replay");
            let before = snapshot(&pool);
            let n = i64::from(pool.num_blocks());
            let unknown = Error::UnknownBlock {
                block_id: n,
                num_blocks: usize::try_from(n).unwrap(),
            };
            assert_eq!(pool.free_blocks(&[1, n]), Err(unknown.clone()));
            assert_eq!(
                pool.touch(&[-1]).unwrap_err().to_string(),
                format!("block id -1 is out of range for a pool of {n} blocks")
            );
            assert_eq!(pool.evict_blocks(&[0, n]), Err(unknown));
            assert_eq!(
                pool.get_new_blocks(-2),
                Err(Error::Negative {
                    name: "n",
                    value: -2
                })
            );
            assert!(pool.block(n).is_err());
            // Freeing every block once more than it is held must fail on some block.
            let held: Vec<i64> = (1..n)
                .flat_map(|b| std::iter::repeat_n(b, pool.block(b).unwrap().ref_cnt as usize + 1))
                .collect();
            assert!(matches!(
                pool.free_blocks(&held),
                Err(Error::DoubleFree { .. })
            ));
            assert_eq!(
                pool.cache_full_blocks(&[1], &[h], 0, 2, 0),
                Err(Error::TooManyFullBlocks {
                    num_full_blocks: 2,
                    num_block_ids: 1
                })
            );
            // Ids in range even for a 2-block pool, so that only the hashes are short.
            assert_eq!(
                pool.cache_full_blocks(&[1, 1], &[h], 0, 2, 0),
                Err(Error::TooFewHashes { needed: 2, got: 1 })
            );
            assert_eq!(
                pool.cache_full_blocks(&[1], &[h], -1, 1, 0),
                Err(Error::Negative {
                    name: "num_cached_blocks",
                    value: -1
                })
            );
            if n > 2 {
                // The same block twice in the range: the second one would be hashed twice.
                let b = pool.free_block_ids().first().copied().map_or(1, i64::from);
                let r = pool.cache_full_blocks(&[b, b], &[h, h], 0, 2, 0);
                assert!(matches!(r, Err(Error::AlreadyHashed { .. })), "{r:?}");
            }
            assert_eq!(snapshot(&pool), before, "a failed call changed the pool");
            pool.check_invariants().unwrap();
        }
    }
}

#[test]
fn error_messages_match_the_catalogue() {
    let mut pool = BlockPool::new(4, true).unwrap();
    assert_eq!(
        BlockPool::new(0, true).unwrap_err().to_string(),
        "num_blocks must be positive, got 0"
    );
    assert_eq!(
        pool.get_new_blocks(5).unwrap_err().to_string(),
        "Cannot get 5 free blocks from the pool (3 free)"
    );
    assert_eq!(
        pool.free_blocks(&[2]).unwrap_err().to_string(),
        "block 2 is already free (ref count 0)"
    );
    let got = pool.get_new_blocks(1).unwrap();
    assert_eq!(got, [1]);
    assert_eq!(
        pool.free_blocks(&[1, 1]).unwrap_err().to_string(),
        "block 1 is already free (ref count 0)"
    );
    let h = BlockHash::new(&[3; 32]).unwrap();
    pool.cache_full_blocks(&[1], &[h], 0, 1, 0).unwrap();
    assert_eq!(
        pool.cache_full_blocks(&[1], &[h], 0, 1, 0)
            .unwrap_err()
            .to_string(),
        "block 1 already has a hash"
    );
    assert_eq!(
        pool.cache_full_blocks(&[1], &[], 0, 1, 0)
            .unwrap_err()
            .to_string(),
        "need 1 block hashes, got 0"
    );
    assert_eq!(
        pool.cache_full_blocks(&[1], &[h, h], 0, 2, 0)
            .unwrap_err()
            .to_string(),
        "num_full_blocks 2 exceeds the 1 block ids given"
    );
    // Callers that convert hashes lazily: every check runs before the hashes are asked
    // for, and only the range to cache is asked for.
    let g = BlockHash::new(&[4; 32]).unwrap();
    let unasked = |_: std::ops::Range<usize>| -> kvblocks_core::Result<Vec<BlockHash>> {
        panic!("hashes asked for before the checks passed")
    };
    assert_eq!(
        pool.cache_full_blocks_with(&[1], 2, 1, 2, 0, unasked)
            .unwrap_err()
            .to_string(),
        "num_full_blocks 2 exceeds the 1 block ids given"
    );
    assert_eq!(
        pool.cache_full_blocks_with(&[1, 9], 2, 1, 2, 0, unasked)
            .unwrap_err()
            .to_string(),
        "block id 9 is out of range for a pool of 4 blocks"
    );
    assert_eq!(
        pool.cache_full_blocks_with(&[1, 2], 2, 1, 2, 1 << 32, unasked)
            .unwrap_err()
            .to_string(),
        "kv_cache_group_id must be at most 4294967295, got 4294967296"
    );
    let mut asked = None;
    assert_eq!(
        pool.cache_full_blocks_with(&[2, 1, 1], 3, 1, 3, 0, |range| {
            asked = Some(range);
            Ok(vec![g, g])
        })
        .unwrap_err()
        .to_string(),
        "block 1 already has a hash"
    );
    assert_eq!(asked, Some(1..3));
    assert_eq!(
        pool.num_cached_keys(),
        1,
        "a failed cache_full_blocks_with changes nothing"
    );
    assert_eq!(
        pool.block(7).unwrap_err().to_string(),
        "block id 7 is out of range for a pool of 4 blocks"
    );
    assert!(!pool.reset_prefix_cache());
    // Null ids are skipped everywhere.
    pool.free_blocks(&[0, 1, 0]).unwrap();
    pool.touch(&[0]).unwrap();
    pool.cache_full_blocks(&[0], &[h], 0, 1, 0).unwrap();
    assert!(pool.evict_blocks(&[0]).unwrap().is_empty());
    let null = pool.block(0).unwrap();
    assert!(null.is_null && null.ref_cnt == 0 && null.block_hash.is_none());
    assert!(pool.reset_prefix_cache());
    assert!(pool.cached_blocks().is_empty());
    pool.check_invariants().unwrap();
    let tiny = BlockPool::new(1, true).unwrap();
    assert!(tiny.usage() == 0.0 && tiny.num_free_blocks() == 0);
    assert!(BlockPool::new(i64::MAX, true).is_err());
}
