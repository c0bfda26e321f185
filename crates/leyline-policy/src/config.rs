//! [`PolicyConfig`]: a policy as the server accepts it (tagged JSON) or as the CLI writes it.

use crate::clear::{
    ClearAtLeast, ClearToolInputs, ClearToolUses, ClearToolUsesConfig, Keep, Trigger,
};
use crate::error::{PolicyError, Result};
use crate::policy::{CharEstimate, NoPolicy, Policy, TokenCounter};
use crate::truncate::{TruncateToolOutputs, TruncateToolOutputsConfig};
use serde::{Deserialize, Serialize};
use std::str::FromStr;
use std::sync::Arc;

/// A built-in policy and its settings. JSON, tagged by `type`:
/// `{"type":"none"}`, `{"type":"truncate_tool_outputs","older_than_turns":2,"stub":"..."}`,
/// `{"type":"clear_tool_uses","trigger":{"type":"input_tokens","value":30000},
/// "keep":{"type":"tool_uses","value":3},"clear_at_least":{"type":"input_tokens","value":5000},
/// "exclude_tools":["web_search"],"clear_tool_inputs":false,"placeholder":"..."}`
/// (`clear_tool_uses_20250919` is accepted as a type alias).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum PolicyConfig {
    /// Leave the history alone.
    #[default]
    None,
    /// The paper's rule.
    TruncateToolOutputs(TruncateToolOutputsConfig),
    /// Anthropic's context editing.
    #[serde(alias = "clear_tool_uses_20250919")]
    ClearToolUses(ClearToolUsesConfig),
}

impl PolicyConfig {
    /// Parses the JSON form.
    ///
    /// # Errors
    /// [`PolicyError::Config`] on malformed JSON, an unknown type or an unknown field.
    pub fn from_json(text: &str) -> Result<Self> {
        serde_json::from_str(text).map_err(|e| PolicyError::Config(e.to_string()))
    }

    /// The policy, counting tokens (where it needs to) with [`CharEstimate`].
    pub fn build(&self) -> Box<dyn Policy> {
        self.build_with_counter(Arc::new(CharEstimate))
    }

    /// The policy, counting tokens with `counter`.
    pub fn build_with_counter(&self, counter: Arc<dyn TokenCounter>) -> Box<dyn Policy> {
        match self {
            PolicyConfig::None => Box::new(NoPolicy),
            PolicyConfig::TruncateToolOutputs(c) => {
                Box::new(TruncateToolOutputs { config: c.clone() })
            }
            PolicyConfig::ClearToolUses(c) => {
                Box::new(ClearToolUses::with_counter(c.clone(), counter))
            }
        }
    }

    /// The config name (`none`, `truncate_tool_outputs`, `clear_tool_uses`).
    pub fn name(&self) -> &'static str {
        match self {
            PolicyConfig::None => "none",
            PolicyConfig::TruncateToolOutputs(_) => "truncate_tool_outputs",
            PolicyConfig::ClearToolUses(_) => "clear_tool_uses",
        }
    }
}

fn bad(msg: impl Into<String>) -> PolicyError {
    PolicyError::Config(msg.into())
}

fn number(key: &str, v: &str) -> Result<usize> {
    v.parse()
        .map_err(|_| bad(format!("{key}: expected a non-negative integer, got {v:?}")))
}

