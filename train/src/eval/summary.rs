//! Acceptance statistics of replayed rounds, per verification mode: tau, streaks, the
//! acceptance-length histogram and per-depth acceptance, overall and per prompt.
//!
//! tau is tokens per verify round with the bonus included, `(accepted + rounds) / rounds` over
//! all rounds of all prompts, the same formula as the engine's `SeqStats::tau`; the mean streak
//! (accepted drafts per round) is `tau - 1`.

use serde::{Deserialize, Serialize};

use super::replay::{ReplayRound, Verify};

/// One prompt under one verification mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptStats {
    pub id: String,
    pub rounds: usize,
    pub accepted: usize,
    pub tau: f64,
    /// Accepted drafts of each round, in order.
    pub streaks: Vec<usize>,
}

/// Every prompt under one verification mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModeSummary {
    /// `chain` or `ddtree-B` ([`Verify::label`]).
    pub mode: String,
    /// The DDTree budget; `None` for the chain.
    pub budget: Option<usize>,
    pub rounds: usize,
    pub accepted: usize,
    pub tau: f64,
    pub mean_streak: f64,
    /// `histogram[k]`: rounds that accepted exactly k drafts, k = 0..=L.
    pub histogram: Vec<usize>,
    /// Per depth d = 1..=L: rounds that accepted a draft at depth d over rounds whose tree
    /// reached depth d (the engine's `SeqStats::depth_acceptance`).
    pub depth_accept: Vec<f64>,
    /// Per depth d = 1..=L: P(streak >= d | streak >= d - 1), the hit rate at depth d given
    /// that every shallower depth was accepted.
    pub depth_conditional: Vec<f64>,
    pub per_prompt: Vec<PromptStats>,
}

/// One drafter on one cache: a [`ModeSummary`] per verification mode, in the order asked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalSummary {
    /// Draft depths per round (block_size - 1).
    pub max_depth: usize,
    pub modes: Vec<ModeSummary>,
}

impl EvalSummary {
    pub fn mode(&self, verify: Verify) -> Option<&ModeSummary> {
        let label = verify.label();
        self.modes.iter().find(|m| m.mode == label)
    }

    /// tau of one mode (`None` when it was not evaluated).
    pub fn tau(&self, verify: Verify) -> Option<f64> {
        self.mode(verify).map(|m| m.tau)
    }
}

fn ratio(num: usize, den: usize) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

fn tau(accepted: usize, rounds: usize) -> f64 {
    ratio(accepted + rounds, rounds)
}

/// Aggregates the replayed rounds of every prompt (`(id, rounds)`) under `verify`.
pub fn summarize(
    verify: Verify,
    max_depth: usize,
    prompts: &[(String, Vec<ReplayRound>)],
) -> ModeSummary {
    let mut histogram = vec![0usize; max_depth + 1];
    let mut reached = vec![0usize; max_depth];
    let mut per_prompt = Vec::with_capacity(prompts.len());
    for (id, rounds) in prompts {
        for r in rounds {
            histogram[r.accepted.min(max_depth)] += 1;
            for slot in reached.iter_mut().take(r.tree_depth.min(max_depth)) {
                *slot += 1;
            }
        }
        let accepted: usize = rounds.iter().map(|r| r.accepted).sum();
        per_prompt.push(PromptStats {
            id: id.clone(),
            rounds: rounds.len(),
            accepted,
            tau: tau(accepted, rounds.len()),
            streaks: rounds.iter().map(|r| r.accepted).collect(),
        });
    }
    let rounds: usize = histogram.iter().sum();
    let accepted: usize = histogram.iter().enumerate().map(|(k, &c)| k * c).sum();
    // at_least[d]: rounds with streak >= d, d = 0..=L.
    let at_least: Vec<usize> = (0..=max_depth)
        .map(|d| histogram[d..].iter().sum())
        .collect();
    ModeSummary {
        mode: verify.label(),
        budget: match verify {
            Verify::Chain => None,
            Verify::DDTree { budget } => Some(budget),
        },
        rounds,
        accepted,
        tau: tau(accepted, rounds),
        mean_streak: ratio(accepted, rounds),
        depth_accept: (1..=max_depth)
            .map(|d| ratio(at_least[d], reached[d - 1]))
            .collect(),
        depth_conditional: (1..=max_depth)
            .map(|d| ratio(at_least[d], at_least[d - 1]))
            .collect(),
        histogram,
        per_prompt,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(accepted: usize, tree_depth: usize) -> ReplayRound {
        ReplayRound {
            anchor: 0,
            accepted,
            tree_depth,
            tree_nodes: tree_depth,
        }
    }

    #[test]
    fn tau_histogram_and_depth_rates_follow_the_engine_formulas() {
        let prompts = vec![
            ("a".to_string(), vec![round(0, 3), round(2, 3)]),
            ("b".to_string(), vec![round(3, 3), round(1, 2)]),
        ];
        let s = summarize(Verify::DDTree { budget: 4 }, 3, &prompts);
        assert_eq!(s.mode, "ddtree-4");
        assert_eq!((s.rounds, s.accepted), (4, 6));
        assert!((s.tau - 2.5).abs() < 1e-12);
        assert!((s.mean_streak - 1.5).abs() < 1e-12);
        assert_eq!(s.histogram, vec![1, 1, 1, 1]);
        // depth 3 reached by 3 rounds (the depth-2 tree stops short), accepted by 1.
        assert_eq!(s.depth_accept, vec![0.75, 0.5, 1.0 / 3.0]);
        assert_eq!(s.depth_conditional, vec![0.75, 2.0 / 3.0, 0.5]);
        assert_eq!(s.per_prompt[1].streaks, vec![3, 1]);
        assert!((s.per_prompt[0].tau - 2.0).abs() < 1e-12);
    }
}
