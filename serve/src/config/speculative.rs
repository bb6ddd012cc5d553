//! The speculative-decoding flags, resolved as SGLang resolves them: `DFLASH` (a DFlash
//! drafter, DDTree-verified by default) and `NEXTN` / `MTP` (the target's own `mtp.*` head,
//! chain-verified by default; `--speculative-eagle-topk` > 1 asks for a tree).

use std::path::Path;

use super::{zlab_drafter_repo, ConfigError};
use crate::cli::{Args, DrafterArg, VerifyArg};

/// SGLang's automatic `--speculative-num-steps` for the Qwen3.5 / Qwen3-Next MTP heads.
pub const NEXTN_DEFAULT_STEPS: usize = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecAlgorithm {
    DFlash,
    /// The built-in multi-token-prediction head (SGLang `NEXTN`; `MTP` is accepted too).
    NextN,
}

impl SpecAlgorithm {
    /// The name SGLang reports in `/server_info`.
    pub fn name(self) -> &'static str {
        match self {
            SpecAlgorithm::DFlash => "DFLASH",
            SpecAlgorithm::NextN => "NEXTN",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DraftSource {
    /// A directory or repo id given with --speculative-draft-model-path.
    Path(String),
    /// `--drafter z-lab`: the repo derived from the target's repo id.
    ZLab { repo: String },
    /// NEXTN: the `mtp.*` head stored in the target checkpoint itself.
    TargetMtp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifyMode {
    Chain,
    DDTree { budget: usize },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub algorithm: SpecAlgorithm,
    pub draft: DraftSource,
    /// Verify width including the bonus slot. DFLASH: the block size, `None` meaning the
    /// drafter's `block_size`; NEXTN: steps + 1 for a chain, tree nodes + 1 for a tree.
    pub num_draft_tokens: Option<usize>,
    /// Drafts per round from an autoregressive head (NEXTN); 1 for DFLASH, as SGLang forces.
    pub num_steps: usize,
    /// SGLang's branching flag; 1 for DFLASH and for a NEXTN chain.
    pub eagle_topk: usize,
    pub verify: VerifyMode,
}

fn bad(flag: &'static str, value: impl ToString, reason: impl Into<String>) -> ConfigError {
    ConfigError::BadValue {
        flag,
        value: value.to_string(),
        reason: reason.into(),
    }
}

fn ddtree(budget: usize, flag: &'static str) -> Result<VerifyMode, ConfigError> {
    if budget == 0 {
        return Err(bad(
            flag,
            budget,
            "the tree needs at least 1 node; use --speculative-verify chain for a single path",
        ));
    }
    Ok(VerifyMode::DDTree { budget })
}

/// `None` when no speculative algorithm is asked for (and no drafter implies one).
pub(super) fn from_args(
    args: &Args,
    model_path: &str,
    demo_drafter: Option<&Path>,
) -> Result<Option<SpeculativeConfig>, ConfigError> {
    let algo = args
        .speculative_algorithm
        .as_deref()
        .map(str::to_ascii_uppercase);
    match algo.as_deref() {
        None if args.speculative_draft_model_path.is_some()
            || args.drafter.is_some()
            || demo_drafter.is_some() =>
        {
            dflash(args, model_path, demo_drafter).map(Some)
        }
        None | Some("NONE") => Ok(None),
        Some("DFLASH") => dflash(args, model_path, demo_drafter).map(Some),
        Some("NEXTN" | "MTP") => nextn(args, model_path).map(Some),
        Some(other) => Err(bad(
            "--speculative-algorithm",
            other,
            "dflash-serve implements DFLASH, NEXTN (alias MTP: the target's built-in MTP head) and NONE for plain decoding; EAGLE, EAGLE3, STANDALONE, NGRAM and DSPARK are SGLang-only",
        )),
    }
}

fn dflash(
    args: &Args,
    model_path: &str,
    demo_drafter: Option<&Path>,
) -> Result<SpeculativeConfig, ConfigError> {
    let draft = match (&args.speculative_draft_model_path, args.drafter) {
        (Some(_), Some(_)) => {
            return Err(bad(
                "--drafter",
                "z-lab",
                "give either --drafter or --speculative-draft-model-path, not both",
            ))
        }
        (Some(p), None) => DraftSource::Path(p.clone()),
        (None, Some(DrafterArg::ZLab)) => DraftSource::ZLab {
            repo: zlab_drafter_repo(model_path).ok_or_else(|| bad("--drafter", "z-lab", format!("needs --model-path to be a Hugging Face repo id like Qwen/Qwen3-8B (given `{model_path}`); pass --speculative-draft-model-path DIR instead")))?,
        },
        (None, None) => match demo_drafter {
            Some(d) => DraftSource::Path(d.display().to_string()),
            None => return Err(bad(
                "--speculative-algorithm",
                "DFLASH",
                "needs a drafter: pass --speculative-draft-model-path DIR_OR_REPO or --drafter z-lab (or NEXTN for a target with a built-in MTP head)",
            )),
        },
    };
    let num_draft_tokens = match (
        args.speculative_num_draft_tokens,
        args.speculative_dflash_block_size,
    ) {
        (Some(a), Some(b)) if a != b => {
            return Err(bad(
                "--speculative-dflash-block-size",
                b,
                format!("must equal --speculative-num-draft-tokens ({a}) when both are given"),
            ))
        }
        (Some(n), _) | (None, Some(n)) if n < 2 => {
            return Err(bad(
                "--speculative-num-draft-tokens",
                n,
                "a DFlash block needs at least 2 tokens",
            ))
        }
        (a, b) => a.or(b),
    };
    for (flag, v) in [
        ("--speculative-num-steps", args.speculative_num_steps),
        ("--speculative-eagle-topk", args.speculative_eagle_topk),
    ] {
        if matches!(v, Some(n) if n != 1) {
            tracing::warn!("{flag} is forced to 1 for DFLASH (as SGLang does)");
        }
    }
    let verify = match args.speculative_verify.unwrap_or(VerifyArg::Ddtree) {
        VerifyArg::Chain => VerifyMode::Chain,
        VerifyArg::Ddtree => ddtree(
            args.speculative_ddtree_budget,
            "--speculative-ddtree-budget",
        )?,
    };
    Ok(SpeculativeConfig {
        algorithm: SpecAlgorithm::DFlash,
        draft,
        num_draft_tokens,
        num_steps: 1,
        eagle_topk: 1,
        verify,
    })
}

/// NEXTN as SGLang reads its flags: `--speculative-num-steps` drafts per round (default 3),
/// `--speculative-eagle-topk` 1 for a chain of steps + 1 verified tokens, more than 1 for a
/// tree of `--speculative-num-draft-tokens` - 1 nodes. The tree is DDTree's best-first tree
/// over the head's per-depth top-k (not EAGLE's beam), so it keeps DDTree's exactness.
fn nextn(args: &Args, model_path: &str) -> Result<SpeculativeConfig, ConfigError> {
    const WHY: &str =
        "NEXTN drafts with the MTP head inside the target checkpoint (its mtp.* weights)";
    if args.drafter.is_some() {
        return Err(bad("--drafter", "z-lab", format!("{WHY}; drop --drafter, or use --speculative-algorithm DFLASH for the z-lab DFlash drafter")));
    }
    if let Some(p) = args
        .speculative_draft_model_path
        .as_ref()
        .filter(|p| *p != model_path)
    {
        return Err(bad("--speculative-draft-model-path", p, format!("{WHY}, not a separate model; drop the flag (or pass the --model-path itself), or use --speculative-algorithm DFLASH for a DFlash drafter")));
    }
    if let Some(b) = args.speculative_dflash_block_size {
        return Err(bad(
            "--speculative-dflash-block-size",
            b,
            "is for DFLASH only; NEXTN drafts --speculative-num-steps tokens per round",
        ));
    }
    let steps = args.speculative_num_steps.unwrap_or(NEXTN_DEFAULT_STEPS);
    if steps == 0 {
        return Err(bad(
            "--speculative-num-steps",
            0,
            "NEXTN needs at least 1 draft step per round",
        ));
    }
    let topk = args.speculative_eagle_topk.unwrap_or(1);
    if topk == 0 {
        return Err(bad(
            "--speculative-eagle-topk",
            0,
            "must be at least 1 (1 verifies a chain, more a tree)",
        ));
    }
    let default = if topk > 1 {
        VerifyArg::Ddtree
    } else {
        VerifyArg::Chain
    };
    let verify = match args.speculative_verify.unwrap_or(default) {
        VerifyArg::Chain if topk > 1 => {
            return Err(bad(
                "--speculative-verify",
                "chain",
                format!("verifies a single path, but --speculative-eagle-topk {topk} asks for a tree; drop one of the two flags"),
            ))
        }
        VerifyArg::Chain => {
            if let Some(n) = args.speculative_num_draft_tokens.filter(|&n| n != steps + 1) {
                // SGLang adjusts it the same way for topk 1.
                tracing::warn!("--speculative-num-draft-tokens {n} is set to --speculative-num-steps + 1 = {} for a NEXTN chain (as SGLang does)", steps + 1);
            }
            VerifyMode::Chain
        }
        VerifyArg::Ddtree => match args.speculative_num_draft_tokens {
            Some(n) if n < 2 => {
                return Err(bad(
                    "--speculative-num-draft-tokens",
                    n,
                    "a NEXTN tree needs at least 2 tokens (the root and one node)",
                ))
            }
            Some(n) => VerifyMode::DDTree { budget: n - 1 },
            None => ddtree(args.speculative_ddtree_budget, "--speculative-ddtree-budget")?,
        },
    };
    let width = match verify {
        VerifyMode::Chain => steps + 1,
        VerifyMode::DDTree { budget } => budget + 1,
    };
    Ok(SpeculativeConfig {
        algorithm: SpecAlgorithm::NextN,
        draft: DraftSource::TargetMtp,
        num_draft_tokens: Some(width),
        num_steps: steps,
        eagle_topk: topk,
        verify,
    })
}
