//! Length limits applied before the expensive work, so memory per request stays bounded.
//!
//! Tokenizing a text costs far more memory than the text itself (the tokenizer keeps offsets,
//! alignments and token strings for every byte and token; a 30 MB text peaked at 6 GB), so an
//! over-long prompt must be refused before it is tokenized in full. Two checks do that:
//!
//! 1. A byte bound. Every token stands for at most `max_token_bytes` bytes of text (the longest
//!    decoded vocabulary entry), and normalization (NFC) shrinks text at most threefold (Hangul
//!    jamo compose 3:1), so a text longer than `context x max_token_bytes x 3` bytes has more
//!    tokens than the context holds. It is refused from its length alone.
//! 2. A windowed pre-count for texts under that bound but still large: the text is tokenized in
//!    windows cut just before a space that starts a word, where the pre-tokenizer splits anyway,
//!    and counting stops as soon as the tokens seen (less one per cut, to stay a lower bound)
//!    exceed the context. Only a text that may fit is then tokenized whole.
//!
//! Both refusals use SGLang's context-length message, with "at least" since the count stopped
//! early. Tokenization itself runs on a bounded pool ([`TokenizerPool`]) so a flood of large
//! prompts queues instead of occupying every blocking thread at once.

use std::sync::Arc;

use dflash_common::tokenizer::Tokenizer;
use tokio::sync::Semaphore;

use crate::error::ApiError;
use crate::validation::ValidationError;

/// How much normalization can shrink a text (NFC composes Hangul jamo 3:1).
const NORMALIZATION_SHRINK: usize = 3;
/// Texts up to this size are tokenized whole without a pre-count: their tokenization is cheap.
const PRECOUNT_FROM_BYTES: usize = 64 * 1024;
/// Bytes per pre-count window.
const WINDOW_BYTES: usize = 32 * 1024;

/// The prompt-length bounds for one model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptLimits {
    pub context_length: usize,
    pub max_token_bytes: usize,
    /// Texts longer than this cannot fit the context (check 1 above).
    pub max_text_bytes: usize,
}

impl PromptLimits {
    pub fn new(context_length: usize, max_token_bytes: usize) -> Self {
        let max_token_bytes = max_token_bytes.max(1);
        Self {
            context_length,
            max_token_bytes,
            max_text_bytes: context_length
                .saturating_mul(max_token_bytes)
                .saturating_mul(NORMALIZATION_SHRINK),
        }
    }

    /// Check 1: refuses a text (or several, summed, as for chat messages) from its byte length.
    pub fn check_bytes(&self, bytes: usize) -> Result<(), ValidationError> {
        if bytes <= self.max_text_bytes {
            return Ok(());
        }
        Err(ValidationError::PromptTooLongAtLeast {
            at_least: bytes / (self.max_token_bytes * NORMALIZATION_SHRINK),
            context: self.context_length,
        })
    }

    /// Checks 1 and 2, then tokenizes `text` whole. Runs on a blocking worker.
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, ApiError> {
        self.check_bytes(text.len())?;
        if text.len() > PRECOUNT_FROM_BYTES {
            let at_least = self.count_at_least(tokenizer, text)?;
            if at_least >= self.context_length {
                return Err(ValidationError::PromptTooLongAtLeast {
                    at_least,
                    context: self.context_length,
                }
                .into());
            }
        }
        Ok(tokenizer.encode(text, add_special_tokens)?)
    }

    /// A lower bound on `text`'s token count, exact up to one token per window cut; stops once
    /// it reaches the context length.
    fn count_at_least(&self, tokenizer: &Tokenizer, text: &str) -> Result<usize, ApiError> {
        let mut total = 0usize;
        let mut cuts = 0usize;
        let mut rest = text;
        while !rest.is_empty() {
            let (window, tail) = rest.split_at(window_end(rest));
            total += tokenizer.encode(window, false)?.len();
            rest = tail;
            if !rest.is_empty() {
                cuts += 1;
            }
            if total.saturating_sub(cuts) >= self.context_length {
                break;
            }
        }
        Ok(total.saturating_sub(cuts))
    }
}

/// Where the next window ends: just before the last space that starts a word within
/// [`WINDOW_BYTES`], else at the last character boundary there.
fn window_end(text: &str) -> usize {
    if text.len() <= WINDOW_BYTES {
        return text.len();
    }
    let mut end = WINDOW_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let bytes = text.as_bytes();
    let word_start = (1..end)
        .rev()
        .find(|&i| bytes[i] == b' ' && bytes.get(i + 1).is_some_and(|b| !b.is_ascii_whitespace()));
    match word_start {
        Some(i) => i,
        None => end.max(1),
    }
}

/// Tokenization and template rendering run here: on tokio's blocking threads, at most
/// `permits` at a time (the machine's cores), so a burst of large prompts waits in line
/// instead of holding a tokenizer's working memory for every request at once.
#[derive(Debug, Clone)]
pub struct TokenizerPool {
    permits: Arc<Semaphore>,
}

impl Default for TokenizerPool {
    fn default() -> Self {
        Self::new()
    }
}

impl TokenizerPool {
    pub fn new() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self {
            permits: Arc::new(Semaphore::new(cores.max(2))),
        }
    }

    /// Runs `work` on a blocking thread once a permit is free.
    pub async fn run<T, F>(&self, work: F) -> Result<T, ApiError>
    where
        F: FnOnce() -> Result<T, ApiError> + Send + 'static,
        T: Send + 'static,
    {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|e| ApiError::Internal(format!("tokenizer pool closed: {e}")))?;
        tokio::task::spawn_blocking(work)
            .await
            .map_err(|e| ApiError::Internal(format!("tokenizer worker failed: {e}")))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_bound_refuses_only_texts_that_cannot_fit() {
        let l = PromptLimits::new(100, 10);
        assert_eq!(l.max_text_bytes, 3000);
        assert!(l.check_bytes(3000).is_ok());
        let err = l.check_bytes(6001).unwrap_err();
        assert_eq!(
            err,
            ValidationError::PromptTooLongAtLeast {
                at_least: 200,
                context: 100
            }
        );
        assert!(err
            .to_string()
            .contains("longer than the model's context length"));
    }

    #[test]
    fn windows_end_before_a_word_and_on_char_boundaries() {
        let text = format!("{} word", "é".repeat(WINDOW_BYTES));
        let end = window_end(&text);
        assert!(text.is_char_boundary(end) && end <= WINDOW_BYTES && end > 0);
        let spaced = "ab ".repeat(WINDOW_BYTES);
        let end = window_end(&spaced);
        assert_eq!(&spaced[end..end + 2], " a");
    }
}
