//! A request's blocks not hashed yet, and vLLM 0.33.0's block-hash extra keys of its
//! blocks, derived from the request's extras read once as plain data
//! ([`RequestExtras`]): per block the `LoRA` key, one key per multimodal item
//! overlapping the block, then the cache salt on the block that starts at token 0.
//!
//! A binding reads the extras in one order (the adapter, the salt, the items'
//! positions, then the identifiers of the items the blocks overlap, which
//! [`mm_items_needed`] names); every rule that decides which key a block gets is here.

use crate::error::{Error, Result};
use crate::hashing::{mm_features_in_block, MmCursor, MmPosition, Tuple, Value};

/// The full blocks of a request holding `num_tokens` tokens that its `num_hashes` known
/// hashes do not cover: `(first token, number of blocks)`, or `None` when there is none.
#[must_use]
pub fn new_blocks(
    num_hashes: usize,
    num_tokens: usize,
    block_size: usize,
) -> Option<(usize, usize)> {
    let start = num_hashes.checked_mul(block_size)?;
    let available = num_tokens.checked_sub(start)?;
    let num_blocks = available.checked_div(block_size)?;
    (num_blocks > 0).then_some((start, num_blocks))
}

/// A request's `LoRA` adapter, as its keys use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lora {
    /// `lora_name`.
    pub name: Value,
    /// `lora_path`.
    pub path: Value,
}

/// A multimodal item: its position, and its identifier when it was read (only the
/// items that overlap the blocks at hand are).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmItem {
    /// Where the item's placeholder tokens are.
    pub position: MmPosition,
    /// `identifier`, if read.
    pub identifier: Option<Value>,
}

/// The tag strings keys start with. A binding gives them the identities of the string
/// objects vLLM's code uses, so that the pickler memoizes them as `CPython`'s does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyTags {
    /// `"lora"`.
    pub lora: Value,
    /// `"mm"`.
    pub mm: Value,
    /// `"cache_salt"`.
    pub cache_salt: Value,
}

impl Default for KeyTags {
    fn default() -> Self {
        Self {
            lora: Value::str("lora"),
            mm: Value::str("mm"),
            cache_salt: Value::str("cache_salt"),
        }
    }
}

/// Everything a request adds to its blocks' extra keys, read once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestExtras {
    /// The adapter, when `lora_request` is truthy.
    pub lora: Option<Lora>,
    /// `cache_salt`, when truthy.
    pub cache_salt: Option<Value>,
    /// `mm_features`, sorted by offset.
    pub mm_items: Vec<MmItem>,
    /// The tag strings; `None`: untagged (a request without extras needs none).
    pub tags: Option<KeyTags>,
}

/// How the multimodal items are matched to blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MmWalk {
    /// vLLM's hashing walk: from block 0 it resumes where the last block stopped;
    /// starting past block 0 only the last item can still overlap (vLLM's `-1`).
    Hashing,
    /// Events: every block from item 0, so every item that overlaps a block is found.
    Events,
}

/// An item overlapping a block: the block (counted from the first of the walk), the
/// item's index, and the item's offset from the block's first token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmOverlap {
    pub block: usize,
    pub item: usize,
    pub offset: i64,
}

/// The items that overlap each of `num_blocks` blocks of `block_size` tokens from token
/// `start`, block by block: nothing to allocate for a request without items.
#[must_use]
pub fn mm_overlaps(
    positions: &[MmPosition],
    start: usize,
    num_blocks: usize,
    block_size: usize,
    walk: MmWalk,
) -> Vec<MmOverlap> {
    let Some(last) = positions.last() else {
        return Vec::new();
    };
    let items_end = last.offset.saturating_add(last.length);
    let mut cursor = match walk {
        MmWalk::Hashing if start != 0 => MmCursor::Last,
        _ => MmCursor::At(0),
    };
    let mut overlaps = Vec::new();
    let mut hits = Vec::new();
    for block in 0..num_blocks {
        let block_start = to_i64(start + block * block_size);
        if block_start >= items_end {
            // Past every item: no later block overlaps one either.
            break;
        }
        if walk == MmWalk::Events {
            cursor = MmCursor::At(0);
        }
        hits.clear();
        let block_end = to_i64(start + (block + 1) * block_size);
        cursor = mm_features_in_block(positions, block_start, block_end, cursor, &mut hits);
        overlaps.extend(hits.iter().map(|&(item, offset)| MmOverlap {
            block,
            item,
            offset,
        }));
    }
    overlaps
}

/// The items whose identifiers `overlaps` uses, in item order, each once: the ones a
/// binding reads.
#[must_use]
pub fn mm_items_needed(overlaps: &[MmOverlap]) -> Vec<usize> {
    let mut items: Vec<usize> = overlaps.iter().map(|o| o.item).collect();
    items.sort_unstable();
    items.dedup();
    items
}

