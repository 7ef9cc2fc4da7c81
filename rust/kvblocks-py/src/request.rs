//! `Request` for Python: a request's tokens and block hashes kept in Rust, so the
//! native manager reads them in place.

use kvblocks_core::BlockHash;
use pyo3::prelude::*;

/// A request's token ids and the hashes of its full blocks.
#[pyclass(module = "kvblocks._native", name = "Request")]
pub struct PyRequest {
    request_id: String,
    num_prompt_tokens: usize,
    all_token_ids: Vec<i64>,
    num_computed_tokens: i64,
    block_hashes: Vec<BlockHash>,
}

impl PyRequest {
    /// The request id.
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// Prompt plus output tokens.
    pub fn num_tokens(&self) -> i64 {
        i64::try_from(self.all_token_ids.len()).unwrap_or(i64::MAX)
    }

    /// Tokens whose KV is computed.
    pub fn num_computed_tokens(&self) -> i64 {
        self.num_computed_tokens
    }

    /// The hashes of the full blocks, block 0 first.
    pub fn block_hashes(&self) -> &[BlockHash] {
        &self.block_hashes
    }
}
