//! The run's results as one serializable report, rendered as markdown tables (stdout) and
//! written as `eval.json` (for machines).

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::cache::{CacheEntry, CacheStatus};
use super::error::EvalError;
use super::identity::TargetIdentity;
use super::live::LiveRun;
use super::replay::Verify;
use super::summary::EvalSummary;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PromptSetInfo {
    pub path: String,
    pub sha256: String,
    pub count: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CacheInfo {
    pub dir: String,
    pub status: CacheStatus,
    pub tap_layer_ids: Vec<usize>,
    pub entries: Vec<CacheEntry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DrafterReport {
    pub name: String,
    pub spec: String,
    pub block_size: usize,
    pub target_layer_ids: Vec<usize>,
    pub offline: Option<EvalSummary>,
    pub live: Vec<LiveRun>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalReport {
    pub target: TargetIdentity,
    pub device: String,
    pub prompts: PromptSetInfo,
    pub max_new_tokens: usize,
    pub budgets: Vec<usize>,
    pub cache: Option<CacheInfo>,
    /// Plain decoding in the live run (the speedup baseline).
    pub plain: Option<LiveRun>,
    pub drafters: Vec<DrafterReport>,
}

impl EvalReport {
    pub fn verifies(&self) -> Vec<Verify> {
        Verify::chain_and_budgets(&self.budgets)
    }

    /// Reads an `eval.json` written by [`write_json`](Self::write_json) (to re-plot it).
    pub fn read_json(path: &Path) -> Result<Self, EvalError> {
        let err = |message: String| EvalError::Report {
            path: path.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        serde_json::from_str(&text).map_err(|e| err(format!("not an eval.json report: {e}")))
    }

    pub fn write_json(&self, path: &Path) -> Result<(), EvalError> {
        let err = |message: String| EvalError::Output {
            path: path.to_path_buf(),
            message,
        };
        let json = serde_json::to_string_pretty(self).map_err(|e| err(e.to_string()))?;
        std::fs::write(path, json).map_err(|e| err(e.to_string()))
    }

    /// Markdown: the offline tau table, per-depth acceptance, per-prompt taus, and the live table.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "## Drafter comparison: target `{}` ({}), {} ({} prompts), max_new_tokens {}, greedy\n",
            self.target.source,
            self.device,
            self.prompts.path,
            self.prompts.count,
            self.max_new_tokens
        );
        let verifies = self.verifies();
        if self.drafters.iter().any(|d| d.offline.is_some()) {
            self.offline_tables(&mut s, &verifies);
        }
        if self.plain.is_some() {
            self.live_table(&mut s);
        }
        s
    }

    fn offline_tables(&self, s: &mut String, verifies: &[Verify]) {
        let _ = writeln!(
            s,
            "### Offline acceptance (round replay on the target's greedy continuation)\n"
        );
        let _ = writeln!(s, "tau = tokens per verify round, bonus included (mean streak = tau - 1); `chain` = vanilla DFlash, `ddtree-B` = DDTree with B draft nodes.\n");
        let mut header = "| drafter | block |".to_string();
        let mut rule = "|---|---:|".to_string();
        for v in verifies {
            let _ = write!(header, " {} tau |", v.label());
            rule.push_str("---:|");
        }
        let _ = writeln!(s, "{header} rounds (chain) |\n{rule}---:|");
        for d in &self.drafters {
            let Some(o) = &d.offline else { continue };
            let mut row = format!("| {} | {} |", d.name, d.block_size);
            for v in verifies {
                let cell = o.tau(*v).map_or("-".into(), |t| format!("{t:.2}"));
                let _ = write!(row, " {cell} |");
            }
            let rounds = o.mode(Verify::Chain).map_or(0, |m| m.rounds);
            let _ = writeln!(s, "{row} {rounds} |");
        }
        let deepest = verifies.iter().copied().max().unwrap_or(Verify::Chain);
        for v in [Verify::Chain, deepest] {
            let _ = writeln!(
                s,
                "\n#### Per-depth acceptance, {} (P(streak >= d | streak >= d-1))\n",
                v.label()
            );
            let depth = self
                .drafters
                .iter()
                .filter_map(|d| d.offline.as_ref())
                .map(|o| o.max_depth)
                .max()
                .unwrap_or(0);
            let mut header = "| drafter |".to_string();
            let mut rule = "|---|".to_string();
            for d in 1..=depth {
                let _ = write!(header, " d{d} |");
                rule.push_str("---:|");
            }
            let _ = writeln!(s, "{header}\n{rule}");
            for d in &self.drafters {
                let Some(m) = d.offline.as_ref().and_then(|o| o.mode(v)) else {
                    continue;
                };
                let mut row = format!("| {} |", d.name);
                for k in 0..depth {
                    let cell = m
                        .depth_conditional
                        .get(k)
                        .map_or("-".into(), |r| format!("{r:.2}"));
                    let _ = write!(row, " {cell} |");
                }
                let _ = writeln!(s, "{row}");
            }
            if v == deepest {
                break;
            }
        }
        let _ = writeln!(s, "\n#### Per prompt: tau chain / {}\n", deepest.label());
        let mut header = "| prompt |".to_string();
        let mut rule = "|---|".to_string();
        let offline: Vec<_> = self
            .drafters
            .iter()
            .filter_map(|d| d.offline.as_ref().map(|o| (d, o)))
            .collect();
        for (d, _) in &offline {
            let _ = write!(header, " {} |", d.name);
            rule.push_str("---:|");
        }
        let _ = writeln!(s, "{header}\n{rule}");
        let ids: Vec<String> = offline
            .first()
            .and_then(|(_, o)| o.mode(Verify::Chain))
            .map(|m| m.per_prompt.iter().map(|p| p.id.clone()).collect())
            .unwrap_or_default();
        for (i, id) in ids.iter().enumerate() {
            let mut row = format!("| {id} |");
            for (_, o) in &offline {
                let t = |v: Verify| {
                    o.mode(v)
                        .and_then(|m| m.per_prompt.get(i))
                        .map_or("-".into(), |p| format!("{:.2}", p.tau))
                };
                let _ = write!(row, " {} / {} |", t(Verify::Chain), t(deepest));
            }
            let _ = writeln!(s, "{row}");
        }
        s.push('\n');
    }

    fn live_table(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "### Live decoding (batch 1, greedy, same prompts and max_new_tokens)\n"
        );
        let _ = writeln!(s, "| drafter | mode | tau | tokens | seconds | tokens/s | speedup | same output as plain |\n|---|---|---:|---:|---:|---:|---:|---:|");
        let n = self.prompts.count;
        let row = |s: &mut String, name: &str, r: &LiveRun| {
            let speedup = r.speedup.map_or("1.00x".into(), |x| format!("{x:.2}x"));
            let same = r.matches_plain.map_or("-".into(), |m| format!("{m}/{n}"));
            let _ = writeln!(
                s,
                "| {name} | {} | {:.2} | {} | {:.2} | {:.1} | {speedup} | {same} |",
                r.mode, r.tau, r.tokens, r.seconds, r.tokens_per_second
            );
        };
        if let Some(p) = &self.plain {
            row(s, "-", p);
        }
        for d in &self.drafters {
            for r in &d.live {
                row(s, &d.name, r);
            }
        }
        s.push('\n');
    }
}
