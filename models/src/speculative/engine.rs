//! The decoding engine. A step is a transaction per sequence:
//! **propose** (one batched proposer call), **verify** (one batched target forward over every
//! sequence's tree, chain or single token), **commit** (walk the tree with the target's own
//! token at every node, keep the accepted path's K/V and features) and **roll back** the rest
//! (cache compaction drops rejected rows; the proposer never sees them).
//!
//! Lossless by construction: every committed token is the target's own choice at a node whose
//! context is exactly the committed prefix (argmax at T=0, a sample from the target's filtered
//! distribution at T>0). Drafts only decide how many of those choices one forward can make.

use std::time::Instant;

use candle_core::Tensor;

use crate::batch::SeqForward;
use crate::cache::{pages_for, KvPool, PrefixCache, SequenceCache, PAGE_SIZE};
use crate::error::ModelError;
use crate::layers::attention::AttnPattern;
use crate::speculative::constraint::Constraint;
use crate::speculative::logprobs;
use crate::speculative::penalties::PenaltyState;
use crate::speculative::proposer::{ProposeItem, Proposer, SeqId};
use crate::speculative::sampling::{self, Sampler};
use crate::speculative::simulate::SimulatedAcceptance;
use crate::speculative::spare::SpareCaches;
use crate::speculative::stats::{RoundStats, SeqStats};
use crate::speculative::tree::{build_ddtree, chain_tree, walk, DraftTree, TopK};
use crate::speculative::{greedy, profile};
use crate::target::{DraftTarget, Target};

pub use crate::speculative::request::{
    Algorithm, EngineConfig, EngineError, FinishReason, GenerationRequest, SeqEvent,
};

/// Smallest cache a sequence gets, in rows ([`Engine::cache_capacity`]).
pub const MIN_CACHE_ROWS: usize = 256;

struct Sequence {
    id: SeqId,
    req: GenerationRequest,
    cache: SequenceCache,
    /// What the target cache (and the proposer's) was made for ([`Engine::cache_capacity`]).
    capacity: usize,
    /// Prompt and generated tokens; once prefilled the last one is the bonus token, which is
    /// not yet in the target cache (`cache.len() == tokens.len() - 1`).
    tokens: Vec<u32>,
    generated: usize,
    sampler: Sampler,
    /// Target features of committed positions the proposer has not seen.
    pending_features: Option<Tensor>,
    /// Prompt tokens already in the target cache while the prompt is prefilled in chunks.
    prefill_done: usize,
    prefilled: bool,
    /// Retracted after its prompt was prefilled: the re-prefill restores the cache up to the
    /// bonus token and samples nothing (`engine/retract.rs`).
    resumed: bool,
    stats: SeqStats,
    /// `Some(top_n)`: report committed tokens' logprobs with the `top_n` best entries.
    logprobs: Option<usize>,
    /// Penalties on the target's rows ([`Engine::set_penalties`]); None: none.
    penalties: Option<PenaltyState>,
    /// A grammar on the target's rows ([`Engine::set_constraint`]); None: none.
    constraint: Option<Box<dyn Constraint>>,
    /// `Some((start, top_n))`: report the logprobs of prompt tokens from `start` on
    /// ([`Engine::set_prompt_logprobs`]), gathered in `prompt_lps` over the prefill's chunks.
    prompt_logprobs: Option<(usize, usize)>,
    prompt_lps: Vec<logprobs::TokenLogprob>,
}

pub struct Engine {
    target: Target,
    proposer: Option<Box<dyn Proposer>>,
    config: EngineConfig,
    seqs: Vec<Sequence>,
    next_id: SeqId,
    /// Benchmarks only: accept drafts by count instead of by the target (not lossless).
    simulate: Option<SimulatedAcceptance>,
    /// Most prompt tokens prefilled per step ([`Engine::set_chunked_prefill`]).
    prefill_chunk: Option<usize>,
    /// Most prompt tokens prefilled in a step while other sequences decode
    /// ([`Engine::set_prefill_while_decoding`]).
    prefill_while_decoding: Option<usize>,
    /// Target caches of finished sequences, for the next ones (their step graphs stay valid).
    /// Not used with a pool: a finished sequence's pages go back to it.
    spare: SpareCaches,
    /// The shared paged K/V pool of the target ([`Engine::use_kv_pool`]); None: each sequence
    /// gets a cache of its own.
    pool: Option<KvPool>,
    /// Sequences whose forwards fail on purpose ([`Engine::inject_forward_failure`]).
    faults: isolate::InjectedFaults,
    /// Cached K/V pages of common prefixes ([`Engine::enable_prefix_cache`]).
    prefix: Option<PrefixCache>,
}

