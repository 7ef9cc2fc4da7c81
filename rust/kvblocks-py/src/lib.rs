//! `kvblocks._native`: `PyO3` bindings of kvblocks-core. Conversions and delegation only.

#[macro_use]
mod docstrings;

mod convert;
mod errors;
mod events;
mod extra_keys;
mod hashing;
mod imports;
mod manager;
mod num_tokens;
mod pool;
mod request;
mod request_fields;
mod rollback;
mod values;
mod vllm;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<pool::PyBlockPool>()?;
    m.add_class::<manager::PyKVCacheManager>()?;
    m.add_class::<hashing::PyBlockHasher>()?;
    m.add_class::<request::PyRequest>()?;
    // The value classes, which both backends share.
    for class in [
        &imports::KV_CACHE_BLOCK,
        &imports::PREFIX_CACHE_STATS,
        &imports::ROLLBACK_RESULT,
        &imports::INVALID_BLOCKS_OUTCOME,
    ] {
        m.add(class.name(), class.get(m.py())?)?;
    }
    // kvblocks.vllm's native half, outside the backend API (`__all__`).
    m.add_class::<vllm::PyVllmManager>()?;
    m.add_class::<vllm::PyKVCacheBlocks>()?;
    m.add_class::<vllm::PyBlockView>()?;
    m.add_function(wrap_pyfunction!(num_tokens::register_vllm_request, m)?)?;
    m.add_function(wrap_pyfunction!(rollback::rollback_invalid_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(
        rollback::update_requests_with_invalid_blocks,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(rollback::handle_invalid_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(rollback::handle_failed_recving, m)?)?;
    m.add(
        "__all__",
        [
            "BlockHasher",
            "BlockPool",
            "KVCacheBlock",
            "KVCacheManager",
            "PrefixCacheStats",
            "Request",
            "InvalidBlocksOutcome",
            "RollbackResult",
            "rollback_invalid_blocks",
            "update_requests_with_invalid_blocks",
            "handle_invalid_blocks",
            "handle_failed_recving",
        ],
    )?;
    Ok(())
}
