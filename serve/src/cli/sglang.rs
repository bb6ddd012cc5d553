//! Every SGLang 0.5.23 server flag, so any `python -m sglang.launch_server` line parses.
//!
//! The flags dflash-serve implements are clap arguments ([`super::Args`]); every other flag in
//! `sglang_0_5_23_flags.txt` is taken out of the command line before clap sees it, with its
//! values read as argparse reads them, and [`disposition`] says what becomes of it: most are
//! accepted with one start-up warning naming them (attention backends, CUDA-graph sizes,
//! watchdogs: nothing a user relies on changes here); the few whose behaviour a user would rely
//! on and we lack stop start-up naming the flag. A flag in neither list is clap's to refuse.

use std::collections::HashSet;
use std::sync::OnceLock;

/// The released flag list, one `NAME ARITY [ALIAS...]` a line.
const FLAGS_TXT: &str = include_str!("sglang_0_5_23_flags.txt");

/// How argparse reads a flag's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arity {
    /// `store_true`: no value.
    Flag,
    /// One value (`--x v` or `--x=v`).
    Value,
    /// `nargs="?"`: a value when the next word is not an option.
    Optional,
    /// `nargs="+"`/`"*"`: every following word up to the next option.
    Multi,
    /// `BooleanOptionalAction`: `--x` or `--no-x`.
    Negatable,
}

#[derive(Debug)]
pub struct FlagSpec {
    pub name: &'static str,
    pub arity: Arity,
    pub aliases: Vec<&'static str>,
}

/// One SGLang flag taken from the command line: its canonical name and the values given.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PassedFlag {
    pub name: String,
    pub values: Vec<String>,
    /// `--no-x` of a negatable flag.
    pub negated: bool,
}

impl PassedFlag {
    /// As a user would write it: `--attention-backend fa3`.
    pub fn display(&self) -> String {
        let name = if self.negated {
            format!("--no-{}", &self.name[2..])
        } else {
            self.name.clone()
        };
        std::iter::once(name)
            .chain(self.values.iter().cloned())
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// What dflash-serve does with an SGLang flag it has no clap argument for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Accepted; named in the start-up warning.
    Warn,
    /// Refused: the reason and what to do instead.
    Refuse(&'static str),
    /// Accepted (with the warning) when every value is one of these, else refused.
    OnlyValues(&'static [&'static str], &'static str),
}

/// The short list of SGLang flags whose behaviour a user would rely on and dflash-serve lacks;
/// everything else is warned about. The README's flag table lists the same ones.
pub fn disposition(name: &str) -> Disposition {
    use Disposition::*;
    const ONE: &[&str] = &["1"];
    const ONE_DEVICE: &str = "dflash-serve runs on one device, so only 1 is allowed";
    match name {
        "--enable-lora" | "--lora-paths" => Refuse("LoRA adapters are not supported"),
        "--is-embedding" => Refuse("embedding models are not served (generation only)"),
        "--skip-tokenizer-init" => {
            Refuse("the server always tokenizes and detokenizes (text in and out)")
        }
        "--ssl-certfile" | "--ssl-keyfile" | "--ssl-ca-certs" | "--ssl-keyfile-password" => {
            Refuse("TLS is not built in; terminate TLS in a reverse proxy")
        }
        "--admin-api-key" => Refuse(
            "there is no separate admin key; --api-key guards every route but /health and /metrics",
        ),
        "--config" => Refuse("YAML config files are not read; pass the flags on the command line"),
        "--json-model-override-args" => {
            Refuse("overriding the model's config.json is not supported")
        }
        "--nnodes" => OnlyValues(ONE, "dflash-serve runs on one node, so only 1 is allowed"),
        "--node-rank" => OnlyValues(
            &["0"],
            "dflash-serve runs on one node, so only 0 is allowed",
        ),
        "--ep-size" | "--dcp-size" | "--attn-dp-size" | "--attn-cp-size" | "--moe-dp-size" => {
            OnlyValues(ONE, ONE_DEVICE)
        }
        "--base-gpu-id" => OnlyValues(&["0"], "pick the GPU with --device cuda:N instead"),
        "--disaggregation-mode" => {
            OnlyValues(&["null"], "prefill/decode disaggregation is not supported")
        }
        "--load-format" => OnlyValues(
            &["auto", "safetensors"],
            "only safetensors checkpoints are loaded",
        ),
        "--revision" => OnlyValues(
            &["main"],
            "only the default revision is resolved; download the revision and pass its directory",
        ),
        _ => Warn,
    }
}

fn parse_arity(word: &str) -> Arity {
    match word {
        "flag" => Arity::Flag,
        "optional" => Arity::Optional,
        "multi" => Arity::Multi,
        "negatable" => Arity::Negatable,
        _ => Arity::Value,
    }
}

/// The flag list, parsed once.
pub fn flags() -> &'static [FlagSpec] {
    static FLAGS: OnceLock<Vec<FlagSpec>> = OnceLock::new();
    FLAGS.get_or_init(|| {
        FLAGS_TXT
            .lines()
            .filter(|l| l.starts_with("--"))
            .map(|l| {
                let mut words = l.split_whitespace();
                let name = words.next().unwrap_or_default();
                let arity = parse_arity(words.next().unwrap_or_default());
                FlagSpec {
                    name,
                    arity,
                    aliases: words.collect(),
                }
            })
            .collect()
    })
}

/// The flag `word` names (`--x`, an alias, `--no-x` of a negatable one), with `negated`.
fn lookup(word: &str) -> Option<(&'static FlagSpec, bool)> {
    let all = flags();
    if let Some(f) = all
        .iter()
        .find(|f| f.name == word || f.aliases.contains(&word))
    {
        return Some((f, false));
    }
    let positive = format!("--{}", word.strip_prefix("--no-")?);
    all.iter()
        .find(|f| f.arity == Arity::Negatable && f.name == positive)
        .map(|f| (f, true))
}

/// An argparse-style unique prefix of one listed flag (`--disable-radix`), when no clap
/// argument also starts with it (clap infers its own prefixes).
fn lookup_prefix(word: &str, clap_names: &HashSet<String>) -> Option<&'static FlagSpec> {
    if word.len() < 4 || clap_names.iter().any(|n| n.starts_with(word)) {
        return None;
    }
    let mut hits = flags()
        .iter()
        .filter(|f| f.name.starts_with(word) || f.aliases.iter().any(|a| a.starts_with(word)));
    let first = hits.next()?;
    hits.next().is_none().then_some(first)
}

