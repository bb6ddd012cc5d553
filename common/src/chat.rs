//! Chat templates rendered the way `transformers`' `apply_chat_template` renders them.
//!
//! HF runs templates in a sandboxed Jinja2 environment with `trim_blocks` and `lstrip_blocks`
//! on, the `loopcontrols` extension, a `raise_exception` global and a `tojson` filter that is
//! `json.dumps(..., ensure_ascii=False)` (not Jinja's HTML-escaping one). minijinja plus
//! minijinja-contrib's pycompat layer (Python string/dict methods such as `.strip()`,
//! `.split()`, `.items()`) reproduces that environment; the differences that matter are
//! re-implemented here. Template variables: `messages`, `tools`, `add_generation_prompt`,
//! `bos_token`, `eos_token`, plus any `chat_template_kwargs` (e.g. `enable_thinking`), which HF
//! passes as extra template variables, so an unset kwarg is *undefined*, not false.

use std::path::{Path, PathBuf};

use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::{Map, Value as Json};

use crate::tokenizer::{ChatTemplateField, TokenizerConfig};

const TEMPLATE_NAME: &str = "chat_template";

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("the model has no chat template (no `chat_template` in tokenizer_config.json and no chat_template.jinja); pass one with --chat-template FILE")]
    Missing,
    #[error("tokenizer_config.json has no chat template named `{name}`; it has: {available}")]
    UnknownName { name: String, available: String },
    #[error("cannot read chat template {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("chat template does not compile: {message}")]
    Syntax { message: String },
    /// The template itself called `raise_exception(...)`, e.g. for an unsupported role.
    #[error("{message}")]
    Raised { message: String },
    #[error("chat template failed to render: {message}")]
    Render { message: String },
}

/// A compiled chat template with the tokenizer's special tokens.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

/// What one render takes. `messages` and `tools` stay JSON so that fields the template reads
/// (`reasoning_content`, `tool_calls`, `name`) pass through untouched.
#[derive(Debug, Clone, Default)]
pub struct ChatRenderInput<'a> {
    pub messages: &'a [Json],
    pub tools: Option<&'a [Json]>,
    pub add_generation_prompt: bool,
    /// `chat_template_kwargs`, e.g. `{"enable_thinking": false}`.
    pub kwargs: Option<&'a Map<String, Json>>,
}

const RAISED_PREFIX: &str = "raise_exception: ";

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED_PREFIX}{message}"),
    ))
}

impl ChatTemplate {
    /// Compiles `source` with HF's Jinja settings.
    pub fn new(
        source: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| TemplateError::Syntax {
                message: describe(&e),
            })?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The template a model ships: `chat_template` in `tokenizer_config.json` (a string, or the
    /// entry called `name` — `default` when not given — of a list of named templates), else
    /// `chat_template.jinja` in the model folder (newer `transformers` saves it there).
    pub fn from_model(
        dir: &Path,
        config: &TokenizerConfig,
        name: Option<&str>,
    ) -> Result<Self, TemplateError> {
        let source = match &config.chat_template {
            Some(ChatTemplateField::Single(s)) => s.clone(),
            Some(ChatTemplateField::Named(list)) => pick_named(list, name)?,
            None => {
                let path = dir.join("chat_template.jinja");
                if !path.exists() {
                    return Err(TemplateError::Missing);
                }
                read_file(&path)?
            }
        };
        Self::new(source, config.bos_token(), config.eos_token())
    }

    /// A template from a file (`--chat-template FILE`), with the tokenizer's special tokens.
    pub fn from_file(path: &Path, config: &TokenizerConfig) -> Result<Self, TemplateError> {
        Self::new(read_file(path)?, config.bos_token(), config.eos_token())
    }

    pub fn render(&self, input: &ChatRenderInput<'_>) -> Result<String, TemplateError> {
        let mut ctx: Map<String, Json> = input.kwargs.cloned().unwrap_or_default();
        ctx.insert("messages".into(), Json::Array(input.messages.to_vec()));
        ctx.insert(
            "tools".into(),
            input
                .tools
                .map(|t| Json::Array(t.to_vec()))
                .unwrap_or(Json::Null),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(input.add_generation_prompt),
        );
        ctx.insert(
            "bos_token".into(),
            Json::String(self.bos_token.clone().unwrap_or_default()),
        );
        ctx.insert(
            "eos_token".into(),
            Json::String(self.eos_token.clone().unwrap_or_default()),
        );
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TemplateError::Render {
                message: describe(&e),
            })?;
        template.render(Value::from_serialize(&ctx)).map_err(|e| {
            let text = e.detail().unwrap_or_default();
            match text.strip_prefix(RAISED_PREFIX) {
                Some(message) => TemplateError::Raised {
                    message: message.to_string(),
                },
                None => TemplateError::Render {
                    message: describe(&e),
                },
            }
        })
    }
}

fn pick_named(
    list: &[crate::tokenizer::NamedTemplate],
    name: Option<&str>,
) -> Result<String, TemplateError> {
    let wanted = name.unwrap_or("default");
    if let Some(t) = list.iter().find(|t| t.name == wanted) {
        return Ok(t.template.clone());
    }
    match (name, list.first()) {
        (None, Some(first)) => Ok(first.template.clone()),
        _ => Err(TemplateError::UnknownName {
            name: wanted.to_string(),
            available: list
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

fn read_file(path: &Path) -> Result<String, TemplateError> {
    std::fs::read_to_string(path).map_err(|source| TemplateError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn describe(e: &Error) -> String {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

/// HF's `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
/// sort_keys=sort_keys)`. Python's default separators are `", "` and `": "` (`","` between
/// items when indenting), which templates that embed tool schemas depend on byte for byte.
fn tojson(value: &Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value).map_err(|e| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: value is not JSON-serializable: {e}"),
        )
    })?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair (item_separator, key_separator)",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let style = PyJson {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

struct PyJson {
    indent: Option<usize>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl PyJson {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    }

    fn write(&self, v: &Json, level: usize, out: &mut String) {
        match v {
            Json::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            Json::Object(map) if !map.is_empty() => {
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    out.push_str(&Json::String(k.clone()).to_string());
                    out.push_str(&self.key_sep);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
            Json::Array(_) => out.push_str("[]"),
            Json::Object(_) => out.push_str("{}"),
            Json::Bool(true) => out.push_str("true"),
            Json::Bool(false) => out.push_str("false"),
            Json::Null => out.push_str("null"),
            other => out.push_str(&other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests;
