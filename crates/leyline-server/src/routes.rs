//! Routes and thin handlers: parse, validate, hand to the engine, shape the answer.

use crate::auth::{require_key, Principal};
use crate::error::{Result, ServerError};
use crate::generation::{self, GenerateSpec, Piece};
use crate::openai::*;
use crate::session_routes;
use crate::sessions::SessionLease;
use crate::AppState;
use axum::extract::{FromRequest, Request, State};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use leyline_core::{Directive, Mode};
use leyline_engine::{render_pieces, Engine, SessionRequest};
use leyline_model::chat::RenderOptions;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

pub(crate) type St = State<Arc<AppState>>;

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
    const KNOWN: [&str; 6] = [
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/sessions",
    ];
    if KNOWN.contains(&path) {
        return path.to_string();
    }
    match path.strip_prefix("/v1/sessions/") {
        Some(rest) if rest.ends_with("/directives") => "/v1/sessions/{id}/directives".into(),
        Some(_) => "/v1/sessions/{id}".into(),
        None => "other".into(),
    }
}

/// A JSON body, read within the size limit, with errors in the API's shape.
pub struct ApiJson(pub Value);

impl FromRequest<Arc<AppState>> for ApiJson {
    type Rejection = ServerError;

    async fn from_request(req: Request, st: &Arc<AppState>) -> Result<Self> {
        let limit = st.config.max_body_bytes;
        let mut stream = req.into_body().into_data_stream();
        let mut buf: Vec<u8> = Vec::new();
        let mut total = 0usize;
        // Past the limit, keep reading (up to 8x) and discard, so the client gets the
        // 413 instead of a reset connection while still sending.
        while let Some(chunk) = stream.next().await {
            let chunk = chunk
                .map_err(|e| ServerError::bad_request(format!("reading the body failed: {e}")))?;
            total += chunk.len();
            if total <= limit {
                buf.extend_from_slice(&chunk);
            } else if total > limit.saturating_mul(8) {
                break;
            }
        }
        if total > limit {
            return Err(ServerError::PayloadTooLarge(format!(
                "the request body is larger than the limit of {limit} bytes"
            )));
        }
        let v: Value = serde_json::from_slice(&buf).map_err(|e| {
            ServerError::bad_request(format!("the request body is not valid JSON: {e}"))
        })?;
        if !v.is_object() {
            return Err(ServerError::bad_request(
                "the request body must be a JSON object",
            ));
        }
        Ok(ApiJson(v))
    }
}

/// Deserializes `v` into `T`, naming the field on error.
pub(crate) fn parse<T: DeserializeOwned>(v: &Value) -> Result<T> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ServerError::bad_request(format!("invalid request body: {inner}"))
        } else {
            ServerError::invalid(&path, format!("invalid value for `{path}`: {inner}"))
        }
    })
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn models(State(st): St) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": st.config.model_name, "object": "model", "created": st.created, "owned_by": "leyline"
    }]}))
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

impl AppState {
    fn check_model(&self, model: &str) -> Result<()> {
        if model == self.config.model_name {
            return Ok(());
        }
        Err(ServerError::NotFound {
            message: format!(
                "the model {model:?} does not exist; this server serves {:?}",
                self.config.model_name
            ),
            code: "model_not_found",
        })
    }
}