impl Engine {
    pub fn new(
        target: impl Into<Target>,
        proposer: Option<Box<dyn Proposer>>,
        config: EngineConfig,
    ) -> Self {
        Self {
            target: target.into(),
            proposer,
            config,
            seqs: Vec::new(),
            next_id: 0,
            simulate: None,
            prefill_chunk: None,
            spare: SpareCaches::default(),
            pool: None,
            prefix: None,
            faults: Default::default(),
            prefill_while_decoding: None,
        }
    }

    /// Makes every later round accept drafts as `sim` says instead of checking them against
    /// the target (SGLang's SGLANG_SIMULATE_ACC_LEN). Output is no longer the target's: use it
    /// to measure system cost only.
    pub fn simulate_acceptance(&mut self, sim: SimulatedAcceptance) {
        self.simulate = Some(sim);
    }

    /// Prefills prompts in chunks of at most `tokens` tokens per step across all new sequences
    /// (SGLang's `--chunked-prefill-size`), so a long prompt is prefilled over several steps
    /// interleaved with the decode and verify rounds of the running sequences instead of
    /// stalling them; `None` (the default) prefills every new prompt whole in one step.
    /// While other sequences decode, a prompt with more than `tokens` tokens still to prefill
    /// is prefilled in pieces of at most that many per step (fewer deep into a long prompt,
    /// see `long_prompt_piece`), so it stretches their inter-token latency by a bounded
    /// amount; shorter prompts still go in whole up to the chunk size. `None`: only the chunk
    /// size bounds it. Outputs do not change.
    pub fn set_prefill_while_decoding(&mut self, tokens: Option<usize>) {
        self.prefill_while_decoding = tokens.map(|t| t.max(1));
    }

    pub fn set_chunked_prefill(&mut self, tokens: Option<usize>) {
        self.prefill_chunk = tokens.filter(|&t| t > 0);
    }

