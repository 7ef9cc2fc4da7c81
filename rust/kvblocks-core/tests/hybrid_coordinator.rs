//! The hybrid coordinator against vLLM 0.33.0's own run of the same workload: a
//! full-attention group and a sliding-window group (window 8), blocks of 4 tokens,
//! 24 blocks, vLLM's default retention interval 0. The expected tables, hits and
//! boundaries are those vLLM's `HybridKVCacheCoordinator` produced for it.

mod common;

use kvblocks_core::events::EventRecord;
use kvblocks_core::hybrid::{
    Attention, GroupSpec, HybridConfig, HybridManager, HybridRequest, HybridSlots,
};
use kvblocks_core::request::RequestView;
use kvblocks_core::BlockHash;

const BS: i64 = 4;
const SWA: Attention = Attention::SlidingWindow {
    window: 8,
    extra_retained: 0,
};

fn manager(retention: Option<i64>) -> HybridManager {
    HybridManager::new(HybridConfig {
        num_blocks: 24,
        scheduler_block_size: BS,
        hash_block_size: BS,
        groups: vec![
            GroupSpec {
                attention: Attention::Full,
                block_size: BS,
                admission_cap: None,
                lookup_class: 0,
            },
            GroupSpec {
                attention: SWA,
                block_size: BS,
                admission_cap: Some(5),
                lookup_class: 1,
            },
        ],
        enable_caching: true,
        max_model_len: 256,
        retention_interval: retention,
    })
    .unwrap()
}

/// Chained block hashes of `tokens`: block `i`'s hash covers tokens `0 .. (i+1)*BS`.
fn hashes(tokens: &[i64]) -> Vec<BlockHash> {
    let mut out = Vec::new();
    let mut state = 0u64;
    for block in tokens.chunks_exact(4) {
        for &t in block {
            state = state
                .wrapping_mul(1_000_003)
                .wrapping_add(t.unsigned_abs() + 1);
        }
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&state.to_be_bytes());
        out.push(BlockHash::new(&bytes).unwrap());
    }
    out
}

struct Req {
    id: &'static str,
    tokens: Vec<i64>,
    prompt: i64,
    computed: i64,
    boundary: i64,
}

impl Req {
    fn new(id: &'static str, tokens: Vec<i64>) -> Self {
        let prompt = i64::try_from(tokens.len()).unwrap();
        Self {
            id,
            tokens,
            prompt,
            computed: 0,
            boundary: 0,
        }
    }

    /// Schedules `n` tokens (a prefill chunk) and returns the new blocks per group.
    fn step(
        &mut self,
        mgr: &mut HybridManager,
        n: i64,
        hits: Option<&[Vec<u32>]>,
        hit: i64,
    ) -> Vec<Vec<u32>> {
        let h = hashes(&self.tokens);
        let request = HybridRequest {
            view: RequestView {
                request_id: self.id,
                num_tokens: i64::try_from(self.tokens.len()).unwrap(),
                num_computed_tokens: self.computed,
                block_hashes: h.as_slice(),
            },
            num_prompt_tokens: self.prompt,
            num_in_flight_tokens: 0,
            shared_prefix_boundary: self.boundary,
        };
        let slots = HybridSlots {
            num_new_tokens: n,
            num_new_computed_tokens: hit,
            new_computed_blocks: hits,
            ..HybridSlots::default()
        };
        let new = mgr.allocate_slots(&request, &slots).unwrap().unwrap();
        self.computed += hit + n;
        mgr.check_invariants().unwrap();
        new
    }

    fn lookup(&self, mgr: &HybridManager) -> (Vec<Vec<u32>>, i64, i64) {
        let h = hashes(&self.tokens);
        let view = RequestView {
            request_id: self.id,
            num_tokens: i64::try_from(self.tokens.len()).unwrap(),
            num_computed_tokens: 0,
            block_hashes: h.as_slice(),
        };
        let hit = mgr.get_computed_blocks(&view, None).unwrap();
        (hit.blocks, hit.hit_tokens, hit.shared_prefix_boundary)
    }
}

fn shared() -> Vec<i64> {
    (100..116).collect()
}

fn prompt(tail: std::ops::Range<i64>) -> Vec<i64> {
    shared().into_iter().chain(tail).collect()
}

