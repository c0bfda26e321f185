//! OpenAI wire types (requests, responses, stream chunks) and their conversions into engine
//! types. Unknown request fields are ignored, as OpenAI-compatible servers do; known fields
//! with a wrong type or an absurd value are refused with the field named.

use crate::error::{Result, ServerError};
use leyline_core::Mode;
use leyline_engine::SamplingParams;
use leyline_model::chat::ChatMessage;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and `usage: null` on the others).
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// `stop`: one string or a list of up to four.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// How a request uses cached context, as `leyline.mode` (or, for a request without a session,
/// the `X-Leyline-Mode` header) names it: an edit of cached context becomes directives of a
/// [`Mode`] (`amortize`, the default, or `forget`), or only the prefix cache is used
/// (`prefix`). The one vocabulary from the wire to the directive: the names are [`Mode`]'s.
///
/// - `amortize`: splice the edit in place. In the body without a session id it opens a new
///   session (its id comes back); by header it is the implicit splice.
/// - `forget`: trim and prefill again; what the edit drops is never served again. In the body
///   without a session id it opens a new session; by header the conversation the request
///   continues takes the turn in FORGET mode.
/// - `prefix`: no splice (a session keeps its longest common prefix with the prompt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    /// Edits become directives of this mode.
    Edit(Mode),
    /// The prefix cache only.
    Prefix,
}

impl CacheMode {
    /// What a request without a mode gets: AMORTIZE.
    pub const DEFAULT: CacheMode = CacheMode::Edit(Mode::Amortize);
    /// Every name, in the order errors list them.
    const NAMES: [&'static str; 3] = ["amortize", "forget", "prefix"];

    /// The mode's name: [`Mode::name`], or `prefix`.
    pub fn name(self) -> &'static str {
        match self {
            CacheMode::Edit(m) => m.name(),
            CacheMode::Prefix => "prefix",
        }
    }

    /// The mode of an exact name.
    fn from_name(name: &str) -> Option<Self> {
        match name {
            "prefix" => Some(CacheMode::Prefix),
            _ => Mode::from_name(name).map(CacheMode::Edit),
        }
    }

    /// Reads the `X-Leyline-Mode` header's value (case and surrounding blanks ignored).
    pub fn parse(s: &str) -> Option<Self> {
        Self::from_name(&s.trim().to_ascii_lowercase())
    }

    /// The mode of a session turn's directives (or, without message bounds, of its token
    /// diff): a prefix-only turn keeps the longest common prefix, as AMORTIZE does.
    pub fn directive_mode(self) -> Mode {
        match self {
            CacheMode::Edit(m) => m,
            CacheMode::Prefix => Mode::Amortize,
        }
    }
}

impl Serialize for CacheMode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for CacheMode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Self::from_name(&name).ok_or_else(|| serde::de::Error::unknown_variant(&name, &Self::NAMES))
    }
}

/// Leyline's own top-level request fields, the same on every API.
pub const LEYLINE_FIELDS: [&str; 3] = ["leyline", "session_id", "cache_salt"];

/// Leyline's own request options (`extra_body={"leyline": {...}}` in OpenAI clients).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub struct LeylineOptions {
    /// How an edit of the session's earlier context is applied.
    #[serde(default)]
    pub mode: Option<CacheMode>,
    /// Server-side context edits (chat completions): `{"edits": [...]}` as on
    /// `/v1/messages` (see `context.rs`).
    #[serde(default)]
    pub context_management: Option<Value>,
    /// How many downstream tokens this turn's AMORTIZE splice recomputes under the edited
    /// context, and which ([`WireRepair`]); the server's `--repair` when absent.
    #[serde(default)]
    pub repair: Option<WireRepair>,
    /// Report each generated token's log-probability and this many alternatives (0-20) in
    /// the response's `leyline.logprobs` (OpenAI's chat `logprobs.content` shape), in any API.
    #[serde(default)]
    pub logprobs: Option<usize>,
}

/// A repair on the wire: a token count (the first N tokens after each edit), a string
/// (`after_edit:N`, `before_end:N` or `deviation:N`), or `{"tokens": N, "rule": "after_edit"}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum WireRepair {
    /// The first N tokens after each edit.
    Tokens(usize),
    /// `after_edit:N`, `before_end:N` or `deviation:N`.
    Spec(String),
    /// Count and rule.
    Full(leyline_core::Repair),
}

