//! Block hashes as fixed-size values, and the interner that stores each distinct
//! hash once however many blocks carry it.

use rustc_hash::FxHashMap;

use crate::error::{Error, Result};
use crate::free_queue::ix;

/// The longest hash kvblocks stores: a SHA-256 digest. xxh3-128 digests are 16 bytes.
pub const MAX_HASH_LEN: usize = 32;

/// A block hash of 0 to 32 bytes, stored inline so that it never allocates.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash {
    bytes: [u8; MAX_HASH_LEN],
    len: u8,
}

impl BlockHash {
    /// Wraps `bytes`.
    ///
    /// # Errors
    /// [`Error::HashTooLong`] when `bytes` is longer than [`MAX_HASH_LEN`].
    pub fn new(bytes: &[u8]) -> Result<Self> {
        let len = bytes.len();
        if len > MAX_HASH_LEN {
            return Err(Error::HashTooLong { len });
        }
        let mut out = [0u8; MAX_HASH_LEN];
        out[..len].copy_from_slice(bytes);
        // len <= 32 was checked above, so it fits in a u8.
        #[allow(clippy::cast_possible_truncation)]
        Ok(Self {
            bytes: out,
            len: len as u8,
        })
    }

    /// The hash's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
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

/// Marker for "no slot" in the interner's fingerprint chains.
const NO_SLOT: u32 = u32::MAX;

/// Stores each distinct [`BlockHash`] once, under a small integer slot id, and counts
/// how many holders (cached blocks) use it. A slot whose count drops to zero is
/// freed and reused by the next new hash.
///
/// Memory: rather than a `HashMap<BlockHash, u32>` (40-byte entries), the map goes
/// from a 64-bit fingerprint of the hash to the first slot with that fingerprint;
/// slots sharing a fingerprint are chained through `fp_next`. Entries are 16 bytes,
/// and every hash's bytes are stored exactly once (in `hashes`).
///
/// Invariants (checked by [`HashInterner::check`]):
/// * a slot is live iff its count is non-zero; live slots are exactly the slots
///   reachable from `by_fp`, each in the chain of its own fingerprint, once;
/// * free slots are exactly the slots listed in `free_slots`;
/// * no two live slots hold the same hash.
#[derive(Debug, Clone, Default)]
pub struct HashInterner {
    /// `hashes[slot]`: the hash a live slot holds (stale for free slots).
    hashes: Vec<BlockHash>,
    /// `counts[slot]`: holders of the slot; 0 for a free slot.
    counts: Vec<u32>,
    /// `fp_next[slot]`: the next live slot with the same fingerprint, or `NO_SLOT`.
    fp_next: Vec<u32>,
    /// Fingerprint → first live slot of its chain.
    by_fp: FxHashMap<u64, u32>,
    /// Free slots, reused last-freed first.
    free_slots: Vec<u32>,
}

fn fingerprint(hash: &BlockHash) -> u64 {
    use std::hash::BuildHasher;
    rustc_hash::FxBuildHasher.hash_one(hash)
}

impl HashInterner {
    /// An empty interner.
    pub fn new() -> Self {
        Self::default()
    }

    /// The number of distinct hashes held.
    pub fn len(&self) -> usize {
        self.hashes.len() - self.free_slots.len()
    }

    /// Whether no hash is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The slot of `hash`, if it is held.
    pub fn lookup(&self, hash: &BlockHash) -> Option<u32> {
        let mut slot = *self.by_fp.get(&fingerprint(hash))?;
        while slot != NO_SLOT {
            let i = usize::try_from(slot).ok()?;
            if self.hashes.get(i) == Some(hash) {
                return Some(slot);
            }
            slot = *self.fp_next.get(i)?;
        }
        None
    }

    /// Adds one holder of `hash` and returns its slot, storing the hash if it is new.
    ///
    /// Returns `None` (changing nothing) only if `u32::MAX - 1` distinct hashes are
    /// already held, or if the slot already has `u32::MAX` holders.
    pub fn intern(&mut self, hash: &BlockHash) -> Option<u32> {
        if let Some(slot) = self.lookup(hash) {
            let count = self.counts.get_mut(usize::try_from(slot).ok()?)?;
            *count = count.checked_add(1)?;
            return Some(slot);
        }
        let fp = fingerprint(hash);
        let chain_head = self.by_fp.get(&fp).copied().unwrap_or(NO_SLOT);
        let slot = if let Some(slot) = self.free_slots.pop() {
            let i = usize::try_from(slot).ok()?;
            self.hashes[i] = *hash;
            self.counts[i] = 1;
            self.fp_next[i] = chain_head;
            slot
        } else {
            let slot = u32::try_from(self.hashes.len())
                .ok()
                .filter(|&s| s != NO_SLOT)?;
            self.hashes.push(*hash);
            self.counts.push(1);
            self.fp_next.push(chain_head);
            slot
        };
        self.by_fp.insert(fp, slot);
        Some(slot)
    }

