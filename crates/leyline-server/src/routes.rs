//! Routes and thin handlers: parse, validate, hand to the engine, shape the answer.

use crate::auth::{require_key, Principal};
use crate::error::{Result, ServerError};
use crate::generation::Piece;
use crate::handler::{engine_call, parse, ApiJson, St};
use crate::openai::*;
use crate::reasoning::OutputSplitter;
use crate::session_routes;
use crate::state::AppState;
use crate::submit::{collect_text, report, start, Collected, SessionRun, Started};
use crate::toolcall::Segment;
use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::middleware::{from_fn_with_state, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use leyline_engine::{render_prompt, ErrorKind, Failure};
use leyline_model::chat::RenderOptions;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio_stream::wrappers::ReceiverStream;

/// Every route; all but `/health` need the API key when one is set.
pub fn router(state: Arc<AppState>) -> Router {
    let guarded = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/v1/sessions", post(session_routes::create_session))
        .route(
            "/v1/sessions/{id}",
            get(session_routes::get_session).delete(session_routes::delete_session),
        )
        .route(
            "/v1/sessions/{id}/directives",
            post(session_routes::apply_directives),
        )
        .route("/v1/cache/flush", post(flush_cache))
        .route("/v1/messages", post(crate::messages::messages))
        .route(
            "/v1/messages/count_tokens",
            post(crate::messages::count_tokens),
        )
        .merge(crate::responses_routes::router(&state));
    let guarded = crate::record::layer(guarded, state.recorder.as_ref())
        .route_layer(from_fn_with_state(Arc::clone(&state), require_key));
    Router::new()
        .route("/health", get(health))
        .merge(guarded)
        .fallback(|| async {
            ServerError::NotFound {
                message: "no such route".into(),
                code: "unknown_route",
            }
        })
        .layer(from_fn_with_state(
            Arc::clone(&state),
            crate::guard::check_host,
        ))
        .layer(from_fn_with_state(Arc::clone(&state), track))
        .with_state(state)
}

/// Counts responses by route and status; refuses new work while draining.
async fn track(State(st): St, req: Request, next: Next) -> Response {
    let route = route_label(req.uri().path());
    let resp = if st.is_draining() && route != "/health" {
        ServerError::ShuttingDown("the server is shutting down".into()).into_response()
    } else {
        next.run(req).await
    };
    st.metrics.record_response(&route, resp.status().as_u16());
    resp
}

/// The metrics label of a path: known routes, with session ids folded.
fn route_label(path: &str) -> String {
    const KNOWN: [&str; 10] = [
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/sessions",
        "/v1/cache/flush",
    ];
    if KNOWN.contains(&path) {
        return path.to_string();
    }
    if path.starts_with("/v1/responses/") {
        return "/v1/responses/{id}".into();
    }
    match path.strip_prefix("/v1/sessions/") {
        Some(rest) if rest.ends_with("/directives") => "/v1/sessions/{id}/directives".into(),
        Some(_) => "/v1/sessions/{id}".into(),
        None => "other".into(),
    }
}

/// 200 while the engine runs; 503 once its thread has stopped (a panic), so that a
/// supervisor restarts the process.
async fn health(State(st): St) -> Response {
    if st.engine.is_alive() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        ServerError::Unavailable {
            message: "the engine has stopped".into(),
            code: "engine_stopped",
        }
        .into_response()
    }
}

