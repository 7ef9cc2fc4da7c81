//! vLLM's `KVCacheManager` for one full-attention group, as its Scheduler gets it from
//! kvblocks (the hybrid manager with one group), at the rules the Scheduler relies on
//! beyond the scheduler-level runs: the full-sequence admission gate, reserved blocks,
//! the watermark, prefix hits that are free (and so consumed by touching them),
//! deferred frees, `estimate_cached_tokens`, the coordinator's block count, bounded
//! lookups, "full"-mode reuse events, the rules of older releases, and what vLLM does
//! with arguments outside the library's domain. Each case states vLLM's arithmetic.

mod common;

use common::Source;
use kvblocks_core::events::EventRecord;
use kvblocks_core::hybrid::{
    Attention, GroupSpec, HybridConfig, HybridManager, HybridRequest, HybridSlots, ReleaseRules,
};
use kvblocks_core::request::RequestView;
use kvblocks_core::{BlockHash, Error};

const BS: i64 = 4;

fn source(num_tokens: usize) -> Source {
    let tokens: Vec<i64> = (0..num_tokens).map(|t| i64::try_from(t).unwrap()).collect();
    let hashes = (0..num_tokens / 4)
        .map(|i| BlockHash::new(&[u8::try_from(i + 1).unwrap(); 32]).unwrap())
        .collect();
    Source { hashes, tokens }
}

fn view<'a>(id: &'a str, num_computed: i64, s: &'a Source) -> HybridRequest<'a, Source> {
    let num_tokens = i64::try_from(s.tokens.len()).unwrap();
    HybridRequest {
        view: RequestView {
            request_id: id,
            num_tokens,
            num_computed_tokens: num_computed,
            block_hashes: s,
        },
        num_prompt_tokens: num_tokens,
        num_in_flight_tokens: 0,
        shared_prefix_boundary: 0,
    }
}

fn new_tokens(n: i64) -> HybridSlots<'static> {
    HybridSlots {
        num_new_tokens: n,
        ..HybridSlots::default()
    }
}

/// One full-attention group of 4-token blocks, capped at 1,024 tokens.
fn manager_with(num_blocks: i64, enable_caching: bool) -> HybridManager {
    HybridManager::new(HybridConfig {
        num_blocks,
        scheduler_block_size: BS,
        hash_block_size: BS,
        groups: vec![GroupSpec {
            attention: Attention::Full,
            block_size: BS,
            admission_cap: None,
            lookup_class: 0,
        }],
        enable_caching,
        max_model_len: 1024,
        retention_interval: None,
    })
    .unwrap()
}

fn manager(num_blocks: i64) -> HybridManager {
    manager_with(num_blocks, true)
}

/// The free queue, the requests with a table, and the cached blocks.
type Snapshot = (Vec<u32>, Vec<String>, Vec<(u32, BlockHash, u32)>);

/// The state a refused call must leave alone.
fn snapshot(mgr: &HybridManager) -> Snapshot {
    let pool = mgr.block_pool();
    let mut ids: Vec<String> = mgr.request_ids(0).map(str::to_owned).collect();
    ids.sort();
    (pool.free_block_ids(), ids, pool.cached_blocks())
}

fn table(mgr: &HybridManager, id: &str) -> Vec<u32> {
    mgr.get_block_ids(id)[0].to_vec()
}

#[test]
fn the_full_sequence_gate_refuses_what_only_the_chunk_fits() {
    // 9 free blocks; the 40-token prompt needs cdiv(40, 4) = 10, its first chunk 2.
    let mut mgr = manager(10);
    let s = source(40);
    let chunk = new_tokens(8);
    let gated = HybridSlots {
        full_sequence_must_fit: true,
        ..chunk
    };
    let before = snapshot(&mgr);
    assert_eq!(mgr.allocate_slots(&view("r", 0, &s), &gated).unwrap(), None);
    assert_eq!(snapshot(&mgr), before, "a refusal changes nothing");
    assert_eq!(
        mgr.allocate_slots(&view("r", 0, &s), &chunk).unwrap(),
        Some(vec![vec![1, 2]])
    );
    // 36 tokens need 9 blocks: the gate lets the whole of it in.
    let mut mgr = manager(10);
    let s = source(36);
    assert_eq!(
        mgr.allocate_slots(&view("r", 0, &s), &gated).unwrap(),
        Some(vec![vec![1, 2]])
    );
}

