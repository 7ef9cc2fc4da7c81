//! Block hashes as fixed-size values, and the interner that stores each distinct
//! hash once however many blocks carry it.

use hashbrown::hash_table::Entry;
use hashbrown::HashTable;

use crate::error::{Error, Result};
use crate::index::ix;

/// The longest hash kvblocks stores: a SHA-256 digest. xxh3-128 digests are 16 bytes.
pub const MAX_HASH_LEN: usize = 32;

/// A block hash of 0 to 32 bytes, stored inline so that it never allocates.
///
/// The layout is for speed of copying: the bytes are 8-byte aligned and the length is
/// a full word, so a hash is always written and read as whole words. (With alignment 1
/// and a `u8` length, copies were written at odd offsets or in partial words and read
/// back with wider loads, the padding after the length included, which nobody stores;
/// the CPU cannot forward such a load from the pending stores, so it stalled on every
/// hash passed by value: about a third of `cache_full_blocks` in the pool churn.)
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(C, align(8))]
pub struct BlockHash {
    bytes: [u8; MAX_HASH_LEN],
    len: usize,
}

impl BlockHash {
    /// Wraps `bytes`.
    ///
    /// # Errors
    /// [`Error::HashTooLong`] when `bytes` is longer than [`MAX_HASH_LEN`].
    pub fn new(bytes: &[u8]) -> Result<Self> {
        // A full-length digest (the common case) is one fixed-size copy.
        if let Ok(bytes) = <[u8; MAX_HASH_LEN]>::try_from(bytes) {
            return Ok(Self::full(bytes));
        }
        let len = bytes.len();
        if len > MAX_HASH_LEN {
            return Err(Error::HashTooLong { len });
        }
        let mut out = [0u8; MAX_HASH_LEN];
        out[..len].copy_from_slice(bytes);
        Ok(Self { bytes: out, len })
    }

    /// A hash of exactly [`MAX_HASH_LEN`] bytes.
    pub fn full(bytes: [u8; MAX_HASH_LEN]) -> Self {
        Self {
            bytes,
            len: MAX_HASH_LEN,
        }
    }

    /// The hash's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// vLLM's `BlockHashWithGroupId`, which its `KVCacheBlock.block_hash` holds: the
    /// hash's bytes, then the group id as 4 big-endian bytes.
    pub fn with_group_id(&self, group_id: u32) -> Vec<u8> {
        [self.as_bytes(), &group_id.to_be_bytes()].concat()
    }
}

impl std::fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// The tag of a slot whose owner has set none.
pub const NO_TAG: u32 = u32::MAX;

/// One interner slot. Everything a lookup, an intern or a release reads of a slot
/// sits in one record, so touching a random slot costs one cache line or two, not
/// one per field.
#[derive(Debug, Clone, Copy)]
struct Slot {
    /// The hash a live slot holds (stale for a free slot).
    hash: BlockHash,
    /// Holders of the slot; 0 for a free slot.
    count: u32,
    /// A value the owner keeps with the hash ([`NO_TAG`] when unset or free): the
    /// prefix map keeps the key's group-0 head block here, next to the hash a lookup
    /// has just compared.
    tag: u32,
}

/// Stores each distinct [`BlockHash`] once, under a small integer slot id, and counts
/// how many holders (cached blocks) use it. A slot whose count drops to zero is
/// freed and reused by the next new hash.
///
/// The index is a hash table of 8-byte entries, a slot id and 32 bits of the hash's
/// fingerprint, rather than a `HashMap<BlockHash, u32>` (48-byte entries): every
/// hash's bytes are stored once, in its slot record, and the index of 65,536 cached
/// blocks is about 1.2 MB instead of 6.4 MB, which keeps its random probes in cache.
/// The fingerprint bits in the entry let a lookup skip the records of other hashes,
/// and let the index grow (rehash) without reading any slot record; releasing a slot
/// finds its entry by id.
///
/// Invariants (checked by [`HashInterner::check`]):
/// * a slot is live iff its count is non-zero; the index holds exactly the live
///   slots, once each, under their own fingerprint;
/// * free slots are exactly the slots listed in `free_slots`, and have no tag;
/// * no two live slots hold the same hash.
#[derive(Debug, Clone, Default)]
pub struct HashInterner {
    slots: Vec<Slot>,
    /// One entry per live slot.
    index: HashTable<IndexEntry>,
    /// Free slots, reused last-freed first.
    free_slots: Vec<u32>,
}

