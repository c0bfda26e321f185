//! leyline-server: Leyline's HTTP API. OpenAI-compatible completions and chat completions
//! (JSON or SSE streaming), sessions whose cached context is edited by directives, and
//! Prometheus `/metrics`, over an engine running on its own thread.
//!
//! Design decision: handlers are thin. Wire types live in [`openai`] with conversions into
//! engine types, every failure is one [`ServerError`] that knows its HTTP status, OpenAI
//! error `type` and SSE form, and the only state shared between requests is the engine
//! handle, the session table and counters, so a handler never blocks the engine.
//!
//! ```
//! use leyline_server::ServerConfig;
//! let cfg = ServerConfig::new("smollm2-135m");
//! assert_eq!(cfg.addr.to_string(), "127.0.0.1:8000");
//! assert!(cfg.api_keys.is_empty());
//! ```
#![deny(missing_docs)]

pub mod auth;
pub mod error;
pub mod generation;
pub mod metrics;
pub mod openai;
mod routes;
mod session_routes;
pub mod sessions;

pub use auth::Principal;
pub use error::{Result, ServerError};

use leyline_engine::{Engine, EngineConfig, EngineHandle, EngineThread};
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
    /// The model id clients name (`GET /v1/models`).
    pub model_name: String,
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
}

impl ServerConfig {
    /// Defaults for serving `model_name`.
    pub fn new(model_name: impl Into<String>) -> Self {
        Self {
            addr: SocketAddr::from(([127, 0, 0, 1], 8000)),
            api_keys: Vec::new(),
            model_name: model_name.into(),
            max_body_bytes: 4 << 20,
            max_concurrent: 64,
            default_max_tokens: 512,
            shutdown_grace: Duration::from_secs(30),
            sessions: sessions::SessionLimits::default(),
        }
    }
}

/// Everything the handlers share.
pub struct AppState {
    /// Settings.
    pub config: ServerConfig,
    engine: EngineHandle,
    tokenizer: Arc<Tokenizer>,
    chat: Option<ChatTemplate>,
    stop_tokens: Vec<u32>,
    context_length: usize,
    max_sequence_len: usize,
    vocab_size: usize,
    sessions: Arc<sessions::Sessions>,
    metrics: metrics::ServerMetrics,
    admission: Arc<Semaphore>,
    draining: AtomicBool,
    abort: watch::Sender<bool>,
    created: u64,
}

impl AppState {
    /// Shared state over a running engine and the model's tokenizer and template.
    ///
    /// Blocks briefly on the engine (one call between steps) to read its limits.
    ///
    /// # Errors
    /// The engine has stopped.
    pub fn new(config: ServerConfig, engine: EngineHandle, lm: LoadedModel) -> Result<Arc<Self>> {
        let (max_sequence_len, context_length, vocab_size) = engine.call(|e: &mut Engine| {
            let info = e.model().info();
            (e.max_sequence_len(), info.context_length, info.vocab_size)
        })?;
        let tokenizer = Arc::new(lm.tokenizer);
        let mut stop_tokens: Vec<u32> = tokenizer.eos_id().into_iter().collect();
        if let Some(t) = tokenizer
            .token_id("<|im_end|>")
            .filter(|t| !stop_tokens.contains(t))
        {
            stop_tokens.push(t);
        }
        let admission = Arc::new(Semaphore::new(config.max_concurrent.max(1)));
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Ok(Arc::new(Self {
            config,
            engine,
            tokenizer,
            chat: lm.chat,
            stop_tokens,
            context_length,
            max_sequence_len,
            vocab_size,
            sessions: Arc::default(),
            metrics: metrics::ServerMetrics::default(),
            admission,
            draining: AtomicBool::new(false),
            abort: watch::channel(false).0,
            created,
        }))
    }

    /// Refuse new work (503); running requests continue.
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// End running requests now with an error answer or event.
    pub fn abort_in_flight(&self) {
        self.abort.send_replace(true);
    }

    fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

/// A server listening on a socket, serving on the current tokio runtime.
pub struct Server {
    addr: SocketAddr,
    state: Arc<AppState>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    reaper: tokio::task::JoinHandle<()>,
}

impl Server {
    /// Binds `state.config.addr` and starts serving.
    ///
    /// # Errors
    /// The address cannot be bound.
    pub async fn start(state: Arc<AppState>) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind(state.config.addr)
            .await
            .map_err(|e| {
                ServerError::Startup(format!("cannot listen on {}: {e}", state.config.addr))
            })?;
        let addr = listener
            .local_addr()
            .map_err(|e| ServerError::Startup(e.to_string()))?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let app = routes::router(Arc::clone(&state));
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await
        });
        tracing::info!("listening on http://{addr}");
        let reaper = tokio::spawn(session_routes::reap_periodically(Arc::downgrade(&state)));
        Ok(Self {
            addr,
            state,
            stop: Some(stop),
            task,
            reaper,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The shared state.
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// Graceful stop: new requests get 503 and the listener closes; in-flight requests get
    /// `shutdown_grace` to finish, then are answered with an error. Returns when every
    /// connection is closed (at most a few seconds after the grace period).
    pub async fn shutdown(mut self) {
        self.reaper.abort();
        self.state.begin_drain();
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let grace = self.state.config.shutdown_grace;
        if tokio::time::timeout(grace, &mut self.task).await.is_ok() {
            return;
        }
        tracing::warn!("shutdown grace of {grace:?} over: ending in-flight requests");
        self.state.abort_in_flight();
        if tokio::time::timeout(Duration::from_secs(5), &mut self.task)
            .await
            .is_err()
        {
            self.task.abort();
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// Runs `leyline serve`: starts the engine over `lm` with `engine_config`, serves until
/// SIGINT or SIGTERM, then shuts down gracefully (see [`Server::shutdown`]). Blocks.
///
/// # Errors
/// The engine or the runtime cannot start, or the address cannot be bound.
pub fn serve(config: ServerConfig, lm: LoadedModel, engine_config: EngineConfig) -> Result<()> {
    let engine = Engine::new(Arc::clone(&lm.model), engine_config)?;
    let thread = EngineThread::spawn(engine)?;
    let state = AppState::new(config, thread.handle(), lm)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| ServerError::Startup(format!("cannot start the async runtime: {e}")))?;
    rt.block_on(async {
        let server = Server::start(state).await?;
        eprintln!(
            "leyline: serving on http://{} (Ctrl-C to stop)",
            server.local_addr()
        );
        shutdown_signal().await;
        eprintln!("leyline: shutting down");
        server.shutdown().await;
        Ok::<(), ServerError>(())
    })?;
    thread.shutdown();
    Ok(())
}
