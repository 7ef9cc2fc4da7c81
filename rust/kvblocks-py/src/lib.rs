//! `kvblocks._native`: PyO3 bindings of kvblocks-core. Conversions and delegation only.

mod convert;
mod errors;
mod manager;
mod pool;
mod request;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<pool::PyBlockPool>()?;
    m.add_class::<pool::PyKVCacheBlock>()?;
    m.add_class::<manager::PyKVCacheManager>()?;
    m.add_class::<manager::PyPrefixCacheStats>()?;
    m.add_class::<request::PyRequest>()?;
    m.add("__all__", ["BlockPool", "KVCacheBlock", "KVCacheManager", "PrefixCacheStats"])?;
    Ok(())
}