/// The interner's 64-bit key for `hash`.
///
/// Block hashes are digests, so their bytes are already uniform: a multiply-xor fold
/// of the four zero-padded words and the length (which tells `b"ab"` from
/// `b"ab\0"`), then a `SplitMix64` finaliser so that every bit is mixed even for
/// short, structured hashes. This costs a fraction of feeding the bytes through a
/// general-purpose hasher.
fn fingerprint(hash: &BlockHash) -> u64 {
    const MULTIPLIERS: [u64; 4] = [
        0x9e37_79b9_7f4a_7c15,
        0xc2b2_ae3d_27d4_eb4f,
        0x1656_67b1_9e37_79f9,
        0xd6e8_feb8_6659_fd93,
    ];
    let mut key = hash.len as u64;
    for (word, multiplier) in hash.bytes.chunks_exact(8).zip(MULTIPLIERS) {
        let mut le = [0u8; 8];
        le.copy_from_slice(word);
        key ^= u64::from_le_bytes(le).wrapping_mul(multiplier);
    }
    key ^= key >> 30;
    key = key.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    key ^= key >> 27;
    key = key.wrapping_mul(0x94d0_49bb_1331_11eb);
    key ^ (key >> 31)
}

/// An index entry: a live slot and the 32 fingerprint bits it is filed under.
#[derive(Debug, Clone, Copy)]
struct IndexEntry {
    slot: u32,
    key: u32,
}

/// The index key of `hash`: 32 well-mixed bits of its fingerprint.
fn index_key(hash: &BlockHash) -> u32 {
    // Truncation intended: the low half of an avalanche-mixed 64-bit value.
    #[allow(clippy::cast_possible_truncation)]
    let key = fingerprint(hash) as u32;
    key
}

/// The table hash of an index key. The key is already mixed, so repeating it in both
/// halves gives the table its bucket bits (low) and control-byte bits (high).
fn table_hash(key: u32) -> u64 {
    u64::from(key) * 0x1_0000_0001
}

impl HashInterner {
    /// An empty interner.
    pub fn new() -> Self {
        Self::default()
    }

