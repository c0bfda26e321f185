//! Tool calls in generated text: the chat-template format of Qwen2.5, Qwen3 and Hermes-style
//! models, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, and Qwen3-Coder's
//! XML inside the same tags (`<function=NAME>` then `<parameter=KEY>VALUE</parameter>`s),
//! split out of the text as it streams, so both APIs can answer with structured calls
//! (`tool_use` blocks, `tool_calls`).

use serde_json::Value;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A stretch of generated output.
#[derive(Debug, Clone, PartialEq)]
pub enum Segment {
    /// Plain text.
    Text(String),
    /// Reasoning the model wrote before its answer ([`crate::reasoning`]).
    Reasoning(String),
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
    /// The offered tools' names: a reply that is nothing but one call's JSON object, without
    /// the tags, naming one of them, is a call too (Qwen2.5-Coder-0.5B answers so). `None`:
    /// tagged calls only.
    bare: Option<Vec<String>>,
    /// Whether a segment has been released (a bare call must be the whole reply).
    released: bool,
}

/// The names of tool schemas in either API's form (`{"function": {"name"}}` or `{"name"}`).
pub fn tool_names(tools: &[Value]) -> Vec<String> {
    tools
        .iter()
        .filter_map(|t| t.get("function").unwrap_or(t).get("name")?.as_str())
        .map(str::to_string)
        .collect()
}

/// The start of a call, written into the prompt after the generation prompt to force one:
/// the model then continues inside the call syntax (for `name`, with its arguments; without,
/// with the name of a tool it picks; the arguments' opening brace is written too, or a small
/// model may write a scalar there). The answer's text is this opening plus what the model
/// wrote.
pub fn forced_opening(name: Option<&str>) -> String {
    match name {
        Some(n) => format!(
            "{OPEN}\n{{\"name\": {}, \"arguments\": {{",
            Value::String(n.to_string())
        ),
        None => format!("{OPEN}\n{{\"name\": \""),
    }
}

impl ToolCallSplitter {
    /// A splitter that also takes a whole reply of one untagged call to one of `names`.
    pub fn with_tools(names: Vec<String>) -> Self {
        Self {
            bare: Some(names),
            ..Self::default()
        }
    }

    /// Whether the reply so far may still be one untagged call (held until the end): a
    /// JSON object, bare or in one ```json (or plain ```) code fence, as small models write
    /// it.
    fn may_be_bare(&self) -> bool {
        if self.bare.is_none() || self.released {
            return false;
        }
        let t = self.held.trim_start();
        if t.is_empty() || t.starts_with('{') || FENCE.starts_with(t) {
            return true;
        }
        let Some(rest) = t.strip_prefix(FENCE) else {
            return false;
        };
        match rest.split_once('\n') {
            None => "json".starts_with(rest.trim_end()),
            Some((lang, body)) => {
                matches!(lang.trim(), "" | "json") && {
                    let b = body.trim_start();
                    b.is_empty() || b.starts_with('{')
                }
            }
        }
    }

    /// Adds `text`; returns the segments it completes.
    pub fn push(&mut self, text: &str) -> Vec<Segment> {
        self.held.push_str(text);
        if self.may_be_bare() {
            return Vec::new();
        }
        let out = self.release();
        self.released |= !out.is_empty();
        out
    }

