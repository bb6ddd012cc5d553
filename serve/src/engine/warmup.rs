//! Start-up forwards over every row count a mixed step is likely to use, so that no request
//! pays a shape's first use. On the H200 (Qwen3-8B, 16 decoding streams beside a 32K-token
//! prompt) the first forward with a new total row count took 7-18 ms more than the next ones
//! with it, and those steps were the largest inter-token gaps of the run
//! (deploy/bench/results/h200-2026-12-06-s16-interf); loading every CUDA module eagerly
//! (`CUDA_MODULE_LOADING=EAGER`) removed only part of it (H100, s18-server). The mixed-step
//! pieces keep a step's rows to whole multiples of 16 (`piece::ROW_QUANTUM`), so one prefill
//! per multiple of 16 up to [`WARM_ROWS`] covers the steps beside up to a few hundred streams.

use dflash_models::speculative::{
    Algorithm, Engine, EngineError, GenerationRequest, SamplingParams,
};

/// Largest row count warmed: a 256-token piece (`--prefill-tokens-while-decoding`'s default)
/// beside 256 decoding rows.
pub const WARM_ROWS: usize = 512;

/// Row counts warmed: every multiple of 16 up to `max_rows` (and the chunk size, if smaller).
pub fn row_counts(max_rows: usize, chunk: Option<usize>) -> Vec<usize> {
    let top = chunk.map_or(max_rows, |c| c.min(max_rows));
    (1..=top / 16).map(|k| 16 * k).collect()
}

/// One prefill of `n` tokens (one greedy token sampled, plain decoding) per row count below the
/// context length. Returns the number of forwards run. The engine holds no request before or
/// after.
pub fn warm_row_counts(engine: &mut Engine, counts: &[usize]) -> Result<usize, EngineError> {
    let vocab = dflash_models::DraftTarget::vocab_size(engine.target()).max(2);
    let context = engine.config().max_context;
    for &n in counts.iter().filter(|&&n| n < context) {
        let prompt: Vec<u32> = (0..n).map(|i| 1 + (i % (vocab - 1)) as u32).collect();
        engine.generate(GenerationRequest {
            prompt,
            max_new_tokens: 1,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![],
            ignore_eos: true,
            algorithm: Algorithm::Plain,
        })?;
    }
    Ok(counts.iter().filter(|&&n| n < context).count())
}

/// On CUDA: every kernel module loaded ([`preload_modules`]), then the forward shapes warmed
/// ([`warm_up`]). Nothing on the CPU.
pub fn at_start(
    engine: &mut Engine,
    device: &candle_core::Device,
    chunk: Option<usize>,
) -> Result<(), String> {
    if !device.is_cuda() {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    preload_modules(device)?;
    warm_up(engine, chunk).map_err(|e| format!("warming the forwards up: {e}"))
}

/// Every kernel module loaded now rather than at its first launch (the driver compiles a
/// module's PTX on its first load: up to seconds each on a fresh machine), logged.
#[cfg(feature = "cuda")]
pub fn preload_modules(device: &candle_core::Device) -> Result<(), String> {
    let (n, took) =
        dflash_models::cuda::preload_kernel_modules(device).map_err(|e| e.to_string())?;
    tracing::info!("loaded {n} kernel modules in {:.2} s", took.as_secs_f64());
    Ok(())
}

/// [`warm_row_counts`] over [`row_counts`]`(WARM_ROWS, chunk)`, logged with its time.
pub fn warm_up(engine: &mut Engine, chunk: Option<usize>) -> Result<(), EngineError> {
    let t0 = std::time::Instant::now();
    let counts = row_counts(WARM_ROWS, chunk);
    let n = warm_row_counts(engine, &counts)?;
    tracing::info!(
        "warmed {n} forward shapes (16..={} rows) in {:.2} s",
        counts.last().copied().unwrap_or(0),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_counts_are_the_multiples_of_16_up_to_the_bound_and_the_chunk() {
        assert_eq!(row_counts(64, None), vec![16, 32, 48, 64]);
        assert_eq!(row_counts(512, Some(40)), vec![16, 32]);
        assert_eq!(row_counts(WARM_ROWS, None).len(), 32);
        assert!(row_counts(8, None).is_empty());
    }

    /// The warm-up runs its prefills (those below the context length) and leaves the engine
    /// empty, with the same greedy tokens for a request afterwards as before.
    #[test]
    fn warming_up_runs_each_count_below_the_context_and_leaves_nothing_behind() {
        use dflash_models::speculative::EngineConfig;
        use dflash_models::{OpsMode, Qwen3Model};
        let dir =
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-coder-demo");
        let cpu = candle_core::Device::Cpu;
        let t = Qwen3Model::load(&dir, candle_core::DType::F32, &cpu, 64, OpsMode::Fused)
            .expect("the demo target");
        let mut e = Engine::new(
            dflash_models::Target::from(t),
            None,
            EngineConfig {
                max_context: 40,
                max_ddtree_budget: 0,
                eos_token_ids: vec![],
                seed: 0,
            },
        );
        let req = || GenerationRequest {
            prompt: vec![5, 6, 7, 8],
            max_new_tokens: 6,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![],
            ignore_eos: true,
            algorithm: Algorithm::Plain,
        };
        let before = e.generate(req()).unwrap().0;
        assert_eq!(warm_row_counts(&mut e, &row_counts(64, None)).unwrap(), 2);
        assert_eq!(e.num_active(), 0);
        assert_eq!(e.generate(req()).unwrap().0, before);
    }
}
