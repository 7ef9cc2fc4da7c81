//! KV cache events (vLLM's `BlockStored`, `BlockRemoved`, `AllBlocksCleared`) as
//! compact records.
//!
//! A pool records events only once [`EventLog::enable`] ran (a manager created with
//! events on does it), so a pool without events pays one branch per eviction. Records
//! hold no heap object of their own: a `Stored` names its hashes and token ids as
//! ranges of two buffers the whole log shares, a `Removed` holds its one hash inline.
//! The bindings turn records into Python objects only when the events are taken.
//!
//! Like vLLM's `kv_event_queue`, the log grows until it is taken or cleared.
//!
//! Invariant: every range of a [`StoredRecord`] lies within the log's buffers.

use std::ops::Range;

use crate::block_hash::BlockHash;

/// How a pool records events, fixed when they are enabled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventConfig {
    /// Tokens per block (the `block_size` of every `BlockStored`).
    pub block_size: usize,
    /// Router-grade option, off in vLLM: record a removal only when the last block
    /// cached under its hash and group goes, not once per block.
    pub last_copy_removal: bool,
}

/// One `BlockStored`: blocks of a request entered the prefix cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRecord {
    /// The stored blocks' hashes: a range of the log's hash buffer.
    pub hashes: Range<usize>,
    /// The request's hash just before the first stored block (`None` from block 0).
    pub parent: Option<BlockHash>,
    /// The request's token ids of the stored blocks: a range of the log's token buffer.
    pub tokens: Range<usize>,
    /// Index of the first stored block in the request's block table.
    pub first_block: usize,
    /// The KV cache group id.
    pub group: u32,
    /// Tokens per block of the group.
    pub block_size: usize,
    /// The table indices of the stored blocks (a range of the log's position buffer)
    /// when the step stored only some of its blocks: a group whose window skips blocks.
    pub positions: Option<Range<usize>>,
}

/// One recorded event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventRecord {
    /// `BlockStored`.
    Stored(StoredRecord),
    /// `BlockRemoved` of one (hash, group) prefix-cache entry.
    Removed {
        /// The hash removed.
        hash: BlockHash,
        /// Its group id.
        group: u32,
    },
    /// `AllBlocksCleared`: the prefix cache was reset.
    AllCleared,
}

/// The events recorded since they were last taken, oldest first.
#[derive(Debug, Clone, Default)]
pub struct EventLog {
    /// `None` while events are off: nothing is recorded.
    config: Option<EventConfig>,
    records: Vec<EventRecord>,
    hashes: Vec<BlockHash>,
    tokens: Vec<i64>,
    positions: Vec<usize>,
}

impl EventLog {
    /// Starts recording with `config` (replacing an earlier configuration).
    pub fn enable(&mut self, config: EventConfig) {
        self.config = Some(config);
    }

    /// The configuration, or `None` while events are off.
    pub fn config(&self) -> Option<EventConfig> {
        self.config
    }

    /// Whether events are recorded.
    pub fn is_enabled(&self) -> bool {
        self.config.is_some()
    }

    /// The records, oldest first.
    pub fn records(&self) -> &[EventRecord] {
        &self.records
    }

    /// The number of records.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether there is no record.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The hashes of a record of this log (empty for a record of another log).
    pub fn stored_hashes(&self, record: &StoredRecord) -> &[BlockHash] {
        self.hashes.get(record.hashes.clone()).unwrap_or_default()
    }

    /// The token ids of a record of this log (empty for a record of another log).
    pub fn stored_tokens(&self, record: &StoredRecord) -> &[i64] {
        self.tokens.get(record.tokens.clone()).unwrap_or_default()
    }

    /// The table indices of a record's stored blocks, when the step stored only some
    /// of its blocks (`None` then, and for a record of another log).
    pub fn stored_positions(&self, record: &StoredRecord) -> Option<&[usize]> {
        record
            .positions
            .as_ref()
            .and_then(|r| self.positions.get(r.clone()))
    }

    /// Drops every record, keeping the buffers for the next ones.
    pub fn clear(&mut self) {
        self.records.clear();
        self.hashes.clear();
        self.tokens.clear();
        self.positions.clear();
    }

