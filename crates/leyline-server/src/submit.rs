//! Starting a generation: limits, admission, the request's session, and the submission to
//! the engine, shared by every API that generates (OpenAI's chat and completions,
//! Anthropic's messages); each API then shapes the pieces that come back.

use crate::auth::Principal;
use crate::error::{Result, ServerError};
use crate::generation::{self, GenerateSpec, Piece};
use crate::handler::{create_engine_session, engine_call};
use crate::openai::{CacheMode, Generation, GenerationFields, LeylineReport};
use crate::state::AppState;
use leyline_core::Mode;
use leyline_engine::{ImplicitTurn, SessionEdits, SessionId, SessionRequest};
use std::sync::Arc;
use tokio::sync::{mpsc, OwnedSemaphorePermit};

/// The session a request runs in.
pub(crate) struct SessionRun {
    /// Its public id.
    pub(crate) id: String,
    pub(crate) engine: SessionId,
    pub(crate) mode: CacheMode,
    /// Whether this request created it again from its history.
    pub(crate) rebuilt: bool,
}

/// How a request uses cached context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CachePlan {
    /// In a named session (given, or opened for `leyline.mode` amortize or forget).
    Session,
    /// Without one, continuing the tenant's cached conversation it edits (implicit
    /// splices), in this mode.
    Implicit(Mode),
    /// From the prefix tree alone.
    Prefix,
}

impl CachePlan {
    /// The plan for a request's fields: a session id or a body mode decides first, then the
    /// server's implicit-splice switch, then the `X-Leyline-Mode` header.
    pub(crate) fn of(st: &AppState, fields: &GenerationFields) -> Self {
        let body = fields.leyline.as_ref().and_then(|l| l.mode);
        if fields.session_id.is_some() || matches!(body, Some(CacheMode::Edit(_))) {
            return CachePlan::Session;
        }
        if body == Some(CacheMode::Prefix) || !st.config.implicit_splices {
            return CachePlan::Prefix;
        }
        match fields.header_mode.unwrap_or(CacheMode::DEFAULT) {
            CacheMode::Prefix => CachePlan::Prefix,
            CacheMode::Edit(mode) => CachePlan::Implicit(mode),
        }
    }

    /// Whether the prompt's message bounds are needed (everything but the prefix tree).
    pub(crate) fn needs_bounds(self) -> bool {
        self != CachePlan::Prefix
    }
}

/// The `X-Leyline-Mode` header, if the request has one.
///
/// # Errors
/// A value other than `amortize`, `forget` or `prefix`.
pub(crate) fn header_mode(headers: &axum::http::HeaderMap) -> Result<Option<CacheMode>> {
    let Some(v) = headers.get("x-leyline-mode") else {
        return Ok(None);
    };
    v.to_str()
        .ok()
        .and_then(CacheMode::parse)
        .map(Some)
        .ok_or_else(|| {
            ServerError::invalid(
                "X-Leyline-Mode",
                "the X-Leyline-Mode header must be amortize, forget or prefix",
            )
        })
}

/// Takes the `X-Session-Id` header as the request's session id when the server lets the
/// header name sessions (`session_header`) and the body names none.
///
/// # Errors
/// A header that is not text, or one that names another session than the body.
pub(crate) fn session_header(
    st: &AppState,
    headers: &axum::http::HeaderMap,
    fields: &mut GenerationFields,
) -> Result<()> {
    let Some(v) = headers
        .get("x-session-id")
        .filter(|_| st.config.session_header)
    else {
        return Ok(());
    };
    let v = v.to_str().map_err(|_| {
        ServerError::invalid("X-Session-Id", "the X-Session-Id header must be ASCII")
    })?;
    match &fields.session_id {
        Some(body) if body != v => Err(ServerError::invalid(
            "session_id",
            "session_id and the X-Session-Id header name different sessions",
        )),
        Some(_) => Ok(()),
        None => {
            fields.session_id = Some(v.to_owned());
            Ok(())
        }
    }
}

/// The engine's key for a client's conversation name (a fixed-key hash: the same name is the
/// same key in every run and on every replica). Tenants are kept apart by the engine
/// beside it, so equal names under two API keys never meet.
fn conversation_key(name: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut h);
    h.finish()
}

