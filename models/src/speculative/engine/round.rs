//! The verify half of a step ([`Engine::round`]): one batched proposer call, the draft trees,
//! one batched target forward over every ready sequence's tree (padded on CUDA to a captured
//! size), then the walk and the commit of each sequence's accepted path.

use std::time::Instant;

use candle_core::Tensor;

use super::{commit_tokens, isolate, Engine, EngineError, Sequence};
use crate::batch::{ForwardOutput, SeqForward};
use crate::error::ModelError;
use crate::layers::attention::AttnPattern;
use crate::speculative::logprobs;
use crate::speculative::proposer::{ProposeItem, SeqId};
use crate::speculative::request::{Algorithm, SeqEvent};
use crate::speculative::sampling;
use crate::speculative::stats::RoundStats;
use crate::speculative::tree::{build_ddtree, chain_tree, walk, DraftTree, TopK};
use crate::speculative::{greedy, profile};
use crate::target::DraftTarget;

/// What a round verifies: every ready sequence's draft tree (a single token for plain
/// decoding), the form the target runs (padded on CUDA), its positions, attention pattern and
/// logit rows, and where each sequence's cache stood.
pub(super) struct RoundPlan {
    trees: Vec<DraftTree>,
    padded: Vec<Option<DraftTree>>,
    positions: Vec<Vec<u32>>,
    patterns: Vec<AttnPattern>,
    rows: Vec<Vec<usize>>,
    pub starts: Vec<usize>,
    pub ids: Vec<SeqId>,
    draft_time: std::time::Duration,
}

impl RoundPlan {
    /// What the target verifies for sequence `i`: its tree, or the padded form.
    fn verified(&self, i: usize) -> &DraftTree {
        self.padded[i].as_ref().unwrap_or(&self.trees[i])
    }

    /// The verify forwards of `seqs` (the ready sequences the plan was made for, in order).
    pub fn forwards<'a>(&'a self, seqs: &'a mut [Sequence]) -> Vec<SeqForward<'a>> {
        seqs.iter_mut()
            .enumerate()
            .map(|(i, s)| SeqForward {
                cache: &mut s.cache,
                tokens: &self.verified(i).tokens,
                positions: &self.positions[i],
                pattern: &self.patterns[i],
                logit_rows: &self.rows[i],
            })
            .collect()
    }
}

impl Engine {
    /// One round for every (ready) sequence: draft, verify in one forward, commit.
    pub(super) fn round(&mut self, events: &mut Vec<SeqEvent>) -> Result<(), EngineError> {
        let plan = self.plan_round()?;
        let t_verify = Instant::now();
        let taps = self.taps();
        let (out, failed) = {
            let mut batch = plan.forwards(&mut self.seqs);
            // A failure ends only the sequences it fails for (`engine/isolate.rs`).
            isolate::forward_isolating(
                &self.target,
                &self.faults,
                &mut batch,
                &plan.ids,
                &plan.starts,
                &taps,
            )?
        };
        self.finish_round(&plan, &out, &failed, t_verify, events)
    }

    /// Drafts for the speculating sequences (one batched proposer call) and the trees the
    /// round verifies.
    pub(super) fn plan_round(&mut self) -> Result<RoundPlan, EngineError> {
        let vocab = self.target.vocab_size();
        let dev = self.target.device().clone();
        profile::mark(&dev, "0_between_rounds");
        let t_draft = Instant::now();
        let spec: Vec<usize> = (0..self.seqs.len())
            .filter(|&i| self.seqs[i].req.algorithm != Algorithm::Plain)
            .collect();
        let mut proposals = if spec.is_empty() {
            Vec::new()
        } else {
            let features: Vec<Option<Tensor>> = spec
                .iter()
                .map(|&i| self.seqs[i].pending_features.take())
                .collect();
            let items: Vec<ProposeItem<'_>> = spec
                .iter()
                .zip(&features)
                .map(|(&i, f)| {
                    let s = &self.seqs[i];
                    let top_k = match s.req.algorithm {
                        Algorithm::DDTree { budget } => budget.min(vocab),
                        _ => 1,
                    };
                    ProposeItem {
                        seq: s.id,
                        tokens: &s.tokens,
                        features: f.as_ref(),
                        top_k,
                    }
                })
                .collect();
            let proposer = self
                .proposer
                .as_mut()
                .ok_or(EngineError::NoProposer(Algorithm::Chain))?;
            let proposals = proposer.propose(&items)?;
            profile::mark(&dev, "3c_propose_rest");
            proposals
        }
        .into_iter();
        let draft_time = t_draft.elapsed();
        profile::mark(&dev, "3_draft_select");

        let max_positions = self.target.max_positions();
        // Prefilled sequences hold their bonus token (the prompt is never empty).
        let bonuses = self
            .seqs
            .iter()
            .map(|s| s.tokens.last().copied())
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| {
                ModelError::BadCacheOp("a sequence entered a round without a token".into())
            })?;
        let trees: Vec<DraftTree> = self
            .seqs
            .iter()
            .zip(bonuses)
            .map(|(s, bonus)| {
                // Drafts past the length limit or the position table can never be committed.
                let start = s.tokens.len() - 1;
                let depth_cap = (s.req.max_new_tokens - s.generated)
                    .saturating_sub(1)
                    .min(max_positions.saturating_sub(start + 1));
                match s.req.algorithm {
                    Algorithm::Plain => DraftTree::root_only(bonus),
                    Algorithm::Chain => {
                        let mut drafts = proposals
                            .next()
                            .map(|p| p.argmax_tokens())
                            .unwrap_or_default();
                        drafts.truncate(depth_cap);
                        chain_tree(bonus, &drafts)
                    }
                    Algorithm::DDTree { budget } => proposals.next().map_or_else(
                        || DraftTree::root_only(bonus),
                        |p| {
                            let depths = p.depths().min(depth_cap);
                            let capped =
                                TopK::new((0..depths).map(|d| p.row(d).to_vec()).collect());
                            build_ddtree(bonus, &capped, budget)
                        },
                    ),
                }
            })
            .collect();

