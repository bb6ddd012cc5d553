//! End to end over HTTP: the real router and engine thread on an ephemeral loopback port, with a
//! scripted engine standing in for the model (it commits 3 tokens per step, as a speculative
//! engine commits a block). Snapshots are SSE payloads with run-dependent values normalized.

mod support;

use expect_test::expect;
use serde_json::json;
use support::{normalize, normalized_events, start};

#[tokio::test]
async fn generate_non_stream_returns_text_ids_and_spec_meta() {
    let s = start(&[], 3).await;
    let r = s
        .post("/generate", &json!({"text": "hi", "rid": "r1", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let mut v = r.json();
    normalize(&mut v);
    expect![[r#"{"text":"Hello world, this","output_ids":[4136,5690,11,835],"meta_info":{"id":"r1","finish_reason":{"type":"length","length":4},"prompt_tokens":1,"completion_tokens":4,"cached_tokens":0,"reasoning_tokens":0,"weight_version":"default","num_retractions":0,"e2e_latency":"<varies>","queue_time":"<varies>","spec_verify_ct":2,"spec_accept_length":2.0,"spec_accept_rate":0.5,"spec_num_correct_drafts":2,"spec_num_proposed_drafts":4,"spec_correct_drafts_histogram":[1,0,1],"spec_accept_token_num":2,"spec_draft_token_num":4,"spec_accepted_drafts":2,"spec_proposed_drafts":4,"spec_accept_histogram":[1,0,1]}}"#]]
    .assert_eq(&v.to_string());
}

#[tokio::test]
async fn generate_stream_sends_cumulative_text_then_done() {
    let s = start(&[], 3).await;
    let r = s
        .post("/generate", &json!({"text": "hi", "rid": "r2", "stream": true, "sampling_params": {"max_new_tokens": 5}}))
        .await;
    assert_eq!(r.status, 200);
    assert!(r
        .headers
        .to_ascii_lowercase()
        .contains("content-type: text/event-stream"));
    assert!(r.body.ends_with("data: [DONE]\n\n"));
    expect![[r#"
        {"text":"Hello world,","output_ids":[4136,5690,11],"meta_info":{"id":"r2","finish_reason":null,"prompt_tokens":1,"completion_tokens":3,"cached_tokens":0,"reasoning_tokens":0,"weight_version":"default","num_retractions":0}}
        {"text":"Hello world, this is","output_ids":[4136,5690,11,835,367],"meta_info":{"id":"r2","finish_reason":{"type":"length","length":5},"prompt_tokens":1,"completion_tokens":5,"cached_tokens":0,"reasoning_tokens":0,"weight_version":"default","num_retractions":0,"e2e_latency":"<varies>","queue_time":"<varies>","spec_verify_ct":2,"spec_accept_length":2.5,"spec_accept_rate":0.75,"spec_num_correct_drafts":3,"spec_num_proposed_drafts":4,"spec_correct_drafts_histogram":[0,1,1],"spec_accept_token_num":3,"spec_draft_token_num":4,"spec_accepted_drafts":3,"spec_proposed_drafts":4,"spec_accept_histogram":[0,1,1]}}
        [DONE]"#]].assert_eq(&normalized_events(&r));
}

#[tokio::test]
async fn generate_batch_returns_a_list_and_stream_chunks_carry_index() {
    let s = start(&[], 3).await;
    let r = s
        .post(
            "/generate",
            &json!({"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2}}),
        )
        .await;
    let v = r.json();
    assert_eq!(v.as_array().map(Vec::len), Some(2), "{v}");
    assert_eq!(v[1]["meta_info"]["prompt_tokens"], 1);
    let r = s
        .post(
            "/generate",
            &json!({"text": ["a", "b"], "stream": true, "sampling_params": {"max_new_tokens": 2}}),
        )
        .await;
    let events = r.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    for e in &events[..events.len() - 1] {
        let v: serde_json::Value = serde_json::from_str(e).expect("json");
        assert!(v["index"].is_u64(), "{e}");
    }
}

#[tokio::test]
async fn stop_string_split_across_a_multi_token_step_ends_the_output_before_it() {
    let s = start(&[], 3).await;
    let r = s
        .post(
            "/generate",
            &json!({"text": "hi", "sampling_params": {"max_new_tokens": 30, "stop": ["is a"]}}),
        )
        .await;
    let v = r.json();
    assert_eq!(v["text"], "Hello world, this ");
    assert_eq!(
        v["meta_info"]["finish_reason"],
        json!({"type": "stop", "matched": "is a"})
    );
    let completion = v["meta_info"]["completion_tokens"].as_u64().unwrap_or(0);
    assert!(completion < 30, "tokens after the stop leaked: {v}");
}

#[tokio::test]
async fn eos_stops_generation_and_is_trimmed_from_the_text() {
    let s = start(&[], 4).await;
    let r = s
        .post(
            "/generate",
            &json!({"text": "hi", "sampling_params": {"max_new_tokens": 100}}),
        )
        .await;
    let v = r.json();
    assert_eq!(v["text"], support::SCRIPT_TEXT);
    assert_eq!(
        v["meta_info"]["finish_reason"],
        json!({"type": "stop", "matched": 8188})
    );
}

#[tokio::test]
async fn chat_stream_follows_sglang_chunk_order_with_usage() {
    let s = start(&[], 3).await;
    let r = s
        .post(
            "/v1/chat/completions",
            &json!({"model": "tiny-coder-demo", "rid": "c1", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    expect![[r#"
        {"id":"c1","object":"chat.completion.chunk","created":"<varies>","model":"tiny-coder-demo","choices":[{"index":0,"delta":{"reasoning_content":null,"role":"assistant","content":""},"logprobs":null,"finish_reason":null,"matched_stop":null}]}
        {"id":"c1","object":"chat.completion.chunk","created":"<varies>","model":"tiny-coder-demo","choices":[{"index":0,"delta":{"reasoning_content":null,"content":"Hello world,"},"logprobs":null,"finish_reason":null,"matched_stop":null}]}
        {"id":"c1","object":"chat.completion.chunk","created":"<varies>","model":"tiny-coder-demo","choices":[{"index":0,"delta":{"reasoning_content":null,"content":" this"},"logprobs":null,"finish_reason":null,"matched_stop":null}]}
        {"id":"c1","object":"chat.completion.chunk","created":"<varies>","model":"tiny-coder-demo","choices":[{"index":0,"delta":{"reasoning_content":null},"logprobs":null,"finish_reason":"length","matched_stop":null}]}
        {"id":"c1","object":"chat.completion.chunk","created":"<varies>","model":"tiny-coder-demo","choices":[],"usage":{"prompt_tokens":11,"total_tokens":15,"completion_tokens":4,"reasoning_tokens":0}}
        [DONE]"#]].assert_eq(&normalized_events(&r));
}

#[tokio::test]
async fn chat_non_stream_returns_message_usage_and_meta_info_on_request() {
    let s = start(&[], 3).await;
    let r = s
        .post(
            "/v1/chat/completions",
            &json!({"rid": "c2", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                    "max_completion_tokens": 3, "return_meta_info": true,
                    "chat_template_kwargs": {"enable_thinking": false}}),
        )
        .await;
    let mut v = r.json();
    normalize(&mut v);
    expect![[r#"
        {
          "id": "c2",
          "object": "chat.completion",
          "created": "<varies>",
          "model": "tiny-coder-demo",
          "choices": [
            {
              "index": 0,
              "message": {
                "role": "assistant",
                "content": "Hello world,",
                "reasoning_content": null
              },
              "logprobs": null,
              "finish_reason": "length",
              "matched_stop": null,
              "meta_info": {
                "id": "c2",
                "finish_reason": {
                  "type": "length",
                  "length": 3
                },
                "prompt_tokens": 15,
                "completion_tokens": 3,
                "cached_tokens": 0,
                "reasoning_tokens": 0,
                "weight_version": "default",
                "num_retractions": 0,
                "e2e_latency": "<varies>",
                "queue_time": "<varies>",
                "spec_verify_ct": 1,
                "spec_accept_length": 3.0,
                "spec_accept_rate": 1.0,
                "spec_num_correct_drafts": 2,
                "spec_num_proposed_drafts": 2,
                "spec_correct_drafts_histogram": [
                  0,
                  0,
                  1
                ],
                "spec_accept_token_num": 2,
                "spec_draft_token_num": 2,
                "spec_accepted_drafts": 2,
                "spec_proposed_drafts": 2,
                "spec_accept_histogram": [
                  0,
                  0,
                  1
                ]
              }
            }
          ],
          "usage": {
            "prompt_tokens": 15,
            "total_tokens": 18,
            "completion_tokens": 3,
            "prompt_tokens_details": null,
            "reasoning_tokens": 0,
            "completion_tokens_details": null
          },
          "metadata": {
            "weight_version": "default"
          }
        }"#]]
    .assert_eq(&serde_json::to_string_pretty(&v).unwrap_or_default());
}

#[tokio::test]
async fn completions_non_stream_and_stream() {
    let s = start(&[], 3).await;
    let r = s
        .post(
            "/v1/completions",
            &json!({"rid": "p1", "prompt": "hi", "max_tokens": 3, "n": 2, "seed": 1}),
        )
        .await;
    let mut v = r.json();
    normalize(&mut v);
    expect![[r#"{"id":"p1","object":"text_completion","created":"<varies>","model":"tiny-coder-demo","choices":[{"index":0,"text":"Hello world,","logprobs":null,"finish_reason":"length","matched_stop":null},{"index":1,"text":"Hello world,","logprobs":null,"finish_reason":"length","matched_stop":null}],"usage":{"prompt_tokens":1,"total_tokens":7,"completion_tokens":6,"prompt_tokens_details":null,"reasoning_tokens":0,"completion_tokens_details":null},"metadata":{"weight_version":"default"}}"#]].assert_eq(&v.to_string());
    let r = s
        .post(
            "/v1/completions",
            &json!({"rid": "p2", "prompt": [1, 2], "max_tokens": 4, "stream": true,
                                          "stream_options": {"include_usage": true}}),
        )
        .await;
    expect![[r#"
        {"id":"p2","object":"text_completion","created":"<varies>","model":"tiny-coder-demo","choices":[{"index":0,"text":"Hello world,","logprobs":null,"finish_reason":null,"matched_stop":null}],"usage":null}
        {"id":"p2","object":"text_completion","created":"<varies>","model":"tiny-coder-demo","choices":[{"index":0,"text":" this","logprobs":null,"finish_reason":"length","matched_stop":null}],"usage":null}
        {"id":"p2","object":"text_completion","created":"<varies>","model":"tiny-coder-demo","choices":[],"usage":{"prompt_tokens":2,"total_tokens":6,"completion_tokens":4,"reasoning_tokens":0}}
        [DONE]"#]].assert_eq(&normalized_events(&r));
}

#[tokio::test]
async fn health_models_model_info_server_info_and_load() {
    let s = start(&["--served-model-name", "demo"], 3).await;
    let r = s.get("/health").await;
    assert_eq!((r.status, r.body.as_str()), (200, ""));
    assert_eq!(s.get("/health_generate").await.status, 200);
    let v = s.get("/v1/models").await.json();
    assert_eq!(v["data"][0]["id"], "demo");
    assert_eq!(v["data"][0]["max_model_len"], 4096);
    assert_eq!(s.get("/v1/models/nope").await.status, 404);
    for path in ["/get_model_info", "/model_info"] {
        let v = s.get(path).await.json();
        assert_eq!(v["model_type"], "qwen3");
        assert_eq!(v["is_generation"], true);
    }
    for path in ["/get_server_info", "/server_info"] {
        let v = s.get(path).await.json();
        assert!(
            v["internal_states"][0]["avg_spec_accept_length"].is_f64(),
            "{v}"
        );
        assert!(v["internal_states"][0]["last_gen_throughput"].is_number());
        assert_eq!(v["tp_size"], 1);
        assert_eq!(v["max_req_input_len"], 4095);
        // What sglang-router reads when it registers a worker (dp_size for --dp-aware).
        assert_eq!(v["dp_size"], 1);
        assert!(
            v["model_path"].is_string() && v["max_running_requests"].is_u64(),
            "{v}"
        );
    }
    expect![[r#"[{"dp_rank":0,"num_reqs":0,"num_waiting_reqs":0,"num_tokens":0}]"#]]
        .assert_eq(&s.get("/get_load").await.body);
    let r = s.request("POST", "/flush_cache", &[], b"").await;
    assert_eq!(r.status, 200);
    assert!(r.body.starts_with("Cache flushed."));
}

#[tokio::test]
async fn metrics_use_sglang_names_and_label_sets() {
    let s = start(&[], 3).await;
    s.post(
        "/generate",
        &json!({"text": "hi", "sampling_params": {"max_new_tokens": 3}}),
    )
    .await;
    let r = s.get("/metrics").await;
    assert_eq!(r.status, 200);
    for line in [
        // The tokenizer's request counters split by `is_streaming`, as SGLang's do.
        r#"sglang:num_requests_total{model_name="tiny-coder-demo",engine_type="unified",is_streaming="false"} 1"#,
        r#"sglang:num_requests_total{model_name="tiny-coder-demo",engine_type="unified",is_streaming="true"} 0"#,
        r#"sglang:generation_tokens_total{model_name="tiny-coder-demo",engine_type="unified",is_streaming="false"} 3"#,
        r#"sglang:prompt_tokens_total{model_name="tiny-coder-demo",engine_type="unified",is_streaming="false"} 1"#,
        // The scheduler's series carry the (single) ranks.
        r#"sglang:spec_verify_calls_total{model_name="tiny-coder-demo",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"} 1"#,
        r#"sglang:num_running_reqs{model_name="tiny-coder-demo",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"} 0"#,
    ] {
        assert!(r.body.contains(line), "missing {line} in\n{}", r.body);
    }
    assert!(r.body.contains("sglang:e2e_request_latency_seconds_bucket"));
}

#[tokio::test]
async fn bad_requests_get_400_in_the_route_shape_and_the_server_keeps_serving() {
    let s = start(&[], 3).await;
    let cases = [
        ("/v1/chat/completions", r#"{"messages": ["#.to_string()),
        (
            "/v1/chat/completions",
            r#"{"messages": [], "max_tokens": 3}"#.to_string(),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}"#.to_string(),
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "top_p": 0}"#.to_string(),
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "max_tokens": 5000}"#.to_string(),
        ),
        (
            "/v1/completions",
            format!(r#"{{"prompt": {:?}}}"#, vec![1; 5000]),
        ),
        ("/generate", r#"{"sampling_params": {}}"#.to_string()),
        ("/generate", r#"{"input_ids": [7777]}"#.to_string()),
    ];
    let mut out = Vec::new();
    for (path, body) in cases {
        let r = s
            .request(
                "POST",
                path,
                &[("Content-Type", "application/json")],
                body.as_bytes(),
            )
            .await;
        out.push(format!("{} {path} {}", r.status, r.body));
    }
    let r = s
        .request(
            "POST",
            "/v1/completions",
            &[("Content-Type", "text/plain")],
            b"{}",
        )
        .await;
    out.push(format!("{} {}", r.status, r.body));
    let r = s
        .request(
            "POST",
            "/generate",
            &[("Content-Type", "application/json")],
            b"{\"text\": \"\xff\"}",
        )
        .await;
    out.push(format!("{} {}", r.status, r.body));
    expect![[r#"
        400 /v1/chat/completions {"object":"error","message":"Invalid JSON body (send well-formed JSON): EOF while parsing a list at line 1 column 14","type":"BadRequestError","param":null,"code":400}
        400 /v1/chat/completions {"object":"error","message":"`messages` must be a non-empty list of {\"role\", \"content\"} objects","type":"BadRequestError","param":null,"code":400}
        400 /v1/chat/completions {"object":"error","message":"Invalid JSON body: invalid type: string \"hot\", expected f64 at line 1 column 70","type":"BadRequestError","param":null,"code":400}
        400 /v1/completions {"object":"error","message":"`top_p` must be in (0, 1]. Given: 0","type":"BadRequestError","param":null,"code":400}
        400 /v1/completions {"object":"error","message":"Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of 5001 tokens: 1 tokens from the input messages and 5000 tokens for the completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.","type":"BadRequestError","param":null,"code":400}
        400 /v1/completions {"object":"error","message":"The input (5000 tokens) is longer than the model's context length (4096 tokens).","type":"BadRequestError","param":null,"code":400}
        400 /generate {"error":{"message":"Either text, input_ids or input_embeds should be provided."}}
        400 /generate {"error":{"message":"token 7777 is refused by the test engine"}}
        400 {"object":"error","message":"Unsupported Media Type: Only 'application/json' is allowed","type":"BadRequestError","param":null,"code":400}
        400 {"error":{"message":"The request body is not valid UTF-8 (invalid byte at offset 10); send UTF-8 encoded JSON"}}"#]].assert_eq(&out.join("\n"));
    assert_eq!(
        s.post("/generate", &json!({"text": "ok"})).await.status,
        200
    );
}

/// A device error while admitting one request (the test engine's token 7778 fails as a CUDA
/// out-of-memory would) is the server's fault: that request gets a 500 saying what happened,
/// a request admitted beside it completes, and the server keeps serving.
#[tokio::test]
async fn a_device_error_at_admission_is_a_500_and_other_requests_go_on() {
    let s = start(&[], 3).await;
    let bad_body = json!({"input_ids": [7778]});
    let good_body = json!({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}});
    let (bad, good) = tokio::join!(
        s.post("/generate", &bad_body),
        s.post("/generate", &good_body)
    );
    assert_eq!(bad.status, 500, "{}", bad.body);
    assert!(
        bad.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("CUDA_ERROR_OUT_OF_MEMORY")),
        "{}",
        bad.body
    );
    assert_eq!(good.status, 200, "{}", good.body);
    assert_eq!(good.json()["meta_info"]["completion_tokens"], 4);
    assert_eq!(s.get("/health").await.status, 200);
    assert_eq!(
        s.post("/v1/completions", &json!({"prompt": [7778]}))
            .await
            .status,
        500
    );
}

#[tokio::test]
async fn oversized_bodies_get_413_in_the_flat_shape() {
    let s = start(&["--max-request-body-bytes", "64"], 3).await;
    let body = json!({"prompt": "x".repeat(200)}).to_string();
    let r = s
        .request(
            "POST",
            "/v1/completions",
            &[("Content-Type", "application/json")],
            body.as_bytes(),
        )
        .await;
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(r.json()["object"], "error");
}

#[tokio::test]
async fn api_key_is_required_except_for_health_and_metrics() {
    let s = start(&["--api-key", "sekret"], 3).await;
    let r = s.get("/v1/models").await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (401, r#"{"error":"Unauthorized"}"#)
    );
    let ok = s
        .request(
            "GET",
            "/v1/models",
            &[("Authorization", "Bearer sekret")],
            b"",
        )
        .await;
    assert_eq!(ok.status, 200);
    let wrong = s
        .request(
            "GET",
            "/v1/models",
            &[("Authorization", "Bearer nope")],
            b"",
        )
        .await;
    assert_eq!(wrong.status, 401);
    assert_eq!(s.get("/health").await.status, 200);
    assert_eq!(s.get("/metrics").await.status, 200);
}

#[tokio::test]
async fn reasoning_parser_separates_think_text_streamed_and_not() {
    let script = "<think>\nCheck the edge cases.\n</think>\n\nHello world";
    let s = support::start_with_script(&["--reasoning-parser", "qwen3"], 2, script).await;
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40});
    let r = s.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(
        v["choices"][0]["message"]["reasoning_content"],
        "Check the edge cases.\n"
    );
    assert_eq!(v["choices"][0]["message"]["content"], "Hello world");
    let reasoning_tokens = v["usage"]["reasoning_tokens"]
        .as_u64()
        .expect("reasoning_tokens");
    assert!(reasoning_tokens > 2, "{v}");
    assert_eq!(
        v["usage"]["completion_tokens_details"]["reasoning_tokens"],
        reasoning_tokens
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = s.post("/v1/chat/completions", &streamed).await;
    let (mut reasoning, mut content) = (String::new(), String::new());
    for e in r.events() {
        if e == "[DONE]" {
            continue;
        }
        let c: serde_json::Value = serde_json::from_str(&e).expect("chunk");
        let delta = &c["choices"][0]["delta"];
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
        content.push_str(delta["content"].as_str().unwrap_or_default());
    }
    assert_eq!(reasoning, "\nCheck the edge cases.");
    assert_eq!(content, "\n\nHello world");

    // Thinking switched off in the template, or separation off: all of it is content.
    for extra in [
        json!({"chat_template_kwargs": {"enable_thinking": false}}),
        json!({"separate_reasoning": false}),
    ] {
        let mut b = body.clone();
        b.as_object_mut()
            .expect("object")
            .extend(extra.as_object().expect("object").clone());
        let v = s.post("/v1/chat/completions", &b).await.json();
        assert!(
            v["choices"][0]["message"]["reasoning_content"].is_null(),
            "{v}"
        );
        assert_eq!(v["choices"][0]["message"]["content"], script);
    }
}

#[tokio::test]
async fn return_spec_tokens_details_adds_sglext_streamed_and_not() {
    let s = start(&[], 3).await;
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
        "return_spec_tokens_details": true});
    let v = s.post("/v1/chat/completions", &body).await.json();
    let d = &v["sglext"]["spec_tokens_details"];
    assert_eq!(d["spec_verify_ct"], 2, "{v}");
    assert_eq!(d["spec_accept_length"], 3.0);
    assert!(
        d.get("spec_accept_token_num").is_none(),
        "legacy names stay in meta_info"
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = s.post("/v1/chat/completions", &streamed).await.events();
    let ext: serde_json::Value =
        serde_json::from_str(&events[events.len() - 2]).expect("sglext chunk");
    assert_eq!(ext["choices"], json!([]));
    assert_eq!(ext["sglext"]["spec_tokens_details"], *d);
}
