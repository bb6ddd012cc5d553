//! Data-parallel drafter training: one drafter replica per `--drafter-device` entry, each with
//! its own optimizer, frozen embedding and LM head on its device.
//!
//! A step's `grad_accum` micro-batches are cut into one contiguous run per rank (rank 0 the
//! first `grad_accum / N`, and so on); every rank accumulates its run's gradients in f32, the
//! gradients are summed across ranks, and every rank applies the same AdamW step to the same
//! sum, so the replicas stay equal without a weight broadcast (as PyTorch's DDP does). The loss
//! is normalised over the whole step's weight before the backward, so the summed gradient is the
//! gradient of the same objective a single device computes: one device with `--grad-accum K`
//! and N devices with the same `--grad-accum K` train on the same global batch.
//!
//! The sum ([`GradReducer`]) runs over NCCL on GPUs when built with the `nccl` feature (one
//! flat f32 all-reduce per step, on the ranks' own streams), else in-process: each gradient is
//! summed in rank order on rank 0's device and copied back to every rank. With one micro-batch
//! per rank the in-process order is a single device's accumulation order (`(g0 + g1) + g2
//! ...`), so such runs equal one-device runs bit for bit on the CPU; with several per rank, or
//! over NCCL (ring order), they match to f32 rounding, every rank still receiving the same sum.
//!
//! Replicas are checked equal at every checkpoint ([`check_replicas_agree`]): a drifted
//! replica is an error, never a silently saved checkpoint.

use std::collections::HashMap;

use candle_core::{DType, Device, Shape, Tensor, Var};
use dflash_common::DFlashConfig;
use dflash_models::{DFlashDrafter, TargetEmbeddingsAndHead, TrainSequence};

use super::dataset::Example;
use super::error::{TrainError, TrainResult};
use super::loss::{self, BlockTargets};
use super::optimizer::{OptimizerChoice, TrainOptimizer};
use super::pipeline::ComputedBatch;
use super::setup;
use super::window::{Stage, StageClock};
use super::{DeviceSpec, GradReducerArg, TrainArgs, TrainEngineArg};

/// One data-parallel rank: its device, optimizer (f32 masters and moments), the target's frozen
/// embedding and head, and the drafter built over the optimizer's variables when it shares
/// their storage (else rebuilt each step).
pub struct Replica {
    pub device: Device,
    pub opt: TrainOptimizer,
    pub parts: TargetEmbeddingsAndHead,
    shared: Option<DFlashDrafter>,
}

/// A micro-batch's anchors (one list per sequence) and labels, drawn for the whole step first.
pub struct Prepared {
    pub anchors: Vec<Vec<usize>>,
    pub targets: BlockTargets,
}

/// What a rank computed for its micro-batches.
pub struct RankGrads {
    /// Per optimizer variable, f32, summed over the rank's micro-batches (`None`: no gradient).
    pub grads: Vec<Option<Tensor>>,
    /// Per micro-batch, in order: the loss (f32 scalar) and the argmax predictions.
    pub losses: Vec<Tensor>,
    pub predicted: Vec<Tensor>,
}

/// The drafter devices of `--drafter-device`, checked: all of one kind, GPUs distinct (two
/// replicas on one GPU would only halve its memory), and `--grad-accum` a multiple of their
/// number (every rank gets the same number of micro-batches).
pub fn open_devices(specs: &[DeviceSpec], grad_accum: usize) -> TrainResult<Vec<Device>> {
    let flag = "--drafter-device";
    let err = |message: String| TrainError::Flag { flag, message };
    let Some(first) = specs.first() else {
        return Err(err(
            "names no device; use cpu, cuda:N or a list such as 0,1".into(),
        ));
    };
    if specs
        .iter()
        .any(|s| matches!(s, DeviceSpec::Cpu) != matches!(first, DeviceSpec::Cpu))
    {
        return Err(err(format!(
            "mixes the CPU and GPUs ({}); data-parallel replicas run on one kind of device",
            list(specs)
        )));
    }
    for (i, s) in specs.iter().enumerate() {
        if matches!(s, DeviceSpec::Cuda(_)) && specs[..i].contains(s) {
            return Err(err(format!(
                "names {s} twice ({}); give each replica its own GPU",
                list(specs)
            )));
        }
    }
    if !grad_accum.is_multiple_of(specs.len()) {
        return Err(TrainError::Flag {
            flag: "--grad-accum",
            message: format!(
                "{grad_accum} is not a multiple of the {} drafter devices ({}): every replica takes \
                 the same number of micro-batches per step; use --grad-accum {}",
                specs.len(),
                list(specs),
                grad_accum.next_multiple_of(specs.len())
            ),
        });
    }
    specs.iter().map(|s| s.open(flag)).collect()
}

