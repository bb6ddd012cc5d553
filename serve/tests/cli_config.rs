//! The command line: SGLang spellings, old aliases, argparse-style prefixes, typed settings, and
//! refusals that name the flag.

use clap::Parser;
use dflash_serve::cli::Args;
use dflash_serve::config::{
    ConfigError, DType, DeviceSpec, DraftSource, ServeConfig, SpecAlgorithm, VerifyMode,
};

fn config(argv: &[&str]) -> Result<ServeConfig, ConfigError> {
    let mut full = vec!["dflash-serve"];
    full.extend_from_slice(argv);
    let args = Args::try_parse_sglang_from(full).unwrap_or_else(|e| panic!("{e}"));
    ServeConfig::from_args(&args)
}

#[test]
fn no_arguments_serve_the_bundled_demo_on_cpu() {
    let c = config(&[]).expect("defaults");
    assert!(
        c.model_path.ends_with("assets/tiny-coder-demo"),
        "{}",
        c.model_path
    );
    assert_eq!((c.host.as_str(), c.port), ("127.0.0.1", 30000));
    assert_eq!(c.device, DeviceSpec::Cpu);
    assert_eq!(c.dtype, DType::Auto);
    assert_eq!(c.served_model_name, "tiny-coder-demo");
    // The demo pair: the bundled drafter speculates unless told not to.
    let spec = c.speculative.expect("the bundled demo drafter is used");
    assert!(
        matches!(&spec.draft, DraftSource::Path(p) if p.ends_with("tiny-coder-demo-dflash")),
        "{:?}",
        spec.draft
    );
    let plain = config(&["--speculative-algorithm", "NONE"]).expect("plain");
    assert!(plain.speculative.is_none());
}

#[test]
fn dflash_is_case_insensitive_and_defaults_max_running_to_48() {
    let c = config(&[
        "--model-path",
        "Qwen/Qwen3-8B",
        "--speculative-algorithm",
        "dflash",
        "--drafter",
        "z-lab",
    ])
    .expect("ok");
    let spec = c.speculative.expect("speculative");
    assert_eq!(
        spec.draft,
        DraftSource::ZLab {
            repo: "z-lab/Qwen3-8B-DFlash-b16".into()
        }
    );
    assert_eq!(spec.verify, VerifyMode::DDTree { budget: 32 });
    assert_eq!(c.max_running_requests, 48);
}

#[test]
fn zlab_drafter_for_qwen3_5_and_qwen3_6_targets_has_no_block_suffix() {
    for (target, drafter) in [
        ("Qwen/Qwen3.6-27B", "z-lab/Qwen3.6-27B-DFlash"),
        ("Qwen/Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash"),
        ("Qwen/Qwen3.6-35B-A3B", "z-lab/Qwen3.6-35B-A3B-DFlash"),
        ("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16"),
    ] {
        let c = config(&[
            "--model-path",
            target,
            "--speculative-algorithm",
            "dflash",
            "--drafter",
            "z-lab",
        ])
        .expect("ok");
        assert_eq!(
            c.speculative.expect("speculative").draft,
            DraftSource::ZLab {
                repo: drafter.into()
            },
            "{target}"
        );
    }
}

#[test]
fn zlab_drafter_for_the_qwen3_coder_moe_target_is_its_one_published_drafter() {
    for target in [
        "Qwen/Qwen3-Coder-30B-A3B-Instruct",
        "Qwen/Qwen3-Coder-30B-A3B",
    ] {
        let c = config(&[
            "--model-path",
            target,
            "--speculative-algorithm",
            "dflash",
            "--drafter",
            "z-lab",
        ])
        .expect("ok");
        assert_eq!(
            c.speculative.expect("speculative").draft,
            DraftSource::ZLab {
                repo: "z-lab/Qwen3-Coder-30B-A3B-DFlash".into()
            },
            "{target}"
        );
    }
}

#[test]
fn old_spellings_and_unique_prefixes_are_accepted() {
    let c = config(&[
        "--model",
        "Qwen/Qwen3-8B",
        "--speculative-algo",
        "DFLASH",
        "--speculative-draft",
        "z-lab/Qwen3-8B-DFlash-b16",
        "--speculative-verify",
        "chain",
        "--cuda-graph-max-bs",
        "8",
        "--tp",
        "1",
        "--dtype",
        "half",
    ])
    .expect("ok");
    assert_eq!(c.dtype, DType::Float16);
    let spec = c.speculative.expect("speculative");
    assert_eq!(
        spec.draft,
        DraftSource::Path("z-lab/Qwen3-8B-DFlash-b16".into())
    );
    assert_eq!(spec.verify, VerifyMode::Chain);
}

#[test]
fn other_speculative_algorithms_are_refused_by_name() {
    let err = config(&["--speculative-algorithm", "EAGLE3"]).expect_err("refused");
    assert!(
        err.to_string()
            .starts_with("--speculative-algorithm EAGLE3: dflash-serve implements DFLASH"),
        "{err}"
    );
}

