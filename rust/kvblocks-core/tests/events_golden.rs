//! Replays every case of `tests/golden/events.jsonl` (vLLM 0.33.0 `KVCacheManager`
//! traces with KV cache events on) and checks, after every operation, the events the
//! manager recorded against the decoded events of the trace: kinds, int hashes,
//! parent hashes, token ids, block size and group. (The msgpack bytes are checked by
//! the Python tests, which build the msgspec structs.) Also covers the router-grade
//! `last_copy_removal` option and a hash source without tokens.

mod common;

use std::collections::BTreeMap;

use common::{golden, TestRequest};
use kvblocks_core::events::{hash_as_u64, EventLog, EventRecord};
use kvblocks_core::hashing::{BlockHasher, HashAlgo};
use kvblocks_core::manager::{KVCacheManager, SlotRequest};
use kvblocks_core::request::RequestView;
use kvblocks_core::{BlockHash, Error};
use serde_json::{json, Value};

/// The recorded events in the trace's decoded form (the fields the core knows).
fn decoded(log: &EventLog, block_size: usize) -> Vec<Value> {
    log.records()
        .iter()
        .map(|r| match r {
            EventRecord::Stored(s) => json!({
                "type": "BlockStored",
                "block_hashes": log.stored_hashes(s).iter().map(hash_as_u64).collect::<Vec<_>>(),
                "parent_block_hash": s.parent.as_ref().map(hash_as_u64),
                "token_ids": log.stored_tokens(s),
                "block_size": block_size,
                "group_idx": s.group,
            }),
            EventRecord::Removed { hash, group } => json!({
                "type": "BlockRemoved",
                "block_hashes": [hash_as_u64(hash)],
                "group_idx": group,
            }),
            EventRecord::AllCleared => json!({"type": "AllBlocksCleared"}),
        })
        .collect()
}

/// The trace's events reduced to the same fields.
fn expected(op: &Value) -> Vec<Value> {
    op["events_decoded"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let keep: &[&str] = match e["type"].as_str().unwrap() {
                "BlockStored" => &[
                    "type",
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "group_idx",
                ],
                "BlockRemoved" => &["type", "block_hashes", "group_idx"],
                _ => &["type"],
            };
            Value::Object(keep.iter().map(|&k| (k.to_owned(), e[k].clone())).collect())
        })
        .collect()
}

