//! Penalties on the target's logits with SGLang's semantics, applied at every tree node from
//! the committed tokens plus that node's own ancestors, so a speculative round penalises each
//! node's row exactly as plain decoding penalises the same position.
//!
//! Per row, in this order (vLLM's and HF's order; SGLang applies the same rules):
//! - `repetition_penalty` (HF's CTRL rule): every token already in the prompt or the output has
//!   its logit divided by the penalty when positive, multiplied when negative;
//! - `frequency_penalty`: minus the penalty times the token's count in the output;
//! - `presence_penalty`: minus the penalty once for a token present in the output;
//! - `min_new_tokens`: the stop tokens (EOS unless ignored, and `stop_token_ids`) get `-inf`
//!   while fewer output tokens than that exist before the position;
//! - `logit_bias`: added last (SGLang adds it after its penalizers).
//!
//! "Output" is every generated token before the position: the committed ones and, inside a
//! tree, the path from the root to the node (the root, the bonus token, is already committed).

use std::collections::{HashMap, HashSet};

/// A request's penalties; [`Penalties::default`] changes nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct Penalties {
    pub frequency: f32,
    pub presence: f32,
    /// 1 disables it.
    pub repetition: f32,
    /// Stop tokens are masked until this many tokens are generated.
    pub min_new_tokens: usize,
    /// (token, bias) added to the token's logit.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for Penalties {
    fn default() -> Self {
        Self {
            frequency: 0.0,
            presence: 0.0,
            repetition: 1.0,
            min_new_tokens: 0,
            logit_bias: Vec::new(),
        }
    }
}

/// A rejected penalty, naming the field, its range and the value given (SGLang's ranges).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PenaltyError {
    #[error("`{field}` must be in [-2, 2], got {given}")]
    Linear { field: &'static str, given: f32 },
    #[error("`repetition_penalty` must be in (0, 2], got {given}")]
    Repetition { given: f32 },
    #[error("`logit_bias` for token {token} must be a finite number, got {given}")]
    Bias { token: u32, given: f32 },
    #[error("`logit_bias` names token {token}, outside the vocabulary ({vocab})")]
    BiasToken { token: u32, vocab: usize },
}

impl Penalties {
    /// Whether any rule changes a row.
    pub fn is_active(&self) -> bool {
        self.frequency != 0.0
            || self.presence != 0.0
            || self.repetition != 1.0
            || self.min_new_tokens > 0
            || !self.logit_bias.is_empty()
    }

    /// SGLang's ranges; comparisons are written so that NaN fails.
    pub fn validate(&self, vocab: usize) -> Result<(), PenaltyError> {
        for (field, given) in [
            ("frequency_penalty", self.frequency),
            ("presence_penalty", self.presence),
        ] {
            if !(-2.0..=2.0).contains(&given) {
                return Err(PenaltyError::Linear { field, given });
            }
        }
        if !(self.repetition > 0.0 && self.repetition <= 2.0) {
            return Err(PenaltyError::Repetition {
                given: self.repetition,
            });
        }
        for &(token, given) in &self.logit_bias {
            if token as usize >= vocab {
                return Err(PenaltyError::BiasToken { token, vocab });
            }
            if !given.is_finite() {
                return Err(PenaltyError::Bias { token, given });
            }
        }
        Ok(())
    }
}

/// One sequence's penalties and what they read: the prompt's distinct tokens and the counts
/// of committed output tokens.
#[derive(Debug, Clone)]
pub struct PenaltyState {
    params: Penalties,
    prompt: HashSet<u32>,
    output: HashMap<u32, u32>,
    generated: usize,
    stop_ids: Vec<u32>,
}

impl PenaltyState {
    /// `stop_ids`: what `min_new_tokens` masks (EOS unless ignored, plus `stop_token_ids`).
    pub fn new(params: Penalties, prompt: &[u32], stop_ids: Vec<u32>) -> Self {
        let prompt = if params.repetition != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Self {
            params,
            prompt,
            output: HashMap::new(),
            generated: 0,
            stop_ids,
        }
    }

    /// Records committed output tokens.
    pub fn commit(&mut self, tokens: &[u32]) {
        for &t in tokens {
            *self.output.entry(t).or_insert(0) += 1;
        }
        self.generated += tokens.len();
    }

