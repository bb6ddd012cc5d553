//! The training loop: take `grad_accum` batches from the pipeline, draw anchors, run the
//! drafter's training forward, back-propagate the decayed cross-entropy normalised over the whole
//! step, clip, and update; log, write metrics and checkpoints on the way.
//!
//! Determinism: the batch plan, the anchors (seeded by run seed and batch index) and the
//! initialisation depend only on the settings, and the optimizer state is saved in f32, so a run
//! stopped at a checkpoint and resumed ends with the same weights as one that never stopped.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};
use serde_json::{json, Map, Value};

use super::checkpoint::{self, RunFingerprint, TrainerState};
use super::ckpt_writer::{CheckpointSpec, CheckpointWriter};
use super::data::load_specs;
use super::dataset::DataOptions;
use super::error::{TrainError, TrainResult};
use super::flops;
use super::loss::{self, BlockTargets, Hits};
use super::optim::{learning_rate, AdamWConfig};
use super::optimizer::{OptimizerChoice, TrainOptimizer};
use super::periodic_eval::PeriodicEval;
use super::pipeline::{ComputedBatch, Depth, Pipeline, Routing};
use super::plan::{BatchPlan, PlanConfig};
use super::replicas::{self, Prepared, Replica};
use super::resume;
use super::setup;
use super::target::Target;
use super::window::{describe, MfuBasis, Stage, StageClock, Window};
use super::{DeviceSpec, SaveDtype, TrainArgs};
use crate::observe::Reporter;

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
    args.check_engine()?;
    let drafter_devices = replicas::open_devices(&args.drafter_devices, args.grad_accum)?;
    let drafter_device = drafter_devices[0].clone();
    let dtype = setup::compute_dtype(args.compute_dtype, &drafter_device);
    let target = Target::open(&args.target_model)?;
    let target_cfg = target.config.clone();
    let dataset_specs = args.dataset_specs()?;
    if args.init_from_target_layers.is_some() {
        target.require_dir("--init-from-target-layers")?;
    }

    let resumed = resume::resume_point(args, &drafter_device)?;
    let resumed_from = resumed.as_ref().map(|r| r.dir.clone());
    let cfg = match &resumed {
        Some(r) => {
            let path = r.dir.join("config.json");
            r.cfg
                .check_against_target(&path, &target_cfg)
                .map_err(|e| TrainError::DrafterMismatch(e.to_string()))?;
            r.cfg.clone()
        }
        None => setup::fresh_config(args, &target_cfg, target.default_mask_token())?,
    };
    let b = cfg.block_size;
    let gamma = args.loss_gamma.unwrap_or_else(|| loss::default_gamma(b));

    let opts = DataOptions {
        max_len: args.max_len,
        min_supervised: args.min_supervised.unwrap_or(2 * b),
        max_bad_lines: args.max_bad_lines,
        max_records: args.max_records,
    };
    let data = load_specs(&dataset_specs, &target, cfg.mask_token_id, &opts)?;
    tracing::info!(
        "data: {} sequences, {} tokens ({} supervised); {} records, {} unreadable lines, {} without a final assistant turn, {} truncated, {} with too little supervision",
        data.examples.len(), data.stats.tokens, data.stats.supervised_tokens, data.stats.records,
        data.stats.bad_lines, data.stats.no_final_assistant_turn, data.stats.truncated,
        data.stats.too_little_supervision
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
        datasets: dataset_specs.iter().map(|d| d.to_string()).collect(),
        max_records: args.max_records,
        max_len: args.max_len,
        min_supervised: opts.min_supervised,
        plan: plan_cfg,
        num_anchors: args.num_anchors,
        grad_accum: args.grad_accum,
    };

    let choice = OptimizerChoice {
        fused: args.optimizer.fused_on(&drafter_device),
        adam: adam_cfg(args),
        clip: args.grad_clip,
        compute_dtype: dtype,
    };
    let (opt, mut state) = match resumed {
        Some(r) => resume::restore(r, &fingerprint, total_steps, choice)?,
        None => {
            let params = match &args.init_drafter {
                Some(dir) => setup::load_params(&cfg, dir, &drafter_device)?,
                None => setup::init_params(
                    &cfg,
                    args.seed,
                    &drafter_device,
                    target.dir(),
                    args.init_from_target_layers.as_deref(),
                )?,
            };
            let opt = TrainOptimizer::new(choice, params, None)?;
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
    tracing::info!(
        "drafter: {} layers, block {b}, taps {:?}, mask {}, {} parameters; {total_steps} steps, gamma {gamma}; {} AdamW",
        cfg.layers.num_hidden_layers, cfg.target_layer_ids, cfg.mask_token_id, opt.num_params(),
        if opt.is_fused() { "fused" } else { "reference" }
    );
    setup::warn_on_last_layer_tap(&cfg, &target_cfg);

    let workers = target.load_workers(
        &args.target_devices,
        args.compute_dtype,
        args.max_len,
        &cfg.target_layer_ids,
        &drafter_devices,
    )?;
    let parts = target.embeddings_and_head(&workers, dtype, &drafter_device, args.max_len)?;
    // Rank 0 holds the run's optimizer; the other data-parallel ranks start as exact copies.
    let mut ranks = vec![Replica::new(
        drafter_device.clone(),
        opt,
        parts,
        &cfg,
        dtype,
    )?];
    for dev in &drafter_devices[1..] {
        let parts = target.embeddings_and_head(&workers, dtype, dev, args.max_len)?;
        let counters = (state.adam_t, state.skipped_steps as u64);
        let rank = ranks[0].replicate(dev.clone(), parts, choice, counters, &cfg, dtype)?;
        ranks.push(rank);
    }
    let reducer = replicas::GradReducer::for_devices(args.grad_reducer, &drafter_devices)?;
    let var_shapes: Vec<_> = ranks[0]
        .opt
        .vars()
        .iter()
        .map(|(_, v)| v.shape().clone())
        .collect();
    if ranks.len() > 1 {
        tracing::info!(
            "data-parallel: {} drafter replicas ({}), {} micro-batches each per step, gradients summed {}",
            ranks.len(),
            args.drafter_devices
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(","),
            args.grad_accum / ranks.len(),
            reducer.describe()
        );
    }
    let periodic = match (&args.eval_prompts, args.eval_every) {
        (Some(prompts), every) if every > 0 => Some(PeriodicEval::start(
            every,
            prompts,
            args.eval_max_new_tokens,
            &args.eval_budgets,
            target.require_dir("--eval-every")?,
            &cfg,
            dtype,
            &drafter_device,
            &args.output_dir,
        )?),
        _ => None,
    };
    let cuda: Vec<usize> = args
        .target_devices
        .iter()
        .chain(&args.drafter_devices)
        .filter_map(|d| match d {
            DeviceSpec::Cuda(i) => Some(*i),
            DeviceSpec::Cpu => None,
        })
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let basis = MfuBasis {
        peak_tflops: args
            .peak_tflops
            .or_else(|| (!drafter_device.is_cpu()).then_some(flops::H200_BF16_PEAK_TFLOPS)),
        target_devices: args.target_devices.len(),
        devices: args
            .target_devices
            .iter()
            .chain(&args.drafter_devices)
            .map(|d| d.to_string())
            .collect::<BTreeSet<_>>()
            .len(),
    };
    let examples = Arc::new(data.examples);
    let mut pipeline = Pipeline::start(
        examples.clone(),
        Box::new(plan.skip(state.batches)),
        state.batches,
        workers,
        cfg.target_layer_ids.clone(),
        if args.serialize_target {
            Depth::Serialized(args.batch_size)
        } else {
            Depth::Overlapped(args.max_depth)
        },
        (drafter_devices.len() > 1).then(|| Routing {
            grad_accum: args.grad_accum,
            rank_devices: drafter_devices.clone(),
        }),
    );
    let save_dtype = match args.save_dtype {
        SaveDtype::Bf16 => DType::BF16,
        SaveDtype::F32 => DType::F32,
    };
    let warmup = ((args.warmup_ratio * total_steps as f64).ceil() as usize).max(1);
    let stop_at = args.stop_after_steps.unwrap_or(usize::MAX).min(total_steps);
    let mut reporter = Reporter::new(
        &args.output_dir,
        stop_at,
        state.step,
        &cuda,
        Duration::from_secs_f64(args.gpu_sample_secs.max(0.05)),
    )
    .map_err(|e| TrainError::OutputDir {
        path: args.output_dir.clone(),
        message: e.to_string(),
    })?;
    let lens: Vec<usize> = examples.iter().map(|e| e.tokens.len()).collect();
    let log_every = args.log_every.max(1);

    let loop_start = Instant::now();
    let mut losses = Vec::new();
    let mut curve = Vec::new();
    let mut window = Window::default();
    let mut total_tokens = 0usize;
    let mut last_checkpoint = None;
    let mut exhausted = false;
    let mut evals: Vec<Value> = Vec::new();
    let mut writer = CheckpointWriter::new(args.sync_checkpoints);
    let dev = drafter_device.clone();
    while state.step < stop_at && !exhausted {
        let t_step = Instant::now();
        // The last step of each log window is timed stage by stage (synchronising the device
        // at each boundary); the others run free.
        let timed = (state.step + 1) % log_every == 0;
        let mut clock = StageClock::new(timed, &dev);
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
        clock.restart();
        // Anchors and labels of the whole step first: the loss is normalised over all of it.
        let mut prepared = Vec::with_capacity(batches.len());
        let mut step_flops = (0.0, 0.0);
        for bt in &batches {
            let mut rng = loss::anchor_rng(args.seed, bt.index);
            let mut targets = BlockTargets::default();
            let mut anchors = Vec::with_capacity(bt.seqs.len());
            for s in &bt.seqs {
                let ex = &examples[s.example];
                let a = loss::sample_anchors(ex, args.num_anchors, &mut rng);
                let rows_before = targets.rows.len();
                targets.push(ex, &a, b, gamma);
                step_flops.0 += flops::drafter_step(
                    &cfg,
                    ex.tokens.len(),
                    &a,
                    targets.rows.len() - rows_before,
                );
                step_flops.1 += flops::target_forward(&target_cfg, ex.tokens.len());
                anchors.push(a);
            }
            prepared.push(Prepared { anchors, targets });
        }
        let total_weight: f64 = prepared.iter().map(|p| p.targets.total_weight()).sum();
        let work: Vec<(&ComputedBatch, &Prepared)> = batches.iter().zip(&prepared).collect();
        let step_tokens: usize = work
            .iter()
            .flat_map(|(bt, _)| &bt.seqs)
            .map(|s| examples[s.example].tokens.len())
            .sum();
        window.target_s += batches.iter().map(|bt| bt.target_s).sum::<f64>();
        let per_rank = replicas::run_ranks(
            &ranks,
            args,
            &cfg,
            dtype,
            &examples,
            &work,
            total_weight,
            &mut clock,
        )?;
        // Losses and argmaxes stay on the devices until the step's one read-back; in
        // micro-batch order (each rank holds a contiguous run of them).
        let mut loss_parts = Vec::with_capacity(batches.len());
        let mut predicted_parts = Vec::with_capacity(batches.len());
        let mut rank_grads = Vec::with_capacity(ranks.len());
        for r in per_rank {
            for l in r.losses {
                loss_parts.push(l.to_device(&drafter_device)?);
            }
            predicted_parts.extend(r.predicted);
            rank_grads.push(r.grads);
        }
        let mut rank_grads = reducer.all_reduce(rank_grads, &drafter_devices, &var_shapes)?;
        let loss_t = Tensor::stack(&loss_parts, 0)?.sum_all()?;
        if args.inject_nan_grad_at_step == Some(state.step + 1) {
            for grads in &mut rank_grads {
                if let Some(g) = grads.iter_mut().flatten().next() {
                    *g = (&*g * f64::NAN)?;
                }
            }
        }
        state.batches += batches.len();
        let lr = learning_rate(state.step, total_steps, warmup, args.lr);
        // Fused: enqueued, and its outcome read with the step's one read-back below. Every
        // rank applies the same update to the same summed gradient.
        for (rank, grads) in ranks.iter_mut().zip(rank_grads) {
            let loss = loss_t.to_device(&rank.device)?;
            rank.opt.step(grads, &loss, lr)?;
        }
        clock.lap(Stage::Optimizer)?;
        let step_loss = loss_t.to_scalar::<f32>()? as f64;
        let mut step_hits = Hits::default();
        for (p, prep) in predicted_parts.iter().zip(&prepared) {
            step_hits.add(loss::hits(&p.to_vec1::<u32>()?, &prep.targets));
        }
        let outcome = ranks[0].opt.outcome()?;
        clock.lap(Stage::Readback)?;
        let (finite, norm) = (outcome.ran, outcome.norm);
        if finite {
            state.adam_t = outcome.adam_t;
            state.nonfinite_in_row = 0;
        } else {
            state.skipped_steps += 1;
            state.nonfinite_in_row += 1;
            reporter.log(&format!(
                "step {}: non-finite loss {step_loss} or gradient norm {norm}; step skipped",
                state.step + 1
            ));
            if state.nonfinite_in_row >= args.max_nonfinite_steps {
                writer.wait()?;
                reporter.finish();
                return Err(TrainError::NonFinite {
                    count: state.nonfinite_in_row,
                    step: state.step + 1,
                    total: state.skipped_steps,
                    limit: args.max_nonfinite_steps,
                    // Verified, not merely the newest: a damaged one is no place to go back to.
                    // The one resumed from was verified at startup (it may lie elsewhere).
                    last_good: checkpoint::newest_verified(&args.output_dir)
                        .or_else(|| resumed_from.clone())
                        .map_or("none yet".into(), |p| p.display().to_string()),
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
        window.all_steps += 1;
        window.hits.add(step_hits);
        window.tokens += step_tokens;
        window.step_s += step_s;
        window.drafter_flops += step_flops.0;
        window.target_flops += step_flops.1;
        clock.add_to(&mut window.timed);
        let step_scalars = vec![
            ("loss".to_string(), step_loss),
            ("accuracy".into(), step_hits.accuracy()),
            ("tau_estimate".into(), step_hits.tau()),
            ("lr".into(), lr),
            ("grad_norm".into(), norm),
            ("tokens".into(), step_tokens as f64),
            ("blocks".into(), step_hits.blocks as f64),
            ("step_s".into(), step_s),
            ("queue_depth".into(), pipeline.depth() as f64),
            ("elapsed_s".into(), started.elapsed().as_secs_f64()),
        ];
        let mut extra = Map::new();
        extra.insert("skipped".into(), Value::Bool(!finite));
        reporter.jsonl("step", state.step, &step_scalars, extra);
        let last = state.step == stop_at || exhausted;
        if state.step % log_every == 0 || last {
            let mut scalars = window.scalars(&basis);
            scalars.extend([
                ("lr".to_string(), lr),
                ("grad_norm".into(), norm),
                ("queue_depth".into(), pipeline.depth() as f64),
            ]);
            let by_bucket = pipeline.ready_by_bucket(args.bucket_width, |i| lens[i]);
            scalars.extend(
                by_bucket
                    .iter()
                    .map(|(k, v)| (format!("queue_bucket{k}"), *v as f64)),
            );
            scalars.extend(reporter.gpu_scalars());
            let line = format!(
                "step {}/{} {} | lr {lr:.2e} |g| {norm:.2} | queue {} {:?}",
                state.step,
                total_steps,
                describe(&scalars),
                pipeline.depth(),
                by_bucket
            );
            reporter.log(&line);
            let get = |k: &str| {
                scalars
                    .iter()
                    .find(|(n, _)| n == k)
                    .map_or(f64::NAN, |x| x.1)
            };
            reporter.window_summary(format!(
                "loss {:.4} acc {:.3} tau~{:.2} | {} tok/s",
                get("loss"),
                get("accuracy"),
                get("tau_estimate"),
                super::window::human(get("tokens_per_s"))
            ));
            reporter.jsonl("window", state.step, &scalars, Map::new());
            reporter.tensorboard("train", state.step, &scalars);
            curve.push(json!({"step": state.step, "loss": get("loss"), "accuracy": get("accuracy"), "tau_estimate": get("tau_estimate"), "tokens_per_s": get("tokens_per_s"), "mfu": get("mfu")}));
            window = Window::default();
        }
        if let Some(pe) = periodic.as_ref().filter(|pe| pe.due(state.step, last)) {
            let taus = pe.run(&cfg, ranks[0].opt.vars(), &ranks[0].parts)?;
            let line = taus
                .iter()
                .map(|(k, v)| format!("{k} {v:.3}"))
                .collect::<Vec<_>>()
                .join(", ");
            reporter.log(&format!("step {} eval: {line}", state.step));
            reporter.eval_summary(
                taus.iter()
                    .filter(|(k, _)| k.starts_with("tau"))
                    .map(|(k, v)| format!("{} {v:.2}", k.trim_start_matches("tau_")))
                    .collect::<Vec<_>>()
                    .join(" "),
            );
            reporter.jsonl("eval", state.step, &taus, Map::new());
            reporter.tensorboard("eval", state.step, &taus);
            let mut pt: Map<String, Value> =
                taus.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
            pt.insert("step".into(), json!(state.step));
            evals.push(Value::Object(pt));
        }
        reporter.set_position(state.step);
        // A skipped step changed nothing; saving it would only rotate good checkpoints out.
        if (finite && state.step % args.save_every.max(1) == 0) || last {
            let t_save = Instant::now();
            replicas::check_replicas_agree(&ranks)?;
            state.total_steps = total_steps;
            let spec = CheckpointSpec {
                out: &args.output_dir,
                cfg: &cfg,
                num_target_layers: target_cfg.num_hidden_layers,
                save_dtype,
                keep: args.keep_checkpoints,
            };
            let snapshot = || ranks[0].opt.snapshot();
            let path = writer.save_reported(&spec, snapshot, &state, t_save, &mut reporter)?;
            last_checkpoint = Some(path);
        }
    }
    // The last checkpoint is on disk before the run reports it.
    writer.wait()?;
    reporter.finish();
    drop(pipeline);
    let loop_s = loop_start.elapsed().as_secs_f64();
    let stopped_early = state.step < total_steps && !exhausted;
    let output = if stopped_early {
        last_checkpoint
            .clone()
            .unwrap_or_else(|| args.output_dir.clone())
    } else {
        checkpoint::write_drafter(
            &args.output_dir,
            &cfg,
            target_cfg.num_hidden_layers,
            &ranks[0].opt.host_params()?,
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
        "data": data.stats, "curve": curve, "evals": evals, "args": format!("{args:?}"),
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
