//! `POST /v1/messages`: Anthropic's Messages API over the same engine, sessions and prefix
//! cache as chat completions. Tool calls the model writes in its template's format come back
//! as `tool_use` blocks; usage counts cache reads as Anthropic does; errors use its envelope.

use crate::anthropic::{self, MessagesRequest};
use crate::auth::Principal;
use crate::error::{Result, ServerError};
use crate::generation::Piece;
use crate::handler::{parse, ApiJson, St};
use crate::openai::{GenerationFields, LeylineOptions, StopSpec};
use crate::reasoning::OutputSplitter;
use crate::state::AppState;
use crate::submit::{collect_text, report, start, Collected, SessionRun, Started};
use crate::toolcall::Segment;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// Leyline's fields on an Anthropic request.
#[derive(Debug, Default, Deserialize)]
struct LeylineFields {
    #[serde(default)]
    session_id: Option<String>,
    #[serde(default)]
    leyline: Option<LeylineOptions>,
    #[serde(default)]
    cache_salt: Option<String>,
}

/// The handler: every failure is answered in Anthropic's error envelope.
pub(crate) async fn messages(
    State(st): St,
    Extension(who): Extension<Principal>,
    headers: HeaderMap,
    body: std::result::Result<ApiJson, ServerError>,
) -> Response {
    match handle(st, who, headers, body).await {
        Ok(r) => r,
        Err(e) => anthropic::error_response(e),
    }
}

/// A Messages request read and checked, up to its rendered prompt.
struct Prepared {
    fields: GenerationFields,
    gen: crate::openai::Generation,
    prompt: Vec<u32>,
    bounds: Option<Vec<usize>>,
    tools: anthropic::Tools,
    /// What the request's context edits did, when it asked for any.
    context_management: Option<Value>,
    /// Prompt tokens up to the last `cache_control` breakpoint, if it has one.
    breakpoint_tokens: Option<usize>,
    /// The call opening written after the generation prompt (`tool_choice` any or tool).
    forced: Option<String>,
}

