//! Per-round and per-sequence speculative statistics: tau (tokens committed per verify round,
//! the bonus included), tree size, per-depth acceptance, time in draft / verify / commit.

use std::time::Duration;

#[derive(Debug, Clone, PartialEq)]
pub struct RoundStats {
    /// Draft nodes verified (the root excluded).
    pub tree_nodes: usize,
    pub max_depth: usize,
    pub accepted_drafts: usize,
    /// Tokens emitted this round (accepted drafts + bonus, cut at a stop).
    pub committed: usize,
    pub draft_time: Duration,
    pub verify_time: Duration,
    pub commit_time: Duration,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct SeqStats {
    pub rounds: usize,
    pub committed: usize,
    pub accepted_drafts: usize,
    pub tree_nodes: usize,
    /// `depth_reached[d]`: rounds whose tree reached depth d+1.
    pub depth_proposed: Vec<usize>,
    /// `depth_accepted[d]`: rounds that accepted a draft at depth d+1.
    pub depth_accepted: Vec<usize>,
    pub draft_time: Duration,
    pub verify_time: Duration,
    pub commit_time: Duration,
    /// Times the sequence gave its K/V pages back for lack of them (and was prefilled again).
    pub retractions: usize,
    /// Prompt tokens found in the prefix cache at admission (not prefilled).
    pub cached_tokens: usize,
}

impl SeqStats {
    pub fn new(max_depth: usize) -> Self {
        Self {
            depth_proposed: vec![0; max_depth],
            depth_accepted: vec![0; max_depth],
            ..Self::default()
        }
    }

    pub fn record(&mut self, r: &RoundStats) {
        self.rounds += 1;
        self.committed += r.committed;
        self.accepted_drafts += r.accepted_drafts;
        self.tree_nodes += r.tree_nodes;
        for d in 0..r.max_depth.min(self.depth_proposed.len()) {
            self.depth_proposed[d] += 1;
        }
        for d in 0..r.accepted_drafts.min(self.depth_accepted.len()) {
            self.depth_accepted[d] += 1;
        }
        self.draft_time += r.draft_time;
        self.verify_time += r.verify_time;
        self.commit_time += r.commit_time;
    }

    /// Mean tokens committed per verify round (tau), bonus included.
    pub fn tau(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            (self.accepted_drafts + self.rounds) as f64 / self.rounds as f64
        }
    }

    /// Acceptance rate at each depth: accepted / reached.
    pub fn depth_acceptance(&self) -> Vec<f64> {
        self.depth_proposed
            .iter()
            .zip(&self.depth_accepted)
            .map(|(&p, &a)| if p == 0 { 0.0 } else { a as f64 / p as f64 })
            .collect()
    }
}
