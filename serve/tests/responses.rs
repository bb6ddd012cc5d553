//! `/v1/responses` through the router with the scripted engine: the response object's shape
//! (one `message` item with one `output_text` part, usage, `incomplete` at the token budget),
//! the streamed events in OpenAI's order with deltas that spell the final text, instructions
//! and message lists reaching the chat template, and refusals in OpenAI's error shape.

mod support;

use serde_json::{json, Value};
use support::{start, SCRIPT_TEXT};

#[tokio::test]
async fn a_text_response_has_openais_shape_and_usage() {
    let s = start(&[], 3).await;
    let r = s
        .post(
            "/v1/responses",
            &json!({"model": "gpt-4o", "input": "Say hello."}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "response");
    assert!(
        v["id"].as_str().is_some_and(|id| id.starts_with("resp_")),
        "{v}"
    );
    assert_eq!(v["status"], "completed", "{v}");
    assert_eq!(v["model"], "tiny-coder-demo", "the served model is named");
    let item = &v["output"][0];
    assert_eq!(item["type"], "message");
    assert_eq!(item["role"], "assistant");
    assert!(
        item["id"].as_str().is_some_and(|id| id.starts_with("msg_")),
        "{item}"
    );
    assert_eq!(item["content"][0]["type"], "output_text");
    assert_eq!(item["content"][0]["text"], SCRIPT_TEXT);
    let u = &v["usage"];
    let (input, output) = (
        u["input_tokens"].as_u64().unwrap(),
        u["output_tokens"].as_u64().unwrap(),
    );
    assert!(input > 0 && output > 0, "{u}");
    assert_eq!(u["total_tokens"].as_u64(), Some(input + output));

    // The budget cuts it: incomplete, with the reason.
    let v = s
        .post(
            "/v1/responses",
            &json!({"input": "Say hello.", "max_output_tokens": 2}),
        )
        .await
        .json();
    assert_eq!(v["status"], "incomplete", "{v}");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["usage"]["output_tokens"], 2);

    // Instructions and a message list count as prompt tokens like chat's messages do.
    let with = s
        .post(
            "/v1/responses",
            &json!({"instructions": "Be brief and polite.",
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}]}),
        )
        .await
        .json();
    let more = with["usage"]["input_tokens"].as_u64().unwrap();
    assert!(
        more > input,
        "instructions reach the prompt: {more} vs {input}"
    );
}

#[tokio::test]
async fn a_streamed_response_sends_openais_events_in_order() {
    let s = start(&[], 3).await;
    let r = s
        .post(
            "/v1/responses",
            &json!({"input": "Say hello.", "stream": true}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let events: Vec<Value> = r
        .events()
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).expect("json"))
        .collect();
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    let deltas = kinds
        .iter()
        .filter(|k| **k == "response.output_text.delta")
        .count();
    assert!(deltas >= 2, "{kinds:?}");
    let mut want = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    want.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    want.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(kinds, want);
    let seqs: Vec<u64> = events
        .iter()
        .filter_map(|e| e["sequence_number"].as_u64())
        .collect();
    assert_eq!(seqs, (0..events.len() as u64).collect::<Vec<_>>());
    let text: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    assert_eq!(text, SCRIPT_TEXT);
    let done = events.last().unwrap();
    assert_eq!(
        done["response"]["output"][0]["content"][0]["text"],
        SCRIPT_TEXT
    );
    assert_eq!(done["response"]["status"], "completed");
}

#[tokio::test]
async fn what_responses_does_not_serve_is_refused_in_openais_shape() {
    let s = start(&[], 3).await;
    for (body, needle) in [
        (
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            "tools",
        ),
        (
            json!({"input": "x", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (json!({"input": 5}), "input"),
        (
            json!({"input": [{"type": "function_call_output", "output": "1"}]}),
            "role",
        ),
    ] {
        let r = s.post("/v1/responses", &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let v = r.json();
        assert_eq!(v["object"], "error", "{v}");
        assert!(
            v["message"].as_str().unwrap_or("").contains(needle),
            "{needle}: {v}"
        );
    }
}