/// The extra keys of `num_blocks` blocks of `block_size` tokens from token `start`, one
/// entry per block (`None` for a block without keys); `None` when no block has any.
///
/// # Errors
/// [`Error::InvalidArgument`] when a key nests too deep; [`Error::Invariant`] when an
/// item the blocks overlap has no identifier (the binding did not read it).
pub fn block_extra_keys(
    extras: &RequestExtras,
    start: usize,
    num_blocks: usize,
    block_size: usize,
) -> Result<Option<Vec<Option<Value>>>> {
    if num_blocks == 0 || !has_keys(extras, start) {
        return Ok(None);
    }
    let tags = extras.tags.clone().unwrap_or_default();
    let lora = |l: &Lora| tuple(vec![tags.lora.clone(), l.name.clone(), l.path.clone()]);
    let mm = |identifier, offset| tuple(vec![tags.mm.clone(), identifier, Value::Int(offset)]);
    let salt = |salt: &Value| tuple(vec![tags.cache_salt.clone(), salt.clone()]);
    let walk = (start, num_blocks, block_size, MmWalk::Hashing);
    let keys = keys_per_block(extras, walk, lora, mm, salt)?;
    let blocks = keys.into_iter().map(|block_keys| {
        (!block_keys.is_empty())
            .then(|| tuple(block_keys))
            .transpose()
    });
    blocks.collect::<Result<_>>().map(Some)
}

/// The extra keys of blocks `first_block ..` as a `BlockStored` publishes them,
/// untagged: per block the adapter's name, `(identifier, offset)` per item, the salt.
/// `None` when the request has no adapter, no items and no salt on these blocks (the
/// event then has no extra keys at all).
///
/// # Errors
/// As [`block_extra_keys`].
pub fn event_extra_keys(
    extras: &RequestExtras,
    first_block: usize,
    num_blocks: usize,
    block_size: usize,
) -> Result<Option<Vec<Option<Vec<Value>>>>> {
    let start = first_block * block_size;
    if !has_keys(extras, start) {
        return Ok(None);
    }
    let lora = |l: &Lora| Ok(l.name.clone());
    let mm = |identifier, offset| tuple(vec![identifier, Value::Int(offset)]);
    let salt = |salt: &Value| Ok(salt.clone());
    let walk = (start, num_blocks, block_size, MmWalk::Events);
    let keys = keys_per_block(extras, walk, lora, mm, salt)?;
    Ok(Some(
        keys.into_iter()
            .map(|block_keys| (!block_keys.is_empty()).then_some(block_keys))
            .collect(),
    ))
}

/// Whether blocks from token `start` can have any key: the request has an adapter or
/// items, or the blocks start at token 0 and it has a salt.
fn has_keys(extras: &RequestExtras, start: usize) -> bool {
    extras.lora.is_some() || !extras.mm_items.is_empty() || salt_at(extras, start).is_some()
}

/// The salt of the block starting at token `block_start`: the request's, on block 0 only.
fn salt_at(extras: &RequestExtras, block_start: usize) -> Option<&Value> {
    extras.cache_salt.as_ref().filter(|_| block_start == 0)
}

/// Each block's keys, in vLLM's order (the adapter's, each overlapping item's, the
/// salt's), each made by the function of its kind. `walk` is `(start, num_blocks,
/// block_size, how items are matched)`.
fn keys_per_block<K>(
    extras: &RequestExtras,
    walk: (usize, usize, usize, MmWalk),
    lora: impl Fn(&Lora) -> Result<K>,
    mm: impl Fn(Value, i64) -> Result<K>,
    salt: impl Fn(&Value) -> Result<K>,
) -> Result<Vec<Vec<K>>> {
    let (start, num_blocks, block_size, walk) = walk;
    let positions = positions(extras);
    let overlaps = mm_overlaps(&positions, start, num_blocks, block_size, walk);
    let mut overlaps = overlaps.iter().peekable();
    let mut keys = Vec::with_capacity(num_blocks);
    for block in 0..num_blocks {
        let mut block_keys = Vec::new();
        if let Some(adapter) = &extras.lora {
            block_keys.push(lora(adapter)?);
        }
        while let Some(hit) = overlaps.next_if(|o| o.block == block) {
            block_keys.push(mm(identifier(extras, hit.item)?, hit.offset)?);
        }
        if let Some(value) = salt_at(extras, start + block * block_size) {
            block_keys.push(salt(value)?);
        }
        keys.push(block_keys);
    }
    Ok(keys)
}

fn positions(extras: &RequestExtras) -> Vec<MmPosition> {
    extras.mm_items.iter().map(|item| item.position).collect()
}

fn identifier(extras: &RequestExtras, item: usize) -> Result<Value> {
    extras
        .mm_items
        .get(item)
        .and_then(|i| i.identifier.clone())
        .ok_or_else(|| {
            Error::Invariant(format!("multimodal item {item}'s identifier was not read"))
        })
}

fn tuple(items: Vec<Value>) -> Result<Value> {
    Tuple::new(items, None).map(Value::Tuple)
}

