//! Offline evaluation of one drafter on a cache: the entry point for `dflash-train eval` and for
//! periodic evaluation inside training.

use dflash_models::speculative::{DFlashProposer, Proposer};
use dflash_models::{DFlashDrafter, Qwen3Model};

use super::cache::EvalCache;
use super::error::EvalError;
use super::replay::{replay_batch, ReplayInput, ReplayRound, Verify};
use super::summary::{summarize, EvalSummary};

/// Acceptance of `drafter` on every cached prompt under each of `verifies` (round replay,
/// DDTREE.md §7.2): exactly the per-round accepted drafts greedy decoding with the drafter
/// would see, without running the target.
///
/// `target` is the model the drafter is paired with (its device runs the drafter; the
/// drafter already shares its embeddings and `lm_head`). The cache must hold the drafter's tap
/// layers; any block size works. Build it once per prompt set with
/// [`EvalCache::build`] (or load it) and reuse it for every evaluation.
///
/// For training: build a small cache at startup (a few prompts, `max_new_tokens` 64–128), then
/// every N steps turn the current weights into a `DFlashDrafter` and call this with
/// `Verify::chain_and_budgets(&[8, 32])`; log `summary.tau(Verify::Chain)` and the DDTree taus
/// next to the loss. Its cost is one 16-token drafter forward per distinct round anchor.
pub fn offline_eval(
    target: &Qwen3Model,
    drafter: &DFlashDrafter,
    cache: &EvalCache,
    verifies: &[Verify],
) -> Result<EvalSummary, EvalError> {
    cache.check_drafter("drafter", drafter.target_layer_ids())?;
    let mut proposer = DFlashProposer::new(drafter.clone());
    let layers = drafter.target_layer_ids().to_vec();
    replay_cache(&mut proposer, cache, verifies, REPLAY_BATCH, |i| {
        cache.features_for(i, &layers, target.device()).map(Some)
    })
}

/// Prompts drafted together in one proposer call (one drafter forward per step).
pub const REPLAY_BATCH: usize = 16;

/// As [`offline_eval`] for any proposer (`features(i)` gives prompt i's features in the
/// proposer's layer order, or `None`), `batch` prompts at a time. A stateful proposer (the
/// noisy oracle) needs `batch = 1` and one verification per call to see the engine's call
/// sequence; see [`replay_batch`].
pub fn replay_cache(
    proposer: &mut dyn Proposer,
    cache: &EvalCache,
    verifies: &[Verify],
    batch: usize,
    mut features: impl FnMut(usize) -> Result<Option<candle_core::Tensor>, EvalError>,
) -> Result<EvalSummary, EvalError> {
    let mut per_verify: Vec<Vec<(String, Vec<ReplayRound>)>> = vec![Vec::new(); verifies.len()];
    let indices: Vec<usize> = (0..cache.prompts.len()).collect();
    for chunk in indices.chunks(batch.max(1)) {
        let feats = chunk
            .iter()
            .map(|&i| features(i))
            .collect::<Result<Vec<_>, _>>()?;
        let inputs: Vec<ReplayInput<'_>> = chunk
            .iter()
            .zip(&feats)
            .map(|(&i, f)| {
                let p = &cache.prompts[i];
                ReplayInput {
                    id: &p.id,
                    tokens: &p.tokens,
                    prompt_len: p.prompt_len,
                    max_new_tokens: cache.manifest.max_new_tokens,
                    generated: p.generated,
                    features: f.as_ref(),
                }
            })
            .collect();
        let rounds = replay_batch(proposer, &inputs, verifies)?;
        for (input, per_prompt) in inputs.iter().zip(rounds) {
            for (v, r) in per_prompt.into_iter().enumerate() {
                per_verify[v].push((input.id.to_string(), r));
            }
        }
    }
    let max_depth = proposer.max_depth();
    Ok(EvalSummary {
        max_depth,
        modes: verifies
            .iter()
            .zip(&per_verify)
            .map(|(&v, prompts)| summarize(v, max_depth, prompts))
            .collect(),
    })
}