/// Parses, checks and renders a Messages request (shared by `/v1/messages` and
/// `/v1/messages/count_tokens`).
async fn prepare(
    st: &Arc<AppState>,
    headers: &HeaderMap,
    body: std::result::Result<ApiJson, ServerError>,
    count_only: bool,
) -> Result<Prepared> {
    let header_mode = crate::submit::header_mode(headers)?;
    let ApiJson(mut v) = body?;
    if count_only {
        // count_tokens takes no max_tokens; the checks below want one.
        if let Some(o) = v.as_object_mut() {
            o.entry("max_tokens").or_insert(json!(1));
        }
    }
    crate::handler::refuse_unknown_fields(
        &v,
        &[&anthropic::MESSAGES_FIELDS, &crate::openai::LEYLINE_FIELDS],
    )?;
    let req: MessagesRequest = parse(&v)?;
    let extra: LeylineFields = parse(&v)?;
    st.check_model(&req.model)?;
    if req.max_tokens < 1 {
        return Err(ServerError::invalid(
            "max_tokens",
            format!("max_tokens must be at least 1, got {}", req.max_tokens),
        ));
    }
    anthropic::check_reasoning_fields(&req)?;
    let mut fields = GenerationFields {
        max_tokens: Some(req.max_tokens),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        stop: req.stop_sequences.clone().map(StopSpec::Many),
        stream: req.stream,
        session_id: extra.session_id,
        leyline: extra.leyline,
        cache_salt: extra.cache_salt,
        header_mode,
        ..Default::default()
    };
    let gen = st.generation(&mut fields).map_err(|e| match e {
        // The OpenAI name of the field is `stop`; here it is `stop_sequences`.
        ServerError::InvalidRequest {
            message,
            param,
            code,
        } if param.as_deref() == Some("stop") => ServerError::InvalidRequest {
            message: message.replace("stop strings", "stop_sequences"),
            param: Some("stop_sequences".into()),
            code,
        },
        e => e,
    })?;
    crate::submit::session_header(st, headers, &mut fields)?;
    crate::submit::conversation_header(headers, &mut fields)?;
    let anthropic::Converted {
        mut chat,
        cached_messages,
    } = anthropic::to_chat(&req)?;
    let applied = match &req.context_management {
        Some(cm) => crate::context::apply(&mut chat, cm, &st.tokenizer)?,
        None => Vec::new(),
    };
    let context_management = (req.context_management.is_some())
        .then(|| json!({"applied_edits": applied.iter().map(|a| a.to_json()).collect::<Vec<_>>()}));
    let tools = anthropic::template_tools(&req)?;
    let names = tools
        .offered
        .as_deref()
        .map(crate::toolcall::tool_names)
        .unwrap_or_default();
    let forced = match (&tools.choice, names.as_slice()) {
        // One tool to choose from: the name is forced too (a small model, left to write
        // it, may name a tool that does not exist).
        (anthropic::ToolChoice::Any, [only]) => Some(crate::toolcall::forced_opening(Some(only))),
        (anthropic::ToolChoice::Any, _) => Some(crate::toolcall::forced_opening(None)),
        (anthropic::ToolChoice::Tool(name), _) => Some(crate::toolcall::forced_opening(Some(name))),
        _ => None,
    };
    // A breakpoint on the last message (Claude Code's) ends where the generation prompt
    // starts, which the message bounds give when the request has them; otherwise the
    // messages up to it are rendered a second time to count them.
    let all_messages = chat.len();
    let breakpoint_chat = cached_messages.map(|n| chat[..n.min(all_messages)].to_vec());
    let offered = tools.offered.clone();
    let (mut prompt, bounds) = st
        .render_chat(
            chat,
            offered.clone(),
            anthropic::thinking_wanted(&req),
            &mut fields,
        )
        .await?;
    let messages_end = bounds.as_ref().and_then(|b| b.last().copied());
    let breakpoint_tokens = match (breakpoint_chat, messages_end) {
        (None, _) => None,
        (Some(part), Some(end)) if part.len() == all_messages => Some(end),
        (Some(part), _) => Some(st.count_rendered(part, offered).await?.min(prompt.len())),
    };
    if let Some(open) = &forced {
        let open = open.clone();
        let ids = st
            .off_workers(move |st| Ok(st.tokenizer.encode(&open, false)?))
            .await?;
        prompt.extend(ids);
    }
    Ok(Prepared {
        fields,
        gen,
        prompt,
        bounds,
        tools,
        context_management,
        breakpoint_tokens,
        forced,
    })
}

