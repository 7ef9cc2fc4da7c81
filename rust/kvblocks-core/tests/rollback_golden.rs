//! Replays vLLM 0.33.0's golden vectors (`tests/golden/rollback.jsonl` and
//! `handle_invalid.jsonl`, format in `tests/golden/FORMAT.md`) through the core.
//!
//! Every case must match exactly; a mismatch names the file line.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::PathBuf;

use kvblocks_core::rollback::Tolerance;
use kvblocks_core::rollback::{
    check_single_group, handle_invalid_blocks, rollback_invalid_blocks, Batch, BlockIds, Mode,
    Policy, Rollback, MULTIPLE_GROUPS_MESSAGE,
};
use kvblocks_core::{Error, ErrorKind};
use serde_json::Value;

/// The cases of `tests/golden/<name>.jsonl`, with their 1-based line numbers.
fn golden(name: &str) -> Vec<(usize, Value)> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/golden")
        .join(format!("{name}.jsonl"));
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let cases: Vec<(usize, Value)> = text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            let case =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("{name}:{}: {e}", i + 1));
            (i + 1, case)
        })
        .collect();
    assert!(!cases.is_empty(), "{name}.jsonl has no cases");
    cases
}

fn int(v: &Value) -> i64 {
    v.as_i64().unwrap_or_else(|| panic!("not an integer: {v}"))
}

fn ints(v: &Value) -> Vec<i64> {
    v.as_array().expect("array").iter().map(int).collect()
}

fn strs(v: &Value) -> BTreeSet<String> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|s| s.as_str().expect("string").to_owned())
        .collect()
}

/// One request of a case.
struct Req {
    id: String,
    block_ids: Vec<i64>,
    num_computed_tokens: i64,
    state: String,
}

fn requests(case: &Value) -> Vec<Req> {
    case["requests"]
        .as_array()
        .expect("requests")
        .iter()
        .map(|r| Req {
            id: r["req_id"].as_str().expect("req_id").to_owned(),
            block_ids: ints(&r["block_ids"]),
            num_computed_tokens: int(&r["num_computed_tokens"]),
            state: r["state"].as_str().unwrap_or("running").to_owned(),
        })
        .collect()
}

/// Columns of `reqs`: computed counts and this step's scheduled tokens (0 if absent).
fn columns(case: &Value, reqs: &[&Req]) -> (Vec<i64>, Vec<i64>) {
    let scheduled = &case["num_scheduled_tokens"];
    (
        reqs.iter().map(|r| r.num_computed_tokens).collect(),
        reqs.iter()
            .map(|r| scheduled.get(&r.id).map_or(0, int))
            .collect(),
    )
}

fn expected_counts(expect: &Value) -> BTreeMap<String, i64> {
    expect["num_computed_tokens"]
        .as_object()
        .expect("num_computed_tokens")
        .iter()
        .map(|(k, v)| (k.clone(), int(v)))
        .collect()
}

fn ids_of(reqs: &[&Req], indices: &[usize]) -> BTreeSet<String> {
    indices.iter().map(|&i| reqs[i].id.clone()).collect()
}

/// The block tables of `reqs` converted to another id type (every golden id fits).
fn converted<T: TryFrom<i64>>(reqs: &[&Req]) -> Vec<Vec<T>> {
    reqs.iter()
        .map(|r| {
            r.block_ids
                .iter()
                .map(|&b| T::try_from(b).unwrap_or_else(|_| panic!("id {b} does not fit")))
                .collect()
        })
        .collect()
}

/// Whether `got` is exactly what the case expects.
fn matches_rollback_case(reqs: &[&Req], expect: &Value, got: &Rollback) -> bool {
    let counts: BTreeMap<String, i64> = reqs
        .iter()
        .zip(&got.num_computed_tokens)
        .map(|(r, &n)| (r.id.clone(), n))
        .collect();
    let mut expected_evict = ints(&expect["blocks_to_evict"]);
    expected_evict.sort_unstable();
    ids_of(reqs, &got.affected) == strs(&expect["affected_req_ids"])
        && got.affected.windows(2).all(|w| w[0] < w[1])
        && i128::try_from(got.total_affected_tokens).ok()
            == Some(i128::from(int(&expect["total_affected_tokens"])))
        && got.blocks_to_evict == expected_evict
        && counts == expected_counts(expect)
}

