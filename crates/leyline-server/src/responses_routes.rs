//! `POST /v1/responses` (OpenAI's Responses API, as Codex CLI and the `openai` SDK speak it)
//! and `GET` / `DELETE /v1/responses/{id}`, over the same engine, sessions and prefix cache as
//! chat completions. Tool calls the model writes in its template's format come back as
//! `function_call` items; a stream announces each output item with OpenAI's event names.

use crate::auth::Principal;
use crate::error::{Result, ServerError};
use crate::generation::Piece;
use crate::handler::{ApiJson, St};
use crate::openai::GenerationFields;
use crate::reasoning::OutputSplitter;
use crate::responses::{input_to_chat, split_tools, ResponsesRequest};
use crate::responses_output::{response_id, usage, Output};
use crate::responses_store::{ResponseStore, StoredResponse};
use crate::state::AppState;
use crate::submit::{collect_text, report, start, Collected, SessionRun, Started};
use crate::toolcall::tool_names;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use leyline_model::chat::ChatMessage;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

/// The routes, with the response store (`ServerConfig::responses_store` entries) they share.
pub(crate) fn router(st: &Arc<AppState>) -> Router<Arc<AppState>> {
    let store = Arc::new(ResponseStore::new(st.config.responses_store));
    Router::new()
        .route("/v1/responses", post(create))
        .route("/v1/responses/{id}", get(retrieve).delete(delete))
        .layer(Extension(store))
}

fn not_found(id: &str) -> ServerError {
    ServerError::NotFound {
        message: format!("no response with id {id:?} is stored for this API key"),
        code: "response_not_found",
    }
}

