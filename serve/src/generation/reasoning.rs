//! Reasoning separation (`--reasoning-parser qwen3`): the `<think>…</think>` part of a chat
//! answer goes to `reasoning_content`, the rest to `content`.
//!
//! The rules follow SGLang's `BaseReasoningFormatDetector` exactly, so clients see the same
//! split: streamed text is buffered only while the whole buffer could still become a think tag,
//! `<think>` is stripped once, text up to `</think>` is reasoning (right-trimmed at the end tag),
//! and everything after is content. `qwen3-thinking` models open reasoning in the template, so
//! the output is reasoning from its first token (`force_reasoning`). One deliberate difference:
//! a tag cut across two pieces (possible when a tokenizer spells it in several tokens) is held
//! back until it completes, where SGLang would pass the first half through as text.

use serde_json::Value;

const THINK_START: &str = "<think>";
const THINK_END: &str = "</think>";

/// The parsers `--reasoning-parser` accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningParserKind {
    /// Qwen3 hybrid-thinking models: reasoning only when the output opens `<think>`.
    Qwen3,
    /// Qwen3 "Thinking" (2507) models: the template opens `<think>`; output starts in reasoning.
    Qwen3Thinking,
}

impl ReasoningParserKind {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "qwen3" => Some(Self::Qwen3),
            "qwen3-thinking" => Some(Self::Qwen3Thinking),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Qwen3 => "qwen3",
            Self::Qwen3Thinking => "qwen3-thinking",
        }
    }

    /// Whether a chat request gets its reasoning separated: the request did not turn
    /// `separate_reasoning` off, and (for hybrid models) did not switch thinking off in the
    /// template, in which case the whole answer is content (SGLang #5874).
    pub fn applies(
        self,
        separate_reasoning: Option<bool>,
        template_kwargs: &serde_json::Map<String, Value>,
    ) -> bool {
        if separate_reasoning == Some(false) {
            return false;
        }
        match self {
            Self::Qwen3Thinking => true,
            Self::Qwen3 => template_kwargs.get("enable_thinking") != Some(&Value::Bool(false)),
        }
    }
}

/// Text one increment split into its two channels.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReasoningSplit {
    pub reasoning: String,
    pub content: String,
}

/// Streaming splitter for one choice.
#[derive(Debug, Clone)]
pub struct ReasoningParser {
    buffer: String,
    in_reasoning: bool,
    stripped_start: bool,
}

impl ReasoningParser {
    pub fn new(kind: ReasoningParserKind) -> Self {
        Self {
            buffer: String::new(),
            in_reasoning: kind == ReasoningParserKind::Qwen3Thinking,
            stripped_start: false,
        }
    }

    /// Splits the next piece of streamed text.
    pub fn push(&mut self, text: &str) -> ReasoningSplit {
        self.buffer.push_str(text);
        let could_be_tag = [THINK_START, THINK_END]
            .iter()
            .any(|tag| tag.starts_with(self.buffer.as_str()) && *tag != self.buffer);
        if could_be_tag {
            return ReasoningSplit::default();
        }
        let mut current = std::mem::take(&mut self.buffer);
        if !self.stripped_start && current.contains(THINK_START) {
            current = current.replace(THINK_START, "");
            self.stripped_start = true;
            self.in_reasoning = true;
        }
        if self.in_reasoning {
            if let Some(end) = current.find(THINK_END) {
                self.in_reasoning = false;
                return ReasoningSplit {
                    reasoning: current[..end].trim_end().to_string(),
                    content: current[end + THINK_END.len()..].to_string(),
                };
            }
            self.buffer = hold_partial_tag(&mut current, THINK_END);
            return ReasoningSplit {
                reasoning: current,
                content: String::new(),
            };
        }
        if !self.stripped_start {
            self.buffer = hold_partial_tag(&mut current, THINK_START);
        }
        ReasoningSplit {
            reasoning: String::new(),
            content: current,
        }
    }

    /// What is still buffered when the output ends (a partial tag that never completed).
    pub fn finish(&mut self) -> ReasoningSplit {
        let rest = std::mem::take(&mut self.buffer);
        if self.in_reasoning {
            ReasoningSplit {
                reasoning: rest,
                content: String::new(),
            }
        } else {
            ReasoningSplit {
                reasoning: String::new(),
                content: rest,
            }
        }
    }
}

/// Splits off the longest tail of `text` that could be the start of `tag`, so a tag cut across
/// two pieces is still recognised (SGLang only buffers when the whole buffer is a tag prefix).
fn hold_partial_tag(text: &mut String, tag: &str) -> String {
    let keep = (1..tag.len())
        .rev()
        .find(|&n| text.ends_with(&tag[..n]))
        .unwrap_or(0);
    text.split_off(text.len() - keep)
}