#[test]
fn rollback_golden_vectors_replay_exactly_for_every_table_type() {
    let mut failures = Vec::new();
    for (line, case) in golden("rollback") {
        let owned = requests(&case);
        let reqs: Vec<&Req> = owned.iter().collect();
        let (computed, scheduled) = columns(&case, &reqs);
        let invalid = ints(&case["invalid_block_ids"]);
        let block_size = int(&case["block_size"]);
        let collect = case["evict_blocks"].as_bool().expect("evict_blocks");
        let replay = |tables: &[BlockIds<'_>]| {
            rollback_invalid_blocks(
                batch(tables, &computed, &scheduled),
                &invalid,
                block_size,
                collect,
                Mode::Vllm,
                Tolerance::Strict,
            )
            .unwrap_or_else(|e| panic!("rollback.jsonl:{line}: {e}"))
        };

        let wide: Vec<Vec<i64>> = converted(&reqs);
        let narrow: Vec<Vec<i32>> = converted(&reqs);
        let unsigned: Vec<Vec<u32>> = converted(&reqs);
        let kinds: [(&str, Vec<BlockIds<'_>>); 4] = [
            ("i64", wide.iter().map(|t| BlockIds::I64(t)).collect()),
            ("i32", narrow.iter().map(|t| BlockIds::I32(t)).collect()),
            ("u32", unsigned.iter().map(|t| BlockIds::U32(t)).collect()),
            // A batch mixing integer types, as a binding given heterogeneous arrays builds.
            (
                "mixed",
                (0..reqs.len())
                    .map(|i| match i % 3 {
                        0 => BlockIds::I64(&wide[i]),
                        1 => BlockIds::I32(&narrow[i]),
                        _ => BlockIds::U32(&unsigned[i]),
                    })
                    .collect(),
            ),
        ];
        for (kind, tables) in &kinds {
            let got = replay(tables);
            if !matches_rollback_case(&reqs, &case["expect"], &got) {
                failures.push(format!(
                    "rollback.jsonl:{line} ({kind} tables): got {got:?}"
                ));
            }
        }
        // Plain slices and Vecs go through the same generic entry point.
        let slices: Vec<&[i64]> = reqs.iter().map(|r| r.block_ids.as_slice()).collect();
        let direct = rollback_invalid_blocks(
            batch(&slices, &computed, &scheduled),
            &invalid,
            block_size,
            collect,
            Mode::Vllm,
            Tolerance::Strict,
        );
        assert_eq!(
            direct.as_ref().ok(),
            Some(&replay(&kinds[0].1)),
            "rollback.jsonl:{line}"
        );
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn batch<'a, B>(tables: &'a [B], computed: &'a [i64], scheduled: &'a [i64]) -> Batch<'a, B> {
    Batch {
        block_tables: tables,
        num_computed_tokens: computed,
        num_scheduled_tokens: scheduled,
    }
}

#[test]
#[allow(clippy::too_many_lines)] // one case's whole replay: inputs, the call, every output
fn handle_invalid_golden_vectors_replay_exactly() {
    let mut failures = Vec::new();
    let mut errors_seen = 0;
    for (line, case) in golden("handle_invalid") {
        let owned = requests(&case);
        let waiting: Vec<&Req> = owned
            .iter()
            .filter(|r| r.state == "waiting_for_remote_kvs")
            .collect();
        let running: Vec<&Req> = owned.iter().filter(|r| r.state == "running").collect();
        let (w_computed, w_scheduled) = columns(&case, &waiting);
        let (r_computed, r_scheduled) = columns(&case, &running);
        let w_tables: Vec<&[i64]> = waiting.iter().map(|r| r.block_ids.as_slice()).collect();
        let r_tables: Vec<Vec<u32>> = running
            .iter()
            .map(|r| {
                r.block_ids
                    .iter()
                    .map(|&b| u32::try_from(b).expect("u32"))
                    .collect()
            })
            .collect();
        let policy =
            Policy::from_name(case["policy"].as_str().expect("policy")).expect("known policy");
        let expect = &case["expect"];
        // The group count is checked first, before anything else is read.
        let result = check_single_group(int(&case["num_kv_cache_groups"])).and_then(|()| {
            handle_invalid_blocks(
                batch(&w_tables, &w_computed, &w_scheduled),
                batch(&r_tables, &r_computed, &r_scheduled),
                &ints(&case["invalid_block_ids"]),
                int(&case["block_size"]),
                policy,
                Mode::Vllm,
                Tolerance::Strict,
            )
        });
        if let Some(error) = expect.get("error") {
            assert_eq!(error, "RuntimeError", "handle_invalid.jsonl:{line}");
            errors_seen += 1;
            match result {
                Err(e @ Error::UnsupportedLayout(_)) => {
                    assert_eq!(e.kind(), ErrorKind::UnsupportedLayout);
                    assert_eq!(e.to_string(), MULTIPLE_GROUPS_MESSAGE);
                }
                other => failures.push(format!(
                    "handle_invalid.jsonl:{line}: expected the multi-group error, got {other:?}"
                )),
            }
            continue;
        }
        let out = result.unwrap_or_else(|e| panic!("handle_invalid.jsonl:{line}: {e}"));

        let returned: BTreeSet<String> = match policy {
            Policy::Fail => ids_of(&waiting, out.failed_waiting())
                .union(&ids_of(&running, out.failed_running()))
                .cloned()
                .collect(),
            Policy::Recompute => ids_of(&running, out.rescheduled_running()),
        };
        let mut counts: BTreeMap<String, i64> = owned
            .iter()
            .map(|r| (r.id.clone(), r.num_computed_tokens))
            .collect();
        for (reqs, pass) in [(&waiting, &out.waiting), (&running, &out.running)] {
            for &i in &pass.affected {
                counts.insert(reqs[i].id.clone(), pass.num_computed_tokens[i]);
            }
        }
        let expected_evicted: BTreeSet<i64> =
            ints(&expect["evicted_block_ids"]).into_iter().collect();
        let evict_calls = i64::from(!out.evicted_block_ids().is_empty());
        let ok = returned == strs(&expect["returned_req_ids"])
            && out
                .evicted_block_ids()
                .iter()
                .copied()
                .collect::<BTreeSet<_>>()
                == expected_evicted
            && out.evicted_block_ids().windows(2).all(|w| w[0] < w[1])
            && evict_calls == int(&expect["evict_calls"])
            && ids_of(&waiting, out.retry_waiting()) == strs(&expect["failed_recving_req_ids"])
            && out.waiting.blocks_to_evict.is_empty()
            && counts == expected_counts(expect)
            && out.total_affected_tokens()
                == out.waiting.total_affected_tokens + out.running.total_affected_tokens;
        let policy_lists_ok = match policy {
            Policy::Fail => out.rescheduled_running().is_empty() && out.retry_waiting().is_empty(),
            Policy::Recompute => {
                out.failed_waiting().is_empty()
                    && out.failed_running().is_empty()
                    && out.evicted_block_ids().is_empty()
            }
        };
        if !(ok && policy_lists_ok) {
            failures.push(format!("handle_invalid.jsonl:{line}: got {out:?}"));
        }
    }
    assert!(errors_seen > 0, "the multi-group error cases are missing");
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn handle_invalid_golden_vectors_agree_with_two_rollback_passes() {
    // The same cases through the batch primitive: async pass without evictions, sync pass
    // with, each with its own marked set.
    for (line, case) in golden("handle_invalid") {
        if case["expect"].get("error").is_some() {
            continue;
        }
        let owned = requests(&case);
        let invalid = ints(&case["invalid_block_ids"]);
        let block_size = int(&case["block_size"]);
        let mut counts: BTreeMap<String, i64> = owned
            .iter()
            .map(|r| (r.id.clone(), r.num_computed_tokens))
            .collect();
        for (state, collect) in [("waiting_for_remote_kvs", false), ("running", true)] {
            let reqs: Vec<&Req> = owned.iter().filter(|r| r.state == state).collect();
            let (computed, scheduled) = columns(&case, &reqs);
            let tables: Vec<&[i64]> = reqs.iter().map(|r| r.block_ids.as_slice()).collect();
            let pass = rollback_invalid_blocks(
                batch(&tables, &computed, &scheduled),
                &invalid,
                block_size,
                collect,
                Mode::Vllm,
                Tolerance::Strict,
            )
            .unwrap_or_else(|e| panic!("handle_invalid.jsonl:{line}: {e}"));
            for &i in &pass.affected {
                counts.insert(reqs[i].id.clone(), pass.num_computed_tokens[i]);
            }
        }
        assert_eq!(
            counts,
            expected_counts(&case["expect"]),
            "handle_invalid.jsonl:{line}"
        );
    }
}
