//! `kvblocks._native`: PyO3 bindings of kvblocks-core. Conversions and delegation only.

mod convert;
mod errors;

use pyo3::prelude::*;

#[pymodule]
fn _native(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