    /// Heap bytes held by the buffers.
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        self.records.capacity() * size_of::<EventRecord>()
            + self.hashes.capacity() * size_of::<BlockHash>()
            + self.tokens.capacity() * size_of::<i64>()
            + self.positions.capacity() * size_of::<usize>()
    }

    /// Records a `BlockStored` (if events are on).
    pub(crate) fn record_stored(
        &mut self,
        hashes: &[BlockHash],
        parent: Option<BlockHash>,
        tokens: &[i64],
        first_block: usize,
        group: u32,
    ) {
        let block_size = self.config.map_or(0, |c| c.block_size);
        self.record_stored_sized(hashes, parent, tokens, first_block, group, block_size);
    }

    /// [`Self::record_stored`] for a group whose blocks hold `block_size` tokens.
    pub(crate) fn record_stored_sized(
        &mut self,
        hashes: &[BlockHash],
        parent: Option<BlockHash>,
        tokens: &[i64],
        first_block: usize,
        group: u32,
        block_size: usize,
    ) {
        if self.config.is_none() {
            return;
        }
        let hash_start = self.hashes.len();
        self.hashes.extend_from_slice(hashes);
        let token_start = self.tokens.len();
        self.tokens.extend_from_slice(tokens);
        self.records.push(EventRecord::Stored(StoredRecord {
            hashes: hash_start..self.hashes.len(),
            parent,
            tokens: token_start..self.tokens.len(),
            first_block,
            group,
            block_size,
            positions: None,
        }));
    }

    /// [`Self::record_stored`] for a caching step over the table indices `blocks` that
    /// stored those at `positions` (one per hash, ascending): all of them, or some.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn record_stored_at(
        &mut self,
        hashes: &[BlockHash],
        positions: &[usize],
        parent: Option<BlockHash>,
        tokens: &[i64],
        blocks: Range<usize>,
        group: u32,
        block_size: usize,
    ) {
        let all = positions.iter().copied().eq(blocks.clone());
        self.record_stored_sized(hashes, parent, tokens, blocks.start, group, block_size);
        if let (false, Some(EventRecord::Stored(record))) = (all, self.records.last_mut()) {
            let start = self.positions.len();
            self.positions.extend_from_slice(positions);
            record.positions = Some(start..self.positions.len());
        }
    }

    /// Records a `BlockRemoved` (if events are on). `still_cached` says whether another
    /// block still holds the key, which suppresses it under `last_copy_removal`.
    pub(crate) fn record_removed(&mut self, hash: BlockHash, group: u32, still_cached: bool) {
        match self.config {
            Some(c) if !(c.last_copy_removal && still_cached) => {
                self.records.push(EventRecord::Removed { hash, group });
            }
            _ => {}
        }
    }

    /// Records an `AllBlocksCleared` (if events are on).
    pub(crate) fn record_cleared(&mut self) {
        if self.config.is_some() {
            self.records.push(EventRecord::AllCleared);
        }
    }
}

/// The int form of a block hash that vLLM's events carry by default
/// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`): its last 8 bytes as a big-endian unsigned
/// int (the whole hash for a shorter one).
pub fn hash_as_u64(hash: &BlockHash) -> u64 {
    let bytes = hash.as_bytes();
    let tail = bytes
        .get(bytes.len().saturating_sub(8)..)
        .unwrap_or_default();
    tail.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(bytes: &[u8]) -> BlockHash {
        BlockHash::new(bytes).unwrap()
    }

    #[test]
    fn disabled_log_records_nothing() {
        let mut log = EventLog::default();
        log.record_stored(&[h(b"a")], None, &[1, 2], 0, 0);
        log.record_removed(h(b"a"), 0, false);
        log.record_cleared();
        assert!(log.is_empty());
        assert!(!log.is_enabled());
    }

    #[test]
    fn records_share_buffers() {
        let mut log = EventLog::default();
        log.enable(EventConfig {
            block_size: 2,
            last_copy_removal: false,
        });
        log.record_stored(&[h(b"a"), h(b"b")], None, &[1, 2, 3, 4], 0, 0);
        log.record_stored(&[h(b"c")], Some(h(b"b")), &[5, 6], 2, 0);
        log.record_removed(h(b"a"), 0, true);
        log.record_cleared();
        assert_eq!(log.len(), 4);
        let EventRecord::Stored(second) = &log.records()[1] else {
            panic!("not stored");
        };
        assert_eq!(log.stored_hashes(second), [h(b"c")]);
        assert_eq!(log.stored_tokens(second), [5, 6]);
        assert_eq!(second.parent, Some(h(b"b")));
        assert_eq!(second.first_block, 2);
        assert_eq!(
            log.records()[2],
            EventRecord::Removed {
                hash: h(b"a"),
                group: 0
            }
        );
        log.clear();
        assert!(log.is_empty());
        assert!(log.heap_bytes() > 0, "buffers are kept");
    }

    #[test]
    fn last_copy_removal_skips_removals_of_keys_still_cached() {
        let mut log = EventLog::default();
        log.enable(EventConfig {
            block_size: 2,
            last_copy_removal: true,
        });
        log.record_removed(h(b"a"), 0, true);
        assert!(log.is_empty());
        log.record_removed(h(b"a"), 0, false);
        assert_eq!(log.len(), 1);
    }

    #[test]
    fn int_form_is_the_low_eight_bytes_big_endian() {
        // vLLM's worked example: sha256 52a7…361a → 0x1a1eb4e3edd9361a.
        let digest: Vec<u8> = (0..32)
            .map(|i| {
                u8::from_str_radix(
                    &"52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a"
                        [2 * i..2 * i + 2],
                    16,
                )
                .unwrap()
            })
            .collect();
        assert_eq!(hash_as_u64(&h(&digest)), 1_882_140_585_328_457_242);
        assert_eq!(hash_as_u64(&h(&[1, 2])), 0x0102);
        assert_eq!(hash_as_u64(&h(&[])), 0);
    }
}
