//! The million-block memory budget, measured by a counting global allocator rather
//! than taken from the pool's own [`BlockPool::heap_bytes`] estimate.
//!
//! This file is its own test binary, so the allocator counts only this test. Keep it
//! the only test here: tests of one binary run on parallel threads, and every thread's
//! allocations land in the same counter.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use kvblocks_core::pool::BlockPool;
use kvblocks_core::BlockHash;

/// [`System`], counting the bytes currently allocated and their high-water mark.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let live = LIVE.fetch_add(bytes, Relaxed) + bytes;
    PEAK.fetch_max(live, Relaxed);
}

fn shrank(bytes: usize) {
    LIVE.fetch_sub(bytes, Relaxed);
}

// SAFETY: every call is forwarded to `System` unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            grew(new_size);
            shrank(layout.size());
        }
        new
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bytes allocated now, beyond `baseline`.
fn live_since(baseline: usize) -> usize {
    LIVE.load(Relaxed).saturating_sub(baseline)
}

/// Whether the estimate is within 1% (plus a page) of the measurement, either way.
fn close(estimate: usize, measured: usize) -> bool {
    estimate.abs_diff(measured) <= measured / 100 + 4096
}

/// 1,048,576 blocks, all allocated and cached under distinct hashes (the worst case
/// for memory): the pool must stay under 100 bytes a block (94 today: 28 per block, a
/// 48-byte hash slot and the hash index). `heap_bytes` must agree with the count, so
/// its estimate cannot drift from what the pool really holds.
#[test]
fn a_million_blocks_fit_in_memory_budget() {
    const N: i64 = 1 << 20;
    const BLOCKS: usize = 1 << 20;
    // The inputs are built first, so that only the pool's own bytes are counted.
    let table: Vec<i64> = (1..N).collect();
    let hashes: Vec<BlockHash> = (0..N)
        .map(|i| BlockHash::new(&[i.to_le_bytes(), [7; 8], [9; 8], [3; 8]].concat()).unwrap())
        .collect();
    let baseline = LIVE.load(Relaxed);

    let mut pool = BlockPool::new(N, true).unwrap();
    let empty = live_since(baseline);
    let empty_estimate = pool.heap_bytes();

    // A fresh pool hands out its blocks in id order, so `table` is this allocation.
    let blocks = pool.get_new_blocks(N - 1).unwrap();
    assert!(blocks
        .iter()
        .map(|&b| i64::from(b))
        .eq(table.iter().copied()));
    drop(blocks);
    PEAK.store(LIVE.load(Relaxed), Relaxed);
    pool.cache_full_blocks(&table, &hashes, 0, N - 1, 0)
        .unwrap();
    let full = live_since(baseline);
    let caching_peak = PEAK.load(Relaxed).saturating_sub(baseline);
    let full_estimate = pool.heap_bytes();

    eprintln!(
        "empty: {empty} bytes measured ({} per block), heap_bytes {empty_estimate}",
        empty / BLOCKS
    );
    eprintln!(
        "full: {full} bytes measured ({} per block), heap_bytes {full_estimate}; \
         peak while caching {caching_peak}",
        full / BLOCKS
    );
    // Per block when empty: ref count 4 + free-queue links 8 + prefix map 16 bytes.
    assert!(empty <= 28 * BLOCKS + 1024, "empty pool: {empty} bytes");
    assert!(
        full / BLOCKS < 100,
        "{} bytes per block ({full} total)",
        full / BLOCKS
    );
    assert!(
        close(empty_estimate, empty),
        "empty pool: heap_bytes {empty_estimate}, measured {empty}"
    );
    assert!(
        close(full_estimate, full),
        "full pool: heap_bytes {full_estimate}, measured {full}"
    );
    assert_eq!(pool.num_cached_keys(), BLOCKS - 1);
    pool.free_blocks(&table).unwrap();
    assert_eq!(pool.num_free_blocks(), BLOCKS - 1);
}
