//! `leyline serve`: the OpenAI-compatible HTTP server.

use crate::{load_model, ModelArgs, ServeThreadsArgs};
use anyhow::Result;
use clap::Args;

/// Options of `leyline serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    addr: std::net::SocketAddr,
    /// Bearer key guarding every route but /health (repeatable or comma-separated).
    #[arg(long = "api-key", env = "LEYLINE_API_KEY", value_delimiter = ',')]
    api_keys: Vec<String>,
    /// Model ids clients may name (repeatable or comma-separated). The first is the id
    /// /v1/models lists first and responses carry; the others are aliases, e.g. the ids a
    /// client sends for its side requests (Claude Code's small fast model). Any other id is a
    /// 404. Default: the registry name or the file stem.
    #[arg(long, value_delimiter = ',')]
    served_model_name: Vec<String>,
    /// Cap on the new tokens of every request: a larger max_tokens (Claude Code asks for
    /// 32000) is lowered to it rather than refused. Shown in /v1/models.
    #[arg(long)]
    max_output_tokens: Option<usize>,
    /// Temperature of requests that set none (default: the APIs' 1.0). Shown in /v1/models.
    #[arg(long)]
    temperature: Option<f64>,
    /// Sampler seed of requests that set none (default: random per request). Shown in
    /// /v1/models.
    #[arg(long)]
    seed: Option<u64>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_body_bytes: usize,
    /// Most generation requests in flight; more get 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    max_concurrent: usize,
    /// max_tokens when a request sets none.
    #[arg(long, default_value_t = 512)]
    default_max_tokens: usize,
    /// Prompt tokens prefilled per scheduler step (long prompts never stall decodes long).
    #[arg(long, default_value_t = leyline_engine::DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: usize,
    /// Prompt tokens prefilled per step while other requests decode: bounds the gap between
    /// two streamed tokens when long prompts arrive.
    #[arg(long, default_value_t = leyline_engine::DEFAULT_DECODE_PREFILL_CHUNK)]
    decode_prefill_chunk: usize,
    /// Which prompts get a step's prefill budget first: `shortest` (fewest tokens left) or
    /// `arrival` (admission order).
    #[arg(long, default_value_t = leyline_engine::PrefillOrder::Shortest)]
    prefill_order: leyline_engine::PrefillOrder,
    /// With `--prefill-order shortest`: a prompt left without prefill in this many steps
    /// goes ahead of shorter ones from then on (bounds how long a long prompt waits).
    #[arg(long, default_value_t = leyline_engine::DEFAULT_PREFILL_PATIENCE)]
    prefill_patience: u32,
    /// Most sessions open at once (each pins its KV); when full, the least recently used
    /// idle session is dropped for a new one.
    #[arg(long, default_value_t = 1024)]
    max_sessions: usize,
    /// Seconds after which an idle session is dropped (a chat turn that names it again, with
    /// its history, creates it again; a directive batch on it answers 404 `session_unknown`).
    #[arg(long, default_value_t = 1800)]
    session_idle_timeout: u64,
    /// Seconds in-flight requests may run after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30)]
    shutdown_grace: u64,
    /// Host names clients may use to reach the server (the Host header; `name` or
    /// `name:port`, comma-separated; `*` for any). IP addresses and localhost always work;
    /// list the names a proxy or DNS gives the server. Guards against DNS rebinding.
    #[arg(long, value_delimiter = ',')]
    allowed_hosts: Vec<String>,
    /// Seconds a client has to send a request's headers (and an idle keep-alive connection
    /// stays open).
    #[arg(long, default_value_t = 10)]
    header_timeout: u64,
    /// Seconds a client has to send a request's body.
    #[arg(long, default_value_t = 30)]
    body_timeout: u64,
    /// Most open connections; more wait in the listen backlog.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// Most requests waiting for the engine; more get 503 with Retry-After.
    #[arg(long, default_value_t = leyline_engine::DEFAULT_MAX_WAITING)]
    max_queued: usize,
    /// Whether chat requests without a session id that edit a conversation cached for
    /// their API key continue it by a splice instead of a re-prefill (`on` or `off`). A
    /// request opts out with `leyline.mode` or the `X-Leyline-Mode` header set to `prefix`
    /// or `forget`.
    #[arg(long, default_value = "on", value_parser = on_off, action = clap::ArgAction::Set)]
    implicit_splices: bool,
    /// What an `X-Session-Id` request header does: `session` (it names the request's session,
    /// as `session_id` in the body does: an id the server does not hold for the caller's key
    /// is created, so a proxy can route by it from the first turn and a replica that takes a
    /// conversation over rebuilds it) or `route` (it is only the proxy's affinity key, for
    /// clients that rely on implicit splices; the server ignores it).
    #[arg(long, default_value = "session", value_parser = ["session", "route"])]
    session_header: String,
    /// Most cached conversations kept for implicit splices (least recently used goes).
    #[arg(long, default_value_t = leyline_engine::DEFAULT_MAX_IMPLICIT_SESSIONS)]
    max_conversations: usize,
    /// Most responses kept for `previous_response_id` and `GET /v1/responses/{id}` (Responses
    /// API, `store: true`; the least recently used goes first; 0 keeps none).
    #[arg(long, default_value_t = 256)]
    responses_store: usize,
    /// Downstream tokens an AMORTIZE splice recomputes under the edited context, unless a
    /// request or directive batch says otherwise: `0` (none: the splice alone), `N` or
    /// `after_edit:N` (the first N tokens after each edit), `before_end:N` (the last N tokens
    /// of the cached context) or `deviation:N` (the N whose KV moves most, found by a pass of
    /// the first layers over every downstream token). More is closer to FORGET's exact
    /// result and costs prefill. The default, `after_edit:16`, is for stock clients that
    /// never ask: on Qwen2.5-Coder-0.5B it lifts agreement with FORGET's next token from
    /// 80% to 93% of held-out probes for 1.7% of FORGET's work (BENCHMARKS.md, "Repair").
    #[arg(long, default_value = "after_edit:16")]
    repair: leyline_core::Repair,
    /// Record every generation request (chat, completions, messages, count_tokens,
    /// responses) to DIR/<unix-ms-at-start>.jsonl, one JSON line each, for
    /// `scripts/replay_http.py --recording`. API keys are never written, but the lines hold
    /// the client's prompts, file contents and tool texts as sent: keep recordings out of
    /// repositories and treat them as private.
    #[arg(long, value_name = "DIR")]
    record: Option<std::path::PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    rotation: crate::RotationArgs,
    #[command(flatten)]
    threads: ServeThreadsArgs,
}

