//! Synthetic token datasets (`--dataset synthetic:len=2048,n=10000`) for throughput runs,
//! above all with random-weight targets, which have no tokenizer.
//!
//! Tokens are uniform over the target vocabulary (never the mask token), seeded, so a run is
//! reproducible. A training step costs the same whatever the token values, so these measure
//! real throughput; the loss is meaningless.

use std::path::PathBuf;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::dataset::{DataStats, Dataset, Example};
use super::error::{TrainError, TrainResult};

/// One `--dataset` value.
#[derive(Debug, Clone, PartialEq)]
pub enum DatasetSpec {
    File(PathBuf),
    Synthetic(SyntheticSpec),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntheticSpec {
    /// Sequence lengths, uniform in `min_len..=max_len` (`len=2048` or `len=512..2048`).
    pub min_len: usize,
    pub max_len: usize,
    /// Number of sequences.
    pub n: usize,
    /// Unsupervised prefix (the "prompt") of each sequence.
    pub prompt: usize,
    pub seed: u64,
}

impl std::fmt::Display for DatasetSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::File(p) => write!(f, "{}", p.display()),
            Self::Synthetic(s) => write!(
                f,
                "synthetic:len={}..{},n={},prompt={},seed={}",
                s.min_len, s.max_len, s.n, s.prompt, s.seed
            ),
        }
    }
}

impl DatasetSpec {
    /// Splits a `--dataset` value: a synthetic spec whole (its options are comma-separated),
    /// otherwise comma-separated file names.
    pub fn parse_list(value: &str) -> Result<Vec<Self>, String> {
        if let Some(rest) = value.strip_prefix("synthetic:") {
            return Ok(vec![Self::Synthetic(SyntheticSpec::parse(rest)?)]);
        }
        Ok(value
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| Self::File(PathBuf::from(s)))
            .collect())
    }
}

impl SyntheticSpec {
    fn parse(opts: &str) -> Result<Self, String> {
        let mut s = Self {
            min_len: 0,
            max_len: 0,
            n: 0,
            prompt: 0,
            seed: 0,
        };
        let num = |k: &str, v: &str| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| format!("synthetic dataset: `{k}={v}` is not a number"))
        };
        for kv in opts.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                format!("synthetic dataset: `{kv}` is not key=value (keys: len, n, prompt, seed)")
            })?;
            match k.trim() {
                "len" => match v.split_once("..") {
                    Some((a, b)) => (s.min_len, s.max_len) = (num(k, a)?, num(k, b)?),
                    None => (s.min_len, s.max_len) = (num(k, v)?, num(k, v)?),
                },
                "n" => s.n = num(k, v)?,
                "prompt" => s.prompt = num(k, v)?,
                "seed" => s.seed = num(k, v)? as u64,
                other => {
                    return Err(format!(
                        "synthetic dataset: unknown key `{other}` (keys: len, n, prompt, seed)"
                    ))
                }
            }
        }
        if s.n == 0 || s.min_len == 0 {
            return Err("synthetic dataset needs len=L (or len=A..B) and n=N, e.g. synthetic:len=2048,n=10000".into());
        }
        if s.min_len > s.max_len || s.prompt + 3 > s.min_len {
            return Err(format!(
                "synthetic dataset: lengths {}..{} must be ascending and leave at least 3 tokens after prompt={}",
                s.min_len, s.max_len, s.prompt
            ));
        }
        Ok(s)
    }

    /// The sequences, cut to `max_len`; tokens in `0..vocab` except `mask`.
    pub fn generate(&self, vocab: usize, mask: u32, max_len: usize) -> TrainResult<Dataset> {
        if vocab < 2 {
            return Err(TrainError::Flag {
                flag: "--dataset",
                message: "the target vocabulary is too small for synthetic tokens".into(),
            });
        }
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ 0x5eed_da7a);
        let mut stats = DataStats::default();
        let examples = (0..self.n)
            .map(|_| {
                let len = rng.random_range(self.min_len..=self.max_len);
                let tokens: Vec<u32> = (0..len.min(max_len))
                    .map(|_| {
                        // Draw from vocab - 1 values and step over the mask id.
                        let t = rng.random_range(0..vocab as u32 - 1);
                        t + u32::from(t >= mask)
                    })
                    .collect();
                stats.records += 1;
                stats.truncated += usize::from(len > max_len);
                let loss_mask: Vec<u8> = (0..tokens.len())
                    .map(|i| u8::from(i >= self.prompt))
                    .collect();
                Example { tokens, loss_mask }
            })
            .filter(|ex| {
                let ok = !ex.anchor_candidates().is_empty();
                stats.too_little_supervision += usize::from(!ok);
                ok
            })
            .inspect(|ex| {
                stats.tokens += ex.tokens.len();
                stats.supervised_tokens += ex.supervised();
            })
            .collect::<Vec<_>>();
        if examples.is_empty() {
            return Err(TrainError::NoSupervisedTokens {
                paths: DatasetSpec::Synthetic(self.clone()).to_string(),
                detail: format!(
                    "--max-len {max_len} leaves nothing after prompt={}",
                    self.prompt
                ),
            });
        }
        Ok(Dataset { examples, stats })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_spec_parses_ranges_and_refuses_typos() {
        let l = DatasetSpec::parse_list("synthetic:len=64..128,n=5,prompt=8,seed=2").unwrap();
        let DatasetSpec::Synthetic(s) = &l[0] else {
            panic!("not synthetic")
        };
        assert_eq!(
            (s.min_len, s.max_len, s.n, s.prompt, s.seed),
            (64, 128, 5, 8, 2)
        );
        assert_eq!(DatasetSpec::parse_list("a.jsonl,b.jsonl").unwrap().len(), 2);
        assert!(DatasetSpec::parse_list("synthetic:len=64,m=3")
            .unwrap_err()
            .contains("unknown key `m`"));
        assert!(DatasetSpec::parse_list("synthetic:n=3").is_err());
        let d = s.generate(10, 4, 100).unwrap();
        assert_eq!(d.examples.len(), 5);
        for ex in &d.examples {
            assert!(ex.tokens.len() <= 100 && ex.tokens.len() >= 64);
            assert!(ex.tokens.iter().all(|&t| t < 10 && t != 4));
            assert_eq!(ex.loss_mask[..8], [0; 8]);
            assert_eq!(ex.loss_mask[8], 1);
        }
    }
}