#[test]
fn nextn_and_mtp_use_the_target_head_chain_verified_unless_topk_asks_for_a_tree() {
    const Q: [&str; 2] = ["--model-path", "Qwen/Qwen3.6-27B"];
    let c = config(&[&Q[..], &["--speculative-algorithm", "NEXTN"]].concat()).expect("ok");
    let spec = c.speculative.expect("speculative");
    assert_eq!(spec.algorithm, SpecAlgorithm::NextN);
    assert_eq!(spec.draft, DraftSource::TargetMtp);
    assert_eq!(
        (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens),
        (3, 1, Some(4))
    );
    assert_eq!(spec.verify, VerifyMode::Chain);
    assert_eq!(c.max_running_requests, 48);
    // SGLang's launch line; a num-draft-tokens that disagrees with a chain is adjusted (warned).
    for extra in [&["--speculative-num-draft-tokens", "5"][..], &[][..]] {
        let argv = [
            &Q[..],
            &[
                "--speculative-algorithm",
                "mtp",
                "--speculative-num-steps",
                "4",
            ],
            extra,
        ]
        .concat();
        let spec = config(&argv).expect("ok").speculative.expect("spec");
        assert_eq!((spec.num_steps, spec.num_draft_tokens), (4, Some(5)));
        assert_eq!(spec.verify, VerifyMode::Chain);
    }
    // topk > 1: a tree of num-draft-tokens - 1 nodes, or --speculative-ddtree-budget nodes.
    let tree = |extra: &[&str]| {
        let argv = [
            &Q[..],
            &[
                "--speculative-algorithm",
                "NEXTN",
                "--speculative-eagle-topk",
                "4",
            ],
            extra,
        ]
        .concat();
        config(&argv).expect("ok").speculative.expect("spec")
    };
    let t = tree(&["--speculative-num-draft-tokens", "8"]);
    assert_eq!(t.verify, VerifyMode::DDTree { budget: 7 });
    assert_eq!(t.num_draft_tokens, Some(8));
    assert_eq!(tree(&[]).verify, VerifyMode::DDTree { budget: 32 });
    // --speculative-verify ddtree with topk 1 asks for a tree too.
    let argv = [
        &Q[..],
        &[
            "--speculative-algorithm",
            "NEXTN",
            "--speculative-verify",
            "ddtree",
        ],
        &["--speculative-ddtree-budget", "16"],
    ]
    .concat();
    let spec = config(&argv).expect("ok").speculative.expect("spec");
    assert_eq!(spec.verify, VerifyMode::DDTree { budget: 16 });
    // DFLASH still defaults to DDTree.
    let d = config(&["--speculative-draft-model-path", "d"]).expect("ok");
    let d = d.speculative.expect("spec");
    assert_eq!(d.algorithm, SpecAlgorithm::DFlash);
    assert_eq!(d.verify, VerifyMode::DDTree { budget: 32 });
}

