//! What every handler shares: the state extractor, the JSON body reader, typed parsing
//! with the field named on error, and calls into the engine thread.

use crate::auth::Principal;
use crate::error::{Result, ServerError};
use crate::state::AppState;
use axum::extract::{FromRequest, Request, State};
use leyline_engine::{Engine, SessionId};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::sync::Arc;
use tokio_stream::StreamExt;

pub(crate) type St = State<Arc<AppState>>;

/// A JSON body, read within the size limit, with errors in the API's shape.
pub struct ApiJson(pub Value);

impl FromRequest<Arc<AppState>> for ApiJson {
    type Rejection = ServerError;

    async fn from_request(req: Request, st: &Arc<AppState>) -> Result<Self> {
        crate::guard::require_json(req.headers())?;
        let limit = st.config.max_body_bytes;
        let timeout = st.config.body_timeout;
        let mut stream = req.into_body().into_data_stream();
        let mut buf: Vec<u8> = Vec::new();
        let mut total = 0usize;
        // Past the limit, keep reading (up to 8x) and discard, so the client gets the
        // 413 instead of a reset connection while still sending.
        let read = async {
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| {
                    ServerError::bad_request(format!("reading the body failed: {e}"))
                })?;
                total += chunk.len();
                if total <= limit {
                    buf.extend_from_slice(&chunk);
                } else if total > limit.saturating_mul(8) {
                    break;
                }
            }
            Ok::<(), ServerError>(())
        };
        tokio::time::timeout(timeout, read).await.map_err(|_| {
            ServerError::RequestTimeout(format!(
                "the request body did not arrive within {} s",
                timeout.as_secs_f64()
            ))
        })??;
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

/// Refuses a top-level field of `body` that none of the `known` lists holds, naming it: an
/// API that is strict about its fields never serves a request with part of it ignored.
///
/// # Errors
/// A 400 whose `param` is the first unknown field.
pub(crate) fn refuse_unknown_fields(body: &Value, known: &[&[&str]]) -> Result<()> {
    let Some(obj) = body.as_object() else {
        return Ok(());
    };
    match obj
        .keys()
        .find(|k| !known.iter().any(|list| list.contains(&k.as_str())))
    {
        None => Ok(()),
        Some(k) => Err(ServerError::invalid(
            k,
            format!("`{k}` is not supported by this server; leave it out"),
        )),
    }
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

/// Creates a session in the engine and the table, under the caller's tenant (split by
/// `cache_salt`) and under `id` if given (checked by the caller); returns its public id and
/// its engine session.
///
/// # Errors
/// 429 when every place is taken; 409 when a concurrent request created `id` first.
pub(crate) async fn create_engine_session(
    st: &AppState,
    who: Principal,
    id: Option<&str>,
    cache_salt: Option<&str>,
) -> Result<(String, SessionId)> {
    let limits = st.config.sessions;
    reap(st, 1).await;
    let tenant = who.tenant(cache_salt);
    let eid = engine_call(st, move |e| e.create_tenant_session(tenant)).await?;
    let id = st
        .sessions
        .create(who, id, eid, limits.max)
        .inspect_err(|_| {
            // Lost a race for the last place or the id: the engine session must not outlive this.
            let engine = st.engine.clone();
            tokio::task::spawn_blocking(move || engine.call(move |e| e.delete_session(eid)));
        })?;
    Ok((id, eid))
}

/// Drops expired sessions (and, for `room > 0`, the least recently used idle ones until
/// `room` more fit) from the engine and the table.
pub(crate) async fn reap(st: &AppState, room: usize) {
    let limits = st.config.sessions;
    let gone = engine_call(st, move |e| {
        e.reap_sessions(
            std::time::Instant::now(),
            limits.idle_timeout,
            limits.max,
            room,
        )
    })
    .await;
    match gone {
        Ok(gone) if !gone.is_empty() => {
            st.sessions.remove_engine_sessions(&gone);
            tracing::info!("dropped {} idle sessions", gone.len());
        }
        Ok(_) => {}
        Err(e) => tracing::warn!("dropping idle sessions: {e}"),
    }
}
