//! Properties of `kvblocks_core::rollback` on random batches:
//! * `Mode::Vllm` equals a line-by-line transliteration of vLLM 0.33.0's loop;
//! * `Mode::Strict` keeps no invalid block within any request's pre-step computed tokens;
//! * counts are never negative, errors are exactly the documented ones, nothing panics;
//! * `handle_invalid_blocks` is the two passes plus the policy.
//!
//! Timings are in `examples/timing_rollback.rs`, not here.

use std::collections::HashSet;

use kvblocks_core::rollback::Tolerance;
use kvblocks_core::rollback::{
    check_single_group, handle_failed_recving, handle_invalid_blocks, rollback_invalid_blocks,
    Batch, Mode, Pass, Policy, Rollback, RollbackTarget, MULTIPLE_GROUPS_MESSAGE,
};
use kvblocks_core::Error;
use proptest::prelude::*;

mod common;
use common::{as_i32, as_u32};

/// A valid random batch: small id range so requests share blocks and ids repeat.
#[derive(Debug, Clone)]
struct Case {
    tables: Vec<Vec<i64>>,
    computed: Vec<i64>,
    scheduled: Vec<i64>,
    invalid: Vec<i64>,
    block_size: i64,
    collect: bool,
}

fn case() -> impl Strategy<Value = Case> {
    (1_i64..=4, 0_usize..=8, any::<bool>()).prop_flat_map(|(block_size, n, collect)| {
        let request = (
            prop::collection::vec(0_i64..12, 0..=7),
            0_i64..=1,
            0_i64..=9,
        )
            .prop_flat_map(move |(table, fill, scheduled)| {
                let max_before = i64::try_from(table.len()).unwrap_or(0) * block_size;
                // Bias half the requests to a full pre-step range (more blocks scanned).
                let before = if fill == 1 {
                    Just(max_before).boxed()
                } else {
                    (0..=max_before).boxed()
                };
                (Just(table), before, Just(scheduled))
            });
        (
            prop::collection::vec(request, n),
            prop::collection::vec(0_i64..14, 0..=5),
        )
            .prop_map(move |(reqs, invalid)| Case {
                tables: reqs.iter().map(|(t, _, _)| t.clone()).collect(),
                computed: reqs.iter().map(|&(_, b, s)| b + s).collect(),
                scheduled: reqs.iter().map(|&(_, _, s)| s).collect(),
                invalid,
                block_size,
                collect,
            })
    })
}

impl Case {
    fn run<B: kvblocks_core::rollback::BlockTable>(&self, tables: &[B], mode: Mode) -> Rollback {
        let batch = Batch {
            block_tables: tables,
            num_computed_tokens: &self.computed,
            num_scheduled_tokens: &self.scheduled,
        };
        rollback_invalid_blocks(
            batch,
            &self.invalid,
            self.block_size,
            self.collect,
            mode,
            Tolerance::Strict,
        )
        .unwrap_or_else(|e| panic!("valid case refused: {e}"))
    }
}

/// vLLM 0.33.0's `_update_requests_with_invalid_blocks`, transliterated with a `HashSet`
/// (zip truncation included). Returns `(num_computed, affected, total, blocks_to_evict)`.
fn vllm_reference(c: &Case) -> (Vec<i64>, Vec<usize>, i128, Vec<i64>) {
    let invalid: HashSet<i64> = c.invalid.iter().copied().collect();
    let mut marked: HashSet<i64> = HashSet::new();
    let mut computed = c.computed.clone();
    let mut affected = Vec::new();
    let mut total: i128 = 0;
    let mut evict: HashSet<i64> = HashSet::new();
    for (i, req_block_ids) in c.tables.iter().enumerate() {
        let mut is_affected = false;
        let mut marked_invalid_block = false;
        let req_num_computed_tokens = computed[i] - c.scheduled[i];
        let req_num_computed_blocks = (req_num_computed_tokens + c.block_size - 1) / c.block_size;
        let blocks = usize::try_from(req_num_computed_blocks).unwrap_or(0);
        for (idx, &block_id) in req_block_ids.iter().enumerate().take(blocks) {
            if !invalid.contains(&block_id) {
                continue;
            }
            is_affected = true;
            if marked.contains(&block_id) {
                continue;
            }
            marked.insert(block_id);
            if marked_invalid_block {
                continue;
            }
            marked_invalid_block = true;
            computed[i] = i64::try_from(idx).unwrap_or(0) * c.block_size;
            total += i128::from(req_num_computed_tokens - computed[i]);
            if c.collect {
                evict.extend(&req_block_ids[idx..]);
            }
        }
        if is_affected {
            if !marked_invalid_block {
                total += i128::from(computed[i] - req_num_computed_tokens);
                computed[i] = req_num_computed_tokens;
            }
            affected.push(i);
        }
    }
    let mut evict: Vec<i64> = evict.into_iter().collect();
    evict.sort_unstable();
    (computed, affected, total, evict)
}

