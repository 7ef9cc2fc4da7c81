//! Writing a decided rollback back: the caller's manager and requests, behind
//! [`RollbackTarget`], in the one order that keeps a refused step harmless.

use std::collections::HashMap;

use super::{InvalidBlocksOutcome, Policy, Rollback};
use crate::error::{Error, Result};

/// Which pass of [`super::handle_invalid_blocks`] a request index refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// The requests waiting for remote KVs (the async pass).
    Waiting,
    /// The running requests (the sync pass).
    Running,
}

/// Where a decided rollback is written: the binding implements it once over its
/// manager and request objects.
pub trait RollbackTarget {
    /// Removes `block_ids` from the prefix cache. They come in the order vLLM adds them
    /// to its set (duplicates included); a target that must evict in vLLM's order
    /// rebuilds that set.
    ///
    /// # Errors
    /// Whatever the manager refuses; nothing has been written yet.
    fn evict_blocks(&mut self, block_ids: &[i64]) -> Result<()>;

    /// Sets the `num_computed_tokens` of request `index` of `pass`.
    ///
    /// # Errors
    /// Whatever the request refuses.
    fn set_num_computed_tokens(&mut self, pass: Pass, index: usize, value: i64) -> Result<()>;
}

impl Rollback {
    /// Writes the decided counts of the affected requests of `pass`, in batch order.
    ///
    /// # Errors
    /// The first error of the target; earlier requests stay written.
    pub fn write(&self, pass: Pass, target: &mut impl RollbackTarget) -> Result<()> {
        for &i in &self.affected {
            if let Some(&value) = self.num_computed_tokens.get(i) {
                target.set_num_computed_tokens(pass, i, value)?;
            }
        }
        Ok(())
    }
}

impl InvalidBlocksOutcome {
    /// Applies the outcome: evicts first, so that a manager refusing the eviction leaves
    /// every request unchanged, then writes the waiting pass's counts, then the running
    /// pass's. `eviction_sequence` is [`InvalidBlocksOutcome::eviction_sequence`] of the
    /// running tables (taken first, so the tables may be borrowed from the manager the
    /// target then changes).
    ///
    /// # Errors
    /// The first error of the target.
    pub fn apply(&self, eviction_sequence: &[i64], target: &mut impl RollbackTarget) -> Result<()> {
        if !self.evicted_block_ids().is_empty() {
            target.evict_blocks(eviction_sequence)?;
        }
        self.waiting.write(Pass::Waiting, target)?;
        self.running.write(Pass::Running, target)
    }
}

/// What [`handle_failed_recving`] decided and wrote.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FailedRecving {
    /// Indices of the waiting requests reported as failed, in the order the connector
    /// reported them (each once), as vLLM's `_handle_failed_recving` adds them.
    pub matched: Vec<usize>,
    /// Tokens lost: everything the matched requests had computed.
    pub total_affected_tokens: u128,
}

/// vLLM's `_handle_failed_recving`: requests whose async load failed as a whole.
///
/// Only requests in `waiting_ids` (those whose async load is in flight, each once: the
/// caller checks) can fail this way; other reported ids are ignored, as in vLLM.
/// `num_computed_tokens` is read for the matched requests only, in waiting order, and
/// checked once all are read. Under `recompute` each matched request is then rewound
/// to 0 through `target` (as [`Pass::Waiting`]); under `fail` nothing is written.
///
/// # Errors
/// The reader's error; [`Error::Negative`] for the first negative count; the target's.
pub fn handle_failed_recving<S: AsRef<str>>(
    reported: &[S],
    waiting_ids: &[S],
    policy: Policy,
    num_computed_tokens: impl FnMut(usize) -> Result<i64>,
    target: &mut impl RollbackTarget,
) -> Result<FailedRecving> {
    let mut index: HashMap<&str, usize> = waiting_ids
        .iter()
        .enumerate()
        .map(|(i, id)| (id.as_ref(), i))
        .collect();
    let matched: Vec<usize> = reported
        .iter()
        .filter_map(|id| index.remove(id.as_ref()))
        .collect();
    let mut in_waiting = matched.clone();
    in_waiting.sort_unstable();
    let counts = in_waiting
        .iter()
        .copied()
        .map(num_computed_tokens)
        .collect::<Result<Vec<i64>>>()?;
    let mut total = 0u128;
    for value in counts {
        total += u128::try_from(value).map_err(|_| Error::Negative {
            name: "num_computed_tokens",
            value,
        })?;
    }
    if policy == Policy::Recompute {
        for &i in &in_waiting {
            target.set_num_computed_tokens(Pass::Waiting, i, 0)?;
        }
    }
    Ok(FailedRecving {
        matched,
        total_affected_tokens: total,
    })
}
