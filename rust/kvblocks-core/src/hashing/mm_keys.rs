//! Which multimodal items overlap a block, the walk behind vLLM's
//! `("mm", identifier, offset)` extra keys.

/// Where a multimodal item's placeholder tokens sit in the prompt (vLLM's
/// `PlaceholderRange`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmPosition {
    /// Index of the first placeholder token.
    pub offset: i64,
    /// Number of placeholder tokens.
    pub length: i64,
}

/// Where the multimodal walk of [`mm_features_in_block`] resumes: a feature index, or
/// `Last` for vLLM's `-1` ("only the last item can still overlap").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MmCursor {
    /// Resume at this feature.
    At(usize),
    /// The last feature (vLLM's `start_mm_idx == -1`, used once hashing starts past
    /// block 0).
    Last,
}

/// vLLM 0.33.0's `_gen_mm_extra_hash_keys` walk: which features (sorted by offset)
/// overlap the block `[start, end)`. Appends `(feature index, offset - start)` to
/// `out` for each, in order (each becomes the key `("mm", identifier, offset - start)`),
/// and returns the cursor for the next block.
pub fn mm_features_in_block(
    positions: &[MmPosition],
    start: i64,
    end: i64,
    cursor: MmCursor,
    out: &mut Vec<(usize, i64)>,
) -> MmCursor {
    let Some(last) = positions.last() else {
        return cursor;
    };
    if last.offset.saturating_add(last.length) <= start {
        // Past every item: vLLM returns the cursor unchanged.
        return cursor;
    }
    let mut idx = match cursor {
        MmCursor::At(i) => i,
        MmCursor::Last => positions.len() - 1,
    };
    while let Some(pos) = positions.get(idx) {
        if end <= pos.offset {
            // The block has not reached this item.
            break;
        }
        let item_end = pos.offset.saturating_add(pos.length);
        if start >= item_end {
            // The block is past this item.
            idx += 1;
            continue;
        }
        out.push((idx, pos.offset.saturating_sub(start)));
        if end >= item_end {
            // The item ends in this block; the next one may start in it too.
            idx += 1;
        } else {
            break;
        }
    }
    MmCursor::At(idx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mm_walk_image_across_two_blocks() {
        // An image at offset 2, length 5 (tokens 2..7), block size 4: block 0 gets offset 2
        // and keeps the cursor on the image, which runs on; block 1 gets offset -2 (the
        // image began two tokens before it) and moves past it; block 2 gets nothing.
        let positions = [MmPosition {
            offset: 2,
            length: 5,
        }];
        let mut out = Vec::new();
        let next = mm_features_in_block(&positions, 0, 4, MmCursor::At(0), &mut out);
        assert_eq!((out.as_slice(), next), (&[(0, 2)][..], MmCursor::At(0)));
        out.clear();
        let next = mm_features_in_block(&positions, 4, 8, next, &mut out);
        assert_eq!((out.as_slice(), next), (&[(0, -2)][..], MmCursor::At(1)));
        out.clear();
        let next = mm_features_in_block(&positions, 8, 12, next, &mut out);
        assert_eq!((out.as_slice(), next), (&[][..], MmCursor::At(1)));
    }
}
