//! Structured output from the real binary on the bundled demo pair (llguidance, f32, CPU):
//! `/generate`'s `json_schema`, `regex` and `ebnf` and the OpenAI routes' `response_format`
//! give answers that parse / match, identical with DFLASH speculation (DDTree and chain) and
//! without, streamed and not; `tool_choice` `required` and a named function return a parsed
//! tool call, streamed in OpenAI's chunk order; bad grammars and unshipped backends are refused.

mod support;

use serde_json::{json, Value};
use support::binary::ServerProcess;

fn schema() -> Value {
    json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"}},
        "required": ["name", "size", "ok"], "additionalProperties": false})
}

fn check_object(text: &str) {
    let v: Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
    assert!(v["name"].is_string(), "{v}");
    assert!(v["size"].as_u64().is_some_and(|n| n <= 999), "{v}");
    assert!(v["ok"].is_boolean(), "{v}");
    assert_eq!(v.as_object().map(|o| o.len()), Some(3), "{v}");
}

/// `[a-z]{1,10} = [0-9]{1,4};`, checked by hand.
fn check_assignment(text: &str) {
    let ok = text.split_once(" = ").is_some_and(|(name, rest)| {
        let num = rest.strip_suffix(';').unwrap_or("");
        (1..=10).contains(&name.len())
            && name.chars().all(|c| c.is_ascii_lowercase())
            && (1..=4).contains(&num.len())
            && num.chars().all(|c| c.is_ascii_digit())
    });
    assert!(ok, "{text:?} does not match the regex");
}

async fn generate_text(p: &ServerProcess, prompt: &str, grammar: &Value, stream: bool) -> String {
    let mut params = json!({"max_new_tokens": 64, "temperature": 0});
    if let (Some(o), Some(g)) = (params.as_object_mut(), grammar.as_object()) {
        o.extend(g.clone());
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
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "stop", "{v}");
    v["text"].as_str().expect("text").to_string()
}

#[tokio::test]
async fn grammar_outputs_match_and_are_the_same_with_and_without_speculation() {
    let plain =
        ServerProcess::start(&["--speculative-algorithm", "NONE", "--skip-server-warmup"]).await;
    let ddtree = ServerProcess::start(&["--skip-server-warmup"]).await;
    let chain =
        ServerProcess::start(&["--speculative-verify", "chain", "--skip-server-warmup"]).await;
    let grammars = [
        json!({"json_schema": schema().to_string()}),
        json!({"regex": "[a-z]{1,10} = [0-9]{1,4};"}),
        json!({"ebnf": "root ::= \"def \" name \"(\" name \"):\"\nname ::= [a-z]{1,10}"}),
    ];
    for prompt in ["def fibonacci(n):", "import os\n", "x = "] {
        for (k, g) in grammars.iter().enumerate() {
            let want = generate_text(&plain, prompt, g, false).await;
            match k {
                0 => check_object(&want),
                1 => check_assignment(&want),
                _ => assert!(
                    want.starts_with("def ") && want.ends_with("):") && want.contains('('),
                    "{want:?}"
                ),
            }
            for (name, server) in [("ddtree", &ddtree), ("chain", &chain)] {
                for stream in [false, true] {
                    let got = generate_text(server, prompt, g, stream).await;
                    assert_eq!(got, want, "{name} (stream {stream}) {g} on {prompt:?}");
                }
            }
        }
    }
    // OpenAI's response_format on chat (streamed and not) and completions.
    let chat = |stream: bool| {
        json!({"model": "m", "messages": [{"role": "user", "content": "Describe a file as JSON."}],
            "max_tokens": 64, "temperature": 0, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "file", "schema": schema()}}})
    };
    let mut contents = Vec::new();
    for server in [&plain, &ddtree] {
        let r = server
            .server
            .post("/v1/chat/completions", &chat(false))
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        let content = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string();
        check_object(&content);
        let r = server
            .server
            .post("/v1/chat/completions", &chat(true))
            .await;
        let streamed: String = r
            .events()
            .iter()
            .filter(|e| *e != "[DONE]")
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter_map(|v| {
                v["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_string)
            })
            .collect();
        assert_eq!(streamed, content, "streamed chat content");
        contents.push(content);
    }
    assert_eq!(
        contents[0], contents[1],
        "chat: same JSON with DDTree speculation"
    );
    let completion = json!({"model": "m", "prompt": "{", "max_tokens": 64, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema()}}});
    let mut texts = Vec::new();
    for server in [&plain, &chain] {
        let v = server
            .server
            .post("/v1/completions", &completion)
            .await
            .json();
        let text = v["choices"][0]["text"].as_str().unwrap_or("").to_string();
        check_object(&text);
        texts.push(text);
    }
    assert_eq!(texts[0], texts[1]);
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "add",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a", "b"], "additionalProperties": false}}}])
}

