//! Reading trajectories (the JSONL format of `data/traces/`): the only file I/O of this crate.

use crate::error::{PolicyError, Result};
use crate::message::Message;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One recorded agent run: `{"id","source","meta","messages":[...]}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trajectory {
    /// Unique id within its source.
    pub id: String,
    /// Where it comes from (`tau-bench`, `swe-agent-demos`).
    pub source: String,
    /// Free-form metadata.
    #[serde(default)]
    pub meta: serde_json::Value,
    /// The conversation, tool calls embedded in assistant text.
    pub messages: Vec<Message>,
}

/// Parses JSONL text: one trajectory per non-blank line.
///
/// # Errors
/// [`PolicyError::Trace`] naming the first line that is not a trajectory.
pub fn parse_traces(text: &str) -> Result<Vec<Trajectory>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|source| PolicyError::Trace {
                line: i + 1,
                source,
            })
        })
        .collect()
}

/// Reads a JSONL trace file.
///
/// # Errors
/// [`PolicyError::Io`] if the file cannot be read, [`PolicyError::Trace`] if a line is bad.
pub fn load_traces(path: impl AsRef<Path>) -> Result<Vec<Trajectory>> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| PolicyError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_traces(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_and_names_bad_ones() {
        let ok = r#"{"id":"a","source":"s","messages":[{"role":"user","content":"hi"},{"role":"tool","content":"o","name":"t"}]}

{"id":"b","source":"s","meta":{"k":1},"messages":[]}"#;
        let t = parse_traces(ok).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].messages[1].name.as_deref(), Some("t"));
        let bad = format!("{ok}\n{{\"id\":\"c\"}}");
        match parse_traces(&bad) {
            Err(PolicyError::Trace { line, .. }) => assert_eq!(line, 4),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            load_traces("/nonexistent/x.jsonl"),
            Err(PolicyError::Io { .. })
        ));
    }
}
