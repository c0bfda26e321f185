//! Leyline's context policies: a policy edits the message history, and the edit becomes token
//! directives by diffing the rendered prompts. No tensors; the only I/O is reading trace files
//! ([`load_traces`]).
//!
//! Design decision: policies work on messages, never on tokens. The token edits come from
//! [`diff`], which aligns whole messages before it compares tokens, so an edited message is
//! one [`Edit`] and untouched messages are untouched token ranges whatever the tokenizer does
//! elsewhere. A policy thus needs no tokenizer, and any renderer (the model's chat template)
//! yields exact directives.
//!
//! ```
//! use leyline_policy::{apply_edits, diff_rendered, ByteChatMl, Message, PolicyConfig, Renderer};
//!
//! let history = vec![
//!     Message::user("list files"),
//!     Message::assistant("<tool_call>{\"name\":\"ls\",\"arguments\":{}}</tool_call>"),
//!     Message::tool("ls", "a.txt b.txt c.txt"),
//!     Message::assistant("Three files."),
//!     Message::user("thanks"),
//! ];
//! let policy: PolicyConfig = "truncate_tool_outputs:0".parse().unwrap();
//! let edited = policy.build().transform(&history, 2);
//! assert_eq!(edited[2].content, "[evicted: older tool output]");
//!
//! let old = ByteChatMl.render_tokens(&history).unwrap();
//! let new = ByteChatMl.render_tokens(&edited).unwrap();
//! let edits = diff_rendered(&old, &new).unwrap();
//! assert_eq!(edits.len(), 1, "one edited message, one edit");
//! assert_eq!(apply_edits(&old.tokens, &edits).unwrap(), new.tokens);
//! ```
#![deny(missing_docs)]

mod clear;
mod config;
mod diff;
mod error;
mod message;
mod policy;
mod render;
mod replay;
mod stats;
mod trace;
mod truncate;

pub use clear::{
    ClearAtLeast, ClearToolInputs, ClearToolUses, ClearToolUsesConfig, Keep, Trigger,
    DEFAULT_PLACEHOLDER,
};
pub use config::PolicyConfig;
pub use diff::{
    apply_edits, diff, diff_rendered, diff_tokens, first_unstable_boundary, Edit, Rendered,
    Renderer,
};
pub use error::{PolicyError, Result};
pub use message::{
    embedded_tool_calls, EmbeddedCall, Message, Role, ToolCall, TOOL_CALL_CLOSE, TOOL_CALL_OPEN,
};
pub use policy::{tool_uses, CharEstimate, NoPolicy, Policy, TokenCounter, ToolUse};
pub use render::ByteChatMl;
pub use replay::{replay_turns, replay_turns_stateful, turn_diffs, Turn, TurnDiff};
pub use stats::PolicyStats;
pub use trace::{load_traces, parse_traces, Trajectory};
pub use truncate::{TruncateToolOutputs, TruncateToolOutputsConfig, DEFAULT_STUB};
