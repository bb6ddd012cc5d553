//! The offline evaluation cache: for each prompt, the target's own greedy continuation and the
//! target's tapped hidden states of every position, computed once and reused by every drafter.
//!
//! On disk a cache is a folder with `features.safetensors` (`{i}.tokens` as u32 and
//! `{i}.features` as `[tokens, taps * hidden]` in the target dtype) and `manifest.json`, written
//! last, which says what the cache was built from: the target (config hash, weight-file sizes and
//! sampled hashes, dtype), the prompt set (file hash, template kwargs, the rendered token ids),
//! `max_new_tokens`, the tapped layers and the end-of-sequence ids. A cache is reused only when
//! all of these match the run (a larger `max_new_tokens` serves a smaller one); otherwise the run
//! is refused with what changed. Nothing in it depends on the drafter's block size: the engine
//! cuts every tree at `max_new_tokens`, so a replay never reads past it, whatever the depth.
//!
//! The continuation is generated through the engine with plain greedy decoding for exactly
//! `max_new_tokens` tokens, past any end of sequence: speculative rounds before the stop may
//! accept drafts beyond it, and the replay must see the target's tokens there too. The features
//! come from one causal forward over `[prompt, continuation]`, which the engine's verify passes
//! match up to kernel numerics; the forward's own argmax is compared with the continuation and
//! the disagreements recorded.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use dflash_models::speculative::{
    Algorithm, Engine, EngineConfig, GenerationRequest, SamplingParams,
};
use dflash_models::{AttnPattern, Qwen3Model, SeqForward};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::error::{CacheError, EvalError};
use super::identity::{short, weights_change, CacheSpec, PromptSetIdentity, TargetIdentity};
use super::prompts::TokenizedPrompt;

/// 2: a tap on the target's last layer is the final-normed output (`dflash_models::taps`);
/// format-1 caches hold the raw one there, so they are refused rather than replayed.
pub const CACHE_FORMAT: u32 = 2;
const MANIFEST: &str = "manifest.json";
const FEATURES: &str = "features.safetensors";
/// One cached prompt's bookkeeping (the tensors live in `features.safetensors`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheEntry {
    pub id: String,
    pub prompt_len: usize,
    /// Tokens the engine commits before it stops: up to and including the first
    /// end-of-sequence token, at most `max_new_tokens`.
    pub generated: usize,
    /// `stop` (end of sequence) or `length`.
    pub finish: String,
    /// Prompt + continuation (`max_new_tokens`, past any end of sequence).
    pub total_tokens: usize,
    /// Positions in the replayed range where the teacher-forced forward's argmax differs from
    /// the generated token (kernel numerics; 0 in f32).
    pub teacher_forced_mismatches: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheManifest {
    pub format: u32,
    pub target: TargetIdentity,
    pub prompts: PromptSetIdentity,
    pub max_new_tokens: usize,
    pub tap_layer_ids: Vec<usize>,
    pub hidden_size: usize,
    pub eos_token_ids: Vec<u32>,
    pub entries: Vec<CacheEntry>,
}

/// One prompt's reference, ready for the replay.
#[derive(Debug, Clone)]
pub struct CachedPrompt {
    pub id: String,
    /// Prompt + greedy continuation (`max_new_tokens`, past any end of sequence).
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub generated: usize,
    /// `[tokens.len(), taps * hidden]` on the CPU, in the manifest's tap order.
    pub features: Tensor,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheStatus {
    Built,
    Reused,
}

#[derive(Debug, Clone)]
pub struct EvalCache {
    pub manifest: CacheManifest,
    pub prompts: Vec<CachedPrompt>,
}

impl EvalCache {
    /// Generates each prompt's greedy continuation with `target` (one batched plain-decoding
    /// run) and computes its features with one causal forward per prompt. `context` bounds
    /// prompt + `max_new_tokens`; longer prompts are refused by id.
    pub fn build(target: &Qwen3Model, spec: &CacheSpec, context: usize) -> Result<Self, EvalError> {
        let longest = check_lengths(&spec.tokenized, spec.max_new_tokens, context)?;
        let continuations = greedy_continuations(target, spec, spec.max_new_tokens, longest)?;
        let mut manifest_entries = Vec::new();
        let mut prompts = Vec::new();
        for (p, continuation) in spec.tokenized.iter().zip(continuations) {
            let stop = continuation
                .iter()
                .position(|t| spec.eos_token_ids.contains(t));
            let generated = stop.map_or(spec.max_new_tokens, |i| i + 1);
            let mut tokens = p.tokens.clone();
            tokens.extend_from_slice(&continuation);
            let (features, mismatches) =
                teacher_forced(target, &tokens, p.tokens.len(), &spec.tap_layer_ids)?;
            manifest_entries.push(CacheEntry {
                id: p.id.clone(),
                prompt_len: p.tokens.len(),
                generated,
                finish: if stop.is_some() { "stop" } else { "length" }.into(),
                total_tokens: tokens.len(),
                teacher_forced_mismatches: mismatches.iter().filter(|&&m| m).count(),
            });
            prompts.push(CachedPrompt {
                id: p.id.clone(),
                tokens,
                prompt_len: p.tokens.len(),
                generated,
                features,
            });
        }
        Ok(Self {
            manifest: CacheManifest {
                format: CACHE_FORMAT,
                target: spec.target.clone(),
                prompts: spec.prompts.clone(),
                max_new_tokens: spec.max_new_tokens,
                tap_layer_ids: spec.tap_layer_ids.clone(),
                hidden_size: target.config().hidden_size,
                eos_token_ids: spec.eos_token_ids.clone(),
                entries: manifest_entries,
            },
            prompts,
        })
    }