/// The short CLI form: `none`, `truncate_tool_outputs[:N]` (N = older_than_turns) or
/// `truncate_tool_outputs:older_than_turns=N,stub=TEXT`, `clear_tool_uses` or
/// `clear_tool_uses:trigger=N,trigger_tool_uses=N,keep=N,clear_at_least=N,exclude=a|b,
/// clear_tool_inputs=true,placeholder=TEXT`; a string starting with `{` is read as JSON.
impl FromStr for PolicyConfig {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if s.starts_with('{') {
            return Self::from_json(s);
        }
        let (kind, args) = s.split_once(':').unwrap_or((s, ""));
        let pairs = || {
            args.split(',').filter(|a| !a.is_empty()).map(|a| {
                a.split_once('=')
                    .ok_or_else(|| bad(format!("expected key=value, got {a:?}")))
            })
        };
        match kind {
            "none" if args.is_empty() => Ok(PolicyConfig::None),
            "truncate_tool_outputs" => {
                let mut c = TruncateToolOutputsConfig::default();
                if !args.is_empty() && !args.contains('=') {
                    c.older_than_turns = number("older_than_turns", args)?;
                    return Ok(PolicyConfig::TruncateToolOutputs(c));
                }
                for kv in pairs() {
                    match kv? {
                        ("older_than_turns" | "n", v) => c.older_than_turns = number("older_than_turns", v)?,
                        ("stub", v) => c.stub = v.to_string(),
                        (k, _) => return Err(bad(format!("truncate_tool_outputs has no field {k:?}"))),
                    }
                }
                Ok(PolicyConfig::TruncateToolOutputs(c))
            }
            "clear_tool_uses" | "clear_tool_uses_20250919" => {
                let mut c = ClearToolUsesConfig::default();
                for kv in pairs() {
                    match kv? {
                        ("trigger", v) => c.trigger = Trigger::InputTokens(number("trigger", v)?),
                        ("trigger_tool_uses", v) => c.trigger = Trigger::ToolUses(number("trigger_tool_uses", v)?),
                        ("keep", v) => c.keep = Keep::ToolUses(number("keep", v)?),
                        ("clear_at_least", v) => {
                            c.clear_at_least = Some(ClearAtLeast::InputTokens(number("clear_at_least", v)?))
                        }
                        ("exclude" | "exclude_tools", v) => {
                            c.exclude_tools = v.split('|').filter(|t| !t.is_empty()).map(String::from).collect()
                        }
                        ("clear_tool_inputs", "true") => c.clear_tool_inputs = ClearToolInputs::All(true),
                        ("clear_tool_inputs", "false") => c.clear_tool_inputs = ClearToolInputs::All(false),
                        ("clear_tool_inputs", v) => {
                            c.clear_tool_inputs = ClearToolInputs::Tools(v.split('|').map(String::from).collect())
                        }
                        ("placeholder", v) => c.placeholder = v.to_string(),
                        (k, _) => return Err(bad(format!("clear_tool_uses has no field {k:?}"))),
                    }
                }
                Ok(PolicyConfig::ClearToolUses(c))
            }
            _ => Err(bad(format!(
                "unknown policy {s:?} (expected none, truncate_tool_outputs[:N], clear_tool_uses[:k=v,..] or JSON)"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_shapes() {
        let c = PolicyConfig::from_json(
            r#"{"type":"truncate_tool_outputs","older_than_turns":5,"stub":"[gone]"}"#,
        )
        .unwrap();
        assert_eq!(
            c,
            PolicyConfig::TruncateToolOutputs(TruncateToolOutputsConfig {
                older_than_turns: 5,
                stub: "[gone]".into()
            })
        );
        let c = PolicyConfig::from_json(
            r#"{"type":"clear_tool_uses_20250919","trigger":{"type":"tool_uses","value":7},
                "keep":{"type":"tool_uses","value":1},"clear_at_least":{"type":"input_tokens","value":500},
                "exclude_tools":["think"],"clear_tool_inputs":["edit"]}"#,
        )
        .unwrap();
        let PolicyConfig::ClearToolUses(cc) = &c else {
            panic!("{c:?}")
        };
        assert_eq!(cc.trigger, Trigger::ToolUses(7));
        assert_eq!(cc.keep, Keep::ToolUses(1));
        assert_eq!(cc.clear_at_least, Some(ClearAtLeast::InputTokens(500)));
        assert_eq!(cc.exclude_tools, vec!["think".to_string()]);
        assert_eq!(
            cc.clear_tool_inputs,
            ClearToolInputs::Tools(vec!["edit".into()])
        );
        assert_eq!(cc.placeholder, crate::clear::DEFAULT_PLACEHOLDER);
        // Serializing and reading back gives the same config.
        let again = PolicyConfig::from_json(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(again, c);

        let d = PolicyConfig::from_json(r#"{"type":"clear_tool_uses"}"#).unwrap();
        assert_eq!(
            d,
            PolicyConfig::ClearToolUses(ClearToolUsesConfig::default())
        );
        assert_eq!(
            PolicyConfig::from_json(r#"{"type":"none"}"#).unwrap(),
            PolicyConfig::None
        );
        assert!(PolicyConfig::from_json(r#"{"type":"truncate_tool_outputs","n":2}"#).is_err());
        assert!(PolicyConfig::from_json(r#"{"type":"summarize"}"#).is_err());
    }

    #[test]
    fn cli_shapes() {
        let t = |s: &str| s.parse::<PolicyConfig>();
        assert_eq!(t("none").unwrap(), PolicyConfig::None);
        let PolicyConfig::TruncateToolOutputs(c) = t("truncate_tool_outputs:5").unwrap() else {
            panic!()
        };
        assert_eq!(c.older_than_turns, 5);
        let PolicyConfig::TruncateToolOutputs(c) = t("truncate_tool_outputs").unwrap() else {
            panic!()
        };
        assert_eq!(c.older_than_turns, 2);
        let PolicyConfig::ClearToolUses(c) =
            t("clear_tool_uses:trigger_tool_uses=4,keep=1,exclude=a|b,clear_tool_inputs=true")
                .unwrap()
        else {
            panic!()
        };
        assert_eq!(c.trigger, Trigger::ToolUses(4));
        assert_eq!(c.keep, Keep::ToolUses(1));
        assert_eq!(c.exclude_tools, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(c.clear_tool_inputs, ClearToolInputs::All(true));
        assert!(t("truncate_tool_outputs:x").is_err());
        assert!(t("clear_tool_uses:keep").is_err());
        assert!(t("clear_tool_uses:bogus=1").is_err());
        assert!(t("compact").is_err());
        assert_eq!(t(r#"{"type":"none"}"#).unwrap(), PolicyConfig::None);
        assert_eq!(
            t("clear_tool_uses").unwrap().build().name(),
            "clear_tool_uses"
        );
    }
}
