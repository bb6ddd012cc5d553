use std::path::PathBuf;

use super::*;
use crate::tokenizer::{Decode, Tokenizer, TokenizerError};

/// A byte-level toy vocabulary: id = one byte, so any UTF-8 character spans several ids.
struct Bytes;

impl Decode for Bytes {
    fn decode_ids(&self, ids: &[u32], _skip: bool) -> Result<String, TokenizerError> {
        let bytes: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

fn ids(s: &str) -> Vec<u32> {
    s.bytes().map(u32::from).collect()
}

#[test]
fn never_emits_half_a_character() {
    let mut dec = IncrementalDecoder::new(true);
    let mut out = Vec::new();
    for id in ids("a€🦀b") {
        let delta = dec.push(&Bytes, &[id]).expect("decodes");
        assert!(!delta.contains('\u{FFFD}'), "{delta:?}");
        out.push(delta);
    }
    assert_eq!(out.concat(), "a€🦀b");
    assert_eq!(out, ["a", "", "", "€", "", "", "", "🦀", "b"]);
}

#[test]
fn multi_token_pushes_release_everything_complete() {
    let mut dec = IncrementalDecoder::new(true);
    let all = ids("xé");
    assert_eq!(dec.push(&Bytes, &all[..2]).expect("decodes"), "");
    assert_eq!(dec.push(&Bytes, &all[2..]).expect("decodes"), "xé");
}

#[test]
fn finish_flushes_an_incomplete_trailing_character() {
    let mut dec = IncrementalDecoder::new(true);
    let all = ids("€");
    assert_eq!(dec.push(&Bytes, &all[..2]).expect("decodes"), "");
    assert_eq!(dec.finish(&Bytes).expect("decodes"), "\u{FFFD}");
}

#[test]
fn demo_tokenizer_round_trips_non_ascii_token_by_token() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../serve/assets/tiny-coder-demo");
    let tok = Tokenizer::from_dir(&dir).expect("loads");
    assert_eq!(tok.vocab_size(), 8192);
    assert_eq!(tok.eos_token_ids(), &[8188, 8186]);
    let text = "def f():\n    return 'héllo 世界 🦀'\n";
    let all = tok.encode(text, false).expect("encodes");
    let mut dec = IncrementalDecoder::new(true);
    let mut out = String::new();
    for id in &all {
        let delta = dec.push(&tok, &[*id]).expect("decodes");
        assert!(!delta.contains('\u{FFFD}'), "{delta:?}");
        out.push_str(&delta);
    }
    out.push_str(&dec.finish(&tok).expect("decodes"));
    assert_eq!(out, text);
}

#[test]
fn stop_string_split_across_pushes_is_found_and_trimmed() {
    let mut m = StopMatcher::new(vec!["STOP".into()], false);
    assert_eq!(m.push("abc ST").released, "abc ");
    let scan = m.push("OP tail");
    assert_eq!(scan.released, "");
    assert_eq!(
        scan.matched,
        Some(StopMatch {
            stop: "STOP".into(),
            start: 4
        })
    );
    assert_eq!(m.released_text(), "abc ");
}

#[test]
fn no_stop_trim_keeps_the_stop_string() {
    let mut m = StopMatcher::new(vec!["\n\n".into()], true);
    assert_eq!(m.push("x\n").released, "x");
    let scan = m.push("\ny");
    assert_eq!(scan.released, "\n\n");
    assert!(scan.matched.is_some());
}

#[test]
fn held_back_prefix_is_released_when_it_stops_matching() {
    let mut m = StopMatcher::new(vec!["</end>".into()], false);
    assert_eq!(m.push("a</e").released, "a");
    assert_eq!(m.push("x").released, "</ex");
    assert_eq!(m.push("</").released, "");
    assert_eq!(m.flush(), "</");
}

#[test]
fn earliest_stop_wins_over_a_later_one_in_the_same_push() {
    let mut m = StopMatcher::new(vec!["b".into(), "a".into()], false);
    let scan = m.push("xxab");
    assert_eq!(scan.released, "xx");
    assert_eq!(scan.matched.map(|s| s.stop), Some("a".to_string()));
}

#[test]
fn held_back_bytes_never_split_a_character() {
    let mut m = StopMatcher::new(vec!["é!".into()], false);
    assert_eq!(m.push("aé").released, "a");
    assert_eq!(m.push("?").released, "é?");
}
