//! Chat templates: the model's Jinja template (`tokenizer.chat_template`) rendered the way
//! Hugging Face transformers renders it, with minijinja.
//!
//! Compatibility with transformers' `apply_chat_template`: `trim_blocks` and
//! `lstrip_blocks` on, loop controls, Python string/dict methods (minijinja-contrib's
//! pycompat), `raise_exception(msg)`, a `tojson` that writes what Python's
//! `json.dumps(ensure_ascii=False)` writes, and the context `messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token`, `tools` and `documents` (`none` when
//! not given, as transformers passes them).
//!
//! A file without a template gets a built-in one where Leyline has one for its architecture
//! ([`BUILTIN_TEMPLATES`]: Gemma 3, whose GGUF files carry none); any other file without one
//! has no chat template.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value as GgufValue;
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::tokenizer::Tokenizer;

/// Name of the one template in a [`ChatTemplate`]'s environment.
const TEMPLATE_NAME: &str = "chat";

/// Leyline's own Gemma 3 template (`chat/gemma3.jinja`; its opening comment gives the
/// format): `<bos>`, `<start_of_turn>user` / `<start_of_turn>model` turns closed by
/// `<end_of_turn>\n`, a first system message folded into the first user turn before a blank
/// line, roles alternating, tools described in the first user turn and called as
/// `<tool_call>` JSON.
pub const GEMMA3_TEMPLATE: &str = include_str!("chat/gemma3.jinja");

/// The built-in templates by `general.architecture`, for files that carry none.
pub const BUILTIN_TEMPLATES: &[(&str, &str)] = &[("gemma3", GEMMA3_TEMPLATE)];

/// One chat message, serde-compatible with OpenAI's `messages` entries.
///
/// Fields that are `None` are absent from what the template sees (so `message.content`
/// of an assistant turn with only `tool_calls` is undefined, as for a Python dict without
/// that key). Unknown fields are kept in `extra` and passed through to the template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, or any role the template accepts.
    pub role: String,
    /// The text of the message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Name of the author or, on a tool message, of the tool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Tool calls of an assistant message, as OpenAI writes them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// On a tool message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Any other fields, passed to the template unchanged.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// A message with a role and text content and nothing else.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: Some(content.into()),
            name: None,
            tool_calls: None,
            tool_call_id: None,
            extra: serde_json::Map::new(),
        }
    }
}

