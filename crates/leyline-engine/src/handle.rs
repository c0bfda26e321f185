//! A running engine on its own thread, driven through a channel.
//!
//! The engine loop blocks while idle, and between steps drains every queued command, so new
//! requests join the running batch at the next step (continuous batching).

use crate::engine::Engine;
use crate::error::{EngineError, Result};
use crate::metrics::Metrics;
use crate::request::Request;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce(&mut Engine) + Send>;

enum Command {
    Submit(Box<Request>),
    Run(Job),
    Shutdown,
}

/// A cloneable handle on an engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    metrics: Arc<Metrics>,
    alive: Arc<AtomicBool>,
}

/// Clears the engine's liveness flag when the engine thread ends.
struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// Owns the engine thread; dropping it shuts the engine down after the running work.
pub struct EngineThread {
    handle: EngineHandle,
    join: Option<JoinHandle<()>>,
}

impl EngineThread {
    /// Moves `engine` onto a new thread.
    ///
    /// # Errors
    /// The thread cannot be spawned.
    pub fn spawn(engine: Engine) -> Result<Self> {
        let (tx, rx) = mpsc::channel();
        let metrics = engine.metrics();
        let alive_flag = Arc::new(AtomicBool::new(true));
        let flag = Arc::clone(&alive_flag);
        let join = std::thread::Builder::new()
            .name("leyline-engine".into())
            .spawn(move || {
                // Cleared however the loop ends, a panic included.
                let _alive = AliveGuard(flag);
                engine_loop(engine, rx)
            })
            .map_err(|e| {
                EngineError::InvalidRequest(format!("cannot start the engine thread: {e}"))
            })?;
        let alive = Arc::clone(&alive_flag);
        Ok(Self {
            handle: EngineHandle { tx, metrics, alive },
            join: Some(join),
        })
    }

    /// A handle for submitting work.
    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Finishes running and queued requests, then stops the thread.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.handle.tx.send(Command::Shutdown);
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

impl Drop for EngineThread {
    fn drop(&mut self) {
        self.stop();
    }
}

impl EngineHandle {
    /// Queues a request; its events arrive through its sink.
    ///
    /// # Errors
    /// The engine has stopped.
    pub fn submit(&self, req: Request) -> Result<()> {
        self.tx
            .send(Command::Submit(Box::new(req)))
            .map_err(|_| EngineError::Stopped)
    }

    /// Runs `f` on the engine between two steps and returns its result.
    ///
    /// # Errors
    /// The engine has stopped.
    pub fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Engine) -> T + Send + 'static,
    ) -> Result<T> {
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move |e| {
            let _ = tx.send(f(e));
        });
        self.tx
            .send(Command::Run(job))
            .map_err(|_| EngineError::Stopped)?;
        rx.recv().map_err(|_| EngineError::Stopped)
    }

    /// Live counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Whether the engine thread still runs (false after a panic in it, or shutdown).
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }
}

fn engine_loop(mut engine: Engine, rx: mpsc::Receiver<Command>) {
    let mut shutting_down = false;
    loop {
        // Block only when idle; otherwise take what has arrived and keep stepping.
        let first = if engine.has_work() || shutting_down {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => {
                    shutting_down = true;
                    None
                }
            }
        } else {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        };
        let mut next = first;
        while let Some(cmd) = next {
            match cmd {
                Command::Submit(r) => {
                    engine.submit(*r);
                }
                Command::Run(job) => job(&mut engine),
                Command::Shutdown => shutting_down = true,
            }
            next = rx.try_recv().ok();
        }
        if engine.has_work() {
            if let Err(e) = engine.step() {
                tracing::error!("engine step failed: {e}");
            }
        } else if shutting_down {
            return;
        }
    }
}
