//! Bad input against the real binary: every kind of malformed request gets a 4xx in SGLang's
//! error shape with a message that says what to change, while a greedy generation running at
//! the same time finishes with exactly the tokens it produces alone.

mod support;

use serde_json::{json, Value};
use support::binary::ServerProcess;
use support::TestServer;

const CONTEXT: usize = 256;
const BODY_LIMIT: usize = 8192;

struct Case {
    name: &'static str,
    path: &'static str,
    content_type: &'static str,
    body: Vec<u8>,
    status: u16,
    /// Words the message must contain (what is wrong, or what to change).
    says: &'static [&'static str],
}

fn case(
    name: &'static str,
    path: &'static str,
    body: Value,
    status: u16,
    says: &'static [&'static str],
) -> Case {
    Case {
        name,
        path,
        content_type: "application/json",
        body: body.to_string().into_bytes(),
        status,
        says,
    }
}

fn cases() -> Vec<Case> {
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}]});
        if let (Some(b), Some(e)) = (b.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        b
    };
    let long_prompt: Vec<u32> = (0..CONTEXT as u32 + 10).map(|i| 100 + i).collect();
    vec![
        Case {
            name: "malformed JSON",
            path: "/generate",
            content_type: "application/json",
            body: br#"{"text": "def f():", "sampling_params": {"#.to_vec(),
            status: 400,
            says: &["JSON"],
        },
        case(
            "wrong type (generate)",
            "/generate",
            json!({"text": 5}),
            400,
            &["text"],
        ),
        case(
            "wrong type (chat)",
            "/v1/chat/completions",
            chat(json!({"max_tokens": "ten"})),
            400,
            &["max_tokens"],
        ),
        case(
            "messages not a list",
            "/v1/chat/completions",
            json!({"messages": "hi"}),
            400,
            &["messages"],
        ),
        case(
            "prompt longer than the context",
            "/generate",
            json!({"input_ids": long_prompt, "sampling_params": {"max_new_tokens": 1}}),
            400,
            &["context length"],
        ),
        case(
            "max_tokens beyond the context",
            "/v1/completions",
            json!({"prompt": "def f():", "max_tokens": 5000}),
            400,
            &["maximum context length", "completion"],
        ),
        case(
            "negative temperature",
            "/v1/chat/completions",
            chat(json!({"temperature": -1})),
            400,
            &["temperature"],
        ),
        case(
            "top_p above 1",
            "/generate",
            json!({"text": "x", "sampling_params": {"top_p": 1.5}}),
            400,
            &["top_p"],
        ),
        case(
            "n of 0",
            "/v1/completions",
            json!({"prompt": "x", "n": 0}),
            400,
            &["n"],
        ),
        Case {
            name: "invalid UTF-8",
            path: "/v1/completions",
            content_type: "application/json",
            body: b"{\"prompt\": \"def \xff\xfe():\", \"max_tokens\": 4}".to_vec(),
            status: 400,
            says: &["UTF-8"],
        },
        Case {
            name: "oversized body",
            path: "/generate",
            content_type: "application/json",
            body: json!({"text": "x".repeat(BODY_LIMIT * 2)})
                .to_string()
                .into_bytes(),
            status: 413,
            says: &["--max-request-body-bytes"],
        },
        Case {
            name: "trailing garbage after the JSON value",
            path: "/generate",
            content_type: "application/json",
            body: br#"{"text": "x", "sampling_params": {"max_new_tokens": 1}} trailing"#.to_vec(),
            status: 400,
            says: &["exactly one JSON value"],
        },
        Case {
            name: "a content type that only starts like JSON",
            path: "/generate",
            content_type: "application/jsonx",
            body: json!({"text": "x"}).to_string().into_bytes(),
            status: 400,
            says: &["application/json"],
        },
        case(
            "temperature beyond f32",
            "/v1/completions",
            json!({"prompt": "x", "temperature": 1e39}),
            400,
            &["temperature", "1e39", "32-bit"],
        ),
        case(
            "more sequences than one request may ask for",
            "/v1/completions",
            json!({"prompt": vec!["x"; 300], "max_tokens": 1}),
            400,
            &["300 sequences", "--max-sequences-per-request"],
        ),
        Case {
            name: "not JSON content type",
            path: "/v1/chat/completions",
            content_type: "text/plain",
            body: chat(json!({})).to_string().into_bytes(),
            // SGLang answers this with 400, not 415.
            status: 400,
            says: &["application/json"],
        },
    ]
}

/// The error message, from SGLang's OpenAI shape or its native `{"error": {"message"}}`.
fn message(path: &str, body: &Value) -> String {
    if path.starts_with("/v1/") {
        assert_eq!(body["object"], "error", "OpenAI error shape: {body}");
        assert!(
            body["code"].is_u64() && body.get("type").is_some() && body.get("param").is_some(),
            "{body}"
        );
        body["message"].as_str().unwrap_or_default().to_string()
    } else {
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

async fn send(s: &TestServer, c: &Case) {
    let r = s
        .request("POST", c.path, &[("Content-Type", c.content_type)], &c.body)
        .await;
    assert_eq!(r.status, c.status, "{}: {}", c.name, r.body);
    let body: Value = serde_json::from_str(&r.body)
        .unwrap_or_else(|e| panic!("{}: not JSON ({e}): {}", c.name, r.body));
    let msg = message(c.path, &body);
    for word in c.says {
        assert!(
            msg.contains(word),
            "{}: message {msg:?} should mention {word:?}",
            c.name
        );
    }
}

#[tokio::test]
async fn bad_requests_get_4xx_and_disturb_nothing() {
    let p = ServerProcess::start(&[
        "--context-length",
        &CONTEXT.to_string(),
        "--max-request-body-bytes",
        &BODY_LIMIT.to_string(),
    ])
    .await;
    let s = &p.server;
    let good = json!({"text": "def quicksort(items):", "stream": true,
        "sampling_params": {"max_new_tokens": 120, "temperature": 0, "ignore_eos": true}});
    let alone = s.post("/generate", &good).await;
    assert_eq!(alone.status, 200, "{}", alone.body);

    let (during, _) = tokio::join!(s.post("/generate", &good), async {
        for c in cases() {
            send(s, &c).await;
        }
    });
    let last = |r: &support::Reply| -> Value {
        let events = r.events();
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        serde_json::from_str(&events[events.len() - 2]).expect("last chunk")
    };
    assert_eq!(
        last(&during)["output_ids"],
        last(&alone)["output_ids"],
        "a bad request disturbed a running one"
    );
    assert_eq!(
        s.get("/health").await.status,
        200,
        "the server keeps serving"
    );
    let info = s.get("/server_info").await.json();
    assert_eq!(info["num_running_reqs"], 0);
}
