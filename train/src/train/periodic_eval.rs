//! Evaluation inside training (`--eval-every N --eval-prompts FILE`): a small offline-eval
//! cache (the target's greedy continuations and tapped features) is built once at startup,
//! then every N steps the current weights are replayed on it exactly as greedy decoding would
//! run them, giving vanilla (chain) tau and DDTree tau at a few budgets.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use dflash_common::DFlashConfig;
use dflash_models::{DFlashDrafter, OpsMode, Qwen3Model, TargetEmbeddingsAndHead};
use serde_json::{Map, Value};

use super::error::{TrainError, TrainResult};
use crate::eval::{self, CacheRequest, CacheSpec, EvalCache, Verify};

pub struct PeriodicEval {
    pub every: usize,
    target: Qwen3Model,
    cache: EvalCache,
    verifies: Vec<Verify>,
}

fn err(path: &Path, e: impl std::fmt::Display) -> TrainError {
    TrainError::Flag {
        flag: "--eval-prompts",
        message: format!("{}: {e}", path.display()),
    }
}

impl PeriodicEval {
    /// Loads the target on the drafter device and opens (or builds) the cache in
    /// `output_dir/eval-cache`, refusing prompts that do not fit `context`.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        every: usize,
        prompts: &Path,
        max_new_tokens: usize,
        budgets: &[usize],
        target_dir: &Path,
        cfg: &DFlashConfig,
        dtype: DType,
        device: &Device,
        output_dir: &Path,
    ) -> TrainResult<Self> {
        let t0 = Instant::now();
        let mut kwargs = Map::new();
        kwargs.insert("enable_thinking".into(), Value::Bool(false));
        let spec = CacheSpec::prepare(CacheRequest {
            target_dir,
            target_source: &target_dir.display().to_string(),
            dtype,
            prompts,
            limit: None,
            template_kwargs: kwargs,
            max_new_tokens,
            tap_layer_ids: cfg.target_layer_ids.clone(),
        })
        .map_err(|e| err(prompts, e))?;
        let context = spec
            .tokenized
            .iter()
            .map(|p| p.tokens.len())
            .max()
            .unwrap_or(0)
            + max_new_tokens
            + cfg.block_size;
        eval::cache::check_lengths(&spec.tokenized, max_new_tokens, context)
            .map_err(|e| err(prompts, e))?;
        let target = Qwen3Model::load(target_dir, dtype, device, context, OpsMode::Fused)?;
        let dir: PathBuf = output_dir.join("eval-cache");
        // Rebuilt when the prompts or the target changed (a stale cache would be wrong).
        let (cache, status) = match EvalCache::open_or_build(&dir, &target, &spec, context, false) {
            Ok(c) => c,
            Err(eval::EvalError::Cache(_)) => {
                EvalCache::open_or_build(&dir, &target, &spec, context, true)
                    .map_err(|e| err(prompts, e))?
            }
            Err(e) => return Err(err(prompts, e)),
        };
        tracing::info!(
            "periodic eval: {} prompts x {max_new_tokens} tokens, cache {:?} in {:.1}s",
            cache.prompts.len(),
            status,
            t0.elapsed().as_secs_f64()
        );
        Ok(Self {
            every,
            target,
            cache,
            verifies: Verify::chain_and_budgets(budgets),
        })
    }

    pub fn due(&self, step: usize, last: bool) -> bool {
        self.every > 0 && (step.is_multiple_of(self.every) || last)
    }

    /// Tau of the current weights: `tau_chain`, `tau_ddtree<B>` per budget, and the seconds
    /// the evaluation took.
    pub fn run(
        &self,
        cfg: &DFlashConfig,
        params: &[(String, Var)],
        parts: &TargetEmbeddingsAndHead,
    ) -> TrainResult<Vec<(String, f64)>> {
        let t0 = Instant::now();
        let dtype = self.target.dtype();
        let tensors = params
            .iter()
            .map(|(n, v)| Ok((n.clone(), v.as_tensor().to_dtype(dtype)?)))
            .collect::<candle_core::Result<HashMap<String, Tensor>>>()?;
        let parts = TargetEmbeddingsAndHead {
            embed_tokens: parts.embed_tokens.to_dtype(dtype)?,
            lm_head: parts.lm_head.to_dtype(dtype)?,
            max_positions: self.target.rope().max_positions(),
        };
        let drafter = DFlashDrafter::from_tensors(cfg.clone(), &tensors, &parts, OpsMode::Fused)?;
        let summary = eval::offline_eval(&self.target, &drafter, &self.cache, &self.verifies)
            .map_err(|e| TrainError::Flag {
                flag: "--eval-every",
                message: e.to_string(),
            })?;
        let mut out: Vec<(String, f64)> = self
            .verifies
            .iter()
            .filter_map(|&v| {
                let name = match v {
                    Verify::Chain => "tau_chain".to_string(),
                    Verify::DDTree { budget } => format!("tau_ddtree{budget}"),
                };
                Some((name, summary.tau(v)?))
            })
            .collect();
        out.push(("eval_s".into(), t0.elapsed().as_secs_f64()));
        Ok(out)
    }
}
