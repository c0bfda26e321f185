//! The configuration and the state every handler shares.

use crate::error::Result;
use crate::{metrics, sessions};
use leyline_engine::{Engine, EngineHandle};
use leyline_model::chat::ChatTemplate;
use leyline_model::tokenizer::Tokenizer;
use leyline_model::LoadedModel;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Semaphore};

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Where to listen (default 127.0.0.1:8000; port 0 picks a free one).
    pub addr: SocketAddr,
    /// Bearer keys; empty means no authentication.
    pub api_keys: Vec<String>,
    /// The model id clients name (`GET /v1/models`), and the one responses carry.
    pub model_name: String,
    /// Further ids that name the same model (`--served-model-name` after the first): the
    /// ids a client sends for its side requests (a small fast model for titles, say).
    pub aliases: Vec<String>,
    /// Cap on any request's new tokens: a larger `max_tokens` is lowered to it, for clients
    /// that always ask for more than the server should give.
    pub max_output_tokens: Option<usize>,
    /// Temperature of requests that set none (the APIs' default, 1, when `None`).
    pub default_temperature: Option<f64>,
    /// Sampler seed of requests that set none (random per request when `None`).
    pub default_seed: Option<u64>,
    /// How long a Messages or Responses stream stays without an event before it sends the
    /// API's own keep-alive (`ping`, `response.in_progress`): clients' idle timers see
    /// those, not SSE comments.
    pub stream_keepalive: Duration,
    /// Largest request body in bytes.
    pub max_body_bytes: usize,
    /// Most generation requests in flight; more are refused with 429.
    pub max_concurrent: usize,
    /// `max_tokens` when a request gives none (capped by the room left in the context).
    pub default_max_tokens: usize,
    /// On shutdown, how long in-flight requests may run before they are answered with an error.
    pub shutdown_grace: Duration,
    /// Bounds on open sessions (each pins its KV).
    pub sessions: sessions::SessionLimits,
    /// Host names (optionally `name:port`) that requests may name in their `Host` header;
    /// `*` allows any. Loopback names always pass, and so does the bound address. Guards a
    /// local server against DNS rebinding; a deployment behind a proxy adds its names.
    pub allowed_hosts: Vec<String>,
    /// How long a client may take to send a request's headers (slowloris guard); also how
    /// long an idle keep-alive connection stays open.
    pub header_timeout: Duration,
    /// How long a client may take to send a request's body.
    pub body_timeout: Duration,
    /// Most open connections; further ones wait in the listen backlog.
    pub max_connections: usize,
    /// Most prompts rendered and tokenized at once (off the async workers).
    pub max_rendering: usize,
    /// Whether chat requests without a session id continue, by a splice, the cached
    /// conversation they edit (implicit splices; a request opts out with `leyline.mode` or
    /// `X-Leyline-Mode` set to `prefix` or `forget`).
    pub implicit_splices: bool,
    /// Whether an `X-Session-Id` header names the request's session, as `session_id` in the
    /// body does; when false the header is only a proxy's affinity key and is ignored here.
    pub session_header: bool,
    /// Most responses kept for `previous_response_id` and `GET /v1/responses/{id}`
    /// (`store: true`; the least recently used goes first; 0 keeps none).
    pub responses_store: usize,
    /// A directory to record every generation request in (`serve --record DIR`): one JSON
    /// line per request, the body as sent and the headers a replay needs, never API keys.
    pub record: Option<std::path::PathBuf>,
}

impl ServerConfig {
    /// Defaults for serving `model_name`.
    pub fn new(model_name: impl Into<String>) -> Self {
        Self {
            addr: SocketAddr::from(([127, 0, 0, 1], 8000)),
            api_keys: Vec::new(),
            model_name: model_name.into(),
            aliases: Vec::new(),
            max_output_tokens: None,
            default_temperature: None,
            default_seed: None,
            stream_keepalive: Duration::from_secs(5),
            max_body_bytes: 4 << 20,
            max_concurrent: 64,
            default_max_tokens: 512,
            shutdown_grace: Duration::from_secs(30),
            sessions: sessions::SessionLimits::default(),
            allowed_hosts: Vec::new(),
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: 512,
            max_rendering: 2,
            implicit_splices: true,
            session_header: true,
            responses_store: 256,
            record: None,
        }
    }
}

