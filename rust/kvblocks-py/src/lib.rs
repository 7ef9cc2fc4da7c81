//! `kvblocks._native`: PyO3 bindings of kvblocks-core. Conversions and delegation only.

mod convert;
mod errors;
mod pool;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<pool::PyBlockPool>()?;
    m.add_class::<pool::PyKVCacheBlock>()?;
    m.add("__all__", ["BlockPool", "KVCacheBlock"])?;
    Ok(())
}
