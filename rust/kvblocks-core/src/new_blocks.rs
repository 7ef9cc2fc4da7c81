//! A request's blocks not hashed yet: which they are, and their extra keys as vLLM
//! 0.33.0's `generate_block_hash_extra_keys` builds them (per block: the `LoRA` key, one
//! key per multimodal item overlapping the block, then the cache salt on the block
//! that starts at token 0).

use crate::error::Result;
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

/// What a request contributes to its blocks' extra keys. The binding implements it
/// once over a Python request, having read the request's attributes; each key is then
/// built (its parts converted) when [`block_extra_keys`] first needs it, in vLLM's
/// order: the `LoRA` key before the walk, each item's key at its first overlap, the salt
/// key on block 0 after that block's multimodal keys.
pub trait ExtraKeySource {
    /// The multimodal items' positions, sorted by offset.
    fn mm_positions(&self) -> &[MmPosition];

    /// Whether the request has a truthy cache salt.
    fn has_salt(&self) -> bool;

    /// Whether the request has a `LoRA` adapter.
    fn has_lora(&self) -> bool;

    /// The `("lora", name, path)` key.
    ///
    /// # Errors
    /// A name or path that is not a valid extra key.
    fn lora_key(&mut self) -> Result<Value>;

    /// The `("mm", identifier, offset)` key of item `index`, `offset` tokens from the
    /// block's start (negative when the item began in an earlier block).
    ///
    /// # Errors
    /// An identifier that is not a valid extra key.
    fn mm_key(&mut self, index: usize, offset: i64) -> Result<Value>;

    /// The `("cache_salt", salt)` key.
    ///
    /// # Errors
    /// A salt that is not a valid extra key.
    fn salt_key(&mut self) -> Result<Value>;
}

/// The extra keys of `num_blocks` blocks of `block_size` tokens from token `start`, one
/// entry per block (`None` for a block without keys); `None` when no block has any.
/// `num_blocks` must count blocks whose tokens exist (as [`new_blocks`] returns).
///
/// # Errors
/// The source's errors, the first in vLLM's order.
pub fn block_extra_keys(
    source: &mut impl ExtraKeySource,
    start: usize,
    num_blocks: usize,
    block_size: usize,
) -> Result<Option<Vec<Option<Value>>>> {
    let salted = start == 0 && source.has_salt();
    if num_blocks == 0 || (source.mm_positions().is_empty() && !salted && !source.has_lora()) {
        return Ok(None);
    }
    let lora = if source.has_lora() {
        Some(source.lora_key()?)
    } else {
        None
    };
    // Past block 0 only the last item can still overlap (vLLM's -1).
    let mut cursor = if start == 0 {
        MmCursor::At(0)
    } else {
        MmCursor::Last
    };
    let mut keys = Vec::with_capacity(num_blocks);
    let mut hits = Vec::new();
    for block in 0..num_blocks {
        let block_start = start + block * block_size;
        hits.clear();
        cursor = mm_features_in_block(
            source.mm_positions(),
            to_i64(block_start),
            to_i64(block_start + block_size),
            cursor,
            &mut hits,
        );
        let mut block_keys: Vec<Value> = lora.iter().cloned().collect();
        for &(index, offset) in &hits {
            block_keys.push(source.mm_key(index, offset)?);
        }
        if block_start == 0 && salted {
            block_keys.push(source.salt_key()?);
        }
        keys.push(if block_keys.is_empty() {
            None
        } else {
            Some(Value::Tuple(Tuple::new(block_keys, None)?))
        });
    }
    Ok(Some(keys))
}

/// Token positions are below `isize::MAX`, so they fit in an `i64`.
fn to_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source whose keys are plain ints, logging what it was asked for.
    struct Fake {
        positions: Vec<MmPosition>,
        salt: bool,
        lora: bool,
        asked: Vec<String>,
    }

    impl ExtraKeySource for Fake {
        fn mm_positions(&self) -> &[MmPosition] {
            &self.positions
        }
        fn has_salt(&self) -> bool {
            self.salt
        }
        fn has_lora(&self) -> bool {
            self.lora
        }
        fn lora_key(&mut self) -> Result<Value> {
            self.asked.push("lora".to_owned());
            Ok(Value::Int(-1))
        }
        fn mm_key(&mut self, index: usize, offset: i64) -> Result<Value> {
            self.asked.push(format!("mm {index} {offset}"));
            Ok(Value::Int(offset))
        }
        fn salt_key(&mut self) -> Result<Value> {
            self.asked.push("salt".to_owned());
            Ok(Value::Int(-2))
        }
    }

    fn fake(positions: &[(i64, i64)], salt: bool, lora: bool) -> Fake {
        Fake {
            positions: positions
                .iter()
                .map(|&(offset, length)| MmPosition { offset, length })
                .collect(),
            salt,
            lora,
            asked: Vec::new(),
        }
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
    fn keys_come_in_vllms_order_and_are_asked_for_lazily() {
        // An item over tokens 2..6 spans blocks 0 and 1 of 4 tokens; the salt is on block 0.
        let mut source = fake(&[(2, 4)], true, true);
        let keys = block_extra_keys(&mut source, 0, 3, 4).unwrap().unwrap();
        assert_eq!(source.asked, ["lora", "mm 0 2", "salt", "mm 0 -2"]);
        let tuple = |items: Vec<Value>| Some(Value::Tuple(Tuple::new(items, None).unwrap()));
        assert_eq!(
            keys,
            vec![
                tuple(vec![Value::Int(-1), Value::Int(2), Value::Int(-2)]),
                tuple(vec![Value::Int(-1), Value::Int(-2)]),
                tuple(vec![Value::Int(-1)]),
            ]
        );
    }

    #[test]
    fn no_keys_at_all_is_none_and_past_block_0_the_salt_is_not_asked() {
        assert_eq!(
            block_extra_keys(&mut fake(&[], false, false), 0, 2, 4),
            Ok(None)
        );
        let mut salted = fake(&[], true, false);
        assert_eq!(block_extra_keys(&mut salted, 4, 2, 4), Ok(None));
        assert!(salted.asked.is_empty());
        assert_eq!(
            block_extra_keys(&mut fake(&[(0, 1)], true, true), 0, 0, 4),
            Ok(None)
        );
    }
}
