//! A running engine on its own thread, driven through a channel.
//!
//! The engine loop blocks while idle, and between steps drains every queued command, so new
//! requests join the running batch at the next step (continuous batching).

use crate::engine::Engine;
use crate::error::{EngineError, Result};
use crate::metrics::Metrics;
use crate::request::Request;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce(&mut Engine) + Send>;

enum Command {
    Submit(Request),
    Run(Job),
    Shutdown,
}

/// A cloneable handle on an engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    metrics: Arc<Metrics>,
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
        let join = std::thread::Builder::new()
            .name("leyline-engine".into())
            .spawn(move || engine_loop(engine, rx))
            .map_err(|e| {
                EngineError::InvalidRequest(format!("cannot start the engine thread: {e}"))
            })?;
        Ok(Self {
            handle: EngineHandle { tx, metrics },
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
            .send(Command::Submit(req))
            .map_err(|_| EngineError::InvalidRequest("the engine has stopped".into()))
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
            .map_err(|_| EngineError::InvalidRequest("the engine has stopped".into()))?;
        rx.recv()
            .map_err(|_| EngineError::InvalidRequest("the engine has stopped".into()))
    }

    /// Live counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
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
                    engine.submit(r);
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