    /// The number of distinct hashes held.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no hash is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn live(&self, slot: u32) -> Option<&Slot> {
        self.slots.get(ix(slot)).filter(|s| s.count > 0)
    }

    fn find(&self, hash: &BlockHash, key: u32) -> Option<u32> {
        let slots = &self.slots;
        self.index
            .find(table_hash(key), |e| {
                e.key == key && slots.get(ix(e.slot)).is_some_and(|s| s.hash == *hash)
            })
            .map(|e| e.slot)
    }

    /// The slot of `hash`, if it is held.
    pub fn lookup(&self, hash: &BlockHash) -> Option<u32> {
        self.find(hash, index_key(hash))
    }

    /// Adds one holder of `hash` and returns its slot, storing the hash if it is new.
    ///
    /// Returns `None` (changing nothing) only if `u32::MAX - 1` distinct hashes are
    /// already held, or if the slot already has `u32::MAX` holders.
    pub fn intern(&mut self, hash: &BlockHash) -> Option<u32> {
        self.intern_tagged(hash, NO_TAG).map(|(slot, _)| slot)
    }

    /// [`HashInterner::intern`] that also gives the slot the tag `tag` if it has none
    /// (a new slot never has one). Returns the slot and the tag it had before, so an
    /// owner keeping a head in the tag learns in the same probe whether it had one.
    ///
    /// Returns `None` in the cases [`HashInterner::intern`] does, changing nothing.
    pub fn intern_tagged(&mut self, hash: &BlockHash, tag: u32) -> Option<(u32, u32)> {
        let key = index_key(hash);
        let slots = &self.slots;
        // One probe finds the hash or the place a new entry goes.
        let entry = self.index.entry(
            table_hash(key),
            |e| e.key == key && slots.get(ix(e.slot)).is_some_and(|s| s.hash == *hash),
            |e| table_hash(e.key),
        );
        match entry {
            Entry::Occupied(held) => {
                let record = self.slots.get_mut(ix(held.get().slot))?;
                record.count = record.count.checked_add(1)?;
                let old_tag = record.tag;
                if old_tag == NO_TAG {
                    record.tag = tag;
                }
                Some((held.get().slot, old_tag))
            }
            Entry::Vacant(place) => {
                let record = Slot {
                    hash: *hash,
                    count: 1,
                    tag,
                };
                let slot = if let Some(slot) = self.free_slots.pop() {
                    self.slots[ix(slot)] = record;
                    slot
                } else {
                    let slot = u32::try_from(self.slots.len())
                        .ok()
                        .filter(|&s| s != NO_TAG)?;
                    self.slots.push(record);
                    slot
                };
                place.insert(IndexEntry { slot, key });
                Some((slot, NO_TAG))
            }
        }
    }

    /// Drops one holder of `slot`; the slot (and its tag) is freed when none remain.
    /// Returns false (changing nothing) if the slot is not live.
    pub fn release(&mut self, slot: u32) -> bool {
        let Some(record) = self.slots.get_mut(ix(slot)).filter(|s| s.count > 0) else {
            return false;
        };
        record.count -= 1;
        if record.count > 0 {
            return true;
        }
        record.tag = NO_TAG;
        let key = index_key(&record.hash);
        if let Ok(entry) = self.index.find_entry(table_hash(key), |e| e.slot == slot) {
            entry.remove();
        }
        self.free_slots.push(slot);
        true
    }

    /// The hash held by a live slot.
    pub fn get(&self, slot: u32) -> Option<&BlockHash> {
        self.live(slot).map(|s| &s.hash)
    }

    /// The number of holders of `slot` (0 for a free or unknown slot).
    pub fn count(&self, slot: u32) -> u32 {
        self.live(slot).map_or(0, |s| s.count)
    }

    /// The tag of a live slot ([`NO_TAG`] when unset, free or unknown).
    pub fn tag(&self, slot: u32) -> u32 {
        self.live(slot).map_or(NO_TAG, |s| s.tag)
    }

    /// Sets the tag of a live slot; returns false (changing nothing) for any other.
    pub fn set_tag(&mut self, slot: u32, tag: u32) -> bool {
        match self.slots.get_mut(ix(slot)).filter(|s| s.count > 0) {
            Some(record) => {
                record.tag = tag;
                true
            }
            None => false,
        }
    }

    /// Every live slot with a tag, as (slot, tag), in slot order.
    pub fn tags(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        (0u32..)
            .zip(&self.slots)
            .filter(|(_, s)| s.count > 0 && s.tag != NO_TAG)
            .map(|(slot, s)| (slot, s.tag))
    }

    /// One past the largest slot id ever handed out.
    pub fn slot_limit(&self) -> usize {
        self.slots.len()
    }

    /// Forgets every hash.
    pub fn clear(&mut self) {
        self.slots.clear();
        self.index.clear();
        self.free_slots.clear();
    }

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        self.slots.capacity() * size_of::<Slot>()
            + self.free_slots.capacity() * size_of::<u32>()
            + self.index.allocation_size()
    }

    /// Walks the structure and names the first broken rule.
    ///
    /// # Errors
    /// A description of the first inconsistency found.
    pub fn check(&self) -> std::result::Result<(), String> {
        let n = self.slots.len();
        let mut seen = vec![false; n];
        for &IndexEntry { slot, key } in &self.index {
            let i = ix(slot);
            if i >= n || seen[i] {
                return Err(format!("the index holds slot {slot} twice or out of range"));
            }
            seen[i] = true;
            let record = &self.slots[i];
            if record.count == 0 {
                return Err(format!("free slot {slot} is in the index"));
            }
            if key != index_key(&record.hash) || self.lookup(&record.hash) != Some(slot) {
                return Err(format!(
                    "slot {slot} is filed under the wrong key, or its hash is held twice"
                ));
            }
        }
        let live = self.slots.iter().filter(|s| s.count > 0).count();
        if live != self.len() {
            return Err(format!(
                "{live} slots are live but the index holds {}",
                self.len()
            ));
        }
        if self.free_slots.len() + live != n {
            return Err(format!(
                "{} free and {live} live slots, but {n} slots exist",
                self.free_slots.len()
            ));
        }
        for &slot in &self.free_slots {
            let free = self.slots.get(ix(slot));
            if free.is_none_or(|s| s.count != 0 || s.tag != NO_TAG) || seen[ix(slot)] {
                return Err(format!(
                    "slot {slot} is listed free but is live, tagged, unknown or listed twice"
                ));
            }
            seen[ix(slot)] = true;
        }
        Ok(())
    }
}

