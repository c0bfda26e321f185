//! OpenAI Responses API wire types (`POST /v1/responses`): the request read strictly, its
//! tools split into what the template renders and what is unsupported, and its input items
//! converted into chat messages for the model's template (the output side is in
//! [`crate::responses_output`]).
//!
//! Design decision: unlike chat completions, every top-level field is either applied,
//! accepted with no effect (listed in [`NO_EFFECT_FIELDS`]), or refused with a 400 that
//! names it: a Responses client (Codex CLI) relies on what it sends, so a silently ignored
//! field would be a silent wrong answer. Hosted tools (`web_search`, `file_search`, ...) are
//! the exception a stock client forces: they are not offered to the model and come back
//! listed in `leyline.unsupported_tools`.

use crate::error::{Result, ServerError};
use crate::openai::LeylineOptions;
use leyline_model::chat::ChatMessage;
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};

/// The fields the server applies.
pub const APPLIED_FIELDS: [&str; 14] = [
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "store",
    "previous_response_id",
    "prompt_cache_key",
    "metadata",
];

/// Fields accepted with no effect on the answer (values checked where one could ask for
/// something this server does not do):
/// - `reasoning`, `include`: nothing is summarized or returned encrypted (a model that
///   reasons returns its reasoning as `reasoning_text`); `reasoning.effort: "none"` turns a
///   reasoning model's thinking off, other efforts leave it as its template has it;
/// - `client_metadata`, `user`, `safety_identifier`, `service_tier`,
///   `prompt_cache_retention`, `stream_options`: bookkeeping for OpenAI's own service;
/// - `truncation`: `"disabled"` or `"auto"` (a prompt that does not fit is a 400 either way);
/// - `text`: only `{"format": {"type": "text"}}` and `verbosity`; other formats are a 400;
/// - `background`: only `false`;
/// - `top_logprobs`: only 0.
///
/// `metadata` is echoed in the response; `prompt_cache_key` names the conversation for
/// implicit splices (with the `session-id` header) and is echoed too.
pub const NO_EFFECT_FIELDS: [&str; 12] = [
    "reasoning",
    "include",
    "client_metadata",
    "user",
    "safety_identifier",
    "service_tier",
    "prompt_cache_retention",
    "stream_options",
    "truncation",
    "text",
    "background",
    "top_logprobs",
];

/// `tool_choice`: what this server can honour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default).
    Auto,
    /// No tools are offered.
    None,
}

impl ToolChoice {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            ToolChoice::Auto => "auto",
            ToolChoice::None => "none",
        }
    }
}

/// `POST /v1/responses`, validated.
#[derive(Debug, Clone)]
pub struct ResponsesRequest {
    /// Model id.
    pub model: String,
    /// `input`: a string or a list of items (converted by [`input_to_chat`]).
    pub input: Option<Value>,
    /// A system message put first (not carried over by `previous_response_id`).
    pub instructions: Option<String>,
    /// Tools as given.
    pub tools: Vec<Value>,
    /// `tool_choice`.
    pub tool_choice: ToolChoice,
    /// `parallel_tool_calls` (echoed; the model may write several calls either way).
    pub parallel_tool_calls: bool,
    /// Most new tokens.
    pub max_output_tokens: Option<i64>,
    /// Temperature in [0, 2].
    pub temperature: Option<f64>,
    /// Nucleus mass.
    pub top_p: Option<f64>,
    /// Stream by SSE.
    pub stream: bool,
    /// Keep the response for `GET` and `previous_response_id` (the API's default: true).
    pub store: bool,
    /// The stored response this one continues.
    pub previous_response_id: Option<String>,
    /// The client's name for its conversation.
    pub prompt_cache_key: Option<String>,
    /// Echoed key-value pairs.
    pub metadata: Option<Value>,
    /// Leyline session to run in.
    pub session_id: Option<String>,
    /// Leyline options.
    pub leyline: Option<LeylineOptions>,
    /// Splits the prefix cache of users behind one key.
    pub cache_salt: Option<String>,
    /// `reasoning.effort` is `none`: a model that reasons is asked not to (its template's
    /// `enable_thinking` off); `None` leaves the template's default.
    pub thinking: Option<bool>,
}

