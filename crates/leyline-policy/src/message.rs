//! Chat messages, compatible with the OpenAI chat format and with the trace format.
//!
//! Tool calls come in two forms: structured (`tool_calls`, as OpenAI sends them) or embedded in
//! assistant text as `<tool_call>{"name": .., "arguments": ..}</tool_call>` (as the traces and
//! several chat templates write them). [`Message::calls`] reads either.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;
use std::ops::Range;

/// Opening tag of an embedded tool call.
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
/// Closing tag of an embedded tool call.
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// System prompt (OpenAI's `developer` role reads as this).
    #[serde(alias = "developer")]
    System,
    /// The user.
    User,
    /// The model; may carry tool calls.
    Assistant,
    /// A tool's output, answering an assistant's tool call.
    Tool,
}

impl Role {
    /// The lowercase wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One tool call of an assistant message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "ToolCallWire", into = "ToolCallWire")]
pub struct ToolCall {
    /// The call id (`tool_call_id` of the answering tool message), if any.
    pub id: Option<String>,
    /// The tool's name.
    pub name: String,
    /// The arguments as JSON text (OpenAI sends a string; an object is serialized).
    pub arguments: String,
}

/// OpenAI's `{"id","type","function":{"name","arguments"}}`, or the flat `{"name","arguments"}`.
#[derive(Serialize, Deserialize)]
struct ToolCallWire {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    function: Option<FunctionWire>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    arguments: Option<Value>,
}

#[derive(Serialize, Deserialize)]
struct FunctionWire {
    name: String,
    #[serde(default)]
    arguments: Option<Value>,
}

fn arguments_text(v: Option<Value>) -> String {
    match v {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s,
        Some(other) => other.to_string(),
    }
}

impl TryFrom<ToolCallWire> for ToolCall {
    type Error = String;
    fn try_from(w: ToolCallWire) -> Result<Self, String> {
        let (name, arguments) = match (w.function, w.name) {
            (Some(f), _) => (f.name, f.arguments),
            (None, Some(n)) => (n, w.arguments),
            (None, None) => return Err("tool call without a name".into()),
        };
        Ok(ToolCall {
            id: w.id,
            name,
            arguments: arguments_text(arguments),
        })
    }
}

impl From<ToolCall> for ToolCallWire {
    fn from(c: ToolCall) -> Self {
        ToolCallWire {
            id: c.id,
            kind: Some("function".into()),
            function: Some(FunctionWire {
                name: c.name,
                arguments: Some(Value::String(c.arguments)),
            }),
            name: None,
            arguments: None,
        }
    }
}

/// A tool call found in message text between [`TOOL_CALL_OPEN`] and [`TOOL_CALL_CLOSE`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddedCall {
    /// Byte range of the JSON body (between the tags) in the content.
    pub body: Range<usize>,
    /// The parsed call; a body that is not JSON gives an empty name and the raw text.
    pub call: ToolCall,
}

/// Finds every `<tool_call>..</tool_call>` in `content`, in order. An unclosed tag ends the scan.
pub fn embedded_tool_calls(content: &str) -> Vec<EmbeddedCall> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(open) = content[from..].find(TOOL_CALL_OPEN) {
        let body_start = from + open + TOOL_CALL_OPEN.len();
        let Some(close) = content[body_start..].find(TOOL_CALL_CLOSE) else {
            break;
        };
        let body = body_start..body_start + close;
        let text = &content[body.clone()];
        let call = serde_json::from_str::<ToolCall>(text).unwrap_or_else(|_| ToolCall {
            id: None,
            name: String::new(),
            arguments: text.to_string(),
        });
        from = body.end + TOOL_CALL_CLOSE.len();
        out.push(EmbeddedCall { body, call });
    }
    out
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// Who wrote it.
    pub role: Role,
    /// The text; OpenAI's `null` reads as empty and an array of text parts is joined.
    #[serde(default, deserialize_with = "content_text")]
    pub content: String,
    /// The tool's name, on tool messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Structured tool calls, on assistant messages.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The call this tool message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

fn content_text<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    use serde::de::Error;
    match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(parts)) => {
            let mut s = String::new();
            for p in parts {
                match p.get("text").and_then(Value::as_str) {
                    Some(t) => s.push_str(t),
                    None => return Err(D::Error::custom("content part without text")),
                }
            }
            Ok(s)
        }
        Some(_) => Err(D::Error::custom(
            "content must be a string, null or text parts",
        )),
    }
}

impl Message {
    /// A message of `role` with `content` and nothing else.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
            name: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }

    /// An assistant message (tool calls may be embedded in the text).
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }

    /// A tool message carrying the output of tool `name`.
    pub fn tool(name: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            name: Some(name.into()),
            ..Self::new(Role::Tool, content)
        }
    }

    /// The tool calls of this message: the structured ones, or else those embedded in the text.
    pub fn calls(&self) -> Vec<ToolCall> {
        if !self.tool_calls.is_empty() {
            return self.tool_calls.clone();
        }
        if self.role != Role::Assistant {
            return Vec::new();
        }
        embedded_tool_calls(&self.content)
            .into_iter()
            .map(|e| e.call)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_openai_and_trace_shapes() {
        let m: Message = serde_json::from_str(
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
                "function":{"name":"ls","arguments":"{\"path\":\".\"}"}}]}"#,
        )
        .unwrap();
        assert_eq!(m.content, "");
        assert_eq!(m.calls()[0].name, "ls");
        assert_eq!(m.calls()[0].arguments, r#"{"path":"."}"#);
        assert_eq!(m.calls()[0].id.as_deref(), Some("c1"));

        let t: Message =
            serde_json::from_str(r#"{"role":"tool","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}],"tool_call_id":"c1"}"#)
                .unwrap();
        assert_eq!(t.content, "ab");
        assert_eq!(t.tool_call_id.as_deref(), Some("c1"));

        // Round trip through the OpenAI form.
        let back: Message = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);
        assert!(serde_json::from_str::<Message>(r#"{"role":"user","content":3}"#).is_err());
    }

    #[test]
    fn embedded_calls_are_found_in_order() {
        let text = "think\n<tool_call>{\"name\": \"a\", \"arguments\": {\"x\": 1}}</tool_call>\n\
                    <tool_call>not json</tool_call><tool_call>{\"name\":\"open";
        let calls = embedded_tool_calls(text);
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].call.name, "a");
        assert_eq!(calls[0].call.arguments, r#"{"x":1}"#);
        assert_eq!(&text[calls[1].body.clone()], "not json");
        assert_eq!(calls[1].call.name, "");
        assert!(Message::user(text).calls().is_empty());
        assert_eq!(Message::assistant(text).calls().len(), 2);
    }
}