/// The served model under each of its ids, with the defaults the server applies to
/// requests that set none (`leyline`).
async fn models(State(st): St) -> Json<Value> {
    let c = &st.config;
    let defaults = json!({
        "context_length": st.context_length,
        "max_output_tokens": c.max_output_tokens,
        "default_max_tokens": c.default_max_tokens,
        "temperature": c.default_temperature,
        "seed": c.default_seed,
    });
    let data: Vec<Value> = std::iter::once(&c.model_name)
        .chain(&c.aliases)
        .map(|id| {
            json!({"id": id, "object": "model", "created": st.created, "owned_by": "leyline",
                   "leyline": {"model": c.model_name, "defaults": defaults}})
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

async fn metrics(State(st): St) -> Response {
    let text = st
        .metrics
        .render(&st.engine.metrics().snapshot(), st.sessions.len());
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        text,
    )
        .into_response()
}

/// `POST /v1/cache/flush`: empties the caller's prefix cache (every tenant's on a server
/// without keys) of what no running request holds. Sessions keep their KV.
async fn flush_cache(State(st): St, Extension(who): Extension<Principal>) -> Result<Json<Value>> {
    let tenant = match who {
        Principal::Anonymous => None,
        key => Some(key.tenant(None)),
    };
    let freed = engine_call(&st, move |e| e.flush_prefix_cache(tenant)).await??;
    Ok(Json(
        json!({"object": "cache.flushed", "freed_slots": freed}),
    ))
}

impl AppState {
    /// Refuses, before any rendering or tokenizing, a prompt that cannot fit: `messages`
    /// messages (each renders to at least one token) or `text_bytes` bytes of text (each token
    /// covers at most `max_token_bytes`).
    pub(crate) fn check_prompt_size(&self, messages: usize, text_bytes: usize) -> Result<()> {
        let limit = self.max_sequence_len;
        let at_least = messages.max(text_bytes.div_ceil(self.max_token_bytes.max(1)));
        if at_least < limit {
            return Ok(());
        }
        Err(self.prompt_too_long(at_least))
    }

    /// The error for a prompt of `tokens` tokens that cannot fit, worded so that both
    /// clients' "prompt too long" handling (compaction) recognises it: Anthropic's message
    /// and OpenAI's `context_length_exceeded` code.
    pub(crate) fn prompt_too_long(&self, tokens: usize) -> ServerError {
        let max = self.max_sequence_len - 1;
        ServerError::InvalidRequest {
            message: format!(
                "prompt is too long: {tokens} tokens > {max} maximum (this server holds at most \
                 {max} tokens per sequence; the model's context length is {})",
                self.context_length
            ),
            param: Some("messages".into()),
            code: Some("context_length_exceeded"),
        }
    }

    /// Validates a request's sampling and length fields, with the server's defaults
    /// (`--temperature`, `--seed`) for those it leaves out.
    ///
    /// # Errors
    /// As [`GenerationFields::validate`].
    pub(crate) fn generation(&self, fields: &mut GenerationFields) -> Result<Generation> {
        if fields.temperature.is_none() {
            fields.temperature = self.config.default_temperature;
        }
        if fields.seed.is_none() {
            fields.seed = self.config.default_seed.map(|s| s as i64);
        }
        fields.validate()
    }

    /// Runs `f` (rendering, tokenizing) on the blocking pool, at most `max_rendering` at once,
    /// so a huge prompt never holds an async worker.
    pub(crate) async fn off_workers<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&AppState) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let permit = Arc::clone(&self.rendering)
            .acquire_owned()
            .await
            .map_err(|_| ServerError::ShuttingDown("the server is shutting down".into()))?;
        let st = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            f(&st)
        })
        .await
        .map_err(|e| ServerError::Engine(format!("rendering the prompt panicked: {e}")))?
    }

    /// Renders and tokenizes `chat` for generation: its size checked first, the work done
    /// off the async workers, with message bounds when the request runs in a session.
    /// `thinking`: a value for the template's `enable_thinking` (Qwen3's switch), or `None`
    /// for its default.
    pub(crate) async fn render_chat(
        self: &Arc<Self>,
        chat: Vec<leyline_model::chat::ChatMessage>,
        tools: Option<Vec<Value>>,
        thinking: Option<bool>,
        fields: &mut GenerationFields,
    ) -> Result<(Vec<u32>, Option<Vec<usize>>)> {
        // A session this prompt creates is a rebuild when the prompt carries earlier turns.
        fields.history = chat.iter().any(|m| m.role == "assistant");
        let text_bytes = chat
            .iter()
            .map(|m| m.content.as_ref().map_or(0, String::len))
            .sum();
        self.check_prompt_size(chat.len(), text_bytes)?;
        let in_session = crate::submit::CachePlan::of(self, fields).needs_bounds();
        self.render(chat, tools, thinking, true, in_session).await
    }

    /// Tokens of `chat` rendered without a generation prompt (as the start of a longer
    /// conversation), with `tools`.
    pub(crate) async fn count_rendered(
        self: &Arc<Self>,
        chat: Vec<leyline_model::chat::ChatMessage>,
        tools: Option<Vec<Value>>,
    ) -> Result<usize> {
        Ok(self.render(chat, tools, None, false, false).await?.0.len())
    }

    /// Renders and tokenizes `chat` off the async workers, as the template takes it: later
    /// system messages folded where the template has no place for them, call arguments as
    /// objects; with message bounds when `with_bounds`.
    async fn render(
        self: &Arc<Self>,
        mut chat: Vec<leyline_model::chat::ChatMessage>,
        tools: Option<Vec<Value>>,
        thinking: Option<bool>,
        add_generation_prompt: bool,
        with_bounds: bool,
    ) -> Result<(Vec<u32>, Option<Vec<usize>>)> {
        if !self.mid_system {
            fold_system_messages(&mut chat);
        }
        // OpenAI's wire form carries a call's arguments as a JSON string; templates (Qwen2.5's
        // `tool_call.arguments | tojson`) expect the object, as transformers renders it.
        for call in chat
            .iter_mut()
            .flat_map(|m| m.tool_calls.iter_mut().flatten())
        {
            let Some(Value::String(args)) = call.pointer("/function/arguments") else {
                continue;
            };
            if let Ok(obj @ Value::Object(_)) = serde_json::from_str::<Value>(args) {
                call["function"]["arguments"] = obj;
            }
        }
        let mut opts = RenderOptions {
            add_generation_prompt,
            tools,
            ..Default::default()
        };
        if let Some(on) = thinking {
            opts.extra.insert("enable_thinking".into(), Value::Bool(on));
        }
        self.off_workers(move |st| {
            let template = st
                .chat
                .as_ref()
                .ok_or_else(|| ServerError::bad_request("this model has no chat template"))?;
            Ok(render_prompt(
                &st.tokenizer,
                template,
                &chat,
                &opts,
                with_bounds,
            )?)
        })
        .await
    }

    /// Checks that `model` is one of the served ids (the name or an alias).
    pub(crate) fn check_model(&self, model: &str) -> Result<()> {
        let c = &self.config;
        if model == c.model_name || c.aliases.iter().any(|a| a == model) {
            return Ok(());
        }
        Err(ServerError::NotFound {
            message: format!(
                "the model {model:?} does not exist; this server serves {:?}{}",
                c.model_name,
                if c.aliases.is_empty() {
                    String::new()
                } else {
                    format!(" (also named {})", c.aliases.join(", "))
                }
            ),
            code: "model_not_found",
        })
    }
}

