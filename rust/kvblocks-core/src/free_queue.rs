//! The free-block queue: vLLM's `FreeKVCacheBlockQueue` as an index-linked list.
//!
//! Instead of `prev`/`next` pointers stored in block objects, the links live in one
//! flat array of `(prev, next)` records indexed by block id. Two extra slots past the last block
//! are the head and tail sentinels, so linking and unlinking never branch on "is this
//! the first/last element". Every operation is O(1) except the iterator and
//! [`FreeQueue::check`].
//!
//! Invariants (checked by [`FreeQueue::check`]):
//! * a block is in the queue iff its `next` slot is not [`NOT_IN_QUEUE`]; a block
//!   outside the queue has both slots set to [`NOT_IN_QUEUE`];
//! * walking `next` from the head sentinel visits exactly `len` blocks and ends at
//!   the tail sentinel, and `prev` mirrors `next` at every step.

use crate::error::{Error, Result};
use crate::index::{ix, try_filled_vec};

/// Link value of a block that is not in the queue (and of the head's `prev` and the
/// tail's `next`).
pub const NOT_IN_QUEUE: u32 = u32::MAX;

/// The largest capacity a queue can have: the two sentinel slots and the
/// [`NOT_IN_QUEUE`] marker must still fit in a `u32`.
pub const MAX_CAPACITY: u32 = u32::MAX - 2;

/// The neighbours of one queue slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Link {
    prev: u32,
    next: u32,
}

const UNLINKED: Link = Link {
    prev: NOT_IN_QUEUE,
    next: NOT_IN_QUEUE,
};

/// A doubly-linked queue of block ids `0 .. capacity`, head first.
///
/// The head is the next block to be allocated (or evicted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreeQueue {
    /// `links[id]`: the elements before and after `id` (block ids or sentinels). Both
    /// links of a block share one 8-byte record: unlinking a random block touches one
    /// cache line for it, not two.
    links: Vec<Link>,
    /// Number of blocks in the queue.
    len: usize,
    /// Slot of the head sentinel, equal to the capacity.
    head: u32,
    /// Slot of the tail sentinel, `head + 1`.
    tail: u32,
}

impl FreeQueue {
    /// An empty queue that can hold the block ids `0 .. capacity`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `capacity` exceeds [`MAX_CAPACITY`] or the
    /// link arrays cannot be allocated.
    pub fn new(capacity: u32) -> Result<Self> {
        if capacity > MAX_CAPACITY {
            return Err(Error::InvalidArgument(format!(
                "a free queue holds at most {MAX_CAPACITY} blocks, got {capacity}"
            )));
        }
        let slots = ix(capacity) + 2;
        let mut links = try_filled_vec(UNLINKED, slots)?;
        let head = capacity;
        let tail = capacity + 1;
        links[ix(head)].next = tail;
        links[ix(tail)].prev = head;
        Ok(Self {
            links,
            len: 0,
            head,
            tail,
        })
    }

    /// The number of block ids the queue can hold.
    pub fn capacity(&self) -> u32 {
        self.head
    }

    /// The number of blocks in the queue.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the queue is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `id` is in the queue (false for ids outside the capacity).
    pub fn contains(&self, id: u32) -> bool {
        id < self.head && self.links[ix(id)].next != NOT_IN_QUEUE
    }

    /// The head block (next to be allocated), if any.
    pub fn front(&self) -> Option<u32> {
        let first = self.links[ix(self.head)].next;
        (first != self.tail).then_some(first)
    }

    /// Removes and returns the head block.
    pub fn pop_front(&mut self) -> Option<u32> {
        let first = self.front()?;
        self.unlink(first);
        Some(first)
    }

    /// Appends `id` at the tail. Returns false (and changes nothing) if `id` is out of
    /// range or already queued.
    pub fn push_back(&mut self, id: u32) -> bool {
        if id >= self.head || self.contains(id) {
            return false;
        }
        let last = self.links[ix(self.tail)].prev;
        self.link_after(last, id);
        true
    }

    /// Inserts `id` at the head. Returns false (and changes nothing) if `id` is out of
    /// range or already queued.
    pub fn push_front(&mut self, id: u32) -> bool {
        if id >= self.head || self.contains(id) {
            return false;
        }
        self.link_after(self.head, id);
        true
    }

    /// Inserts `ids` at the head keeping their order: `[a, b]` gives
    /// `head -> a -> b -> old first` (vLLM's `prepend_n`).
    ///
    /// All or nothing: returns false and leaves the queue unchanged if any id is out
    /// of range, already queued, or repeated.
    pub fn push_front_run(&mut self, ids: &[u32]) -> bool {
        for (pushed, &id) in ids.iter().rev().enumerate() {
            if !self.push_front(id) {
                // The `pushed` ids inserted so far sit at the head: pop them again.
                for _ in 0..pushed {
                    self.pop_front();
                }
                return false;
            }
        }
        true
    }

