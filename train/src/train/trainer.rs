//! The training loop: take `grad_accum` batches from the pipeline, draw anchors, run the
//! drafter's training forward, back-propagate the decayed cross-entropy normalised over the whole
//! step, clip, and update; log, write metrics and checkpoints on the way.
//!
//! Determinism: the batch plan, the anchors (seeded by run seed and batch index) and the
//! initialisation depend only on the settings, and the optimizer state is saved in f32, so a run
//! stopped at a checkpoint and resumed ends with the same weights as one that never stopped.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor, D};
use dflash_common::chat::ChatTemplate;
use dflash_common::tokenizer::Tokenizer;
use dflash_common::Qwen3Config;
use dflash_models::TrainSequence;
use serde_json::json;

use super::checkpoint::{self, RunFingerprint, TrainerState};
use super::data::{load_datasets, DataOptions};
use super::error::{TrainError, TrainResult};
use super::loss::{self, BlockTargets, Hits};
use super::optim::{global_norm, learning_rate, AdamW, AdamWConfig};
use super::pipeline::{ComputedBatch, Pipeline};
use super::plan::{BatchPlan, PlanConfig};
use super::setup;
use super::{SaveDtype, TrainArgs};

/// What a finished (or deliberately stopped) run reports.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// Optimizer steps taken in total (including those before a resume).
    pub steps: usize,
    /// `(step, loss)` of every step this process ran.
    pub losses: Vec<(usize, f64)>,
    pub first_loss: f64,
    pub last_loss: f64,
    pub skipped_steps: usize,
    pub elapsed_s: f64,
    /// Tokens of the sequences trained on, per second of this process's loop.
    pub tokens_per_s: f64,
    /// Where the drafter is: the output directory, or the checkpoint when stopped early.
    pub output: PathBuf,
    pub last_checkpoint: Option<PathBuf>,
    pub stopped_early: bool,
}

/// Loss and hits of a logging window.
#[derive(Default)]
struct Window {
    loss: f64,
    steps: usize,
    hits: Hits,
    tokens: usize,
    wait_s: f64,
    target_s: f64,
    step_s: f64,
}