fn list(specs: &[DeviceSpec]) -> String {
    specs
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

impl Replica {
    /// Rank 0 from its optimizer; with `shared`, the drafter is built once over its variables.
    pub fn new(
        device: Device,
        opt: TrainOptimizer,
        parts: TargetEmbeddingsAndHead,
        cfg: &DFlashConfig,
        dtype: DType,
    ) -> TrainResult<Self> {
        let shared = if opt.drafter_shares_storage(dtype) {
            Some(setup::drafter_from_vars(
                cfg,
                opt.vars(),
                &parts,
                dtype,
                true,
            )?)
        } else {
            None
        };
        Ok(Self {
            device,
            opt,
            parts,
            shared,
        })
    }

    /// Another rank on `device`, starting from this replica's exact state (masters, moments,
    /// update and skip counters), with `parts` on that device.
    pub fn replicate(
        &self,
        device: Device,
        parts: TargetEmbeddingsAndHead,
        choice: OptimizerChoice,
        counters: (u64, u64),
        cfg: &DFlashConfig,
        dtype: DType,
    ) -> TrainResult<Self> {
        let opt = self.opt.replicate(choice, &device, counters)?;
        Self::new(device, opt, parts, cfg, dtype)
    }

    /// The forward and backward of `work` (micro-batches in step order), gradients accumulated
    /// in f32 on this rank's device. `clock` laps this rank's stages (rank 0's is timed).
    #[allow(clippy::too_many_arguments)]
    pub fn micro_batches(
        &self,
        args: &TrainArgs,
        cfg: &DFlashConfig,
        dtype: DType,
        examples: &[Example],
        work: &[(&ComputedBatch, &Prepared)],
        total_weight: f64,
        clock: &mut StageClock<'_>,
    ) -> TrainResult<RankGrads> {
        let rebuilt;
        let explicit = args.engine() == TrainEngineArg::Explicit;
        let drafter = match &self.shared {
            Some(d) if !explicit => d,
            _ => {
                // The explicit engine's drafter holds detached views of the variables.
                rebuilt =
                    setup::drafter_from_vars(cfg, self.opt.vars(), &self.parts, dtype, !explicit)?;
                &rebuilt
            }
        };
        let vars = self.opt.vars();
        let mut out = RankGrads {
            grads: vec![None; vars.len()],
            losses: Vec::with_capacity(work.len()),
            predicted: Vec::with_capacity(work.len()),
        };
        for (bt, prep) in work {
            // One upload per batch (none when the worker shares the device), then views.
            let all = bt.features.to_device(&self.device)?;
            let feats = bt
                .seqs
                .iter()
                .map(|s| all.narrow(0, s.rows.start, s.rows.len()))
                .collect::<candle_core::Result<Vec<_>>>()?;
            clock.lap(Stage::H2d)?;
            let seqs: Vec<TrainSequence<'_>> = bt
                .seqs
                .iter()
                .zip(&feats)
                .zip(&prep.anchors)
                .map(|((s, f), a)| TrainSequence {
                    features: f,
                    tokens: &examples[s.example].tokens,
                    anchors: a,
                })
                .collect();
            let (loss, predicted, grads) = match args.engine() {
                TrainEngineArg::Autograd => {
                    self.autograd_step(args, drafter, &seqs, prep, total_weight, clock)?
                }
                TrainEngineArg::Explicit => {
                    self.explicit_step(args, drafter, &seqs, prep, total_weight, clock)?
                }
            };
            out.predicted.push(predicted);
            for (i, g) in grads {
                // Accumulated in f32 (a no-op cast for the f32 masters' gradients); a single
                // micro-batch's stays in the compute dtype until the optimizer packs it.
                out.grads[i] = Some(match out.grads[i].take() {
                    Some(acc) => (acc.to_dtype(DType::F32)? + g.to_dtype(DType::F32)?)?,
                    None => g,
                });
            }
            // Detached: a clone would keep this micro-batch's whole graph alive until the
            // step's read-back (`to_dtype` to the same dtype is a clone).
            out.losses.push(loss.detach().to_dtype(DType::F32)?);
            clock.lap(Stage::Backward)?;
        }
        Ok(out)
    }
}

impl Replica {
    /// The loss of the label rows' hidden states under `--head-loss` (this rank's frozen head)
    /// and each row's argmax.
    fn head_loss(
        &self,
        args: &TrainArgs,
        drafter: &DFlashDrafter,
        hidden: &Tensor,
        prep: &Prepared,
        total_weight: f64,
    ) -> TrainResult<(Tensor, Tensor)> {
        Ok(loss::head_cross_entropy(
            args.head_loss,
            hidden,
            drafter,
            &self.parts.lm_head,
            &prep.targets,
            total_weight,
        )?)
    }

    /// One micro-batch under candle's autograd: its loss, argmax predictions and each
    /// optimizer variable's gradient (by index into [`TrainOptimizer::vars`]).
    fn autograd_step(
        &self,
        args: &TrainArgs,
        drafter: &DFlashDrafter,
        seqs: &[TrainSequence<'_>],
        prep: &Prepared,
        total_weight: f64,
        clock: &mut StageClock<'_>,
    ) -> TrainResult<MicroBatchGrads> {
        let hidden = drafter.train_hidden_with(seqs, args.train_paths(&self.device))?;
        let rows = Tensor::new(prep.targets.rows.as_slice(), &self.device)?;
        let hidden = hidden.index_select(&rows, 0)?;
        let (loss, predicted) = self.head_loss(args, drafter, &hidden, prep, total_weight)?;
        clock.lap(Stage::Forward)?;
        let store = loss.backward()?;
        let grads = self
            .opt
            .vars()
            .iter()
            .enumerate()
            .filter_map(|(i, (_, var))| store.get(var.as_tensor()).map(|g| (i, g.clone())))
            .collect();
        Ok((loss, predicted, grads))
    }

    /// One micro-batch under the explicit engine: the drafter's forward and backward written
    /// out; autograd runs only over the head's loss, from a leaf copy of the label rows' hidden
    /// states, whose gradient is scattered back to every block row.
    fn explicit_step(
        &self,
        args: &TrainArgs,
        drafter: &DFlashDrafter,
        seqs: &[TrainSequence<'_>],
        prep: &Prepared,
        total_weight: f64,
        clock: &mut StageClock<'_>,
    ) -> TrainResult<MicroBatchGrads> {
        // Sets the process-wide fused-op switch the explicit pieces read on CUDA.
        args.train_paths(&self.device);
        let (hidden, tape) = drafter.train_forward_explicit(seqs)?;
        let hidden = hidden.detach();
        let rows = Tensor::new(prep.targets.rows.as_slice(), &self.device)?;
        let picked = Var::from_tensor(&hidden.index_select(&rows, 0)?)?;
        let (loss, predicted) =
            self.head_loss(args, drafter, picked.as_tensor(), prep, total_weight)?;
        clock.lap(Stage::Forward)?;
        let store = loss.backward()?;
        let d_hidden = match store.get(picked.as_tensor()) {
            Some(d) => prep
                .targets
                .scatter_rows(&d.to_dtype(hidden.dtype())?, hidden.dim(0)?)?,
            // No supervised row in this micro-batch: nothing flows back.
            None => hidden.zeros_like()?,
        };
        let index: HashMap<&str, usize> = self
            .opt
            .vars()
            .iter()
            .enumerate()
            .map(|(i, (n, _))| (n.as_str(), i))
            .collect();
        let grads = drafter
            .train_backward_explicit(&tape, &d_hidden)?
            .into_iter()
            .map(|(name, g)| match index.get(name.as_str()) {
                Some(&i) => Ok((i, g)),
                None => Err(TrainError::DrafterMismatch(format!(
                    "the explicit engine produced a gradient for {name}, which the optimizer \
                     does not hold"
                ))),
            })
            .collect::<TrainResult<Vec<_>>>()?;
        Ok((loss, predicted, grads))
    }
}

/// A micro-batch's loss, argmax predictions and (optimizer variable index, gradient) pairs.
type MicroBatchGrads = (Tensor, Tensor, Vec<(usize, Tensor)>);

/// Every rank's micro-batches of one step, ranks beside each other (one thread per rank after
/// the first, which runs on this thread with `clock`): rank `r` takes the `r`-th contiguous run
/// of `work`. Returns each rank's gradients and losses in rank order.
#[allow(clippy::too_many_arguments)]
pub fn run_ranks(
    replicas: &[Replica],
    args: &TrainArgs,
    cfg: &DFlashConfig,
    dtype: DType,
    examples: &[Example],
    work: &[(&ComputedBatch, &Prepared)],
    total_weight: f64,
    clock: &mut StageClock<'_>,
) -> TrainResult<Vec<RankGrads>> {
    let per_rank = work.len().div_ceil(replicas.len()).max(1);
    let runs: Vec<&[(&ComputedBatch, &Prepared)]> = (0..replicas.len())
        .map(|r| &work[(r * per_rank).min(work.len())..((r + 1) * per_rank).min(work.len())])
        .collect();
    let first = &replicas[0];
    if replicas.len() == 1 {
        return Ok(vec![first.micro_batches(
            args,
            cfg,
            dtype,
            examples,
            runs[0],
            total_weight,
            clock,
        )?]);
    }
    std::thread::scope(|scope| {
        let others: Vec<_> = replicas[1..]
            .iter()
            .zip(&runs[1..])
            .map(|(rep, run)| {
                scope.spawn(move || {
                    let mut untimed = StageClock::new(false, &rep.device);
                    rep.micro_batches(args, cfg, dtype, examples, run, total_weight, &mut untimed)
                })
            })
            .collect();
        let mut out =
            vec![first.micro_batches(args, cfg, dtype, examples, runs[0], total_weight, clock)?];
        for (r, handle) in others.into_iter().enumerate() {
            out.push(
                handle
                    .join()
                    .map_err(|_| TrainError::DataParallel(format!("rank {} panicked", r + 1)))??,
            );
        }
        Ok(out)
    })
}

/// How the ranks' gradients are summed.
pub enum GradReducer {
    /// In rank order through rank 0's device ([`all_reduce_in_rank_order`]).
    InProcess,
    /// One flat f32 NCCL all-reduce per step.
    #[cfg(feature = "nccl")]
    Nccl(dflash_models::cuda::nccl::NcclRanks),
}

impl GradReducer {
    /// `--grad-reducer`: `auto` is NCCL for several GPUs when built with it, else in-process
    /// (with a warning on GPUs, where it costs a device-to-device copy per gradient).
    pub fn for_devices(choice: GradReducerArg, devices: &[Device]) -> TrainResult<Self> {
        let gpus = devices.iter().all(|d| d.is_cuda());
        match choice {
            GradReducerArg::InProcess => return Ok(Self::InProcess),
            GradReducerArg::Auto if devices.len() < 2 || !gpus => return Ok(Self::InProcess),
            GradReducerArg::Nccl if !gpus => {
                return Err(TrainError::Flag {
                    flag: "--grad-reducer",
                    message: "nccl needs every --drafter-device to be a GPU".into(),
                })
            }
            _ => {}
        }
        #[cfg(feature = "nccl")]
        {
            let ranks = dflash_models::cuda::nccl::NcclRanks::new(devices).map_err(|e| {
                TrainError::DataParallel(format!(
                    "{e}; is libnccl.so.2 on LD_LIBRARY_PATH (pip install nvidia-nccl-cu13)?"
                ))
            })?;
            Ok(Self::Nccl(ranks))
        }
        #[cfg(not(feature = "nccl"))]
        {
            if choice == GradReducerArg::Nccl {
                return Err(TrainError::Flag {
                    flag: "--grad-reducer",
                    message: "nccl needs a build with the `nccl` feature (cargo build \
                              --features nccl, libnccl on the library path)"
                        .into(),
                });
            }
            tracing::warn!(
                "data-parallel on {} GPUs without NCCL: gradients are summed through rank 0 by                  device-to-device copies (slow); build with --features nccl",
                devices.len()
            );
            Ok(Self::InProcess)
        }
    }

    pub fn describe(&self) -> &'static str {
        match self {
            Self::InProcess => "in-process, rank order",
            #[cfg(feature = "nccl")]
            Self::Nccl(_) => "NCCL",
        }
    }

    /// Every rank's summed gradients on its own device (`shapes`: the variables'), see
    /// [`all_reduce_in_rank_order`]; over NCCL every variable gets one (zeros where no rank
    /// had one, as the optimizer reads a missing gradient anyway).
    #[cfg_attr(not(feature = "nccl"), allow(unused_variables))]
    pub fn all_reduce(
        &self,
        per_rank: Vec<Vec<Option<Tensor>>>,
        devices: &[Device],
        shapes: &[Shape],
    ) -> TrainResult<Vec<Vec<Option<Tensor>>>> {
        match self {
            Self::InProcess => all_reduce_in_rank_order(per_rank, devices),
            #[cfg(feature = "nccl")]
            Self::Nccl(ranks) => {
                let flat = per_rank
                    .iter()
                    .zip(devices)
                    .map(|(grads, dev)| flatten(grads, shapes, dev))
                    .collect::<TrainResult<Vec<_>>>()?;
                let summed = ranks.all_reduce_sum_f32(&flat)?;
                summed.iter().map(|t| unflatten(t, shapes)).collect()
            }
        }
    }
}

/// One contiguous f32 buffer of `grads` in order (zeros for a missing one).
#[cfg(feature = "nccl")]
fn flatten(grads: &[Option<Tensor>], shapes: &[Shape], dev: &Device) -> TrainResult<Tensor> {
    let parts = grads
        .iter()
        .zip(shapes)
        .map(|(g, shape)| match g {
            Some(g) => g.to_dtype(DType::F32)?.flatten_all(),
            None => Tensor::zeros(shape.elem_count(), DType::F32, dev),
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

/// Views of `flat` cut back into `shapes`.
#[cfg(feature = "nccl")]
fn unflatten(flat: &Tensor, shapes: &[Shape]) -> TrainResult<Vec<Option<Tensor>>> {
    let mut at = 0;
    shapes
        .iter()
        .map(|shape| {
            let n = shape.elem_count();
            let t = flat.narrow(0, at, n)?.reshape(shape.clone())?;
            at += n;
            Ok(Some(t))
        })
        .collect()
}

/// Sums every rank's gradients in rank order on `devices[0]` and gives each rank the sum on
/// its own device (a variable no rank has a gradient for stays `None`, a zero gradient). One
/// rank: returned as it is.
pub fn all_reduce_in_rank_order(
    per_rank: Vec<Vec<Option<Tensor>>>,
    devices: &[Device],
) -> TrainResult<Vec<Vec<Option<Tensor>>>> {
    if per_rank.len() <= 1 {
        return Ok(per_rank);
    }
    let n_vars = per_rank[0].len();
    let mut sums: Vec<Option<Tensor>> = vec![None; n_vars];
    for grads in &per_rank {
        for (i, g) in grads.iter().enumerate() {
            let Some(g) = g else { continue };
            // Summed in f32 (a rank's gradient may still be in the compute dtype).
            let g = g.to_device(&devices[0])?.to_dtype(DType::F32)?;
            sums[i] = Some(match sums[i].take() {
                Some(acc) => (acc + g)?,
                None => g,
            });
        }
    }
    devices
        .iter()
        .map(|dev| {
            sums.iter()
                .map(|s| s.as_ref().map(|t| t.to_device(dev)).transpose())
                .collect::<candle_core::Result<Vec<_>>>()
                .map_err(TrainError::from)
        })
        .collect()
}

/// Fails when any replica's weights differ from rank 0's in any element: the ranks apply the
/// same update to the same summed gradient, so any difference is a fault, and a checkpoint must
/// not save one rank's view as the run's.
pub fn check_replicas_agree(replicas: &[Replica]) -> TrainResult<()> {
    let Some((first, rest)) = replicas.split_first() else {
        return Ok(());
    };
    for (r, rep) in rest.iter().enumerate() {
        for ((name, a), (_, b)) in first.opt.vars().iter().zip(rep.opt.vars()) {
            let b = b.as_tensor().to_device(&first.device)?;
            let diff = (a.as_tensor() - b)?
                .abs()?
                .to_dtype(DType::F32)?
                .max_all()?
                .to_scalar::<f32>()?;
            if diff != 0.0 {
                return Err(TrainError::DataParallel(format!(
                    "rank {} drifted from rank 0 (`{name}` differs by {diff}); the \
                     step is not deterministic on this device, no checkpoint written",
                    r + 1
                )));
            }
        }
    }
    Ok(())
}