/// Approximate heap bytes of a `HashMap` whose `capacity()` is `capacity` and whose
/// entries are `entry` bytes: hashbrown keeps a power-of-two number of buckets with
/// a 7/8 load factor and one control byte per bucket.
pub(crate) fn map_heap_bytes(capacity: usize, entry: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        capacity + 1
    } else {
        (capacity.saturating_mul(8) / 7).next_power_of_two()
    };
    buckets.saturating_mul(entry + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(bytes: &[u8]) -> BlockHash {
        BlockHash::new(bytes).unwrap()
    }

    #[test]
    fn intern_release_reuse() {
        let mut it = HashInterner::new();
        let a = it.intern(&h(b"a")).unwrap();
        let b = it.intern(&h(b"b")).unwrap();
        assert_ne!(a, b);
        assert_eq!(it.intern(&h(b"a")), Some(a));
        assert_eq!(it.count(a), 2);
        assert_eq!(it.len(), 2);
        assert!(it.release(a));
        assert_eq!(it.lookup(&h(b"a")), Some(a));
        assert!(it.release(a));
        assert_eq!(it.lookup(&h(b"a")), None);
        assert!(!it.release(a));
        assert_eq!(it.get(a), None);
        let c = it.intern(&h(b"")).unwrap();
        assert_eq!(c, a, "freed slot is reused");
        assert_eq!(it.get(c), Some(&h(b"")));
        it.check().unwrap();
        it.clear();
        assert!(it.is_empty());
        it.check().unwrap();
    }

    #[test]
    fn hashes_sharing_an_index_key_stay_apart() {
        // Two of 200,000 small hashes share 32 fingerprint bits (birthday bound).
        let mut by_key = std::collections::HashMap::new();
        let (a, b) = (0u32..200_000)
            .map(|i| h(&i.to_le_bytes()))
            .find_map(|x| by_key.insert(index_key(&x), x).map(|y| (y, x)))
            .expect("no two hashes share an index key");
        let mut it = HashInterner::new();
        let (sa, sb) = (it.intern(&a).unwrap(), it.intern(&b).unwrap());
        assert_ne!(sa, sb);
        assert_eq!((it.lookup(&a), it.lookup(&b)), (Some(sa), Some(sb)));
        it.check().unwrap();
        assert!(it.release(sa));
        assert_eq!((it.lookup(&a), it.lookup(&b)), (None, Some(sb)));
        it.check().unwrap();
    }

    #[test]
    fn hashes_copy_as_whole_words() {
        // The layout the type's docs explain: 8-byte aligned bytes, a full-word length.
        assert_eq!(std::mem::align_of::<BlockHash>(), 8);
        assert_eq!(std::mem::size_of::<BlockHash>(), MAX_HASH_LEN + 8);
        assert_eq!(BlockHash::full([3; 32]), h(&[3; 32]));
        assert_eq!(h(&[3; 5]).as_bytes(), &[3; 5]);
    }

    #[test]
    fn too_long_hash() {
        assert_eq!(
            BlockHash::new(&[0; 33]),
            Err(Error::HashTooLong { len: 33 })
        );
        assert_eq!(h(&[7; 32]).as_bytes(), &[7; 32]);
    }
}

/// [`HashInterner::check`] against one broken private field at a time: each rule the
/// checker names must be caught, or a corrupted interner would pass as valid.
#[cfg(test)]
pub(crate) mod corruption_tests {
    use super::*;

    fn h(b: u8) -> BlockHash {
        BlockHash::new(&[b; 32]).unwrap()
    }

    /// Drops the index entry of live `slot`, for the prefix map's checker tests.
    pub(crate) fn unindex(it: &mut HashInterner, slot: u32) {
        let key = index_key(&it.slots[ix(slot)].hash);
        it.index
            .find_entry(table_hash(key), |e| e.slot == slot)
            .expect("slot is indexed")
            .remove();
    }

    /// Files `entry` in the index as a correct insert would (bucket from its key).
    fn file(it: &mut HashInterner, entry: IndexEntry) {
        it.index
            .insert_unique(table_hash(entry.key), entry, |e| table_hash(e.key));
    }