/// argparse treats a word as an option when it starts with `-` and is not a negative number.
fn is_option(word: &str) -> bool {
    word.starts_with('-') && word.len() > 1 && word.parse::<f64>().is_err()
}

/// Splits `argv` (program name first) into what clap parses and the SGLang flags it has no
/// argument for. `clap_names` are the long names and aliases clap knows (`--model-path`).
pub fn split(argv: Vec<String>, clap_names: &HashSet<String>) -> (Vec<String>, Vec<PassedFlag>) {
    let mut keep = Vec::with_capacity(argv.len());
    let mut passed = Vec::new();
    let mut words = argv.into_iter().peekable();
    if let Some(program) = words.next() {
        keep.push(program);
    }
    while let Some(word) = words.next() {
        let (head, inline) = match word.split_once('=') {
            Some((h, v)) if h.starts_with("--") => (h.to_string(), Some(v.to_string())),
            _ => (word.clone(), None),
        };
        if !head.starts_with("--") || clap_names.contains(&head) {
            keep.push(word);
            continue;
        }
        let found = lookup(&head).or_else(|| lookup_prefix(&head, clap_names).map(|f| (f, false)));
        let Some((spec, negated)) = found else {
            keep.push(word);
            continue;
        };
        let mut flag = PassedFlag {
            name: spec.name.to_string(),
            values: Vec::new(),
            negated,
        };
        if let Some(v) = inline {
            flag.values.push(v);
        } else {
            match spec.arity {
                Arity::Flag | Arity::Negatable => {}
                Arity::Value => flag.values.extend(words.next()),
                Arity::Optional => {
                    if words.peek().is_some_and(|w| !is_option(w)) {
                        flag.values.extend(words.next());
                    }
                }
                Arity::Multi => {
                    while words.peek().is_some_and(|w| !is_option(w)) {
                        flag.values.extend(words.next());
                    }
                }
            }
        }
        passed.push(flag);
    }
    (keep, passed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> HashSet<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn argv(words: &[&str]) -> Vec<String> {
        std::iter::once("dflash-serve")
            .chain(words.iter().copied())
            .map(String::from)
            .collect()
    }

    #[test]
    fn the_list_holds_sglangs_flags_with_their_arities() {
        assert!(flags().len() > 500, "{}", flags().len());
        let get = |n: &str| lookup(n).map(|(f, _)| f.arity);
        assert_eq!(get("--watchdog-timeout"), Some(Arity::Value));
        assert_eq!(get("--enable-torch-compile"), Some(Arity::Flag));
        assert_eq!(get("--cuda-graph-bs-decode"), Some(Arity::Multi));
        assert_eq!(get("--model-checksum"), Some(Arity::Optional));
        assert_eq!(get("--expert-parallel-size"), Some(Arity::Value));
        assert_eq!(get("--not-an-sglang-flag"), None);
    }

    #[test]
    fn values_are_read_as_argparse_reads_them() {
        let clap = names(&["--model-path", "--port"]);
        let (keep, passed) = split(
            argv(&[
                "--model-path",
                "m",
                "--watchdog-timeout",
                "-1",
                "--cuda-graph-bs-decode",
                "1",
                "2",
                "4",
                "--port",
                "1",
                "--model-checksum",
                "--attention-backend=fa3",
                "--enable-torch-compile",
                "--no-enable-tf32-matmul",
                "--disable-radix",
            ]),
            &clap,
        );
        assert_eq!(keep, argv(&["--model-path", "m", "--port", "1"]));
        let shown: Vec<String> = passed.iter().map(PassedFlag::display).collect();
        assert_eq!(
            shown,
            [
                "--watchdog-timeout -1",
                "--cuda-graph-bs-decode 1 2 4",
                "--model-checksum",
                "--attention-backend fa3",
                "--enable-torch-compile",
                "--no-enable-tf32-matmul",
                "--disable-radix-cache",
            ]
        );
    }

    #[test]
    fn unknown_words_and_clap_prefixes_are_left_to_clap() {
        let clap = names(&["--speculative-algorithm"]);
        let (keep, passed) = split(argv(&["--speculative-algo", "X", "--bogus"]), &clap);
        assert_eq!(keep, argv(&["--speculative-algo", "X", "--bogus"]));
        assert!(passed.is_empty());
    }

    #[test]
    fn the_refused_list_is_short_and_value_checks_pass_the_defaults() {
        let refused = flags()
            .iter()
            .filter(|f| matches!(disposition(f.name), Disposition::Refuse(_)))
            .count();
        assert!(refused <= 12, "{refused}");
        assert_eq!(disposition("--trust-remote-code"), Disposition::Warn);
        assert!(matches!(
            disposition("--nnodes"),
            Disposition::OnlyValues(&["1"], _)
        ));
    }
}