/// Request A (22 tokens) in chunks of 8: under retention 0 its sliding-window group
/// hashes only the blocks ending at its replay boundary (token 20), its
/// out-of-window blocks become nulls and, unhashed, are the first blocks handed out
/// again, to the full-attention group in the same call.
#[test]
fn sliding_window_tables_follow_vllm() {
    let mut mgr = manager(Some(0));
    let mut a = Req::new("A", prompt(200..206));
    assert_eq!(a.step(&mut mgr, 8, None, 0), vec![vec![1, 2], vec![3, 4]]);
    assert_eq!(a.step(&mut mgr, 8, None, 0), vec![vec![5, 6], vec![7, 8]]);
    assert_eq!(a.step(&mut mgr, 6, None, 0), vec![vec![4, 3], vec![9, 10]]);
    assert_eq!(
        mgr.get_block_ids("A"),
        vec![&[1, 2, 5, 6, 4, 3][..], &[0, 0, 7, 8, 9, 10][..]]
    );
    // Hashed: every full block of group 0; in group 1 only blocks 3 and 4 (tokens
    // 12..20, the window's reach at the boundary).
    let cached = |b: u32| mgr.block_pool().block_is_cached(b);
    assert!([1, 2, 5, 6, 4].into_iter().all(cached));
    assert!(!cached(3), "block 3 holds tokens 20..22, not full");
    assert_eq!([7, 8, 9, 10].map(cached), [false, true, true, false]);
    mgr.free("A").unwrap();
    mgr.check_invariants().unwrap();

    // C repeats A's prompt: both groups hit 20 tokens, the window's as nulls then the
    // two blocks ending at the hit.
    let c = Req::new("C", prompt(200..206));
    let (blocks, hit, boundary) = c.lookup(&mgr);
    assert_eq!((hit, boundary), (20, 0));
    assert_eq!(blocks, vec![vec![1, 2, 5, 6, 4], vec![0, 0, 0, 8, 9]]);

    // B shares only the first 16 tokens: full attention hits 16, the window none
    // (A never hashed its blocks ending at 16), so the hit is 0 and the junction at
    // 16 is reported for B to keep.
    let b = Req::new("B", prompt(300..305));
    let (_, hit, boundary) = b.lookup(&mgr);
    assert_eq!((hit, boundary), (0, 16));
}

/// With dense retention (None) B's window group hits too: the fixed point agrees on 16.
#[test]
fn dense_retention_hits_the_shared_prefix() {
    let mut mgr = manager(None);
    let mut a = Req::new("A", prompt(200..206));
    for n in [8, 8, 6] {
        a.step(&mut mgr, n, None, 0);
    }
    mgr.free("A").unwrap();
    let b = Req::new("B", prompt(300..305));
    let (blocks, hit, boundary) = b.lookup(&mgr);
    assert_eq!((hit, boundary), (16, 0));
    assert_eq!(
        blocks[1][..2],
        [0, 0],
        "the window's skipped blocks are nulls"
    );
}

/// B, admitted with its boundary at 16, hashes its own window blocks ending there
/// (the junction tail) though retention is 0, so a later sibling hits.
#[test]
fn the_junction_tail_is_cached() {
    let mut mgr = manager(Some(0));
    let mut a = Req::new("A", prompt(200..206));
    for n in [8, 8, 6] {
        a.step(&mut mgr, n, None, 0);
    }
    mgr.free("A").unwrap();
    let mut b = Req::new("B", prompt(300..305));
    b.boundary = b.lookup(&mgr).2;
    b.step(&mut mgr, 8, None, 0);
    b.step(&mut mgr, 8, None, 0);
    let window_table = mgr.get_block_ids("B")[1].to_vec();
    assert!(window_table[2..4]
        .iter()
        .all(|&blk| mgr.block_pool().block_is_cached(blk)));
    let d = Req::new("D", prompt(400..410));
    assert_eq!(d.lookup(&mgr).1, 16);
}

/// Immediate frees go group by group, each table tail first: unhashed blocks go to
/// the head (the last group's first), hashed ones queue as the window's earlier
/// removals, then reversed group 0, then reversed group 1 (vLLM's LRU order).
#[test]
fn free_order_is_group_major() {
    let mut mgr = manager(None);
    let mut a = Req::new("A", prompt(200..206));
    for n in [8, 8, 6] {
        a.step(&mut mgr, n, None, 0);
    }
    // Dense: the removed window blocks 3 and 4 were hashed, so they queued at the
    // tail and the third chunk took fresh blocks.
    assert_eq!(
        mgr.get_block_ids("A"),
        vec![&[1, 2, 5, 6, 9, 10][..], &[0, 0, 7, 8, 11, 12][..]]
    );
    mgr.free("A").unwrap();
    let queue = mgr.block_pool().free_block_ids();
    assert_eq!(queue[..2], [12, 10]);
    assert_eq!(queue[queue.len() - 10..], [4, 3, 9, 6, 5, 2, 1, 11, 8, 7]);
}

