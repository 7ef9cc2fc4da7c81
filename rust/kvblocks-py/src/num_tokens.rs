//! `request.num_tokens` of vLLM's `Request`, read without running its property.
//!
//! vLLM's `Request.num_tokens` is a Python property returning
//! `len(self._all_token_ids)`. Called from C it costs about 1,170 instructions, a quarter
//! of a decoding `allocate_slots`, and the managers and the hasher read it for every
//! request at every step. `kvblocks.vllm` registers vLLM's `Request` class once it has
//! checked that property's code. For a request of exactly that class, while the class
//! still holds the property it held then and looks attributes up generically, the
//! length of the request's `_all_token_ids` list is read instead: the attribute the
//! property reads, with no Python frame.

use std::ffi::c_void;

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyType};

/// vLLM's `Request` class and its `num_tokens` property, once registered.
static VLLM_REQUEST: PyOnceLock<(Py<PyType>, Py<PyAny>)> = PyOnceLock::new();

/// Registers vLLM's `Request` class, whose `num_tokens` property must return
/// ``len(self._all_token_ids)`` (``kvblocks.vllm`` checks its code first). Registering
/// the same class again does nothing; another class raises ``ValueError``.
#[pyfunction]
pub fn register_vllm_request(request_class: &Bound<'_, PyType>) -> PyResult<()> {
    let py = request_class.py();
    let property = request_class.getattr(intern!(py, "num_tokens"))?;
    let (class, _) =
        VLLM_REQUEST.get_or_init(py, || (request_class.clone().unbind(), property.unbind()));
    if class.bind(py).is(request_class) {
        Ok(())
    } else {
        Err(PyValueError::new_err(format!(
            "vLLM's Request class is already registered as {}",
            class.bind(py).repr()?
        )))
    }
}

/// `request.num_tokens` read as the length of `request._all_token_ids`, when `request`
/// is of the registered class and that gives what the property would; `None` otherwise
/// (the caller reads the attribute).
#[inline]
pub fn vllm_num_tokens(request: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
    let py = request.py();
    let Some((class, property)) = VLLM_REQUEST.get(py) else {
        return Ok(None);
    };
    let class = class.bind(py);
    if !request.get_type().is(class)
        || !generic_getattr(class)
        || !class.getattr(intern!(py, "num_tokens"))?.is(property)
    {
        return Ok(None);
    }
    let Some(tokens) = request.getattr_opt(intern!(py, "_all_token_ids"))? else {
        return Ok(None);
    };
    Ok(tokens
        .cast_exact::<PyList>()
        .ok()
        .map(|list| i64::try_from(list.len()).unwrap_or(i64::MAX)))
}

/// Whether instances of `class` look attributes up with `CPython`'s generic lookup (no
/// `__getattribute__` or `__getattr__` of its own), so that `num_tokens` is its property.
fn generic_getattr(class: &Bound<'_, PyType>) -> bool {
    // SAFETY: `class` is a live type object; `PyType_GetSlot` only reads its slot table.
    let slot = unsafe { pyo3::ffi::PyType_GetSlot(class.as_type_ptr(), pyo3::ffi::Py_tp_getattro) };
    let generic = pyo3::ffi::PyObject_GenericGetAttr as *mut c_void;
    slot == generic
}