impl WireRepair {
    /// The repair it names; a 400 naming `param` for a string that names none.
    ///
    /// # Errors
    /// [`ServerError::InvalidRequest`].
    pub fn resolve(&self, param: &str) -> Result<leyline_core::Repair> {
        match self {
            Self::Tokens(n) => Ok(leyline_core::Repair::new(
                *n,
                leyline_core::RepairRule::AfterEdit,
            )),
            Self::Spec(s) => s
                .parse()
                .map_err(|e: String| ServerError::invalid(param, e)),
            Self::Full(r) => Ok(*r),
        }
    }
}

/// Sampling and length fields shared by both completion endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GenerationFields {
    /// Most new tokens (legacy name).
    #[serde(default)]
    pub max_tokens: Option<i64>,
    /// Most new tokens (current name; wins over `max_tokens`).
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    /// Softmax temperature in [0, 2]; default 1.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus mass in (0, 1]; default 1.
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Keep only the `top_k` most likely tokens (an extension, as vLLM's and llama.cpp's
    /// servers take it); 0 or -1 (vLLM's spelling) turns it off, the default.
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Sampler seed; random when absent.
    #[serde(default)]
    pub seed: Option<i64>,
    /// Stop strings (not included in the output).
    #[serde(default)]
    pub stop: Option<StopSpec>,
    /// Number of choices; only 1 is served.
    #[serde(default)]
    pub n: Option<i64>,
    /// Stream by SSE.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Stream options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Leyline session to run in.
    #[serde(default)]
    pub session_id: Option<String>,
    /// Leyline options.
    #[serde(default)]
    pub leyline: Option<LeylineOptions>,
    /// The `X-Leyline-Mode` header, set by the handler (not a body field).
    #[serde(skip)]
    pub header_mode: Option<CacheMode>,
    /// The client's name for its conversation (`prompt_cache_key`, `session-id`,
    /// `X-Claude-Code-Session-Id`): implicit splices continue only a conversation cached
    /// under the same name. Set by the handler (not a body field here).
    #[serde(skip)]
    pub conversation: Option<String>,
    /// Whether the prompt carries earlier turns (an assistant message), set when a chat
    /// prompt is rendered: a session created for it is a rebuild, not a first turn.
    #[serde(skip)]
    pub history: bool,
    /// Separates the prefix caches of users behind one API key (as vLLM's `cache_salt`):
    /// requests match only cached prefixes computed under the same key and salt.
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// Not implemented: refused unless empty.
    #[serde(default)]
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Not implemented: refused unless 0.
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    /// Not implemented: refused unless 0.
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    /// Not implemented: refused unless 1.
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
    /// Log-probabilities: `true` on chat completions (with `top_logprobs` alternatives), a
    /// count of alternatives (0-20) on completions.
    #[serde(default)]
    pub logprobs: Option<Value>,
    /// Chat completions: alternatives per token (0-20), with `logprobs: true`.
    #[serde(default)]
    pub top_logprobs: Option<i64>,
}

/// Longest stop string, in bytes: matching holds back at most this much text per token.
pub const MAX_STOP_BYTES: usize = 256;
/// Longest `cache_salt`, in bytes.
pub const MAX_CACHE_SALT_BYTES: usize = 256;

/// What the server generates with, after validation.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Most new tokens, if the client set it.
    pub max_tokens: Option<usize>,
    /// Sampler settings.
    pub sampling: SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Stream by SSE.
    pub stream: bool,
    /// Send a usage chunk at the end of a stream.
    pub include_usage: bool,
    /// The API's own log-probability field was set (chat `logprobs: true`, completions
    /// `logprobs: N`).
    pub logprobs: bool,
    /// `leyline.logprobs` was set: the `leyline` object carries them (any API).
    pub leyline_logprobs: bool,
}