/// Gemma 4 style: the sliding-window group's blocks hold 8 tokens, the full group's
/// 4 (the hash block size), the scheduler's 8. Tables are sized per group; a window
/// block is cached under the hash of its last 4-token block; hits are multiples of 8.
#[test]
fn unequal_block_sizes_view_the_hashes_per_group() {
    let window = Attention::SlidingWindow {
        window: 16,
        extra_retained: 0,
    };
    let mut mgr = HybridManager::new(HybridConfig {
        num_blocks: 40,
        scheduler_block_size: 8,
        hash_block_size: 4,
        groups: vec![
            GroupSpec {
                attention: window,
                block_size: 8,
                admission_cap: None,
                lookup_class: 0,
            },
            GroupSpec {
                attention: Attention::Full,
                block_size: 4,
                admission_cap: None,
                lookup_class: 1,
            },
        ],
        enable_caching: true,
        max_model_len: 256,
        retention_interval: None,
    })
    .unwrap();
    let mut a = Req::new("A", (0..30).collect());
    let new = a.step(&mut mgr, 20, None, 0);
    assert_eq!(
        (new[0].len(), new[1].len()),
        (3, 5),
        "cdiv(20, 8) and cdiv(20, 4)"
    );
    a.step(&mut mgr, 10, None, 0);
    let tables: Vec<Vec<u32>> = mgr
        .get_block_ids("A")
        .into_iter()
        .map(<[u32]>::to_vec)
        .collect();
    assert_eq!((tables[0].len(), tables[1].len()), (4, 8));
    // Caching rounds down to 8 tokens: 24 of the 30, so 3 window blocks (dense: a
    // window of 2 blocks reaches every boundary) and 6 full ones.
    let cached = |b: &u32| mgr.block_pool().block_is_cached(*b);
    let window_cached: Vec<bool> = tables[0].iter().map(cached).collect();
    assert_eq!(window_cached, [true, true, true, false]);
    assert_eq!(tables[1].iter().filter(|b| cached(b)).count(), 6);
    let h = hashes(&a.tokens);
    let block = mgr.block_pool().get_cached_block(&h[3], &[0]).unwrap();
    assert_eq!(
        block,
        vec![tables[0][1]],
        "window block 1 under hash 3 (tokens 0..16)"
    );
    mgr.free("A").unwrap();
    // The same prompt again: 29 tokens may hit, rounded down to 24.
    let b = Req::new("B", (0..30).collect());
    let (blocks, hit, _) = b.lookup(&mgr);
    assert_eq!(hit, 24);
    assert_eq!(
        blocks[0],
        [0, tables[0][1], tables[0][2]],
        "the window's run ends at 24"
    );
    assert_eq!(blocks[1].len(), 6);
}

/// The admission gate caps a window group's count at its admission cap (vLLM's
/// `max_admission_blocks_per_request`); the step's own count is not capped.
#[test]
fn admission_cap_applies_to_window_groups_only() {
    let mgr = manager(Some(0));
    let uncapped = mgr
        .num_blocks_to_allocate("new", 64, &[], 0, false)
        .unwrap();
    let capped = mgr.num_blocks_to_allocate("new", 64, &[], 0, true).unwrap();
    assert_eq!((uncapped, capped), (16 + 16, 16 + 5));
}

/// External tokens reaching past a window: vLLM pads the skipped blocks with nulls
/// and allocates the rest of the external range, then the new tokens' blocks.
#[test]
fn external_tokens_past_the_window_start_with_nulls() {
    let mut mgr = manager(Some(0));
    let tokens: Vec<i64> = (0..20).collect();
    let h = hashes(&tokens);
    let request = HybridRequest {
        view: RequestView {
            request_id: "X",
            num_tokens: 20,
            num_computed_tokens: 0,
            block_hashes: h.as_slice(),
        },
        num_prompt_tokens: 20,
        num_in_flight_tokens: 0,
        shared_prefix_boundary: 0,
    };
    let slots = HybridSlots {
        num_new_tokens: 4,
        num_external_computed_tokens: 16,
        ..HybridSlots::default()
    };
    let new = mgr.allocate_slots(&request, &slots).unwrap().unwrap();
    let tables = mgr.get_block_ids("X");
    // Skipped: 16 - 8 + 1 = 9 tokens, 2 blocks; external blocks up to cdiv(16, 4).
    assert_eq!(tables[1][..2], [0, 0]);
    assert!(tables[1][2..].iter().all(|&b| b != 0));
    assert_eq!((tables[0].len(), tables[1].len()), (5, 5));
    assert_eq!(
        (new[0].len(), new[1].len()),
        (1, 1),
        "only the new tokens' block is new"
    );
    mgr.check_invariants().unwrap();
    // Deferred frees get the groups' tables one after the other, leading nulls dropped.
    let full: Vec<u32> = tables[0].to_vec();
    let window: Vec<u32> = tables[1][2..].to_vec();
    let popped = mgr.pop_blocks_for_free("X");
    assert_eq!(popped, [full, window].concat());
}

