//! SGLang's new-token ratio: a request is admitted when its prompt and an estimate of the
//! tokens it will still generate fit in the K/V budget, not its whole `max_new_tokens`
//! (most requests stop early, at EOS). The estimate's ratio starts at 0.7 of `max_new_tokens`
//! and decays by steps to 0.098 while nothing runs short; when the engine has to retract a
//! running sequence for pages (it resumes later, with the same output), the ratio goes back
//! to 1 and decays again. The engine's pool still counts every page exactly, so an estimate
//! that was too low costs a retraction, never a failed request.

/// SGLang's `default_init_new_token_ratio`.
const INIT: f64 = 0.7;
/// SGLang's `default_min_new_token_ratio_factor` (of the initial ratio).
const MIN_FACTOR: f64 = 0.14;
/// SGLang's `default_new_token_ratio_decay_steps`.
const DECAY_STEPS: f64 = 600.0;

#[derive(Debug, Clone)]
pub struct NewTokenRatio {
    ratio: f64,
    init: f64,
    min: f64,
    decay: f64,
}

impl NewTokenRatio {
    /// SGLang's rule: `--schedule-conservativeness` scales the initial ratio (capped at 1).
    pub fn new(conservativeness: f64) -> Self {
        let init = (INIT * conservativeness).clamp(0.0, 1.0);
        let min = (init * MIN_FACTOR).min(1.0);
        Self {
            ratio: init,
            init,
            min,
            decay: (init - min) / DECAY_STEPS,
        }
    }

    pub fn ratio(&self) -> f64 {
        self.ratio
    }

    /// New tokens a request of `max_new_tokens` is expected to still generate (at least 1).
    pub fn expected_new_tokens(&self, max_new_tokens: usize) -> usize {
        ((max_new_tokens as f64 * self.ratio).ceil() as usize)
            .clamp(1.min(max_new_tokens), max_new_tokens)
    }

    /// One decode step ran with nothing retracted.
    pub fn step(&mut self) {
        self.ratio = (self.ratio - self.decay).max(self.min);
    }

    /// The engine retracted a sequence: admit as if every request runs to its length, for now.
    pub fn retracted(&mut self) {
        self.ratio = 1.0_f64.max(self.init);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ratio_decays_to_its_floor_and_a_retraction_resets_it() {
        let mut r = NewTokenRatio::new(1.0);
        assert_eq!(r.expected_new_tokens(100), 70);
        assert_eq!(r.expected_new_tokens(1), 1);
        assert_eq!(r.expected_new_tokens(0), 0);
        for _ in 0..300 {
            r.step();
        }
        assert!(
            (r.ratio() - (0.7 + 0.098) / 2.0).abs() < 1e-9,
            "{}",
            r.ratio()
        );
        for _ in 0..1000 {
            r.step();
        }
        assert!((r.ratio() - 0.098).abs() < 1e-12);
        assert_eq!(r.expected_new_tokens(1000), 98);
        r.retracted();
        assert_eq!(r.expected_new_tokens(100), 100);
        assert_eq!(
            NewTokenRatio::new(2.0).expected_new_tokens(10),
            10,
            "capped at 1"
        );
    }
}
