//! The prefix cache through the real binary on the bundled demo pair (f32, CPU): a multi-turn
//! chat (the same system prompt and a growing history) reports cached prompt tokens from the
//! second turn on, in `usage.prompt_tokens_details` (with --enable-cache-report) and in
//! /generate's `meta_info`, and its greedy answers are identical to a server started with
//! --disable-radix-cache, with speculation (DDTree, chain) and without; /flush_cache empties it.

mod support;

use serde_json::{json, Value};
use support::binary::ServerProcess;

const SYSTEM: &str = "You are a careful senior Python engineer. Answer with short, correct, \
idiomatic code and no prose. Prefer the standard library, type hints and small pure functions. \
Every function has a docstring, handles empty input, and raises ValueError on bad arguments. \
Tests use pytest and cover the edge cases: empty lists, one element, duplicates, negative \
numbers, very large inputs and unicode strings. Keep lines under 88 characters.";

const TURNS: [&str; 3] = [
    "Write a function that reverses a string.",
    "Now make it skip whitespace.",
    "Add a pytest test for it.",
];

/// Runs the chat on `server`: each turn's answer and its cached prompt tokens.
async fn chat(p: &ServerProcess) -> Vec<(String, u64)> {
    let mut messages = vec![json!({"role": "system", "content": SYSTEM})];
    let mut out = Vec::new();
    for turn in TURNS {
        messages.push(json!({"role": "user", "content": turn}));
        let body = json!({"model": "m", "messages": messages, "max_tokens": 24,
            "temperature": 0});
        let r = p.server.post("/v1/chat/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let answer = v["choices"][0]["message"]["content"]
            .as_str()
            .expect("content")
            .to_string();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("cached_tokens in usage: {v}"));
        messages.push(json!({"role": "assistant", "content": answer}));
        out.push((answer, cached));
    }
    out
}

async fn generate_cached_tokens(p: &ServerProcess, text: &str) -> (Value, u64) {
    let body = json!({"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}});
    let r = p.server.post("/generate", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let cached = v["meta_info"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens");
    (v["output_ids"].clone(), cached)
}

#[tokio::test]
async fn a_multi_turn_chat_reuses_cached_pages_and_answers_as_without_the_cache() {
    for mode in [
        &["--speculative-algorithm", "NONE"][..],
        &[][..],
        &["--speculative-verify", "chain"][..],
    ] {
        let with = |extra: &[&'static str]| {
            let mut a: Vec<&str> = mode.to_vec();
            a.extend_from_slice(extra);
            a.extend_from_slice(&["--skip-server-warmup", "--enable-cache-report"]);
            a
        };
        let cached = ServerProcess::start(&with(&[])).await;
        let uncached = ServerProcess::start(&with(&["--disable-radix-cache"])).await;
        let got = chat(&cached).await;
        let want = chat(&uncached).await;
        for (k, ((a, c), (b, u))) in got.iter().zip(&want).enumerate() {
            assert_eq!(a, b, "{mode:?}: turn {k} answers differ");
            assert_eq!(*u, 0, "{mode:?}: no cache, nothing cached");
            if k == 0 {
                assert_eq!(*c, 0, "{mode:?}: nothing cached before the first turn");
            } else {
                assert!(*c >= 64, "{mode:?}: turn {k} found {c} cached tokens");
            }
        }
        let info = cached.server.get("/server_info").await.json();
        assert_eq!(info["disable_radix_cache"], false, "{info}");

        // /generate reports it in meta_info; a flush empties the cache.
        let text = format!("{SYSTEM}\n{SYSTEM}\ndef main():");
        let (first, c0) = generate_cached_tokens(&cached, &text).await;
        let (again, c1) = generate_cached_tokens(&cached, &text).await;
        assert_eq!(first, again);
        assert_eq!(c0, 0, "{mode:?}");
        assert!(c1 >= 128, "{mode:?}: {c1}");
        let r = cached
            .server
            .request("POST", "/flush_cache", &[], b"")
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
        let (after, c2) = generate_cached_tokens(&cached, &text).await;
        assert_eq!(after, first);
        assert_eq!(c2, 0, "{mode:?}: nothing cached after a flush");
    }
}
