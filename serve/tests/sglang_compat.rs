//! SGLang drop-in details through the real router and engine thread (scripted engine): any
//! `model` string, model ids with slashes, unknown `sampling_params` keys, `/v1/tokenize` with
//! `messages`, `/server_info`'s launch command and settings, `spec_num_draft_tokens` agreeing
//! between /metrics and /server_info, and `continuous_usage_stats` chunks.

mod support;

use serde_json::{json, Value};
use support::binary::metric;
use support::start;

#[tokio::test]
async fn any_model_string_is_served_and_answers_name_the_served_model() {
    let s = start(&[], 3).await;
    for model in ["gpt-4o", "Qwen/Qwen3-8B", "", "default"] {
        let r = s
            .post(
                "/v1/chat/completions",
                &json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
            )
            .await;
        assert_eq!(r.status, 200, "{model}: {}", r.body);
        assert_eq!(r.json()["model"], "tiny-coder-demo", "{model}");
        let r = s
            .post(
                "/v1/completions",
                &json!({"model": model, "prompt": "hi", "max_tokens": 2}),
            )
            .await;
        assert_eq!(r.status, 200, "{model}: {}", r.body);
        assert_eq!(r.json()["model"], "tiny-coder-demo", "{model}");
    }
}

#[tokio::test]
async fn model_cards_take_ids_with_slashes() {
    let s = start(&["--served-model-name", "Qwen/Qwen3-8B"], 3).await;
    let r = s.get("/v1/models/Qwen/Qwen3-8B").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["id"], "Qwen/Qwen3-8B");
    let r = s.get("/v1/models/Qwen/Qwen3-4B").await;
    assert_eq!(r.status, 404);
    let v = r.json();
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(
        v["error"]["message"],
        "The model 'Qwen/Qwen3-4B' does not exist"
    );
}

#[tokio::test]
async fn unknown_sampling_params_keys_are_a_400_naming_the_key_in_sglangs_shape() {
    let s = start(&[], 3).await;
    let r = s
        .post(
            "/generate",
            &json!({"text": "hi", "sampling_params": {"max_new_tokens": 2, "temprature": 0.5}}),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    let v = r.json();
    let text = v["error"]
        .as_str()
        .unwrap_or_else(|| panic!("flat error: {v}"));
    assert!(
        text.starts_with("unknown field `temprature`, expected one of `max_new_tokens`, `stop`"),
        "{text}"
    );
    // In a batch's list of sampling params too, and known keys still pass.
    let r = s
        .post(
            "/generate",
            &json!({"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_token": 1}]}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(
        r.body.contains("unknown field `max_new_token`"),
        "{}",
        r.body
    );
    let r = s
        .post(
            "/generate",
            &json!({"text": "hi", "sampling_params": {"max_new_tokens": 1, "stream_interval": 1, "custom_params": null}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

#[tokio::test]
async fn tokenize_with_messages_gives_the_chat_prompt_ids() {
    let s = start(&[], 3).await;
    let messages = json!([{"role": "user", "content": "What is 2+2?"}]);
    let r = s.post("/v1/tokenize", &json!({"messages": messages})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let count = v["count"].as_u64().expect("count");
    assert_eq!(v["tokens"].as_array().map(Vec::len), Some(count as usize));
    // The same prompt a chat completion decodes from.
    let chat = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": messages, "max_tokens": 1}),
        )
        .await
        .json();
    assert_eq!(chat["usage"]["prompt_tokens"].as_u64(), Some(count));
    // Without the generation prompt the template stops after the user turn: fewer ids, a prefix.
    let bare = s
        .post(
            "/v1/tokenize",
            &json!({"messages": messages, "add_generation_prompt": false}),
        )
        .await
        .json();
    let bare_ids = bare["tokens"].as_array().expect("tokens").clone();
    let full_ids = v["tokens"].as_array().expect("tokens").clone();
    assert!(
        bare_ids.len() < full_ids.len(),
        "{bare_ids:?} vs {full_ids:?}"
    );
    assert_eq!(&full_ids[..bare_ids.len()], &bare_ids[..]);
    // Exactly one of prompt and messages.
    let r = s
        .post(
            "/v1/tokenize",
            &json!({"prompt": "a", "messages": messages}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(
        r.body.contains("Exactly one of 'prompt' or 'messages'"),
        "{}",
        r.body
    );
}

#[tokio::test]
async fn server_info_carries_the_launch_command_and_more_settings() {
    let s = start(
        &[
            "--api-key",
            "sekret",
            "--page-size",
            "16",
            "--watchdog-timeout",
            "600",
        ],
        3,
    )
    .await;
    let r = s
        .request(
            "GET",
            "/server_info",
            &[("Authorization", "Bearer sekret")],
            b"",
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(
        v["launch_command"],
        "--enable-metrics --api-key <redacted> --page-size 16 --watchdog-timeout 600"
    );
    assert_eq!(v["page_size"], 16);
    assert_eq!(v["ignored_sglang_flags"], json!(["--watchdog-timeout 600"]));
    for key in [
        "chunked_prefill_size",
        "tool_call_parser",
        "reasoning_parser",
        "log_level",
    ] {
        assert!(v.get(key).is_some(), "{key} missing: {v}");
    }
    assert_eq!(v["log_level"], "info");
}

#[tokio::test]
async fn spec_num_draft_tokens_agrees_between_metrics_and_server_info() {
    let s = start(&[], 3).await;
    let info = s.get("/server_info").await.json();
    let from_info = info["speculative_num_draft_tokens"]
        .as_f64()
        .expect("spec tokens");
    // The scripted engine drafts 2 a round: 3 tokens verified (the real drafter's 16 is checked
    // against the binary in binary_sglang_flags.rs).
    assert_eq!(from_info, 3.0);
    let m = s.get("/metrics").await.body;
    assert_eq!(
        metric(&m, "sglang:spec_num_draft_tokens", "tp_rank=\"0\""),
        Some(from_info),
        "{m}"
    );
}

#[tokio::test]
async fn continuous_usage_stats_put_the_running_usage_on_every_chunk() {
    let s = start(&[], 3).await;
    for (route, body) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": true,
                   "stream_options": {"continuous_usage_stats": true, "include_usage": true}}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 5, "stream": true,
                   "stream_options": {"continuous_usage_stats": true}}),
        ),
    ] {
        let r = s.post(route, &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let chunks: Vec<Value> = r
            .events()
            .iter()
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str(e).expect("json"))
            .filter(|c: &Value| c["choices"].as_array().is_some_and(|a| !a.is_empty()))
            .collect();
        assert!(chunks.len() >= 2, "{route}: {}", r.body);
        let mut last = 0;
        for c in &chunks {
            let u = &c["usage"];
            let done = u["completion_tokens"]
                .as_u64()
                .unwrap_or_else(|| panic!("{route}: {c}"));
            assert!(done >= last, "{route}: usage went back: {c}");
            assert_eq!(
                u["total_tokens"].as_u64(),
                Some(u["prompt_tokens"].as_u64().unwrap_or(0) + done)
            );
            last = done;
        }
        assert_eq!(last, 5, "{route}");
    }
    // Off by default: no usage on the content chunks.
    let r = s
        .post(
            "/v1/completions",
            &json!({"prompt": "hi", "max_tokens": 3, "stream": true}),
        )
        .await;
    let first: Value = serde_json::from_str(&r.events()[0]).expect("json");
    assert_eq!(first["usage"], Value::Null);
}