#[test]
fn reserved_blocks_are_left_free_for_the_step_but_not_the_gate() {
    // 9 free; 3 needed. vLLM: required > free - reserved refuses.
    let s = source(12);
    for (reserved, fits) in [(6, true), (7, false)] {
        let mut mgr = manager(10);
        let args = HybridSlots {
            reserved_blocks: reserved,
            ..new_tokens(12)
        };
        let got = mgr.allocate_slots(&view("r", 0, &s), &args).unwrap();
        assert_eq!(got.is_some(), fits, "reserved {reserved}");
    }
    // The full-sequence gate ignores the reservation (it compares with all free blocks).
    let mut mgr = manager(10);
    let args = HybridSlots {
        reserved_blocks: 6,
        full_sequence_must_fit: true,
        ..new_tokens(12)
    };
    assert!(mgr
        .allocate_slots(&view("r", 0, &s), &args)
        .unwrap()
        .is_some());
}

#[test]
fn the_watermark_applies_to_admissions_while_others_are_scheduled() {
    // int(0.25 * 10) = 2 blocks kept; 9 free; 32 tokens need 8: 8 + 2 > 9.
    let s = source(32);
    // Status 0 is an admission status, 2 is not; `None`: not read (nothing scheduled).
    for (status, fits) in [(Some(0), false), (Some(2), true), (None, true)] {
        let mut mgr = manager(10);
        assert!(!mgr.reads_status(true), "no watermark: status not read");
        mgr.set_watermark(0.25, vec![0, 1]).unwrap();
        assert_eq!(mgr.watermark_blocks(), 2);
        assert!(mgr.reads_status(true) && !mgr.reads_status(false));
        let args = HybridSlots {
            status,
            ..new_tokens(32)
        };
        let got = mgr.allocate_slots(&view("r", 0, &s), &args).unwrap();
        assert_eq!(got.is_some(), fits, "status {status:?}");
    }
    // The gate counts the watermark too: 36 tokens need 9 blocks, 9 + 2 > 9.
    let mut mgr = manager(10);
    mgr.set_watermark(0.25, vec![0]).unwrap();
    let gated = HybridSlots {
        status: Some(0),
        full_sequence_must_fit: true,
        ..new_tokens(4)
    };
    assert_eq!(
        mgr.allocate_slots(&view("r", 0, &source(36)), &gated)
            .unwrap(),
        None
    );
    // vLLM asserts a non-negative watermark (NaN fails it too); int(inf) overflows.
    for bad in [-0.1, f64::NAN] {
        assert!(matches!(
            mgr.set_watermark(bad, vec![0]),
            Err(Error::Assertion(_))
        ));
    }
    assert!(matches!(
        mgr.set_watermark(f64::INFINITY, vec![0]),
        Err(Error::Overflow(_))
    ));
    assert_eq!(
        mgr.watermark_blocks(),
        2,
        "a refused watermark changes nothing"
    );
}

#[test]
fn free_hits_count_as_taken_from_the_pool() {
    // r0 caches 2 blocks and frees them: they sit in the free queue (ref 0), hashed.
    let mut mgr = manager(6);
    let s = source(12);
    mgr.allocate_slots(&view("r0", 0, &s), &new_tokens(12))
        .unwrap();
    mgr.free("r0").unwrap();
    let hit = mgr
        .get_computed_blocks(&view("r1", 0, &s).view, None)
        .unwrap();
    assert_eq!((hit.blocks[0].len(), hit.hit_tokens), (2, 8));
    // 5 free blocks; the request needs cdiv(12, 4) = 3, 2 of them hits that are free:
    // 1 new + 2 touched = 3 <= 5. The coordinator's count says the same.
    assert_eq!(
        mgr.num_blocks_to_allocate("r1", 12, &hit.blocks, 0, false),
        Ok(3)
    );
    assert_eq!(
        mgr.num_blocks_to_allocate("r1", 12, &[vec![]], 0, false),
        Ok(3)
    );
    // With 3 blocks reserved only 2 are available: refused.
    let args = HybridSlots {
        num_new_computed_tokens: 8,
        new_computed_blocks: Some(&hit.blocks),
        reserved_blocks: 3,
        ..new_tokens(4)
    };
    assert_eq!(mgr.allocate_slots(&view("r1", 0, &s), &args).unwrap(), None);
    let args = HybridSlots {
        reserved_blocks: 2,
        ..args
    };
    assert!(mgr
        .allocate_slots(&view("r1", 0, &s), &args)
        .unwrap()
        .is_some());
    // Known now: one more token needs cdiv(13, 4) - 3 = 1 block; vLLM asserts
    // against new hits for a running request.
    assert_eq!(
        mgr.num_blocks_to_allocate("r1", 13, &[vec![]], 0, false),
        Ok(1)
    );
    assert!(matches!(
        mgr.num_blocks_to_allocate("r1", 13, &[vec![1]], 0, false),
        Err(Error::Assertion(_))
    ));
}