/// `obj[name]`, null counting as absent, deserialized with the field (and any path inside
/// it) named on error.
fn field<T: DeserializeOwned>(obj: &Map<String, Value>, name: &str) -> Result<Option<T>> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_path_to_error::deserialize(v).map(Some).map_err(|e| {
            let inner = e.path().to_string();
            let at = match inner.as_str() {
                "." => name.to_string(),
                i if i.starts_with('[') => format!("{name}{i}"),
                i => format!("{name}.{i}"),
            };
            ServerError::invalid(&at, format!("invalid value for `{at}`: {}", e.into_inner()))
        }),
    }
}

fn refuse(param: &str, why: impl std::fmt::Display) -> ServerError {
    ServerError::invalid(param, format!("`{param}`: {why}"))
}

impl ResponsesRequest {
    /// Reads and checks a request body.
    ///
    /// # Errors
    /// A 400 naming the first field that is unknown, malformed, or asks for what this
    /// server cannot do.
    pub fn from_body(v: &Value) -> Result<Self> {
        let obj = v
            .as_object()
            .ok_or_else(|| ServerError::bad_request("the request body must be a JSON object"))?;
        crate::handler::refuse_unknown_fields(
            v,
            &[
                &APPLIED_FIELDS,
                &NO_EFFECT_FIELDS,
                &crate::openai::LEYLINE_FIELDS,
            ],
        )?;
        check_no_effect(obj)?;
        let model: String =
            field(obj, "model")?.ok_or_else(|| refuse("model", "a model is required"))?;
        let tool_choice = match obj.get("tool_choice") {
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
            Some(Value::String(s)) if s == "none" => ToolChoice::None,
            Some(other) => {
                return Err(refuse(
                    "tool_choice",
                    format!(
                        "{other} is not supported: this server cannot force a tool call; use \"auto\" or \"none\""
                    ),
                ))
            }
        };
        let metadata: Option<Map<String, Value>> = field(obj, "metadata")?;
        let leyline: Option<LeylineOptions> = field(obj, "leyline")?;
        if leyline
            .as_ref()
            .is_some_and(|l| l.context_management.is_some())
        {
            return Err(refuse(
                "leyline.context_management",
                "context edits are not supported on /v1/responses; use /v1/chat/completions or /v1/messages",
            ));
        }
        Ok(Self {
            model,
            input: obj.get("input").filter(|i| !i.is_null()).cloned(),
            instructions: field(obj, "instructions")?,
            tools: field(obj, "tools")?.unwrap_or_default(),
            tool_choice,
            parallel_tool_calls: field(obj, "parallel_tool_calls")?.unwrap_or(true),
            max_output_tokens: field(obj, "max_output_tokens")?,
            temperature: field(obj, "temperature")?,
            top_p: field(obj, "top_p")?,
            stream: field(obj, "stream")?.unwrap_or(false),
            store: field(obj, "store")?.unwrap_or(true),
            previous_response_id: field(obj, "previous_response_id")?,
            prompt_cache_key: field(obj, "prompt_cache_key")?,
            metadata: metadata.map(Value::Object),
            session_id: field(obj, "session_id")?,
            leyline,
            cache_salt: field(obj, "cache_salt")?,
            thinking: match obj
                .get("reasoning")
                .and_then(|r| r.get("effort"))
                .and_then(Value::as_str)
            {
                Some("none") => Some(false),
                _ => None,
            },
        })
    }
}

/// Checks the values of the fields accepted with no effect.
fn check_no_effect(obj: &Map<String, Value>) -> Result<()> {
    let _: Option<Map<String, Value>> = field(obj, "reasoning")?;
    let _: Option<Vec<String>> = field(obj, "include")?;
    let _: Option<Map<String, Value>> = field(obj, "client_metadata")?;
    let _: Option<Map<String, Value>> = field(obj, "stream_options")?;
    for name in [
        "user",
        "safety_identifier",
        "service_tier",
        "prompt_cache_retention",
    ] {
        let _: Option<String> = field(obj, name)?;
    }
    match field::<String>(obj, "truncation")?.as_deref() {
        None | Some("disabled" | "auto") => {}
        Some(other) => {
            return Err(refuse(
                "truncation",
                format!("must be \"disabled\" or \"auto\", got {other:?}"),
            ))
        }
    }
    if field::<bool>(obj, "background")? == Some(true) {
        return Err(refuse(
            "background",
            "background responses are not supported; leave it out or send false",
        ));
    }
    if field::<i64>(obj, "top_logprobs")?.is_some_and(|n| n != 0) {
        return Err(refuse(
            "top_logprobs",
            "log probabilities are not supported; leave it out",
        ));
    }
    if let Some(text) = field::<Map<String, Value>>(obj, "text")? {
        for (k, v) in &text {
            match k.as_str() {
                "verbosity" => {}
                "format" if v.is_null() || v.get("type").and_then(Value::as_str) == Some("text") => {}
                "format" => {
                    return Err(refuse(
                        "text.format",
                        "only {\"type\": \"text\"} is supported: this server cannot constrain output to a schema",
                    ))
                }
                other => {
                    return Err(refuse(
                        &format!("text.{other}"),
                        "this server does not support this parameter; leave it out",
                    ))
                }
            }
        }
    }
    Ok(())
}