/// For a template that only takes a system message first: each later `system` message joins
/// the next user message (or, when none follows, the last one before it; or becomes one),
/// its text first and a blank line between, so what it says still reaches the model in order.
pub(crate) fn fold_system_messages(chat: &mut Vec<leyline_model::chat::ChatMessage>) {
    let mut i = 1;
    while i < chat.len() {
        if chat[i].role != "system" {
            i += 1;
            continue;
        }
        let text = chat[i].content.clone().unwrap_or_default();
        let next = (i + 1..chat.len()).find(|&j| chat[j].role == "user");
        let prev = (0..i).rev().find(|&j| chat[j].role == "user");
        match next.or(prev) {
            Some(j) => {
                let old = chat[j].content.take().unwrap_or_default();
                chat[j].content = Some(match (j > i, old.is_empty()) {
                    (_, true) => text,
                    (true, false) => format!("{text}\n\n{old}"),
                    (false, false) => format!("{old}\n\n{text}"),
                });
                chat.remove(i);
            }
            None => {
                chat[i].role = "user".into();
                i += 1;
            }
        }
    }
}

async fn chat_completions(
    State(st): St,
    Extension(who): Extension<Principal>,
    headers: HeaderMap,
    ApiJson(v): ApiJson,
) -> Result<Response> {
    let req: ChatCompletionRequest = parse(&v)?;
    let mut fields: GenerationFields = parse(&v)?;
    fields.header_mode = crate::submit::header_mode(&headers)?;
    crate::submit::session_header(&st, &headers, &mut fields)?;
    crate::submit::conversation_header(&headers, &mut fields)?;
    st.check_model(&req.model)?;
    let gen = st.generation(&mut fields)?;
    if st.chat.is_none() {
        return Err(ServerError::bad_request(
            "this model has no chat template; use /v1/completions",
        ));
    }
    if req.messages.is_empty() {
        return Err(ServerError::invalid(
            "messages",
            "messages must not be empty",
        ));
    }
    let mut messages = req
        .messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| m.into_chat(i))
        .collect::<Result<Vec<_>>>()?;
    let cm = fields
        .leyline
        .as_ref()
        .and_then(|l| l.context_management.as_ref());
    let context_management = match cm {
        Some(cm) => {
            let applied = crate::context::apply(&mut messages, cm, &st.tokenizer)?;
            let applied: Vec<Value> = applied.iter().map(|a| a.to_json()).collect();
            Some(json!({ "applied_edits": applied }))
        }
        None => None,
    };
    let tool_names = req
        .tools
        .as_deref()
        .filter(|t| !t.is_empty())
        .map(crate::toolcall::tool_names);
    // Message bounds anchor the engine's diff of the next turn.
    let (prompt, bounds) = st
        .render_chat(messages, req.tools, None, &mut fields)
        .await?;
    let extras = ChatExtras {
        tool_names,
        think: st.think_for(&prompt),
        context_management,
    };
    run(st, who, Kind::Chat(extras), prompt, bounds, gen, fields).await
}

