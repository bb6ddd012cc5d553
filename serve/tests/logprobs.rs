//! Output-token logprobs in each API's shape through the router (the scripted engine gives
//! token k of an answer the logprob -k/10, with itself and token 0 as its alternatives), and
//! the requests that ask for what is not built (prompt logprobs) refused naming the field.

mod support;

use serde_json::{json, Value};
use support::start;

fn close(v: &Value, want: f64) -> bool {
    v.as_f64().is_some_and(|x| (x - want).abs() < 1e-6)
}

#[tokio::test]
async fn generate_returns_sglangs_logprob_triples() {
    let s = start(&[], 3).await;
    let body = json!({"text": "hi", "return_logprob": true, "top_logprobs_num": 2,
        "return_text_in_logprobs": true, "sampling_params": {"max_new_tokens": 5}});
    let v = s.post("/generate", &body).await.json();
    let meta = &v["meta_info"];
    let out = meta["output_token_logprobs"]
        .as_array()
        .expect("output_token_logprobs");
    assert_eq!(out.len(), 5, "{meta}");
    let ids = v["output_ids"].as_array().expect("ids");
    for (k, (t, id)) in out.iter().zip(ids).enumerate() {
        assert!(close(&t[0], -(k as f64) / 10.0), "{t}");
        assert_eq!(&t[1], id);
        assert!(t[2].is_string(), "text asked for: {t}");
    }
    let tops = meta["output_top_logprobs"].as_array().expect("tops");
    assert_eq!(tops.len(), 5);
    assert_eq!(tops[0].as_array().map(Vec::len), Some(2));
    assert_eq!(tops[0][1][1], 0);
    assert_eq!(meta["input_token_logprobs"], json!([]));
    // Without text and without alternatives: null texts, null top entries.
    let body =
        json!({"text": "hi", "return_logprob": true, "sampling_params": {"max_new_tokens": 2}});
    let meta = s.post("/generate", &body).await.json()["meta_info"].clone();
    assert_eq!(meta["output_token_logprobs"][1][2], Value::Null);
    assert_eq!(meta["output_top_logprobs"], json!([null, null]));
    // Not asked: no logprob fields.
    let body = json!({"text": "hi", "sampling_params": {"max_new_tokens": 2}});
    let meta = s.post("/generate", &body).await.json()["meta_info"].clone();
    assert!(meta.get("output_token_logprobs").is_none(), "{meta}");
}

#[tokio::test]
async fn streamed_generate_chunks_carry_the_logprobs_so_far() {
    let s = start(&[], 3).await;
    let body = json!({"text": "hi", "stream": true, "return_logprob": true,
        "sampling_params": {"max_new_tokens": 5}});
    let r = s.post("/generate", &body).await;
    let chunks: Vec<Value> = r
        .events()
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).expect("json"))
        .collect();
    for c in &chunks {
        let n = c["output_ids"].as_array().map_or(0, Vec::len);
        assert_eq!(
            c["meta_info"]["output_token_logprobs"]
                .as_array()
                .map(Vec::len),
            Some(n),
            "{c}"
        );
    }
}

#[tokio::test]
async fn chat_logprobs_have_openais_shape_whole_and_streamed() {
    let s = start(&[], 3).await;
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "logprobs": true, "top_logprobs": 1});
    let v = s.post("/v1/chat/completions", &body).await.json();
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("content");
    assert_eq!(content.len(), 4, "{v}");
    for (k, e) in content.iter().enumerate() {
        assert!(close(&e["logprob"], -(k as f64) / 10.0), "{e}");
        let token = e["token"].as_str().expect("token");
        assert_eq!(e["bytes"], json!(token.as_bytes()));
        assert_eq!(e["top_logprobs"].as_array().map(Vec::len), Some(1));
        assert_eq!(e["top_logprobs"][0]["token"], e["token"]);
    }
    let joined: String = content.iter().filter_map(|e| e["token"].as_str()).collect();
    assert_eq!(joined, v["choices"][0]["message"]["content"]);
    let mut body = body;
    body["stream"] = json!(true);
    let r = s.post("/v1/chat/completions", &body).await;
    let streamed: Vec<Value> = r
        .events()
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).expect("json"))
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(streamed.len(), 4);
    for (k, e) in streamed.iter().enumerate() {
        assert!(close(&e["logprob"], -(k as f64) / 10.0), "{e}");
    }
}

#[tokio::test]
async fn completions_logprobs_have_openais_shape() {
    let s = start(&[], 3).await;
    let body = json!({"prompt": "hi", "max_tokens": 4, "logprobs": 2});
    let v = s.post("/v1/completions", &body).await.json();
    let lp = &v["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().expect("tokens");
    assert_eq!(tokens.len(), 4, "{v}");
    assert!(close(&lp["token_logprobs"][3], -0.3));
    assert_eq!(lp["top_logprobs"][0].as_object().map(|o| o.len()), Some(2));
    // Offsets walk the text.
    let text = v["choices"][0]["text"].as_str().expect("text");
    let mut at = 0;
    for (t, off) in tokens
        .iter()
        .zip(lp["text_offset"].as_array().expect("offsets"))
    {
        assert_eq!(off.as_u64(), Some(at as u64));
        at += t.as_str().map_or(0, str::len);
    }
    assert_eq!(at, text.len());
}

#[tokio::test]
async fn what_is_not_built_is_refused_naming_the_field() {
    let s = start(&[], 3).await;
    for (route, body, needle) in [
        (
            "/generate",
            json!({"text": "hi", "return_logprob": true, "logprob_start_len": -3}),
            "logprob_start_len",
        ),
        (
            "/generate",
            json!({"text": "hi", "return_logprob": true, "token_ids_logprob": [1]}),
            "token_ids_logprob",
        ),
        (
            "/generate",
            json!({"text": "hi", "return_logprob": true, "top_logprobs_num": -1}),
            "top_logprobs_num",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "logprobs": "yes"}),
            "`logprobs` must be",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "logprobs": 1, "suffix": "x"}),
            "suffix",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": -2}),
            "top_logprobs",
        ),
    ] {
        let r = s.post(route, &body).await;
        assert_eq!(r.status, 400, "{route} {body}: {}", r.body);
        assert!(r.body.contains(needle), "{route}: {}", r.body);
    }
    // Without return_logprob the other logprob fields are ignored, as SGLang ignores them.
    let r = s
        .post("/generate", &json!({"text": "hi", "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 1}}))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
}