    /// Writes the cache into `dir` (created if needed); the manifest goes last, so a folder
    /// without one is an unfinished cache.
    pub fn save(&self, dir: &Path) -> Result<(), CacheError> {
        let werr = |path: &Path, message: String| CacheError::Write {
            path: path.to_path_buf(),
            message,
        };
        std::fs::create_dir_all(dir).map_err(|e| werr(dir, e.to_string()))?;
        let manifest_path = dir.join(MANIFEST);
        if manifest_path.exists() {
            std::fs::remove_file(&manifest_path)
                .map_err(|e| werr(&manifest_path, e.to_string()))?;
        }
        let mut tensors = HashMap::new();
        for (i, p) in self.prompts.iter().enumerate() {
            let tokens = Tensor::new(p.tokens.as_slice(), &Device::Cpu)
                .map_err(|e| werr(dir, e.to_string()))?;
            tensors.insert(format!("{i}.tokens"), tokens);
            tensors.insert(format!("{i}.features"), p.features.clone());
        }
        let features = dir.join(FEATURES);
        candle_core::safetensors::save(&tensors, &features)
            .map_err(|e| werr(&features, e.to_string()))?;
        let json = serde_json::to_string_pretty(&self.manifest)
            .map_err(|e| werr(&manifest_path, e.to_string()))?;
        std::fs::write(&manifest_path, json).map_err(|e| werr(&manifest_path, e.to_string()))
    }

    /// Reads a cache written by [`save`](Self::save).
    pub fn load(dir: &Path) -> Result<Self, CacheError> {
        let rerr = |path: &Path, message: String| CacheError::Read {
            path: path.to_path_buf(),
            message,
        };
        let manifest_path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&manifest_path)
            .map_err(|e| rerr(&manifest_path, e.to_string()))?;
        let manifest: CacheManifest =
            serde_json::from_str(&text).map_err(|e| rerr(&manifest_path, e.to_string()))?;
        if manifest.format != CACHE_FORMAT {
            return Err(rerr(
                &manifest_path,
                format!(
                    "format {} (this build reads {CACHE_FORMAT}); rebuild it (`dflash-train eval --rebuild-cache`)",
                    manifest.format
                ),
            ));
        }
        let features_path = dir.join(FEATURES);
        let mut tensors = candle_core::safetensors::load(&features_path, &Device::Cpu)
            .map_err(|e| rerr(&features_path, e.to_string()))?;
        let mut prompts = Vec::with_capacity(manifest.entries.len());
        for (i, e) in manifest.entries.iter().enumerate() {
            let mut take = |name: String| {
                tensors
                    .remove(&name)
                    .ok_or_else(|| rerr(&features_path, format!("tensor `{name}` is missing")))
            };
            let tokens = take(format!("{i}.tokens"))?
                .to_vec1::<u32>()
                .map_err(|err| rerr(&features_path, err.to_string()))?;
            let features = take(format!("{i}.features"))?;
            let rows = features
                .dim(0)
                .map_err(|err| rerr(&features_path, err.to_string()))?;
            if tokens.len() != e.total_tokens || rows != e.total_tokens {
                return Err(rerr(
                    &features_path,
                    format!("entry {i} (`{}`) has {} tokens and {rows} feature rows, the manifest says {}", e.id, tokens.len(), e.total_tokens),
                ));
            }
            prompts.push(CachedPrompt {
                id: e.id.clone(),
                tokens,
                prompt_len: e.prompt_len,
                generated: e.generated,
                features,
            });
        }
        Ok(Self { manifest, prompts })
    }

