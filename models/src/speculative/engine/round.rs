//! The verify half of a step ([`Engine::round`]): one batched proposer call, the draft trees,
//! one batched target forward over every ready sequence's tree (padded on CUDA to a captured
//! size), then the walk and the commit of each sequence's accepted path.

use std::time::Instant;

use candle_core::Tensor;

use super::{commit_tokens, isolate, Engine, EngineError, Sequence};
use crate::batch::SeqForward;
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

impl Engine {
    pub(super) fn round(&mut self, events: &mut Vec<SeqEvent>) -> Result<(), EngineError> {
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
        let trees: Vec<DraftTree> = self
            .seqs
            .iter()
            .map(|s| {
                let bonus = *s
                    .tokens
                    .last()
                    .expect("prefilled sequences hold a bonus token");
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
        let t_verify = Instant::now();
        let taps = self.taps();
        let starts: Vec<usize> = self.seqs.iter().map(|s| s.cache.len()).collect();
        let padded: Vec<Option<DraftTree>> = self
            .seqs
            .iter()
            .zip(&trees)
            .map(|(s, t)| self.verify_padding(s, t))
            .collect();
        // What the target verifies: each tree, or its padded form.
        let verified: Vec<&DraftTree> = trees
            .iter()
            .zip(&padded)
            .map(|(t, p)| p.as_ref().unwrap_or(t))
            .collect();
        let positions: Vec<Vec<u32>> = verified
            .iter()
            .zip(&starts)
            .map(|(t, &s)| t.positions(s))
            .collect();
        let patterns: Vec<AttnPattern> = verified
            .iter()
            .map(|t| {
                if t.is_chain() {
                    AttnPattern::Causal
                } else {
                    AttnPattern::Tree {
                        parents: t.parents().to_vec(),
                    }
                }
            })
            .collect();
        let rows: Vec<Vec<usize>> = verified.iter().map(|t| (0..t.len()).collect()).collect();
        profile::mark(&dev, "5_verify_prepare");
        let ids: Vec<SeqId> = self.seqs.iter().map(|s| s.id).collect();
        let (out, failed) = {
            let mut batch: Vec<SeqForward<'_>> = self
                .seqs
                .iter_mut()
                .enumerate()
                .map(|(i, s)| SeqForward {
                    cache: &mut s.cache,
                    tokens: &verified[i].tokens,
                    positions: &positions[i],
                    pattern: &patterns[i],
                    logit_rows: &rows[i],
                })
                .collect();
            // A failure ends only the sequences it fails for (`engine/isolate.rs`).
            isolate::forward_isolating(
                &self.target,
                &self.faults,
                &mut batch,
                &ids,
                &starts,
                &taps,
            )?
        };
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
                logits.narrow(0, a, b - a)?.to_vec2::<f32>()?
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
            if seq.req.algorithm != Algorithm::Plain {
                if let Some(t) = &out.taps {
                    let idx: Vec<u32> = accepted
                        .iter()
                        .map(|&n| (out.token_offsets[i] + n) as u32)
                        .collect();
                    let idx = Tensor::new(idx.as_slice(), t.device())?;
                    seq.pending_features = Some(t.index_select(&idx, 0)?);
                }
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
        profile::mark(&dev, "8_commit");
        self.reap(events);
        Ok(())
    }

    /// On CUDA, where every verify size is a captured graph, a tree smaller than its
    /// algorithm's full size (near a request's end, where drafts are capped) padded to that
    /// size (see [`DraftTree::padded_to`]): the verify then replays the graph every other round
    /// uses instead of running uncaptured and capturing one more size on its next use (about
    /// 19 ms per capture for the 8B shape, and 8 graph slots per model). The placeholders come
    /// after every real entry, so causal and ancestor masks keep them out of the real rows;
    /// their K/V rows are dropped by the compaction and their logits never read. None: verify
    /// the tree as it is (no room in the cache or the position table, or not on CUDA).
    fn verify_padding(&self, s: &Sequence, tree: &DraftTree) -> Option<DraftTree> {
        if !self.target.device().is_cuda() {
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