/// `estimate_cached_tokens` is the smallest, over groups, of the end of the last
/// hashed block: a window group that hashed only its boundary tail bounds it.
#[test]
fn estimated_cached_tokens_is_the_least_over_groups() {
    let mut mgr = manager(Some(0));
    let mut a = Req::new("A", prompt(200..206));
    a.step(&mut mgr, 8, None, 0);
    // Full group: blocks 0 and 1 hashed (8 tokens); window group: none yet.
    assert_eq!(mgr.estimate_cached_tokens("A"), 0);
    a.step(&mut mgr, 8, None, 0);
    // Window group: block 3 (tokens 12..16) hashed, the boundary tail; full: 16.
    assert_eq!(mgr.estimate_cached_tokens("A"), 16);
}

/// A request over `source` with `computed` tokens.
fn partial_request<'a>(
    id: &'a str,
    source: &'a common::Source,
    prompt: i64,
    computed: i64,
) -> HybridRequest<'a, common::Source> {
    HybridRequest {
        view: RequestView {
            request_id: id,
            num_tokens: i64::try_from(source.tokens.len()).unwrap(),
            num_computed_tokens: computed,
            block_hashes: source,
        },
        num_prompt_tokens: prompt,
        num_in_flight_tokens: 0,
        shared_prefix_boundary: 0,
    }
}

/// One record: kind, hashes, parent, tokens, block size, group.
type Event = (
    char,
    Vec<BlockHash>,
    Option<BlockHash>,
    Vec<i64>,
    usize,
    u32,
);

fn event_summary(mgr: &HybridManager) -> Vec<Event> {
    let log = mgr.events();
    log.records()
        .iter()
        .map(|record| match record {
            EventRecord::Stored(s) => (
                'S',
                log.stored_hashes(s).to_vec(),
                s.parent,
                log.stored_tokens(s).to_vec(),
                s.block_size,
                s.group,
            ),
            EventRecord::Removed { hash, group } => ('R', vec![*hash], None, vec![], 0, *group),
            EventRecord::AllCleared => ('C', vec![], None, vec![], 0, 0),
        })
        .collect()
}

/// A full-attention group with blocks of 8 beside a window group of 4 (hash block 4,
/// scheduler block 8), events on; 16 tokens and their hashes; the first `n` of them
/// as a request's source. A 14-token prompt's last hash boundary is 12 (floor(13 / 4)
/// * 4), inside block 1 (12 // 8): vLLM keys that block under hash 2 (tokens 0..12).
struct PartialTail {
    mgr: HybridManager,
    tokens: Vec<i64>,
    all: Vec<BlockHash>,
}

impl PartialTail {
    fn new() -> Self {
        let window = Attention::SlidingWindow {
            window: 16,
            extra_retained: 0,
        };
        let group = |attention, block_size, lookup_class| GroupSpec {
            attention,
            block_size,
            admission_cap: None,
            lookup_class,
        };
        let mut mgr = HybridManager::new(HybridConfig {
            num_blocks: 40,
            scheduler_block_size: 8,
            hash_block_size: 4,
            groups: vec![group(Attention::Full, 8, 0), group(window, 4, 1)],
            enable_caching: true,
            max_model_len: 256,
            retention_interval: None,
        })
        .unwrap();
        mgr.enable_kv_cache_events();
        let tokens: Vec<i64> = (100..116).collect();
        let all = hashes(&tokens);
        Self { mgr, tokens, all }
    }

    fn source(&self, n: usize) -> common::Source {
        common::Source {
            hashes: self.all[..n / 4].to_vec(),
            tokens: self.tokens[..n].to_vec(),
        }
    }

    fn allocate(&mut self, id: &str, source: &common::Source, computed: i64, n: i64) {
        let request = partial_request(id, source, 14, computed);
        let slots = HybridSlots {
            num_new_tokens: n,
            ..HybridSlots::default()
        };
        self.mgr.allocate_slots(&request, &slots).unwrap().unwrap();
        self.mgr.check_invariants().unwrap();
    }

