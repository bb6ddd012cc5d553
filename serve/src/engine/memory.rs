//! Sizing the K/V-cache budget from device memory, as SGLang does: `--mem-fraction-static` is
//! the fraction of the GPU's memory for the weights plus the K/V pool (the rest is left for
//! activations and CUDA graphs), and its default follows SGLang's rule for the GPU's size.
//! What is left of that fraction once the models are loaded, divided by the K/V bytes of one
//! token (target plus drafter), is the pool in tokens (`max_total_num_tokens`).

/// SGLang 0.5's default `mem_fraction_static` (server_args.py `_handle_gpu_memory_settings`)
/// for a GPU of `gpu_mem_mib`: reserve 512 MiB + 1.5 MiB per chunked-prefill token (at least
/// 2048) + 2 MiB per CUDA-graph batch size, at least 10 GiB above 60 GiB of memory, and 2 GiB
/// more with a draft model. On an H200 (143,771 MiB, 8192-token chunks, graphs up to batch
/// 256) that is 15,488 MiB reserved: 0.892.
pub fn default_mem_fraction_static(
    gpu_mem_mib: f64,
    chunked_prefill_size: usize,
    cuda_graph_max_bs: usize,
    speculative: bool,
) -> f64 {
    let mut reserved = 512.0
        + chunked_prefill_size.max(2048) as f64 * 1.5
        + cuda_graph_max_bs as f64 * 2.0
        + 1024.0 / 8.0;
    if gpu_mem_mib > 60.0 * 1024.0 {
        reserved = reserved.max(10.0 * 1024.0);
    }
    if speculative {
        reserved += 2.0 * 1024.0;
    }
    ((gpu_mem_mib - reserved) / gpu_mem_mib * 1000.0).round() / 1000.0
}

/// SGLang's defaults for a GPU of `gpu_mem_mib` (same function): `(chunked_prefill_size,
/// cuda_graph_max_bs)`.
pub fn default_prefill_and_graph_sizes(gpu_mem_mib: f64) -> (usize, usize) {
    let gib = gpu_mem_mib / 1024.0;
    if gib < 35.0 {
        (2048, 24)
    } else if gib < 60.0 {
        (4096, 32)
    } else if gib < 160.0 {
        (8192, 256)
    } else {
        (16384, 512)
    }
}

/// The K/V pool in tokens: `fraction` of `total` bytes, less what is already in use (the
/// models' weights and buffers: `total - free`) and a `fixed` reserve (per-sequence state
/// that does not scale with tokens), over `bytes_per_token`. 0 when nothing is left.
pub fn pool_tokens(
    free: usize,
    total: usize,
    fraction: f64,
    fixed: usize,
    bytes_per_token: usize,
) -> usize {
    let used = total.saturating_sub(free) as f64;
    let budget = fraction * total as f64 - used - fixed as f64;
    if budget <= 0.0 || bytes_per_token == 0 {
        return 0;
    }
    (budget / bytes_per_token as f64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_fraction_follows_sglangs_rule() {
        // H200: 8192-token chunks, graphs to 256: 512 + 12288 + 512 + 128 = 13440 < 10 GiB? no:
        // 13440 MiB > 10240, so 13440; + 2048 with a drafter.
        let h200 = 143_771.0;
        assert_eq!(default_prefill_and_graph_sizes(h200), (8192, 256));
        assert_eq!(
            default_mem_fraction_static(h200, 8192, 256, false),
            ((h200 - 13_440.0) / h200 * 1000.0_f64).round() / 1000.0
        );
        assert_eq!(default_mem_fraction_static(h200, 8192, 256, true), 0.892);
        // A 24 GiB card: 2048-token chunks, graphs to 24: 512 + 3072 + 48 + 128 = 3760 MiB.
        assert_eq!(
            default_mem_fraction_static(24_576.0, 2048, 24, false),
            0.847
        );
    }

    #[test]
    fn the_pool_is_what_the_fraction_leaves_after_the_weights() {
        let gib = 1usize << 30;
        // 100 GiB card, 90% static, 20 GiB in use, 2 GiB fixed, 1 MiB per token.
        let tokens = pool_tokens(80 * gib, 100 * gib, 0.9, 2 * gib, 1 << 20);
        assert_eq!(tokens, 68 * 1024);
        assert_eq!(pool_tokens(5 * gib, 100 * gib, 0.9, 0, 1 << 20), 0);
    }
}