#[test]
fn popped_blocks_stay_held_until_freed() {
    let mut mgr = manager(8);
    let s = source(10);
    let got = mgr
        .allocate_slots(&view("r", 0, &s), &new_tokens(10))
        .unwrap();
    assert_eq!(got, Some(vec![vec![1, 2, 3]]));
    let free = mgr.block_pool().num_free_blocks();
    let popped = mgr.pop_blocks_for_free("r");
    assert_eq!(popped, [1, 2, 3]);
    assert_eq!(mgr.request_ids(0).count(), 0, "the request is forgotten");
    assert_eq!(
        mgr.block_pool().num_free_blocks(),
        free,
        "its blocks are still held"
    );
    assert!(mgr.pop_blocks_for_free("r").is_empty());
    let tail_first: Vec<i64> = popped.iter().rev().map(|&b| i64::from(b)).collect();
    mgr.block_pool_mut().free_blocks(&tail_first).unwrap();
    assert_eq!(mgr.block_pool().num_free_blocks(), 7);
    mgr.check_invariants().unwrap();
}

#[test]
fn cached_tokens_end_at_the_last_hashed_block() {
    let mut mgr = manager(8);
    let s = source(10);
    assert_eq!(mgr.estimate_cached_tokens("r"), 0);
    mgr.allocate_slots(&view("r", 0, &s), &new_tokens(10))
        .unwrap();
    // Blocks 1 and 2 are full and hashed: 2 * 4 tokens.
    assert_eq!(mgr.estimate_cached_tokens("r"), 8);
    mgr.evict_blocks(&[2]).unwrap();
    assert_eq!(mgr.estimate_cached_tokens("r"), 4);
    mgr.evict_blocks(&[1]).unwrap();
    assert_eq!(mgr.estimate_cached_tokens("r"), 0);
}

#[test]
fn lookups_are_bounded() {
    let mut mgr = manager(10);
    let s = source(20);
    mgr.allocate_slots(&view("r0", 0, &s), &new_tokens(20))
        .unwrap();
    let r1 = view("r1", 0, &s);
    // Default: num_tokens - 1 = 19 tokens, 4 blocks.
    assert_eq!(
        mgr.get_computed_blocks(&r1.view, None).unwrap().hit_tokens,
        16
    );
    let capped = mgr.get_computed_blocks(&r1.view, Some(9)).unwrap();
    assert_eq!((capped.blocks, capped.hit_tokens), (vec![vec![1, 2]], 8));
    // vLLM's islice refuses a negative bound (its ValueError), as for a request
    // without tokens, whose bound is -1.
    let empty = source(0);
    for (request, bound) in [(&r1, Some(-1)), (&view("e", 0, &empty), None)] {
        let err = mgr.get_computed_blocks(&request.view, bound).unwrap_err();
        assert!(
            err.to_string().starts_with("Stop argument for islice()"),
            "{err}"
        );
    }
}

#[test]
fn reused_blocks_are_reported_once_from_block_zero() {
    let mut mgr = manager(10);
    mgr.enable_kv_cache_events();
    let s = source(13);
    mgr.allocate_slots(&view("r0", 0, &s), &new_tokens(13))
        .unwrap();
    mgr.clear_events();
    let r1 = view("r1", 0, &s);
    let hit = mgr.get_computed_blocks(&r1.view, None).unwrap();
    assert_eq!(hit.blocks[0].len(), 3);
    mgr.record_cached_block_events(&r1.view, &hit.blocks)
        .unwrap();
    let log = mgr.events();
    let [EventRecord::Stored(record)] = log.records() else {
        panic!("one BlockStored, got {:?}", log.records());
    };
    assert_eq!(
        (record.parent, record.first_block, record.group),
        (None, 0, 0)
    );
    assert_eq!(log.stored_hashes(record), &s.hashes[..3]);
    assert_eq!(log.stored_tokens(record), &s.tokens[..12]);
    mgr.clear_events();
    mgr.record_cached_block_events(&r1.view, &[vec![]]).unwrap();
    assert!(mgr.events().is_empty());
}