#[tokio::test]
async fn required_and_named_tool_choice_return_a_parsed_call_streamed_in_openai_order() {
    let args = ["--tool-call-parser", "qwen25", "--skip-server-warmup"];
    let ddtree = ServerProcess::start(&args).await;
    let plain =
        ServerProcess::start(&[&args[..], &["--speculative-algorithm", "NONE"]].concat()).await;
    let body = |choice: Value, stream: bool| {
        json!({"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": tools(), "tool_choice": choice, "max_tokens": 400, "temperature": 0,
            "stream": stream})
    };
    let named = json!({"type": "function", "function": {"name": "add"}});
    for choice in [json!("required"), named.clone()] {
        let mut answers = Vec::new();
        for server in [&plain, &ddtree] {
            let r = server
                .server
                .post("/v1/chat/completions", &body(choice.clone(), false))
                .await;
            assert_eq!(r.status, 200, "{}", r.body);
            let v = r.json();
            let choice0 = &v["choices"][0];
            assert_eq!(choice0["finish_reason"], "tool_calls", "{v}");
            let calls = choice0["message"]["tool_calls"]
                .as_array()
                .expect("tool_calls")
                .clone();
            assert!(!calls.is_empty(), "{v}");
            for c in &calls {
                let name = c["function"]["name"].as_str().unwrap_or("");
                assert!(["get_weather", "add"].contains(&name), "{c}");
                if choice == named {
                    assert_eq!(name, "add", "{c}");
                }
                let args: Value =
                    serde_json::from_str(c["function"]["arguments"].as_str().unwrap_or(""))
                        .unwrap_or_else(|e| panic!("arguments of {c} are not JSON: {e}"));
                assert!(
                    args.is_object() && args.as_object().is_some_and(|o| o.len() == 2),
                    "{args}"
                );
                assert!(
                    c["id"].as_str().is_some_and(|id| id.starts_with("call_")),
                    "{c}"
                );
            }
            let stripped: Vec<Value> = calls.iter().map(|c| c["function"].clone()).collect();
            answers.push(stripped);
        }
        assert_eq!(
            answers[0], answers[1],
            "{choice}: same calls with DDTree speculation"
        );

        // Streamed: role chunk first, then per call a chunk with id/type/name and one with the
        // arguments, then the finish chunk with tool_calls.
        let r = ddtree
            .server
            .post("/v1/chat/completions", &body(choice.clone(), true))
            .await;
        let chunks: Vec<Value> = r
            .events()
            .iter()
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str(e).expect("chunk json"))
            .collect();
        assert_eq!(
            chunks[0]["choices"][0]["delta"]["role"], "assistant",
            "{:?}",
            chunks[0]
        );
        let deltas: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
            .flatten()
            .collect();
        assert!(
            deltas.len() >= 2 && deltas.len().is_multiple_of(2),
            "{deltas:?}"
        );
        for pair in deltas.chunks(2) {
            assert!(
                pair[0]["id"].is_string() && pair[0]["function"]["name"].is_string(),
                "{pair:?}"
            );
            assert!(
                pair[1]["id"].is_null() && pair[1]["function"]["arguments"].is_string(),
                "{pair:?}"
            );
        }
        let names: Vec<Value> = deltas
            .chunks(2)
            .map(|p| p[0]["function"]["name"].clone())
            .collect();
        let want: Vec<Value> = answers[1].iter().map(|f| f["name"].clone()).collect();
        assert_eq!(names, want, "streamed calls equal the whole answer's");
        let finish = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
            .next_back();
        assert_eq!(finish, Some("tool_calls"));
    }
    // A function not among the tools, and required without the parser, are 400s.
    let r = ddtree
        .server
        .post(
            "/v1/chat/completions",
            &body(
                json!({"type": "function", "function": {"name": "nope"}}),
                false,
            ),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("nope"), "{}", r.body);
}

#[tokio::test]
async fn bad_grammars_and_unshipped_backends_are_refused() {
    let p =
        ServerProcess::start(&["--speculative-algorithm", "NONE", "--skip-server-warmup"]).await;
    for (params, needle) in [
        (json!({"regex": "(unclosed"}), "regex"),
        (json!({"json_schema": "{not json"}), "json_schema"),
        (
            json!({"regex": "a", "ebnf": "root ::= \"a\""}),
            "Only one of",
        ),
    ] {
        let r = p
            .server
            .post(
                "/generate",
                &json!({"text": "x", "sampling_params": params}),
            )
            .await;
        assert_eq!(r.status, 400, "{params}: {}", r.body);
        assert!(r.body.contains(needle), "{params}: {}", r.body);
    }
    let r = p
        .server
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "structural_tag"}}),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["object"], "error");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dflash-serve"))
        .args(["--grammar-backend", "xgrammar", "--port", "1"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--grammar-backend") && err.contains("llguidance"),
        "{err}"
    );
}
