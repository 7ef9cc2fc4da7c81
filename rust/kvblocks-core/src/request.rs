//! What the manager reads of a request: a [`RequestView`] of vLLM's duck-typed
//! `Request`, whose block hashes come from a [`HashSource`] and token ids from a
//! [`TokenSource`]. A binding implements the two sources once over its own request
//! objects; the manager asks them only for the hashes and tokens a call needs.

use std::ops::Range;

use crate::block_hash::BlockHash;
use crate::error::{Error, Result};

/// A request's full-block hashes, in block order (vLLM's `request.block_hashes`).
///
/// Implementations may convert lazily (e.g. from a Python list): the manager asks only
/// for the ranges it needs, always within `0 .. num_hashes()`.
pub trait HashSource {
    /// How many block hashes the request has.
    fn num_hashes(&self) -> usize;

    /// Appends the hashes in `range` to `out`.
    ///
    /// # Errors
    /// Any error the conversion hits (e.g. [`Error::HashTooLong`]). The manager passes
    /// it on unchanged, having changed nothing.
    fn hashes(&self, range: Range<usize>, out: &mut Vec<BlockHash>) -> Result<()>;

    /// Hash `i` alone (a lookup reads hashes one at a time, up to the first miss).
    ///
    /// # Errors
    /// Those of [`HashSource::hashes`]; [`Error::TooFewHashes`] if it gave no hash.
    fn hash(&self, i: usize) -> Result<BlockHash> {
        let mut one = Vec::with_capacity(1);
        self.hashes(i..i + 1, &mut one)?;
        one.first().copied().ok_or(Error::TooFewHashes {
            needed: i + 1,
            got: i,
        })
    }

    /// The hash before block `first` (a `BlockStored`'s parent): `None` from block 0.
    ///
    /// # Errors
    /// Those of [`HashSource::hash`].
    fn parent(&self, first: usize) -> Result<Option<BlockHash>> {
        first.checked_sub(1).map(|i| self.hash(i)).transpose()
    }

    /// The request's token ids, if this source provides them. A manager asks only
    /// when KV cache events are on (for `BlockStored.token_ids`); it then refuses to
    /// cache the blocks of a request whose source returns `None` (the default).
    fn token_source(&self) -> Option<&dyn TokenSource> {
        None
    }
}

/// A request's token ids, prompt then output (vLLM's `request.all_token_ids`).
pub trait TokenSource {
    /// Appends the token ids in `range` to `out`: fewer if the request has fewer (as
    /// a Python slice), `block_size` tokens per block of `range`. The manager asks once
    /// per caching step, for the blocks it is about to cache, before changing anything.
    ///
    /// # Errors
    /// Any error the conversion hits; the manager passes it on, having changed nothing.
    fn token_ids(&self, range: Range<usize>, block_size: usize, out: &mut Vec<i64>) -> Result<()>;
}

impl TokenSource for Vec<i64> {
    fn token_ids(&self, range: Range<usize>, _block_size: usize, out: &mut Vec<i64>) -> Result<()> {
        let end = range.end.min(self.len());
        out.extend_from_slice(self.get(range.start.min(end)..end).unwrap_or_default());
        Ok(())
    }
}

impl HashSource for [BlockHash] {
    fn num_hashes(&self) -> usize {
        self.len()
    }

    fn hashes(&self, range: Range<usize>, out: &mut Vec<BlockHash>) -> Result<()> {
        let (start, end) = (range.start, range.end);
        let slice = self.get(range).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "block hash range {start}..{end} is outside the {} hashes given",
                self.len()
            ))
        })?;
        out.extend_from_slice(slice);
        Ok(())
    }

    fn hash(&self, i: usize) -> Result<BlockHash> {
        self.get(i).copied().ok_or(Error::TooFewHashes {
            needed: i + 1,
            got: self.len(),
        })
    }
}

/// What the manager reads of a request (vLLM's duck-typed `Request`).
#[derive(Debug)]
pub struct RequestView<'a, H: ?Sized> {
    /// The request id.
    pub request_id: &'a str,
    /// Prompt plus output tokens so far.
    pub num_tokens: i64,
    /// Tokens whose KV is computed (or scheduled) before this call.
    pub num_computed_tokens: i64,
    /// The hashes of the request's full blocks.
    pub block_hashes: &'a H,
}

// By hand: a derive would ask `H: Copy`, which a `dyn HashSource` is not.
impl<H: ?Sized> Clone for RequestView<'_, H> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<H: ?Sized> Copy for RequestView<'_, H> {}

impl<H: HashSource + ?Sized> RequestView<'_, H> {
    /// The token ids of `blocks` (of `block_size` tokens each), for a `BlockStored`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the hash source has no token source; the token
    /// source's errors.
    pub fn block_tokens(&self, blocks: Range<usize>, block_size: usize) -> Result<Vec<i64>> {
        let Some(source) = self.block_hashes.token_source() else {
            return Err(Error::InvalidArgument(format!(
                "KV cache events need the token ids of request {}",
                self.request_id
            )));
        };
        let mut tokens = Vec::with_capacity(blocks.len().saturating_mul(block_size));
        source.token_ids(
            blocks.start.saturating_mul(block_size)..blocks.end.saturating_mul(block_size),
            block_size,
            &mut tokens,
        )?;
        Ok(tokens)
    }
}