#[test]
fn a_negative_cache_count_caches_nothing() {
    // vLLM's async spec-decode path passes num_computed_tokens - num_in_flight_tokens
    // = -1: min(-1, 2 * 4) // 4 = -1 full blocks, not above the 0 cached.
    let s = source(10);
    let mut mgr = manager(8);
    let delayed = HybridSlots {
        delay_cache_blocks: true,
        ..new_tokens(10)
    };
    mgr.allocate_slots(&view("r", 0, &s), &delayed).unwrap();
    let before = snapshot(&mgr);
    mgr.cache_blocks(&view("r", 0, &s), -1).unwrap();
    mgr.cache_blocks(&view("r", 0, &s), i64::MIN).unwrap();
    assert_eq!(snapshot(&mgr), before);
    // 7 tokens: 7 // 4 = 1 block.
    mgr.cache_blocks(&view("r", 0, &s), 7).unwrap();
    assert_eq!(mgr.estimate_cached_tokens("r"), 4);
}

#[test]
fn a_cache_count_past_the_table_is_recorded_as_vllm_records_it() {
    // 17 tokens, 4 hashes; 2 blocks held. vLLM caches blocks[0:4] (the 2 there) and
    // sets num_cached_block = 4, so the next 2 blocks are never hashed.
    let s = source(17);
    let mut mgr = manager(8);
    let delayed = HybridSlots {
        delay_cache_blocks: true,
        ..new_tokens(8)
    };
    mgr.allocate_slots(&view("r", 0, &s), &delayed).unwrap();
    mgr.cache_blocks(&view("r", 0, &s), 17).unwrap();
    assert_eq!(mgr.estimate_cached_tokens("r"), 8);
    // cdiv(8 + 9, 4) = 5 blocks; min(17, 17) // 4 = 4 <= 4 cached: nothing hashed.
    let new = mgr
        .allocate_slots(&view("r", 8, &s), &new_tokens(9))
        .unwrap();
    assert_eq!(new.map(|b| b[0].len()), Some(3));
    assert_eq!(mgr.estimate_cached_tokens("r"), 8);
    // A request it has not seen: nothing cached, the count kept until freed.
    mgr.cache_blocks(&view("q", 0, &s), 17).unwrap();
    assert!(table(&mgr, "q").is_empty());
    mgr.free("q").unwrap();
    assert_eq!(mgr.request_ids(0).collect::<Vec<_>>(), ["r"]);
}

#[test]
fn negative_slot_counts_are_summed_before_they_are_clamped() {
    // vLLM: total = 8 + 0 + 0, main = 8 + (-3) = 5, slots = min(5 + 2, 1024) = 7:
    // cdiv(7, 4) = 2 blocks; a count at or below zero needs none.
    let s = source(12);
    let mut mgr = manager(8);
    mgr.allocate_slots(&view("r", 0, &s), &new_tokens(8))
        .unwrap();
    let odd = HybridSlots {
        num_lookahead_tokens: 2,
        ..new_tokens(-3)
    };
    assert_eq!(
        mgr.allocate_slots(&view("r", 8, &s), &odd),
        Ok(Some(vec![vec![]]))
    );
    let overdrawn = HybridSlots {
        num_lookahead_tokens: -40,
        ..new_tokens(9)
    };
    assert_eq!(
        mgr.allocate_slots(&view("r", 8, &s), &overdrawn),
        Ok(Some(vec![vec![]]))
    );
    // A negative reservation adds room: 6 <= 5 free - (-2) passes vLLM's check, and
    // then the pool cannot give 6 blocks: vLLM's ValueError.
    let reserved = HybridSlots {
        reserved_blocks: -2,
        ..new_tokens(24)
    };
    assert_eq!(
        mgr.allocate_slots(&view("r", 8, &s), &reserved),
        Err(Error::NoFreeBlocks {
            requested: 6,
            free: 5
        })
    );
}