fn ids(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

/// The iteration order of Python's `set(ids)` for at most 4 distinct small
/// non-negative ints: an 8-slot table, slot `id & 7`, perturbed probing on collision.
fn python_set_order(ids: &[i64]) -> Vec<i64> {
    const MASK: usize = 7;
    let mut table = [None; MASK + 1];
    for &id in ids {
        if table.contains(&Some(id)) {
            continue;
        }
        assert!(table.iter().flatten().count() < 4, "set too large to model");
        let mut perturb = usize::try_from(id).unwrap();
        let mut i = perturb & MASK;
        while table[i].is_some() {
            perturb >>= 5;
            i = (i * 5 + 1 + perturb) & MASK;
        }
        table[i] = Some(id);
    }
    table.iter().flatten().copied().collect()
}

fn apply(
    mgr: &mut KVCacheManager,
    live: &mut BTreeMap<String, TestRequest>,
    hasher: &BlockHasher,
    op: &Value,
    ctx: &str,
) {
    match op["op"].as_str().unwrap() {
        "add" => {
            let id = op["req_id"].as_str().unwrap();
            let mut req = TestRequest::new(id, &ids(&op["token_ids"]), hasher);
            let (hits, hit_tokens) = mgr.get_computed_blocks(&req.view()).unwrap();
            let hit_tokens = i64::try_from(hit_tokens).unwrap();
            let hit_ids: Vec<i64> = hits.iter().map(|&b| i64::from(b)).collect();
            let args = SlotRequest {
                num_new_tokens: req.view().num_tokens - hit_tokens,
                num_new_computed_tokens: hit_tokens,
                new_computed_blocks: &hit_ids,
                ..SlotRequest::default()
            };
            let got = mgr.allocate_slots(&req.view(), &args).unwrap();
            assert_eq!(
                got.is_some(),
                !op["allocated"].is_null(),
                "{ctx}: allocated"
            );
            if got.is_some() {
                req.num_computed = req.view().num_tokens;
                live.insert(id.to_owned(), req);
            }
        }
        "decode" => {
            let req = live.get_mut(op["req_id"].as_str().unwrap()).unwrap();
            req.append(&[op["token_id"].as_i64().unwrap()], hasher);
            let args = SlotRequest {
                num_new_tokens: 1,
                ..SlotRequest::default()
            };
            let got = mgr.allocate_slots(&req.view(), &args).unwrap();
            assert_eq!(
                got.is_some(),
                !op["allocated"].is_null(),
                "{ctx}: allocated"
            );
            if got.is_some() {
                req.num_computed += 1;
            }
        }
        "free" => {
            let id = op["req_id"].as_str().unwrap();
            mgr.free(id).unwrap();
            live.remove(id);
        }
        "evict_blocks" => {
            // vLLM takes a `set` and removes in its iteration order.
            mgr.evict_blocks(&python_set_order(&ids(&op["ids"])))
                .unwrap();
        }
        "reset_prefix_cache" => {
            assert_eq!(
                mgr.reset_prefix_cache(),
                op["result"].as_bool().unwrap(),
                "{ctx}"
            );
        }
        other => panic!("{ctx}: unknown op {other}"),
    }
}

fn new_manager(case: &Value, last_copy_removal: bool) -> (KVCacheManager, BlockHasher) {
    let bs = case["block_size"].as_i64().unwrap();
    let algo = HashAlgo::from_name(case["hash_algo"].as_str().unwrap()).unwrap();
    let hasher = BlockHasher::new(bs, algo, case["seed"].as_str().unwrap()).unwrap();
    let mut mgr =
        KVCacheManager::new(case["num_blocks"].as_i64().unwrap(), bs, true, None, false).unwrap();
    mgr.enable_kv_cache_events(last_copy_removal);
    (mgr, hasher)
}

#[test]
fn replays_every_events_case() {
    let cases = golden("events.jsonl");
    assert_eq!(cases.len(), 40);
    let mut num_events = 0;
    for (ci, case) in cases.iter().enumerate() {
        let (mut mgr, hasher) = new_manager(case, false);
        let bs = mgr.block_size();
        let mut live = BTreeMap::new();
        for (j, op) in case["ops"].as_array().unwrap().iter().enumerate() {
            let ctx = format!("case {} op {j} ({})", ci + 1, op["op"]);
            apply(&mut mgr, &mut live, &hasher, op, &ctx);
            assert_eq!(decoded(mgr.events(), bs), expected(op), "{ctx}");
            num_events += mgr.events().len();
            mgr.clear_events();
            mgr.check_invariants().unwrap();
        }
    }
    assert!(num_events > 250, "{num_events} events");
}

/// With `last_copy_removal`, the removals are exactly those of vLLM's stream whose
/// (hash, group) no other block still caches: replaying each case, a multiset of the
/// cached hashes built from vLLM's events must drop to zero exactly at the removals
/// kept.
#[test]
fn last_copy_removal_keeps_only_removals_of_the_last_copy() {
    let mut suppressed = 0;
    for (ci, case) in golden("events.jsonl").iter().enumerate() {
        let (mut mgr, hasher) = new_manager(case, true);
        let bs = mgr.block_size();
        let mut live = BTreeMap::new();
        let mut copies: BTreeMap<u64, usize> = BTreeMap::new();
        for (j, op) in case["ops"].as_array().unwrap().iter().enumerate() {
            let ctx = format!("case {} op {j}", ci + 1);
            apply(&mut mgr, &mut live, &hasher, op, &ctx);
            let mut want = Vec::new();
            for e in expected(op) {
                match e["type"].as_str().unwrap() {
                    "BlockStored" => {
                        for h in e["block_hashes"].as_array().unwrap() {
                            *copies.entry(h.as_u64().unwrap()).or_default() += 1;
                        }
                        want.push(e);
                    }
                    "BlockRemoved" => {
                        let h = e["block_hashes"][0].as_u64().unwrap();
                        let n = copies.get_mut(&h).unwrap();
                        *n -= 1;
                        if *n == 0 {
                            copies.remove(&h);
                            want.push(e);
                        } else {
                            suppressed += 1;
                        }
                    }
                    _ => {
                        copies.clear();
                        want.push(e);
                    }
                }
            }
            assert_eq!(decoded(mgr.events(), bs), want, "{ctx}");
            mgr.clear_events();
        }
    }
    assert!(suppressed > 0, "the traces evict duplicates");
}

/// Events off: nothing is recorded. Events on with a hash source that has no token
/// ids: caching is refused before anything changes.
#[test]
fn events_need_tokens_and_cost_nothing_when_off() {
    let hashes: Vec<BlockHash> = (0..3u8)
        .map(|i| BlockHash::new(&[i; 32]).unwrap())
        .collect();
    let view = RequestView {
        request_id: "r",
        num_tokens: 13,
        num_computed_tokens: 0,
        block_hashes: &hashes[..],
    };
    let args = SlotRequest {
        num_new_tokens: 13,
        ..SlotRequest::default()
    };
    let mut off = KVCacheManager::new(8, 4, true, None, false).unwrap();
    assert_eq!(
        off.allocate_slots(&view, &args).unwrap(),
        Some(vec![1, 2, 3, 4])
    );
    off.free("r").unwrap();
    assert!(off.reset_prefix_cache());
    assert!(off.events().is_empty());
    assert_eq!(off.events().config(), None);

    let mut on = KVCacheManager::new(8, 4, true, None, false).unwrap();
    on.enable_kv_cache_events(false);
    let before = on.block_pool().free_block_ids();
    assert_eq!(
        on.allocate_slots(&view, &args),
        Err(Error::InvalidArgument(
            "KV cache events need the token ids of request r".to_owned()
        ))
    );
    assert_eq!(on.block_pool().free_block_ids(), before);
    assert_eq!(on.num_requests(), 0);
    assert!(on.events().is_empty());
    assert!(on.reset_prefix_cache());
    assert_eq!(on.events().records(), [EventRecord::AllCleared]);
}
