//! `clear_tool_uses`: Anthropic's context-editing strategy (`clear_tool_uses_20250919`).
//!
//! Once the prompt passes `trigger`, the results of all tool uses but the `keep` most recent
//! are replaced by `placeholder`, oldest first, except those of `exclude_tools`; with
//! `clear_tool_inputs` the calls' arguments are cleared too. If that would remove fewer than
//! `clear_at_least` tokens, nothing is cleared (an edit breaks the prefix cache: make it worth
//! it). Results that already hold the placeholder count as removing nothing, so the policy is
//! idempotent and can be fed either the original or an already-edited history.

use crate::message::{embedded_tool_calls, Message};
use crate::policy::{tool_uses, CharEstimate, Policy, TokenCounter};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// The text written over a cleared tool result, unless configured otherwise.
pub const DEFAULT_PLACEHOLDER: &str = "[cleared: old tool result]";

/// When clearing starts (`{"type":"input_tokens","value":N}` or `{"type":"tool_uses","value":N}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub enum Trigger {
    /// The prompt holds more than this many tokens (counted by the policy's [`TokenCounter`]).
    InputTokens(usize),
    /// The prompt holds more than this many tool uses.
    ToolUses(usize),
}

/// How many recent tool uses survive (`{"type":"tool_uses","value":N}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub enum Keep {
    /// The `N` most recent tool uses, of any tool.
    ToolUses(usize),
}

/// The least a clearing must remove (`{"type":"input_tokens","value":N}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub enum ClearAtLeast {
    /// Tokens, counted by the policy's [`TokenCounter`].
    InputTokens(usize),
}

/// Whose call arguments are cleared with their results: `true`/`false`, or a list of tools.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ClearToolInputs {
    /// All tools, or none.
    All(bool),
    /// Only these tools.
    Tools(Vec<String>),
}

impl ClearToolInputs {
    fn applies_to(&self, name: Option<&str>) -> bool {
        match self {
            ClearToolInputs::All(b) => *b,
            ClearToolInputs::Tools(t) => name.is_some_and(|n| t.iter().any(|x| x == n)),
        }
    }
}

fn default_trigger() -> Trigger {
    Trigger::InputTokens(100_000)
}
fn default_keep() -> Keep {
    Keep::ToolUses(3)
}
fn default_inputs() -> ClearToolInputs {
    ClearToolInputs::All(false)
}
fn default_placeholder() -> String {
    DEFAULT_PLACEHOLDER.to_string()
}

/// Settings of [`ClearToolUses`], with Anthropic's field names and defaults (trigger at 100k
/// input tokens, keep 3 tool uses).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClearToolUsesConfig {
    /// When clearing starts.
    #[serde(default = "default_trigger")]
    pub trigger: Trigger,
    /// How many recent tool uses survive.
    #[serde(default = "default_keep")]
    pub keep: Keep,
    /// The least one clearing must remove, or nothing is cleared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clear_at_least: Option<ClearAtLeast>,
    /// Tools whose uses are never cleared.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude_tools: Vec<String>,
    /// Whether call arguments are cleared with their results.
    #[serde(default = "default_inputs")]
    pub clear_tool_inputs: ClearToolInputs,
    /// Text written over a cleared result and over cleared call arguments (as the arguments
    /// text of a structured call, as a JSON string value in an embedded one).
    #[serde(default = "default_placeholder")]
    pub placeholder: String,
}

impl Default for ClearToolUsesConfig {
    fn default() -> Self {
        ClearToolUsesConfig {
            trigger: default_trigger(),
            keep: default_keep(),
            clear_at_least: None,
            exclude_tools: Vec::new(),
            clear_tool_inputs: default_inputs(),
            placeholder: default_placeholder(),
        }
    }
}

/// The `clear_tool_uses` policy.
#[derive(Clone)]
pub struct ClearToolUses {
    /// Its settings.
    pub config: ClearToolUsesConfig,
    counter: Arc<dyn TokenCounter>,
}