/// What a chat request adds to its response beyond the text.
#[derive(Clone, Default, PartialEq, Eq)]
struct ChatExtras {
    /// The offered tools' names, if any: the model's tool calls come back as `tool_calls`.
    tool_names: Option<Vec<String>>,
    /// For a model that reasons, whether the prompt left a `<think>` block open: its
    /// reasoning comes back as `reasoning_content`.
    think: Option<bool>,
    /// `leyline.context_management` of the response.
    context_management: Option<Value>,
}

async fn completions(
    State(st): St,
    Extension(who): Extension<Principal>,
    headers: HeaderMap,
    ApiJson(v): ApiJson,
) -> Result<Response> {
    let req: CompletionRequest = parse(&v)?;
    let mut fields: GenerationFields = parse(&v)?;
    crate::submit::session_header(&st, &headers, &mut fields)?;
    st.check_model(&req.model)?;
    let gen = st.generation(&mut fields)?;
    if req.echo == Some(true) {
        return Err(ServerError::invalid("echo", "echo is not supported"));
    }
    let text = match req.prompt {
        Prompt::Text(t) => t,
        Prompt::Texts(mut v) if v.len() == 1 => v.remove(0),
        Prompt::Texts(v) => {
            return Err(ServerError::invalid(
                "prompt",
                format!("only one prompt per request, got {}", v.len()),
            ))
        }
        Prompt::Tokens(ids) => {
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= st.vocab_size) {
                return Err(ServerError::invalid(
                    "prompt",
                    format!(
                        "token id {bad} is outside the vocabulary of {}",
                        st.vocab_size
                    ),
                ));
            }
            return run(st, who, Kind::Completion, ids, None, gen, fields).await;
        }
    };
    st.check_prompt_size(0, text.len())?;
    let prompt = st
        .off_workers(move |st| Ok(st.tokenizer.encode(&text, true)?))
        .await?;
    run(st, who, Kind::Completion, prompt, None, gen, fields).await
}

#[derive(Clone, PartialEq, Eq)]
enum Kind {
    Chat(ChatExtras),
    Completion,
}

