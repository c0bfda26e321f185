//! Tool calls in generated text: the chat-template format of Qwen2.5 and Hermes-style models,
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, split out of the text as it
//! streams, so both APIs can answer with structured calls (`tool_use` blocks, `tool_calls`).

use serde_json::Value;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A stretch of generated output.
#[derive(Debug, Clone, PartialEq)]
pub enum Segment {
    /// Plain text.
    Text(String),
    /// One well-formed tool call.
    Call {
        /// The tool's name.
        name: String,
        /// Its arguments (a JSON object).
        arguments: Value,
    },
}

/// Splits streamed text into [`Segment`]s: text is released as soon as it cannot be the
/// start of a call; a call is released once it is closed. A call that does not parse stays
/// text, as the model wrote it.
#[derive(Debug, Default)]
pub struct ToolCallSplitter {
    held: String,
}

impl ToolCallSplitter {
    /// Adds `text`; returns the segments it completes.
    pub fn push(&mut self, text: &str) -> Vec<Segment> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.held.find(OPEN) {
                Some(open) => {
                    let Some(len) = self.held[open..].find(CLOSE) else {
                        push_text(&mut out, &self.held[..open]);
                        self.held.drain(..open);
                        return out;
                    };
                    let body = &self.held[open + OPEN.len()..open + len];
                    push_text(&mut out, &self.held[..open]);
                    match parse_call(body) {
                        Some(call) => out.push(call),
                        None => push_text(&mut out, &self.held[open..open + len + CLOSE.len()]),
                    }
                    self.held.drain(..open + len + CLOSE.len());
                }
                None => {
                    // Keep what may be the start of `<tool_call>`.
                    let keep = (1..OPEN.len())
                        .rev()
                        .find(|&k| self.held.ends_with(&OPEN[..k]))
                        .unwrap_or(0);
                    let cut = self.held.len() - keep;
                    push_text(&mut out, &self.held[..cut]);
                    self.held.drain(..cut);
                    return out;
                }
            }
        }
    }

    /// Ends the text: a call left open is parsed if it can be (the model may stop right
    /// before `</tool_call>`), else released as text.
    pub fn finish(&mut self) -> Vec<Segment> {
        let held = std::mem::take(&mut self.held);
        let mut out = Vec::new();
        if let Some(body) = held.strip_prefix(OPEN) {
            if let Some(call) = parse_call(body) {
                out.push(call);
                return out;
            }
        }
        push_text(&mut out, &held);
        out
    }

    /// Splits a whole text at once.
    pub fn split(text: &str) -> Vec<Segment> {
        let mut s = Self::default();
        let mut out = s.push(text);
        out.extend(s.finish());
        merge_text(out)
    }
}

fn push_text(out: &mut Vec<Segment>, t: &str) {
    if !t.is_empty() {
        out.push(Segment::Text(t.to_string()));
    }
}

/// Joins neighbouring text segments.
pub fn merge_text(segments: Vec<Segment>) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::with_capacity(segments.len());
    for s in segments {
        match (out.last_mut(), s) {
            (Some(Segment::Text(a)), Segment::Text(b)) => a.push_str(&b),
            (_, s) => out.push(s),
        }
    }
    out
}

/// `{"name": "...", "arguments": {...}}` (also `parameters`, or arguments as a JSON string).
fn parse_call(body: &str) -> Option<Segment> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(Value::String(s)) => serde_json::from_str(s).ok()?,
        Some(a) => a.clone(),
    };
    arguments
        .is_object()
        .then_some(Segment::Call { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(name: &str, arguments: Value) -> Segment {
        Segment::Call {
            name: name.into(),
            arguments,
        }
    }

    #[test]
    fn calls_are_split_from_text_however_the_text_is_cut() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\nDone.";
        let want = vec![
            Segment::Text("Let me check.\n".into()),
            call("get_weather", json!({"city": "Paris"})),
            Segment::Text("\nDone.".into()),
        ];
        assert_eq!(ToolCallSplitter::split(text), want);
        // Streamed in pieces of every size: the same segments, and no text of the call leaks.
        for n in 1..12 {
            let mut s = ToolCallSplitter::default();
            let mut out = Vec::new();
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(n) {
                out.extend(s.push(&piece.iter().collect::<String>()));
            }
            out.extend(s.finish());
            assert_eq!(merge_text(out), want, "pieces of {n}");
        }
    }

    #[test]
    fn malformed_or_unclosed_calls_stay_text_unless_they_parse() {
        let bad = "<tool_call>\n{not json}\n</tool_call>";
        assert_eq!(
            ToolCallSplitter::split(bad),
            vec![Segment::Text(bad.into())]
        );
        // Stopped before the closing tag: a complete JSON object still counts.
        let open = "<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}";
        assert_eq!(
            ToolCallSplitter::split(open),
            vec![call("f", json!({"x": 1}))]
        );
        let cut = "<tool_call>\n{\"name\": \"f\", \"argu";
        assert_eq!(
            ToolCallSplitter::split(cut),
            vec![Segment::Text(cut.into())]
        );
        // Arguments must be an object; a text that merely looks like a tag start is text.
        let scalar = "<tool_call>{\"name\": \"f\", \"arguments\": 3}</tool_call>";
        assert_eq!(
            ToolCallSplitter::split(scalar),
            vec![Segment::Text(scalar.into())]
        );
        assert_eq!(
            ToolCallSplitter::split("a <tool b"),
            vec![Segment::Text("a <tool b".into())]
        );
    }
}
