//! The one error type of the core. Its `Display` is the exact message both Python
//! backends raise, and [`Error::kind`] picks the Python class, so the bindings map
//! errors in a single place.

use std::fmt;

/// Which Python exception class an [`Error`] becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// `ValueError`: a bad count or argument value.
    Value,
    /// `kvblocks.NoFreeBlocksError`.
    NoFreeBlocks,
    /// `kvblocks.BlockStateError`.
    BlockState,
    /// `kvblocks.UnknownBlockError`.
    UnknownBlock,
    /// `kvblocks.UnsupportedLayoutError`.
    UnsupportedLayout,
    /// `kvblocks.InvariantError`.
    Invariant,
    /// `AssertionError`: what vLLM asserts, refused as vLLM does (vLLM callers only).
    Assertion,
    /// `IndexError`: where vLLM's code indexes past a list (vLLM callers only).
    Index,
    /// `OverflowError`: where vLLM's code overflows a conversion (vLLM callers only).
    Overflow,
}

/// Everything a core call can refuse. A call that returns an error changed nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A count that must be > 0 was not.
    NonPositive { name: &'static str, value: i64 },
    /// A count that must be >= 0 was negative.
    Negative { name: &'static str, value: i64 },
    /// More blocks were asked for than are free.
    NoFreeBlocks { requested: usize, free: usize },
    /// A block id outside `0 .. num_blocks`.
    UnknownBlock { block_id: i64, num_blocks: usize },
    /// Freeing a block whose ref count is already 0.
    DoubleFree { block_id: u32 },
    /// Caching a block that already holds a hash.
    AlreadyHashed { block_id: u32 },
    /// `cache_full_blocks` got fewer hashes than blocks to cache.
    TooFewHashes { needed: usize, got: usize },
    /// `cache_full_blocks` was told to cache past the end of the block table.
    TooManyFullBlocks {
        num_full_blocks: usize,
        num_block_ids: usize,
    },
    /// A block hash longer than the 32 bytes a SHA-256 digest has.
    HashTooLong { len: usize },
    /// Any other bad argument value; the message is complete.
    InvalidArgument(String),
    /// Block-level failures on a layout that cannot be rolled back safely.
    UnsupportedLayout(String),
    /// `check_invariants` found the named rule broken.
    Invariant(String),
    /// An argument vLLM's own code refuses with an `assert`, given to the vLLM manager
    /// ([`crate::hybrid`]) or a rollback with [`crate::rollback::Tolerance::Vllm`].
    Assertion(String),
    /// Where vLLM's own code indexes past the end of a list, for a caller that asked
    /// for vLLM's tolerance.
    Index(String),
    /// Where vLLM's own code overflows converting a number, for a caller that asked
    /// for vLLM's tolerance.
    Overflow(String),
}

impl Error {
    /// The Python class this error is raised as.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::NonPositive { .. }
            | Self::Negative { .. }
            | Self::TooFewHashes { .. }
            | Self::TooManyFullBlocks { .. }
            | Self::HashTooLong { .. }
            | Self::InvalidArgument(_) => ErrorKind::Value,
            Self::NoFreeBlocks { .. } => ErrorKind::NoFreeBlocks,
            Self::DoubleFree { .. } | Self::AlreadyHashed { .. } => ErrorKind::BlockState,
            Self::UnknownBlock { .. } => ErrorKind::UnknownBlock,
            Self::UnsupportedLayout(_) => ErrorKind::UnsupportedLayout,
            Self::Invariant(_) => ErrorKind::Invariant,
            Self::Assertion(_) => ErrorKind::Assertion,
            Self::Index(_) => ErrorKind::Index,
            Self::Overflow(_) => ErrorKind::Overflow,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NonPositive { name, value } => write!(f, "{name} must be positive, got {value}"),
            Self::Negative { name, value } => write!(f, "{name} must be non-negative, got {value}"),
            Self::NoFreeBlocks { requested, free } => {
                write!(
                    f,
                    "Cannot get {requested} free blocks from the pool ({free} free)"
                )
            }
            Self::UnknownBlock {
                block_id,
                num_blocks,
            } => write!(
                f,
                "block id {block_id} is out of range for a pool of {num_blocks} blocks"
            ),
            Self::DoubleFree { block_id } => {
                write!(f, "block {block_id} is already free (ref count 0)")
            }
            Self::AlreadyHashed { block_id } => write!(f, "block {block_id} already has a hash"),
            Self::TooFewHashes { needed, got } => {
                write!(f, "need {needed} block hashes, got {got}")
            }
            Self::TooManyFullBlocks {
                num_full_blocks,
                num_block_ids,
            } => write!(
                f,
                "num_full_blocks {num_full_blocks} exceeds the {num_block_ids} block ids given"
            ),
            Self::HashTooLong { len } => {
                write!(f, "block hash must be at most 32 bytes, got {len}")
            }
            Self::InvalidArgument(msg)
            | Self::UnsupportedLayout(msg)
            | Self::Invariant(msg)
            | Self::Assertion(msg)
            | Self::Index(msg)
            | Self::Overflow(msg) => f.write_str(msg),
        }
    }
}

impl std::error::Error for Error {}

/// The result type of every fallible core call.
pub type Result<T> = std::result::Result<T, Error>;

/// `value` as a count: [`Error::Negative`] naming `name` when it is below zero.
///
/// # Errors
/// [`Error::Negative`] for `value < 0`.
pub fn non_negative(name: &'static str, value: i64) -> Result<usize> {
    usize::try_from(value).map_err(|_| Error::Negative { name, value })
}

/// `value` as a size: [`Error::NonPositive`] naming `name` unless it is above zero.
///
/// # Errors
/// [`Error::NonPositive`] for `value <= 0`.
pub fn positive(name: &'static str, value: i64) -> Result<usize> {
    usize::try_from(value)
        .ok()
        .filter(|&v| v > 0)
        .ok_or(Error::NonPositive { name, value })
}

/// `value` as a KV cache group id, which vLLM encodes in 4 bytes.
///
/// # Errors
/// [`Error::Negative`] for `value < 0`; [`Error::InvalidArgument`] above `u32::MAX`.
pub fn group_id(name: &'static str, value: i64) -> Result<u32> {
    if value < 0 {
        return Err(Error::Negative { name, value });
    }
    u32::try_from(value).map_err(|_| {
        Error::InvalidArgument(format!("{name} must be at most {}, got {value}", u32::MAX))
    })
}