#[test]
fn what_vllm_asserts_is_an_assertion() {
    // Hits for a request that already holds blocks: vLLM asserts in
    // get_num_blocks_to_allocate.
    let s = source(12);
    let mut mgr = manager(8);
    mgr.allocate_slots(&view("r", 0, &s), &new_tokens(8))
        .unwrap();
    let hits = [vec![1]];
    let adopt = HybridSlots {
        new_computed_blocks: Some(&hits),
        num_new_computed_tokens: 4,
        ..new_tokens(4)
    };
    assert!(matches!(
        mgr.allocate_slots(&view("r", 8, &s), &adopt),
        Err(Error::Assertion(_))
    ));
    // evict_blocks: an id past the pool fails vLLM's assert; -7 is block 1 of 8.
    assert!(matches!(mgr.evict_blocks(&[8]), Err(Error::Assertion(_))));
    assert!(matches!(
        mgr.evict_blocks(&[-9]),
        Err(Error::UnknownBlock { .. })
    ));
    assert_eq!(mgr.evict_blocks(&[-7]).unwrap().len(), 1);
}

#[test]
fn vllm_slices_follow_pythons_arithmetic() {
    let s = source(13);
    let mut mgr = manager(8);
    mgr.allocate_slots(&view("r", 0, &s), &new_tokens(13))
        .unwrap();
    // table[:cdiv(n, 4)], a negative end counting from the end: cdiv(-9, 4) = -2.
    let whole = table(&mgr, "r");
    for (tokens, end) in [(-9, 2), (-5, 3), (-4, 3), (-1, 0), (0, 0), (5, 2), (99, 4)] {
        assert_eq!(
            mgr.block_ids_for_computed_tokens("r", tokens),
            [&whole[..end]],
            "{tokens}"
        );
    }
}

#[test]
fn vllm_asserts_against_adopting_only_after_its_capacity_checks() {
    // Caching off, so r holds blocks without a cached count. External tokens for it:
    // vLLM first finds no room (returns None), and asserts only when there is room.
    let s = source(12);
    let mut mgr = manager_with(3, false);
    mgr.allocate_slots(&view("r", 0, &s), &new_tokens(4))
        .unwrap();
    let external = HybridSlots {
        num_external_computed_tokens: 4,
        ..new_tokens(8)
    };
    // cdiv(4 + 4 + 8, 4) - 1 = 3 blocks wanted, 1 free.
    assert_eq!(mgr.allocate_slots(&view("r", 4, &s), &external), Ok(None));
    let small = HybridSlots {
        num_external_computed_tokens: 1,
        ..new_tokens(1)
    };
    assert!(matches!(
        mgr.allocate_slots(&view("r", 2, &s), &small),
        Err(Error::Assertion(_))
    ));
}

#[test]
fn caching_past_the_table_with_events_fails_where_vllm_indexes() {
    // vLLM caches the blocks the table has, then indexes blocks[i] past its end while
    // building the BlockStored event: IndexError, no event, the count unchanged.
    let s = source(17);
    let mut mgr = manager(8);
    mgr.enable_kv_cache_events();
    let delayed = HybridSlots {
        delay_cache_blocks: true,
        ..new_tokens(8)
    };
    mgr.allocate_slots(&view("r", 0, &s), &delayed).unwrap();
    assert!(matches!(
        mgr.cache_blocks(&view("r", 0, &s), 17),
        Err(Error::Index(_))
    ));
    assert_eq!(mgr.estimate_cached_tokens("r"), 8);
    assert!(mgr.events().is_empty());
}

#[test]
fn truncating_a_lookup_is_vllms_aligned_slice() {
    // blocks[:n // 4]: n must be a multiple of 4 and n // 4 at most the hits; a negative
    // multiple counts from the end.
    let mgr = manager(8);
    assert_eq!(mgr.truncated_hits(&[3], 8), Ok(vec![2]));
    assert_eq!(mgr.truncated_hits(&[3], -4), Ok(vec![2]));
    assert_eq!(mgr.truncated_hits(&[3], -16), Ok(vec![0]));
    assert!(matches!(
        mgr.truncated_hits(&[3], 6),
        Err(Error::Assertion(_))
    ));
    assert!(matches!(
        mgr.truncated_hits(&[3], 16),
        Err(Error::Assertion(_))
    ));
}

