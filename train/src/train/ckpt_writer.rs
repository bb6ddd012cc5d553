//! Checkpoints written beside training: the loop takes a host snapshot of the optimizer state
//! (the only part that must happen between two steps) and a background thread cuts it per
//! tensor (`snapshot.rs`), serialises, writes, fsyncs, digests and renames it into place
//! (`checkpoint::save_checkpoint`, atomic as before), while the next steps run. At most one
//! write is in flight: the next save, the end of the run and dropping the writer wait for it,
//! and a failed write fails the run there, naming the checkpoint. The next save waits before
//! its snapshot is taken, since the fused optimizer's snapshots reuse one set of host buffers,
//! which the write in flight still holds. A crash mid-write leaves only a `.checkpoint-N.tmp`
//! directory, which resume never reads, and the previous checkpoints stay untouched until the
//! new one is in place.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::Instant;

use candle_core::DType;
use dflash_common::DFlashConfig;

use super::checkpoint::{self, TrainerState};
use super::error::{TrainError, TrainResult};
use super::snapshot::OptimizerSnapshot;
use crate::observe::Reporter;

/// What one checkpoint needs besides the optimizer snapshot.
pub struct CheckpointSpec<'a> {
    pub out: &'a Path,
    pub cfg: &'a DFlashConfig,
    pub num_target_layers: usize,
    pub save_dtype: DType,
    pub keep: usize,
}

#[derive(Default)]
pub struct CheckpointWriter {
    pending: Option<(PathBuf, JoinHandle<TrainResult<PathBuf>>)>,
    /// Synchronous writes (`--sync-checkpoints`): each save returns once the checkpoint is in
    /// place.
    sync: bool,
}

/// The directory a checkpoint of `step` is renamed to.
pub fn checkpoint_path(out: &Path, step: usize) -> PathBuf {
    out.join(format!("{}{:08}", checkpoint::CHECKPOINT_PREFIX, step))
}

impl CheckpointWriter {
    pub fn new(sync: bool) -> Self {
        Self {
            pending: None,
            sync,
        }
    }

    /// Starts writing `snapshot` (host state no step will touch) and `state` as the
    /// checkpoint of `state.step`, after the previous write is done. Returns the checkpoint's
    /// final path and the seconds the caller waited (for the previous write, or for this one
    /// when synchronous).
    pub fn save(
        &mut self,
        spec: &CheckpointSpec<'_>,
        snapshot: OptimizerSnapshot,
        state: &TrainerState,
    ) -> TrainResult<(PathBuf, f64)> {
        let t0 = Instant::now();
        self.wait()?;
        let path = checkpoint_path(spec.out, state.step);
        let (out, cfg, state) = (spec.out.to_path_buf(), spec.cfg.clone(), state.clone());
        let (layers, dtype, keep) = (spec.num_target_layers, spec.save_dtype, spec.keep);
        let job = move || {
            // Cut here, off the loop; a flat snapshot's buffers go back to their pool now.
            let tensors = snapshot.into_tensors()?;
            checkpoint::save_checkpoint(&out, &cfg, layers, &tensors, &state, dtype, keep)
        };
        if self.sync {
            job()?;
        } else {
            let handle = std::thread::Builder::new()
                .name("checkpoint-writer".into())
                .spawn(job)
                .map_err(|e| TrainError::Checkpoint {
                    path: path.clone(),
                    message: format!("cannot start the writer thread: {e}"),
                })?;
            self.pending = Some((path.clone(), handle));
        }
        Ok((path, t0.elapsed().as_secs_f64()))
    }

    /// Waits for the previous write, takes the snapshot (`take_snapshot`) and [`Self::save`]s
    /// it, logging the checkpoint and how long the loop stood still for it since `started`:
    /// a `checkpoint` JSONL record with `snapshot_s` (the snapshot and what the caller did
    /// since `started`, the replica check) and `wait_s` (for the previous write, and for this
    /// one when synchronous).
    pub fn save_reported(
        &mut self,
        spec: &CheckpointSpec<'_>,
        take_snapshot: impl FnOnce() -> TrainResult<OptimizerSnapshot>,
        state: &TrainerState,
        started: Instant,
        reporter: &mut Reporter,
    ) -> TrainResult<PathBuf> {
        let checked = started.elapsed().as_secs_f64();
        let t_wait = Instant::now();
        self.wait()?;
        let waited_before = t_wait.elapsed().as_secs_f64();
        let t_snap = Instant::now();
        let snapshot = take_snapshot()?;
        let before = checked + t_snap.elapsed().as_secs_f64();
        let (path, waited_in_save) = self.save(spec, snapshot, state)?;
        let waited = waited_before + waited_in_save;
        let stall = started.elapsed().as_secs_f64();
        reporter.log(&format!(
            "checkpoint {} ({}; the loop spent {stall:.2} s: snapshot {before:.2} s, waiting {waited:.2} s)",
            path.display(),
            if self.sync { "written" } else { "writing in the background" },
        ));
        let fields = vec![
            ("loop_stall_s".to_string(), stall),
            ("snapshot_s".to_string(), before),
            ("wait_s".to_string(), waited),
        ];
        reporter.jsonl("checkpoint", state.step, &fields, serde_json::Map::new());
        Ok(path)
    }

    /// Waits for the write in flight, if any; its error if it failed.
    pub fn wait(&mut self) -> TrainResult<()> {
        let Some((path, handle)) = self.pending.take() else {
            return Ok(());
        };
        match handle.join() {
            Ok(result) => result.map(|_| ()),
            Err(_) => Err(TrainError::Checkpoint {
                path,
                message: "the checkpoint writer thread panicked".into(),
            }),
        }
    }
}