impl GenerationFields {
    /// Validates ranges and converts.
    ///
    /// # Errors
    /// [`ServerError::InvalidRequest`] naming the field.
    pub fn validate(&self) -> Result<Generation> {
        let max_tokens = match self
            .max_completion_tokens
            .map(|v| ("max_completion_tokens", v))
            .or(self.max_tokens.map(|v| ("max_tokens", v)))
        {
            Some((name, v)) if v < 1 => {
                return Err(ServerError::invalid(
                    name,
                    format!("{name} must be at least 1, got {v}"),
                ))
            }
            Some((_, v)) => Some(usize::try_from(v).unwrap_or(usize::MAX)),
            None => None,
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !temperature.is_finite() || !(0.0..=2.0).contains(&temperature) {
            return Err(ServerError::invalid(
                "temperature",
                format!("temperature must be between 0 and 2, got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        // Checked as the sampler holds it: 1e-50 is positive as f64 and 0 as f32.
        if !((top_p as f32) > 0.0 && top_p <= 1.0) {
            return Err(ServerError::invalid(
                "top_p",
                format!("top_p must be in (0, 1], got {top_p}"),
            ));
        }
        let top_k = match self.top_k {
            None | Some(-1) => 0,
            Some(k) => usize::try_from(k).map_err(|_| {
                ServerError::invalid(
                    "top_k",
                    format!("top_k must be >= 0 (or -1 for off), got {k}"),
                )
            })?,
        };
        match self.n {
            None | Some(1) => {}
            Some(n) => {
                return Err(ServerError::invalid(
                    "n",
                    format!("only n=1 is supported, got {n}"),
                ))
            }
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopSpec::One(s)) => vec![s.clone()],
            Some(StopSpec::Many(v)) => v.clone(),
        };
        if stop.len() > 4 {
            return Err(ServerError::invalid(
                "stop",
                format!("at most 4 stop strings, got {}", stop.len()),
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(ServerError::invalid(
                "stop",
                "stop strings must not be empty",
            ));
        }
        if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ServerError::invalid(
                "stop",
                format!(
                    "stop strings may have at most {MAX_STOP_BYTES} bytes, got {}",
                    long.len()
                ),
            ));
        }
        self.refuse_unimplemented()?;
        let (logprobs, top) = self.logprobs()?;
        let leyline_top = self.leyline.as_ref().and_then(|l| l.logprobs);
        if leyline_top.is_some_and(|n| n > crate::logprobs::MAX_TOP_LOGPROBS) {
            return Err(ServerError::invalid(
                "leyline.logprobs",
                format!(
                    "leyline.logprobs must be 0 to {}",
                    crate::logprobs::MAX_TOP_LOGPROBS
                ),
            ));
        }
        if self
            .cache_salt
            .as_ref()
            .is_some_and(|s| s.is_empty() || s.len() > MAX_CACHE_SALT_BYTES)
        {
            return Err(ServerError::invalid(
                "cache_salt",
                format!("cache_salt must have 1 to {MAX_CACHE_SALT_BYTES} bytes"),
            ));
        }
        let seed = match self.seed {
            Some(s) => s as u64,
            None => rand::random(),
        };
        let stream = self.stream.unwrap_or(false);
        let include_usage = self
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        Ok(Generation {
            max_tokens,
            sampling: SamplingParams {
                temperature: temperature as f32,
                top_p: top_p as f32,
                top_k,
                seed,
                logprobs: match (logprobs.then_some(top), leyline_top) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                },
            },
            stop,
            stream,
            include_usage,
            logprobs,
            leyline_logprobs: leyline_top.is_some(),
        })
    }

    /// Whether the API's own log-probabilities were asked for, and how many alternatives.
    fn logprobs(&self) -> Result<(bool, usize)> {
        let max = crate::logprobs::MAX_TOP_LOGPROBS as i64;
        let top = match self.top_logprobs {
            None => None,
            Some(n) if (0..=max).contains(&n) => Some(n as usize),
            Some(n) => {
                return Err(ServerError::invalid(
                    "top_logprobs",
                    format!("top_logprobs must be 0 to {max}, got {n}"),
                ))
            }
        };
        match &self.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => match top {
                Some(n) if n > 0 => Err(ServerError::invalid(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                )),
                _ => Ok((false, 0)),
            },
            Some(Value::Bool(true)) => Ok((true, top.unwrap_or(0))),
            Some(Value::Number(n)) if top.is_none() => match n.as_i64() {
                Some(k) if (0..=max).contains(&k) => Ok((true, k as usize)),
                _ => Err(ServerError::invalid(
                    "logprobs",
                    format!("logprobs must be 0 to {max}, got {n}"),
                )),
            },
            Some(_) => Err(ServerError::invalid(
                "logprobs",
                "logprobs must be true or false (chat completions) or a count of \
                 alternatives (completions)",
            )),
        }
    }
}

impl GenerationFields {
    /// Sampling controls this server does not implement are refused with the field named,
    /// rather than silently ignored; their neutral values pass.
    fn refuse_unimplemented(&self) -> Result<()> {
        let refuse = |field: &str| {
            Err(ServerError::invalid(
                field,
                format!("{field} is not supported by this server; leave it out"),
            ))
        };
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return refuse("logit_bias");
        }
        for (field, v, neutral) in [
            ("presence_penalty", self.presence_penalty, 0.0),
            ("frequency_penalty", self.frequency_penalty, 0.0),
            ("repetition_penalty", self.repetition_penalty, 1.0),
        ] {
            if v.is_some_and(|v| v != neutral) {
                return refuse(field);
            }
        }
        Ok(())
    }
}

/// A message's `content`: text, or a list of parts of which only text parts are served.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// `text` (others are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// The roles a chat message may have.
pub const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// One message of a chat request.
#[derive(Debug, Clone, Deserialize)]
pub struct WireMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Text or text parts; may be null on an assistant message with tool calls.
    #[serde(default)]
    pub content: Option<Content>,
    /// Author or tool name.
    #[serde(default)]
    pub name: Option<String>,
    /// Tool calls of an assistant message.
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
    /// The call a tool message answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

impl WireMessage {
    /// Converts to the template's message, joining text parts.
    ///
    /// # Errors
    /// A non-text content part.
    pub fn into_chat(self, index: usize) -> Result<ChatMessage> {
        if !ROLES.contains(&self.role.as_str()) {
            return Err(ServerError::invalid(
                &format!("messages[{index}].role"),
                format!(
                    "unknown role {:?}; expected one of {}",
                    self.role,
                    ROLES.join(", ")
                ),
            ));
        }
        let content = match self.content {
            None => None,
            Some(Content::Text(t)) => Some(t),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        (kind, _) => {
                            return Err(ServerError::invalid(
                                &format!("messages[{index}].content"),
                                format!(
                                    "only text content parts are supported, got a {kind:?} part"
                                ),
                            ))
                        }
                    }
                }
                Some(text)
            }
        };
        Ok(ChatMessage {
            role: self.role,
            content,
            name: self.name,
            tool_calls: self.tool_calls,
            tool_call_id: self.tool_call_id,
            extra: serde_json::Map::new(),
        })
    }
}

