//! The one place where core errors become Python exceptions.
//!
//! The classes are imported from `kvblocks.errors`, so both backends raise the very
//! same classes, and the message is the core error's `Display`, which the pure-Python
//! reference reproduces word for word.

use kvblocks_core::{Error, ErrorKind};
use pyo3::exceptions::{PyAssertionError, PyIndexError, PyOverflowError, PyValueError};
use pyo3::PyErr;

pyo3::import_exception!(kvblocks.errors, NoFreeBlocksError);
pyo3::import_exception!(kvblocks.errors, BlockStateError);
pyo3::import_exception!(kvblocks.errors, UnknownBlockError);
pyo3::import_exception!(kvblocks.errors, UnsupportedLayoutError);
pyo3::import_exception!(kvblocks.errors, InvariantError);

/// Converts a core error into the documented Python exception.
pub fn to_py(err: &Error) -> PyErr {
    let msg = err.to_string();
    match err.kind() {
        ErrorKind::Value => PyValueError::new_err(msg),
        ErrorKind::NoFreeBlocks => NoFreeBlocksError::new_err(msg),
        ErrorKind::BlockState => BlockStateError::new_err(msg),
        ErrorKind::UnknownBlock => UnknownBlockError::new_err(msg),
        ErrorKind::UnsupportedLayout => UnsupportedLayoutError::new_err(msg),
        ErrorKind::Invariant => InvariantError::new_err(msg),
        ErrorKind::Assertion => PyAssertionError::new_err(msg),
        ErrorKind::Index => PyIndexError::new_err(msg),
        ErrorKind::Overflow => PyOverflowError::new_err(msg),
    }
}

/// `?`-friendly conversion of a core result.
pub trait IntoPyResult<T> {
    /// Maps the error with [`to_py`].
    fn py(self) -> pyo3::PyResult<T>;
}

impl<T> IntoPyResult<T> for kvblocks_core::Result<T> {
    fn py(self) -> pyo3::PyResult<T> {
        self.map_err(|e| to_py(&e))
    }
}

/// A Python error met inside a core callback (a request's hash or token source), kept
/// to be raised as it was once the core call has returned, having changed nothing. The
/// core meanwhile gets a placeholder error that ends its call.
#[derive(Default)]
pub struct StashedError(std::cell::RefCell<Option<PyErr>>);

impl StashedError {
    /// Keeps `err`; returns the placeholder for the core, naming `what` failed.
    pub fn keep(&self, err: PyErr, what: &str) -> Error {
        *self.0.borrow_mut() = Some(err);
        Error::InvalidArgument(format!("{what} failed"))
    }

    /// The error kept, if any (taking it).
    pub fn take(&self) -> Option<PyErr> {
        self.0.borrow_mut().take()
    }

    /// The core result, or the Python error kept meanwhile (which caused the core's).
    pub fn finish<T>(&self, result: kvblocks_core::Result<T>) -> pyo3::PyResult<T> {
        match self.take() {
            Some(err) => Err(err),
            None => result.py(),
        }
    }
}
