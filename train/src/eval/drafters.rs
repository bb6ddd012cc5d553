//! Which drafters to compare: `--drafter [NAME=]SPEC`, parsed once into a [`DrafterArg`] and
//! loaded against the target.
//!
//! SPEC is a checkpoint directory or a z-lab repo id (resolved like `dflash-serve` resolves
//! one, through the Hugging Face cache), `demo` for the bundled tiny-coder-demo drafter, or
//! `random[:key=value,...]` for a seeded random-init drafter (a floor to compare against, and
//! the tests' drafter), or `oracle[:noise=P,seed=S]`: the target proposing its own greedy
//! continuation, all drafts right without noise and a wrong rank-1 token with probability P
//! with it. The oracle is no drafter; it checks the harness (its offline and live tau must
//! agree, and it shows what tau a near-perfect drafter reaches on these prompts).

use std::path::PathBuf;

use dflash_common::DFlashConfig;
use dflash_models::speculative::{DFlashProposer, Noise, OracleProposer, Proposer};
use dflash_models::{DFlashDrafter, OpsMode, Qwen3Model};

use super::error::EvalError;

/// The bundled target, `serve/assets/tiny-coder-demo`.
pub fn demo_target_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../serve/assets/tiny-coder-demo")
}

/// The bundled drafter for it, `serve/assets/tiny-coder-demo-dflash`.
pub fn demo_drafter_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../serve/assets/tiny-coder-demo-dflash")
}

/// Shape and seed of a random-init drafter. Unset fields follow `DFlashConfig::for_target`:
/// mask token = last vocabulary id, tap layers by the published rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RandomDrafter {
    pub seed: u64,
    pub layers: usize,
    pub block_size: usize,
    pub mask_token_id: Option<u32>,
    pub target_layer_ids: Option<Vec<usize>>,
}