async fn handle(
    st: Arc<AppState>,
    who: Principal,
    headers: HeaderMap,
    body: std::result::Result<ApiJson, ServerError>,
) -> Result<Response> {
    let p = prepare(&st, &headers, body, false).await?;
    // A forced tool call opens right after the generation prompt: no reasoning first.
    let think = match p.forced {
        Some(_) => None,
        None => st.think_for(&p.prompt),
    };
    let started = start(&st, who, p.prompt, p.bounds, &p.gen, &p.fields).await?;
    let ctx = Ctx {
        id: format!("msg_{:024x}", rand::random::<u128>() >> 32),
        model: st.config.model_name.clone(),
        tool_names: p.tools.offered.as_deref().map(crate::toolcall::tool_names),
        think,
        context_management: p.context_management,
        unsupported_tools: p.tools.unsupported,
        breakpoint_tokens: p.breakpoint_tokens,
        forced: p.forced,
    };
    if p.gen.stream {
        Ok(stream(st, ctx, started).into_response())
    } else {
        collect(st, ctx, started).await
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as `/v1/messages` would render the
/// same body (tools, system messages, context edits and a forced tool call included).
pub(crate) async fn count_tokens(
    State(st): St,
    headers: HeaderMap,
    body: std::result::Result<ApiJson, ServerError>,
) -> Response {
    match prepare(&st, &headers, body, true).await {
        Ok(p) => Json(json!({"input_tokens": p.prompt.len()})).into_response(),
        Err(e) => anthropic::error_response(e),
    }
}

struct Ctx {
    id: String,
    model: String,
    /// The offered tools' names, if any: then tool calls are split out of the text.
    tool_names: Option<Vec<String>>,
    /// For a model that reasons, whether the prompt left a `<think>` block open.
    think: Option<bool>,
    /// What the request's context edits did, when it asked for any.
    context_management: Option<Value>,
    /// Server tools the request listed that were not offered.
    unsupported_tools: Vec<String>,
    /// Prompt tokens up to the last `cache_control` breakpoint.
    breakpoint_tokens: Option<usize>,
    /// The forced call's opening, which the answer's text starts with.
    forced: Option<String>,
}

impl Ctx {
    /// The `leyline` object, with the server tools that were not offered.
    fn leyline(
        &self,
        usage: &leyline_engine::Usage,
        session: &Option<SessionRun>,
        logprobs: Option<Vec<Value>>,
    ) -> Value {
        let mut r = report(usage, session);
        r.logprobs = logprobs.map(Value::from);
        r.unsupported_tools = self.unsupported_tools.iter().map(|n| json!(n)).collect();
        json!(r)
    }
}

fn tool_use_id() -> String {
    format!("toolu_{:024x}", rand::random::<u128>() >> 32)
}

/// A segment as a content block.
fn block(s: &Segment) -> Value {
    match s {
        Segment::Text(t) => json!({"type": "text", "text": t}),
        // No signature: nothing signs a local model's reasoning, and these blocks are
        // dropped when a client sends them back (the templates render no old reasoning).
        Segment::Reasoning(t) => json!({"type": "thinking", "thinking": t, "signature": ""}),
        Segment::Call { name, arguments } => {
            json!({"type": "tool_use", "id": tool_use_id(), "name": name, "input": arguments})
        }
    }
}

async fn collect(st: Arc<AppState>, ctx: Ctx, started: Started) -> Result<Response> {
    let Started {
        mut rx,
        permit: _permit,
        session,
        ..
    } = started;
    let Collected {
        text,
        finish_reason,
        usage,
        stop_sequence,
        logprobs,
    } = collect_text(&st, &mut rx).await?;
    let text = match &ctx.forced {
        Some(open) => format!("{open}{text}"),
        None => text,
    };
    let segments = OutputSplitter::split(&text, ctx.tool_names.clone(), ctx.think);
    let called = segments.iter().any(|s| matches!(s, Segment::Call { .. }));
    let content: Vec<Value> = segments.iter().map(block).collect();
    let mut body = json!({
        "id": ctx.id,
        "type": "message",
        "role": "assistant",
        "model": ctx.model,
        "content": content,
        "stop_reason": anthropic::stop_reason(finish_reason, stop_sequence.as_deref(), called),
        "stop_sequence": stop_sequence,
        "usage": anthropic::usage(&usage, ctx.breakpoint_tokens),
        "leyline": ctx.leyline(&usage, &session, logprobs),
    });
    if let Some(cm) = ctx.context_management {
        body["context_management"] = cm;
    }
    Ok(Json(body).into_response())
}

/// Builds the stream's events: content blocks open, grow and close in order.
struct Blocks {
    next: usize,
    /// The text or thinking block that grows with the next delta of its kind.
    open: Option<(usize, Grows)>,
    called: bool,
}

/// A block that grows by deltas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Grows {
    Text,
    Thinking,
}

impl Blocks {
    fn event(name: &str, data: Value) -> Event {
        Event::default().event(name).data(data.to_string())
    }

    fn close_open(&mut self, out: &mut Vec<Event>) {
        if let Some((i, _)) = self.open.take() {
            out.push(Self::event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": i}),
            ));
        }
    }

    /// The index of the open block of `kind`, opening one (and closing another kind's).
    fn grow(&mut self, kind: Grows, out: &mut Vec<Event>) -> usize {
        match self.open {
            Some((i, k)) if k == kind => return i,
            Some(_) => self.close_open(out),
            None => {}
        }
        let i = self.next;
        self.next += 1;
        self.open = Some((i, kind));
        let block = match kind {
            Grows::Text => json!({"type": "text", "text": ""}),
            Grows::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
        };
        out.push(Self::event(
            "content_block_start",
            json!({"type": "content_block_start", "index": i, "content_block": block}),
        ));
        i
    }

    fn push(&mut self, s: Segment, out: &mut Vec<Event>) {
        match s {
            Segment::Text(t) => {
                let i = self.grow(Grows::Text, out);
                out.push(Self::event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": t}}),
                ));
            }
            Segment::Reasoning(t) => {
                let i = self.grow(Grows::Thinking, out);
                out.push(Self::event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": i, "delta": {"type": "thinking_delta", "thinking": t}}),
                ));
            }
            Segment::Call { name, arguments } => {
                self.close_open(out);
                let i = self.next;
                self.next += 1;
                self.called = true;
                out.push(Self::event(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": i, "content_block": {"type": "tool_use", "id": tool_use_id(), "name": name, "input": {}}}),
                ));
                out.push(Self::event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": arguments.to_string()}}),
                ));
                out.push(Self::event(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": i}),
                ));
            }
        }
    }
}