/// `POST /v1/chat/completions` (its sampling, length, streaming and Leyline fields are
/// read separately as [`GenerationFields`], so errors name the field).
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    /// Model id (see `GET /v1/models`).
    pub model: String,
    /// The conversation.
    pub messages: Vec<WireMessage>,
    /// Tool schemas, passed to the chat template.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
}

/// A completion prompt: text, one text in a list, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// Texts (only one is served).
    Texts(Vec<String>),
}

/// `POST /v1/completions` (with [`GenerationFields`] read separately).
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Model id.
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// Echo the prompt (not supported).
    #[serde(default)]
    pub echo: Option<bool>,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the KV cache.
    pub cached_tokens: usize,
}

/// `usage`.
#[derive(Debug, Clone, Serialize)]
pub struct WireUsage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// Cache details.
    pub prompt_tokens_details: PromptTokensDetails,
}

impl From<&leyline_engine::Usage> for WireUsage {
    fn from(u: &leyline_engine::Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_tokens,
            },
        }
    }
}

/// The `leyline` object of a response: what the cache did for this request.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LeylineReport {
    /// The session the request ran in, if any.
    pub session_id: Option<String>,
    /// The mode edits were applied in, if a session.
    pub mode: Option<CacheMode>,
    /// Whether cached context was spliced for this request (AMORTIZE directives applied),
    /// in a named session or, without one, in the cached conversation it continued.
    pub spliced: bool,
    /// Directives applied before this request.
    pub directives_applied: usize,
    /// Prompt tokens whose KV was reused.
    pub tokens_reused: usize,
    /// Reused tokens whose keys were rotated.
    pub tokens_rotated: usize,
    /// Downstream tokens the splice recomputed under the edited context (`repair`).
    pub tokens_repaired: usize,
    /// Prompt tokens prefilled.
    pub tokens_prefilled: usize,
    /// Whether this turn named a session this server did not hold and, carrying the
    /// conversation's history, created it again (after a failover or a rebalance).
    pub session_rebuilt: bool,
    /// With `leyline.logprobs` in the request: each generated token's log-probabilities.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Value>,
    /// With `leyline.context_management` in the request: `{"applied_edits": [...]}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_management: Option<Value>,
    /// Tools the request listed that the model was not offered, since this server does not
    /// run them (Anthropic's server tools by name, OpenAI's hosted tools as sent).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unsupported_tools: Vec<Value>,
}