    /// Drops one holder of `slot`; the slot is freed when none remain. Returns false
    /// (changing nothing) if the slot is not live.
    pub fn release(&mut self, slot: u32) -> bool {
        let Some(i) = usize::try_from(slot)
            .ok()
            .filter(|&i| self.counts.get(i).is_some_and(|&c| c > 0))
        else {
            return false;
        };
        self.counts[i] -= 1;
        if self.counts[i] > 0 {
            return true;
        }
        let fp = fingerprint(&self.hashes[i]);
        let after = self.fp_next[i];
        self.fp_next[i] = NO_SLOT;
        match self.by_fp.get(&fp).copied() {
            Some(head) if head == slot => {
                if after == NO_SLOT {
                    self.by_fp.remove(&fp);
                } else {
                    self.by_fp.insert(fp, after);
                }
            }
            Some(head) => {
                // Fingerprint collisions are rare: chains have one slot almost always.
                let mut cursor = head;
                while let Some(&next) = usize::try_from(cursor)
                    .ok()
                    .and_then(|c| self.fp_next.get(c))
                {
                    if next == slot {
                        self.fp_next[ix(cursor)] = after;
                        break;
                    }
                    cursor = next;
                }
            }
            None => {}
        }
        self.free_slots.push(slot);
        true
    }

    /// The hash held by a live slot.
    pub fn get(&self, slot: u32) -> Option<&BlockHash> {
        let i = usize::try_from(slot).ok()?;
        (*self.counts.get(i)? > 0).then(|| &self.hashes[i])
    }

    /// The number of holders of `slot` (0 for a free or unknown slot).
    pub fn count(&self, slot: u32) -> u32 {
        usize::try_from(slot)
            .ok()
            .and_then(|i| self.counts.get(i))
            .copied()
            .unwrap_or(0)
    }

    /// One past the largest slot id ever handed out.
    pub fn slot_limit(&self) -> usize {
        self.hashes.len()
    }

    /// Forgets every hash.
    pub fn clear(&mut self) {
        self.hashes.clear();
        self.counts.clear();
        self.fp_next.clear();
        self.by_fp.clear();
        self.free_slots.clear();
    }

    /// Heap bytes held, counting hash-map buckets at their allocated size.
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        self.hashes.capacity() * size_of::<BlockHash>()
            + (self.counts.capacity() + self.fp_next.capacity() + self.free_slots.capacity())
                * size_of::<u32>()
            + map_heap_bytes(self.by_fp.capacity(), size_of::<(u64, u32)>())
    }

    /// Walks the structure and names the first broken rule.
    ///
    /// # Errors
    /// A description of the first inconsistency found.
    pub fn check(&self) -> std::result::Result<(), String> {
        let n = self.hashes.len();
        if self.counts.len() != n || self.fp_next.len() != n {
            return Err("slot arrays differ in length".to_owned());
        }
        let mut seen = vec![false; n];
        let mut reached = 0usize;
        for (&fp, &head) in &self.by_fp {
            let mut slot = head;
            while slot != NO_SLOT {
                let i = ix(slot);
                if i >= n || seen[i] {
                    return Err(format!(
                        "fingerprint chain {fp:#x} reaches slot {slot} twice or out of range"
                    ));
                }
                seen[i] = true;
                reached += 1;
                if self.counts[i] == 0 {
                    return Err(format!("free slot {slot} is in a fingerprint chain"));
                }
                if fingerprint(&self.hashes[i]) != fp {
                    return Err(format!(
                        "slot {slot} is chained under the wrong fingerprint"
                    ));
                }
                slot = self.fp_next[i];
            }
        }
        if reached != self.len() {
            return Err(format!(
                "{reached} slots are reachable but {} are live",
                self.len()
            ));
        }
        for &slot in &self.free_slots {
            if self.count(slot) != 0 || ix(slot) >= n {
                return Err(format!("slot {slot} is listed free but is live or unknown"));
            }
        }
        for (i, &live) in seen.iter().enumerate() {
            if live && self.lookup(&self.hashes[i]).map(ix) != Some(i) {
                return Err(format!("slot {i} holds a hash stored in another slot too"));
            }
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
    fn too_long_hash() {
        assert_eq!(
            BlockHash::new(&[0; 33]),
            Err(Error::HashTooLong { len: 33 })
        );
        assert_eq!(h(&[7; 32]).as_bytes(), &[7; 32]);
    }
}
