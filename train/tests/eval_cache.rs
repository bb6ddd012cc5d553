//! The offline evaluation cache on disk: reused when target, prompts and settings match,
//! refused with what changed when they do not, and prompts that do not fit are refused by id.

mod eval_support;

use std::path::Path;

use candle_core::DType;
use dflash_models::speculative::OracleProposer;
use dflash_train::eval::drafters::demo_target_dir;
use dflash_train::eval::{
    replay_cache, CacheError, CacheStatus, EvalCache, EvalError, TargetIdentity, Verify,
};
use eval_support::*;

fn build(
    dir: &Path,
    spec: &dflash_train::eval::CacheSpec,
    rebuild: bool,
) -> (EvalCache, CacheStatus) {
    EvalCache::open_or_build(dir, &target(), spec, CONTEXT, rebuild).unwrap()
}

fn mismatch(err: EvalError) -> (&'static str, String) {
    let message = err.to_string();
    match err {
        EvalError::Cache(CacheError::Mismatch { what, .. }) => (what, message),
        other => panic!("expected a cache mismatch, got {other}"),
    }
}

#[test]
fn cache_round_trips_and_is_reused_when_nothing_changed() {
    let dir = scratch("reuse");
    let prompts = write_prompts(&dir, &PROMPTS[..2]);
    let spec = spec(&prompts, 12, vec![1, 2]);
    let cache_dir = dir.join("cache");
    let (built, status) = build(&cache_dir, &spec, false);
    assert_eq!(status, CacheStatus::Built);
    assert!(cache_dir.join("manifest.json").exists());
    let (loaded, status) = build(&cache_dir, &spec, false);
    assert_eq!(status, CacheStatus::Reused);
    assert_eq!(loaded.manifest, built.manifest);
    for (a, b) in loaded.prompts.iter().zip(&built.prompts) {
        assert_eq!(
            (&a.id, &a.tokens, a.prompt_len, a.generated),
            (&b.id, &b.tokens, b.prompt_len, b.generated)
        );
        assert_eq!(
            a.tokens.len(),
            a.prompt_len + 12,
            "the continuation runs to max_new_tokens"
        );
        let diff = (&a.features - &b.features)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
    }
    // --rebuild-cache builds again even though the cache matches.
    assert_eq!(build(&cache_dir, &spec, true).1, CacheStatus::Built);
}

#[test]
fn cache_refuses_another_prompt_set_target_dtype_or_longer_run() {
    let dir = scratch("refuse");
    let prompts = write_prompts(&dir, &PROMPTS[..2]);
    let spec = spec(&prompts, 12, vec![1, 2]);
    let cache_dir = dir.join("cache");
    build(&cache_dir, &spec, false);
    let t = target();

    let other_dir = scratch("refuse-other");
    let other = spec_for(&write_prompts(&other_dir, &PROMPTS[1..]));
    let (what, message) =
        mismatch(EvalCache::open_or_build(&cache_dir, &t, &other, CONTEXT, false).unwrap_err());
    assert_eq!(what, "prompt set");
    assert!(message.contains("--rebuild-cache"), "{message}");

    // Same weights, a config.json that differs in one value: another target.
    let model_copy = scratch("refuse-model");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(demo_target_dir().join(f), model_copy.join(f)).unwrap();
    }
    let config = std::fs::read_to_string(model_copy.join("config.json")).unwrap();
    std::fs::write(
        model_copy.join("config.json"),
        config.replace("\"initializer_range\": 0.02", "\"initializer_range\": 0.03"),
    )
    .unwrap();
    let mut changed = spec.clone();
    changed.target = TargetIdentity::of_dir(&model_copy, "copy", DType::F32).unwrap();
    let (what, message) =
        mismatch(EvalCache::open_or_build(&cache_dir, &t, &changed, CONTEXT, false).unwrap_err());
    assert_eq!(what, "target");
    assert!(message.contains("config.json sha256"), "{message}");
    // The unchanged copy is the same target: fingerprints are content-based.
    std::fs::write(model_copy.join("config.json"), config).unwrap();
    changed.target = TargetIdentity::of_dir(&model_copy, "copy", DType::F32).unwrap();
    assert!(EvalCache::open_or_build(&cache_dir, &t, &changed, CONTEXT, false).is_ok());

    let mut bf16 = spec.clone();
    bf16.target.dtype = "bf16".into();
    assert_eq!(
        mismatch(EvalCache::open_or_build(&cache_dir, &t, &bf16, CONTEXT, false).unwrap_err()).0,
        "target dtype"
    );

    let mut longer = spec.clone();
    longer.max_new_tokens = 20;
    let err = EvalCache::open_or_build(&cache_dir, &t, &longer, CONTEXT, false).unwrap_err();
    assert!(
        matches!(
            err,
            EvalError::Cache(CacheError::TooShort {
                cached: 12,
                requested: 20,
                ..
            })
        ),
        "{err}"
    );
}

fn spec_for(prompts: &Path) -> dflash_train::eval::CacheSpec {
    spec(prompts, 12, vec![1, 2])
}

#[test]
fn cache_refuses_drafters_tapping_layers_it_lacks() {
    let dir = scratch("drafters");
    let prompts = write_prompts(&dir, &PROMPTS[..1]);
    let cache = EvalCache::build(&target(), &spec(&prompts, 6, vec![1, 2]), CONTEXT).unwrap();
    cache.check_drafter("ok", &[2, 1]).unwrap();
    let err = cache.check_drafter("deep", &[0, 2, 3]).unwrap_err();
    assert!(
        matches!(&err, CacheError::MissingTaps { missing, .. } if missing == &vec![0, 3]),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("drafter `deep` needs layers [0, 3]"),
        "{err}"
    );
}

#[test]
fn prompt_longer_than_the_context_is_refused_by_id() {
    let dir = scratch("long");
    let prompts = write_prompts(&dir, &PROMPTS[..2]);
    let spec = spec(&prompts, 64, vec![1]);
    let longest = spec.tokenized.iter().map(|p| p.tokens.len()).max().unwrap();
    let err = EvalCache::build(&target(), &spec, longest + 63).unwrap_err();
    let message = err.to_string();
    assert!(
        matches!(
            err,
            EvalError::PromptTooLong {
                max_new_tokens: 64,
                ..
            }
        ),
        "{message}"
    );
    assert!(message.contains("--context-length"), "{message}");
}

#[test]
fn a_longer_cache_serves_a_shorter_run_exactly() {
    let dir = scratch("prefix");
    let prompts = write_prompts(&dir, &PROMPTS[..2]);
    let t = target();
    let long = EvalCache::build(&t, &spec(&prompts, 30, vec![1]), CONTEXT).unwrap();
    let short = EvalCache::build(&t, &spec(&prompts, 10, vec![1]), CONTEXT).unwrap();
    let cut = long.with_max_new_tokens(10);
    let verifies = Verify::chain_and_budgets(&[4]);
    let replay = |c: &EvalCache| {
        let mut oracle = OracleProposer::new(t.clone(), 15, None);
        replay_cache(&mut oracle, c, &verifies, 4, |_| Ok(None)).unwrap()
    };
    for (a, b) in cut.prompts.iter().zip(&short.prompts) {
        assert_eq!(a.generated, b.generated);
        assert_eq!(a.tokens[..b.tokens.len()], b.tokens[..]);
    }
    assert_eq!(replay(&cut), replay(&short));
}
