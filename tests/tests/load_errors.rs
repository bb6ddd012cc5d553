//! Loading errors name the file and the field or tensor, and never panic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use dflash_models::{DFlashDrafter, ModelError, OpsMode, Qwen3Model};
use dflash_tests::{demo_model, fixture, max_abs_diff};

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dflash-load-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn copy_config(from: &Path, to: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(from.join("config.json")).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(
        to.join("config.json"),
        serde_json::to_string_pretty(&v).unwrap(),
    )
    .unwrap();
}

fn tensors(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap()
}

fn load_target(dir: &Path) -> Result<Qwen3Model, ModelError> {
    Qwen3Model::load(dir, DType::F32, &Device::Cpu, 64, OpsMode::Fused)
}

#[test]
fn missing_tensor_names_the_tensor_and_directory() {
    let src = fixture("qwen3-tiny-random");
    let dir = tmpdir("missing");
    copy_config(&src, &dir, |_| {});
    let mut t = tensors(&src);
    t.remove("model.layers.1.mlp.up_proj.weight");
    candle_core::safetensors::save(&t, dir.join("model.safetensors")).unwrap();
    let e = load_target(&dir).unwrap_err().to_string();
    assert!(
        e.contains("model.layers.1.mlp.up_proj.weight") && e.contains(&dir.display().to_string()),
        "{e}"
    );
}

#[test]
fn shape_mismatch_names_file_tensor_and_shapes() {
    let src = fixture("qwen3-tiny-random");
    let dir = tmpdir("shape");
    copy_config(&src, &dir, |v| v["intermediate_size"] = 96.into());
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let e = load_target(&dir).unwrap_err().to_string();
    assert!(
        e.contains("model.safetensors")
            && e.contains("gate_proj")
            && e.contains("[128, 64]")
            && e.contains("[96, 64]"),
        "{e}"
    );
}

#[test]
fn wrongly_typed_config_field_is_named() {
    let src = fixture("qwen3-tiny-random");
    let dir = tmpdir("type");
    copy_config(&src, &dir, |v| v["num_attention_heads"] = "four".into());
    let e = load_target(&dir).unwrap_err().to_string();
    assert!(
        e.contains("config.json") && e.contains("num_attention_heads"),
        "{e}"
    );
}

#[test]
fn drafter_with_taps_beyond_target_depth_is_refused() {
    let target = load_target(&fixture("qwen3-tiny-random")).unwrap();
    let src = fixture("dflash-tiny-random");
    let dir = tmpdir("taps");
    copy_config(&src, &dir, |v| {
        v["dflash_config"]["target_layer_ids"] = serde_json::json!([0, 5])
    });
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let e = DFlashDrafter::load(&dir, &target, OpsMode::Fused)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("config.json") && e.contains("target_layer_ids") && e.contains('5'),
        "{e}"
    );
}

#[test]
fn drafter_for_another_hidden_size_is_refused() {
    let target =
        Qwen3Model::load(&demo_model(), DType::F32, &Device::Cpu, 64, OpsMode::Fused).unwrap();
    let e = DFlashDrafter::load(&fixture("dflash-tiny-random"), &target, OpsMode::Fused)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("config.json") && e.contains("hidden_size") && e.contains("256"),
        "{e}"
    );
}

/// The same weights split over two shards with an index load and compute identically.
#[test]
fn sharded_checkpoint_loads_and_matches_single_file() {
    let src = fixture("qwen3-tiny-random");
    let dir = tmpdir("sharded");
    copy_config(&src, &dir, |_| {});
    let t = tensors(&src);
    let (mut a, mut b) = (HashMap::new(), HashMap::new());
    let mut map = serde_json::Map::new();
    for (name, tensor) in t {
        let (part, file) = if name.contains("layers.1") || name == "lm_head.weight" {
            (&mut b, "model-00002-of-00002.safetensors")
        } else {
            (&mut a, "model-00001-of-00002.safetensors")
        };
        map.insert(name.clone(), file.into());
        part.insert(name, tensor);
    }
    candle_core::safetensors::save(&a, dir.join("model-00001-of-00002.safetensors")).unwrap();
    candle_core::safetensors::save(&b, dir.join("model-00002-of-00002.safetensors")).unwrap();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let sharded = load_target(&dir).unwrap();
    let single = load_target(&src).unwrap();
    assert!(max_abs_diff(sharded.lm_head_weight(), single.lm_head_weight()) == 0.0);
    assert!(max_abs_diff(sharded.embed_weight(), single.embed_weight()) == 0.0);
}

#[test]
fn tied_checkpoint_without_lm_head_loads_with_embeddings_as_head() {
    let m = Qwen3Model::load(&demo_model(), DType::F32, &Device::Cpu, 64, OpsMode::Fused).unwrap();
    assert!(m.config().tie_word_embeddings);
    assert!(max_abs_diff(m.lm_head_weight(), m.embed_weight()) == 0.0);
}
