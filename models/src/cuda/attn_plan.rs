//! Launch geometry of the one-launch attention (`attn_decode.cu`): row tiles per block, how
//! the caller's key splits are regrouped and the shared memory a block needs. Free of CUDA so
//! that its invariants are tested on every machine; `attn_decode.rs` launches what it says.
// Without the `cuda` feature only the tests use it.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// Keys per chunk (CH in attn_decode.cu, `cuda::CHUNK`).
pub(crate) const CHUNK_KEYS: usize = 64;
/// Bytes per shared K/V/q row (KPAD bf16 in attn_decode.cu).
pub(crate) const ROW_BYTES: usize = 136 * 2;
/// The most dynamic shared memory any launch asks for (two stages, four row tiles): the
/// kernel's attribute is always set to this, so graphs captured earlier keep launching.
pub(crate) const MAX_SHARED_BYTES: usize = 2 * 2 * CHUNK_KEYS * ROW_BYTES + 64 * ROW_BYTES;

/// One launch: grid (KV heads, `nsplit`, `tiles`), blocks of `16 rt` query rows walking
/// `cps` chunks of keys each, `stages` shared K/V buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AttnPlan {
    pub rt: usize,
    pub tiles: usize,
    pub nsplit: usize,
    pub cps: usize,
    pub stages: usize,
    pub shared_bytes: usize,
}

/// The plan for `rows = tokens * groups` query rows per KV head and the caller's `(nsplit,
/// cps)` split plan (which covers the live keys); `rt` forces the 16-row tiles per block (1, 2
/// or 4), None picks by the row count. Splits are regrouped into at most 32 / 16 / 8 (for
/// 1 / 2 / 4 tiles) of several chunks each, covering at least the keys the caller's plan did:
/// the block that merges reads every split's partial of its rows, so their number bounds the
/// merge's tail, and a block streams its chunks double buffered.
pub(crate) fn attn_plan(
    rows: usize,
    (nsplit, cps): (usize, usize),
    rt: Option<usize>,
) -> Result<AttnPlan, String> {
    if rows == 0 || nsplit == 0 || cps == 0 {
        return Err(format!(
            "{rows} query rows with split plan ({nsplit}, {cps}): nothing to launch"
        ));
    }
    let rt = match (rt, rows) {
        (Some(rt @ (1 | 2 | 4)), _) => rt,
        (Some(rt), _) => return Err(format!("{rt} row tiles per block (1, 2 or 4)")),
        (None, 0..=16) => 1,
        (None, 17..=32) => 2,
        (None, _) => 4,
    };
    let per = nsplit.div_ceil(max_splits(rt));
    let (nsplit, cps) = ((nsplit * cps).div_ceil(cps * per), cps * per);
    let stages = if cps > 1 { 2 } else { 1 };
    let kv_bytes = stages * 2 * CHUNK_KEYS * ROW_BYTES;
    // The merge stages two floats per (split, row) in the K/V buffers.
    if 2 * 4 * nsplit * 16 * rt > kv_bytes {
        return Err(format!(
            "{nsplit} splits of {rt} row tiles exceed the merge's shared memory"
        ));
    }
    Ok(AttnPlan {
        rt,
        tiles: rows.div_ceil(16 * rt),
        nsplit,
        cps,
        stages,
        shared_bytes: kv_bytes + 16 * rt * ROW_BYTES,
    })
}

/// The most splits of a launch with `rt` row tiles per block: the block that merges reads
/// every split's partial of its rows, so their number bounds the merge's tail.
fn max_splits(rt: usize) -> usize {
    match rt {
        1 => 32,
        2 => 16,
        _ => 8,
    }
}

/// Shared memory of a one-stage block (`attn_decode_rt1_b4s1`): one K/V buffer however many
/// chunks the block walks, and the q rows; the block partial and the merge's table reuse the
/// K/V buffer (checked in the tests for the most splits).
pub(crate) fn one_stage_shared_bytes(rt: usize) -> usize {
    2 * CHUNK_KEYS * ROW_BYTES + 16 * rt * ROW_BYTES
}

