//! Attention over a sequence's cache with an explicit visibility pattern.
//!
//! The new tokens of one sequence are written into its cache first; the queries then attend to
//! cache rows `[0, len + t)`. Which of those rows a query may see is the pattern: causal
//! (prefill, chain verify), tree (each node sees the prefix, its ancestors and itself), full
//! (the DFlash block) or sliding (DFlash sliding layers). GQA is done by grouping query heads
//! per KV head rather than repeating K/V.

use candle_core::{DType, Device, Result, Tensor};

use crate::layers::ops::{softmax_last_dim, OpsMode};

/// How the `t` new tokens of a sequence see the cache (`c` committed rows) and each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttnPattern {
    /// New token i sees all committed rows and new tokens 0..=i.
    Causal,
    /// New token i sees all committed rows, itself and its ancestors. `parents[i]` is the index
    /// of i's parent among the new tokens (`None` for a root); parents precede children.
    Tree { parents: Vec<Option<usize>> },
    /// Every new token sees every committed row and every new token (the DFlash block).
    Full,
    /// DFlash sliding layers: causal among new tokens; committed row j is visible to the new
    /// token at position p only if `j > p - window` (the window includes the token itself).
    Sliding {
        window: usize,
        first_position: usize,
    },
}

impl AttnPattern {
    /// Checks a tree's parent list: every parent precedes its child.
    pub fn validate(&self, t: usize) -> std::result::Result<(), String> {
        if let AttnPattern::Tree { parents } = self {
            if parents.len() != t {
                return Err(format!("tree has {} parents for {t} tokens", parents.len()));
            }
            for (i, p) in parents.iter().enumerate() {
                if let Some(p) = p {
                    if *p >= i {
                        return Err(format!(
                            "tree node {i} has parent {p}: parents must precede children"
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Additive mask `[t, c + t]` (0 visible, -inf hidden), or `None` when everything is visible.
    pub fn mask(&self, c: usize, t: usize, device: &Device) -> Result<Option<Tensor>> {
        let neg = f32::NEG_INFINITY;
        let block: Vec<f32> = match self {
            AttnPattern::Full => return Ok(None),
            AttnPattern::Causal if t == 1 => return Ok(None),
            AttnPattern::Causal => (0..t)
                .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { neg }))
                .collect(),
            AttnPattern::Tree { parents } => {
                let mut vis = vec![false; t * t];
                for i in 0..t {
                    if let Some(p) = parents[i] {
                        let (before, row) = vis.split_at_mut(i * t);
                        row[..t].copy_from_slice(&before[p * t..p * t + t]);
                    }
                    vis[i * t + i] = true;
                }
                vis.into_iter().map(|v| if v { 0.0 } else { neg }).collect()
            }
            AttnPattern::Sliding {
                window,
                first_position,
            } => {
                let mut m = vec![0f32; t * (c + t)];
                for i in 0..t {
                    let pos = first_position + i;
                    for j in 0..c {
                        // committed row j sits at position j
                        if j + window <= pos {
                            m[i * (c + t) + j] = neg;
                        }
                    }
                    for j in 0..t {
                        if j > i {
                            m[i * (c + t) + c + j] = neg;
                        }
                    }
                }
                return Ok(Some(Tensor::from_vec(m, (t, c + t), device)?));
            }
        };
        let block = Tensor::from_vec(block, (t, t), device)?;
        if c == 0 {
            return Ok(Some(block));
        }
        let prefix = Tensor::zeros((t, c), DType::F32, device)?;
        Ok(Some(Tensor::cat(&[&prefix, &block], 1)?))
    }
}

/// `softmax(q kᵀ / √d + mask) v` for one sequence.
///
/// `q: [n_heads, t, d]`, `k`, `v: [n_kv_heads, L, d]`, `mask: [t, L]` (f32). Scores and softmax
/// run in f32 whatever the model dtype. Returns `[t, n_heads * d]`.
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    mode: OpsMode,
) -> Result<Tensor> {
    let (n_heads, t, d) = q.dims3()?;
    let (n_kv, l, _) = k.dims3()?;
    let groups = n_heads / n_kv;
    let dtype = q.dtype();
    // Heads h = kv * groups + g share KV head `kv` (HF `repeat_kv`), so the query heads of one
    // KV head are adjacent and can be folded into the row dimension.
    let q = q.contiguous()?.reshape((n_kv, groups * t, d))?;
    let scale = 1.0 / (d as f64).sqrt();
    let scores = q.matmul(&k.t()?)?.to_dtype(DType::F32)?;
    let scores = (scores * scale)?.reshape((n_kv, groups, t, l))?;
    let scores = match mask {
        Some(m) => scores.broadcast_add(m)?,
        None => scores,
    };
    let probs = softmax_last_dim(&scores, mode)?.to_dtype(dtype)?;
    let probs = probs.reshape((n_kv, groups * t, l))?;
    let out = probs.matmul(&v.contiguous()?)?; // [n_kv, groups*t, d]
    out.reshape((n_heads, t, d))?
        .transpose(0, 1)?
        .reshape((t, n_heads * d))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn visible(m: &Option<Tensor>, t: usize, l: usize) -> Vec<Vec<bool>> {
        match m {
            None => vec![vec![true; l]; t],
            Some(m) => m
                .to_vec2::<f32>()
                .unwrap()
                .into_iter()
                .map(|r| r.into_iter().map(|x| x == 0.0).collect())
                .collect(),
        }
    }

    #[test]
    fn tree_mask_shows_prefix_ancestors_and_self_only() {
        // root 0; 1,2 children of 0; 3 child of 1; 4 child of 2
        let p = AttnPattern::Tree {
            parents: vec![None, Some(0), Some(0), Some(1), Some(2)],
        };
        let v = visible(&p.mask(3, 5, &Device::Cpu).unwrap(), 5, 8);
        let expect_block = [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],
            [1, 1, 0, 1, 0],
            [1, 0, 1, 0, 1],
        ];
        for i in 0..5 {
            assert!(v[i][..3].iter().all(|&x| x), "prefix visible to node {i}");
            for j in 0..5 {
                assert_eq!(
                    v[i][3 + j],
                    expect_block[i][j] == 1,
                    "node {i} sees node {j}"
                );
            }
        }
    }

    #[test]
    fn causal_and_sliding_masks() {
        let v = visible(&AttnPattern::Causal.mask(2, 3, &Device::Cpu).unwrap(), 3, 5);
        assert_eq!(v[0], vec![true, true, true, false, false]);
        assert_eq!(v[2], vec![true; 5]);
        // block at positions 10..13, 10 committed rows, window 4: slot k sees rows >= 10+k-3
        let p = AttnPattern::Sliding {
            window: 4,
            first_position: 10,
        };
        let v = visible(&p.mask(10, 3, &Device::Cpu).unwrap(), 3, 13);
        assert_eq!(
            &v[0][..10],
            &[false, false, false, false, false, false, false, true, true, true]
        );
        assert_eq!(&v[0][10..], &[true, false, false]);
        assert_eq!(
            &v[2][..10],
            &[false, false, false, false, false, false, false, false, false, true]
        );
        assert_eq!(&v[2][10..], &[true, true, true]);
    }

    #[test]
    fn parents_must_precede_children() {
        let p = AttnPattern::Tree {
            parents: vec![None, Some(1)],
        };
        assert!(p.validate(2).is_err());
    }
}