#[test]
fn nextn_flag_combinations_that_cannot_work_are_refused_by_flag() {
    let cases: [(&[&str], &str); 7] = [
        (&["--drafter", "z-lab"], "--drafter z-lab: NEXTN drafts with the MTP head inside the target checkpoint"),
        (&["--speculative-draft-model-path", "z-lab/Qwen3.6-27B-DFlash"], "--speculative-draft-model-path z-lab/Qwen3.6-27B-DFlash: NEXTN drafts with the MTP head"),
        (&["--speculative-dflash-block-size", "16"], "--speculative-dflash-block-size 16: is for DFLASH only"),
        (&["--speculative-num-steps", "0"], "--speculative-num-steps 0: NEXTN needs at least 1 draft step"),
        (&["--speculative-eagle-topk", "0"], "--speculative-eagle-topk 0: must be at least 1"),
        (&["--speculative-eagle-topk", "2", "--speculative-verify", "chain"], "--speculative-verify chain: verifies a single path, but --speculative-eagle-topk 2 asks for a tree"),
        (&["--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "1"], "--speculative-num-draft-tokens 1: a NEXTN tree needs at least 2 tokens"),
    ];
    for (extra, want) in cases {
        let argv = [
            &[
                "--model-path",
                "Qwen/Qwen3.6-27B",
                "--speculative-algorithm",
                "NEXTN",
            ][..],
            extra,
        ]
        .concat();
        let err = config(&argv).expect_err("refused").to_string();
        assert!(err.starts_with(want), "{extra:?}: {err}");
    }
    // Naming the target itself as the draft model is SGLang's NEXTN spelling and is fine.
    config(&[
        "--model-path",
        "Qwen/Qwen3.6-27B",
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-draft-model-path",
        "Qwen/Qwen3.6-27B",
    ])
    .expect("ok");
}

#[test]
fn dflash_without_a_drafter_is_refused() {
    let err = config(&[
        "--model-path",
        "Qwen/Qwen3-8B",
        "--speculative-algorithm",
        "DFLASH",
    ])
    .expect_err("refused");
    assert!(err.to_string().contains("needs a drafter"), "{err}");
}

#[test]
fn block_size_aliases_must_agree() {
    let err = config(&[
        "--speculative-draft-model-path",
        "d",
        "--speculative-num-draft-tokens",
        "16",
        "--speculative-dflash-block-size",
        "8",
    ])
    .expect_err("refused");
    assert!(
        err.to_string()
            .starts_with("--speculative-dflash-block-size 8: must equal"),
        "{err}"
    );
}

#[test]
fn multi_device_flags_are_refused_by_name() {
    let err = config(&["--tp-size", "2"]).expect_err("refused");
    assert!(
        err.to_string()
            .starts_with("--tp-size is not supported by dflash-serve"),
        "{err}"
    );
    let err = config(&["--quantization", "fp8"]).expect_err("refused");
    assert!(
        err.to_string()
            .starts_with("--quantization is not supported"),
        "{err}"
    );
}

#[test]
fn bad_device_names_the_flag() {
    let err = config(&["--device", "tpu"]).expect_err("refused");
    assert_eq!(
        err.to_string(),
        "--device tpu: expected auto, cpu, cuda or cuda:N"
    );
    assert_eq!(
        config(&["--device", "cuda:1"]).expect("ok").device,
        DeviceSpec::Cuda(1)
    );
}

/// `--device auto` (the default) is the CPU in a build without CUDA, where CI runs; with CUDA
/// it is device 0 when one opens (checked on the GPU machine, not here).
#[test]
fn the_default_device_is_auto_and_falls_back_to_the_cpu_without_cuda() {
    let default = config(&[]).expect("ok").device;
    let auto = config(&["--device", "auto"]).expect("ok").device;
    assert_eq!(default, auto);
    if !candle_core::utils::cuda_is_available() {
        assert_eq!(auto, DeviceSpec::Cpu);
    }
}

#[test]
fn unknown_flags_and_bad_enum_values_stop_clap() {
    assert!(Args::try_parse_sglang_from(["dflash-serve", "--enable-loraa"]).is_err());
    assert!(Args::try_parse_sglang_from(["dflash-serve", "--not-an-sglang-flag"]).is_err());
    let err = Args::try_parse_from(["dflash-serve", "--dtype", "int4"]).expect_err("refused");
    assert!(err.to_string().contains("--dtype"), "{err}");
}

#[test]
fn default_chat_template_kwargs_must_be_a_json_object() {
    let err = config(&["--default-chat-template-kwargs", "[1]"]).expect_err("refused");
    assert!(
        err.to_string()
            .starts_with("--default-chat-template-kwargs [1]: expected a JSON object"),
        "{err}"
    );
    let c = config(&[
        "--default-chat-template-kwargs",
        r#"{"enable_thinking": false}"#,
    ])
    .expect("ok");
    assert_eq!(
        c.default_chat_template_kwargs.get("enable_thinking"),
        Some(&serde_json::json!(false))
    );
}

#[test]
fn chunked_prefill_size_takes_sglangs_values() {
    assert_eq!(config(&[]).expect("ok").chunked_prefill_size, None);
    assert_eq!(
        config(&["--chunked-prefill-size", "512"])
            .expect("ok")
            .chunked_prefill_size,
        Some(Some(512))
    );
    assert_eq!(
        config(&["--chunked-prefill-size", "-1"])
            .expect("ok")
            .chunked_prefill_size,
        Some(None),
        "-1 prefills prompts whole"
    );
    let err = config(&["--chunked-prefill-size", "0"]).expect_err("refused");
    assert!(
        err.to_string().starts_with("--chunked-prefill-size 0:"),
        "{err}"
    );
}

#[test]
fn mixed_step_budget_defaults_to_two_decode_steps_and_0_keeps_fixed_pieces() {
    let budget = |argv: &[&str]| config(argv).map(|c| c.mixed_step_budget);
    assert_eq!(budget(&[]), Ok(Some(2.0)));
    assert_eq!(budget(&["--mixed-step-budget", "2.5"]), Ok(Some(2.5)));
    assert_eq!(
        budget(&["--mixed-step-budget", "0"]),
        Ok(None),
        "the fixed pieces"
    );
    for bad in ["1", "0.5", "-1", "inf"] {
        let err = config(&["--mixed-step-budget", bad]).expect_err("refused");
        assert!(
            err.to_string().starts_with("--mixed-step-budget"),
            "{bad}: {err}"
        );
    }
    // The piece bound keeps working beside it.
    let c = config(&["--prefill-tokens-while-decoding", "64"]).expect("ok");
    assert_eq!(
        (c.prefill_tokens_while_decoding, c.mixed_step_budget),
        (Some(64), Some(2.0))
    );
}

#[test]
fn mem_fraction_static_must_be_a_fraction() {
    assert_eq!(
        config(&["--mem-fraction-static", "0.8"])
            .expect("ok")
            .mem_fraction_static,
        Some(0.8)
    );
    let err = config(&["--mem-fraction-static", "1.5"]).expect_err("refused");
    assert!(err.to_string().contains("--mem-fraction-static"), "{err}");
}
