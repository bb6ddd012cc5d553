//! Penalties from the real binary on the bundled demo pair (f32, CPU): frequency, presence and
//! repetition penalties, `min_new_tokens` and `logit_bias` give the same greedy output with
//! DFLASH speculation (DDTree and chain verify) as without, on `/generate` and the OpenAI
//! routes, streamed and not; each setting changes the unpenalised output, drafts are still
//! accepted, and a bad `logit_bias` is a 400 in SGLang's shape.

mod support;

use serde_json::{json, Value};
use support::binary::ServerProcess;

const PROMPTS: [&str; 3] = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Stack:",
];
const NEW_TOKENS: u64 = 32;

/// `sampling_params` extras, each of which changes the demo model's greedy answer.
fn settings() -> Vec<Value> {
    vec![
        json!({"frequency_penalty": 2.0}),
        json!({"presence_penalty": 1.5, "repetition_penalty": 1.8}),
        json!({"repetition_penalty": 0.5}),
        json!({"min_new_tokens": 20, "frequency_penalty": 0.5, "logit_bias": {"13": 4.0, "220": -5.0}}),
    ]
}

/// Output ids and the accept length of one greedy `/generate` call.
async fn generate(p: &ServerProcess, prompt: &str, extra: &Value, stream: bool) -> (Vec<u64>, f64) {
    let mut params = json!({"max_new_tokens": NEW_TOKENS, "temperature": 0});
    if let (Some(o), Some(e)) = (params.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    let body = json!({"text": prompt, "stream": stream, "sampling_params": params});
    let r = p.server.post("/generate", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = if stream {
        let events = r.events();
        let last = events
            .iter()
            .rev()
            .find(|e| *e != "[DONE]")
            .expect("a chunk");
        serde_json::from_str(last).expect("json")
    } else {
        r.json()
    };
    let ids = v["output_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    let accept = v["meta_info"]["spec_accept_length"].as_f64().unwrap_or(0.0);
    (ids, accept)
}

#[tokio::test]
async fn penalised_greedy_output_is_the_same_with_and_without_speculation() {
    let plain =
        ServerProcess::start(&["--speculative-algorithm", "NONE", "--skip-server-warmup"]).await;
    let ddtree = ServerProcess::start(&["--skip-server-warmup"]).await;
    let chain =
        ServerProcess::start(&["--speculative-verify", "chain", "--skip-server-warmup"]).await;
    let mut best_accept: f64 = 0.0;
    for prompt in PROMPTS {
        let (unpenalised, _) = generate(&plain, prompt, &json!({}), false).await;
        for extra in settings() {
            let (want, _) = generate(&plain, prompt, &extra, false).await;
            assert_ne!(
                want, unpenalised,
                "{extra} changes the output of {prompt:?}"
            );
            if extra.get("min_new_tokens").is_some() {
                assert!(want.len() >= 20, "{extra}: {} tokens", want.len());
            }
            for (name, server) in [("ddtree", &ddtree), ("chain", &chain)] {
                for stream in [false, true] {
                    let (got, accept) = generate(server, prompt, &extra, stream).await;
                    assert_eq!(got, want, "{name} (stream {stream}) {extra} on {prompt:?}");
                    best_accept = best_accept.max(accept);
                }
            }
        }
    }
    assert!(
        best_accept > 1.5,
        "the drafter's drafts are still accepted under penalties (best accept length {best_accept})"
    );
}

#[tokio::test]
async fn min_new_tokens_holds_back_eos_and_logit_bias_reaches_the_openai_routes() {
    let plain =
        ServerProcess::start(&["--speculative-algorithm", "NONE", "--skip-server-warmup"]).await;
    let ddtree = ServerProcess::start(&["--skip-server-warmup"]).await;
    // EOS (8188) pushed up by 100: the answer ends right after min_tokens tokens.
    let body = json!({"model": "x", "prompt": "def add(a, b):", "max_tokens": 40, "temperature": 0,
        "min_tokens": 7, "logit_bias": {"8188": 100}});
    let mut answers = Vec::new();
    for server in [&plain, &ddtree] {
        let r = server.server.post("/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        answers.push(v["choices"][0]["text"].clone());
    }
    assert_eq!(answers[0], answers[1], "same text with DDTree speculation");

    // A chat answer with a frequency penalty: the same with and without speculation.
    let chat = json!({"model": "x", "messages": [{"role": "user", "content": "Write a loop."}],
        "max_tokens": 24, "temperature": 0, "frequency_penalty": 1.2, "presence_penalty": 0.5});
    let texts: Vec<Value> = chat_contents(&[&plain, &ddtree], &chat).await;
    assert_eq!(texts[0], texts[1]);

    for bad in [
        json!({"99999": 1.0}),
        json!({"abc": 1.0}),
        json!({"5": "high"}),
        json!([1, 2]),
    ] {
        let r = plain
            .server
            .post(
                "/v1/completions",
                &json!({"prompt": "x", "max_tokens": 2, "logit_bias": bad}),
            )
            .await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        let v = r.json();
        assert_eq!(v["object"], "error", "{v}");
        assert!(
            v["message"].as_str().unwrap_or("").contains("logit_bias"),
            "{v}"
        );
    }
    let r = plain
        .server
        .post(
            "/generate",
            &json!({"text": "x", "sampling_params": {"max_new_tokens": 2, "logit_bias": {"8192": 1}}}),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("logit_bias"), "{}", r.body);
}

async fn chat_contents(servers: &[&ServerProcess], body: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    for s in servers {
        let r = s.server.post("/v1/chat/completions", body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        out.push(r.json()["choices"][0]["message"]["content"].clone());
    }
    out
}