    /// Refuses a cache that was built from another target, prompt set, rendering, end-of-sequence
    /// ids or a smaller `max_new_tokens` than `spec` asks for; the error names what changed.
    pub fn check(&self, spec: &CacheSpec, dir: &Path) -> Result<(), CacheError> {
        let m = &self.manifest;
        let mismatch = |what: &'static str, detail: String| CacheError::Mismatch {
            dir: dir.to_path_buf(),
            what,
            detail,
        };
        let (was, now) = (&m.target, &spec.target);
        if was.config_sha256 != now.config_sha256 {
            return Err(mismatch(
                "target",
                format!(
                    "config.json sha256 was {} (target `{}`), now {} (target `{}`)",
                    short(&was.config_sha256),
                    was.source,
                    short(&now.config_sha256),
                    now.source
                ),
            ));
        }
        if was.weights != now.weights {
            let detail = weights_change(&was.weights, &now.weights);
            return Err(mismatch(
                "target",
                format!(
                    "{detail} (cached target `{}`, now `{}`)",
                    was.source, now.source
                ),
            ));
        }
        if was.dtype != now.dtype {
            return Err(mismatch(
                "target dtype",
                format!(
                    "features were computed in {}, this run uses {}; pass --dtype {}",
                    was.dtype, now.dtype, was.dtype
                ),
            ));
        }
        let (was, now) = (&m.prompts, &spec.prompts);
        if was.sha256 != now.sha256 || was.count != now.count {
            return Err(mismatch(
                "prompt set",
                format!(
                    "{} ({} prompts, sha256 {}) then, {} ({} prompts, sha256 {}) now",
                    was.name,
                    was.count,
                    short(&was.sha256),
                    now.name,
                    now.count,
                    short(&now.sha256)
                ),
            ));
        }
        if was.template_kwargs != now.template_kwargs {
            return Err(mismatch(
                "chat template kwargs",
                format!(
                    "{} then, {} now",
                    Value::Object(was.template_kwargs.clone()),
                    Value::Object(now.template_kwargs.clone())
                ),
            ));
        }
        for (cached, p) in self.prompts.iter().zip(&spec.tokenized) {
            if cached.id != p.id || cached.tokens[..cached.prompt_len] != p.tokens[..] {
                return Err(mismatch("prompt rendering", format!("prompt `{}` renders to other tokens now ({} then, {} now): the tokenizer or chat template changed", p.id, cached.prompt_len, p.tokens.len())));
            }
        }
        if m.eos_token_ids != spec.eos_token_ids {
            return Err(mismatch(
                "end-of-sequence ids",
                format!("{:?} then, {:?} now", m.eos_token_ids, spec.eos_token_ids),
            ));
        }
        if m.max_new_tokens < spec.max_new_tokens {
            return Err(CacheError::TooShort {
                dir: dir.to_path_buf(),
                cached: m.max_new_tokens,
                requested: spec.max_new_tokens,
            });
        }
        Ok(())
    }

    /// The same references cut to `max_new_tokens` (<= the cached one): greedy decoding's
    /// prefix does not depend on how far it ran.
    pub fn with_max_new_tokens(mut self, max_new_tokens: usize) -> Self {
        let m = &mut self.manifest;
        if max_new_tokens < m.max_new_tokens {
            m.max_new_tokens = max_new_tokens;
            for (e, p) in m.entries.iter_mut().zip(&mut self.prompts) {
                if e.generated > max_new_tokens {
                    e.generated = max_new_tokens;
                    e.finish = "length".into();
                }
                p.generated = e.generated;
            }
        }
        self
    }

    /// Loads the cache in `dir` when it matches `spec`, else (or with `rebuild`) builds and
    /// saves a new one. A folder without a manifest is an unfinished build and is replaced.
    pub fn open_or_build(
        dir: &Path,
        target: &Qwen3Model,
        spec: &CacheSpec,
        context: usize,
        rebuild: bool,
    ) -> Result<(Self, CacheStatus), EvalError> {
        if !rebuild && dir.join(MANIFEST).exists() {
            let cache = Self::load(dir)?;
            cache.check(spec, dir)?;
            return Ok((
                cache.with_max_new_tokens(spec.max_new_tokens),
                CacheStatus::Reused,
            ));
        }
        let cache = Self::build(target, spec, context)?;
        cache.save(dir)?;
        Ok((cache, CacheStatus::Built))
    }

    /// Refuses a drafter that taps a target layer the cache lacks (any block size is served).
    pub fn check_drafter(&self, name: &str, layer_ids: &[usize]) -> Result<(), CacheError> {
        let m = &self.manifest;
        let missing: Vec<usize> = layer_ids
            .iter()
            .copied()
            .filter(|l| !m.tap_layer_ids.contains(l))
            .collect();
        if !missing.is_empty() {
            return Err(CacheError::MissingTaps {
                drafter: name.to_string(),
                cached: m.tap_layer_ids.clone(),
                missing,
            });
        }
        Ok(())
    }

    /// Prompt `i`'s features for a drafter tapping `layer_ids` (in its order), on `device`.
    pub fn features_for(
        &self,
        i: usize,
        layer_ids: &[usize],
        device: &Device,
    ) -> Result<Tensor, EvalError> {
        let m = &self.manifest;
        let h = m.hidden_size;
        let all = &self.prompts[i].features;
        let f = if layer_ids == m.tap_layer_ids.as_slice() {
            all.clone()
        } else {
            let cols = layer_ids
                .iter()
                .map(|l| {
                    let k = m.tap_layer_ids.iter().position(|c| c == l).ok_or_else(|| {
                        CacheError::MissingTaps {
                            drafter: String::new(),
                            cached: m.tap_layer_ids.clone(),
                            missing: vec![*l],
                        }
                    })?;
                    Ok(all.narrow(1, k * h, h)?)
                })
                .collect::<Result<Vec<_>, EvalError>>()?;
            Tensor::cat(&cols, 1)?
        };
        Ok(f.to_device(device)?)
    }
}