    /// Penalises `row`, the logits predicting the token after the committed output followed by
    /// `path` (a tree node's ancestors below the root, the node itself last).
    pub fn apply(&self, path: &[u32], row: &mut [f32]) {
        let p = &self.params;
        let mut extra: HashMap<u32, u32> = HashMap::new();
        for &t in path {
            *extra.entry(t).or_insert(0) += 1;
        }
        let count = |t: u32| {
            self.output.get(&t).copied().unwrap_or(0) + extra.get(&t).copied().unwrap_or(0)
        };
        let seen = self
            .output
            .keys()
            .chain(extra.keys().filter(|t| !self.output.contains_key(t)));
        if p.repetition != 1.0 {
            let only_prompt = self.prompt.iter().filter(|t| count(**t) == 0);
            for &t in seen.clone().chain(only_prompt) {
                if let Some(x) = row.get_mut(t as usize) {
                    *x = if *x > 0.0 {
                        *x / p.repetition
                    } else {
                        *x * p.repetition
                    };
                }
            }
        }
        if p.frequency != 0.0 || p.presence != 0.0 {
            for &t in seen {
                if let Some(x) = row.get_mut(t as usize) {
                    *x -= p.frequency * count(t) as f32 + p.presence;
                }
            }
        }
        if self.generated + path.len() < p.min_new_tokens {
            for &t in &self.stop_ids {
                if let Some(x) = row.get_mut(t as usize) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        for &(t, b) in &p.logit_bias {
            if let Some(x) = row.get_mut(t as usize) {
                *x += b;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(p: Penalties, prompt: &[u32], output: &[u32]) -> PenaltyState {
        let mut s = PenaltyState::new(p, prompt, vec![0]);
        s.commit(output);
        s
    }

    fn penalised(s: &PenaltyState, path: &[u32]) -> Vec<f32> {
        let mut row = vec![2.0, -2.0, 1.0, 4.0, -1.0, 0.5];
        s.apply(path, &mut row);
        row
    }

    #[test]
    fn each_rule_changes_exactly_the_tokens_it_names() {
        let freq = Penalties {
            frequency: 0.5,
            ..Default::default()
        };
        // Output: 3 twice, 1 once; prompt tokens are not penalised by frequency.
        assert_eq!(
            penalised(&state(freq, &[2], &[3, 1, 3]), &[]),
            [2.0, -2.5, 1.0, 3.0, -1.0, 0.5]
        );
        let pres = Penalties {
            presence: 0.25,
            ..Default::default()
        };
        assert_eq!(
            penalised(&state(pres, &[2], &[3, 1, 3]), &[]),
            [2.0, -2.25, 1.0, 3.75, -1.0, 0.5]
        );
        let rep = Penalties {
            repetition: 2.0,
            ..Default::default()
        };
        // Prompt and output tokens, each once: positive halved, negative doubled.
        assert_eq!(
            penalised(&state(rep, &[2, 4, 2], &[3, 1, 3]), &[]),
            [2.0, -4.0, 0.5, 2.0, -2.0, 0.5]
        );
        let min = Penalties {
            min_new_tokens: 2,
            ..Default::default()
        };
        assert_eq!(
            penalised(&state(min.clone(), &[], &[5]), &[])[0],
            f32::NEG_INFINITY
        );
        assert_eq!(penalised(&state(min, &[], &[5, 5]), &[])[0], 2.0);
        let bias = Penalties {
            logit_bias: vec![(4, 10.0), (0, -100.0)],
            ..Default::default()
        };
        assert_eq!(
            penalised(&state(bias, &[], &[]), &[]),
            [-98.0, -2.0, 1.0, 4.0, 9.0, 0.5]
        );
    }

    #[test]
    fn a_tree_path_counts_as_output_exactly_as_if_it_were_committed() {
        let all = Penalties {
            frequency: 0.3,
            presence: 0.2,
            repetition: 1.5,
            min_new_tokens: 4,
            logit_bias: vec![(5, 1.0)],
        };
        let prompt = [4, 2];
        for (committed, path) in [
            (&[3u32][..], &[3u32, 1][..]),
            (&[1], &[5, 5, 2]),
            (&[], &[0]),
            (&[2, 2], &[]),
        ] {
            let as_path = penalised(&state(all.clone(), &prompt, committed), path);
            let joined: Vec<u32> = committed.iter().chain(path).copied().collect();
            let as_committed = penalised(&state(all.clone(), &prompt, &joined), &[]);
            assert_eq!(as_path, as_committed, "{committed:?} + {path:?}");
        }
        // The path really matters: min_new_tokens lifts after four outputs.
        let s = state(all, &prompt, &[3]);
        assert_eq!(penalised(&s, &[1, 1])[0], f32::NEG_INFINITY);
        assert!(penalised(&s, &[1, 1, 1])[0].is_finite());
    }

    #[test]
    fn validation_names_the_field_and_default_is_inactive() {
        assert!(!Penalties::default().is_active());
        assert_eq!(Penalties::default().validate(8), Ok(()));
        let bad = |p: Penalties| p.validate(8).unwrap_err().to_string();
        assert!(bad(Penalties {
            presence: 2.5,
            ..Default::default()
        })
        .contains("presence_penalty"));
        assert!(bad(Penalties {
            repetition: 0.0,
            ..Default::default()
        })
        .contains("repetition_penalty"));
        assert!(bad(Penalties {
            logit_bias: vec![(8, 1.0)],
            ..Default::default()
        })
        .contains("outside the vocabulary"));
        assert!(bad(Penalties {
            frequency: f32::NAN,
            ..Default::default()
        })
        .contains("frequency_penalty"));
    }
}
