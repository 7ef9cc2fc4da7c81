//! Keyword arguments that name one value of a core enum (`mode=`, `policy=`).

use kvblocks_core::rollback::{Mode, Policy};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyString;
use pyo3::Borrowed;

/// A keyword argument naming one value of a core enum (`mode=`, `policy=`).
/// Extraction never fails, so that a bad value is refused inside the call with the
/// reference's exact message (`PyO3` would annotate an extraction error with a note the
/// reference does not add).
pub struct ChoiceArg<T>(Result<T, String>);

/// A core enum taken by name.
pub trait Choice: Copy {
    /// The keyword.
    const ARGUMENT: &'static str;
    /// The names it takes, as the error message lists them.
    const EXPECTED: &'static str;
    /// The value of that name.
    fn from_name(name: &str) -> Option<Self>;
}

impl Choice for Mode {
    const ARGUMENT: &'static str = "mode";
    const EXPECTED: &'static str = "'vllm' or 'strict'";
    fn from_name(name: &str) -> Option<Self> {
        Mode::from_name(name)
    }
}

impl Choice for Policy {
    const ARGUMENT: &'static str = "policy";
    const EXPECTED: &'static str = "'fail' or 'recompute'";
    fn from_name(name: &str) -> Option<Self> {
        Policy::from_name(name)
    }
}

impl<T: Choice> ChoiceArg<T> {
    pub const fn default(value: T) -> Self {
        Self(Ok(value))
    }

    pub fn get(&self) -> PyResult<T> {
        self.0.clone().map_err(|got| {
            PyValueError::new_err(format!(
                "{} must be {}, got {got}",
                T::ARGUMENT,
                T::EXPECTED
            ))
        })
    }
}

impl<'a, 'py, T: Choice> FromPyObject<'a, 'py> for ChoiceArg<T> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let value = obj
            .cast::<PyString>()
            .ok()
            .and_then(|s| s.to_str().ok().and_then(T::from_name));
        Ok(Self(value.ok_or_else(|| repr(obj))))
    }
}

fn repr(obj: Borrowed<'_, '_, PyAny>) -> String {
    obj.repr()
        .map_or_else(|_| "<unrepresentable>".to_owned(), |r| r.to_string())
}