    pub fn target(&self) -> &Target {
        &self.target
    }
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }
    pub fn num_active(&self) -> usize {
        self.seqs.len()
    }
    /// The committed tokens (the last one is the bonus token, not yet in the cache) and the
    /// target cache of an active sequence: for inspection and for tests that recompute it.
    pub fn sequence(&self, id: SeqId) -> Option<(&[u32], &SequenceCache)> {
        self.seqs
            .iter()
            .find(|s| s.id == id)
            .map(|s| (s.tokens.as_slice(), &s.cache))
    }

    /// Target caches kept from finished sequences for the next ones ([`SpareCaches`]).
    pub fn spare_caches(&self) -> usize {
        self.spare.len()
    }

    /// Drafts per round of the loaded proposer (0 without one).
    pub fn max_depth(&self) -> usize {
        self.proposer.as_ref().map_or(0, |p| p.max_depth())
    }

    /// Rows a sequence's caches are made for: its prompt plus `max_new_tokens`, rounded up to
    /// a power of two of at least [`MIN_CACHE_ROWS`] (at most the context length), plus the
    /// verify width. Rounding lets a finished sequence's cache (and the CUDA graphs captured
    /// on it) serve the next request of a similar size; sizing by the request, not the whole
    /// context, is what lets many sequences share a GPU's memory. A server admitting by K/V
    /// memory reserves exactly this.
    ///
    /// With a pool ([`Engine::use_kv_pool`]) a sequence takes exactly what it can fill,
    /// prompt + max_new_tokens + the verify width, in whole pages: the pool's step graphs
    /// serve every capacity.
    pub fn cache_capacity(
        &self,
        prompt_len: usize,
        max_new_tokens: usize,
        algorithm: Algorithm,
    ) -> usize {
        let need = prompt_len.saturating_add(max_new_tokens);
        if self.pool.is_some() {
            return pages_for(need + self.verify_width(algorithm)) * PAGE_SIZE;
        }
        let rows = need
            .max(MIN_CACHE_ROWS)
            .checked_next_power_of_two()
            .unwrap_or(usize::MAX)
            .min(self.config.max_context.max(need));
        rows + self.verify_width(algorithm)
    }

    /// Device bytes one cache row of a speculating sequence takes: the target's K/V plus the
    /// proposer's (a DFlash drafter's context K/V), for sizing a K/V budget from memory.
    pub fn kv_bytes_per_row(&self) -> usize {
        self.target.kv_bytes_per_row()
            + self
                .proposer
                .as_ref()
                .map_or(0, |p| p.cache_bytes_per_row())
    }

    /// Puts the target's K/V in one paged pool of `tokens` rows (rounded down to whole
    /// pages), allocated now, from which every sequence admitted later takes its pages; a
    /// server sizes it from device memory and admits by [`Engine::cache_capacity`] against
    /// [`Engine::kv_pool_tokens`], so a sequence's pages are always there. Only before any
    /// sequence is admitted.
    pub fn use_kv_pool(&mut self, tokens: usize) -> Result<(), EngineError> {
        if !self.seqs.is_empty() {
            return Err(EngineError::Model(ModelError::BadCacheOp(
                "the K/V pool is set before any sequence is admitted".into(),
            )));
        }
        let pages = tokens / PAGE_SIZE;
        if pages == 0 {
            return Err(EngineError::Model(ModelError::BadInput(format!(
                "a K/V pool of {tokens} tokens holds no page of {PAGE_SIZE}"
            ))));
        }
        self.spare = SpareCaches::default();
        // The old pool's memory is freed before the new one is allocated (the prefix cache
        // holds pages of it and is dropped too).
        self.prefix = None;
        self.pool = None;
        self.pool = Some(self.target.new_kv_pool(pages)?);
        Ok(())
    }

    /// Rows the pool holds (None without one).
    pub fn kv_pool_tokens(&self) -> Option<usize> {
        self.pool.as_ref().map(|p| p.total_pages() * PAGE_SIZE)
    }

    /// Rows of the pool not held by any sequence (None without one).
    pub fn kv_pool_free_tokens(&self) -> Option<usize> {
        self.pool.as_ref().map(|p| p.free_pages() * PAGE_SIZE)
    }

    fn verify_width(&self, algorithm: Algorithm) -> usize {
        1 + match algorithm {
            Algorithm::Plain => 0,
            Algorithm::Chain => self.max_depth(),
            Algorithm::DDTree { budget } => budget,
        }
    }

    /// Validates and admits a request. Nothing changes on error.
    pub fn add(&mut self, req: GenerationRequest) -> Result<SeqId, EngineError> {
        let max_context = self.config.max_context;
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if req.prompt.len() > max_context {
            return Err(EngineError::PromptTooLong {
                prompt: req.prompt.len(),
                max_context,
            });
        }
        if req.max_new_tokens == 0 {
            return Err(EngineError::ZeroMaxNewTokens);
        }
        if req.prompt.len() + req.max_new_tokens > max_context {
            return Err(EngineError::ContextExceeded {
                prompt: req.prompt.len(),
                max_new_tokens: req.max_new_tokens,
                max_context,
            });
        }
        let vocab = self.target.vocab_size();
        if let Some(&token) = req
            .prompt
            .iter()
            .chain(&req.stop_token_ids)
            .find(|&&t| t as usize >= vocab)
        {
            return Err(EngineError::TokenOutOfVocab { token, vocab });
        }
        req.sampling.validate()?;
        match req.algorithm {
            Algorithm::Plain => {}
            Algorithm::Chain | Algorithm::DDTree { .. } if self.proposer.is_none() => {
                return Err(EngineError::NoProposer(req.algorithm))
            }
            Algorithm::Chain => {}
            Algorithm::DDTree { budget } => {
                if budget == 0 || budget > self.config.max_ddtree_budget {
                    return Err(EngineError::BadBudget {
                        budget,
                        max: self.config.max_ddtree_budget,
                    });
                }
            }
        }
        let id = self.next_id;
        let capacity = self.cache_capacity(req.prompt.len(), req.max_new_tokens, req.algorithm);
        // With a pool, pages are taken as the sequence fills (prefill chunks, verify rows),
        // after the cached prefix it starts on. Hybrid targets keep a recurrent state per
        // verify node so any accepted one commits.
        let opened = self.open_cache(&req.prompt, req.prompt.len(), req.algorithm, capacity)?;
        if let (Some(p), true) = (self.proposer.as_mut(), req.algorithm != Algorithm::Plain) {
            if let Err(e) = p.open(id, capacity) {
                if self.pool.is_none() {
                    self.spare.put(capacity, opened.cache);
                }
                return Err(e.into());
            }
        }
        self.next_id += 1;
        let sampler = Sampler::new(
            req.sampling.clone(),
            self.config
                .seed
                .wrapping_add(id.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        );
        let mut stats = SeqStats::new(self.max_depth());
        stats.cached_tokens = opened.cached;
        self.seqs.push(Sequence {
            id,
            tokens: req.prompt.clone(),
            req,
            cache: opened.cache,
            capacity,
            generated: 0,
            sampler,
            pending_features: opened.features,
            prefill_done: opened.cached,
            prefilled: false,
            resumed: false,
            stats,
            logprobs: None,
            penalties: None,
            constraint: None,
            prompt_logprobs: None,
            prompt_lps: Vec::new(),
        });
        Ok(id)
    }

    /// Drops a sequence (abort). Unknown ids are an error so callers notice double removal.
    pub fn remove(&mut self, id: SeqId) -> Result<(), EngineError> {
        let i = self
            .seqs
            .iter()
            .position(|s| s.id == id)
            .ok_or(EngineError::UnknownSequence(id))?;
        let seq = self.seqs.remove(i);
        self.cache_leaving(&seq);
        if let Some(p) = self.proposer.as_mut() {
            if seq.req.algorithm != Algorithm::Plain {
                p.close(id);
            }
        }
        if self.pool.is_none() {
            self.spare.put(seq.capacity, seq.cache);
        }
        Ok(())
    }

    fn taps(&self) -> Vec<usize> {
        self.proposer
            .as_ref()
            .map_or_else(Vec::new, |p| p.target_layers())
    }

    /// Advances every sequence: prefills new ones, then runs one speculative round for all.
    /// Finished sequences are removed after their final event.
    pub fn step(&mut self) -> Result<Vec<SeqEvent>, EngineError> {
        let mut events = Vec::new();
        if self.seqs.iter().any(|s| !s.prefilled) {
            self.prefill(&mut events)?;
        }
        // Pages for this round's verify rows; the newest sequences give theirs up if needed.
        self.make_room()?;
        // Sequences whose prompt is still being prefilled (chunked) sit out the round.
        let (ready, prefilling): (Vec<Sequence>, Vec<Sequence>) = std::mem::take(&mut self.seqs)
            .into_iter()
            .partition(|s| s.prefilled);
        self.seqs = ready;
        let result = if self.seqs.is_empty() {
            Ok(())
        } else {
            self.round(&mut events)
        };
        self.seqs.extend(prefilling);
        result?;
        Ok(events)
    }

    fn round(&mut self, events: &mut Vec<SeqEvent>) -> Result<(), EngineError> {
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

    /// Removes the sequences whose final event is in `events` (finished or failed).
    fn reap(&mut self, events: &[SeqEvent]) {
        for e in events
            .iter()
            .filter(|e| e.finished.is_some() || e.error.is_some())
        {
            if self.seqs.iter().any(|s| s.id == e.id) {
                let _ = self.remove(e.id);
            }
        }
    }

    /// Runs one request to completion alone (tests, the offline tools).
    pub fn generate(
        &mut self,
        req: GenerationRequest,
    ) -> Result<(Vec<u32>, SeqStats), EngineError> {
        let id = self.add(req)?;
        let mut out = Vec::new();
        loop {
            for e in self.step()? {
                if e.id == id {
                    out.extend_from_slice(&e.tokens);
                    if e.finished.is_some() {
                        return Ok((out, e.stats));
                    }
                }
            }
        }
    }
}

impl Sequence {
    /// The event of a sequence that failed (it leaves the engine).
    fn failed(&self, error: &str) -> SeqEvent {
        SeqEvent {
            id: self.id,
            tokens: Vec::new(),
            finished: None,
            round: None,
            stats: self.stats.clone(),
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            error: Some(error.to_string()),
        }
    }
}

/// Appends `new` to the sequence until a stop condition; returns the emitted tokens and why it
/// finished. A block is cut right after a stop token or at the length limit.
fn commit_tokens(seq: &mut Sequence, new: &[u32], eos: &[u32]) -> (Vec<u32>, Option<FinishReason>) {
    let mut emitted = Vec::with_capacity(new.len());
    for &t in new {
        seq.tokens.push(t);
        seq.generated += 1;
        emitted.push(t);
        let is_stop =
            seq.req.stop_token_ids.contains(&t) || (!seq.req.ignore_eos && eos.contains(&t));
        if is_stop {
            return (emitted, Some(FinishReason::Stop(t)));
        }
        if seq.generated >= seq.req.max_new_tokens {
            return (emitted, Some(FinishReason::Length));
        }
    }
    (emitted, None)
}

#[cfg(test)]
mod tests;

mod isolate;
mod prefill;
mod prefix;
mod retract;
mod rows;
