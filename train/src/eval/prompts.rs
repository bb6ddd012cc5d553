//! Prompt sets: JSONL chat records (`{"id": ..., "messages": [...]}`, one per line), rendered
//! with the target's chat template exactly as `dflash-serve` renders a chat request (generation
//! prompt on, template kwargs such as `enable_thinking=false`, no extra special tokens).

use std::path::{Path, PathBuf};

use dflash_common::chat::{ChatRenderInput, ChatTemplate};
use dflash_common::tokenizer::Tokenizer;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::error::EvalError;

/// One chat record of a prompt set.
#[derive(Debug, Clone)]
pub struct ChatPrompt {
    /// The record's `id`, or `line-N` when it has none.
    pub id: String,
    pub messages: Vec<Value>,
}

/// A prompt set as read from disk, with the hash that identifies it in a cache manifest.
#[derive(Debug, Clone)]
pub struct PromptSet {
    pub path: PathBuf,
    /// sha256 of the file's bytes (hex).
    pub sha256: String,
    pub prompts: Vec<ChatPrompt>,
}

/// A rendered, tokenized prompt: what the target sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizedPrompt {
    pub id: String,
    pub tokens: Vec<u32>,
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

impl PromptSet {
    /// Reads a JSONL file of chat records. Blank lines are skipped; `limit` keeps the first N.
    pub fn load(path: &Path, limit: Option<usize>) -> Result<Self, EvalError> {
        let bytes = std::fs::read(path).map_err(|e| EvalError::Prompts {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let text = String::from_utf8(bytes.clone()).map_err(|e| EvalError::Prompts {
            path: path.to_path_buf(),
            message: format!("not UTF-8: {e}"),
        })?;
        let mut prompts = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |message: String| EvalError::PromptLine {
                path: path.to_path_buf(),
                line: i + 1,
                message,
            };
            let record: Value = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
            let messages = record
                .get("messages")
                .and_then(Value::as_array)
                .filter(|m| !m.is_empty())
                .ok_or_else(|| {
                    bad("expected a chat record {\"messages\": [{\"role\": ..., \"content\": ...}, ...]} with at least one message".into())
                })?
                .clone();
            let id = match record.get("id") {
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
                None => format!("line-{}", i + 1),
            };
            prompts.push(ChatPrompt { id, messages });
        }
        if let Some(n) = limit {
            prompts.truncate(n);
        }
        if prompts.is_empty() {
            return Err(EvalError::Prompts {
                path: path.to_path_buf(),
                message: "no chat records in the file".into(),
            });
        }
        Ok(Self {
            path: path.to_path_buf(),
            sha256: sha256_hex(&bytes),
            prompts,
        })
    }

    /// The file name, for tables and manifests.
    pub fn name(&self) -> String {
        self.path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.path.display().to_string())
    }

    /// Renders every record with `template` (generation prompt on, `kwargs` as template
    /// variables) and tokenizes it without adding special tokens: the template has them.
    pub fn tokenize(
        &self,
        tokenizer: &Tokenizer,
        template: &ChatTemplate,
        kwargs: &Map<String, Value>,
    ) -> Result<Vec<TokenizedPrompt>, EvalError> {
        self.prompts
            .iter()
            .map(|p| {
                let err = |message: String| EvalError::Render {
                    id: p.id.clone(),
                    message,
                };
                let text = template
                    .render(&ChatRenderInput {
                        messages: &p.messages,
                        tools: None,
                        add_generation_prompt: true,
                        kwargs: Some(kwargs),
                    })
                    .map_err(|e| err(e.to_string()))?;
                let tokens = tokenizer
                    .encode(&text, false)
                    .map_err(|e| err(e.to_string()))?;
                if tokens.is_empty() {
                    return Err(err("renders to no tokens".into()));
                }
                Ok(TokenizedPrompt {
                    id: p.id.clone(),
                    tokens,
                })
            })
            .collect()
    }
}