/// A manager under the rules of vLLM 0.31.
fn older_release_manager(num_blocks: i64, enable_caching: bool) -> HybridManager {
    let mut mgr = manager_with(num_blocks, enable_caching);
    mgr.set_release_rules(ReleaseRules::for_vllm((0, 31)));
    mgr
}

#[test]
fn before_0_33_caching_counts_blocks_past_the_hashes() {
    // 0.31/0.32: num_full_blocks = num_tokens // block_size, not capped by the hashes.
    // A request without blocks and 1 hash, cached to 9 tokens: 9 // 4 = 2 counted.
    let s = source(5);
    let mut older = older_release_manager(8, true);
    older.cache_blocks(&view("q", 0, &s), 9).unwrap();
    assert_eq!(older.cached_block_counts(0).collect::<Vec<_>>(), [("q", 2)]);
    // 0.33: min(9, 1 * 4) // 4 = 1.
    let mut newest = manager(8);
    newest.cache_blocks(&view("q", 0, &s), 9).unwrap();
    assert_eq!(
        newest.cached_block_counts(0).collect::<Vec<_>>(),
        [("q", 1)]
    );
}

#[test]
fn before_0_33_a_table_block_without_a_hash_fails_after_those_before_it() {
    // 3 blocks held, 2 hashes (9 tokens): caching 12 tokens hashes blocks 0 and 1, then
    // vLLM 0.31 indexes block_hashes[2]: IndexError, the count not updated.
    let s = source(9);
    let mut mgr = older_release_manager(8, true);
    let delayed = HybridSlots {
        delay_cache_blocks: true,
        ..new_tokens(12)
    };
    let allocated = mgr
        .allocate_slots(&view("r", 0, &s), &delayed)
        .unwrap()
        .unwrap();
    let err = mgr.cache_blocks(&view("r", 0, &s), 12).unwrap_err();
    assert!(matches!(err, Error::Index(_)), "{err:?}");
    let pool = mgr.block_pool();
    assert_eq!(
        allocated[0]
            .iter()
            .map(|&b| pool.block_is_cached(b))
            .collect::<Vec<_>>(),
        [true, true, false]
    );
    assert_eq!(mgr.estimate_cached_tokens("r"), 8);
    assert!(mgr.cached_block_counts(0).all(|(_, n)| n == 0));
}

#[test]
fn common_prefix_blocks_are_those_every_table_holds() {
    // vLLM 0.31: leading blocks whose ref count is the number of tables. Two requests
    // share 2 blocks of prefix; the third block is each one's own.
    let s = source(12);
    let mut mgr = older_release_manager(16, true);
    mgr.allocate_slots(&view("a", 0, &s), &new_tokens(12))
        .unwrap();
    let hit = mgr
        .get_computed_blocks(&view("b", 0, &s).view, None)
        .unwrap();
    assert_eq!(hit.blocks[0].len(), 2);
    let shared = HybridSlots {
        new_computed_blocks: Some(&hit.blocks),
        num_new_computed_tokens: 8,
        ..new_tokens(4)
    };
    mgr.allocate_slots(&view("b", 0, &s), &shared).unwrap();
    assert_eq!(mgr.num_common_prefix_blocks("a"), [2]);
    // Later releases answer 0, and make no table.
    let mut newest = mgr.clone();
    newest.set_release_rules(ReleaseRules::default());
    assert_eq!(newest.num_common_prefix_blocks("a"), [0]);
    assert_eq!(newest.num_common_prefix_blocks("ghost"), [0]);
    assert_eq!(newest.request_ids(0).count(), 2);
    // An unknown request gets an empty table (vLLM's defaultdict): now nothing is
    // held by all three.
    assert_eq!(mgr.num_common_prefix_blocks("ghost"), [0]);
    assert_eq!(mgr.request_ids(0).count(), 3);
    assert_eq!(mgr.num_common_prefix_blocks("a"), [0]);
    // Without prefix caching, vLLM's coordinator counts nothing.
    let mut uncached = older_release_manager(16, false);
    uncached
        .allocate_slots(&view("a", 0, &s), &new_tokens(12))
        .unwrap();
    assert_eq!(uncached.num_common_prefix_blocks("a"), [0]);
    assert_eq!(uncached.num_common_prefix_blocks("ghost"), [0]);
    assert_eq!(uncached.request_ids(0).count(), 1);
}