/// Options of one rendering beyond the messages.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    /// Append the opening of an assistant turn (`<|im_start|>assistant\n` for ChatML).
    pub add_generation_prompt: bool,
    /// Tool schemas (OpenAI `tools`), or `None` (the template sees `none`).
    pub tools: Option<Vec<serde_json::Value>>,
    /// Further variables for the template (e.g. `enable_thinking`); these override the
    /// built-in ones of the same name.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// A compiled chat template with the special tokens it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    /// The architecture whose built-in template this is, when the file had none.
    builtin_for: Option<&'static str>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source` (Jinja) with the given BOS / EOS token texts.
    ///
    /// # Errors
    /// [`ModelError::Template`] on a syntax error.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_test("iterable", is_iterable);
        let source = source.into();
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(template_err)?;
        Ok(Self {
            env,
            source,
            builtin_for: None,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The template of a GGUF file (`tokenizer.chat_template`), with the BOS / EOS texts of
    /// `tokenizer` (empty where the file names none). A file without the key whose
    /// `general.architecture` has a built-in template ([`BUILTIN_TEMPLATES`]) gets that one,
    /// which [`Self::builtin_for`] then names (and an `info` log line says so).
    ///
    /// # Errors
    /// [`ModelError::Template`] if the key is missing (and no built-in template applies), not
    /// a string, or does not compile.
    pub fn from_gguf_metadata(
        md: &HashMap<String, GgufValue>,
        tokenizer: &Tokenizer,
    ) -> Result<Self> {
        let text = |id: Option<u32>| -> Result<String> {
            match id {
                Some(id) => tokenizer.decode(&[id], false),
                None => Ok(String::new()),
            }
        };
        let (bos, eos) = (text(tokenizer.bos_id())?, text(tokenizer.eos_id())?);
        let Some(value) = md.get("tokenizer.chat_template") else {
            let arch = md
                .get("general.architecture")
                .and_then(|v| v.to_string().ok())
                .map(String::as_str);
            let Some(&(arch, source)) = BUILTIN_TEMPLATES.iter().find(|(a, _)| Some(*a) == arch)
            else {
                return Err(ModelError::Template(format!(
                    "the file has no tokenizer.chat_template, and Leyline has no built-in \
                     template for its architecture {} (it has one for: {})",
                    arch.map_or_else(|| "(none named)".to_string(), |a| format!("{a:?}")),
                    BUILTIN_TEMPLATES
                        .iter()
                        .map(|(a, _)| *a)
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            };
            tracing::info!(
                architecture = arch,
                "the file has no tokenizer.chat_template: using Leyline's built-in {arch} template"
            );
            let mut t = Self::new(source, bos, eos)?;
            t.builtin_for = Some(arch);
            return Ok(t);
        };
        let source = value
            .to_string()
            .map_err(|e| ModelError::Template(format!("tokenizer.chat_template: {e}")))?;
        Self::new(source.clone(), bos, eos)
    }

    /// The architecture whose built-in template this is, when the file carried none
    /// (`Some("gemma3")`); `None` for the file's own template or one given as source.
    pub fn builtin_for(&self) -> Option<&'static str> {
        self.builtin_for
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends with the opening of
    /// an assistant turn.
    ///
    /// # Errors
    /// [`ModelError::Template`] if rendering fails or the template raises (e.g. a message
    /// without `content` where the template needs one).
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(
            messages,
            &RenderOptions {
                add_generation_prompt,
                ..RenderOptions::default()
            },
        )
    }

    /// Renders `messages` with [`RenderOptions`].
    ///
    /// # Errors
    /// As [`render`](Self::render).
    pub fn render_with(&self, messages: &[ChatMessage], opts: &RenderOptions) -> Result<String> {
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(template_err)?;
        let mut ctx: HashMap<&str, Value> = HashMap::new();
        ctx.insert("messages", Value::from_serialize(messages));
        ctx.insert(
            "add_generation_prompt",
            Value::from(opts.add_generation_prompt),
        );
        ctx.insert("bos_token", Value::from(self.bos_token.as_str()));
        ctx.insert("eos_token", Value::from(self.eos_token.as_str()));
        ctx.insert(
            "tools",
            opts.tools
                .as_ref()
                .map_or(Value::from(()), Value::from_serialize),
        );
        ctx.insert("documents", Value::from(()));
        for (k, v) in &opts.extra {
            ctx.insert(k.as_str(), Value::from_serialize(v));
        }
        tmpl.render(ctx).map_err(template_err)
    }
}

fn template_err(e: Error) -> ModelError {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    ModelError::Template(msg)
}

/// Python's `is iterable`: strings, lists, dicts and undefined values (Jinja's
/// `Undefined` iterates as empty) are; `none`, numbers and booleans are not. (minijinja's
/// own test holds `none` iterable, and Qwen3-Coder's template then takes `none | length`.)
fn is_iterable(v: &Value) -> bool {
    use minijinja::value::ValueKind;
    matches!(
        v.kind(),
        ValueKind::Undefined
            | ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
            | ValueKind::Iterable
    )
}

/// `raise_exception(msg)`: the template's own error, as transformers defines it.
fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `tojson(indent=None, sort_keys=False)`: Python's `json.dumps(x, ensure_ascii=False)`
/// layout (`", "` and `": "` separators; with `indent`, one item per line).
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    // Unknown keyword arguments (ensure_ascii, separators) are accepted and ignored.
    for key in ["ensure_ascii", "separators"] {
        let _: Option<Value> = kwargs.get(key)?;
    }
    kwargs.assert_all_used()?;
    let json = to_python_json(&value, indent, sort_keys.unwrap_or(false))
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(json))
}

/// Serializes like Python's `json.dumps` with `ensure_ascii=False`.
fn to_python_json(
    value: &Value,
    indent: Option<usize>,
    sort_keys: bool,
) -> std::result::Result<String, serde_json::Error> {
    let mut json = serde_json::to_value(value)?;
    if sort_keys {
        sort_json_keys(&mut json);
    }
    let mut out = Vec::new();
    match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&pad);
            let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
            serde::Serialize::serialize(&json, &mut ser)?;
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
            serde::Serialize::serialize(&json, &mut ser)?;
        }
    }
    // serde_json writes only valid UTF-8.
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn sort_json_keys(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(map) => {
            map.sort_keys();
            map.values_mut().for_each(sort_json_keys);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(sort_json_keys),
        _ => {}
    }
}