    /// The full group's block `i` of request `id` and the hash it is cached under.
    fn full_block(&self, id: &str, i: usize) -> (u32, Option<BlockHash>) {
        let block = self.mgr.get_block_ids(id)[0][i];
        let info = self.mgr.block_pool().block(block.into()).unwrap();
        (block, info.block_hash)
    }

    /// The tail's own `BlockStored`: one hash block of 4 tokens.
    fn tail_event(&self) -> Event {
        let (all, tokens) = (&self.all, &self.tokens);
        (
            'S',
            vec![all[2]],
            Some(all[1]),
            tokens[8..12].to_vec(),
            4,
            0,
        )
    }

    /// Block 1's own `BlockStored` of 8 tokens.
    fn full_event(&self) -> Event {
        let (all, tokens) = (&self.all, &self.tokens);
        (
            'S',
            vec![all[3]],
            Some(all[1]),
            tokens[8..16].to_vec(),
            8,
            0,
        )
    }
}

/// Caching at 8 tokens stops short of the boundary; at 16, block 1 is full and gets
/// hash 2 beside hash 3, with its own event; caching again adds nothing.
#[test]
fn a_partial_tail_is_keyed_beside_the_full_key() {
    let mut t = PartialTail::new();
    let (a14, a16) = (t.source(14), t.source(16));
    t.allocate("A", &a14, 0, 14);
    assert!(!event_summary(&t.mgr).contains(&t.tail_event()));
    t.mgr.clear_events();
    t.allocate("A", &a16, 14, 2);
    let events = event_summary(&t.mgr);
    assert_eq!(events[..2], [t.full_event(), t.tail_event()]);
    assert_eq!(
        t.full_block("A", 1).1,
        Some(t.all[3]),
        "the full key stays primary"
    );
    t.mgr.clear_events();
    t.mgr
        .cache_blocks(&partial_request("A", &a16, 14, 16), 16)
        .unwrap();
    assert!(event_summary(&t.mgr).is_empty());
}

/// Cached to 16 tokens by a direct call (as vLLM's scheduler makes after a KV load)
/// while only the 3 prompt hashes exist, block 1's only key is the partial one; when
/// the hashes catch up vLLM removes it, stores the full key, then keys the tail again.
#[test]
fn a_partial_key_is_promoted_when_the_block_fills() {
    let mut t = PartialTail::new();
    let (b14, b16) = (t.source(14), t.source(16));
    t.allocate("B", &b14, 0, 16);
    t.mgr.clear_events();
    t.mgr
        .cache_blocks(&partial_request("B", &b14, 14, 16), 16)
        .unwrap();
    t.mgr.check_invariants().unwrap();
    assert_eq!(t.full_block("B", 1).1, Some(t.all[2]));
    assert!(event_summary(&t.mgr).contains(&t.tail_event()));
    t.mgr.clear_events();
    t.mgr
        .cache_blocks(&partial_request("B", &b16, 14, 16), 16)
        .unwrap();
    t.mgr.check_invariants().unwrap();
    let events = event_summary(&t.mgr);
    let removed = ('R', vec![t.all[2]], None, vec![], 0, 0);
    assert_eq!(events[..3], [removed, t.full_event(), t.tail_event()]);
    assert_eq!(events[3].5, 1, "then the window group's own BlockStored");
    assert_eq!(t.full_block("B", 1).1, Some(t.all[3]));
}

/// Reusing a block with a partial key beside its full one removes both keys, the
/// primary first.
#[test]
fn eviction_removes_every_key_of_a_block() {
    let mut t = PartialTail::new();
    let (a14, a16) = (t.source(14), t.source(16));
    t.allocate("A", &a14, 0, 14);
    t.allocate("A", &a16, 14, 2);
    t.mgr.free("A").unwrap();
    t.mgr.clear_events();
    let free = i64::try_from(t.mgr.block_pool().num_free_blocks()).unwrap();
    t.mgr.block_pool_mut().get_new_blocks(free).unwrap();
    t.mgr.check_invariants().unwrap();
    let removed: Vec<(BlockHash, u32)> = event_summary(&t.mgr)
        .into_iter()
        .map(|e| (e.1[0], e.5))
        .collect();
    let full: Vec<BlockHash> = removed.iter().filter(|k| k.1 == 0).map(|k| k.0).collect();
    // vLLM frees a table tail first: block 1, then block 0.
    assert_eq!(full, [t.all[3], t.all[2], t.all[1]]);
}