/// Non-streaming split of a whole answer, as SGLang's `detect_and_parse`: `None` reasoning when
/// the answer never entered a reasoning block.
pub fn split_whole(kind: ReasoningParserKind, text: &str) -> (Option<String>, String) {
    let in_reasoning = kind == ReasoningParserKind::Qwen3Thinking || text.contains(THINK_START);
    if !in_reasoning {
        return (None, text.to_string());
    }
    let processed = text.replace(THINK_START, "");
    let processed = processed.trim();
    match processed.split_once(THINK_END) {
        None => (Some(processed.to_string()), String::new()),
        Some((reasoning, content)) => (Some(reasoning.to_string()), content.trim().to_string()),
    }
}

/// Output tokens that belong to the reasoning: everything up to and including the first
/// `think_end_id` (all of them when reasoning never closed). 0 when the output never reasoned.
pub fn reasoning_token_count(
    kind: ReasoningParserKind,
    output_ids: &[u32],
    think_start_id: Option<u32>,
    think_end_id: Option<u32>,
) -> usize {
    let opened = kind == ReasoningParserKind::Qwen3Thinking
        || think_start_id.is_some_and(|s| output_ids.contains(&s));
    if !opened {
        return 0;
    }
    match think_end_id.and_then(|e| output_ids.iter().position(|&t| t == e)) {
        Some(pos) => pos + 1,
        None => output_ids.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(kind: ReasoningParserKind, pieces: &[&str]) -> (String, String) {
        let mut p = ReasoningParser::new(kind);
        let (mut r, mut c) = (String::new(), String::new());
        for piece in pieces {
            let s = p.push(piece);
            r.push_str(&s.reasoning);
            c.push_str(&s.content);
        }
        let s = p.finish();
        r.push_str(&s.reasoning);
        c.push_str(&s.content);
        (r, c)
    }

    #[test]
    fn tags_split_across_pieces_are_recognised() {
        let (r, c) = stream(
            ReasoningParserKind::Qwen3,
            &[
                "<th",
                "ink>",
                "\nLet me",
                " think.\n</",
                "think>",
                "\n\nAnswer",
                ".",
            ],
        );
        // Text streamed before the end tag is not trimmed again (SGLang's streaming behaviour).
        assert_eq!(r, "\nLet me think.\n");
        assert_eq!(c, "\n\nAnswer.");
    }

    #[test]
    fn no_think_tag_means_everything_is_content() {
        let (r, c) = stream(ReasoningParserKind::Qwen3, &["Hello", " world"]);
        assert_eq!((r.as_str(), c.as_str()), ("", "Hello world"));
        assert_eq!(
            split_whole(ReasoningParserKind::Qwen3, "Hello world"),
            (None, "Hello world".into())
        );
    }

    #[test]
    fn forced_reasoning_starts_in_reasoning() {
        let (r, c) = stream(ReasoningParserKind::Qwen3Thinking, &["abc </think>", "x"]);
        assert_eq!((r.as_str(), c.as_str()), ("abc", "x"));
        assert_eq!(
            split_whole(ReasoningParserKind::Qwen3Thinking, "abc </think>\n x "),
            (Some("abc ".into()), "x".into())
        );
    }

    #[test]
    fn whole_split_trims_like_sglang() {
        assert_eq!(
            split_whole(
                ReasoningParserKind::Qwen3,
                "<think>\nwhy\n</think>\n\nbecause"
            ),
            (Some("why\n".into()), "because".into())
        );
        assert_eq!(
            split_whole(ReasoningParserKind::Qwen3, "<think>\nunfinished"),
            (Some("unfinished".into()), String::new())
        );
    }

    #[test]
    fn reasoning_tokens_count_up_to_the_end_tag() {
        let k = ReasoningParserKind::Qwen3;
        assert_eq!(
            reasoning_token_count(k, &[5, 1, 2, 6, 3], Some(5), Some(6)),
            4
        );
        assert_eq!(reasoning_token_count(k, &[1, 2, 3], Some(5), Some(6)), 0);
        assert_eq!(reasoning_token_count(k, &[5, 1, 2], Some(5), Some(6)), 3);
    }

    #[test]
    fn thinking_switched_off_in_the_template_disables_separation() {
        let mut kw = serde_json::Map::new();
        assert!(ReasoningParserKind::Qwen3.applies(None, &kw));
        kw.insert("enable_thinking".into(), Value::Bool(false));
        assert!(!ReasoningParserKind::Qwen3.applies(None, &kw));
        assert!(!ReasoningParserKind::Qwen3Thinking.applies(Some(false), &kw));
    }
}