/// The conversation-name headers clients send, in the order they are read:
/// `X-Claude-Code-Session-Id` (Claude Code), `session-id` (Codex).
pub(crate) const CONVERSATION_HEADERS: [&str; 2] = ["x-claude-code-session-id", "session-id"];

/// Takes the first conversation-name header the request has as its conversation name,
/// unless the body named one (`prompt_cache_key`).
///
/// # Errors
/// A header that is not visible ASCII, or longer than 256 bytes.
pub(crate) fn conversation_header(
    headers: &axum::http::HeaderMap,
    fields: &mut GenerationFields,
) -> Result<()> {
    if fields.conversation.is_some() {
        return Ok(());
    }
    for name in CONVERSATION_HEADERS {
        let Some(v) = headers.get(name) else {
            continue;
        };
        let v = v
            .to_str()
            .ok()
            .filter(|v| !v.is_empty() && v.len() <= 256)
            .ok_or_else(|| {
                ServerError::invalid(
                    name,
                    format!("the {name} header must be 1 to 256 ASCII characters"),
                )
            })?;
        fields.conversation = Some(v.to_owned());
        return Ok(());
    }
    Ok(())
}

/// The request's session, if it runs in one: a named one, or a new one when
/// `leyline.mode` (amortize or forget) comes without a session id (its id comes back in
/// `leyline`). A named id this server does not hold for the caller's key is created under
/// that id (sessions are soft state: after a failover the turn's full history rebuilds it).
async fn open_session(
    st: &Arc<AppState>,
    who: Principal,
    fields: &GenerationFields,
) -> Result<Option<SessionRun>> {
    let mode = fields.leyline.as_ref().and_then(|l| l.mode);
    let salt = fields.cache_salt.as_deref();
    let (id, engine, created) = match (&fields.session_id, mode) {
        (Some(id), _) => match st.sessions.resolve(id, who) {
            Ok(engine) => (id.clone(), engine, false),
            Err(_) => {
                crate::sessions::check_client_id(id, "session_id")?;
                let (_, engine) = create_engine_session(st, who, Some(id), salt).await?;
                (id.clone(), engine, true)
            }
        },
        (None, Some(CacheMode::Edit(_))) => {
            let (id, engine) = create_engine_session(st, who, None, salt).await?;
            (id, engine, false)
        }
        (None, _) => return Ok(None),
    };
    let rebuilt = created && fields.history;
    if rebuilt {
        st.metrics
            .sessions_rebuilt
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    Ok(Some(SessionRun {
        id,
        engine,
        mode: mode.unwrap_or(CacheMode::DEFAULT),
        rebuilt,
    }))
}

/// A generation the engine accepted.
pub(crate) struct Started {
    /// Its pieces, in order.
    pub(crate) rx: mpsc::UnboundedReceiver<Piece>,
    /// Its place among the requests in flight, held until the answer is complete.
    pub(crate) permit: OwnedSemaphorePermit,
    /// The session it runs in, if any.
    pub(crate) session: Option<SessionRun>,
    /// Prompt tokens.
    pub(crate) prompt_tokens: usize,
}

/// Checks `prompt` and `gen` against the server's limits, takes a place among the requests
/// in flight, opens the request's session, and submits. Refusals known at once (invalid,
/// unknown or busy session, a session edit that does not fit, a full queue) come back as
/// errors before any response starts.
///
/// # Errors
/// As above.
pub(crate) async fn start(
    st: &Arc<AppState>,
    who: Principal,
    prompt: Vec<u32>,
    bounds: Option<Vec<usize>>,
    gen: &Generation,
    fields: &GenerationFields,
) -> Result<Started> {
    if prompt.is_empty() {
        return Err(ServerError::invalid("prompt", "the prompt is empty"));
    }
    let limit = st.max_sequence_len;
    if prompt.len() >= limit {
        return Err(st.prompt_too_long(prompt.len()));
    }
    // A request may ask for more than the context has room for (Claude Code asks for 32000
    // on every model): it gets the room, as a generation that reaches the end of the
    // context would; `--max-output-tokens` caps it further.
    let room = limit - prompt.len();
    let max_tokens = gen
        .max_tokens
        .unwrap_or(st.config.default_max_tokens)
        .min(st.config.max_output_tokens.unwrap_or(usize::MAX))
        .min(room);
    let permit = Arc::clone(&st.admission).try_acquire_owned().map_err(|_| {
        ServerError::Overloaded(format!(
            "{} requests are in flight; retry later",
            st.config.max_concurrent
        ))
    })?;
    let session = open_session(st, who, fields).await?;
    // The engine diffs the prompt against the session (or the cached conversation it
    // continues) along the message bounds.
    let (session_req, implicit) = match (&session, CachePlan::of(st, fields)) {
        (Some(s), _) => {
            let edits = match (s.mode, bounds) {
                (CacheMode::Prefix, _) | (_, None) => SessionEdits::Tokens,
                (_, Some(b)) => SessionEdits::Messages(b),
            };
            let req = SessionRequest {
                id: s.engine,
                mode: s.mode.directive_mode(),
                edits,
            };
            (Some(req), None)
        }
        (None, CachePlan::Implicit(mode)) => {
            let conversation = fields.conversation.as_deref().map(conversation_key);
            let turn = bounds.map(|bounds| ImplicitTurn {
                bounds,
                mode,
                conversation,
            });
            (None, turn)
        }
        (None, _) => (None, None),
    };
    let repair = match fields.leyline.as_ref().and_then(|l| l.repair.as_ref()) {
        Some(r) => Some(r.resolve("leyline.repair")?),
        None => None,
    };
    let prompt_tokens = prompt.len();
    let spec = GenerateSpec {
        prompt,
        max_tokens,
        sampling: gen.sampling,
        stop_tokens: st.stop_tokens.clone(),
        stop: gen.stop.clone(),
        session: session_req,
        tenant: who.tenant(fields.cache_salt.as_deref()),
        implicit,
        repair,
    };
    let (req, rx) = generation::request(spec, Arc::clone(&st.tokenizer));
    // Refusals known at once (invalid, unknown or busy session) get their status before
    // any response starts.
    engine_call(st, move |e| e.try_submit(req)).await??;
    Ok(Started {
        rx,
        permit,
        session,
        prompt_tokens,
    })
}

/// The `leyline` object of a response: what the cache did for it.
pub(crate) fn report(usage: &leyline_engine::Usage, session: &Option<SessionRun>) -> LeylineReport {
    let edit = usage.edit.as_ref();
    LeylineReport {
        session_id: session.as_ref().map(|s| s.id.clone()),
        mode: session.as_ref().map(|s| s.mode),
        spliced: edit.is_some_and(|e| e.mode == Mode::Amortize && e.directives > 0),
        directives_applied: edit.map_or(0, |e| e.directives),
        tokens_reused: usage.cached_tokens,
        tokens_rotated: edit.map_or(0, |e| e.rotated),
        tokens_repaired: edit.map_or(0, |e| e.repaired),
        tokens_prefilled: usage.computed_tokens(),
        session_rebuilt: session.as_ref().is_some_and(|s| s.rebuilt),
        logprobs: None,
        context_management: None,
        unsupported_tools: Vec::new(),
    }
}

/// A generation's whole answer, for the APIs' non-streamed responses.
pub(crate) struct Collected {
    /// The text, stop strings cut.
    pub(crate) text: String,
    /// OpenAI's finish reason: `stop` or `length`.
    pub(crate) finish_reason: &'static str,
    /// Counts and timings.
    pub(crate) usage: leyline_engine::Usage,
    /// The stop string that ended the text, if one did.
    pub(crate) stop_sequence: Option<String>,
    /// Each token's log-probabilities (chat shape), when asked for.
    pub(crate) logprobs: Option<Vec<serde_json::Value>>,
}

/// Reads a generation to its end.
///
/// # Errors
/// The engine's failure, the engine dropping the request, or the server shutting down.
pub(crate) async fn collect_text(
    st: &AppState,
    rx: &mut mpsc::UnboundedReceiver<Piece>,
) -> Result<Collected> {
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
            Some(Piece::Failed(f)) => return Err(ServerError::from(f)),
            None => return Err(ServerError::Engine("the engine dropped the request".into())),
            Some(Piece::Done {
                finish_reason,
                usage,
                stop_sequence,
                logprobs,
                ..
            }) => {
                return Ok(Collected {
                    text,
                    finish_reason,
                    usage: *usage,
                    stop_sequence,
                    logprobs,
                })
            }
        }
    }
}