impl Default for RandomDrafter {
    fn default() -> Self {
        Self {
            seed: 0,
            layers: 1,
            block_size: 16,
            mask_token_id: None,
            target_layer_ids: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum DrafterSource {
    /// A directory or a repo id.
    Model(String),
    Demo,
    Random(RandomDrafter),
    /// The target's own greedy continuation, optionally corrupted.
    Oracle {
        noise: Option<(f64, u64)>,
    },
}

/// Draft depths of the oracle (a block of 16, like the published drafters).
pub const ORACLE_DEPTH: usize = 15;

/// A loaded `--drafter`.
#[derive(Debug, Clone)]
pub enum Drafter {
    DFlash(Box<DFlashDrafter>),
    Oracle { noise: Option<Noise> },
}

impl Drafter {
    pub fn block_size(&self) -> usize {
        match self {
            Drafter::DFlash(d) => d.block_size(),
            Drafter::Oracle { .. } => ORACLE_DEPTH + 1,
        }
    }

    pub fn target_layer_ids(&self) -> Vec<usize> {
        match self {
            Drafter::DFlash(d) => d.target_layer_ids().to_vec(),
            Drafter::Oracle { .. } => Vec::new(),
        }
    }

    /// A fresh proposer (a noisy oracle restarts its seeded noise).
    pub fn proposer(&self, target: &Qwen3Model) -> Box<dyn Proposer> {
        match self {
            Drafter::DFlash(d) => Box::new(DFlashProposer::new(d.as_ref().clone())),
            Drafter::Oracle { noise } => {
                Box::new(OracleProposer::new(target.clone(), ORACLE_DEPTH, *noise))
            }
        }
    }
}

/// One `--drafter` value.
#[derive(Debug, Clone, PartialEq)]
pub struct DrafterArg {
    /// Label in tables, JSON and plots.
    pub name: String,
    /// SPEC as given.
    pub spec: String,
    pub source: DrafterSource,
}

const RANDOM_KEYS: &str = "seed, layers, block_size, mask_token_id, target_layer_ids (joined by +)";
const SPEC_FORMS: &str =
    "[NAME=]DIR, a repo id, `demo`, `random[:seed=S,...]` or `oracle[:noise=P,seed=S]`";

impl DrafterArg {
    /// Parses `[NAME=]SPEC` (the clap value parser of `--drafter`).
    pub fn parse(value: &str) -> Result<Self, String> {
        let (name, spec) = match value.split_once('=') {
            // `random:seed=1` has '=' after ':'; a NAME never contains ':' or '/'.
            Some((n, s)) if !n.is_empty() && !n.contains([':', '/']) => (Some(n.to_string()), s),
            _ => (None, value),
        };
        if spec.is_empty() {
            return Err(format!("empty drafter spec; expected {SPEC_FORMS}"));
        }
        let source = if spec == "demo" {
            DrafterSource::Demo
        } else if spec == "random" || spec.starts_with("random:") {
            DrafterSource::Random(parse_random(spec.strip_prefix("random:").unwrap_or(""))?)
        } else if spec == "oracle" || spec.starts_with("oracle:") {
            DrafterSource::Oracle {
                noise: parse_oracle(spec.strip_prefix("oracle:").unwrap_or(""))?,
            }
        } else {
            DrafterSource::Model(spec.to_string())
        };
        let name = name.unwrap_or_else(|| match &source {
            DrafterSource::Demo => "demo".into(),
            DrafterSource::Random(r) => format!("random-{}", r.seed),
            DrafterSource::Oracle { noise: None } => "oracle".into(),
            DrafterSource::Oracle {
                noise: Some((p, _)),
            } => format!("oracle-noise-{p}"),
            DrafterSource::Model(s) => {
                let trimmed = s.trim_end_matches('/');
                trimmed.rsplit('/').next().unwrap_or(trimmed).to_string()
            }
        });
        Ok(Self {
            name,
            spec: spec.to_string(),
            source,
        })
    }

    /// Loads the drafter for `target` (whose embeddings and `lm_head` it shares).
    pub fn load(&self, target: &Qwen3Model) -> Result<Drafter, EvalError> {
        match &self.source {
            DrafterSource::Oracle { noise } => Ok(Drafter::Oracle {
                noise: noise.map(|(corrupt_prob, seed)| Noise { corrupt_prob, seed }),
            }),
            _ => self
                .load_dflash(target)
                .map(|d| Drafter::DFlash(Box::new(d))),
        }
    }

    fn load_dflash(&self, target: &Qwen3Model) -> Result<DFlashDrafter, EvalError> {
        let err = |message: String| EvalError::Drafter {
            spec: self.spec.clone(),
            message,
        };
        match &self.source {
            DrafterSource::Demo => {
                let dir = demo_drafter_dir();
                if !dir.join("config.json").exists() {
                    return Err(err(format!("the bundled demo drafter is not at {}; train it first or pass a checkpoint directory", dir.display())));
                }
                DFlashDrafter::load(&dir, target, OpsMode::Fused).map_err(|e| err(e.to_string()))
            }
            DrafterSource::Model(spec) => {
                let location = dflash_common::resolve_model(spec)
                    .map_err(|e| err(format!("{e}; a drafter is {SPEC_FORMS}")))?;
                DFlashDrafter::load(&location.dir, target, OpsMode::Fused)
                    .map_err(|e| err(e.to_string()))
            }
            DrafterSource::Random(r) => {
                let tc = target.config();
                let mask = r.mask_token_id.unwrap_or(tc.vocab_size as u32 - 1);
                let cfg = DFlashConfig::for_target(
                    tc,
                    r.layers,
                    r.block_size,
                    mask,
                    r.target_layer_ids.clone(),
                );
                let path = PathBuf::from(format!("<{}>", self.spec));
                cfg.check_against_target(&path, tc)
                    .map_err(|e| err(e.to_string()))?;
                DFlashDrafter::random(cfg, target, r.seed, OpsMode::Fused)
                    .map_err(|e| err(e.to_string()))
            }
            DrafterSource::Oracle { .. } => Err(err("the oracle is not a DFlash drafter".into())),
        }
    }
}

fn parse_random(options: &str) -> Result<RandomDrafter, String> {
    let mut r = RandomDrafter::default();
    for kv in options.split(',').filter(|s| !s.is_empty()) {
        let (key, value) = kv.split_once('=').ok_or_else(|| {
            format!("random drafter option `{kv}` is not key=value; keys: {RANDOM_KEYS}")
        })?;
        let num = |v: &str| {
            v.parse::<u64>().map_err(|_| {
                format!("random drafter option `{key}`: `{v}` is not a non-negative integer")
            })
        };
        match key {
            "seed" => r.seed = num(value)?,
            "layers" => r.layers = num(value)? as usize,
            "block_size" => r.block_size = num(value)? as usize,
            "mask_token_id" => r.mask_token_id = Some(num(value)? as u32),
            "target_layer_ids" => {
                r.target_layer_ids = Some(
                    value
                        .split('+')
                        .map(|v| num(v).map(|x| x as usize))
                        .collect::<Result<_, _>>()?,
                )
            }
            other => {
                return Err(format!(
                    "unknown random drafter option `{other}`; keys: {RANDOM_KEYS}"
                ))
            }
        }
    }
    if r.layers == 0 {
        return Err("random drafter: layers must be at least 1".into());
    }
    if r.block_size < 2 {
        return Err(
            "random drafter: block_size must be at least 2 (the bonus token plus one draft)".into(),
        );
    }
    Ok(r)
}

fn parse_oracle(options: &str) -> Result<Option<(f64, u64)>, String> {
    let (mut noise, mut seed) = (None, 0);
    for kv in options.split(',').filter(|s| !s.is_empty()) {
        match kv.split_once('=') {
            Some(("noise", v)) => match v.parse::<f64>() {
                Ok(p) if (0.0..=1.0).contains(&p) => noise = Some(p),
                _ => {
                    return Err(format!(
                        "oracle option `noise`: `{v}` is not a probability in [0, 1]"
                    ))
                }
            },
            Some(("seed", v)) => {
                seed = v.parse().map_err(|_| {
                    format!("oracle option `seed`: `{v}` is not a non-negative integer")
                })?
            }
            _ => return Err(format!("unknown oracle option `{kv}`; keys: noise, seed")),
        }
    }
    Ok(noise.map(|p| (p, seed)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafter_specs_parse_names_and_random_shapes() {
        let d = DrafterArg::parse("ours=runs/ckpt-100/").unwrap();
        assert_eq!(
            (d.name.as_str(), d.spec.as_str()),
            ("ours", "runs/ckpt-100/")
        );
        let d = DrafterArg::parse("z-lab/Qwen3-8B-DFlash-b16").unwrap();
        assert_eq!(d.name, "Qwen3-8B-DFlash-b16");
        assert_eq!(
            d.source,
            DrafterSource::Model("z-lab/Qwen3-8B-DFlash-b16".into())
        );
        assert_eq!(
            DrafterArg::parse("demo").unwrap().source,
            DrafterSource::Demo
        );
        let d = DrafterArg::parse("random:seed=3,layers=2,target_layer_ids=1+2").unwrap();
        assert_eq!(d.name, "random-3");
        let DrafterSource::Random(r) = d.source else {
            panic!("random")
        };
        assert_eq!((r.seed, r.layers, r.block_size), (3, 2, 16));
        assert_eq!(r.target_layer_ids, Some(vec![1, 2]));
        let named = DrafterArg::parse("floor=random:seed=9").unwrap();
        assert_eq!(
            (named.name.as_str(), named.spec.as_str()),
            ("floor", "random:seed=9")
        );
        assert!(DrafterArg::parse("random:depth=3")
            .unwrap_err()
            .contains("unknown random drafter option `depth`"));
        assert!(DrafterArg::parse("random:block_size=1").is_err());
        let o = DrafterArg::parse("oracle:noise=0.3,seed=5").unwrap();
        assert_eq!(o.name, "oracle-noise-0.3");
        assert_eq!(
            o.source,
            DrafterSource::Oracle {
                noise: Some((0.3, 5))
            }
        );
        assert!(DrafterArg::parse("oracle:noise=2").is_err());
    }
}