async fn run(
    st: Arc<AppState>,
    who: Principal,
    kind: Kind,
    prompt: Vec<u32>,
    bounds: Option<Vec<usize>>,
    gen: Generation,
    fields: GenerationFields,
) -> Result<Response> {
    let Started {
        rx,
        permit,
        session,
        ..
    } = start(&st, who, prompt, bounds, &gen, &fields).await?;
    let ctx = Ctx {
        id: format!(
            "{}{:024x}",
            if matches!(kind, Kind::Chat(_)) {
                "chatcmpl-"
            } else {
                "cmpl-"
            },
            rand::random::<u128>() >> 32
        ),
        created: now(),
        model: st.config.model_name.clone(),
        kind,
        include_usage: gen.include_usage,
        logprobs: gen.logprobs,
        leyline_logprobs: gen.leyline_logprobs,
    };
    if gen.stream {
        Ok(stream(st, ctx, rx, permit, session).into_response())
    } else {
        collect(st, ctx, rx, permit, session).await
    }
}

struct Ctx {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    include_usage: bool,
    /// The API's own `logprobs` field was set.
    logprobs: bool,
    /// `leyline.logprobs` was set.
    leyline_logprobs: bool,
}

impl Ctx {
    /// A choice's `logprobs` in this API's shape, and the `leyline` object's, from the
    /// tokens' entries.
    fn logprobs(&self, entries: Option<Vec<Value>>) -> (Option<Value>, Option<Value>) {
        let Some(entries) = entries else {
            return (None, None);
        };
        let api = self.logprobs.then(|| match self.kind {
            Kind::Chat(_) => json!({ "content": entries }),
            Kind::Completion => crate::logprobs::legacy(&entries),
        });
        (api, self.leyline_logprobs.then(|| json!(entries)))
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn collect(
    st: Arc<AppState>,
    ctx: Ctx,
    mut rx: mpsc::UnboundedReceiver<Piece>,
    _permit: OwnedSemaphorePermit,
    session: Option<SessionRun>,
) -> Result<Response> {
    let Collected {
        text,
        finish_reason,
        usage,
        logprobs,
        ..
    } = collect_text(&st, &mut rx).await?;
    let mut leyline = report(&usage, &session);
    let (logprobs, leyline_logprobs) = ctx.logprobs(logprobs);
    leyline.logprobs = leyline_logprobs;
    let body = match &ctx.kind {
        Kind::Chat(x) => {
            leyline.context_management = x.context_management.clone();
            let Reply {
                content,
                reasoning_content,
                tool_calls,
            } = split_reply(&text, x);
            let finish_reason = match (&tool_calls, finish_reason) {
                (Some(_), "stop") => "tool_calls",
                (_, r) => r,
            };
            serde_json::to_value(ChatCompletion {
                id: ctx.id,
                object: "chat.completion",
                created: ctx.created,
                model: ctx.model,
                choices: vec![ChatChoice {
                    index: 0,
                    message: ResponseMessage {
                        role: "assistant",
                        content,
                        reasoning_content,
                        tool_calls,
                    },
                    finish_reason,
                    logprobs,
                }],
                usage: WireUsage::from(&usage),
                leyline,
            })
        }
        Kind::Completion => serde_json::to_value(Completion {
            id: ctx.id,
            object: "text_completion",
            created: ctx.created,
            model: ctx.model,
            choices: vec![CompletionChoice {
                text,
                index: 0,
                logprobs,
                finish_reason,
            }],
            usage: WireUsage::from(&usage),
            leyline,
        }),
    };
    Ok(Json(body.map_err(|e| ServerError::Engine(e.to_string()))?).into_response())
}

/// A tool call in OpenAI's form (`index` for stream deltas).
fn tool_call(index: Option<usize>, name: &str, arguments: &Value) -> Value {
    let mut call = json!({
        "id": format!("call_{:024x}", rand::random::<u128>() >> 32),
        "type": "function",
        "function": {"name": name, "arguments": arguments.to_string()},
    });
    if let Some(i) = index {
        call["index"] = json!(i);
    }
    call
}

/// A whole chat reply's parts.
struct Reply {
    /// The text around the calls (null when there are calls and no other text).
    content: Option<String>,
    /// The reasoning, for a model that reasons and wrote some.
    reasoning_content: Option<String>,
    /// The calls in order (none: `None`).
    tool_calls: Option<Vec<Value>>,
}

/// A whole reply split as the request's extras say.
fn split_reply(text: &str, x: &ChatExtras) -> Reply {
    let mut content = String::new();
    let mut reasoning: Option<String> = None;
    let mut calls = Vec::new();
    for seg in OutputSplitter::split(text, x.tool_names.clone(), x.think) {
        match seg {
            Segment::Text(t) => content.push_str(&t),
            Segment::Reasoning(t) => reasoning.get_or_insert_with(String::new).push_str(&t),
            Segment::Call { name, arguments } => calls.push(tool_call(None, &name, &arguments)),
        }
    }
    if calls.is_empty() {
        return Reply {
            content: Some(content),
            reasoning_content: reasoning,
            tool_calls: None,
        };
    }
    Reply {
        content: (!content.trim().is_empty()).then_some(content),
        reasoning_content: reasoning,
        tool_calls: Some(calls),
    }
}

impl Ctx {
    /// Stream chunks of segments: text as content deltas, each call whole in a
    /// `tool_calls` delta numbered from `calls` on.
    fn segment_chunks(&self, segments: Vec<Segment>, calls: &mut usize) -> Vec<Chunk> {
        let mut out = Vec::with_capacity(segments.len());
        for seg in segments {
            match seg {
                Segment::Text(t) => out.push(self.chunk(Some(t), false, None)),
                Segment::Reasoning(t) => {
                    let mut c = self.chunk(None, false, None);
                    c.choices[0].delta = Some(Delta {
                        reasoning_content: Some(t),
                        ..Delta::default()
                    });
                    out.push(c);
                }
                Segment::Call { name, arguments } => {
                    let mut c = self.chunk(None, false, None);
                    c.choices[0].delta = Some(Delta {
                        tool_calls: Some(vec![tool_call(Some(*calls), &name, &arguments)]),
                        ..Delta::default()
                    });
                    *calls += 1;
                    out.push(c);
                }
            }
        }
        out
    }

    fn chunk(&self, text: Option<String>, role: bool, finish: Option<&'static str>) -> Chunk {
        let choice = match self.kind {
            Kind::Chat(_) => ChunkChoice {
                index: 0,
                delta: Some(Delta {
                    role: role.then_some("assistant"),
                    content: text,
                    ..Delta::default()
                }),
                text: None,
                finish_reason: finish,
                logprobs: None,
            },
            Kind::Completion => ChunkChoice {
                index: 0,
                delta: None,
                text: Some(text.unwrap_or_default()),
                finish_reason: finish,
                logprobs: None,
            },
        };
        Chunk {
            id: self.id.clone(),
            object: if matches!(self.kind, Kind::Chat(_)) {
                "chat.completion.chunk"
            } else {
                "text_completion"
            },
            created: self.created,
            model: self.model.clone(),
            choices: vec![choice],
            usage: if self.include_usage {
                UsageField::Null
            } else {
                UsageField::Absent
            },
            leyline: None,
        }
    }
}

fn event(chunk: &Chunk) -> Event {
    Event::default().data(serde_json::to_string(chunk).unwrap_or_default())
}

fn stream(
    st: Arc<AppState>,
    ctx: Ctx,
    mut rx: mpsc::UnboundedReceiver<Piece>,
    permit: OwnedSemaphorePermit,
    session: Option<SessionRun>,
) -> impl IntoResponse {
    let (tx, out) = mpsc::channel::<std::result::Result<Event, Infallible>>(64);
    st.metrics.streams_open.fetch_add(1, Ordering::Relaxed);
    tokio::spawn(async move {
        let _permit = permit;
        let mut abort = st.abort.subscribe();
        let send = |e: Event| {
            let tx = tx.clone();
            async move { tx.send(Ok(e)).await.is_ok() }
        };
        let mut ok = true;
        let mut splitter = match &ctx.kind {
            Kind::Chat(x) => Some(OutputSplitter::new(x.tool_names.clone(), x.think)),
            Kind::Completion => None,
        };
        let mut calls = 0;
        if matches!(ctx.kind, Kind::Chat(_)) {
            ok = send(event(&ctx.chunk(Some(String::new()), true, None))).await;
        }
        while ok {
            let piece = tokio::select! {
                p = rx.recv() => p,
                _ = abort.wait_for(|a| *a) => Some(Piece::Failed(Failure::new(ErrorKind::Stopped, "the server shut down before the request finished"))),
                // The client went away: dropping `rx` tells the engine to stop.
                _ = tx.closed() => break,
            };
            match piece {
                Some(Piece::Text(t)) => {
                    let chunks = match &mut splitter {
                        Some(sp) => ctx.segment_chunks(sp.push(&t), &mut calls),
                        None => vec![ctx.chunk(Some(t), false, None)],
                    };
                    for c in chunks {
                        ok = ok && send(event(&c)).await;
                    }
                }
                Some(Piece::Done {
                    finish_reason,
                    usage,
                    logprobs,
                    ..
                }) => {
                    if let Some(sp) = &mut splitter {
                        for c in ctx.segment_chunks(sp.finish(), &mut calls) {
                            ok = ok && send(event(&c)).await;
                        }
                    }
                    let mut leyline = report(&usage, &session);
                    let (logprobs, leyline_logprobs) = ctx.logprobs(logprobs);
                    leyline.logprobs = leyline_logprobs;
                    let finish_reason = match finish_reason {
                        "stop" if calls > 0 => "tool_calls",
                        r => r,
                    };
                    let mut last = ctx.chunk(None, false, Some(finish_reason));
                    last.choices[0].logprobs = logprobs;
                    if let Kind::Chat(x) = &ctx.kind {
                        last.choices[0].delta = Some(Delta::default());
                        leyline.context_management = x.context_management.clone();
                    }
                    last.leyline = Some(leyline.clone());
                    ok = send(event(&last)).await;
                    if ok && ctx.include_usage {
                        let mut u = ctx.chunk(None, false, None);
                        u.choices.clear();
                        u.usage = UsageField::Some(WireUsage::from(&*usage));
                        u.leyline = Some(leyline);
                        ok = send(event(&u)).await;
                    }
                    if ok {
                        send(Event::default().data("[DONE]")).await;
                    }
                    break;
                }
                Some(Piece::Failed(f)) => {
                    st.metrics.stream_errors.fetch_add(1, Ordering::Relaxed);
                    let err = if st.abort.borrow().to_owned() {
                        ServerError::ShuttingDown(f.message)
                    } else {
                        ServerError::from(f)
                    };
                    if send(err.sse_event()).await {
                        send(Event::default().data("[DONE]")).await;
                    }
                    break;
                }
                None => break,
            }
        }
        st.metrics.streams_open.fetch_sub(1, Ordering::Relaxed);
    });
    Sse::new(ReceiverStream::new(out)).keep_alive(KeepAlive::default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use leyline_model::chat::ChatMessage;

    fn roles_and_text(chat: &[ChatMessage]) -> Vec<(String, String)> {
        chat.iter()
            .map(|m| (m.role.clone(), m.content.clone().unwrap_or_default()))
            .collect()
    }

    #[test]
    fn later_system_messages_join_a_user_message_in_order() {
        let m = ChatMessage::new;
        let mut chat = vec![
            m("system", "S"),
            m("user", "q1"),
            m("system", "note"),
            m("assistant", "a1"),
            m("user", "q2"),
            m("system", "last"),
        ];
        fold_system_messages(&mut chat);
        let want = [
            ("system", "S"),
            ("user", "q1"),
            ("assistant", "a1"),
            ("user", "note\n\nq2\n\nlast"),
        ];
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(r, t)| (r.to_string(), t.to_string()))
            .collect();
        assert_eq!(roles_and_text(&chat), want);
        // With no user message at all, the system text becomes one.
        let mut lone = vec![m("assistant", "a"), m("system", "x")];
        fold_system_messages(&mut lone);
        assert_eq!(lone[1].role, "user");
    }
}