/// Everything the handlers share.
pub struct AppState {
    /// Settings.
    pub config: ServerConfig,
    pub(crate) engine: EngineHandle,
    pub(crate) tokenizer: Arc<Tokenizer>,
    pub(crate) chat: Option<ChatTemplate>,
    pub(crate) stop_tokens: Vec<u32>,
    pub(crate) context_length: usize,
    pub(crate) max_sequence_len: usize,
    pub(crate) vocab_size: usize,
    /// The most bytes of text one token covers (a prompt of `n` bytes has at least
    /// `n / max_token_bytes` tokens).
    pub(crate) max_token_bytes: usize,
    pub(crate) sessions: Arc<sessions::Sessions>,
    pub(crate) metrics: metrics::ServerMetrics,
    pub(crate) admission: Arc<Semaphore>,
    pub(crate) rendering: Arc<Semaphore>,
    pub(crate) draining: AtomicBool,
    pub(crate) abort: watch::Sender<bool>,
    pub(crate) created: u64,
    /// Whether the chat template renders a `system` message after the first one at its
    /// place (ChatML's do); when not, such a message joins the next user message.
    pub(crate) mid_system: bool,
    /// Whether the model reasons in `<think>` blocks (its chat template knows `</think>`):
    /// its outputs' reasoning is split from their answers.
    pub(crate) thinks: bool,
    /// The open recording (`record`).
    pub(crate) recorder: Option<Arc<crate::record::Recorder>>,
}

impl AppState {
    /// Shared state over a running engine and the model's tokenizer and template.
    ///
    /// Blocks briefly on the engine (one call between steps) to read its limits.
    ///
    /// # Errors
    /// The engine has stopped, an API key is empty, or the `record` directory or its file
    /// cannot be created.
    pub fn new(config: ServerConfig, engine: EngineHandle, lm: LoadedModel) -> Result<Arc<Self>> {
        crate::auth::check_keys(&config.api_keys)?;
        let (max_sequence_len, context_length, vocab_size) = engine.call(|e: &mut Engine| {
            let info = e.model().info();
            (e.max_sequence_len(), info.context_length, info.vocab_size)
        })?;
        let tokenizer = Arc::new(lm.tokenizer);
        let max_token_bytes = (0..tokenizer.vocab_size() as u32)
            .filter_map(|id| tokenizer.token_bytes(id).map(<[u8]>::len))
            .max()
            .unwrap_or(1);
        let stop_tokens = tokenizer.stop_ids().to_vec();
        let admission = Arc::new(Semaphore::new(config.max_concurrent.max(1)));
        let rendering = Arc::new(Semaphore::new(config.max_rendering.max(1)));
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mid_system = lm.chat.as_ref().is_some_and(renders_mid_system);
        let thinks = lm
            .chat
            .as_ref()
            .is_some_and(|t| t.source().contains("</think>"));
        let recorder = config
            .record
            .as_deref()
            .map(|dir| {
                crate::record::Recorder::open(
                    dir,
                    config.api_keys.clone(),
                    config.max_body_bytes,
                    config.body_timeout,
                )
                .map(Arc::new)
            })
            .transpose()?;
        Ok(Arc::new(Self {
            config,
            engine,
            tokenizer,
            chat: lm.chat,
            stop_tokens,
            context_length,
            max_sequence_len,
            vocab_size,
            max_token_bytes,
            sessions: Arc::default(),
            metrics: metrics::ServerMetrics::default(),
            admission,
            rendering,
            draining: AtomicBool::new(false),
            abort: watch::channel(false).0,
            created,
            mid_system,
            thinks,
            recorder,
        }))
    }

    /// How the output of `prompt` is read for reasoning ([`crate::reasoning::OutputSplitter`]):
    /// `None` for a model that does not reason, else whether the prompt left a `<think>`
    /// block open.
    pub(crate) fn think_for(&self, prompt: &[u32]) -> Option<bool> {
        if !self.thinks {
            return None;
        }
        let tail = &prompt[prompt.len().saturating_sub(8)..];
        let text = self.tokenizer.decode(tail, false).unwrap_or_default();
        Some(crate::reasoning::ThinkSplitter::opened_by(&text))
    }

    /// Refuse new work (503); running requests continue.
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// End running requests now with an error answer or event.
    pub fn abort_in_flight(&self) {
        self.abort.send_replace(true);
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

/// Whether `template` renders a `system` message that follows other messages at its place:
/// a probe conversation must show the text, in order.
fn renders_mid_system(template: &ChatTemplate) -> bool {
    use leyline_model::chat::{ChatMessage, RenderOptions};
    const PROBE: &str = "\u{2}leyline-mid-system-probe\u{3}";
    let chat = [
        ChatMessage::new("system", "s"),
        ChatMessage::new("user", "first question"),
        ChatMessage::new("system", PROBE),
        ChatMessage::new("user", "second question"),
    ];
    template
        .render_with(&chat, &RenderOptions::default())
        .ok()
        .and_then(|text| {
            let probe = text.find(PROBE)?;
            Some(text.find("first question")? < probe && probe < text.find("second question")?)
        })
        .unwrap_or(false)
}