    fn release(&mut self) -> Vec<Segment> {
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
        if self.may_be_bare() {
            let names = self.bare.as_deref().unwrap_or_default();
            match bare_calls(unfence(&self.held), names) {
                Some(calls) => {
                    self.held.clear();
                    return calls;
                }
                None => {
                    self.released = true;
                    let mut out = self.release();
                    out.extend(self.finish());
                    return out;
                }
            }
        }
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

    /// Splits a whole text at once (`names`: as [`Self::with_tools`]).
    pub fn split(text: &str, names: Option<Vec<String>>) -> Vec<Segment> {
        let mut s = Self {
            bare: names,
            ..Self::default()
        };
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

/// Joins neighbouring text segments, and neighbouring reasoning segments.
pub fn merge_text(segments: Vec<Segment>) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::with_capacity(segments.len());
    for s in segments {
        match (out.last_mut(), s) {
            (Some(Segment::Text(a)), Segment::Text(b)) => a.push_str(&b),
            (Some(Segment::Reasoning(a)), Segment::Reasoning(b)) => a.push_str(&b),
            (_, s) => out.push(s),
        }
    }
    out
}

/// A Markdown code fence.
const FENCE: &str = "```";

/// The inside of a reply that is one code fence (its language line dropped), else the reply.
fn unfence(text: &str) -> &str {
    let t = text.trim();
    match t.strip_prefix(FENCE).and_then(|r| r.strip_suffix(FENCE)) {
        Some(inner) => inner.split_once('\n').map_or(inner, |(_, body)| body),
        None => text,
    }
}

/// A reply of untagged calls, as small models write them: one or more call objects (one a
/// line, say) each naming one of `names`, perhaps ending in one cut short by the token limit,
/// which is dropped. A call the same as the one before it is dropped too: a model that
/// repeats its call until the limit asked for it once. `None` if anything else is there.
fn bare_calls(text: &str, names: &[String]) -> Option<Vec<Segment>> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    let mut calls: Vec<Segment> = Vec::new();
    loop {
        match values.next() {
            None => break,
            Some(Ok(v)) => match parse_call(&v.to_string()) {
                Some(Segment::Call { name, arguments }) if names.contains(&name) => {
                    let call = Segment::Call { name, arguments };
                    if calls.last() != Some(&call) {
                        calls.push(call);
                    }
                }
                _ => return None,
            },
            // Only a call cut off at the end of the reply may be incomplete.
            Some(Err(e)) if e.is_eof() && !calls.is_empty() => break,
            Some(Err(_)) => return None,
        }
    }
    (!calls.is_empty()).then_some(calls)
}

/// `{"name": "...", "arguments": {...}}` (also `parameters`, or arguments as a JSON string),
/// or Qwen3-Coder's `<function=...>` form ([`parse_xml_call`]).
fn parse_call(body: &str) -> Option<Segment> {
    if body.trim_start().starts_with("<function=") {
        return parse_xml_call(body.trim());
    }
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

/// Qwen3-Coder's call: `<function=NAME>`, then any number of `<parameter=KEY>\nVALUE\n</parameter>`,
/// then `</function>`, whitespace between them. A value is read as JSON when it parses as
/// JSON (numbers, booleans, objects, arrays, quoted strings), else kept as the text between
/// the tags less one newline at each end (the template writes values so). Anything else
/// between the tags, a repeated key or a missing close is not a call.
fn parse_xml_call(body: &str) -> Option<Segment> {
    let rest = body.strip_prefix("<function=")?;
    let (name, mut rest) = rest.split_once('>')?;
    let name = name.trim();
    if name.is_empty() || name.contains(['<', '\n']) {
        return None;
    }
    let mut arguments = serde_json::Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</function>") {
            return after.trim().is_empty().then(|| Segment::Call {
                name: name.to_string(),
                arguments: Value::Object(arguments),
            });
        }
        let p = rest.strip_prefix("<parameter=")?;
        let (key, p) = p.split_once('>')?;
        let (raw, after) = p.split_once("</parameter>")?;
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let value = serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.into()));
        if arguments.insert(key.trim().to_string(), value).is_some() {
            return None;
        }
        rest = after;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Every call Qwen3-Coder's own template renders (transformers, the model crate's
    /// fixtures) parses back to the message's name and arguments.
    #[test]
    fn calls_rendered_by_qwen3_coders_template_parse_back() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../leyline-model/tests/fixtures/qwen3moe/chat_template_cases.qwen3-coder.json"
        );
        let cases: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let mut checked = 0;
        for c in cases["cases"].as_array().unwrap() {
            let Some(text) = c["text"].as_str() else {
                continue;
            };
            let want: Vec<Segment> = c["messages"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|m| m["tool_calls"].as_array())
                .flatten()
                .map(|t| {
                    let f = &t["function"];
                    let args = match &f["arguments"] {
                        Value::String(s) => serde_json::from_str(s).unwrap(),
                        a => a.clone(),
                    };
                    call(f["name"].as_str().unwrap(), args)
                })
                .collect();
            if want.is_empty() {
                // (A case may hold a call typed into an assistant's text by hand.)
                continue;
            }
            let got: Vec<Segment> = ToolCallSplitter::split(text, None)
                .into_iter()
                .filter(|s| matches!(s, Segment::Call { .. }))
                .collect();
            // The instructions of a prompt that offers tools show an example call first.
            assert_eq!(
                got[got.len().saturating_sub(want.len())..],
                want,
                "case {}",
                c["name"]
            );
            checked += want.len();
        }
        assert!(
            checked >= 4,
            "only {checked} rendered calls in the fixtures"
        );
    }

    /// Llama 3.1-3.3 write a call as a bare JSON object (`{"name": ..., "parameters": ...}`)
    /// as the whole assistant turn: every such turn their own templates render (the model
    /// crate's fixtures) is a call when the tool is offered.
    #[test]
    fn calls_rendered_by_llama_3_templates_parse_back() {
        let mut checked = 0;
        for v in ["3.1", "3.2", "3.3"] {
            let path = format!(
                "{}/../leyline-model/tests/fixtures/llama/chat_template_cases.llama{v}.json",
                env!("CARGO_MANIFEST_DIR")
            );
            let cases: Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            for c in cases["cases"].as_array().unwrap() {
                let Some(text) = c["text"].as_str() else {
                    continue;
                };
                let calls: Vec<&Value> = c["messages"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter_map(|m| m["tool_calls"].as_array())
                    .flatten()
                    .collect();
                if calls.len() != 1 {
                    continue;
                }
                let f = &calls[0]["function"];
                let name = f["name"].as_str().unwrap();
                let args = match &f["arguments"] {
                    Value::String(s) => serde_json::from_str(s).unwrap(),
                    a => a.clone(),
                };
                let turn = text
                    .split("<|start_header_id|>assistant<|end_header_id|>\n\n")
                    .find(|t| t.starts_with('{'))
                    .and_then(|t| t.split("<|eot_id|>").next())
                    .unwrap_or_else(|| panic!("llama {v} {}: no call turn", c["name"]));
                assert_eq!(
                    ToolCallSplitter::split(turn, Some(vec![name.to_string()])),
                    vec![call(name, args)],
                    "llama {v} case {}",
                    c["name"]
                );
                checked += 1;
            }
        }
        assert!(
            checked >= 6,
            "only {checked} rendered calls in the fixtures"
        );
    }

    /// Qwen3-Coder's template writes a call as below (its `tool_calls` rendering); the values
    /// come back typed where they are JSON, as text otherwise, and a malformed body stays text.
    #[test]
    fn qwen3_coder_xml_calls_are_calls() {
        let text = "Let me look.\n<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/main.rs\n</parameter>\n<parameter=limit>\n40\n</parameter>\n<parameter=opts>\n{\"raw\": true}\n</parameter>\n</function>\n</tool_call>";
        for cut in [1, 7, 30, 64, text.len()] {
            let mut s = ToolCallSplitter::default();
            let mut out = Vec::new();
            for chunk in text.as_bytes().chunks(cut) {
                out.extend(s.push(std::str::from_utf8(chunk).unwrap()));
            }
            out.extend(s.finish());
            assert_eq!(
                merge_text(out),
                vec![
                    Segment::Text("Let me look.\n".into()),
                    call(
                        "read_file",
                        json!({"path": "src/main.rs", "limit": 40, "opts": {"raw": true}})
                    ),
                ],
                "cut every {cut} bytes"
            );
        }
        let multi_line = "<tool_call>\n<function=write>\n<parameter=body>\nline 1\nline 2\n</parameter>\n</function>\n</tool_call>";
        assert_eq!(
            ToolCallSplitter::split(multi_line, None),
            vec![call("write", json!({"body": "line 1\nline 2"}))]
        );
        for bad in [
            "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
            "<tool_call>\n<function=f>\nhello\n</function>\n</tool_call>",
            "<tool_call>\n<function=f>\n<parameter=a>1</parameter><parameter=a>2</parameter></function>\n</tool_call>",
        ] {
            assert_eq!(
                ToolCallSplitter::split(bad, None),
                vec![Segment::Text(bad.into())],
                "{bad:?}"
            );
        }
    }

    fn call(name: &str, arguments: Value) -> Segment {
        Segment::Call {
            name: name.into(),
            arguments,
        }
    }

    #[test]
    fn several_untagged_calls_repeated_and_cut_at_the_limit_are_calls() {
        let names = Some(vec!["exec_command".to_string(), "read".to_string()]);
        let line = |c: &str| {
            format!("{{\"name\": \"exec_command\", \"arguments\": {{\"cmd\": \"{c}\"}}}}")
        };
        let text = format!(
            "{}\n{}\n{}\n{}",
            line("ls"),
            line("ls"),
            line("cat a"),
            &line("x")[..20]
        );
        assert_eq!(
            ToolCallSplitter::split(&text, names.clone()),
            vec![
                call("exec_command", json!({"cmd": "ls"})),
                call("exec_command", json!({"cmd": "cat a"}))
            ]
        );
        // Not a call to an offered tool, text after the calls, or a cut first call: text.
        let other = format!("{}\n{{\"name\": \"rm\", \"arguments\": {{}}}}", line("ls"));
        let prose = format!("{}\nDone.", line("ls"));
        for t in [other, prose, line("ls")[..20].to_string()] {
            assert!(
                matches!(
                    &ToolCallSplitter::split(&t, names.clone())[..],
                    [Segment::Text(_)]
                ),
                "{t}"
            );
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
        assert_eq!(ToolCallSplitter::split(text, None), want);
        // A forced opening and a completion the model could write give one call.
        let forced = format!("{}\"q\": 1}}}}\n</tool_call>", forced_opening(Some("f\"x")));
        assert_eq!(
            ToolCallSplitter::split(&forced, None),
            vec![Segment::Call {
                name: "f\"x".into(),
                arguments: serde_json::json!({"q": 1})
            }]
        );
        let any = format!(
            "{}g\", \"arguments\": {{}}}}\n</tool_call>",
            forced_opening(None)
        );
        assert!(
            matches!(&ToolCallSplitter::split(&any, None)[..], [Segment::Call { name, .. }] if name == "g")
        );
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
            ToolCallSplitter::split(bad, None),
            vec![Segment::Text(bad.into())]
        );
        // Stopped before the closing tag: a complete JSON object still counts.
        let open = "<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}";
        assert_eq!(
            ToolCallSplitter::split(open, None),
            vec![call("f", json!({"x": 1}))]
        );
        let cut = "<tool_call>\n{\"name\": \"f\", \"argu";
        assert_eq!(
            ToolCallSplitter::split(cut, None),
            vec![Segment::Text(cut.into())]
        );
        // Arguments must be an object; a text that merely looks like a tag start is text.
        let scalar = "<tool_call>{\"name\": \"f\", \"arguments\": 3}</tool_call>";
        assert_eq!(
            ToolCallSplitter::split(scalar, None),
            vec![Segment::Text(scalar.into())]
        );
        assert_eq!(
            ToolCallSplitter::split("a <tool b", None),
            vec![Segment::Text("a <tool b".into())]
        );
    }

    #[test]
    fn a_whole_reply_of_one_untagged_call_is_a_call_only_for_an_offered_tool() {
        let names = Some(vec!["get_weather".to_string()]);
        let bare = " {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n";
        let want = vec![call("get_weather", json!({"city": "Paris"}))];
        assert_eq!(ToolCallSplitter::split(bare, names.clone()), want);
        for n in 1..8 {
            let mut s = ToolCallSplitter::with_tools(vec!["get_weather".into()]);
            let chars: Vec<char> = bare.chars().collect();
            let mut out = Vec::new();
            for piece in chars.chunks(n) {
                out.extend(s.push(&piece.iter().collect::<String>()));
            }
            out.extend(s.finish());
            assert_eq!(out, want, "pieces of {n}");
        }
        // The same call alone in a code fence, as small models write it.
        for fenced in [
            "```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```",
            "```\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```\n",
        ] {
            for n in [1, 3, 100] {
                let mut s = ToolCallSplitter::with_tools(vec!["get_weather".into()]);
                let chars: Vec<char> = fenced.chars().collect();
                let mut out = Vec::new();
                for piece in chars.chunks(n) {
                    out.extend(s.push(&piece.iter().collect::<String>()));
                }
                out.extend(s.finish());
                assert_eq!(out, want, "{fenced:?} in pieces of {n}");
            }
        }
        // Not offered, not alone, not a call, other code, or no tools at all: text as written.
        for text in [
            "```python\nprint(1)\n```",
            "```json\n{\"name\": \"get_weather\", \"arguments\": {}}\n```\nDone.",
            "```json\n{\"city\": \"Paris\"}\n```",
            "{\"name\": \"rm_rf\", \"arguments\": {}}",
            "Sure: {\"name\": \"get_weather\", \"arguments\": {}}",
            "{\"name\": \"get_weather\", \"arguments\": {}} and more",
            "{\"city\": \"Paris\"}",
        ] {
            assert_eq!(
                ToolCallSplitter::split(text, names.clone()),
                vec![Segment::Text(text.into())],
                "{text}"
            );
        }
        let plain = "{\"name\": \"get_weather\", \"arguments\": {}}";
        assert_eq!(
            ToolCallSplitter::split(plain, None),
            vec![Segment::Text(plain.into())]
        );
        assert_eq!(
            tool_names(&[
                json!({"type": "function", "function": {"name": "a"}}),
                json!({"name": "b", "input_schema": {}})
            ]),
            vec!["a".to_string(), "b".to_string()]
        );
    }
}