pub fn train(args: &TrainArgs) -> TrainResult<TrainSummary> {
    let started = Instant::now();
    setup::check_output_dir(&args.output_dir)?;
    if args.batch_size == 0 || args.grad_accum == 0 {
        return Err(TrainError::Flag {
            flag: "--batch-size",
            message: "--batch-size and --grad-accum must be at least 1".into(),
        });
    }
    if args.max_depth < args.batch_size {
        return Err(TrainError::Flag {
            flag: "--max-depth",
            message: format!(
                "{} is smaller than --batch-size {}: a batch could never be buffered",
                args.max_depth, args.batch_size
            ),
        });
    }
    let drafter_device = args.drafter_device.open("--drafter-device")?;
    let dtype = setup::compute_dtype(args.compute_dtype, &drafter_device);
    let target_cfg = Qwen3Config::from_file(args.target_model.join("config.json"))?;
    let tok = Tokenizer::from_dir(&args.target_model)?;
    let template = ChatTemplate::from_model(&args.target_model, tok.config(), None)?;

    let resumed = args
        .resume
        .as_ref()
        .map(|p| checkpoint::load_checkpoint(p, &drafter_device))
        .transpose()?;
    let cfg = match &resumed {
        Some(r) => {
            let path = r.dir.join("config.json");
            r.cfg
                .check_against_target(&path, &target_cfg)
                .map_err(|e| TrainError::DrafterMismatch(e.to_string()))?;
            r.cfg.clone()
        }
        None => setup::fresh_config(args, &target_cfg, tok.token_to_id("<|MASK|>"))?,
    };
    let b = cfg.block_size;
    let gamma = args.loss_gamma.unwrap_or_else(|| loss::default_gamma(b));

    let opts = DataOptions {
        max_len: args.max_len,
        min_supervised: args.min_supervised.unwrap_or(2 * b),
        max_bad_lines: args.max_bad_lines,
        max_records: args.max_records,
    };
    let data = load_datasets(&args.datasets, &tok, &template, &opts)?;
    tracing::info!(
        "data: {} sequences, {} tokens ({} supervised); {} records, {} unreadable lines, {} truncated, {} with too little supervision",
        data.examples.len(), data.stats.tokens, data.stats.supervised_tokens, data.stats.records,
        data.stats.bad_lines, data.stats.truncated, data.stats.too_little_supervision
    );
    let plan_cfg = PlanConfig {
        seed: args.seed,
        batch_size: args.batch_size,
        min_ready: args.min_ready,
        bucket_width: args.bucket_width,
        epochs: if args.max_steps.is_some() {
            None
        } else {
            Some(args.epochs)
        },
    };
    let lens: Vec<usize> = data.examples.iter().map(|e| e.tokens.len()).collect();
    let plan = BatchPlan::new(plan_cfg.clone(), lens);
    let total_steps = match (args.max_steps, plan.total_batches()) {
        (Some(s), _) => s,
        (None, Some(batches)) => batches.div_ceil(args.grad_accum),
        (None, None) => unreachable!("epochs bound the plan"),
    };
    let fingerprint = RunFingerprint {
        datasets: args
            .datasets
            .iter()
            .map(|p| p.display().to_string())
            .collect(),
        max_records: args.max_records,
        max_len: args.max_len,
        min_supervised: opts.min_supervised,
        plan: plan_cfg,
        num_anchors: args.num_anchors,
        grad_accum: args.grad_accum,
    };

    let (params, mut state) = match resumed {
        Some(r) => {
            if r.state.fingerprint != fingerprint {
                return Err(TrainError::Checkpoint {
                    path: r.dir.join(checkpoint::STATE_FILE),
                    message: format!(
                        "was trained with different data settings; resume with the same --dataset, --max-records, --max-len, --min-supervised, --seed, --batch-size, --min-ready, --bucket-width, --epochs/--max-steps, --num-anchors and --grad-accum.\n  checkpoint: {:?}\n  now:        {:?}",
                        r.state.fingerprint, fingerprint
                    ),
                });
            }
            tracing::info!("resuming from {} at step {}", r.dir.display(), r.state.step);
            let mut state = r.state;
            state.total_steps = total_steps;
            let vars = setup::to_vars(r.params)?;
            let mut opt = AdamW::new(adam_cfg(args), vars)?;
            opt.m = r.m;
            opt.v = r.v;
            opt.t = state.adam_t;
            (opt, state)
        }
        None => {
            let params = setup::init_params(
                &cfg,
                args.seed,
                &drafter_device,
                &args.target_model,
                args.init_from_target_layers.as_deref(),
            )?;
            let opt = AdamW::new(adam_cfg(args), setup::to_vars(params)?)?;
            let state = TrainerState {
                step: 0,
                batches: 0,
                adam_t: 0,
                skipped_steps: 0,
                nonfinite_in_row: 0,
                total_steps,
                fingerprint,
            };
            (opt, state)
        }
    };
    let mut opt = params;
    let n_params: usize = opt
        .params
        .iter()
        .map(|(_, v)| v.as_tensor().elem_count())
        .sum();
    tracing::info!(
        "drafter: {} layers, block {b}, taps {:?}, mask {}, {n_params} parameters; {total_steps} steps, gamma {gamma}",
        cfg.layers.num_hidden_layers, cfg.target_layer_ids, cfg.mask_token_id
    );

    let parts = setup::load_embeddings_and_head(
        &args.target_model,
        &target_cfg,
        dtype,
        &drafter_device,
        args.max_len,
    )?;
    let workers = setup::load_target_workers(
        &args.target_model,
        &args.target_devices,
        args.compute_dtype,
        args.max_len,
    )?;
    let examples = Arc::new(data.examples);
    let mut pipeline = Pipeline::start(
        examples.clone(),
        Box::new(plan.skip(state.batches)),
        state.batches,
        workers,
        cfg.target_layer_ids.clone(),
        args.max_depth,
    );
    // f32 compute shares storage with the variables, so one drafter serves every step.
    let shared = if dtype == DType::F32 {
        Some(setup::drafter_from_vars(&cfg, &opt.params, &parts, dtype)?)
    } else {
        None
    };
    let save_dtype = match args.save_dtype {
        SaveDtype::Bf16 => DType::BF16,
        SaveDtype::F32 => DType::F32,
    };
    let warmup = ((args.warmup_ratio * total_steps as f64).ceil() as usize).max(1);
    let stop_at = args.stop_after_steps.unwrap_or(usize::MAX).min(total_steps);
    let mut metrics = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(args.output_dir.join("metrics.jsonl"))
        .map_err(|e| TrainError::OutputDir {
            path: args.output_dir.clone(),
            message: e.to_string(),
        })?;

    let loop_start = Instant::now();
    let mut losses = Vec::new();
    let mut curve = Vec::new();
    let mut window = Window::default();
    let mut total_tokens = 0usize;
    let mut last_checkpoint = None;
    let mut exhausted = false;
    while state.step < stop_at && !exhausted {
        let t_step = Instant::now();
        let mut batches: Vec<ComputedBatch> = Vec::with_capacity(args.grad_accum);
        for _ in 0..args.grad_accum {
            let (batch, waited) = pipeline.next_batch()?;
            window.wait_s += waited.as_secs_f64();
            match batch {
                Some(bt) => batches.push(bt),
                None => {
                    exhausted = true;
                    break;
                }
            }
        }
        if batches.is_empty() {
            break;
        }
        // Anchors and labels of the whole step first: the loss is normalised over all of it.
        let mut prepared = Vec::with_capacity(batches.len());
        for bt in &batches {
            let mut rng = loss::anchor_rng(args.seed, bt.index);
            let mut targets = BlockTargets::default();
            let mut anchors = Vec::with_capacity(bt.seqs.len());
            for s in &bt.seqs {
                let ex = &examples[s.example];
                let a = loss::sample_anchors(ex, args.num_anchors, &mut rng);
                targets.push(ex, &a, b, gamma);
                anchors.push(a);
            }
            prepared.push((anchors, targets));
        }
        let total_weight: f64 = prepared.iter().map(|(_, t)| t.total_weight()).sum();
        let rebuilt;
        let drafter = match &shared {
            Some(d) => d,
            None => {
                rebuilt = setup::drafter_from_vars(&cfg, &opt.params, &parts, dtype)?;
                &rebuilt
            }
        };
        let mut grads: Vec<Option<Tensor>> = vec![None; opt.params.len()];
        let mut step_loss = 0.0;
        let mut step_hits = Hits::default();
        let mut step_tokens = 0;
        for (bt, (anchors, targets)) in batches.iter().zip(&prepared) {
            let feats = bt
                .seqs
                .iter()
                .map(|s| s.features.to_device(drafter.device()))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let seqs: Vec<TrainSequence<'_>> = bt
                .seqs
                .iter()
                .zip(&feats)
                .zip(anchors)
                .map(|((s, f), a)| TrainSequence {
                    features: f,
                    tokens: &examples[s.example].tokens,
                    anchors: a,
                })
                .collect();
            step_tokens += seqs.iter().map(|s| s.tokens.len()).sum::<usize>();
            window.target_s += bt.target_s;
            let hidden = drafter.train_hidden(&seqs)?;
            let rows = Tensor::new(targets.rows.as_slice(), drafter.device())?;
            let logits = drafter.lm_head(&hidden.index_select(&rows, 0)?)?;
            let loss =
                loss::weighted_cross_entropy(&logits, targets, total_weight, drafter.device())?;
            let store = loss.backward()?;
            for (i, (_, var)) in opt.params.iter().enumerate() {
                if let Some(g) = store.get(var.as_tensor()) {
                    grads[i] = Some(match grads[i].take() {
                        Some(acc) => (acc + g)?,
                        None => g.clone(),
                    });
                }
            }
            step_loss += loss.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
            let predicted = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
            step_hits.add(loss::hits(&predicted, targets));
        }
        state.batches += batches.len();
        let grads = opt
            .params
            .iter()
            .zip(grads)
            .map(|((_, v), g)| g.map_or_else(|| v.as_tensor().zeros_like(), Ok))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let norm = global_norm(&grads)?;
        let lr = learning_rate(state.step, total_steps, warmup, args.lr);
        let finite = step_loss.is_finite() && norm.is_finite();
        if finite {
            let scale = if norm > args.grad_clip {
                args.grad_clip / (norm + 1e-6)
            } else {
                1.0
            };
            let clipped = if scale < 1.0 {
                grads
                    .iter()
                    .map(|g| g * scale)
                    .collect::<candle_core::Result<Vec<_>>>()?
            } else {
                grads
            };
            opt.step(&clipped, lr)?;
            state.adam_t = opt.t;
            state.nonfinite_in_row = 0;
        } else {
            state.skipped_steps += 1;
            state.nonfinite_in_row += 1;
            tracing::warn!(
                "step {}: non-finite loss {step_loss} or gradient norm {norm}; step skipped",
                state.step + 1
            );
            if state.nonfinite_in_row >= args.max_nonfinite_steps {
                return Err(TrainError::NonFinite {
                    count: state.nonfinite_in_row,
                    step: state.step + 1,
                    total: state.skipped_steps,
                    limit: args.max_nonfinite_steps,
                    last_good: last_checkpoint
                        .as_ref()
                        .or(checkpoint::list_checkpoints(&args.output_dir)
                            .last()
                            .map(|(_, p)| p))
                        .map_or("none yet".into(), |p: &PathBuf| p.display().to_string()),
                });
            }
        }
        state.step += 1;
        total_tokens += step_tokens;
        let step_s = t_step.elapsed().as_secs_f64();
        if finite {
            losses.push((state.step, step_loss));
            window.loss += step_loss;
            window.steps += 1;
        }
        window.hits.add(step_hits);
        window.tokens += step_tokens;
        window.step_s += step_s;
        let record = json!({
            "step": state.step, "loss": step_loss, "accuracy": step_hits.accuracy(),
            "tau_estimate": step_hits.tau(), "lr": lr, "grad_norm": norm,
            "tokens": step_tokens, "blocks": step_hits.blocks, "step_s": step_s,
            "queue_depth": pipeline.depth(), "elapsed_s": started.elapsed().as_secs_f64(),
            "skipped": !finite,
        });
        let _ = writeln!(metrics, "{record}");
        let last = state.step == stop_at || exhausted;
        if state.step % args.log_every.max(1) == 0 || last {
            let n = window.steps.max(1) as f64;
            let elapsed = loop_start.elapsed().as_secs_f64();
            let eta = elapsed / losses.len().max(1) as f64
                * (stop_at.min(total_steps) - state.step) as f64;
            tracing::info!(
                "step {}/{} loss {:.4} acc {:.3} tau~{:.2} lr {:.2e} |g| {:.2} | {:.0} tok/s, wait {:.0}% , queue {} | ETA {:.0}s",
                state.step, total_steps, window.loss / n, window.hits.accuracy(), window.hits.tau(), lr, norm,
                window.tokens as f64 / window.step_s.max(1e-9), 100.0 * window.wait_s / window.step_s.max(1e-9),
                pipeline.depth(), eta
            );
            curve.push(json!({"step": state.step, "loss": window.loss / n, "accuracy": window.hits.accuracy(), "tau_estimate": window.hits.tau()}));
            window = Window::default();
        }
        // A skipped step changed nothing; saving it would only rotate good checkpoints out.
        if (finite && state.step % args.save_every.max(1) == 0) || last {
            state.total_steps = total_steps;
            let path = checkpoint::save_checkpoint(
                &args.output_dir,
                &cfg,
                target_cfg.num_hidden_layers,
                &opt,
                &state,
                save_dtype,
                args.keep_checkpoints,
            )?;
            tracing::info!("checkpoint {}", path.display());
            last_checkpoint = Some(path);
        }
    }
    drop(pipeline);
    let loop_s = loop_start.elapsed().as_secs_f64();
    let stopped_early = state.step < total_steps && !exhausted;
    let output = if stopped_early {
        last_checkpoint
            .clone()
            .unwrap_or_else(|| args.output_dir.clone())
    } else {
        let params: Vec<(String, Tensor)> = opt
            .params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        checkpoint::write_drafter(
            &args.output_dir,
            &cfg,
            target_cfg.num_hidden_layers,
            &params,
            save_dtype,
        )?;
        args.output_dir.clone()
    };
    let first_loss = losses.first().map_or(f64::NAN, |l| l.1);
    let last_loss = losses.last().map_or(f64::NAN, |l| l.1);
    let log = json!({
        "steps": state.step, "total_steps": total_steps, "skipped_steps": state.skipped_steps,
        "elapsed_s": started.elapsed().as_secs_f64(), "loop_s": loop_s,
        "tokens_per_s": total_tokens as f64 / loop_s.max(1e-9),
        "data": data.stats, "curve": curve, "args": format!("{args:?}"),
    });
    checkpoint::write_atomic(
        &args.output_dir.join("training_log.json"),
        serde_json::to_string_pretty(&log)
            .expect("log serializes")
            .as_bytes(),
    )?;
    Ok(TrainSummary {
        steps: state.step,
        losses,
        first_loss,
        last_loss,
        skipped_steps: state.skipped_steps,
        elapsed_s: started.elapsed().as_secs_f64(),
        tokens_per_s: total_tokens as f64 / loop_s.max(1e-9),
        output,
        last_checkpoint,
        stopped_early,
    })
}

fn adam_cfg(args: &TrainArgs) -> AdamWConfig {
    AdamWConfig {
        weight_decay: args.weight_decay,
        ..AdamWConfig::default()
    }
}
