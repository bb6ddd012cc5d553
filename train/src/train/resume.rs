//! `--resume`: which checkpoint a run continues from, and the optimizer state it restores.
//!
//! Every candidate is verified against its manifest before any of it is read, so a damaged
//! checkpoint is never trained on. The newest checkpoint is the one resumed; when it fails
//! verification the run stops and names the damaged file, unless `--resume-fallback` asks for
//! the newest older one that verifies. Those that failed are then renamed `checkpoint-N.corrupt`:
//! kept for inspection, but out of the rotation (which would otherwise delete good checkpoints
//! and keep the damaged newest one) and out of later resumes.
//!
//! A `--resume` directory with no checkpoint yet (or not created yet) starts a fresh run with one
//! log line, so a wrapper that always passes the flag works from the first launch on.

use std::path::{Path, PathBuf};

use candle_core::Device;

use super::checkpoint::{
    self, checkpoint_step, list_checkpoints, LoadedCheckpoint, RunFingerprint, TrainerState,
    STATE_FILE,
};
use super::error::{TrainError, TrainResult};
use super::manifest::{IntegrityError, MANIFEST_FILE};
use super::optimizer::{OptimizerChoice, TrainOptimizer};
use super::TrainArgs;
use crate::durable;

/// The verified checkpoint `--resume` continues from, or `None` for a fresh run.
pub fn resume_point(args: &TrainArgs, device: &Device) -> TrainResult<Option<LoadedCheckpoint>> {
    let Some(path) = &args.resume else {
        return Ok(None);
    };
    let candidates = candidates(path, &args.output_dir)?;
    if candidates.is_empty() {
        tracing::info!(
            "--resume {}: no checkpoint there yet; starting a fresh run",
            path.display()
        );
        return Ok(None);
    }
    let mut failed: Vec<(PathBuf, IntegrityError)> = Vec::new();
    for (i, dir) in candidates.iter().enumerate() {
        match checkpoint::verify_checkpoint(dir) {
            Ok(_) => {
                for (bad, problem) in &failed {
                    set_aside(bad, problem);
                }
                return checkpoint::load_checkpoint(dir, device).map(Some);
            }
            Err(problem) if args.resume_fallback => {
                tracing::warn!(
                    "checkpoint {} failed verification: {problem}; trying the previous one",
                    dir.display()
                );
                failed.push((dir.clone(), problem));
            }
            Err(problem) => {
                let fix = match candidates.get(i + 1) {
                    Some(previous) => format!(
                        "restore it from a copy, or pass --resume-fallback to resume from the newest older checkpoint that verifies (next to check: {})",
                        previous.display()
                    ),
                    None => "restore it from a copy; there is no older checkpoint to fall back to, so otherwise start over without --resume in a new --output-dir".into(),
                };
                return Err(TrainError::UnverifiedCheckpoint {
                    dir: dir.clone(),
                    problem,
                    fix,
                });
            }
        }
    }
    let names: Vec<String> = failed
        .iter()
        .map(|(d, _)| d.display().to_string())
        .collect();
    let (dir, problem) = failed.remove(0);
    Err(TrainError::UnverifiedCheckpoint {
        dir,
        problem,
        fix: format!(
            "no older checkpoint verifies either ({}; all left in place); restore one from a copy, or start over without --resume in a new --output-dir",
            names.join(", ")
        ),
    })
}

/// The checkpoints `--resume path` may continue from, newest first: `path` itself and its older
/// siblings when it is a checkpoint directory, else the checkpoints inside it (none: fresh run).
fn candidates(path: &Path, output_dir: &Path) -> TrainResult<Vec<PathBuf>> {
    let named_step = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(checkpoint_step);
    if named_step.is_some() || path.join(STATE_FILE).exists() || path.join(MANIFEST_FILE).exists() {
        if !path.is_dir() {
            // A mistyped checkpoint name must not quietly become a fresh run.
            return Err(TrainError::Checkpoint {
                path: path.to_path_buf(),
                message: "no such checkpoint directory; pass --resume the output directory to continue from its newest checkpoint".into(),
            });
        }
        let mut v = vec![path.to_path_buf()];
        if let (Some(step), Some(parent)) = (named_step, path.parent()) {
            v.extend(
                list_checkpoints(parent)
                    .into_iter()
                    .rev()
                    .filter(|(s, _)| *s < step)
                    .map(|(_, p)| p),
            );
        }
        return Ok(v);
    }
    if path.exists() && !path.is_dir() {
        return Err(TrainError::Checkpoint {
            path: path.to_path_buf(),
            message: "is a file; pass --resume a checkpoint directory or the output directory holding checkpoint-N directories".into(),
        });
    }
    let found: Vec<PathBuf> = list_checkpoints(path)
        .into_iter()
        .rev()
        .map(|(_, p)| p)
        .collect();
    if found.is_empty() {
        if let Some((_, theirs)) = list_checkpoints(output_dir).pop() {
            // A fresh run saving into this --output-dir would rotate its checkpoints away.
            return Err(TrainError::Flag {
                flag: "--resume",
                message: format!(
                    "{} holds no checkpoint, but --output-dir {} holds {}; pass --resume {} to continue it, or choose an empty --output-dir",
                    path.display(),
                    output_dir.display(),
                    theirs.display(),
                    output_dir.display()
                ),
            });
        }
    }
    Ok(found)
}

/// Renames a checkpoint that failed verification to `checkpoint-N.corrupt` (`.corrupt-2`, ...
/// when taken), which neither the rotation nor a resume picks up.
fn set_aside(dir: &Path, problem: &IntegrityError) {
    let mut aside = dir.as_os_str().to_owned();
    aside.push(".corrupt");
    let mut aside = PathBuf::from(aside);
    for n in 2.. {
        if !aside.exists() {
            break;
        }
        let mut next = dir.as_os_str().to_owned();
        next.push(format!(".corrupt-{n}"));
        aside = PathBuf::from(next);
    }
    match std::fs::rename(dir, &aside).and_then(|_| durable::sync_parent(&aside)) {
        Ok(()) => tracing::warn!(
            "checkpoint {} failed verification ({problem}); moved to {}",
            dir.display(),
            aside.display()
        ),
        Err(e) => tracing::warn!(
            "checkpoint {} failed verification ({problem}) and cannot be moved aside: {e}",
            dir.display()
        ),
    }
}

/// The optimizer and trainer state of a resumed run, after checking that the data settings are
/// the checkpoint's (otherwise the resumed steps would see other batches). The checkpoint's
/// per-tensor state serves either optimizer.
pub fn restore(
    r: LoadedCheckpoint,
    fingerprint: &RunFingerprint,
    total_steps: usize,
    choice: OptimizerChoice,
) -> TrainResult<(TrainOptimizer, TrainerState)> {
    if &r.state.fingerprint != fingerprint {
        return Err(TrainError::Checkpoint {
            path: r.dir.join(STATE_FILE),
            message: format!(
                "was trained with different data settings; resume with the same --dataset, --max-records, --max-len, --min-supervised, --seed, --batch-size, --min-ready, --bucket-width, --epochs/--max-steps, --num-anchors and --grad-accum.\n  checkpoint: {:?}\n  now:        {:?}",
                r.state.fingerprint, fingerprint
            ),
        });
    }
    tracing::info!(
        "resuming from {} at step {} (verified against its manifest)",
        r.dir.display(),
        r.state.step
    );
    let mut state = r.state;
    state.total_steps = total_steps;
    let resumed = (r.m, r.v, state.adam_t, state.skipped_steps as u64);
    let opt = TrainOptimizer::new(choice, r.params, Some(resumed))?;
    Ok((opt, state))
}