/// serde_json formatter with Python's default separators `", "` and `": "`.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render_src(src: &str, ctx: Value) -> Result<String> {
        let t = ChatTemplate::new(src, "<s>", "</s>")?;
        t.env.render_str(src, ctx).map_err(template_err)
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        // Expected strings written from Python's json.dumps(x, ensure_ascii=False[, indent=2]).
        let v: serde_json::Value =
            serde_json::from_str(r#"{"b": [1, 2.5, null, true], "a": "é\"<x>\n", "c": {}}"#)
                .expect("valid json");
        let ctx = Value::from_serialize(serde_json::json!({ "v": v }));
        assert_eq!(
            render_src("{{ v | tojson }}", ctx.clone()).expect("renders"),
            r#"{"b": [1, 2.5, null, true], "a": "é\"<x>\n", "c": {}}"#
        );
        assert_eq!(
            render_src("{{ v | tojson(indent=2) }}", ctx.clone()).expect("renders"),
            "{\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"a\": \"é\\\"<x>\\n\",\n  \"c\": {}\n}"
        );
        assert_eq!(
            render_src("{{ v.b | tojson }}|{{ v | tojson(sort_keys=true) }}", ctx)
                .expect("renders"),
            r#"[1, 2.5, null, true]|{"a": "é\"<x>\n", "b": [1, 2.5, null, true], "c": {}}"#
        );
    }

    #[test]
    fn python_methods_and_raise_exception() {
        let ctx = Value::from_serialize(serde_json::json!({ "s": "  hi there ", "d": {"k": 1} }));
        assert_eq!(
            render_src(
                "{{ s.strip() }}|{{ s.startswith('  h') }}|{% for k, v in d.items() %}{{ k }}={{ v }}{% endfor %}",
                ctx.clone()
            )
            .expect("renders"),
            "hi there|True|k=1"
        );
        let err = render_src("{{ raise_exception('bad role') }}", ctx).expect_err("raises");
        assert!(err.to_string().contains("bad role"), "{err}");
    }

    #[test]
    fn trim_and_lstrip_blocks_as_transformers() {
        let src = "{% for m in messages %}\n    {{ m }}\n{% endfor %}";
        let ctx = Value::from_serialize(serde_json::json!({ "messages": ["a", "b"] }));
        assert_eq!(render_src(src, ctx).expect("renders"), "    a\n    b\n");
    }

    #[test]
    fn message_serde_keeps_extra_and_omits_none() {
        let m: ChatMessage = serde_json::from_str(
            r#"{"role":"assistant","tool_calls":[{"type":"function"}],"reasoning":"x"}"#,
        )
        .expect("parses");
        assert_eq!(m.content, None);
        assert_eq!(m.extra.get("reasoning"), Some(&serde_json::json!("x")));
        let back = serde_json::to_value(&m).expect("serializes");
        assert!(back.get("content").is_none());
        assert_eq!(back["reasoning"], "x");
    }
}