    /// Live slots 0 (hash 10, two holders) and 1 (hash 11, tagged 7); free slots 2
    /// and 3, freed in that order. Checked valid before any corruption.
    fn valid_interner() -> HashInterner {
        let mut it = HashInterner::new();
        assert_eq!(it.intern(&h(10)), Some(0));
        assert_eq!(it.intern(&h(10)), Some(0));
        assert_eq!(it.intern_tagged(&h(11), 7), Some((1, NO_TAG)));
        assert_eq!(it.intern_tagged(&h(12), 8), Some((2, NO_TAG)));
        assert_eq!(it.intern(&h(13)), Some(3));
        assert!(it.release(2) && it.release(3));
        assert_eq!(it.free_slots, [2, 3]);
        it.check().unwrap();
        it
    }

    fn assert_caught(it: &HashInterner, fragment: &str) {
        let err = it.check().expect_err("the corruption went unnoticed");
        assert!(err.contains(fragment), "{err:?} does not name {fragment:?}");
    }

    #[test]
    fn index_entry_for_a_slot_that_does_not_exist() {
        let mut it = valid_interner();
        file(&mut it, IndexEntry { slot: 9, key: 1 });
        assert_caught(&it, "the index holds slot 9 twice or out of range");
    }

    #[test]
    fn index_entry_repeated() {
        let mut it = valid_interner();
        let key = index_key(&h(11));
        file(&mut it, IndexEntry { slot: 1, key });
        assert_caught(&it, "the index holds slot 1 twice or out of range");
    }

    /// A live slot's holder count dropped to zero while it is still indexed.
    #[test]
    fn indexed_slot_with_count_zero() {
        let mut it = valid_interner();
        it.slots[0].count = 0;
        assert_caught(&it, "free slot 0 is in the index");
    }

    #[test]
    fn index_entry_filed_under_the_wrong_key() {
        let mut it = valid_interner();
        for entry in it.index.iter_mut().filter(|e| e.slot == 1) {
            entry.key ^= 1;
        }
        assert_caught(&it, "slot 1 is filed under the wrong key");
    }

    /// A slot's hash bytes overwritten: its entry no longer matches its hash.
    #[test]
    fn slot_hash_changed_under_its_index_entry() {
        let mut it = valid_interner();
        it.slots[1].hash = h(99);
        assert_caught(&it, "slot 1 is filed under the wrong key");
    }

    /// Slot 1 holds slot 0's hash and is filed under that hash's key, as if the same
    /// hash had been interned twice: only the lookup tells them apart.
    #[test]
    fn two_live_slots_hold_the_same_hash() {
        let mut it = valid_interner();
        unindex(&mut it, 1);
        it.slots[1].hash = h(10);
        file(
            &mut it,
            IndexEntry {
                slot: 1,
                key: index_key(&h(10)),
            },
        );
        assert_caught(&it, "or its hash is held twice");
    }

    #[test]
    fn live_slot_missing_from_the_index() {
        let mut it = valid_interner();
        unindex(&mut it, 1);
        assert_caught(&it, "2 slots are live but the index holds 1");
    }

    /// A free slot with a holder count is live by the count, but unindexed.
    #[test]
    fn free_slot_with_a_count() {
        let mut it = valid_interner();
        it.slots[3].count = 1;
        assert_caught(&it, "3 slots are live but the index holds 2");
    }

    #[test]
    fn free_slot_not_listed_free() {
        let mut it = valid_interner();
        it.free_slots.pop();
        assert_caught(&it, "1 free and 2 live slots, but 4 slots exist");
    }

    #[test]
    fn free_list_names_a_live_slot() {
        let mut it = valid_interner();
        it.free_slots[1] = 0;
        assert_caught(&it, "slot 0 is listed free but is live");
    }

    #[test]
    fn free_slot_keeps_a_tag() {
        let mut it = valid_interner();
        it.slots[2].tag = 8;
        assert_caught(&it, "slot 2 is listed free but is live, tagged");
    }

    #[test]
    fn free_list_names_an_unknown_slot() {
        let mut it = valid_interner();
        it.free_slots[1] = 9;
        assert_caught(&it, "slot 9 is listed free but is live, tagged, unknown");
    }

    #[test]
    fn free_list_names_a_slot_twice() {
        let mut it = valid_interner();
        it.free_slots[1] = 2;
        assert_caught(
            &it,
            "slot 2 is listed free but is live, tagged, unknown or listed twice",
        );
    }
}
