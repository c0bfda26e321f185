//! Session routes: create, inspect, delete, and the explicit directive channel.

use crate::auth::Principal;
use crate::error::{Result, ServerError};
use crate::handler::{create_engine_session, engine_call, parse, reap, ApiJson, St};
use crate::openai::WireRepair;
use crate::state::AppState;
use axum::extract::{Path, Query, State};
use axum::{Extension, Json};
use leyline_core::{Directive, Mode};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// Reaps expired sessions every quarter of the idle timeout (at most every minute) until
/// the state is gone.
pub(crate) async fn reap_periodically(st: std::sync::Weak<AppState>) {
    let every = match st.upgrade() {
        Some(s) => (s.config.sessions.idle_timeout / 4).clamp(
            std::time::Duration::from_millis(10),
            std::time::Duration::from_secs(60),
        ),
        None => return,
    };
    loop {
        tokio::time::sleep(every).await;
        let Some(s) = st.upgrade() else { return };
        reap(&s, 0).await;
    }
}

pub(crate) async fn create_session(
    State(st): St,
    Extension(who): Extension<Principal>,
) -> Result<Json<Value>> {
    let (id, _) = create_engine_session(&st, who, None, None).await?;
    Ok(Json(json!({"id": id, "object": "session", "length": 0})))
}

#[derive(Deserialize)]
pub(crate) struct SessionQuery {
    #[serde(default)]
    pub(crate) tokens: bool,
}

pub(crate) async fn get_session(
    State(st): St,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    q: std::result::Result<Query<SessionQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>> {
    let Query(q) = q.map_err(|e| ServerError::invalid("tokens", e.body_text()))?;
    let eid = st.sessions.resolve(&id, who)?;
    let info = engine_call(&st, move |e| e.session_info(eid)).await??;
    let mut body = json!({
        "id": id, "object": "session", "length": info.tokens.len(), "turns": info.turns, "busy": info.busy
    });
    if q.tokens {
        body["tokens"] = json!(info.tokens);
    }
    Ok(Json(body))
}

pub(crate) async fn delete_session(
    State(st): St,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<Value>> {
    let eid = st.sessions.resolve(&id, who)?;
    // The engine refuses a busy session (409); only then does the id go.
    engine_call(&st, move |e| e.delete_session(eid)).await??;
    st.sessions.remove(&id, who)?;
    Ok(Json(
        json!({"id": id, "object": "session.deleted", "deleted": true}),
    ))
}

/// One directive on the wire: a pre-edit range and a replacement given as text or ids.
#[derive(Deserialize)]
pub(crate) struct WireDirective {
    start: usize,
    end: usize,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    tokens: Option<Vec<u32>>,
}

/// `POST /v1/sessions/{id}/directives`: one atomic batch in one mode.
#[derive(Deserialize)]
pub(crate) struct DirectiveRequest {
    directives: Vec<WireDirective>,
    #[serde(default)]
    mode: Option<Mode>,
    /// The batch's repair, over the session's and the server's.
    #[serde(default)]
    repair: Option<WireRepair>,
}

pub(crate) async fn apply_directives(
    State(st): St,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    ApiJson(v): ApiJson,
) -> Result<Json<Value>> {
    let req: DirectiveRequest = parse(&v)?;
    let mode = req.mode.unwrap_or(Mode::Amortize);
    let result = apply_batch(&st, who, &id, req, mode).await;
    st.metrics.record_directives(
        mode.name(),
        if result.is_ok() { "applied" } else { "refused" },
    );
    result
}

async fn apply_batch(
    st: &Arc<AppState>,
    who: Principal,
    id: &str,
    req: DirectiveRequest,
    mode: Mode,
) -> Result<Json<Value>> {
    if req.directives.is_empty() {
        return Err(ServerError::invalid(
            "directives",
            "the batch has no directives",
        ));
    }
    let mut directives = Vec::with_capacity(req.directives.len());
    for (i, d) in req.directives.into_iter().enumerate() {
        let replacement = match (d.text, d.tokens) {
            (Some(t), None) => st.tokenizer.encode(&t, false)?,
            (None, Some(ids)) => ids,
            (None, None) => Vec::new(),
            (Some(_), Some(_)) => {
                return Err(ServerError::invalid(
                    &format!("directives[{i}]"),
                    format!("directive {i}: give the replacement as `text` or `tokens`, not both"),
                ))
            }
        };
        directives.push(Directive::new(d.start, d.end, replacement, mode));
    }
    let repair = match &req.repair {
        Some(r) => Some(r.resolve("repair")?),
        None => None,
    };
    let eid = st.sessions.resolve(id, who)?;
    let (before, report) = engine_call(st, move |e| {
        let before = e.session_info(eid).map(|i| i.tokens.len())?;
        e.apply_directives_repaired(eid, directives, repair)
            .map(|r| (before, r))
    })
    .await??;
    Ok(Json(json!({
        "id": id,
        "object": "session.directives",
        "mode": mode,
        "directives_applied": report.directives,
        "length_before": before,
        "length": report.new_len,
        "delta": report.new_len as i64 - before as i64,
        "tokens_reused": report.reused,
        "tokens_rotated": report.rotated,
        "tokens_repaired": report.repaired,
        "tokens_prefilled": report.prefilled,
    })))
}
