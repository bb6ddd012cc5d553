//! Incremental detokenization: turning a growing list of generated ids into text deltas.
//!
//! Byte-level BPE splits multi-byte characters over several tokens, so decoding one token at a
//! time would emit U+FFFD halves. The prefix_offset/read_offset algorithm (as in TGI and vLLM)
//! decodes a small window of already-emitted tokens plus the new ones, and only releases text once
//! the window decodes to something longer that does not end in U+FFFD. The window also keeps
//! SentencePiece-style leading-space handling right, because the new tokens are never decoded on
//! their own.
//!
//! Under speculative decoding one step commits several tokens; [`IncrementalDecoder::push`] takes
//! them all at once.

use crate::tokenizer::{Decode, TokenizerError};

const REPLACEMENT: char = '\u{FFFD}';

#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDecoder {
    pub fn new(skip_special_tokens: bool) -> Self {
        Self {
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            skip_special_tokens,
        }
    }

    /// All ids pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Appends `new_ids` and returns the text that became final (possibly empty).
    pub fn push(&mut self, tok: &impl Decode, new_ids: &[u32]) -> Result<String, TokenizerError> {
        if new_ids.is_empty() {
            return Ok(String::new());
        }
        self.ids.extend_from_slice(new_ids);
        let prefix = tok.decode_ids(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tok.decode_ids(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if full.len() > prefix.len() && !full.ends_with(REPLACEMENT) {
            if let Some(delta) = full.get(prefix.len()..) {
                let delta = delta.to_string();
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                return Ok(delta);
            }
        }
        Ok(String::new())
    }

    /// Releases whatever is still held back (at the end of generation), replacement characters
    /// included: the model really did end on an incomplete character.
    pub fn finish(&mut self, tok: &impl Decode) -> Result<String, TokenizerError> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let prefix = tok.decode_ids(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tok.decode_ids(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }
}

/// A stop string found in the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopMatch {
    /// The stop string that matched (the earliest-starting one; the longest on a tie).
    pub stop: String,
    /// Byte offset in the full output text where it starts.
    pub start: usize,
}

/// Text released by one [`StopMatcher::push`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopScan {
    /// Newly releasable text (the stop string itself trimmed unless `no_stop_trim`).
    pub released: String,
    /// Set once a stop string matched; generation must end.
    pub matched: Option<StopMatch>,
}

/// Finds stop strings across token (and chunk) boundaries.
///
/// Text that could still be the start of a stop string (a suffix equal to a proper prefix of one,
/// so at most `max_stop_len - 1` bytes) is held back; everything before it is released. A stop
/// string starting before the released point would have been complete when it was released, so
/// searching only from the released point is exact.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    no_stop_trim: bool,
    text: String,
    released: usize,
    matched: Option<StopMatch>,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>, no_stop_trim: bool) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Self {
            stops,
            no_stop_trim,
            text: String::new(),
            released: 0,
            matched: None,
        }
    }

    /// The whole output text seen so far, held-back part included.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The text released to the client so far.
    pub fn released_text(&self) -> &str {
        &self.text[..self.released]
    }

    pub fn matched(&self) -> Option<&StopMatch> {
        self.matched.as_ref()
    }

    pub fn push(&mut self, delta: &str) -> StopScan {
        if self.matched.is_some() {
            return StopScan::default();
        }
        let search_from = self.released;
        self.text.push_str(delta);
        if let Some(found) = self.find_from(search_from) {
            let end = if self.no_stop_trim {
                found.start + found.stop.len()
            } else {
                found.start
            };
            let released = self.text[self.released..end].to_string();
            self.released = end;
            self.text.truncate(end);
            self.matched = Some(found.clone());
            return StopScan {
                released,
                matched: Some(found),
            };
        }
        let keep = self.held_back_len();
        let end = self.text.len() - keep;
        let released = self.text[self.released..end].to_string();
        self.released = end;
        StopScan {
            released,
            matched: None,
        }
    }

    /// Releases the held-back tail (generation ended without a stop string).
    pub fn flush(&mut self) -> String {
        let rest = self.text[self.released..].to_string();
        self.released = self.text.len();
        rest
    }

    fn find_from(&self, from: usize) -> Option<StopMatch> {
        let hay = &self.text[from..];
        let mut best: Option<StopMatch> = None;
        for stop in &self.stops {
            if let Some(pos) = hay.find(stop.as_str()) {
                let start = from + pos;
                let better = match &best {
                    None => true,
                    Some(b) => start < b.start || (start == b.start && stop.len() > b.stop.len()),
                };
                if better {
                    best = Some(StopMatch {
                        stop: stop.clone(),
                        start,
                    });
                }
            }
        }
        best
    }

    /// Length of the longest suffix of the unreleased text that is a proper prefix of a stop.
    fn held_back_len(&self) -> usize {
        let pending = &self.text[self.released..];
        let mut keep = 0;
        for stop in &self.stops {
            let max = (stop.len() - 1).min(pending.len());
            for k in (keep + 1..=max).rev() {
                let start = pending.len() - k;
                if pending.is_char_boundary(start)
                    && stop.as_bytes().starts_with(&pending.as_bytes()[start..])
                {
                    keep = k;
                    break;
                }
            }
        }
        keep
    }
}

#[cfg(test)]
mod tests;