/// What a request's `tools` become.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tools {
    /// Function tools in the template's form (`{"type": "function", "function": {...}}`);
    /// none when there are none or `tool_choice` is `none`.
    pub template: Option<Vec<Value>>,
    /// The function tools as the response echoes them.
    pub echoed: Vec<Value>,
    /// Hosted tools, not offered to the model: `{"type"}` and the `name` where one is given.
    pub unsupported: Vec<Value>,
}

/// Splits `tools` into function tools for the template and hosted ones this server lists as
/// unsupported.
///
/// # Errors
/// A 400 naming a tool without a `type`, or a function tool without a name.
pub fn split_tools(tools: &[Value], choice: ToolChoice) -> Result<Tools> {
    let mut out = Tools::default();
    let mut template = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        let kind = t
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| refuse(&format!("{at}.type"), "every tool needs a `type`"))?;
        if kind != "function" {
            let mut u = json!({"type": kind});
            if let Some(name) = t.get("name").and_then(Value::as_str) {
                u["name"] = json!(name);
            }
            out.unsupported.push(u);
            continue;
        }
        let name = t
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| refuse(&format!("{at}.name"), "a function tool needs a name"))?;
        let parameters = match t.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(refuse(
                    &format!("{at}.parameters"),
                    "must be a JSON schema object",
                ))
            }
        };
        let description = t.get("description").and_then(Value::as_str);
        // OpenAI's key order (name, description, parameters): templates print the object
        // as it lies, and models were trained on that form.
        let mut f = Map::new();
        f.insert("name".into(), json!(name));
        if let Some(d) = description {
            f.insert("description".into(), json!(d));
        }
        f.insert("parameters".into(), parameters.clone());
        template.push(json!({"type": "function", "function": f}));
        out.echoed.push(json!({
            "type": "function", "name": name, "description": description,
            "parameters": parameters, "strict": t.get("strict").and_then(Value::as_bool).unwrap_or(false),
        }));
    }
    if choice == ToolChoice::Auto && !template.is_empty() {
        out.template = Some(template);
    }
    Ok(out)
}

fn string_at(item: &Value, key: &str, at: &str) -> Result<String> {
    item.get(key)
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| refuse(&format!("{at}.{key}"), "a string is required"))
}

