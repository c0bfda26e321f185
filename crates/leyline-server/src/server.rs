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
        let task = tokio::spawn(accept_loop(listener, app, Arc::clone(&state), stopped));
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

/// Serves connections until `stopped`, then waits for the open ones to finish (each is told
/// to close once its request in flight is answered).
///
/// Each connection has `header_timeout` to send a request's headers (idle keep-alive
/// connections too), so half-open connections cannot pile up; at most `max_connections` are
/// open, and further ones wait in the kernel's listen backlog.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    state: Arc<AppState>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let cfg = &state.config;
    let slots = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections.max(1)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let permit = tokio::select! {
            p = Arc::clone(&slots).acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = &mut stopped => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: wait, do not spin.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut stopped => break,
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(cfg.header_timeout)
            .serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        let st = Arc::clone(&state);
        st.metrics
            .connections_accepted
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        st.metrics
            .connections_open
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection ended: {e}");
            }
            st.metrics
                .connections_open
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
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
    if !config.addr.ip().is_loopback() && config.api_keys.is_empty() {
        tracing::warn!("listening on {} without an API key", config.addr);
        eprintln!(
            "leyline: WARNING: listening on {} with no --api-key: anyone who can reach this \
             address can use the server and read its sessions",
            config.addr
        );
    }
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