fn cdiv(a: i64, b: i64) -> usize {
    usize::try_from((a + b - 1) / b).unwrap_or(0)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn vllm_mode_equals_the_transliterated_loop(c in case()) {
        let (computed, affected, total, evict) = vllm_reference(&c);
        let got = c.run(&c.tables, Mode::Vllm);
        prop_assert_eq!(&got.num_computed_tokens, &computed);
        prop_assert_eq!(&got.affected, &affected);
        prop_assert_eq!(i128::try_from(got.total_affected_tokens).ok(), Some(total));
        prop_assert_eq!(&got.blocks_to_evict, &evict);
        // The integer type of the tables changes nothing.
        prop_assert_eq!(&c.run(&as_i32(&c.tables), Mode::Vllm), &got);
        prop_assert_eq!(&c.run(&as_u32(&c.tables), Mode::Vllm), &got);
    }

    #[test]
    fn renaming_ids_changes_nothing_but_the_names(c in case(), strict in any::<bool>()) {
        // Increasing renamings that force the other membership paths: every id aliasing
        // onto one filter bit (each "maybe" confirmed against the exact set), and ids
        // far past the bitset limit (the hash set).
        let mode = if strict { Mode::Strict } else { Mode::Vllm };
        let plain = c.run(&c.tables, mode);
        for rename in [|id: i64| id << 24, |id: i64| id + (1 << 40)] {
            let renamed = Case {
                tables: c.tables.iter().map(|t| t.iter().map(|&b| rename(b)).collect()).collect(),
                invalid: c.invalid.iter().map(|&b| rename(b)).collect(),
                ..c.clone()
            };
            let got = renamed.run(&renamed.tables, mode);
            let expected = Rollback {
                blocks_to_evict: plain.blocks_to_evict.iter().map(|&b| rename(b)).collect(),
                ..plain.clone()
            };
            prop_assert_eq!(got, expected);
        }
    }

    #[test]
    fn strict_mode_leaves_no_invalid_block_in_pre_step_tokens(c in case()) {
        let strict = c.run(&c.tables, Mode::Strict);
        let vllm = c.run(&c.tables, Mode::Vllm);
        let invalid: HashSet<i64> = c.invalid.iter().copied().collect();
        let mut expected_evict: HashSet<i64> = HashSet::new();
        let mut total: i128 = 0;
        for (i, table) in c.tables.iter().enumerate() {
            let before = c.computed[i] - c.scheduled[i];
            let new = strict.num_computed_tokens[i];
            let kept = new.min(before);
            // The guarantee.
            for &block_id in &table[..cdiv(kept, c.block_size)] {
                prop_assert!(!invalid.contains(&block_id), "request {} keeps invalid block {}", i, block_id);
            }
            let first = table[..cdiv(before, c.block_size)].iter().position(|b| invalid.contains(b));
            if let Some(idx) = first {
                // Truncated at its own first invalid block, tail collected.
                prop_assert_eq!(new, i64::try_from(idx).unwrap_or(0) * c.block_size);
                total += i128::from(before - new);
                if c.collect {
                    expected_evict.extend(&table[idx..]);
                }
            } else {
                prop_assert_eq!(new, c.computed[i]);
            }
            // Strict never keeps more than vLLM does.
            prop_assert!(new <= vllm.num_computed_tokens[i]);
        }
        // The same requests are affected in both modes: those with an invalid scanned block.
        prop_assert_eq!(&strict.affected, &vllm.affected);
        prop_assert_eq!(i128::try_from(strict.total_affected_tokens).ok(), Some(total));
        let mut expected_evict: Vec<i64> = expected_evict.into_iter().collect();
        expected_evict.sort_unstable();
        prop_assert_eq!(&strict.blocks_to_evict, &expected_evict);
    }

    #[test]
    fn counts_are_never_negative_nor_raised(c in case(), strict in any::<bool>()) {
        let mode = if strict { Mode::Strict } else { Mode::Vllm };
        let got = c.run(&c.tables, mode);
        let mut total: u128 = 0;
        for (i, &new) in got.num_computed_tokens.iter().enumerate() {
            prop_assert!(new >= 0);
            prop_assert!(new <= c.computed[i]);
            if got.affected.contains(&i) {
                // Block-aligned, or exactly the pre-step count (vLLM's revert).
                let before = c.computed[i] - c.scheduled[i];
                prop_assert!(new % c.block_size == 0 || new == before);
                total += u128::from((c.computed[i] - new).unsigned_abs());
            } else {
                prop_assert_eq!(new, c.computed[i]);
            }
        }
        // vLLM's total never exceeds what was actually rolled back.
        prop_assert!(got.total_affected_tokens <= total);
        prop_assert!(got.blocks_to_evict.iter().all(|&b| b >= 0));
        prop_assert!(got.blocks_to_evict.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn hostile_columns_get_the_first_documented_error_and_never_panic(
        tables in prop::collection::vec(prop::collection::vec(-2_i64..6, 0..4), 0..4),
        computed in prop::collection::vec(-2_i64..10, 0..4),
        scheduled in prop::collection::vec(-2_i64..10, 0..4),
        invalid in prop::collection::vec(-2_i64..6, 0..3),
        block_size in -1_i64..4,
    ) {
        let batch = Batch {
            block_tables: &tables,
            num_computed_tokens: &computed,
            num_scheduled_tokens: &scheduled,
        };
        let got = rollback_invalid_blocks(batch, &invalid, block_size, true, Mode::Vllm, Tolerance::Strict);
        prop_assert_eq!(got.err(), expected_error(&tables, &computed, &scheduled, &invalid, block_size));
    }

    #[test]
    fn handle_invalid_is_two_passes_and_the_policy(
        w in case(), r in case(), recompute in any::<bool>(), strict in any::<bool>(),
    ) {
        let mode = if strict { Mode::Strict } else { Mode::Vllm };
        let policy = if recompute { Policy::Recompute } else { Policy::Fail };
        let r = Case { block_size: w.block_size, invalid: w.invalid.clone(), ..r };
        // `r` was generated for its own block size: keep only requests it still fits.
        let fits = |i: usize| cdiv(r.computed[i] - r.scheduled[i], r.block_size) <= r.tables[i].len();
        let keep: Vec<usize> = (0..r.tables.len()).filter(|&i| fits(i)).collect();
        let r = Case {
            tables: keep.iter().map(|&i| r.tables[i].clone()).collect(),
            computed: keep.iter().map(|&i| r.computed[i]).collect(),
            scheduled: keep.iter().map(|&i| r.scheduled[i]).collect(),
            ..r
        };
        let out = handle_invalid_blocks(
            Batch { block_tables: &w.tables, num_computed_tokens: &w.computed, num_scheduled_tokens: &w.scheduled },
            Batch { block_tables: &as_u32(&r.tables), num_computed_tokens: &r.computed, num_scheduled_tokens: &r.scheduled },
            &w.invalid, w.block_size, policy, mode, Tolerance::Strict,
        ).unwrap_or_else(|e| panic!("valid case refused: {e}"));
        let waiting = Case { collect: false, ..w.clone() }.run(&w.tables, mode);
        // The running pass collects evictions only when the outcome has any.
        let running = Case { collect: !recompute || strict, ..r.clone() }.run(&r.tables, mode);
        prop_assert_eq!(out.total_affected_tokens(), waiting.total_affected_tokens + running.total_affected_tokens);
        prop_assert_eq!(&out.waiting, &waiting);
        prop_assert_eq!(&out.running, &running);
        if recompute {
            prop_assert_eq!(out.rescheduled_running(), &running.affected);
            prop_assert_eq!(out.retry_waiting(), &waiting.affected);
            prop_assert!(out.failed_running().is_empty() && out.failed_waiting().is_empty());
            // Strict mode evicts the rescheduled requests' tails; vLLM mode keeps them.
            if strict {
                prop_assert_eq!(out.evicted_block_ids(), &running.blocks_to_evict);
            } else {
                prop_assert!(out.evicted_block_ids().is_empty());
            }
        } else {
            prop_assert_eq!(out.failed_running(), &running.affected);
            prop_assert_eq!(out.failed_waiting(), &waiting.affected);
            prop_assert!(out.rescheduled_running().is_empty() && out.retry_waiting().is_empty());
            prop_assert_eq!(out.evicted_block_ids(), &running.blocks_to_evict);
        }
    }
}

/// The documented validation order of `rollback_invalid_blocks`, written out plainly.
fn expected_error(
    tables: &[Vec<i64>],
    computed: &[i64],
    scheduled: &[i64],
    invalid: &[i64],
    block_size: i64,
) -> Option<Error> {
    if block_size <= 0 {
        return Some(Error::NonPositive {
            name: "block_size",
            value: block_size,
        });
    }
    if tables.len() != computed.len() || tables.len() != scheduled.len() {
        return Some(Error::InvalidArgument(format!(
            "block_tables, num_computed_tokens and num_scheduled_tokens must have the same length, got {}, {} and {}",
            tables.len(),
            computed.len(),
            scheduled.len()
        )));
    }
    if let Some(&min) = invalid.iter().min().filter(|&&m| m < 0) {
        return Some(Error::Negative {
            name: "invalid_block_ids",
            value: min,
        });
    }
    for i in 0..tables.len() {
        let (c, s) = (computed[i], scheduled[i]);
        let message = if c < 0 {
            format!("num_computed_tokens[{i}] must be non-negative, got {c}")
        } else if s < 0 {
            format!("num_scheduled_tokens[{i}] must be non-negative, got {s}")
        } else if s > c {
            format!("num_scheduled_tokens[{i}] = {s} exceeds num_computed_tokens[{i}] = {c}")
        } else if tables[i].len() < cdiv(c - s, block_size) {
            format!(
                "block_tables[{i}] has {} blocks, fewer than the {} holding its {} tokens computed before this step",
                tables[i].len(),
                cdiv(c - s, block_size),
                c - s
            )
        } else {
            continue;
        };
        return Some(Error::InvalidArgument(message));
    }
    for (i, table) in tables.iter().enumerate() {
        if let Some((j, &b)) = table.iter().enumerate().find(|(_, &b)| b < 0) {
            return Some(Error::InvalidArgument(format!(
                "block_tables[{i}][{j}] must be non-negative, got {b}"
            )));
        }
    }
    None
}

#[test]
fn more_than_one_group_is_refused_with_vllms_message() {
    let err = check_single_group(2);
    assert!(
        matches!(&err, Err(Error::UnsupportedLayout(m)) if m == MULTIPLE_GROUPS_MESSAGE),
        "{err:?}"
    );
    // One group (or the default 0 some callers report) goes on.
    assert_eq!(check_single_group(1), Ok(()));
    assert_eq!(check_single_group(0), Ok(()));
}

#[test]
fn absurdly_large_ids_use_the_hash_set_and_stay_exact() {
    let big = 1_i64 << 40;
    let tables: [&[i64]; 3] = [&[big, 5, big + 1], &[7, big + 1, big + 2], &[1 << 26, 3]];
    let batch = Batch {
        block_tables: &tables,
        num_computed_tokens: &[3, 3, 2],
        num_scheduled_tokens: &[0, 0, 0],
    };
    let got = rollback_invalid_blocks(
        batch,
        &[big + 1, 1 << 26, 9],
        1,
        true,
        Mode::Vllm,
        Tolerance::Strict,
    );
    // Request 1's only scanned invalid block was marked by request 0: it reverts to its
    // pre-step count (3, nothing scheduled) and collects nothing.
    let expected = Rollback {
        num_computed_tokens: vec![2, 3, 0],
        affected: vec![0, 1, 2],
        total_affected_tokens: 1 + 2,
        blocks_to_evict: vec![3, 1 << 26, big + 1],
        eviction_tails: vec![(0, 2), (2, 0)],
    };
    assert_eq!(got, Ok(expected));
}

#[test]
fn a_deeper_shared_block_marked_after_truncation_does_not_truncate_later_requests() {
    // Request 0 truncates at block 10 and still marks block 20, so request 1,
    // whose only invalid block is 20, reverts instead of truncating; strict truncates it.
    let tables: [&[i64]; 2] = [&[1, 10, 20, 2], &[3, 20, 4]];
    let batch = Batch {
        block_tables: &tables,
        num_computed_tokens: &[8, 6],
        num_scheduled_tokens: &[2, 2],
    };
    let vllm = rollback_invalid_blocks(batch, &[10, 20], 2, true, Mode::Vllm, Tolerance::Strict);
    assert_eq!(
        vllm,
        Ok(Rollback {
            num_computed_tokens: vec![2, 4],
            affected: vec![0, 1],
            total_affected_tokens: 4 + 2,
            blocks_to_evict: vec![2, 10, 20],
            eviction_tails: vec![(0, 1)],
        })
    );
    // vLLM's set is built from each truncated request's tail, in request order.
    assert_eq!(
        vllm.as_ref().unwrap().eviction_sequence(&tables),
        [10, 20, 2]
    );
    let strict =
        rollback_invalid_blocks(batch, &[10, 20], 2, true, Mode::Strict, Tolerance::Strict);
    assert_eq!(
        strict,
        Ok(Rollback {
            num_computed_tokens: vec![2, 2],
            affected: vec![0, 1],
            total_affected_tokens: 4 + 2,
            blocks_to_evict: vec![2, 4, 10, 20],
            eviction_tails: vec![(0, 1), (1, 1)],
        })
    );
    assert_eq!(
        strict.unwrap().eviction_sequence(&tables),
        [10, 20, 2, 20, 4]
    );
}

/// A target recording every write, refusing evictions when told to.
#[derive(Default)]
struct Recorder {
    refuse_evictions: bool,
    log: Vec<String>,
}

impl RollbackTarget for Recorder {
    fn evict_blocks(&mut self, block_ids: &[i64]) -> Result<(), Error> {
        if self.refuse_evictions {
            return Err(Error::InvalidArgument("refused".to_owned()));
        }
        self.log.push(format!("evict {block_ids:?}"));
        Ok(())
    }

    fn set_num_computed_tokens(
        &mut self,
        pass: Pass,
        index: usize,
        value: i64,
    ) -> Result<(), Error> {
        self.log.push(format!("{pass:?}[{index}] = {value}"));
        Ok(())
    }
}

fn one_waiting_one_running(
    policy: Policy,
) -> (
    kvblocks_core::rollback::InvalidBlocksOutcome,
    Vec<&'static [i64]>,
) {
    let waiting: [&[i64]; 1] = [&[1, 2]];
    let running: Vec<&'static [i64]> = vec![&[3, 4, 5]];
    let out = handle_invalid_blocks(
        Batch {
            block_tables: &waiting,
            num_computed_tokens: &[8],
            num_scheduled_tokens: &[0],
        },
        Batch {
            block_tables: &running,
            num_computed_tokens: &[12],
            num_scheduled_tokens: &[0],
        },
        &[2, 4],
        4,
        policy,
        Mode::Vllm,
        Tolerance::Strict,
    )
    .unwrap();
    (out, running)
}

#[test]
fn apply_evicts_first_then_writes_waiting_then_running() {
    let (out, running) = one_waiting_one_running(Policy::Fail);
    let mut target = Recorder::default();
    let sequence = out.eviction_sequence(&running);
    assert_eq!(sequence, vec![4, 5]);
    out.apply(&sequence, &mut target).unwrap();
    assert_eq!(
        target.log,
        ["evict [4, 5]", "Waiting[0] = 4", "Running[0] = 4"]
    );
}

#[test]
fn a_refused_eviction_writes_no_request() {
    let (out, running) = one_waiting_one_running(Policy::Fail);
    let mut target = Recorder {
        refuse_evictions: true,
        ..Recorder::default()
    };
    assert!(out
        .apply(&out.eviction_sequence(&running), &mut target)
        .is_err());
    assert!(target.log.is_empty(), "{:?}", target.log);
}

#[test]
fn recompute_in_vllm_mode_evicts_nothing() {
    let (out, running) = one_waiting_one_running(Policy::Recompute);
    let mut target = Recorder::default();
    let sequence = out.eviction_sequence(&running);
    assert!(sequence.is_empty());
    out.apply(&sequence, &mut target).unwrap();
    assert_eq!(target.log, ["Waiting[0] = 4", "Running[0] = 4"]);
}

#[test]
fn failed_recving_matches_in_report_order_and_rewinds_under_recompute() {
    let mut target = Recorder::default();
    let mut reads = Vec::new();
    let out = handle_failed_recving(
        &["c", "x", "a", "c"],
        &["a", "b", "c"],
        Policy::Recompute,
        |i| {
            reads.push(i);
            Ok(10 * i64::try_from(i).unwrap() + 1)
        },
        &mut target,
    )
    .unwrap();
    // Report order, once each; unknown ids ignored; counts read for matched ones only.
    assert_eq!(out.matched, vec![2, 0]);
    assert_eq!(reads, vec![0, 2]);
    assert_eq!(out.total_affected_tokens, 1 + 21);
    assert_eq!(target.log, ["Waiting[0] = 0", "Waiting[2] = 0"]);
}

#[test]
fn failed_recving_under_fail_writes_nothing_and_refuses_negative_counts() {
    let mut target = Recorder::default();
    let out = handle_failed_recving(&["a"], &["a"], Policy::Fail, |_| Ok(3), &mut target).unwrap();
    assert_eq!((out.matched, out.total_affected_tokens), (vec![0], 3));
    assert!(target.log.is_empty());
    let err = handle_failed_recving(&["a"], &["a"], Policy::Recompute, |_| Ok(-1), &mut target);
    assert_eq!(
        err,
        Err(Error::Negative {
            name: "num_computed_tokens",
            value: -1
        })
    );
    assert!(target.log.is_empty(), "a refused call writes nothing");
    // Every count is read before any is checked: a reader's error after a negative
    // count is the one reported.
    let err = handle_failed_recving(
        &["a", "b"],
        &["a", "b"],
        Policy::Recompute,
        |i| {
            if i == 0 {
                Ok(-1)
            } else {
                Err(Error::InvalidArgument("b".into()))
            }
        },
        &mut target,
    );
    assert_eq!(err, Err(Error::InvalidArgument("b".into())));
    assert!(target.log.is_empty());
}

#[test]
fn vllms_scheduler_gets_vllms_scan_of_counts_the_library_refuses() {
    // vLLM's async scheduling with spec decode can leave num_computed_tokens below the
    // tokens scheduled: before = 9 - 10 = -1, range(cdiv(-1, 4)) is empty, so the
    // request is not scanned. A table shorter than cdiv(before, bs) is scanned to its end.
    let tables: [&[i64]; 3] = [&[7, 8], &[1, 7], &[5]];
    let batch = Batch {
        block_tables: &tables,
        num_computed_tokens: &[9, 8, 12],
        num_scheduled_tokens: &[10, 0, 0],
    };
    let strict = rollback_invalid_blocks(batch, &[7, 5], 4, true, Mode::Vllm, Tolerance::Strict);
    assert!(
        matches!(strict, Err(Error::InvalidArgument(_))),
        "{strict:?}"
    );
    let vllm = rollback_invalid_blocks(batch, &[7, 5], 4, true, Mode::Vllm, Tolerance::Vllm);
    assert_eq!(
        vllm,
        Ok(Rollback {
            num_computed_tokens: vec![9, 4, 0],
            affected: vec![1, 2],
            total_affected_tokens: 4 + 12,
            blocks_to_evict: vec![5, 7],
            eviction_tails: vec![(1, 1), (2, 0)],
        })
    );
}
