//! Writing a decided rollback back: the caller's manager and requests, behind
//! [`RollbackTarget`], in the one order that keeps a refused step harmless.

use std::collections::{HashMap, HashSet};

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
    /// `fail`: the matched requests fail; `recompute`: they were rewound to 0 and are
    /// retried.
    pub policy: Policy,
}

/// vLLM's `_handle_failed_recving`: requests whose async load failed as a whole.
///
/// Only requests in `waiting_ids` (those whose async load is in flight) can fail this
/// way; other reported ids are ignored, as in vLLM. `num_computed_tokens` is read for
/// the matched requests only, in waiting order. Under `recompute` each matched request
/// is rewound to 0 through `target` (as [`Pass::Waiting`]), after every count was read
/// and checked; under `fail` nothing is written.
///
/// # Errors
/// The reader's error; [`Error::Negative`] for the first negative count; the target's.
pub fn handle_failed_recving(
    reported: &[&str],
    waiting_ids: &[&str],
    policy: Policy,
    mut num_computed_tokens: impl FnMut(usize) -> Result<i64>,
    target: &mut impl RollbackTarget,
) -> Result<FailedRecving> {
    let failed: HashSet<&str> = reported.iter().copied().collect();
    let in_waiting: Vec<usize> = (0..waiting_ids.len())
        .filter(|&i| failed.contains(waiting_ids[i]))
        .collect();
    let mut total = 0u128;
    for &i in &in_waiting {
        let value = num_computed_tokens(i)?;
        let lost = u128::try_from(value).map_err(|_| Error::Negative {
            name: "num_computed_tokens",
            value,
        })?;
        total += lost;
    }
    // Waiting ids are unique (the caller checks), so each maps to one request.
    let mut index: HashMap<&str, usize> = in_waiting.iter().map(|&i| (waiting_ids[i], i)).collect();
    let mut matched = Vec::with_capacity(in_waiting.len());
    for id in reported {
        if let Some(i) = index.remove(id) {
            matched.push(i);
        }
    }
    if policy == Policy::Recompute {
        for &i in &in_waiting {
            target.set_num_computed_tokens(Pass::Waiting, i, 0)?;
        }
    }
    Ok(FailedRecving {
        matched,
        total_affected_tokens: total,
        policy,
    })
}
