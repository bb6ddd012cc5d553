//! The dataset types the trainer's stages share: a tokenized conversation with its loss mask
//! ([`Example`]), a loaded dataset and its statistics, and the load options. Loading lives in
//! `data.rs` (chat files) and `synthetic.rs` (random tokens); the target pipeline and the loss
//! read examples; none of them is imported back here.

/// One tokenized conversation.
#[derive(Debug, Clone)]
pub struct Example {
    pub tokens: Vec<u32>,
    /// 1 where the token is supervised (assistant output), per position.
    pub loss_mask: Vec<u8>,
}

impl Example {
    /// Positions usable as anchors: `a >= 1` with `loss_mask[a] = loss_mask[a + 1] = 1`
    /// (SpecForge v2: the anchor and at least its first label are supervised).
    pub fn anchor_candidates(&self) -> Vec<usize> {
        (1..self.tokens.len().saturating_sub(1))
            .filter(|&a| self.loss_mask[a] == 1 && self.loss_mask[a + 1] == 1)
            .collect()
    }

    pub fn supervised(&self) -> usize {
        self.loss_mask.iter().map(|&m| m as usize).sum()
    }
}

#[derive(Debug, Clone)]
pub struct DataOptions {
    /// Sequences are cut to this many tokens.
    pub max_len: usize,
    /// Sequences with fewer supervised tokens (after the cut) are dropped.
    pub min_supervised: usize,
    /// Unreadable lines tolerated across all files before the load stops.
    pub max_bad_lines: usize,
    /// Read at most this many records in all (the first ones, in file order).
    pub max_records: Option<usize>,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct DataStats {
    /// Records read for training (those below included), not counting the two skips after them.
    pub records: usize,
    /// Lines that are not a usable record (bad JSON, no `messages`, a template error); past
    /// `--max-bad-lines` the load stops.
    pub bad_lines: usize,
    /// Well-formed records whose last message is not an assistant turn (prompts, e.g. a
    /// `regenerate` input): nothing to supervise, skipped, and never counted as bad lines.
    pub no_final_assistant_turn: usize,
    pub too_little_supervision: usize,
    pub truncated: usize,
    pub tokens: usize,
    pub supervised_tokens: usize,
}

#[derive(Debug)]
pub struct Dataset {
    pub examples: Vec<Example>,
    pub stats: DataStats,
}