    /// Unlinks `id` from wherever it is in the queue. Returns false (and changes
    /// nothing) if it is not queued.
    pub fn remove(&mut self, id: u32) -> bool {
        if !self.contains(id) {
            return false;
        }
        self.unlink(id);
        true
    }

    /// The queued blocks, head first.
    pub fn iter(&self) -> Iter<'_> {
        Iter {
            queue: self,
            cursor: self.links[ix(self.head)].next,
            remaining: self.len,
        }
    }

    /// Heap bytes held by the link arrays.
    pub fn heap_bytes(&self) -> usize {
        self.links.capacity() * std::mem::size_of::<Link>()
    }

    /// Walks the whole structure and names the first broken rule.
    ///
    /// # Errors
    /// A description of the first inconsistency found.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.links[ix(self.head)].prev != NOT_IN_QUEUE
            || self.links[ix(self.tail)].next != NOT_IN_QUEUE
        {
            return Err("a sentinel has an outer link".to_owned());
        }
        let mut before = self.head;
        let mut cursor = self.links[ix(self.head)].next;
        let mut walked = 0usize;
        while cursor != self.tail {
            if cursor >= self.head {
                return Err(format!(
                    "link from {before} points at invalid slot {cursor}"
                ));
            }
            if self.links[ix(cursor)].prev != before {
                return Err(format!(
                    "block {cursor} has prev {} but follows {before}",
                    self.links[ix(cursor)].prev
                ));
            }
            // No cycle check is needed: a cycle revisits a block whose `prev` still names
            // its first predecessor, which the check above refuses, so the walk ends.
            walked += 1;
            before = cursor;
            cursor = self.links[ix(cursor)].next;
        }
        if self.links[ix(self.tail)].prev != before {
            return Err(format!(
                "tail sentinel has prev {} but the last block is {before}",
                self.links[ix(self.tail)].prev
            ));
        }
        if walked != self.len {
            return Err(format!(
                "the list has {walked} blocks but len is {}",
                self.len
            ));
        }
        let mut members = 0usize;
        for id in 0..self.head {
            let (p, n) = (self.links[ix(id)].prev, self.links[ix(id)].next);
            if (p == NOT_IN_QUEUE) != (n == NOT_IN_QUEUE) {
                return Err(format!("block {id} is half linked (prev {p}, next {n})"));
            }
            if n != NOT_IN_QUEUE {
                members += 1;
            }
        }
        if members != self.len {
            return Err(format!(
                "{members} blocks carry links but len is {}",
                self.len
            ));
        }
        Ok(())
    }

    /// Links `id` (not queued, in range) right after `after` (a block or the head).
    fn link_after(&mut self, after: u32, id: u32) {
        let following = self.links[ix(after)].next;
        self.links[ix(after)].next = id;
        self.links[ix(id)].prev = after;
        self.links[ix(id)].next = following;
        self.links[ix(following)].prev = id;
        self.len += 1;
    }

    /// Unlinks a queued block and marks it as outside the queue.
    fn unlink(&mut self, id: u32) {
        let (p, n) = (self.links[ix(id)].prev, self.links[ix(id)].next);
        self.links[ix(p)].next = n;
        self.links[ix(n)].prev = p;
        self.links[ix(id)] = UNLINKED;
        self.len -= 1;
    }
}

impl<'a> IntoIterator for &'a FreeQueue {
    type Item = u32;
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

/// Iterator over a [`FreeQueue`], head first.
#[derive(Debug, Clone)]
pub struct Iter<'a> {
    queue: &'a FreeQueue,
    cursor: u32,
    /// Bounds the walk, so even a corrupted list cannot loop forever.
    remaining: usize,
}

impl Iterator for Iter<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        if self.remaining == 0 || self.cursor >= self.queue.head {
            return None;
        }
        let id = self.cursor;
        self.cursor = self.queue.links[ix(id)].next;
        self.remaining -= 1;
        Some(id)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.remaining))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue_of(cap: u32, ids: &[u32]) -> FreeQueue {
        let mut q = FreeQueue::new(cap).unwrap();
        for &id in ids {
            assert!(q.push_back(id));
        }
        q
    }

    fn order(q: &FreeQueue) -> Vec<u32> {
        q.iter().collect()
    }

    #[test]
    fn prepend_append_remove_pop() {
        let mut q = queue_of(8, &[0]);
        assert!(q.push_front_run(&[4, 5]));
        assert!(q.push_front_run(&[1, 2]));
        assert_eq!(order(&q), [1, 2, 4, 5, 0]);
        assert!(q.remove(4));
        assert!(!q.remove(4));
        assert!(q.push_back(7));
        assert_eq!(order(&q), [1, 2, 5, 0, 7]);
        assert_eq!(q.pop_front(), Some(1));
        assert_eq!(q.len(), 4);
        q.check().unwrap();
        while q.pop_front().is_some() {}
        assert!(q.is_empty());
        assert_eq!(q.front(), None);
        q.check().unwrap();
    }

    #[test]
    fn failed_run_changes_nothing() {
        let mut q = queue_of(8, &[3, 6]);
        let before = q.clone();
        assert!(!q.push_front_run(&[1, 2, 3]));
        assert_eq!(q, before);
        assert!(!q.push_front_run(&[1, 2, 1]));
        assert_eq!(q, before);
        assert!(!q.push_front_run(&[8]));
        assert!(!q.push_back(8) && !q.push_front(3) && !q.remove(9));
        assert_eq!(q, before);
        assert!(!q.contains(u32::MAX));
    }

    #[test]
    fn capacity_limit() {
        assert!(FreeQueue::new(MAX_CAPACITY + 1).is_err());
        let q = FreeQueue::new(0).unwrap();
        assert!(q.is_empty());
        q.check().unwrap();
    }
}

