//! A tiny Qwen3.5 (hybrid Gated DeltaNet) checkpoint that `dflash-serve` can serve with the
//! bundled demo tokenizer, written to a temporary directory by this code (no binary fixture):
//!
//! - the target: the transformers-parity fixture's six layers (tests/fixtures/qwen3_5-tiny-random:
//!   GDN, GDN, gated attention, GDN, GDN, gated attention; released multimodal layout with
//!   `text_config` and the `model.language_model.` prefix) with the vocabulary widened to the
//!   demo tokenizer's 8192 ids (seeded random embeddings and LM head) and the demo's tokenizer,
//!   template and generation config;
//! - its built-in MTP head (`mtp.*`, the 15 tensors of a dense Qwen3.5 head), and a copy of the
//!   target without it;
//! - a DFlash drafter in the Qwen3.6 style (a sliding-window layer then a full one) tapping GDN
//!   layers 1 and 3 (the random weights of tests/fixtures/dflash-tiny-random).
//!
//! Why these weights: with embeddings of std 4 against O(1) layer outputs the target behaves
//! much like a bigram model (the next token mostly follows from the last one through the LM
//! head, and the context decides the rest), so its greedy text varies, and the MTP head is built
//! to be that bigram map (its `fc` passes the token embedding through; its layer's output
//! projections are scaled down). NEXTN rounds then accept some drafts and reject others (average
//! accept length about 1.5 of 4), so both the commit of several recurrent states and their
//! rollback run over HTTP.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use dflash_models::random::WeightRng;
use serde_json::{json, Value};

const VOCAB: usize = 8192;
const EMBED_STD: f32 = 4.0;
const MTP_OUT_SCALE: f64 = 0.1;
const TEXT: &str = "model.language_model.";

/// The directories; removed when dropped.
pub struct HybridFixture {
    root: PathBuf,
    /// The target with its `mtp.*` head.
    pub target: PathBuf,
    /// The same target without `mtp.*` tensors.
    pub target_no_mtp: PathBuf,
    /// A DFlash drafter for the target (block size 4, taps on layers 1 and 3).
    pub drafter: PathBuf,
}

impl Drop for HybridFixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn repo_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("read json")).expect("parse json")
}

fn write_dir(dir: &Path, config: &Value, weights: &HashMap<String, Tensor>, with_tokenizer: bool) {
    std::fs::create_dir_all(dir).expect("create fixture dir");
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write config");
    candle_core::safetensors::save(weights, dir.join("model.safetensors")).expect("save weights");
    if with_tokenizer {
        let demo = repo_dir().join("assets/tiny-coder-demo");
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            std::fs::copy(demo.join(f), dir.join(f)).expect("copy the demo tokenizer");
        }
    }
}

/// The MTP head: `fc` = [I | 0] (the normed token embedding passes through), layer 2's gated
/// attention and MLP with their output projections scaled down, zero-centred norms at 1.
fn mtp_head(w: &HashMap<String, Tensor>, h: usize) -> HashMap<String, Tensor> {
    let mut out = HashMap::new();
    let layer = format!("{TEXT}layers.2.");
    for (k, v) in w {
        if let Some(rest) = k.strip_prefix(&layer) {
            let v = if rest.ends_with("o_proj.weight") || rest.ends_with("down_proj.weight") {
                (v.to_dtype(DType::F32).expect("f32") * MTP_OUT_SCALE).expect("scale")
            } else {
                v.to_dtype(DType::F32).expect("f32")
            };
            out.insert(format!("mtp.layers.0.{rest}"), v);
        }
    }
    let zeros = Tensor::zeros(h, DType::F32, &Device::Cpu).expect("zeros");
    for n in [
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
    ] {
        out.insert(n.into(), zeros.clone());
    }
    let eye = Tensor::eye(h, DType::F32, &Device::Cpu).expect("eye");
    let fc = Tensor::cat(&[&eye, &eye.zeros_like().expect("zeros")], 1).expect("fc");
    out.insert("mtp.fc.weight".into(), fc);
    out
}

/// Writes the fixture under a fresh temporary directory named after `tag` and this process.
pub fn hybrid_fixture(tag: &str) -> HybridFixture {
    let src = repo_dir().join("../tests/fixtures/qwen3_5-tiny-random");
    let root =
        std::env::temp_dir().join(format!("dflash-serve-hybrid-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);

    let mut cfg = read_json(&src.join("config.json"));
    let h = cfg["text_config"]["hidden_size"].as_u64().expect("hidden") as usize;
    let text = &mut cfg["text_config"];
    text["vocab_size"] = json!(VOCAB);
    text["mtp_num_hidden_layers"] = json!(1);
    text["eos_token_id"] = json!(8188);
    text["bos_token_id"] = json!(8186);

    let mut w = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu)
        .expect("fixture weights");
    let mut rng = WeightRng::new(17);
    let embed = rng
        .normal(&[VOCAB, h], 0.0, EMBED_STD, DType::F32, &Device::Cpu)
        .expect("embeddings");
    w.insert(format!("{TEXT}embed_tokens.weight"), embed);
    let lm_head = rng
        .linear(VOCAB, h, DType::F32, &Device::Cpu)
        .expect("lm head");
    w.insert("lm_head.weight".into(), lm_head);
    let mtp = mtp_head(&w, h);

    let target_no_mtp = root.join("target-no-mtp");
    let mut no_mtp_cfg = cfg.clone();
    no_mtp_cfg["text_config"]["mtp_num_hidden_layers"] = json!(0);
    write_dir(&target_no_mtp, &no_mtp_cfg, &w, true);
    let target = root.join("target");
    w.extend(mtp);
    write_dir(&target, &cfg, &w, true);

    let dsrc = repo_dir().join("../tests/fixtures/dflash-tiny-random");
    let mut dcfg = read_json(&dsrc.join("config.json"));
    dcfg["layer_types"] = json!(["sliding_attention", "full_attention"]);
    dcfg["sliding_window"] = json!(4);
    dcfg["use_sliding_window"] = json!(true);
    dcfg["num_target_layers"] = json!(6);
    dcfg["dflash_config"]["target_layer_ids"] = json!([1, 3]);
    let dw = candle_core::safetensors::load(dsrc.join("model.safetensors"), &Device::Cpu)
        .expect("drafter weights");
    let drafter = root.join("drafter");
    write_dir(&drafter, &dcfg, &dw, false);

    HybridFixture {
        root,
        target,
        target_no_mtp,
        drafter,
    }
}
