//! Tool calls parsed out of a chat answer (`--tool-call-parser`), in the formats Qwen models are
//! trained to write, under SGLang's parser names.

/// The parsers `--tool-call-parser` accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolParserKind {
    /// Qwen2.5 / Qwen3 (SGLang `qwen25`; `hermes` is the same format):
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
    Qwen25,
    /// Qwen3-Coder (SGLang `qwen3_coder`): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n
    /// </parameter>\n</function>\n</tool_call>`.
    Qwen3Coder,
}

impl ToolParserKind {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "qwen25" | "qwen" | "hermes" => Some(Self::Qwen25),
            "qwen3_coder" => Some(Self::Qwen3Coder),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Qwen25 => "qwen25",
            Self::Qwen3Coder => "qwen3_coder",
        }
    }
}
