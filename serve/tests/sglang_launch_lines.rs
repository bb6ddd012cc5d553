//! Published SGLang launch lines parse unchanged: z-lab's DFlash README and model cards, and
//! SGLang's speculative-decoding docs (the DFlash section and the EAGLE / MTP examples beside
//! it, 0.5.23's `docs_new/docs/advanced_features/speculative_decoding.mdx`). Every flag in them
//! is either one dflash-serve acts on or one accepted with the start-up warning; the DFLASH
//! lines also resolve to a serving configuration.

use dflash_serve::cli::Args;
use dflash_serve::config::{ConfigError, ServeConfig, SpecAlgorithm};

/// (where it is published, the flags after `python -m sglang.launch_server`).
const DFLASH_LINES: &[(&str, &str)] = &[
    (
        "z-lab/dflash README, SGLang quick start",
        "--model-path Qwen/Qwen3.5-35B-A3B --speculative-algorithm DFLASH \
         --speculative-draft-model-path z-lab/Qwen3.5-35B-A3B-DFlash \
         --speculative-num-draft-tokens 16 --tp-size 1 --attention-backend trtllm_mha \
         --speculative-draft-attention-backend fa4 --mem-fraction-static 0.75 \
         --mamba-scheduler-strategy extra_buffer --trust-remote-code",
    ),
    (
        "z-lab/dflash README, first SGLang release",
        "--model-path Qwen/Qwen3-Coder-30B-A3B-Instruct --speculative-algorithm DFLASH \
         --speculative-draft-model-path z-lab/Qwen3-Coder-30B-A3B-DFlash --tp-size 1 \
         --dtype bfloat16 --attention-backend fa3 --mem-fraction-static 0.75 --trust-remote-code",
    ),
    (
        "z-lab model cards (Qwen3.5-27B-DFlash, Qwen3-Coder-Next-DFlash) with the window tip",
        "--model-path Qwen/Qwen3.5-27B --speculative-algorithm DFLASH \
         --speculative-draft-model-path z-lab/Qwen3.5-27B-DFlash --speculative-num-draft-tokens 16 \
         --tp-size 1 --attention-backend fa3 --mem-fraction-static 0.75 \
         --mamba-scheduler-strategy extra_buffer --trust-remote-code \
         --speculative-dflash-draft-window-size 4096",
    ),
    (
        "SGLang docs, DFlash decoding",
        "--model meta-llama/Llama-3.1-8B-Instruct --speculative-algorithm DFLASH \
         --speculative-draft-model-path z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
    ),
    (
        "SGLang docs, DFlash parameters",
        "--model-path Qwen/Qwen3-8B --speculative-algorithm DFLASH \
         --speculative-draft-model-path z-lab/Qwen3-8B-DFlash-b16 --speculative-dflash-block-size 16 \
         --speculative-num-draft-tokens 16 --speculative-dflash-draft-window-size 2048",
    ),
];

/// The EAGLE / MTP examples of the same docs page: every flag parses, and the algorithm is
/// refused by name (dflash-serve implements DFLASH and NEXTN).
const EAGLE_LINES: &[(&str, &str)] = &[
    (
        "SGLang docs, EAGLE-2",
        "--model meta-llama/Llama-2-7b-chat-hf --speculative-algorithm EAGLE \
         --speculative-draft-model-path lmsys/sglang-EAGLE-llama2-chat-7B --speculative-num-steps 3 \
         --speculative-eagle-topk 4 --speculative-num-draft-tokens 16 --mem-fraction-static 0.7 \
         --cuda-graph-max-bs-decode 8 --log-level warning",
    ),
    (
        "SGLang docs, EAGLE-2 with torch.compile",
        "--model meta-llama/Llama-2-7b-chat-hf --speculative-algorithm EAGLE \
         --speculative-draft-model-path lmsys/sglang-EAGLE-llama2-chat-7B --speculative-num-steps 3 \
         --speculative-eagle-topk 4 --speculative-num-draft-tokens 16 --mem-fraction-static 0.7 \
         --enable-torch-compile --torch-compile-max-bs 8 --log-level warning",
    ),
    (
        "SGLang docs, FR-Spec (and older docs' --cuda-graph-max-bs)",
        "--model meta-llama/Meta-Llama-3-8B-Instruct --speculative-algorithm EAGLE \
         --speculative-draft-model-path lmsys/sglang-EAGLE-LLaMA3-Instruct-8B \
         --speculative-num-steps 3 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16 \
         --speculative-token-map thunlp/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt \
         --mem-fraction-static 0.7 --cuda-graph-max-bs 8 --dtype float16 --log-level warning",
    ),
    (
        "SGLang docs, MTP",
        "--model XiaomiMiMo/MiMo-7B-RL --host 0.0.0.0 --trust-remote-code \
         --speculative-algorithm EAGLE --speculative-num-steps 1 --speculative-eagle-topk 1 \
         --speculative-num-draft-tokens 2 --mem-fraction-static 0.7 --cuda-graph-max-bs-decode 8 \
         --log-level warning",
    ),
];

fn args(line: &str) -> Args {
    let argv = std::iter::once("dflash-serve").chain(line.split_whitespace());
    Args::try_parse_sglang_from(argv).unwrap_or_else(|e| panic!("{line}:\n{e}"))
}

