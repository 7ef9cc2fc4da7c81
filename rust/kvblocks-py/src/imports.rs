//! The Python objects the binding uses from other modules, each imported on first use
//! and kept for the interpreter's life: one registry, so no call imports per call and
//! every dependency on Python code is listed here. Attribute names are `intern!`ed
//! where they are read.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

/// `module.name`, imported on first use.
pub struct LazyImport {
    module: &'static str,
    name: &'static str,
    cell: PyOnceLock<Py<PyAny>>,
}

impl LazyImport {
    const fn new(module: &'static str, name: &'static str) -> Self {
        Self {
            module,
            name,
            cell: PyOnceLock::new(),
        }
    }

    /// The name it is imported as.
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// The object, imported on the first call.
    ///
    /// # Errors
    /// The import's error (`msgspec` missing, for `kvblocks.events`).
    pub fn get<'py>(&self, py: Python<'py>) -> PyResult<&Bound<'py, PyAny>> {
        self.cell.import(py, self.module, self.name)
    }
}

/// `os.environ`, read (not cached) for `PYTHONHASHSEED`, as the reference does.
pub static OS_ENVIRON: LazyImport = LazyImport::new("os", "environ");
/// `operator.index`, for the message of an int beyond 64 bits.
pub static OPERATOR_INDEX: LazyImport = LazyImport::new("operator", "index");
/// `numbers.Integral` and `collections.abc.Iterable`: what `append_output_token_ids`
/// takes as one id.
pub static INTEGRAL: LazyImport = LazyImport::new("numbers", "Integral");
pub static ITERABLE: LazyImport = LazyImport::new("collections.abc", "Iterable");
/// `kvblocks.events`' structs and its setting, shared with the reference.
pub static USE_INT_BLOCK_HASHES: LazyImport =
    LazyImport::new("kvblocks.events", "use_int_block_hashes");
pub static BLOCK_STORED: LazyImport = LazyImport::new("kvblocks.events", "BlockStored");
pub static BLOCK_REMOVED: LazyImport = LazyImport::new("kvblocks.events", "BlockRemoved");
pub static ALL_BLOCKS_CLEARED: LazyImport = LazyImport::new("kvblocks.events", "AllBlocksCleared");
/// The value classes both backends return, and `object`, whose `__new__` makes one.
pub static KV_CACHE_BLOCK: LazyImport = LazyImport::new("kvblocks.values", "KVCacheBlock");
pub static PREFIX_CACHE_STATS: LazyImport = LazyImport::new("kvblocks.values", "PrefixCacheStats");
pub static ROLLBACK_RESULT: LazyImport = LazyImport::new("kvblocks.values", "RollbackResult");
pub static INVALID_BLOCKS_OUTCOME: LazyImport =
    LazyImport::new("kvblocks.values", "InvalidBlocksOutcome");
pub static OBJECT: LazyImport = LazyImport::new("builtins", "object");
