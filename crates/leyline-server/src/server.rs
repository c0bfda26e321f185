//! The listening server, its graceful shutdown, and `leyline serve`.

use crate::error::{Result, ServerError};
use crate::state::{AppState, ServerConfig};
use crate::{routes, session_routes};
use leyline_engine::{Engine, EngineConfig, EngineThread};
use leyline_model::LoadedModel;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

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