/// `GET /v1/responses/{id}`: the stored response object (not its stream again).
async fn retrieve(
    Extension(who): Extension<Principal>,
    Extension(store): Extension<Arc<ResponseStore>>,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Json<Value>> {
    if q.get("stream").is_some_and(|s| s != "false") {
        return Err(ServerError::invalid(
            "stream",
            "a stored response cannot be streamed again; leave stream out",
        ));
    }
    let stored = store.get(&id, who).ok_or_else(|| not_found(&id))?;
    Ok(Json(stored.response.clone()))
}

/// `DELETE /v1/responses/{id}`.
async fn delete(
    Extension(who): Extension<Principal>,
    Extension(store): Extension<Arc<ResponseStore>>,
    Path(id): Path<String>,
) -> Result<Json<Value>> {
    if !store.remove(&id, who) {
        return Err(not_found(&id));
    }
    Ok(Json(
        json!({"id": id, "object": "response", "deleted": true}),
    ))
}

/// The 404 for a `previous_response_id` that is not stored (evicted, deleted, never made,
/// or another key's): the client resends its history.
fn previous_not_found(id: &str) -> Response {
    let e = ServerError::NotFound {
        message: format!(
            "Previous response with id {id:?} not found: it was never stored, was deleted or \
             evicted, or belongs to another API key; send the whole conversation as input"
        ),
        code: "previous_response_not_found",
    };
    let mut body = e.body();
    body["error"]["param"] = json!("previous_response_id");
    (e.status(), Json(body)).into_response()
}

/// The names this API gives the fields that the shared checks name after chat completions.
fn rename_params(e: ServerError) -> ServerError {
    match e {
        ServerError::InvalidRequest {
            message,
            param: Some(p),
            code,
        } if p == "max_tokens" || p == "messages" => ServerError::InvalidRequest {
            message: message.replace("max_tokens", "max_output_tokens"),
            param: Some(
                if p == "messages" {
                    "input"
                } else {
                    "max_output_tokens"
                }
                .into(),
            ),
            code,
        },
        e => e,
    }
}

/// `POST /v1/responses`.
async fn create(
    State(st): St,
    Extension(who): Extension<Principal>,
    Extension(store): Extension<Arc<ResponseStore>>,
    headers: HeaderMap,
    ApiJson(v): ApiJson,
) -> Result<Response> {
    let req = ResponsesRequest::from_body(&v)?;
    st.check_model(&req.model)?;
    let mut fields = GenerationFields {
        max_tokens: req.max_output_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        stream: Some(req.stream),
        session_id: req.session_id.clone(),
        leyline: req.leyline.clone(),
        cache_salt: req.cache_salt.clone(),
        header_mode: crate::submit::header_mode(&headers)?,
        conversation: req.prompt_cache_key.clone(),
        ..Default::default()
    };
    let gen = st.generation(&mut fields).map_err(rename_params)?;
    crate::submit::session_header(&st, &headers, &mut fields)?;
    crate::submit::conversation_header(&headers, &mut fields)?;
    if st.chat.is_none() {
        return Err(ServerError::bad_request(
            "this model has no chat template; use /v1/completions",
        ));
    }
    // The conversation: the stored one this response continues, then this input.
    let mut conversation = match &req.previous_response_id {
        Some(id) => match store.get(id, who) {
            Some(prev) => prev.conversation.clone(),
            None => return Ok(previous_not_found(id)),
        },
        None => Vec::new(),
    };
    if let Some(input) = &req.input {
        conversation.extend(input_to_chat(input)?);
    }
    if conversation.is_empty() {
        return Err(ServerError::invalid(
            "input",
            "input is required (a string or a non-empty list of items)",
        ));
    }
    let tools = split_tools(&req.tools, req.tool_choice)?;
    let stored = req.store && store.enabled();
    let mut chat = Vec::with_capacity(conversation.len() + 1);
    if let Some(i) = req.instructions.as_deref().filter(|i| !i.is_empty()) {
        chat.push(ChatMessage::new("system", i));
    }
    let keep = stored.then(|| (store, who, conversation.clone()));
    chat.extend(conversation);
    let names = tools.template.as_deref().map(tool_names);
    let (prompt, bounds) = st
        .render_chat(chat, tools.template.clone(), req.thinking, &mut fields)
        .await
        .map_err(rename_params)?;
    let think = st.think_for(&prompt);
    let started = start(&st, who, prompt, bounds, &gen, &fields)
        .await
        .map_err(rename_params)?;
    let id = response_id();
    let ctx = Ctx {
        skeleton: req.skeleton(&id, &st.config.model_name, &tools, stored),
        id,
        tool_names: names,
        think,
        unsupported: tools.unsupported,
        keep,
    };
    if gen.stream {
        Ok(stream(st, ctx, started).into_response())
    } else {
        collect(st, ctx, started).await
    }
}

struct Ctx {
    id: String,
    /// The response object before any output.
    skeleton: Value,
    /// The offered tools' names, if any: then tool calls are split out of the text.
    tool_names: Option<Vec<String>>,
    /// For a model that reasons, whether the prompt left a `<think>` block open.
    think: Option<bool>,
    /// Hosted tools the request named, not offered to the model.
    unsupported: Vec<Value>,
    /// With `store`: where to keep the response, for whom, and its conversation so far.
    keep: Option<(Arc<ResponseStore>, Principal, Vec<ChatMessage>)>,
}

impl Ctx {
    /// The finished response object; stored when the request asked for it.
    fn done(
        &mut self,
        out: &Output,
        finish_reason: &str,
        u: &leyline_engine::Usage,
        session: &Option<SessionRun>,
        logprobs: Option<Vec<Value>>,
    ) -> Value {
        // A reply cut after its calls is complete as far as the client goes: it has calls to
        // run (Codex fails a turn on `incomplete`), as Anthropic's `tool_use` stop reason
        // wins over `max_tokens`.
        let called = out.items().iter().any(|i| i["type"] == "function_call");
        let incomplete = finish_reason == "length" && !called;
        let mut r = self.skeleton.clone();
        r["status"] = json!(if incomplete {
            "incomplete"
        } else {
            "completed"
        });
        if incomplete {
            r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        r["output"] = json!(out.items());
        r["usage"] = usage(u);
        let mut leyline = report(u, session);
        leyline.unsupported_tools = self.unsupported.clone();
        leyline.logprobs = logprobs.map(Value::from);
        r["leyline"] = json!(leyline);
        if let Some((store, owner, mut conversation)) = self.keep.take() {
            // Output items are input items: they convert as the next request's would.
            if let Ok(reply) = input_to_chat(&json!(out.items())) {
                conversation.extend(reply);
                let response = r.clone();
                store.insert(
                    self.id.clone(),
                    StoredResponse {
                        owner,
                        response,
                        conversation,
                    },
                );
            }
        }
        r
    }
}

async fn collect(st: Arc<AppState>, mut ctx: Ctx, started: Started) -> Result<Response> {
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
        logprobs,
        ..
    } = collect_text(&st, &mut rx).await?;
    let segments = OutputSplitter::split(&text, ctx.tool_names.clone(), ctx.think);
    let mut out = Output::default();
    for s in segments {
        out.push(s);
    }
    out.finish(finish_reason == "length");
    Ok(Json(ctx.done(&out, finish_reason, &usage, &session, logprobs)).into_response())
}

fn sse(e: &Value) -> Event {
    Event::default()
        .event(e["type"].as_str().unwrap_or("message"))
        .data(e.to_string())
}

fn stream(st: Arc<AppState>, ctx: Ctx, started: Started) -> impl IntoResponse {
    let Started {
        rx,
        permit,
        session,
        ..
    } = started;
    let (tx, events) = mpsc::channel::<Value>(64);
    st.metrics.streams_open.fetch_add(1, Ordering::Relaxed);
    tokio::spawn(async move {
        let _permit = permit;
        if !pump(
            ctx,
            rx,
            session,
            st.abort.subscribe(),
            tx,
            st.config.stream_keepalive,
        )
        .await
        {
            st.metrics.stream_errors.fetch_add(1, Ordering::Relaxed);
        }
        st.metrics.streams_open.fetch_sub(1, Ordering::Relaxed);
    });
    let events = ReceiverStream::new(events).map(|e| Ok::<_, Infallible>(sse(&e)));
    Sse::new(events).keep_alive(KeepAlive::default())
}

/// Sends a generation's stream events to `tx` until it ends, fails, or the client goes away
/// (dropping `rx` then tells the engine to stop); `response.in_progress` after each
/// `keepalive` without an event. False when the generation failed.
async fn pump(
    mut ctx: Ctx,
    mut rx: mpsc::UnboundedReceiver<Piece>,
    session: Option<SessionRun>,
    mut abort: tokio::sync::watch::Receiver<bool>,
    tx: mpsc::Sender<Value>,
    keepalive: Duration,
) -> bool {
    let mut out = Output::default();
    let mut splitter = OutputSplitter::new(ctx.tool_names.clone(), ctx.think);
    let lifecycle = json!({"response": ctx.skeleton});
    let mut pending = vec![
        out.event("response.created", lifecycle.clone()),
        out.event("response.in_progress", lifecycle.clone()),
    ];
    let mut last_sent = tokio::time::Instant::now();
    loop {
        for e in pending.drain(..) {
            if tx.send(e).await.is_err() {
                return true;
            }
            last_sent = tokio::time::Instant::now();
        }
        let piece = tokio::select! {
            p = rx.recv() => p,
            _ = tokio::time::sleep_until(last_sent + keepalive) => {
                pending.push(out.event("response.in_progress", lifecycle.clone()));
                continue;
            }
            _ = abort.wait_for(|a| *a) => Some(Piece::Failed(leyline_engine::Failure::new(
                leyline_engine::ErrorKind::Stopped,
                "the server shut down before the request finished",
            ))),
            _ = tx.closed() => return true,
        };
        match piece {
            Some(Piece::Text(t)) => {
                for s in splitter.push(&t) {
                    out.push(s);
                }
                pending = out.take_events();
            }
            Some(Piece::Done {
                finish_reason,
                usage,
                logprobs,
                ..
            }) => {
                for s in splitter.finish() {
                    out.push(s);
                }
                out.finish(finish_reason == "length");
                let r = ctx.done(&out, finish_reason, &usage, &session, logprobs);
                let kind = if r["status"] == "incomplete" {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                pending = out.take_events();
                pending.push(out.event(kind, json!({ "response": r })));
                for e in pending {
                    if tx.send(e).await.is_err() {
                        break;
                    }
                }
                return true;
            }
            Some(Piece::Failed(f)) => {
                let err = if *abort.borrow() {
                    ServerError::ShuttingDown(f.message)
                } else {
                    ServerError::from(f)
                };
                let body = err.body()["error"].clone();
                let mut r = ctx.skeleton.clone();
                r["status"] = json!("failed");
                r["output"] = json!(out.items());
                r["error"] = json!({"code": body["code"], "message": body["message"]});
                let failed = out.event("response.failed", json!({ "response": r }));
                let error = out.event(
                    "error",
                    json!({"code": body["code"], "message": body["message"], "param": body["param"]}),
                );
                for e in [failed, error] {
                    if tx.send(e).await.is_err() {
                        break;
                    }
                }
                return false;
            }
            None => return true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn in_progress_events_fill_every_silence() {
        let ctx = Ctx {
            id: "resp_1".into(),
            skeleton: json!({"id": "resp_1", "object": "response", "status": "in_progress"}),
            tool_names: None,
            think: None,
            unsupported: Vec::new(),
            keep: None,
        };
        let (pieces, rx) = mpsc::unbounded_channel();
        let (_abort, abort_rx) = tokio::sync::watch::channel(false);
        let (tx, mut events) = mpsc::channel(256);
        let every = Duration::from_millis(100);
        let run = tokio::spawn(pump(ctx, rx, None, abort_rx, tx, every));
        // A prefill of about five periods; then text every tenth of a period for three
        // periods; then silence for two and a half.
        tokio::time::sleep(every * 5 + every / 2).await;
        for _ in 0..30 {
            pieces.send(Piece::Text("a".into())).ok();
            tokio::time::sleep(every / 10).await;
        }
        tokio::time::sleep(every * 2 + every / 2).await;
        drop(pieces);
        assert!(run.await.unwrap());
        let mut kinds = Vec::new();
        while let Ok(e) = events.try_recv() {
            assert_eq!(e["sequence_number"], kinds.len(), "{e}");
            if e["type"] == "response.in_progress" {
                assert_eq!(e["response"]["id"], "resp_1", "the same response: {e}");
            }
            kinds.push(e["type"].as_str().unwrap().to_string());
        }
        let at = |k: &str| kinds.iter().position(|x| x == k).unwrap();
        let (first_text, last_text) = (
            at("response.output_item.added"),
            kinds
                .iter()
                .rposition(|k| k == "response.output_text.delta")
                .unwrap(),
        );
        assert_eq!(kinds[0], "response.created");
        let waiting = &kinds[1..first_text];
        assert!(
            waiting.len() >= 4 && waiting.iter().all(|k| k == "response.in_progress"),
            "{kinds:?}"
        );
        let flowing = &kinds[first_text..=last_text];
        assert!(
            !flowing.contains(&"response.in_progress".to_string()),
            "none while text flows: {kinds:?}"
        );
        let after = &kinds[last_text + 1..];
        assert!(
            after.len() >= 2 && after.iter().all(|k| k == "response.in_progress"),
            "silence after text is filled too: {kinds:?}"
        );
    }
}