/// The text of a message's `content` or a call output's `output`: a string, or parts of
/// type `input_text`, `output_text` or `text` (joined).
fn text_of(v: Option<&Value>, at: &str) -> Result<String> {
    match v {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let here = format!("{at}[{j}]");
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => {
                        text.push_str(&string_at(p, "text", &here)?)
                    }
                    Some(other) => {
                        return Err(refuse(
                            &format!("{here}.type"),
                            format!("only text parts are supported, got {other:?}"),
                        ))
                    }
                    None => {
                        return Err(refuse(&format!("{here}.type"), "every part needs a `type`"))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(refuse(at, "must be a string or a list of text parts")),
    }
}

/// Converts `input` (a string, or a list of items) into the chat messages the template
/// renders: message items keep their role (`developer` becomes `system`), consecutive
/// `function_call` items become one assistant message's `tool_calls` (joining the assistant
/// message just before them), `function_call_output` items become `tool` messages, and
/// `reasoning` items are dropped (the templates render no earlier reasoning).
///
/// Output items of a response are input items too, so a stored response's output converts
/// the same way.
///
/// # Errors
/// A 400 naming the first malformed field (`input[2].call_id`).
pub fn input_to_chat(input: &Value) -> Result<Vec<ChatMessage>> {
    let items = match input {
        Value::String(s) => return Ok(vec![ChatMessage::new("user", s.clone())]),
        Value::Array(items) => items,
        _ => return Err(refuse("input", "must be a string or a list of items")),
    };
    let mut out: Vec<ChatMessage> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        if !item.is_object() {
            return Err(refuse(&at, "every input item must be an object"));
        }
        let kind = match item.get("type") {
            None | Some(Value::Null) => "message",
            Some(Value::String(t)) => t.as_str(),
            Some(_) => return Err(refuse(&format!("{at}.type"), "must be a string")),
        };
        match kind {
            "message" => {
                let role = string_at(item, "role", &at)?;
                let role = match role.as_str() {
                    "developer" | "system" => "system",
                    "user" | "assistant" => role.as_str(),
                    other => {
                        return Err(refuse(
                            &format!("{at}.role"),
                            format!("must be system, developer, user or assistant, got {other:?}"),
                        ))
                    }
                };
                let text = text_of(item.get("content"), &format!("{at}.content"))?;
                out.push(ChatMessage::new(role, text));
            }
            "function_call" => {
                let call_id = string_at(item, "call_id", &at)?;
                let name = string_at(item, "name", &at)?;
                let arguments = string_at(item, "arguments", &at)?;
                let call = json!({
                    "id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments},
                });
                match out.last_mut() {
                    Some(m) if m.role == "assistant" => {
                        m.tool_calls.get_or_insert_with(Vec::new).push(call)
                    }
                    _ => {
                        // Content stays a string beside the calls: templates that
                        // concatenate it (SmolLM2's) fail on a missing one.
                        let mut m = ChatMessage::new("assistant", "");
                        m.tool_calls = Some(vec![call]);
                        out.push(m);
                    }
                }
            }
            "function_call_output" => {
                let call_id = string_at(item, "call_id", &at)?;
                let output = text_of(item.get("output"), &format!("{at}.output"))?;
                let mut m = ChatMessage::new("tool", output);
                m.tool_call_id = Some(call_id);
                out.push(m);
            }
            // The templates render no earlier reasoning: nothing to put in the prompt.
            "reasoning" => {}
            other => {
                return Err(refuse(
                    &format!("{at}.type"),
                    format!("input items of type {other:?} are not supported"),
                ))
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(e: ServerError) -> String {
        e.body()["error"]["param"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    #[test]
    fn items_become_template_messages() {
        let chat = input_to_chat(&json!([
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Use tools."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
            {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": "{}"},
        ]))
        .unwrap();
        let roles: Vec<&str> = chat.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(
            roles,
            [
                "system",
                "system",
                "user",
                "assistant",
                "tool",
                "tool",
                "assistant"
            ]
        );
        assert_eq!(chat[0].content.as_deref(), Some("Be brief."));
        assert_eq!(chat[2].content.as_deref(), Some("Weather in Paris?"));
        // Both calls join the assistant message before them.
        assert_eq!(chat[3].content.as_deref(), Some("Checking."));
        let calls = chat[3].tool_calls.as_ref().unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["id"], "call_1");
        assert_eq!(calls[0]["function"]["arguments"], "{\"city\": \"Paris\"}");
        assert_eq!(chat[4].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(chat[5].content.as_deref(), Some("noon"));
        // A call after a tool message opens a new assistant message with empty content.
        assert_eq!(chat[6].content.as_deref(), Some(""));
        assert_eq!(chat[6].tool_calls.as_ref().unwrap()[0]["id"], "call_3");
        let one = input_to_chat(&json!("Hi")).unwrap();
        assert_eq!(one, vec![ChatMessage::new("user", "Hi")]);
    }

    #[test]
    fn malformed_items_name_the_field() {
        let cases = [
            (json!(5), "input"),
            (json!(["text"]), "input[0]"),
            (json!([{"role": "tool", "content": "x"}]), "input[0].role"),
            (json!([{"content": "x"}]), "input[0].role"),
            (json!([{"role": "user", "content": 3}]), "input[0].content"),
            (
                json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                "input[0].content[0].type",
            ),
            (
                json!([{"role": "user", "content": [{"type": "input_text"}]}]),
                "input[0].content[0].text",
            ),
            (
                json!([{"role": "user", "content": "a"}, {"type": "function_call", "name": "f", "arguments": "{}"}]),
                "input[1].call_id",
            ),
            (
                json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]),
                "input[0].arguments",
            ),
            (
                json!([{"type": "function_call_output", "call_id": "c"}]),
                "input[0].output",
            ),
            (
                json!([{"type": "item_reference", "id": "x"}]),
                "input[0].type",
            ),
        ];
        for (input, want) in cases {
            let e = input_to_chat(&input).unwrap_err();
            assert_eq!(e.status().as_u16(), 400);
            assert_eq!(param(e), want, "{input}");
        }
    }

    fn req(v: Value) -> Result<ResponsesRequest> {
        ResponsesRequest::from_body(&v)
    }

    #[test]
    fn unknown_or_unapplicable_fields_are_refused_by_name() {
        let cases = [
            (
                json!({"model": "m", "input": "x", "frequency_penalty": 1}),
                "frequency_penalty",
            ),
            (
                json!({"model": "m", "input": "x", "conversation": "c"}),
                "conversation",
            ),
            (
                json!({"model": "m", "input": "x", "max_tool_calls": 2}),
                "max_tool_calls",
            ),
            (
                json!({"model": "m", "input": "x", "background": true}),
                "background",
            ),
            (
                json!({"model": "m", "input": "x", "top_logprobs": 3}),
                "top_logprobs",
            ),
            (
                json!({"model": "m", "input": "x", "truncation": "middle"}),
                "truncation",
            ),
            (
                json!({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}),
                "text.format",
            ),
            (
                json!({"model": "m", "input": "x", "text": {"style": 1}}),
                "text.style",
            ),
            (
                json!({"model": "m", "input": "x", "tool_choice": "required"}),
                "tool_choice",
            ),
            (
                json!({"model": "m", "input": "x", "tool_choice": {"type": "function", "name": "f"}}),
                "tool_choice",
            ),
            (
                json!({"model": "m", "input": "x", "temperature": "hot"}),
                "temperature",
            ),
            (
                json!({"model": "m", "input": "x", "include": [3]}),
                "include[0]",
            ),
            (json!({"model": "m", "input": "x", "store": "yes"}), "store"),
            (json!({"input": "x"}), "model"),
            (
                json!({"model": "m", "input": "x", "leyline": {"context_management": {"edits": []}}}),
                "leyline.context_management",
            ),
        ];
        for (body, want) in cases {
            assert_eq!(param(req(body.clone()).unwrap_err()), want, "{body}");
        }
    }

    #[test]
    fn codex_fields_are_accepted() {
        let r = req(json!({
            "model": "m", "instructions": "You are Codex.", "input": [],
            "tools": [], "tool_choice": "auto", "parallel_tool_calls": false,
            "reasoning": {"effort": "medium", "summary": "auto"}, "store": false, "stream": true,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "conv-1",
            "text": {"verbosity": "low", "format": {"type": "text"}}, "client_metadata": {"a": "b"},
            "service_tier": "auto", "truncation": "auto", "background": false, "top_logprobs": 0,
            "metadata": {"k": "v"}, "user": "u", "safety_identifier": "s",
            "prompt_cache_retention": "24h", "temperature": null,
        }))
        .unwrap();
        assert!(!r.store && r.stream && !r.parallel_tool_calls);
        assert_eq!(r.prompt_cache_key.as_deref(), Some("conv-1"));
        assert_eq!(r.temperature, None);
        assert!(req(json!({"model": "m", "input": "x"})).unwrap().store);
    }

    #[test]
    fn hosted_tools_are_listed_and_function_tools_take_the_template_form() {
        let tools = [
            json!({"type": "function", "name": "shell", "description": "Run", "parameters": {"type": "object"}, "strict": false}),
            json!({"type": "web_search"}),
            json!({"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}}),
            json!({"type": "local_shell"}),
        ];
        let t = split_tools(&tools, ToolChoice::Auto).unwrap();
        let template = t.template.as_ref().unwrap();
        assert_eq!(template.len(), 1);
        assert_eq!(
            template[0],
            json!({"type": "function", "function": {"name": "shell", "description": "Run", "parameters": {"type": "object"}}})
        );
        assert_eq!(crate::toolcall::tool_names(template), ["shell"]);
        assert_eq!(
            t.unsupported,
            [
                json!({"type": "web_search"}),
                json!({"type": "custom", "name": "apply_patch"}),
                json!({"type": "local_shell"})
            ]
        );
        assert_eq!(t.echoed[0]["name"], "shell");
        let none = split_tools(&tools, ToolChoice::None).unwrap();
        assert_eq!(none.template, None);
        assert_eq!(none.unsupported.len(), 3);
        assert_eq!(
            param(split_tools(&[json!({"name": "f"})], ToolChoice::Auto).unwrap_err()),
            "tools[0].type"
        );
        assert_eq!(
            param(split_tools(&[json!({"type": "function"})], ToolChoice::Auto).unwrap_err()),
            "tools[0].name"
        );
    }
}