fn on_off(s: &str) -> std::result::Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("expected on or off, got {other:?}")),
    }
}

/// Loads the model and serves until SIGINT or SIGTERM.
pub fn run(a: ServeArgs) -> Result<()> {
    a.threads.init()?;
    let lm = load_model(&a.model)?;
    let slots = a
        .model
        .kv_slots
        .unwrap_or(lm.model.info().context_length * 4);
    let engine_cfg = leyline_engine::EngineConfig {
        kv_dtype: a.model.kv_dtype,
        prefill_chunk: a.prefill_chunk,
        decode_prefill_chunk: a.decode_prefill_chunk,
        prefill_order: a.prefill_order,
        prefill_patience: a.prefill_patience,
        max_waiting: a.max_queued.max(1),
        max_implicit_sessions: if a.implicit_splices {
            a.max_conversations
        } else {
            0
        },
        repair: a.repair,
        ..a.rotation.apply(leyline_engine::EngineConfig::new(slots))
    };
    if let Some(t) = a.temperature.filter(|t| !(0.0..=2.0).contains(t)) {
        anyhow::bail!("--temperature must be between 0 and 2, got {t}");
    }
    if a.max_output_tokens == Some(0) {
        anyhow::bail!("--max-output-tokens must be at least 1");
    }
    let mut names = a.served_model_name.clone();
    names.retain(|n| !n.trim().is_empty());
    let name = if names.is_empty() {
        match &a.model.model {
            None => leyline_hub::DEFAULT_MODEL.to_string(),
            Some(p) => match leyline_hub::model_ref(p) {
                Ok(leyline_hub::ModelRef::Known(m)) => m.name.to_string(),
                _ => p
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "leyline".into()),
            },
        }
    } else {
        names.remove(0)
    };
    let mut cfg = leyline_server::ServerConfig::new(name);
    cfg.aliases = names;
    cfg.max_output_tokens = a.max_output_tokens;
    cfg.default_temperature = a.temperature;
    cfg.default_seed = a.seed;
    cfg.addr = a.addr;
    cfg.api_keys = a.api_keys;
    cfg.max_body_bytes = a.max_body_bytes;
    cfg.max_concurrent = a.max_concurrent;
    cfg.default_max_tokens = a.default_max_tokens;
    cfg.shutdown_grace = std::time::Duration::from_secs(a.shutdown_grace);
    cfg.allowed_hosts = a.allowed_hosts;
    cfg.header_timeout = std::time::Duration::from_secs(a.header_timeout.max(1));
    cfg.body_timeout = std::time::Duration::from_secs(a.body_timeout.max(1));
    cfg.max_connections = a.max_connections.max(1);
    cfg.implicit_splices = a.implicit_splices && a.max_conversations > 0;
    cfg.session_header = a.session_header == "session";
    cfg.responses_store = a.responses_store;
    cfg.record = a.record;
    cfg.sessions = leyline_server::sessions::SessionLimits {
        max: a.max_sessions.max(1),
        idle_timeout: std::time::Duration::from_secs(a.session_idle_timeout),
    };
    if let Some(arch) = lm.chat.as_ref().and_then(|t| t.builtin_for()) {
        eprintln!(
            "leyline: the file has no chat template; using Leyline's built-in {arch} template"
        );
    }
    eprintln!(
        "leyline: serving {} on http://{} ({} KV slots)",
        cfg.model_name, a.addr, slots
    );
    leyline_server::serve(cfg, lm, engine_cfg)?;
    Ok(())
}