/// An assistant message in a response.
#[derive(Debug, Clone, Serialize)]
pub struct ResponseMessage {
    /// `assistant`.
    pub role: &'static str,
    /// The generated text (null when the reply is only tool calls).
    pub content: Option<String>,
    /// The reasoning of a model that reasons (`<think>`), apart from the answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Tool calls the model made (requests with `tools`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
}

/// One choice of a chat completion.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    /// 0.
    pub index: usize,
    /// The reply.
    pub message: ResponseMessage,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: &'static str,
    /// `{"content": [...]}` (chat) or the legacy shape (completions) when asked for; on a
    /// stream, every token's on the chunk with the finish reason.
    pub logprobs: Option<Value>,
}

/// `chat.completion`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    /// `chatcmpl-...`.
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Model id.
    pub model: String,
    /// One choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: WireUsage,
    /// What the cache did.
    pub leyline: LeylineReport,
}

/// A stream delta.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Delta {
    /// `assistant` on the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// New reasoning (a model that reasons in `<think>` blocks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Tool calls, each whole in one delta (`index`, `id`, `type`, `function`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
}

/// One choice of a stream chunk.
#[derive(Debug, Clone, Serialize)]
pub struct ChunkChoice {
    /// 0.
    pub index: usize,
    /// Chat: the delta.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<Delta>,
    /// Completions: the new text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Set on the last content chunk.
    pub finish_reason: Option<&'static str>,
    /// `{"content": [...]}` (chat) or the legacy shape (completions) when asked for; on a
    /// stream, every token's on the chunk with the finish reason.
    pub logprobs: Option<Value>,
}

/// `chat.completion.chunk` or a streamed `text_completion`.
#[derive(Debug, Clone, Serialize)]
pub struct Chunk {
    /// Same for every chunk of a stream.
    pub id: String,
    /// `chat.completion.chunk` or `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Model id.
    pub model: String,
    /// One choice, or none on the usage chunk.
    pub choices: Vec<ChunkChoice>,
    /// With `include_usage`: null except on the last chunk. Absent otherwise.
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    pub usage: UsageField,
    /// On the usage chunk (or the last chunk): what the cache did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leyline: Option<LeylineReport>,
}

/// `usage` of a chunk: absent, `null`, or counts.
#[derive(Debug, Clone)]
pub enum UsageField {
    /// Not written.
    Absent,
    /// `null`.
    Null,
    /// Counts.
    Some(WireUsage),
}

impl UsageField {
    fn is_absent(&self) -> bool {
        matches!(self, UsageField::Absent)
    }
}

impl Serialize for UsageField {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            UsageField::Some(u) => u.serialize(s),
            _ => s.serialize_none(),
        }
    }
}

/// One choice of a text completion.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    /// The generated text.
    pub text: String,
    /// 0.
    pub index: usize,
    /// `{"content": [...]}` (chat) or the legacy shape (completions) when asked for; on a
    /// stream, every token's on the chunk with the finish reason.
    pub logprobs: Option<Value>,
    /// `stop` or `length`.
    pub finish_reason: &'static str,
}

