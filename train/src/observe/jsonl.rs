//! `metrics.jsonl` across resumes: one record per step, however often the run was restarted.
//!
//! A run resumes from its last checkpoint, not from its last step: the steps after that
//! checkpoint (a crash, or a fallback past a damaged checkpoint) are trained again and would be
//! logged twice. So before appending, the file is cut back to the records of the steps the
//! resumed state already contains, `step <= start` (every record carries its step; a fresh run
//! has `start = 0` and starts empty). A last line without its newline was torn by a crash and is
//! dropped with the rest.

use std::fs::{File, OpenOptions};
use std::path::Path;

use serde_json::Value;

use crate::durable;

/// Opens `path` for appending, after dropping every record of a step after `start` (rewritten
/// through a durable rename, so a crash here leaves the old file or the cut one).
pub fn open_from_step(path: &Path, start: usize) -> std::io::Result<File> {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let kept = records_through(&text, start);
            if kept.len() != text.len() {
                durable::write_atomic(path, kept.as_bytes())?;
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    OpenOptions::new().create(true).append(true).open(path)
}

/// The complete lines of `text` whose record has a `step` of at most `start`.
fn records_through(text: &str, start: usize) -> String {
    text.split_inclusive('\n')
        .filter(|line| {
            line.ends_with('\n')
                && serde_json::from_str::<Value>(line)
                    .ok()
                    .and_then(|v| v.get("step")?.as_u64())
                    .is_some_and(|s| s <= start as u64)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::records_through;

    #[test]
    fn records_after_the_resumed_step_and_a_torn_last_line_are_dropped() {
        let text = "{\"kind\":\"step\",\"step\":1}\n{\"kind\":\"window\",\"step\":2}\n\
                    {\"kind\":\"step\",\"step\":3}\n{\"kind\":\"step\",\"st";
        assert_eq!(
            records_through(text, 2),
            "{\"kind\":\"step\",\"step\":1}\n{\"kind\":\"window\",\"step\":2}\n"
        );
        assert_eq!(records_through(text, 0), "");
    }
}