/// The plan whose chunks per split the kernel sets at run time from the live length (`cps` 0:
/// `ceil(live chunks / nsplit)`): the most splits for its row tiles, shared memory for two
/// stages. One launch, or one CUDA graph, then fits every length and cache capacity, and an
/// eager step and its replay add the same partials in the same order.
pub(crate) fn runtime_plan(rows: usize, rt: Option<usize>) -> Result<AttnPlan, String> {
    let p = attn_plan(rows, (1, 2), rt)?;
    Ok(AttnPlan {
        nsplit: max_splits(p.rt),
        cps: 0,
        ..p
    })
}

/// Most key splits per (sequence, KV head) of a batched one-token step (`attn_step.cu`):
/// the merge stages two floats per (split, query head) in the block's rings.
pub(crate) const MAX_STEP_SPLITS: usize = 64;

/// Shared memory of an `attn_step.cu` block with `stages` stages per warp: 4 warps x stages x
/// {K, V} x 16 keys, then 16 q rows and the new K and V rows, every row `ROW_BYTES`.
pub(crate) fn step_shared_bytes(stages: usize) -> usize {
    4 * stages * 2 * 16 * ROW_BYTES + (16 + 2) * ROW_BYTES
}

/// Key splits per (sequence, KV head) of a batched one-token step over `pairs` (sequence,
/// KV head) pairs, from the batch alone (the grid a CUDA graph keeps for every length).
/// `blocks` > 0 aims at that many blocks in all; 0: one split per pair unless there are
/// fewer pairs than the device's `sms`, then enough to give every SM a block. Measured on the
/// H200 (h200-2026-12-06-s16-decattn, 640 positions): B 16 / 32 with 1 split 19.4 / 30.4 us,
/// with 4 / 2 splits 30.1 / 39.6 (a split's fixed cost and the merge outweigh the
/// parallelism once every SM holds a block).
pub(crate) fn step_splits(pairs: usize, sms: usize, blocks: usize) -> usize {
    let pairs = pairs.max(1);
    let blocks = if blocks > 0 { blocks } else { sms };
    (blocks / pairs).clamp(1, MAX_STEP_SPLITS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_the_keys_with_bounded_splits_and_shared_memory() {
        for rows in [1usize, 4, 8, 16, 17, 32, 33, 64, 100, 256, 320] {
            for nsplit in 1..=260 {
                for cps in 1..=4 {
                    for rt in [None, Some(1), Some(2), Some(4)] {
                        let p = attn_plan(rows, (nsplit, cps), rt).unwrap();
                        let what = format!("rows {rows}, plan ({nsplit}, {cps}), rt {rt:?}: {p:?}");
                        assert!(p.nsplit * p.cps >= nsplit * cps, "keys lost: {what}");
                        // Regrouping adds less than one split's worth of (idle) chunks.
                        assert!(p.nsplit * p.cps < nsplit * cps + p.cps, "{what}");
                        assert!(p.nsplit <= [32, 16, 0, 8][p.rt - 1], "{what}");
                        assert!(p.tiles * 16 * p.rt >= rows, "rows lost: {what}");
                        assert!((p.tiles - 1) * 16 * p.rt < rows, "idle tile: {what}");
                        assert_eq!(p.stages, if p.cps > 1 { 2 } else { 1 }, "{what}");
                        assert!(p.shared_bytes <= MAX_SHARED_BYTES, "{what}");
                        // The block partial (4 warps x 16 rows x 128 f32 + max/sum) and the
                        // merge's (max, sum) table fit the K/V buffers they reuse.
                        let kv = p.stages * 2 * CHUNK_KEYS * ROW_BYTES;
                        assert!(4 * 16 * 128 * 4 + 4 * 16 * 2 * 4 <= kv, "{what}");
                        assert!(2 * 4 * p.nsplit * 16 * p.rt <= kv, "{what}");
                    }
                }
            }
        }
    }

    #[test]
    fn runtime_plans_take_the_most_splits_and_two_stages() {
        for rows in [1usize, 4, 16, 17, 64, 256] {
            let p = runtime_plan(rows, None).unwrap();
            let fixed = attn_plan(rows, (1, 1), None).unwrap();
            assert_eq!((p.rt, p.tiles), (fixed.rt, fixed.tiles), "rows {rows}");
            assert_eq!(
                (p.nsplit, p.cps, p.stages),
                (max_splits(p.rt), 0, 2),
                "rows {rows}"
            );
            assert_eq!(
                p.shared_bytes,
                2 * 2 * CHUNK_KEYS * ROW_BYTES + 16 * p.rt * ROW_BYTES
            );
            assert!(p.shared_bytes <= MAX_SHARED_BYTES);
            assert!(2 * 4 * p.nsplit * 16 * p.rt <= p.stages * 2 * CHUNK_KEYS * ROW_BYTES);
        }
        assert!(runtime_plan(0, None).is_err());
    }

    #[test]
    fn one_stage_blocks_fit_their_partials_and_merge_table() {
        let kv = 2 * CHUNK_KEYS * ROW_BYTES;
        assert_eq!(one_stage_shared_bytes(1), kv + 16 * ROW_BYTES);
        assert!(4 * 16 * 128 * 4 + 4 * 16 * 2 * 4 <= kv);
        assert!(2 * 4 * max_splits(1) * 16 <= kv);
        // Four such blocks fit an H200 SM's 227 KB; two-stage ones fit three.
        assert!(4 * one_stage_shared_bytes(1) <= 227 * 1024);
        assert!(3 * runtime_plan(4, Some(1)).unwrap().shared_bytes <= 227 * 1024);
    }

    #[test]
    fn row_tiles_follow_the_row_count_unless_forced() {
        let rt = |rows, forced| attn_plan(rows, (18, 1), forced).unwrap().rt;
        assert_eq!(
            (rt(4, None), rt(16, None), rt(17, None), rt(64, None)),
            (1, 1, 2, 4)
        );
        assert_eq!(rt(64, Some(1)), 1);
        assert!(attn_plan(64, (18, 1), Some(3)).is_err());
        assert!(attn_plan(0, (18, 1), None).is_err());
        assert!(attn_plan(4, (0, 1), None).is_err());
        // A graph's plan over an 8K-key capacity: 130 one-chunk splits become 26 of 5.
        let p = attn_plan(4, (130, 1), None).unwrap();
        assert_eq!((p.nsplit, p.cps, p.stages), (26, 5, 2));
    }

    #[test]
    fn step_splits_follow_the_batch_alone() {
        // 132 SMs: B 16 / 32 / 64 of 8 KV heads take one split (as measured).
        assert_eq!(step_splits(128, 132, 0), 1);
        assert_eq!(step_splits(256, 132, 0), 1);
        assert_eq!(step_splits(512, 132, 0), 1);
        // Smaller batches split until every SM holds a block.
        assert_eq!(step_splits(16, 132, 0), 8);
        assert_eq!(step_splits(8, 132, 0), 16);
        for pairs in [1usize, 8, 16, 100, 128, 256, 384, 512, 2048] {
            let n = step_splits(pairs, 132, 0);
            assert!((1..=MAX_STEP_SPLITS).contains(&n), "{pairs}: {n}");
            assert!(n == 1 || pairs * n <= 132, "{pairs}: {n}");
            assert!(
                n == MAX_STEP_SPLITS || pairs * (n + 1) > 132,
                "{pairs}: {n}"
            );
        }
        // A block target: blocks / pairs, at least one split, at most the merge's bound.
        assert_eq!(step_splits(256, 132, 1024), 4);
        assert_eq!(step_splits(512, 132, 256), 1);
        assert_eq!(step_splits(8, 132, 1 << 20), MAX_STEP_SPLITS);
    }

    #[test]
    fn step_blocks_fit_their_merge_and_the_sm() {
        for stages in [2usize, 3] {
            let rings = 4 * stages * 2 * 16 * ROW_BYTES;
            // The warps' partials (4 x 16 heads x 128 f32 + max/sum) and the split merge's
            // table (2 floats per split and head) reuse the rings.
            assert!(4 * 16 * 128 * 4 + 4 * 16 * 2 * 4 <= rings);
            assert!(2 * 4 * MAX_STEP_SPLITS * 16 <= rings);
        }
        // Three 2-stage or two 3-stage blocks fit an SM's 228 KB (1 KB reserved per block).
        assert!(3 * (step_shared_bytes(2) + 1024 + 128) <= 228 * 1024);
        assert!(2 * (step_shared_bytes(3) + 1024 + 128) <= 228 * 1024);
    }
}