/// `text_completion`.
#[derive(Debug, Clone, Serialize)]
pub struct Completion {
    /// `cmpl-...`.
    pub id: String,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Model id.
    pub model: String,
    /// One choice.
    pub choices: Vec<CompletionChoice>,
    /// Token counts.
    pub usage: WireUsage,
    /// What the cache did.
    pub leyline: LeylineReport,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The API's three names (README, `X-Leyline-Mode`), in the body exactly and in the
    /// header with any case and blanks; the engine modes they carry; anything else refused
    /// with the names listed.
    #[test]
    fn cache_modes_have_the_wire_names_and_carry_the_directive_mode() {
        let body = |v: Value| serde_json::from_value::<CacheMode>(v);
        assert_eq!(
            body("amortize".into()).unwrap(),
            CacheMode::Edit(Mode::Amortize)
        );
        assert_eq!(
            body("forget".into()).unwrap(),
            CacheMode::Edit(Mode::Forget)
        );
        assert_eq!(body("prefix".into()).unwrap(), CacheMode::Prefix);
        let e = body("Forget".into()).unwrap_err().to_string();
        assert!(
            e.contains("`Forget`") && e.contains("`amortize`, `forget`, `prefix`"),
            "{e}"
        );
        assert!(body(3.into()).is_err());
        assert_eq!(
            CacheMode::parse(" FORGET "),
            Some(CacheMode::Edit(Mode::Forget))
        );
        assert_eq!(CacheMode::parse("Prefix"), Some(CacheMode::Prefix));
        assert_eq!(CacheMode::parse("splice"), None);
        for (m, name) in [
            (CacheMode::Edit(Mode::Amortize), "\"amortize\""),
            (CacheMode::Edit(Mode::Forget), "\"forget\""),
            (CacheMode::Prefix, "\"prefix\""),
        ] {
            assert_eq!(serde_json::to_string(&m).unwrap(), name);
        }
        assert_eq!(CacheMode::DEFAULT.directive_mode(), Mode::Amortize);
        assert_eq!(CacheMode::Prefix.directive_mode(), Mode::Amortize);
        assert_eq!(CacheMode::Edit(Mode::Forget).directive_mode(), Mode::Forget);
    }

    fn fields(v: Value) -> GenerationFields {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn max_completion_tokens_wins_and_bad_values_name_the_field() {
        let g = fields(serde_json::json!({"max_tokens": 5, "max_completion_tokens": 7}))
            .validate()
            .unwrap();
        assert_eq!(g.max_tokens, Some(7));
        let e = fields(serde_json::json!({"max_tokens": -1}))
            .validate()
            .unwrap_err();
        assert!(
            e.to_string().contains("max_tokens") && e.to_string().contains("-1"),
            "{e}"
        );
        let e = fields(serde_json::json!({"temperature": 3.5}))
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("temperature"), "{e}");
        let e = fields(serde_json::json!({"n": 2})).validate().unwrap_err();
        assert!(e.to_string().contains("n=1"), "{e}");
        let e = fields(serde_json::json!({"stop": ["a", "b", "c", "d", "e"]}))
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("stop"), "{e}");
    }

    #[test]
    fn usage_chunk_field_is_null_or_absent() {
        let chunk = |usage| Chunk {
            id: "x".into(),
            object: "chat.completion.chunk",
            created: 0,
            model: "m".into(),
            choices: vec![],
            usage,
            leyline: None,
        };
        let absent = serde_json::to_value(chunk(UsageField::Absent)).unwrap();
        assert!(absent.get("usage").is_none());
        let null = serde_json::to_value(chunk(UsageField::Null)).unwrap();
        assert!(null.get("usage").unwrap().is_null());
    }

    #[test]
    fn text_parts_join_and_image_parts_are_refused() {
        let m: WireMessage = serde_json::from_value(serde_json::json!({
            "role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        }))
        .unwrap();
        assert_eq!(m.into_chat(0).unwrap().content.as_deref(), Some("ab"));
        let m: WireMessage = serde_json::from_value(serde_json::json!({
            "role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]
        }))
        .unwrap();
        assert!(m
            .into_chat(3)
            .unwrap_err()
            .to_string()
            .contains("image_url"));
    }
}