async fn chat_completions(
    State(st): St,
    Extension(who): Extension<Principal>,
    ApiJson(v): ApiJson,
) -> Result<Response> {
    let req: ChatCompletionRequest = parse(&v)?;
    let fields: GenerationFields = parse(&v)?;
    st.check_model(&req.model)?;
    let gen = fields.validate()?;
    let template = st.chat.as_ref().ok_or_else(|| {
        ServerError::bad_request("this model has no chat template; use /v1/completions")
    })?;
    if req.messages.is_empty() {
        return Err(ServerError::invalid(
            "messages",
            "messages must not be empty",
        ));
    }
    let messages = req
        .messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| m.into_chat(i))
        .collect::<Result<Vec<_>>>()?;
    let opts = RenderOptions {
        add_generation_prompt: true,
        tools: req.tools,
        ..Default::default()
    };
    let text = template.render_with(&messages, &opts)?;
    let prompt = st.tokenizer.encode(&text, false)?;
    let in_session =
        fields.session_id.is_some() || fields.leyline.as_ref().is_some_and(|l| l.mode.is_some());
    // Message bounds anchor the next turn's diff; only where the pieces tokenize exactly as
    // the whole prompt (otherwise the engine keeps the longest common prefix).
    let bounds = in_session
        .then(|| render_pieces(&st.tokenizer, template, &messages, &opts).ok())
        .flatten()
        .filter(|r| r.tokens == prompt)
        .map(|r| r.bounds);
    run(st, who, Kind::Chat, prompt, bounds, gen, fields).await
}

async fn completions(
    State(st): St,
    Extension(who): Extension<Principal>,
    ApiJson(v): ApiJson,
) -> Result<Response> {
    let req: CompletionRequest = parse(&v)?;
    let fields: GenerationFields = parse(&v)?;
    st.check_model(&req.model)?;
    let gen = fields.validate()?;
    if req.echo == Some(true) {
        return Err(ServerError::invalid("echo", "echo is not supported"));
    }
    if req
        .logprobs
        .as_ref()
        .is_some_and(|l| !l.is_null() && l != &Value::Bool(false))
    {
        return Err(ServerError::invalid(
            "logprobs",
            "logprobs are not supported",
        ));
    }
    let prompt = match req.prompt {
        Prompt::Text(t) => st.tokenizer.encode(&t, true)?,
        Prompt::Texts(mut v) if v.len() == 1 => st.tokenizer.encode(&v.remove(0), true)?,
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
            ids
        }
    };
    run(st, who, Kind::Completion, prompt, None, gen, fields).await
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// The request's session, if it runs in one.
struct SessionRun {
    lease: SessionLease,
    mode: Mode,
    /// Message bounds of this request's prompt, kept for the next turn's diff.
    bounds: Option<Vec<usize>>,
}

/// Runs `f` on the engine thread without blocking the async workers.
pub(crate) async fn engine_call<T: Send + 'static>(
    st: &AppState,
    f: impl FnOnce(&mut Engine) -> T + Send + 'static,
) -> Result<T> {
    let engine = st.engine.clone();
    tokio::task::spawn_blocking(move || engine.call(f))
        .await
        .map_err(|e| ServerError::Engine(format!("engine call panicked: {e}")))?
        .map_err(ServerError::from)
}

pub(crate) async fn create_engine_session(st: &AppState, who: Principal) -> Result<String> {
    let limits = st.config.sessions;
    crate::session_routes::reap(st, 1).await;
    let eid = engine_call(st, |e| e.create_session()).await?;
    st.sessions.create(who, eid, limits.max).inspect_err(|_| {
        // Lost a race for the last place: the engine session must not outlive this.
        let engine = st.engine.clone();
        tokio::task::spawn_blocking(move || engine.call(move |e| e.delete_session(eid)));
    })
}

async fn open_session(
    st: &Arc<AppState>,
    who: Principal,
    fields: &GenerationFields,
    bounds: Option<Vec<usize>>,
) -> Result<Option<SessionRun>> {
    let mode = fields.leyline.as_ref().and_then(|l| l.mode);
    let id = match (&fields.session_id, mode) {
        (Some(id), _) => id.clone(),
        // `leyline.mode` without a session starts one; its id comes back in `leyline`.
        (None, Some(_)) => create_engine_session(st, who).await?,
        (None, None) => return Ok(None),
    };
    let lease = st.sessions.acquire(&id, who)?;
    Ok(Some(SessionRun {
        lease,
        mode: mode.unwrap_or(Mode::Amortize),
        bounds,
    }))
}