/// Token positions are below `isize::MAX`, so they fit in an `i64`.
fn to_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Extras whose identifiers and salt are plain ints, to tell them apart.
    fn extras(positions: &[(i64, i64)], salt: bool, lora: bool) -> RequestExtras {
        RequestExtras {
            lora: lora.then(|| Lora {
                name: Value::str("name"),
                path: Value::str("path"),
            }),
            cache_salt: salt.then_some(Value::Int(-2)),
            mm_items: positions
                .iter()
                .zip(100..)
                .map(|(&(offset, length), id)| MmItem {
                    position: MmPosition { offset, length },
                    identifier: Some(Value::Int(id)),
                })
                .collect(),
            tags: None,
        }
    }

    fn tup(items: Vec<Value>) -> Value {
        tuple(items).unwrap()
    }

    #[test]
    fn new_blocks_are_the_full_blocks_past_the_known_hashes() {
        assert_eq!(new_blocks(0, 9, 4), Some((0, 2)));
        assert_eq!(new_blocks(1, 9, 4), Some((4, 1)));
        assert_eq!(new_blocks(2, 9, 4), None);
        assert_eq!(new_blocks(3, 9, 4), None, "more hashes than tokens");
        assert_eq!(new_blocks(usize::MAX, 9, 4), None, "no overflow");
    }

    #[test]
    fn keys_come_in_vllms_order() {
        // An item over tokens 2..6 spans blocks 0 and 1 of 4 tokens; the salt is on block 0.
        let keys = block_extra_keys(&extras(&[(2, 4)], true, true), 0, 3, 4)
            .unwrap()
            .unwrap();
        let lora = tup(vec![
            Value::str("lora"),
            Value::str("name"),
            Value::str("path"),
        ]);
        let mm = |offset| tup(vec![Value::str("mm"), Value::Int(100), Value::Int(offset)]);
        let salt = tup(vec![Value::str("cache_salt"), Value::Int(-2)]);
        assert_eq!(
            keys,
            vec![
                Some(tup(vec![lora.clone(), mm(2), salt])),
                Some(tup(vec![lora.clone(), mm(-2)])),
                Some(tup(vec![lora])),
            ]
        );
    }

    #[test]
    fn no_keys_at_all_is_none_and_past_block_0_the_salt_is_not_used() {
        assert_eq!(
            block_extra_keys(&extras(&[], false, false), 0, 2, 4),
            Ok(None)
        );
        assert_eq!(
            block_extra_keys(&extras(&[], true, false), 4, 2, 4),
            Ok(None)
        );
        assert_eq!(
            block_extra_keys(&extras(&[(0, 1)], true, true), 0, 0, 4),
            Ok(None)
        );
    }

    #[test]
    fn only_the_overlapping_items_are_needed_and_the_walks_differ_past_block_0() {
        // Items over 1..3, 5..11 and 9..10; blocks of 4 from token 4: 4..8, 8..12.
        let positions = positions(&extras(&[(1, 2), (5, 6), (9, 1)], false, false));
        let at = |block, item, offset| MmOverlap {
            block,
            item,
            offset,
        };
        let hashing = mm_overlaps(&positions, 4, 2, 4, MmWalk::Hashing);
        // vLLM resumes at the last item past block 0: item 1 is missed.
        assert_eq!(hashing, [at(1, 2, 1)]);
        let events = mm_overlaps(&positions, 4, 2, 4, MmWalk::Events);
        assert_eq!(events, [at(0, 1, 1), at(1, 1, -3), at(1, 2, 1)]);
        assert!(mm_overlaps(&positions, 12, 1_000, 4, MmWalk::Events).is_empty());
        assert!(mm_overlaps(&[], 0, 1_000, 4, MmWalk::Hashing).is_empty());
        assert_eq!(mm_items_needed(&hashing), [2]);
        assert_eq!(mm_items_needed(&events), [1, 2]);
    }

    #[test]
    fn an_unread_identifier_is_an_invariant_error() {
        let mut unread = extras(&[(0, 2)], false, false);
        unread.mm_items[0].identifier = None;
        assert!(matches!(
            block_extra_keys(&unread, 0, 1, 4),
            Err(Error::Invariant(_))
        ));
    }

    #[test]
    fn event_keys_are_untagged_and_none_without_extras() {
        assert_eq!(
            event_extra_keys(&extras(&[], true, false), 1, 2, 4),
            Ok(None)
        );
        let keys = event_extra_keys(&extras(&[(2, 4)], true, true), 0, 3, 4)
            .unwrap()
            .unwrap();
        let name = Value::str("name");
        let mm = |offset| tup(vec![Value::Int(100), Value::Int(offset)]);
        assert_eq!(
            keys,
            vec![
                Some(vec![name.clone(), mm(2), Value::Int(-2)]),
                Some(vec![name.clone(), mm(-2)]),
                Some(vec![name]),
            ]
        );
        let plain = event_extra_keys(&extras(&[(9, 1)], false, false), 0, 2, 4).unwrap();
        assert_eq!(plain, Some(vec![None, None]), "items, none on these blocks");
    }
}