/// Refuses the first prompt that does not fit `context` with `max_new_tokens`; returns the
/// longest prompt + `max_new_tokens`.
pub fn check_lengths(
    prompts: &[TokenizedPrompt],
    max_new_tokens: usize,
    context: usize,
) -> Result<usize, EvalError> {
    let mut longest = 0;
    for p in prompts {
        let needed = p.tokens.len() + max_new_tokens;
        if needed > context {
            return Err(EvalError::PromptTooLong {
                id: p.id.clone(),
                prompt: p.tokens.len(),
                max_new_tokens,
                needed,
                context,
            });
        }
        longest = longest.max(needed);
    }
    Ok(longest)
}

/// Sequences decoded together while building a cache: enough to fill a GPU with a small
/// target, few enough that their KV caches fit next to an 8B one.
const GENERATE_BATCH: usize = 16;

/// Plain greedy decoding of every prompt in batched engine runs, `n` tokens each, past the
/// end of sequence.
fn greedy_continuations(
    target: &Qwen3Model,
    spec: &CacheSpec,
    n: usize,
    max_context: usize,
) -> Result<Vec<Vec<u32>>, EvalError> {
    let mut engine = Engine::new(
        target.clone(),
        None,
        EngineConfig {
            max_context,
            max_ddtree_budget: 1,
            eos_token_ids: spec.eos_token_ids.clone(),
            seed: 0,
        },
    );
    let mut continuations = Vec::with_capacity(spec.tokenized.len());
    for chunk in spec.tokenized.chunks(GENERATE_BATCH) {
        let mut ids = Vec::with_capacity(chunk.len());
        for p in chunk {
            ids.push(engine.add(GenerationRequest {
                prompt: p.tokens.clone(),
                max_new_tokens: n,
                sampling: SamplingParams::greedy(),
                stop_token_ids: Vec::new(),
                ignore_eos: true,
                algorithm: Algorithm::Plain,
            })?);
        }
        let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
        while engine.num_active() > 0 {
            for e in engine.step()? {
                out.entry(e.id).or_default().extend_from_slice(&e.tokens);
            }
        }
        continuations.extend(ids.iter().map(|id| out.remove(id).unwrap_or_default()));
    }
    Ok(continuations)
}

/// One causal forward over `tokens`: the tapped features of every position (to the CPU) and,
/// per continuation position, whether the forward's argmax differs from the token there.
fn teacher_forced(
    target: &Qwen3Model,
    tokens: &[u32],
    prompt_len: usize,
    taps: &[usize],
) -> Result<(Tensor, Vec<bool>), EvalError> {
    let mut cache = target.new_cache(tokens.len())?;
    let positions: Vec<u32> = (0..tokens.len() as u32).collect();
    let rows: Vec<usize> = (prompt_len - 1..tokens.len() - 1).collect();
    let out = target.forward(
        &mut [SeqForward {
            cache: &mut cache,
            tokens,
            positions: &positions,
            pattern: &AttnPattern::Causal,
            logit_rows: &rows,
        }],
        taps,
    )?;
    let missing = |what: &str| {
        EvalError::Model(dflash_models::ModelError::BadInput(format!(
            "the teacher-forced forward returned no {what}"
        )))
    };
    let features = out.taps.ok_or_else(|| missing("features"))?;
    let argmax = out
        .logits
        .ok_or_else(|| missing("logits"))?
        .argmax(1)?
        .to_vec1::<u32>()?;
    let mismatches = argmax
        .iter()
        .zip(&tokens[prompt_len..])
        .map(|(a, t)| a != t)
        .collect();
    Ok((features.to_device(&Device::Cpu)?, mismatches))
}
