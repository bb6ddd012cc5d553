//! Reference: the fixture's own template, rendered by `transformers` 5.24.0 (see
//! ../shared/fixtures/README.md, "Tokenizer"); token ids are the `input_ids` recorded in
//! tests/fixtures/greedy/coding-prompts.json, which were rendered with `enable_thinking=False`.

use std::path::PathBuf;

use expect_test::expect;
use serde_json::{json, Map, Value as Json};

use super::*;
use crate::tokenizer::Tokenizer;

fn demo_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../serve/assets/tiny-coder-demo")
}

fn demo() -> (Tokenizer, ChatTemplate) {
    let tok = Tokenizer::from_dir(&demo_dir()).expect("demo tokenizer loads");
    let tpl = ChatTemplate::from_model(&demo_dir(), tok.config(), None).expect("template compiles");
    (tok, tpl)
}

fn kwargs(v: Json) -> Map<String, Json> {
    v.as_object().cloned().unwrap_or_default()
}

fn render(
    tpl: &ChatTemplate,
    messages: &[Json],
    gen: bool,
    kw: Option<&Map<String, Json>>,
) -> String {
    tpl.render(&ChatRenderInput {
        messages,
        tools: None,
        add_generation_prompt: gen,
        kwargs: kw,
    })
    .expect("renders")
}

#[test]
fn demo_template_without_thinking_matches_transformers() {
    let (_, tpl) = demo();
    let kw = kwargs(json!({"enable_thinking": false}));
    let out = render(
        &tpl,
        &[json!({"role": "user", "content": "Write a trie."})],
        true,
        Some(&kw),
    );
    assert_eq!(
        out,
        "<|im_start|>user\nWrite a trie.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
}

#[test]
fn unset_enable_thinking_is_undefined_so_the_model_opens_its_own_think_block() {
    let (_, tpl) = demo();
    let out = render(
        &tpl,
        &[json!({"role": "user", "content": "Write a trie."})],
        true,
        None,
    );
    expect![[r#"
        <|im_start|>user
        Write a trie.<|im_end|>
        <|im_start|>assistant
    "#]]
    .assert_eq(&out);
}

#[test]
fn final_assistant_turn_keeps_reasoning_and_earlier_turns_drop_it() {
    let (_, tpl) = demo();
    let messages = [
        json!({"role": "system", "content": "Be brief."}),
        json!({"role": "user", "content": "hi"}),
        json!({"role": "assistant", "content": "<think>\nold\n</think>\n\nhello"}),
        json!({"role": "user", "content": "again"}),
        json!({"role": "assistant", "content": "ok", "reasoning_content": "\nthink more\n"}),
    ];
    let out = render(&tpl, &messages, false, None);
    expect![[r#"
        <|im_start|>system
        Be brief.<|im_end|>
        <|im_start|>user
        hi<|im_end|>
        <|im_start|>assistant
        hello<|im_end|>
        <|im_start|>user
        again<|im_end|>
        <|im_start|>assistant
        <think>
        think more
        </think>

        ok<|im_end|>
    "#]]
    .assert_eq(&out);
}

/// First record of ../shared/fixtures/corpus/prompts-coding.jsonl (`lru-cache`), copied verbatim.
const LRU_CACHE_PROMPT: &str = "Write a Python class `LRUCache` with `get(key)` and `put(key, value)` methods. It has a fixed capacity and evicts the least recently used entry when it is full.";

#[test]
fn rendered_lru_cache_prompt_tokenizes_to_the_greedy_fixture_input_ids() {
    let (tok, tpl) = demo();
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/greedy/coding-prompts.json");
    let text = std::fs::read_to_string(&fixture).expect("greedy fixture present");
    let v: Json = serde_json::from_str(&text).expect("fixture is JSON");
    let case = &v["models"]["tiny-coder-demo"][0];
    assert_eq!(case["id"], "lru-cache");
    let want: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).expect("ids");

    let messages = [json!({"role": "user", "content": LRU_CACHE_PROMPT})];
    let no_think = kwargs(json!({"enable_thinking": false}));
    let ids = tok
        .encode(&render(&tpl, &messages, true, Some(&no_think)), false)
        .expect("encodes");
    assert_eq!(ids, want);

    let thinking = tok
        .encode(&render(&tpl, &messages, true, None), false)
        .expect("encodes");
    assert_ne!(
        thinking, want,
        "enable_thinking unset must not reproduce the fixture"
    );
}

#[test]
fn raise_exception_surfaces_the_template_message() {
    let tpl = ChatTemplate::new(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}ok".into(),
        None,
        None,
    )
    .expect("compiles");
    let err = tpl
        .render(&ChatRenderInput {
            messages: &[json!({"role": "assistant", "content": "x"})],
            ..Default::default()
        })
        .expect_err("raises");
    assert!(matches!(err, TemplateError::Raised { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "Conversation roles must alternate user/assistant"
    );
}

#[test]
fn tojson_matches_python_json_dumps() {
    let tpl = ChatTemplate::new(
        "{{ tools[0] | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ tools[1] | tojson(sort_keys=true) }}|{{ messages[0].content | tojson }}".into(),
        None,
        None,
    )
    .expect("compiles");
    let tools = [
        json!({"name": "f", "parameters": {"type": "object", "required": ["a", "b"], "x": []}}),
        json!({"z": 1, "a": 2.5}),
    ];
    let out = tpl
        .render(&ChatRenderInput {
            messages: &[json!({"role": "user", "content": "<é \"q\">"})],
            tools: Some(&tools),
            ..Default::default()
        })
        .expect("renders");
    expect![[r#"
        {"name": "f", "parameters": {"type": "object", "required": ["a", "b"], "x": []}}|{
          "name": "f",
          "parameters": {
            "type": "object",
            "required": [
              "a",
              "b"
            ],
            "x": []
          }
        }|{"a": 2.5, "z": 1}|"<é \"q\">""#]]
    .assert_eq(&out);
}

#[test]
fn pycompat_methods_and_trim_blocks_behave_like_jinja2() {
    let tpl = ChatTemplate::new(
        "{% for m in messages %}\n  {{ m.content.strip().upper() }}|{{ m.content.split(',')[1] }}\n{% endfor %}".into(),
        None,
        None,
    )
    .expect("compiles");
    let out = tpl
        .render(&ChatRenderInput {
            messages: &[json!({"role": "user", "content": " a,b "})],
            ..Default::default()
        })
        .expect("renders");
    assert_eq!(out, "  A,B|b \n");
}

#[test]
fn list_valued_chat_template_picks_default_or_the_named_one() {
    let config: crate::tokenizer::TokenizerConfig = serde_json::from_value(json!({
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "plain"}
        ]
    }))
    .expect("config");
    let dir = demo_dir();
    let plain = ChatTemplate::from_model(&dir, &config, None).expect("default");
    assert_eq!(
        plain.render(&ChatRenderInput::default()).expect("renders"),
        "plain"
    );
    let tools = ChatTemplate::from_model(&dir, &config, Some("tool_use")).expect("named");
    assert_eq!(
        tools.render(&ChatRenderInput::default()).expect("renders"),
        "tools"
    );
    let err = ChatTemplate::from_model(&dir, &config, Some("rag")).expect_err("unknown");
    assert_eq!(
        err.to_string(),
        "tokenizer_config.json has no chat template named `rag`; it has: tool_use, default"
    );
}
