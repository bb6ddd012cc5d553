//! A device failure in one sequence's step (the scripted engine fails any sequence whose prompt
//! holds token 7779 after its first tokens, as the real engine reports a forward that fails for
//! one sequence): that request ends with a 500 naming the failure, streamed or not, the
//! requests running beside it complete, and /health stays 200.

mod support;

use serde_json::json;
use support::start;

#[tokio::test]
async fn a_failing_sequence_gets_a_500_and_the_others_complete() {
    let s = start(&[], 2).await;
    let ok = json!({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 12}});
    let bad = json!({"input_ids": [1, 7779, 3], "sampling_params": {"max_new_tokens": 12}});
    let mut bad_stream = bad.clone();
    bad_stream["stream"] = json!(true);
    let (a, b, c, d) = tokio::join!(
        s.post("/generate", &ok),
        s.post("/generate", &bad),
        s.post("/generate", &ok),
        s.post("/generate", &bad_stream),
    );
    for r in [&a, &c] {
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["meta_info"]["completion_tokens"], 12);
    }
    assert_eq!(b.status, 500, "{}", b.body);
    let err = b.json();
    assert!(
        err["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("failed on the device")),
        "{err}"
    );
    // A stream that already sent tokens ends with an error event.
    assert_eq!(d.status, 200);
    assert!(
        d.body.contains("failed on the device"),
        "the stream carries the error: {}",
        d.body
    );
    assert_eq!(s.get("/health").await.status, 200);
    let again = s.post("/generate", &ok).await;
    assert_eq!(again.status, 200, "{}", again.body);
}