impl Drop for CheckpointWriter {
    /// A run that stops on an error still lets its last checkpoint reach the disk whole.
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            tracing::error!("{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};
    use dflash_common::Qwen3Config;

    use crate::train::checkpoint::OptimizerTensors;
    use crate::train::optim::AdamWConfig;
    use crate::train::optimizer::{OptimizerChoice, TrainOptimizer};

    fn setup() -> (DFlashConfig, OptimizerTensors, TrainerState) {
        let demo = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../serve/assets/tiny-coder-demo"
        );
        let target = Qwen3Config::from_file(format!("{demo}/config.json")).unwrap();
        let cfg = DFlashConfig::for_target(&target, 1, 4, 0, None);
        let t = || Tensor::from_slice(&[1.0f32, 2.0, 3.0], 3, &Device::Cpu).unwrap();
        let opt = OptimizerTensors {
            params: vec![("fc.weight".into(), t())],
            m: vec![t()],
            v: vec![t()],
        };
        let state: TrainerState = serde_json::from_value(serde_json::json!({
            "step": 7, "batches": 7, "adam_t": 7, "skipped_steps": 0, "nonfinite_in_row": 0,
            "total_steps": 10, "fingerprint": {"datasets": [], "max_records": null, "max_len": 64,
            "min_supervised": 1, "plan": {"seed": 0, "batch_size": 1, "min_ready": 1,
            "bucket_width": 64, "epochs": 1}, "num_anchors": 1, "grad_accum": 1}
        }))
        .unwrap();
        (cfg, opt, state)
    }

    #[test]
    fn a_background_write_lands_whole_and_a_failed_one_fails_the_next_wait() {
        let out = std::env::temp_dir().join(format!("dflash-ckpt-writer-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir_all(&out).unwrap();
        let (cfg, opt, state) = setup();
        let spec = CheckpointSpec {
            out: &out,
            cfg: &cfg,
            num_target_layers: 4,
            save_dtype: DType::F32,
            keep: 2,
        };
        let mut writer = CheckpointWriter::new(false);
        let (path, _) = writer.save(&spec, opt.into(), &state).unwrap();
        assert_eq!(path, out.join("checkpoint-00000007"));
        writer.wait().unwrap();
        checkpoint::verify_checkpoint(&path).unwrap();
        // An output "directory" that is a file: the write fails in the background, and the
        // wait (the next save, the end of the run) reports it naming the checkpoint.
        let blocked = out.join("not-a-dir");
        std::fs::write(&blocked, b"x").unwrap();
        let spec = CheckpointSpec {
            out: &blocked,
            ..spec
        };
        let (_, opt, state) = setup();
        writer.save(&spec, opt.into(), &state).unwrap();
        let err = writer.wait().unwrap_err().to_string();
        assert!(err.contains("checkpoint-00000007"), "{err}");
        std::fs::remove_dir_all(&out).unwrap();
    }

    /// The fused optimizer's flat snapshot, cut on the writer thread, writes every byte its
    /// per-tensor form writes: a checkpoint does not depend on the form it was taken in.
    #[test]
    fn a_flat_snapshot_writes_the_checkpoint_of_its_per_tensor_form() {
        let (cfg, _, state) = setup();
        let choice = OptimizerChoice {
            fused: true,
            adam: AdamWConfig::default(),
            clip: 1.0,
            compute_dtype: DType::F32,
        };
        let cpu = &Device::Cpu;
        let fc = Tensor::arange(0f32, 6.0, cpu).unwrap();
        let norm = Tensor::from_slice(&[1.0f32, -2.0, 3.0], 3, cpu).unwrap();
        let params = vec![
            ("fc.weight".into(), fc.reshape((2, 3)).unwrap()),
            ("norm.weight".into(), norm),
        ];
        let mut opt = TrainOptimizer::new(choice, params, None).unwrap();
        let grads = vec![
            Some(Tensor::full(0.5f32, (2, 3), cpu).unwrap()),
            Some(Tensor::from_slice(&[-1.0f32, 2.0, 0.25], 3, cpu).unwrap()),
        ];
        opt.step(grads, &Tensor::new(1.0f32, cpu).unwrap(), 0.1)
            .unwrap();
        let out = std::env::temp_dir().join(format!("dflash-ckpt-flat-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let mut writer = CheckpointWriter::new(false);
        let mut write = |dir: &Path, snapshot: OptimizerSnapshot| {
            let spec = CheckpointSpec {
                out: dir,
                cfg: &cfg,
                num_target_layers: 4,
                save_dtype: DType::BF16,
                keep: 1,
            };
            let (path, _) = writer.save(&spec, snapshot, &state).unwrap();
            writer.wait().unwrap();
            path
        };
        let snapshot = opt.snapshot().unwrap();
        assert!(matches!(snapshot, OptimizerSnapshot::Flat(_)));
        let flat = write(&out.join("flat"), snapshot);
        let per_tensor = write(&out.join("tensors"), opt.tensors().unwrap().into());
        for file in checkpoint::CHECKPOINT_FILES
            .iter()
            .chain([&crate::train::manifest::MANIFEST_FILE])
        {
            let (a, b) = (flat.join(file), per_tensor.join(file));
            assert!(
                std::fs::read(a).unwrap() == std::fs::read(b).unwrap(),
                "{file} differs"
            );
        }
        std::fs::remove_dir_all(&out).unwrap();
    }
}