/// The directives that turn the session's cached `old` tokens into a prefix of the new
/// prompt: a message-aligned diff when both prompts' message bounds are known, dropping
/// the pure append at the end (the request prefills it). Without bounds, none: the engine
/// then keeps the longest common prefix and prefills the rest.
fn session_edits(
    old: &[u32],
    old_bounds: Option<&[usize]>,
    new: &[u32],
    new_bounds: Option<&[usize]>,
) -> Vec<Directive> {
    let (Some(ob), Some(nb)) = (old_bounds, new_bounds) else {
        return Vec::new();
    };
    if ob.last().is_none_or(|&end| end > old.len()) {
        return Vec::new();
    }
    match leyline_policy::diff(old, ob, new, nb) {
        Ok(edits) => edits
            .into_iter()
            .filter(|e| !(e.start == old.len() && e.end == old.len()))
            .map(|e| Directive::new(e.start, e.end, e.replacement, Mode::Amortize))
            .collect(),
        Err(_) => Vec::new(),
    }
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
    if prompt.is_empty() {
        return Err(ServerError::invalid("prompt", "the prompt is empty"));
    }
    let limit = st.max_sequence_len;
    if prompt.len() >= limit {
        return Err(ServerError::InvalidRequest {
            message: format!(
                "the prompt has {} tokens but this server holds at most {} per sequence (context length {})",
                prompt.len(),
                limit - 1,
                st.context_length
            ),
            param: Some("messages".into()),
            code: Some("context_length_exceeded"),
        });
    }
    let room = limit - prompt.len();
    let max_tokens = match gen.max_tokens {
        Some(m) if m > st.context_length => {
            return Err(ServerError::InvalidRequest {
                message: format!(
                    "max_tokens is {m} but the model's context length is {} tokens",
                    st.context_length
                ),
                param: Some("max_tokens".into()),
                code: Some("context_length_exceeded"),
            })
        }
        Some(m) => m.min(room),
        None => st.config.default_max_tokens.min(room),
    };
    let permit = Arc::clone(&st.admission).try_acquire_owned().map_err(|_| {
        ServerError::Overloaded(format!(
            "{} requests are in flight; retry later",
            st.config.max_concurrent
        ))
    })?;
    let session = open_session(&st, who, &fields, bounds).await?;
    let session_req = match &session {
        Some(s) => {
            let eid = s.lease.state().engine;
            let old = engine_call(&st, move |e| e.session_info(eid))
                .await??
                .tokens;
            let edits = session_edits(
                &old,
                s.lease.state().bounds.as_deref(),
                &prompt,
                s.bounds.as_deref(),
            );
            Some(SessionRequest {
                id: eid,
                mode: s.mode,
                edits,
            })
        }
        None => None,
    };
    let spec = GenerateSpec {
        prompt,
        max_tokens,
        sampling: gen.sampling,
        stop_tokens: st.stop_tokens.clone(),
        stop: gen.stop.clone(),
        session: session_req,
    };
    let (req, rx) = generation::request(spec, Arc::clone(&st.tokenizer));
    st.engine.submit(req)?;
    let ctx = Ctx {
        id: format!(
            "{}{:024x}",
            if kind == Kind::Chat {
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
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn report(usage: &leyline_engine::Usage, session: &Option<SessionRun>) -> LeylineReport {
    let edit = usage.edit.as_ref();
    LeylineReport {
        session_id: session.as_ref().map(|s| s.lease.id().to_string()),
        mode: session.as_ref().map(|s| s.mode),
        directives_applied: edit.map_or(0, |e| e.directives),
        tokens_reused: usage.cached_tokens,
        tokens_rotated: edit.map_or(0, |e| e.rotated),
        tokens_prefilled: usage.computed_tokens(),
    }
}

/// Keeps this turn's message bounds for the next turn's diff.
fn finish_session(session: &mut Option<SessionRun>) {
    if let Some(s) = session {
        let mut state = s.lease.state().clone();
        state.bounds = s.bounds.take();
        state.turns += 1;
        s.lease.commit(state);
    }
}

async fn collect(
    st: Arc<AppState>,
    ctx: Ctx,
    mut rx: mpsc::UnboundedReceiver<Piece>,
    _permit: OwnedSemaphorePermit,
    mut session: Option<SessionRun>,
) -> Result<Response> {
    let mut abort = st.abort.subscribe();
    let mut text = String::new();
    loop {
        let piece = tokio::select! {
            p = rx.recv() => p,
            _ = abort.wait_for(|a| *a) => {
                return Err(ServerError::ShuttingDown("the server shut down before the request finished".into()))
            }
        };
        match piece {
            Some(Piece::Text(t)) => text.push_str(&t),
            Some(Piece::Failed(m)) => return Err(ServerError::Engine(m)),
            None => return Err(ServerError::Engine("the engine dropped the request".into())),
            Some(Piece::Done {
                finish_reason,
                usage,
                ..
            }) => {
                let leyline = report(&usage, &session);
                finish_session(&mut session);
                let body = match ctx.kind {
                    Kind::Chat => serde_json::to_value(ChatCompletion {
                        id: ctx.id,
                        object: "chat.completion",
                        created: ctx.created,
                        model: ctx.model,
                        choices: vec![ChatChoice {
                            index: 0,
                            message: ResponseMessage {
                                role: "assistant",
                                content: text,
                            },
                            finish_reason,
                            logprobs: None,
                        }],
                        usage: WireUsage::from(&usage),
                        leyline,
                    }),
                    Kind::Completion => serde_json::to_value(Completion {
                        id: ctx.id,
                        object: "text_completion",
                        created: ctx.created,
                        model: ctx.model,
                        choices: vec![CompletionChoice {
                            text,
                            index: 0,
                            logprobs: None,
                            finish_reason,
                        }],
                        usage: WireUsage::from(&usage),
                        leyline,
                    }),
                };
                return Ok(
                    Json(body.map_err(|e| ServerError::Engine(e.to_string()))?).into_response()
                );
            }
        }
    }
}

impl Ctx {
    fn chunk(&self, text: Option<String>, role: bool, finish: Option<&'static str>) -> Chunk {
        let choice = match self.kind {
            Kind::Chat => ChunkChoice {
                index: 0,
                delta: Some(Delta {
                    role: role.then_some("assistant"),
                    content: text,
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
            object: if self.kind == Kind::Chat {
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
    mut session: Option<SessionRun>,
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
        if ctx.kind == Kind::Chat {
            ok = send(event(&ctx.chunk(Some(String::new()), true, None))).await;
        }
        while ok {
            let piece = tokio::select! {
                p = rx.recv() => p,
                _ = abort.wait_for(|a| *a) => Some(Piece::Failed("the server shut down before the request finished".into())),
            };
            match piece {
                Some(Piece::Text(t)) => ok = send(event(&ctx.chunk(Some(t), false, None))).await,
                Some(Piece::Done {
                    finish_reason,
                    usage,
                    ..
                }) => {
                    let leyline = report(&usage, &session);
                    finish_session(&mut session);
                    let mut last = ctx.chunk(None, false, Some(finish_reason));
                    if ctx.kind == Kind::Chat {
                        last.choices[0].delta = Some(Delta::default());
                    }
                    last.leyline = Some(leyline.clone());
                    ok = send(event(&last)).await;
                    if ok && ctx.include_usage {
                        let mut u = ctx.chunk(None, false, None);
                        u.choices.clear();
                        u.usage = UsageField::Some(WireUsage::from(&usage));
                        u.leyline = Some(leyline);
                        ok = send(event(&u)).await;
                    }
                    if ok {
                        send(Event::default().data("[DONE]")).await;
                    }
                    break;
                }
                Some(Piece::Failed(m)) => {
                    st.metrics.stream_errors.fetch_add(1, Ordering::Relaxed);
                    let err = if st.abort.borrow().to_owned() {
                        ServerError::ShuttingDown(m)
                    } else {
                        ServerError::Engine(m)
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