#[test]
fn zlab_and_sglang_dflash_launch_lines_parse_and_resolve() {
    for (source, line) in DFLASH_LINES {
        let config =
            ServeConfig::from_args(&args(line)).unwrap_or_else(|e| panic!("{source}: {e}\n{line}"));
        let spec = config.speculative.expect("speculative");
        assert_eq!(spec.algorithm, SpecAlgorithm::DFlash, "{source}");
        // The flags without an effect here are the warned ones, named as written.
        for warned in &config.ignored_sglang_flags {
            let name = warned.split(' ').next().unwrap_or_default();
            assert!(line.contains(name), "{source}: {warned}");
        }
    }
    let first = ServeConfig::from_args(&args(DFLASH_LINES[0].1)).expect("config");
    assert_eq!(
        first.ignored_sglang_flags,
        [
            "--attention-backend trtllm_mha",
            "--speculative-draft-attention-backend fa4",
            "--mamba-scheduler-strategy extra_buffer",
            "--trust-remote-code",
        ]
    );
    assert_eq!(first.mem_fraction_static, Some(0.75));
}

#[test]
fn sglang_eagle_and_mtp_launch_lines_parse_and_the_algorithm_is_refused_by_name() {
    for (source, line) in EAGLE_LINES {
        match ServeConfig::from_args(&args(line)) {
            Err(ConfigError::BadValue { flag, .. }) => {
                assert_eq!(flag, "--speculative-algorithm", "{source}")
            }
            other => panic!("{source}: expected the algorithm refused, got {other:?}"),
        }
    }
}

/// The flags clap does not own (those it owns have typed values, checked in cli_config.rs)
/// are set aside with their values, whatever they are.
#[test]
fn every_other_listed_sglang_flag_parses_with_a_value_of_its_arity() {
    use clap::CommandFactory;
    use dflash_serve::cli::sglang::{flags, Arity};
    let clap_names: Vec<String> = Args::command()
        .get_arguments()
        .flat_map(|a| {
            a.get_long()
                .into_iter()
                .chain(a.get_all_aliases().unwrap_or_default())
                .map(|n| format!("--{n}"))
        })
        .collect();
    let mut set_aside = 0;
    for f in flags()
        .iter()
        .filter(|f| !clap_names.iter().any(|n| n == f.name))
    {
        let mut argv = vec!["dflash-serve".to_string(), f.name.to_string()];
        match f.arity {
            Arity::Value | Arity::Multi => argv.push("1".into()),
            Arity::Flag | Arity::Optional | Arity::Negatable => {}
        }
        let parsed =
            Args::try_parse_sglang_from(argv.clone()).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
        assert_eq!(parsed.sglang_flags.len(), 1, "{argv:?}");
        assert_eq!(parsed.sglang_flags[0].name, f.name);
        set_aside += 1;
    }
    assert!(set_aside > 450, "{set_aside}");
}

#[test]
fn page_size_is_kept_for_the_paged_pool_and_defaults_to_64() {
    let c = ServeConfig::from_args(&args("--page-size 16")).expect("config");
    assert_eq!(c.page_size, 16);
    let c = ServeConfig::from_args(&args("")).expect("config");
    assert_eq!(c.page_size, 64);
    assert!(ServeConfig::from_args(&args("--page-size 0")).is_err());
}

#[test]
fn flags_a_user_relies_on_are_refused_naming_the_flag() {
    for (line, flag) in [
        ("--enable-lora", "--enable-lora"),
        ("--lora-paths a=b c=d", "--lora-paths"),
        ("--ssl-certfile cert.pem", "--ssl-certfile"),
        ("--nnodes 2", "--nnodes"),
        ("--ep-size 8", "--ep-size"),
        ("--disaggregation-mode prefill", "--disaggregation-mode"),
        ("--config serve.yaml", "--config"),
        ("--expert-parallel-size 2", "--ep-size"),
    ] {
        let err = ServeConfig::from_args(&args(line)).expect_err(line);
        assert!(
            err.to_string()
                .starts_with(&format!("{flag} is not supported by dflash-serve: ")),
            "{line}: {err}"
        );
    }
    // Their defaults are harmless and pass with the warning.
    let c = ServeConfig::from_args(&args("--nnodes 1 --disaggregation-mode null")).expect("ok");
    assert_eq!(
        c.ignored_sglang_flags,
        ["--nnodes 1", "--disaggregation-mode null"]
    );
}

#[test]
fn log_level_takes_sglangs_names() {
    for level in ["warning", "WARNING", "error", "critical", "info", "debug"] {
        ServeConfig::from_args(&args(&format!("--log-level {level}"))).expect(level);
    }
    let err = ServeConfig::from_args(&args("--log-level loud")).expect_err("refused");
    assert!(err.to_string().starts_with("--log-level loud:"), "{err}");
}

#[test]
fn tool_call_parsers_take_sglangs_names() {
    use dflash_serve::generation::ToolParserKind;
    for (name, kind) in [
        ("qwen25", ToolParserKind::Qwen25),
        ("hermes", ToolParserKind::Qwen25),
        ("qwen3_coder", ToolParserKind::Qwen3Coder),
    ] {
        let c = ServeConfig::from_args(&args(&format!("--tool-call-parser {name}"))).expect(name);
        assert_eq!(c.tool_call_parser, Some(kind));
    }
    let err = ServeConfig::from_args(&args("--tool-call-parser llama3")).expect_err("refused");
    assert!(
        err.to_string().starts_with("--tool-call-parser llama3:"),
        "{err}"
    );
}

/// The README's flag table names every flag refused by name (the list is meant to stay short
/// and documented).
#[test]
fn the_readme_table_names_every_refused_flag() {
    use dflash_serve::cli::sglang::{disposition, flags, Disposition};
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("README.md");
    for f in flags() {
        if !matches!(disposition(f.name), Disposition::Warn) {
            assert!(
                readme.contains(&format!("`{}`", f.name)),
                "README.md does not name {}",
                f.name
            );
        }
    }
}