        profile::mark(&dev, "4_tree");
        let starts: Vec<usize> = self.seqs.iter().map(|s| s.cache.len()).collect();
        let padded: Vec<Option<DraftTree>> = self
            .seqs
            .iter()
            .zip(&trees)
            .map(|(s, t)| self.verify_padding(s, t))
            .collect();
        let verified = |i: usize| padded[i].as_ref().unwrap_or(&trees[i]);
        let positions: Vec<Vec<u32>> = (0..trees.len())
            .map(|i| verified(i).positions(starts[i]))
            .collect();
        let patterns: Vec<AttnPattern> = (0..trees.len())
            .map(|i| {
                let t = verified(i);
                if t.is_chain() {
                    AttnPattern::Causal
                } else {
                    AttnPattern::Tree {
                        parents: t.parents().to_vec(),
                    }
                }
            })
            .collect();
        let rows: Vec<Vec<usize>> = (0..trees.len())
            .map(|i| (0..verified(i).len()).collect())
            .collect();
        profile::mark(&dev, "5_verify_prepare");
        let ids: Vec<SeqId> = self.seqs.iter().map(|s| s.id).collect();
        Ok(RoundPlan {
            trees,
            padded,
            positions,
            patterns,
            rows,
            starts,
            ids,
            draft_time,
        })
    }

    /// Walks each tree with the target's rows (`out` and `failed` laid out as the plan's
    /// sequences, the verify begun at `t_verify`) and commits the accepted paths.
    pub(super) fn finish_round(
        &mut self,
        plan: &RoundPlan,
        out: &ForwardOutput,
        failed: &[Option<String>],
        t_verify: Instant,
        events: &mut Vec<SeqEvent>,
    ) -> Result<(), EngineError> {
        let dev = self.target.device().clone();
        let (trees, starts, draft_time) = (&plan.trees, &plan.starts, plan.draft_time);
        profile::mark(&dev, "6_verify_forward");
        // Greedy rows only need the argmax, taken on the device; sampled rows come to the host.
        // (No logits at all: every sequence failed.)
        let argmax = match &out.logits {
            Some(l) => greedy::row_argmax(l)?,
            None => Vec::new(),
        };
        let verify_time = t_verify.elapsed();
        profile::mark(&dev, "7_verify_argmax");

        let t_commit = Instant::now();
        // The accepted rows' tapped features, per speculating sequence: gathered for all of
        // them at once after the walk (one upload and one gather, not one of each per sequence).
        let mut feature_rows: Vec<(usize, Vec<u32>)> = Vec::new();
        for (i, tree) in trees.iter().enumerate() {
            if let Some(error) = &failed[i] {
                events.push(self.seqs[i].failed(error));
                continue;
            }
            let logits = out
                .logits
                .as_ref()
                .ok_or_else(|| ModelError::BadInput("verify returned no logits".into()))?;
            // The tree's own rows: a padded verify has placeholder rows after them.
            let a = out.logit_offsets[i];
            let b = (a + tree.len()).min(out.logit_offsets[i + 1]);
            let seq = &mut self.seqs[i];
            // Host rows: for sampling, and for logprobs when asked.
            let mut host_rows = if seq.needs_host_rows() {
                greedy::host_rows(&logits.narrow(0, a, b - a)?)?
            } else {
                Vec::new()
            };
            // Each node's row penalised from the committed tokens plus that node's path: the
            // row plain decoding would see at the same position.
            let shaped = seq.shapes_rows();
            if shaped {
                for (n, row) in host_rows.iter_mut().enumerate() {
                    seq.penalise(&tree.path(n), row);
                }
            }
            let posterior: Vec<u32> = match (seq.sampler.params().is_greedy(), shaped) {
                (true, false) => argmax[a..b].to_vec(),
                (true, true) => host_rows.iter().map(|r| sampling::argmax(r)).collect(),
                (false, _) => host_rows.iter().map(|r| seq.sampler.sample(r)).collect(),
            };
            let (accepted, next) = match self.simulate.as_mut() {
                Some(sim) if seq.req.algorithm != Algorithm::Plain => sim.walk(tree, &posterior),
                _ => walk(tree, &posterior),
            };
            let start = starts[i];
            let keep: Vec<usize> = accepted.iter().map(|&n| start + n).collect();
            seq.cache.compact(start, &keep)?;
            if seq.req.algorithm != Algorithm::Plain && out.taps.is_some() {
                let offset = out.token_offsets[i];
                feature_rows.push((i, accepted.iter().map(|&n| (offset + n) as u32).collect()));
            }
            let mut new_tokens: Vec<u32> = accepted[1..].iter().map(|&n| tree.tokens[n]).collect();
            new_tokens.push(next);
            let (emitted, finished) = commit_tokens(seq, &new_tokens, &self.config.eos_token_ids);
            seq.record(&emitted);
            let logprobs = match seq.logprobs {
                Some(n) => logprobs::committed(&host_rows, &accepted, &emitted, n),
                None => Vec::new(),
            };
            let round = RoundStats {
                tree_nodes: tree.num_nodes(),
                max_depth: tree.depths.iter().copied().max().unwrap_or(0),
                accepted_drafts: accepted.len() - 1,
                committed: emitted.len(),
                draft_time,
                verify_time,
                commit_time: t_commit.elapsed(),
            };
            seq.stats.record(&round);
            events.push(SeqEvent {
                id: seq.id,
                tokens: emitted,
                finished,
                round: Some(round),
                stats: seq.stats.clone(),
                logprobs,
                error: None,
                prompt_logprobs: Vec::new(),
            });
        }
        if let Some(t) = &out.taps {
            self.attach_features(t, &feature_rows)?;
        }
        profile::mark(&dev, "8_commit");
        self.reap(events);
        Ok(())
    }

    /// Sets each listed sequence's pending features to `taps`' rows of it: one gather into a
    /// fresh tensor (never views of `taps`, which a replayed graph overwrites), then a view of
    /// it per sequence.
    fn attach_features(
        &mut self,
        taps: &Tensor,
        rows: &[(usize, Vec<u32>)],
    ) -> Result<(), EngineError> {
        if rows.is_empty() {
            return Ok(());
        }
        let all: Vec<u32> = rows.iter().flat_map(|(_, r)| r.iter().copied()).collect();
        let idx = Tensor::new(all.as_slice(), taps.device())?;
        let gathered = taps.index_select(&idx, 0)?;
        let mut at = 0;
        for (i, r) in rows {
            self.seqs[*i].pending_features = Some(gathered.narrow(0, at, r.len())?);
            at += r.len();
        }
        Ok(())
    }

    /// On CUDA, where every verify size is a captured graph, a tree smaller than its
    /// algorithm's full size (near a request's end, where drafts are capped) padded to that
    /// size (see [`DraftTree::padded_to`]): the verify then replays the graph every other round
    /// uses instead of running uncaptured and capturing one more size on its next use (about
    /// 19 ms per capture for the 8B shape, and 8 graph slots per model). The placeholders come
    /// after every real entry, so causal and ancestor masks keep them out of the real rows;
    /// their K/V rows are dropped by the compaction and their logits never read. None: verify
    /// the tree as it is (no room in the cache or the position table, not on CUDA, or a target
    /// that replays no verify graphs: [`crate::target::Target::replays_verify_graphs`]).
    fn verify_padding(&self, s: &Sequence, tree: &DraftTree) -> Option<DraftTree> {
        if !self.target.device().is_cuda() || !self.target.replays_verify_graphs() {
            return None;
        }
        let full = match s.req.algorithm {
            Algorithm::Plain => return None,
            Algorithm::Chain => self.proposer.as_ref()?.max_depth() + 1,
            Algorithm::DDTree { budget } => budget.min(self.target.vocab_size()) + 1,
        };
        let start = s.cache.len();
        let deepest =
            tree.depths.iter().copied().max().unwrap_or(0) + full.saturating_sub(tree.len());
        if tree.len() >= full
            || start + full > s.cache.capacity()
            || start + deepest >= self.target.max_positions()
        {
            return None;
        }
        tree.padded_to(full).ok()
    }
}