/// [`FreeQueue::check`] against one broken private field at a time: each rule the
/// checker names must be caught, or a corrupted queue would pass as valid.
#[cfg(test)]
pub(crate) mod corruption_tests {
    use super::*;

    /// Makes `q` claim one more block than it links, for the pool's checker tests.
    pub(crate) fn overstate_len(q: &mut FreeQueue) {
        q.len += 1;
    }

    /// Blocks 1, 2, 3 queued in a queue of 8; checked valid before any corruption.
    fn valid_queue() -> FreeQueue {
        let mut q = FreeQueue::new(8).unwrap();
        for id in [1, 2, 3] {
            assert!(q.push_back(id));
        }
        q.check().unwrap();
        q
    }

    fn assert_caught(q: &FreeQueue, fragment: &str) {
        let err = q.check().expect_err("the corruption went unnoticed");
        assert!(err.contains(fragment), "{err:?} does not name {fragment:?}");
    }

    #[test]
    fn head_sentinel_with_a_prev_link() {
        let mut q = valid_queue();
        let head = ix(q.head);
        q.links[head].prev = 2;
        assert_caught(&q, "a sentinel has an outer link");
    }

    #[test]
    fn tail_sentinel_with_a_next_link() {
        let mut q = valid_queue();
        let tail = ix(q.tail);
        q.links[tail].next = 2;
        assert_caught(&q, "a sentinel has an outer link");
    }

    #[test]
    fn next_link_to_a_slot_that_is_no_block() {
        let mut q = valid_queue();
        q.links[2].next = NOT_IN_QUEUE;
        assert_caught(
            &q,
            &format!("link from 2 points at invalid slot {NOT_IN_QUEUE}"),
        );
    }

    #[test]
    fn next_link_back_to_the_head_sentinel() {
        let mut q = valid_queue();
        q.links[2].next = q.head;
        assert_caught(&q, "link from 2 points at invalid slot 8");
    }

    #[test]
    fn prev_link_not_mirroring_next() {
        let mut q = valid_queue();
        q.links[3].prev = 1;
        assert_caught(&q, "block 3 has prev 1 but follows 2");
    }

    /// A cycle always revisits a block whose `prev` names its first predecessor, so
    /// the back-link rule catches it before the walk could count past the capacity.
    #[test]
    fn cycle_in_next_links_is_caught_as_a_broken_back_link() {
        let mut q = valid_queue();
        q.links[3].next = 1;
        assert_caught(&q, "block 1 has prev 8 but follows 3");
        let mut q = valid_queue();
        q.links[2].next = 2;
        assert_caught(&q, "block 2 has prev 1 but follows 2");
    }

    #[test]
    fn tail_sentinel_prev_not_the_last_block() {
        let mut q = valid_queue();
        let tail = ix(q.tail);
        q.links[tail].prev = 2;
        assert_caught(&q, "tail sentinel has prev 2 but the last block is 3");
    }

    #[test]
    fn len_overstated() {
        let mut q = valid_queue();
        overstate_len(&mut q);
        assert_caught(&q, "the list has 3 blocks but len is 4");
    }

    #[test]
    fn len_understated() {
        let mut q = valid_queue();
        q.len -= 1;
        assert_caught(&q, "the list has 3 blocks but len is 2");
    }

    #[test]
    fn unqueued_block_with_one_link() {
        let mut q = valid_queue();
        q.links[5].prev = 1;
        assert_caught(&q, "block 5 is half linked");
    }

    /// Both links set makes `contains` report the block as free, though no walk
    /// reaches it.
    #[test]
    fn unqueued_block_with_both_links() {
        let mut q = valid_queue();
        q.links[5] = Link {
            prev: 3,
            next: q.tail,
        };
        assert!(q.contains(5));
        assert_caught(&q, "4 blocks carry links but len is 3");
    }
}
