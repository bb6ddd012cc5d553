//! Tool calling on `/v1/chat/completions` end to end through the router, with a scripted engine
//! that answers the way Qwen models call tools: the tools rendered into the prompt by the chat
//! template, the call parsed into `tool_calls` (whole and as OpenAI's streaming deltas), and
//! `tool_choice` `required` / named refused where the grammar cannot write the call.

mod support;

use serde_json::{json, Value};
use support::{start, start_with_script};

const ANSWER: &str = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>";

fn template() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/templates/tools-chat.jinja"
    )
    .to_string()
}

fn request(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}}],
        "max_tokens": 200,
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

async fn detokenized_prompt(s: &support::TestServer, body: &Value) -> String {
    let ids = s.post("/v1/tokenize", body).await.json()["tokens"].clone();
    s.post("/detokenize", &json!({"tokens": ids})).await.json()["text"]
        .as_str()
        .expect("text")
        .to_string()
}

#[tokio::test]
async fn the_chat_template_renders_the_tools_unless_tool_choice_is_none() {
    let s = start(&["--chat-template", &template()], 3).await;
    let prompt = detokenized_prompt(&s, &request(json!({}))).await;
    assert!(prompt.contains("\"name\": \"get_weather\""), "{prompt}");
    assert!(prompt.contains("Weather in Paris?"), "{prompt}");
    let prompt = detokenized_prompt(&s, &request(json!({"tool_choice": "none"}))).await;
    assert!(!prompt.contains("get_weather"), "{prompt}");
}

#[tokio::test]
async fn a_tool_call_in_the_answer_comes_back_parsed() {
    let s = start_with_script(&["--tool-call-parser", "qwen25"], 3, ANSWER).await;
    let r = s.post("/v1/chat/completions", &request(json!({}))).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(choice["matched_stop"], Value::Null);
    let message = &choice["message"];
    assert_eq!(message["content"], "Let me check.");
    let calls = message["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["index"], 0);
    let id = calls[0]["id"].as_str().expect("id");
    assert!(id.starts_with("call_") && id.len() == 29, "{id}");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(
        calls[0]["function"]["arguments"]
            .as_str()
            .expect("arguments"),
    )
    .expect("arguments are JSON");
    assert_eq!(args, json!({"city": "Paris", "unit": "celsius"}));
}

#[tokio::test]
async fn streamed_tool_calls_arrive_as_openai_deltas() {
    let s = start_with_script(&["--tool-call-parser", "qwen25"], 3, ANSWER).await;
    let r = s
        .post("/v1/chat/completions", &request(json!({"stream": true})))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let events = r.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("json"))
        .collect();
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    assert_eq!(deltas[0]["role"], "assistant");
    let content: String = deltas
        .iter()
        .filter_map(|d| d["content"].as_str())
        .collect();
    assert_eq!(content.trim(), "Let me check.");
    assert!(!content.contains("tool_call"), "{content}");
    // The call: a chunk naming it (id, type, name, empty arguments), then its arguments.
    let calls: Vec<&Value> = deltas
        .iter()
        .filter_map(|d| d["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(calls[0]["index"], 0);
    assert!(calls[0]["id"]
        .as_str()
        .is_some_and(|i| i.starts_with("call_")));
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(calls[0]["function"]["arguments"], "");
    assert_eq!(calls[1]["index"], 0);
    assert!(calls[1].get("id").is_none());
    let args: Value = serde_json::from_str(
        calls[1]["function"]["arguments"]
            .as_str()
            .expect("arguments"),
    )
    .expect("JSON");
    assert_eq!(args, json!({"city": "Paris", "unit": "celsius"}));
    // The finish chunk comes last and says tool_calls.
    let last = &chunks[chunks.len() - 1]["choices"][0];
    assert_eq!(last["finish_reason"], "tool_calls");
    let finishes = chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .count();
    assert_eq!(finishes, 1);
}

#[tokio::test]
async fn without_a_parser_or_with_tool_choice_none_the_call_stays_content() {
    for (args, extra) in [
        (&[][..], json!({})),
        (
            &["--tool-call-parser", "qwen25"][..],
            json!({"tool_choice": "none"}),
        ),
    ] {
        let s = start_with_script(args, 3, ANSWER).await;
        let v = s.post("/v1/chat/completions", &request(extra)).await.json();
        let choice = &v["choices"][0];
        assert_eq!(choice["message"]["content"], ANSWER, "{args:?}");
        assert!(choice["message"].get("tool_calls").is_none(), "{v}");
        assert_eq!(choice["finish_reason"], "stop");
    }
}

#[tokio::test]
async fn required_and_named_tool_choice_need_the_qwen25_parser_and_a_declared_tool() {
    // The constrained answer itself is checked on the real model (binary_structured.rs); here
    // the refusals: no parser, a parser whose format the grammar does not write, an unknown
    // function, and a grammar of the request's own on top.
    for (args, choice, needle) in [
        (&[][..], json!("required"), "--tool-call-parser qwen25"),
        (
            &["--tool-call-parser", "qwen3_coder"][..],
            json!("required"),
            "it runs with --tool-call-parser qwen3_coder",
        ),
        (
            &["--tool-call-parser", "qwen25"][..],
            json!({"type": "function", "function": {"name": "nope"}}),
            "\"nope\", which is not among the request's `tools`",
        ),
    ] {
        let s = start_with_script(args, 3, ANSWER).await;
        let r = s
            .post(
                "/v1/chat/completions",
                &request(json!({"tool_choice": choice})),
            )
            .await;
        assert_eq!(r.status, 400, "{}", r.body);
        let message = r.json()["message"].as_str().unwrap_or_default().to_string();
        assert!(message.contains(needle), "{needle:?} in {message}");
    }
    let s = start_with_script(&["--tool-call-parser", "qwen25"], 3, ANSWER).await;
    let r = s
        .post(
            "/v1/chat/completions",
            &request(json!({"tool_choice": "required", "regex": "a"})),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("both constrain the answer"), "{}", r.body);
    let r = s
        .post(
            "/v1/chat/completions",
            &request(json!({"tool_choice": "sometimes"})),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("`tool_choice` must be"), "{}", r.body);
}

#[tokio::test]
async fn parse_function_call_parses_a_finished_answer() {
    let s = start(&[], 3).await;
    let tools = request(json!({}))["tools"].clone();
    let r = s
        .post(
            "/parse_function_call",
            &json!({"text": ANSWER, "tools": tools, "tool_call_parser": "qwen25"}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["normal_text"], "Let me check.");
    assert_eq!(v["calls"][0]["tool_index"], 0);
    assert_eq!(v["calls"][0]["name"], "get_weather");
    let params: Value =
        serde_json::from_str(v["calls"][0]["parameters"].as_str().expect("parameters"))
            .expect("JSON");
    assert_eq!(params, json!({"city": "Paris", "unit": "celsius"}));
    // No parser named and none configured: a 400 that says so.
    let r = s
        .post(
            "/parse_function_call",
            &json!({"text": ANSWER, "tools": tools}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("--tool-call-parser"), "{}", r.body);
}