fn stream(st: Arc<AppState>, ctx: Ctx, started: Started) -> impl IntoResponse {
    let Started {
        mut rx,
        permit,
        session,
        prompt_tokens,
    } = started;
    let (tx, out) = mpsc::channel::<std::result::Result<Event, Infallible>>(64);
    st.metrics
        .streams_open
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tokio::spawn(async move {
        let _permit = permit;
        let mut abort = st.abort.subscribe();
        let mut events = vec![
            Blocks::event(
                "message_start",
                json!({"type": "message_start", "message": {
                    "id": ctx.id, "type": "message", "role": "assistant", "model": ctx.model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
                }}),
            ),
            Blocks::event("ping", json!({"type": "ping"})),
        ];
        let mut blocks = Blocks {
            next: 0,
            open: None,
            called: false,
        };
        let mut splitter = OutputSplitter::new(ctx.tool_names.clone(), ctx.think);
        if let Some(open) = &ctx.forced {
            // The opening only starts a call: nothing of it is released before the call.
            for s in splitter.push(open) {
                blocks.push(s, &mut events);
            }
        }
        // A ping after every `stream_keepalive` without an event: a long prefill (or a tool
        // call held back until it is whole) must not look like a dead connection to a
        // client's idle timer.
        let every = st.config.stream_keepalive;
        let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        'run: loop {
            for e in events.drain(..) {
                if tx.send(Ok(e)).await.is_err() {
                    break 'run;
                }
            }
            let piece = tokio::select! {
                p = rx.recv() => p,
                _ = ping.tick() => {
                    events.push(Blocks::event("ping", json!({"type": "ping"})));
                    continue;
                }
                _ = abort.wait_for(|a| *a) => Some(Piece::Failed(leyline_engine::Failure::new(
                    leyline_engine::ErrorKind::Stopped,
                    "the server shut down before the request finished",
                ))),
                _ = tx.closed() => break,
            };
            ping.reset_after(every);
            match piece {
                Some(Piece::Text(t)) => {
                    for s in splitter.push(&t) {
                        blocks.push(s, &mut events);
                    }
                }
                Some(Piece::Done {
                    finish_reason,
                    usage,
                    stop_sequence,
                    logprobs,
                    ..
                }) => {
                    for s in splitter.finish() {
                        blocks.push(s, &mut events);
                    }
                    blocks.close_open(&mut events);
                    let reason = anthropic::stop_reason(
                        finish_reason,
                        stop_sequence.as_deref(),
                        blocks.called,
                    );
                    let mut delta = json!({"type": "message_delta",
                           "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                           "usage": anthropic::usage(&usage, ctx.breakpoint_tokens),
                           "leyline": ctx.leyline(&usage, &session, logprobs)});
                    if let Some(cm) = &ctx.context_management {
                        delta["context_management"] = cm.clone();
                    }
                    events.push(Blocks::event("message_delta", delta));
                    events.push(Blocks::event(
                        "message_stop",
                        json!({"type": "message_stop"}),
                    ));
                    for e in events.drain(..) {
                        if tx.send(Ok(e)).await.is_err() {
                            break;
                        }
                    }
                    break;
                }
                Some(Piece::Failed(f)) => {
                    st.metrics
                        .stream_errors
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let body = anthropic::error_body(&ServerError::from(f));
                    let _ = tx.send(Ok(Blocks::event("error", body))).await;
                    break;
                }
                None => break,
            }
        }
        st.metrics
            .streams_open
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    });
    Sse::new(ReceiverStream::new(out)).keep_alive(KeepAlive::default())
}