impl std::fmt::Debug for ClearToolUses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClearToolUses")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl ClearToolUses {
    /// The policy, counting tokens with [`CharEstimate`].
    pub fn new(config: ClearToolUsesConfig) -> Self {
        Self::with_counter(config, Arc::new(CharEstimate))
    }

    /// The policy, counting tokens with `counter` (e.g. the model's tokenizer).
    pub fn with_counter(config: ClearToolUsesConfig, counter: Arc<dyn TokenCounter>) -> Self {
        ClearToolUses { config, counter }
    }

    /// Tokens of a message list as the trigger counts them: contents plus call arguments.
    pub fn input_tokens(&self, messages: &[Message]) -> usize {
        messages
            .iter()
            .map(|m| {
                let structured: usize = m
                    .tool_calls
                    .iter()
                    .map(|c| self.counter.count(&c.name) + self.counter.count(&c.arguments))
                    .sum();
                self.counter.count(&m.content) + structured
            })
            .sum()
    }
}

impl Policy for ClearToolUses {
    fn name(&self) -> &str {
        "clear_tool_uses"
    }

    fn transform(&self, messages: &[Message], _turn: usize) -> Vec<Message> {
        let mut out = messages.to_vec();
        let uses = tool_uses(messages);
        let triggered = match self.config.trigger {
            Trigger::InputTokens(n) => self.input_tokens(messages) > n,
            Trigger::ToolUses(n) => uses.len() > n,
        };
        if !triggered {
            return out;
        }
        let Keep::ToolUses(keep) = self.config.keep;
        let old = &uses[..uses.len().saturating_sub(keep)];
        let excluded =
            |n: Option<&str>| n.is_some_and(|n| self.config.exclude_tools.iter().any(|x| x == n));
        let placeholder = &self.config.placeholder;
        let ph_tokens = self.counter.count(placeholder);

        // Plan: which results and which (assistant, call) arguments to clear, and the tokens saved.
        let mut removed = 0usize;
        let mut results = Vec::new();
        let mut inputs: Vec<(usize, usize)> = Vec::new();
        for u in old.iter().filter(|u| !excluded(u.name.as_deref())) {
            let content = &messages[u.result].content;
            if content != placeholder {
                removed += self.counter.count(content).saturating_sub(ph_tokens);
                results.push(u.result);
            }
            if let Some((a, k)) = u.call {
                if self.config.clear_tool_inputs.applies_to(u.name.as_deref()) {
                    let calls = messages[a].calls();
                    if calls[k].arguments != *placeholder {
                        removed += self
                            .counter
                            .count(&calls[k].arguments)
                            .saturating_sub(ph_tokens);
                        inputs.push((a, k));
                    }
                }
            }
        }
        if let Some(ClearAtLeast::InputTokens(min)) = self.config.clear_at_least {
            if removed < min {
                return out;
            }
        }

        for j in results {
            out[j].content.clone_from(placeholder);
        }
        // Inputs, per assistant message, last call first so byte ranges stay valid.
        inputs.sort_unstable();
        for &(a, k) in inputs.iter().rev() {
            let m = &mut out[a];
            if !m.tool_calls.is_empty() {
                m.tool_calls[k].arguments.clone_from(placeholder);
            } else if let Some(e) = embedded_tool_calls(&m.content).get(k) {
                let body = serde_json::json!({"name": e.call.name, "arguments": placeholder});
                m.content.replace_range(e.body.clone(), &body.to_string());
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Role;

    /// user, then rounds of (assistant calling `tools[k]`, tool output k of `sizes[k]` chars).
    fn history(tools: &[&str], sizes: &[usize]) -> Vec<Message> {
        let mut m = vec![Message::user("go")];
        for (k, (t, n)) in tools.iter().zip(sizes).enumerate() {
            m.push(Message::assistant(format!(
                "call {k}\n<tool_call>{{\"name\": \"{t}\", \"arguments\": {{\"k\": {k}}}}}</tool_call>"
            )));
            m.push(Message::tool(*t, "x".repeat(*n)));
        }
        m
    }

    /// Indices k of the cleared tool results.
    fn cleared(cfg: ClearToolUsesConfig, h: &[Message]) -> Vec<usize> {
        // One token per character keeps the arithmetic of the tests readable.
        let p = ClearToolUses::with_counter(cfg, Arc::new(|s: &str| s.len()));
        let out = p.transform(h, 0);
        assert_eq!(p.transform(&out, 0), out, "idempotent");
        out.iter()
            .filter(|m| m.role == Role::Tool)
            .enumerate()
            .filter(|(_, m)| m.content == p.config.placeholder)
            .map(|(k, _)| k)
            .collect()
    }

    fn cfg(trigger: Trigger, keep: usize) -> ClearToolUsesConfig {
        ClearToolUsesConfig {
            trigger,
            keep: Keep::ToolUses(keep),
            placeholder: "[c]".into(),
            ..Default::default()
        }
    }

    #[test]
    fn keep_changes_what_is_cleared() {
        let h = history(&["a"; 6], &[100; 6]);
        assert_eq!(cleared(cfg(Trigger::ToolUses(0), 3), &h), vec![0, 1, 2]);
        assert_eq!(
            cleared(cfg(Trigger::ToolUses(0), 1), &h),
            vec![0, 1, 2, 3, 4]
        );
        assert_eq!(
            cleared(cfg(Trigger::ToolUses(0), 0), &h),
            vec![0, 1, 2, 3, 4, 5]
        );
        assert_eq!(
            cleared(cfg(Trigger::ToolUses(0), 6), &h),
            Vec::<usize>::new()
        );
    }

    #[test]
    fn trigger_gates_clearing() {
        let h = history(&["a"; 4], &[100; 4]);
        // 4 tool uses: more than 3 triggers, more than 4 does not.
        assert_eq!(cleared(cfg(Trigger::ToolUses(3), 1), &h), vec![0, 1, 2]);
        assert!(cleared(cfg(Trigger::ToolUses(4), 1), &h).is_empty());
        // Tokens: outputs alone are 400 characters.
        assert_eq!(
            cleared(cfg(Trigger::InputTokens(399), 1), &h),
            vec![0, 1, 2]
        );
        assert!(cleared(cfg(Trigger::InputTokens(10_000), 1), &h).is_empty());
    }

    #[test]
    fn exclude_tools_are_never_cleared() {
        let h = history(&["a", "b", "a", "b", "a"], &[50; 5]);
        let mut c = cfg(Trigger::ToolUses(0), 1);
        assert_eq!(cleared(c.clone(), &h), vec![0, 1, 2, 3]);
        c.exclude_tools = vec!["b".into()];
        assert_eq!(cleared(c, &h), vec![0, 2]);
    }

    #[test]
    fn clear_at_least_is_all_or_nothing() {
        // Clearable: outputs 0 and 1 (keep 2), each saving 50 - 3 = 47 tokens.
        let h = history(&["a"; 4], &[50; 4]);
        let mut c = cfg(Trigger::ToolUses(0), 2);
        c.clear_at_least = Some(ClearAtLeast::InputTokens(94));
        assert_eq!(cleared(c.clone(), &h), vec![0, 1]);
        c.clear_at_least = Some(ClearAtLeast::InputTokens(95));
        assert!(cleared(c.clone(), &h).is_empty());
        // An already-cleared result (output 1) saves nothing more: only output 0 counts.
        let mut h2 = h.clone();
        h2[4].content = "[c]".into();
        c.clear_at_least = Some(ClearAtLeast::InputTokens(48));
        assert_eq!(cleared(c.clone(), &h2), vec![1]);
        c.clear_at_least = Some(ClearAtLeast::InputTokens(47));
        assert_eq!(cleared(c, &h2), vec![0, 1]);
    }

    #[test]
    fn clear_tool_inputs_rewrites_the_calls() {
        let h = history(&["a", "b", "a"], &[20; 3]);
        let mut c = cfg(Trigger::ToolUses(0), 1);
        c.clear_tool_inputs = ClearToolInputs::Tools(vec!["b".into()]);
        let p = ClearToolUses::new(c);
        let out = p.transform(&h, 0);
        assert_eq!(out[1], h[1], "the call of tool a keeps its arguments");
        assert_eq!(out[3].calls()[0].arguments, "[c]");
        assert_eq!(out[3].calls()[0].name, "b");
        assert!(out[3].content.starts_with("call 1\n<tool_call>"));
        assert_eq!(out[5], h[5], "kept use");
        assert_eq!(p.transform(&out, 0), out);
    }
}
