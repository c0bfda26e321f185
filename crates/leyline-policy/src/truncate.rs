//! `truncate_tool_outputs`: the paper's rule. A tool output older than `n` assistant turns
//! (more than `n` assistant messages after it) becomes a short stub.

use crate::message::{Message, Role};
use crate::policy::Policy;
use serde::{Deserialize, Serialize};

/// The stub written over an evicted tool output, unless configured otherwise.
pub const DEFAULT_STUB: &str = "[evicted: older tool output]";

fn default_older_than_turns() -> usize {
    2
}

fn default_stub() -> String {
    DEFAULT_STUB.to_string()
}

/// Settings of [`TruncateToolOutputs`] (JSON: `{"type":"truncate_tool_outputs",
/// "older_than_turns":2,"stub":"..."}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TruncateToolOutputsConfig {
    /// A tool output followed by more than this many assistant messages is evicted (default 2).
    #[serde(default = "default_older_than_turns")]
    pub older_than_turns: usize,
    /// Text that replaces an evicted output; constant, so an evicted message never changes again.
    #[serde(default = "default_stub")]
    pub stub: String,
}

impl Default for TruncateToolOutputsConfig {
    fn default() -> Self {
        TruncateToolOutputsConfig {
            older_than_turns: default_older_than_turns(),
            stub: default_stub(),
        }
    }
}

/// The `truncate_tool_outputs` policy.
#[derive(Debug, Clone, Default)]
pub struct TruncateToolOutputs {
    /// Its settings.
    pub config: TruncateToolOutputsConfig,
}

impl Policy for TruncateToolOutputs {
    fn name(&self) -> &str {
        "truncate_tool_outputs"
    }

    fn transform(&self, messages: &[Message], _turn: usize) -> Vec<Message> {
        let mut out = messages.to_vec();
        let mut assistants_after = 0;
        for m in out.iter_mut().rev() {
            match m.role {
                Role::Assistant => assistants_after += 1,
                Role::Tool if assistants_after > self.config.older_than_turns => {
                    m.content.clone_from(&self.config.stub);
                }
                _ => {}
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// sys, user, then six rounds of (assistant call k, tool output k), a user message after
    /// round 2 and a plain assistant reply after round 3 (which counts as a turn).
    fn history() -> Vec<Message> {
        let mut m = vec![Message::system("s"), Message::user("go")];
        for k in 0..6 {
            m.push(Message::assistant(format!(
                "<tool_call>{{\"name\":\"t\",\"arguments\":{{\"k\":{k}}}}}</tool_call>"
            )));
            m.push(Message::tool("t", format!("output {k}")));
            if k == 2 {
                m.push(Message::user("more"));
            }
            if k == 3 {
                m.push(Message::assistant("thinking aloud"));
            }
        }
        m
    }

    fn evicted(n: usize) -> Vec<usize> {
        let p = TruncateToolOutputs {
            config: TruncateToolOutputsConfig {
                older_than_turns: n,
                stub: "[x]".into(),
            },
        };
        let h = history();
        let out = p.transform(&h, 7);
        assert_eq!(out.len(), h.len());
        // Which outputs (by k) became the stub; nothing else may change.
        let mut ks = Vec::new();
        for (a, b) in h.iter().zip(&out) {
            if a != b {
                assert_eq!(a.role, Role::Tool);
                assert_eq!(b.content, "[x]");
                assert_eq!(b.name, a.name);
                let k: usize = a.content["output ".len()..].parse().unwrap();
                ks.push(k);
            }
        }
        assert_eq!(p.transform(&out, 7), out, "idempotent");
        ks
    }

    #[test]
    fn evicts_outputs_older_than_n_assistant_turns() {
        // Assistant messages after output k: 5 - k, plus the plain reply for k <= 3.
        // k:      0  1  2  3  4  5
        // after:  6  5  4  3  1  0
        assert_eq!(evicted(0), vec![0, 1, 2, 3, 4]);
        assert_eq!(evicted(1), vec![0, 1, 2, 3]);
        assert_eq!(evicted(2), vec![0, 1, 2, 3]);
        assert_eq!(evicted(3), vec![0, 1, 2]);
        assert_eq!(evicted(5), vec![0]);
        assert_eq!(evicted(6), Vec::<usize>::new());
    }

    #[test]
    fn paper_rule_turn_by_turn() {
        // Plain alternation: at turn t (t rounds done) output k has t - 1 - k assistant
        // messages after it, so it is a stub once t - 1 - k > 2: the model sees the last 3.
        let p = TruncateToolOutputs::default();
        let mut h = vec![Message::user("go")];
        for t in 0..7 {
            let out = p.transform(&h, t);
            let stubs: Vec<bool> = out
                .iter()
                .filter(|m| m.role == Role::Tool)
                .map(|m| m.content == DEFAULT_STUB)
                .collect();
            let expect: Vec<bool> = (0..t).map(|k| k + 3 < t).collect();
            assert_eq!(stubs, expect, "turn {t}");
            h.push(Message::assistant("call"));
            h.push(Message::tool("t", format!("o{t}")));
        }
    }
}
