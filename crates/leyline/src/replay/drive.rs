//! One replay run: a fresh engine, one arm, C sessions in flight.
//!
//! The engine is stepped on this thread (the same `submit`/`step` calls its own thread makes),
//! and a finished request's follow-up is submitted before the next step. Which requests share
//! a step, and so every token count, then depends on the trajectories alone, never on timing:
//! that is what makes the counts reproducible. Latencies are wall-clock times.

use super::prepare::{Prepared, PreparedTurn};
use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use leyline_core::{Directive, Mode};
use leyline_engine::{
    Engine, EngineConfig, Event, MetricsSnapshot, Request, SessionEdits, SessionId, SessionRequest,
    Usage,
};
use leyline_model::CausalLm;
use leyline_policy::{diff_rendered, Rendered};
use serde::{Deserialize, Serialize};
use std::ops::ControlFlow;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a session's cache meets the policy's edits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arm {
    /// Plain requests over the radix prefix cache: an edit re-prefills from its first token.
    Baseline,
    /// Leyline sessions, edits spliced in place (AMORTIZE).
    Amortize,
    /// Leyline sessions, edits trimmed and re-prefilled (FORGET).
    Forget,
    /// Leyline sessions, edits spliced in place and repaired (AMORTIZE with `--repair`).
    Repair,
}

impl Arm {
    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Arm::Baseline => "baseline",
            Arm::Amortize => "amortize",
            Arm::Forget => "forget",
            Arm::Repair => "repair",
        }
    }

    fn mode(self) -> Option<Mode> {
        match self {
            Arm::Baseline => None,
            Arm::Amortize | Arm::Repair => Some(Mode::Amortize),
            Arm::Forget => Some(Mode::Forget),
        }
    }
}

impl std::fmt::Display for Arm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One run's settings.
#[derive(Debug, Clone)]
pub struct RunParams {
    /// The arm.
    pub arm: Arm,
    /// Sessions in flight.
    pub concurrency: usize,
    /// Tokens generated per request (greedy).
    pub max_tokens: usize,
    /// Tokens that end a reply.
    pub stop_tokens: Vec<u32>,
    /// The fresh engine's settings.
    pub engine: EngineConfig,
}

/// One request of a run.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    /// Index of the session in replay order.
    pub session: usize,
    /// Its trajectory, `source/id`.
    pub trajectory: String,
    /// Assistant turn.
    pub turn: usize,
    /// The policy changed a message of the previous request's context.
    pub edit_turn: bool,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV was reused (prefix hits, and kept tokens of an edited session;
    /// not an AMORTIZE replacement).
    pub cached_tokens: usize,
    /// Prompt tokens computed for this request (by the request or by its AMORTIZE edit).
    pub prefilled_tokens: usize,
    /// Directives sent with the request.
    pub directives: usize,
    /// Keys rotated by the edit.
    pub rotated_tokens: usize,
    /// Replacement tokens the edit prefilled that the prompt then did not reuse.
    pub edit_wasted_tokens: usize,
    /// Downstream tokens the edit recomputed (the `repair` arm).
    pub repaired_tokens: usize,
    /// The turn's fresh tokens: what no cache could have held ([`PreparedTurn::fresh_tokens`]).
    pub fresh_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Queue time, ms.
    pub queued_ms: f64,
    /// Time to first token, ms.
    pub ttft_ms: f64,
    /// Submission to finish, ms.
    pub e2e_ms: f64,
}

/// What one run measured.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// Every request, in finishing order.
    pub records: Vec<RequestRecord>,
    /// The engine's counters at the end.
    pub metrics: MetricsSnapshot,
    /// Wall time of the run.
    pub wall: Duration,
}

/// A session's replay state.
#[derive(Default)]
struct Live {
    id: Option<SessionId>,
    next: usize,
    /// What the engine session holds: the last prompt plus its generated tokens.
    held: Rendered,
    directives: usize,
}

/// Replays `prepared` on a fresh engine; `tick` runs after every finished request.
///
/// # Errors
/// Engine errors and failed requests (the replay is sized to fit, so a failure is a bug).
pub fn run(
    model: Arc<dyn CausalLm>,
    prepared: &Prepared,
    p: &RunParams,
    tick: &mut dyn FnMut(),
) -> Result<RunOutcome> {
    let mut engine = Engine::new(model, p.engine.clone())?;
    let (tx, rx) = mpsc::channel::<(usize, Event)>();
    let mut live: Vec<Live> = prepared.sessions.iter().map(|_| Live::default()).collect();
    let mut records = Vec::with_capacity(prepared.requests());
    let mut started = 0;
    let t0 = Instant::now();
    let mut d = Driver {
        engine: &mut engine,
        prepared,
        p,
        tx: &tx,
    };
    while started < p.concurrency.min(prepared.sessions.len()) {
        d.start(started, &mut live[started])?;
        started += 1;
    }
    loop {
        while let Ok((i, ev)) = rx.try_recv() {
            let (usage, tokens) = match ev {
                Event::Finished { usage, tokens, .. } => (usage, tokens),
                Event::Failed(msg) => {
                    let s = &prepared.sessions[i];
                    bail!("{} turn {}: {msg}", s.name, s.turns[live[i].next - 1].turn)
                }
                Event::Token(_) | Event::Logprobs(_) => continue,
            };
            let s = &mut live[i];
            let turn = &prepared.sessions[i].turns[s.next - 1];
            records.push(record(i, &prepared.sessions[i].name, turn, s, &usage));
            tick();
            s.held = Rendered {
                tokens,
                bounds: turn.prompt.bounds.clone(),
            };
            if s.next < prepared.sessions[i].turns.len() {
                d.submit(i, s)?;
            } else {
                if let Some(id) = s.id.take() {
                    d.engine.delete_session(id)?;
                }
                s.held = Rendered::default();
                if started < prepared.sessions.len() {
                    d.start(started, &mut live[started])?;
                    started += 1;
                }
            }
        }
        if !d.engine.has_work() {
            break;
        }
        d.engine.step()?;
    }
    if records.len() != prepared.requests() {
        bail!(
            "{} of {} requests finished",
            records.len(),
            prepared.requests()
        );
    }
    Ok(RunOutcome {
        records,
        metrics: engine.metrics().snapshot(),
        wall: t0.elapsed(),
    })
}

struct Driver<'a> {
    engine: &'a mut Engine,
    prepared: &'a Prepared,
    p: &'a RunParams,
    tx: &'a mpsc::Sender<(usize, Event)>,
}

impl Driver<'_> {
    fn start(&mut self, i: usize, s: &mut Live) -> Result<()> {
        if self.p.arm.mode().is_some() {
            s.id = Some(self.engine.create_session());
        }
        self.submit(i, s)
    }

    /// Submits the session's next turn, with directives for the edits the policy made to
    /// what the session holds.
    fn submit(&mut self, i: usize, s: &mut Live) -> Result<()> {
        let turn = &self.prepared.sessions[i].turns[s.next];
        s.next += 1;
        let session = match (self.p.arm.mode(), s.id) {
            (Some(mode), Some(id)) => {
                let edits = directives(&s.held, &turn.prompt, mode)?;
                s.directives = edits.len();
                Some(SessionRequest {
                    id,
                    mode,
                    edits: SessionEdits::Directives(edits),
                })
            }
            _ => None,
        };
        let tx = self.tx.clone();
        let sink = Box::new(move |e| {
            if !matches!(e, Event::Token(_)) {
                let _ = tx.send((i, e));
            }
            ControlFlow::Continue(())
        });
        let req = Request {
            stop_tokens: self.p.stop_tokens.clone(),
            session,
            ..Request::greedy(turn.prompt.tokens.clone(), self.p.max_tokens, sink)
        };
        self.engine.submit(req);
        Ok(())
    }
}

/// Directives turning what a session holds (`held`: the previous prompt's messages, then the
/// generation prompt and generated tokens) into a prefix of `prompt`: the diff's edits that end
/// within the held messages. The first edit reaching into the generated tail and everything
/// after it are left to the engine, which keeps the longest common prefix of the edited
/// session and the prompt and prefills the rest.
///
/// # Errors
/// Bounds that do not fit their tokens.
pub fn directives(held: &Rendered, prompt: &Rendered, mode: Mode) -> Result<Vec<Directive>> {
    let Some(&messages_end) = held.bounds.last() else {
        return Ok(Vec::new());
    };
    let edits = diff_rendered(held, prompt).context("diffing the session and the prompt")?;
    Ok(edits
        .into_iter()
        .take_while(|e| e.end <= messages_end && e.start < messages_end)
        .map(|e| Directive::new(e.start, e.end, e.replacement, mode))
        .collect())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn record(i: usize, name: &str, turn: &PreparedTurn, s: &Live, u: &Usage) -> RequestRecord {
    let rotated = u.edit.map_or(0, |e| e.rotated);
    RequestRecord {
        session: i,
        trajectory: name.to_string(),
        turn: turn.turn,
        edit_turn: turn.edit_turn,
        prompt_tokens: u.prompt_tokens,
        cached_tokens: u.cached_tokens,
        prefilled_tokens: u.prefilled_tokens,
        directives: s.directives,
        rotated_tokens: rotated,
        edit_wasted_tokens: u.computed_tokens() - u.prefilled_tokens,
        repaired_tokens: u.edit.map_or(0, |e| e.repaired),
        fresh_tokens: turn.fresh_tokens,
        completion_tokens: u.completion_tokens,
        queued_ms: ms(u.queued),
        ttft_ms: ms(u.ttft),
        e2e_ms: ms(u.total),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use leyline_policy::{ByteChatMl, Message, Renderer};

    fn render(m: &[Message], gen: bool) -> Rendered {
        let mut r = ByteChatMl.render_tokens(m).unwrap();
        if gen {
            r.tokens.extend([ByteChatMl::IM_START, b'a' as u32]);
        }
        r
    }

    #[test]
    fn directives_cover_the_policy_edit_and_leave_the_generated_tail_to_the_prefix_match() {
        let before = vec![
            Message::user("go"),
            Message::assistant("call"),
            Message::tool("t", "a long tool output"),
        ];
        // What the session holds: the prompt, the generation prompt and a generated "zz".
        let mut held = render(&before, true);
        held.tokens.extend([b'z' as u32, b'z' as u32]);
        let mut after = before.clone();
        after[2].content = "[stub]".into();
        after.push(Message::assistant("recorded reply"));
        after.push(Message::user("more"));
        let prompt = render(&after, true);
        let d = directives(&held, &prompt, Mode::Amortize).unwrap();
        assert_eq!(d.len(), 1, "{d:?}");
        // Applying the directive and cutting at the first difference gives a prefix of the
        // prompt that reaches past the edit.
        let mut edited = held.tokens[..d[0].start].to_vec();
        edited.extend_from_slice(&d[0].replacement);
        edited.extend_from_slice(&held.tokens[d[0].end..]);
        let keep = edited
            .iter()
            .zip(&prompt.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        let stub_end = prompt.bounds[3];
        assert!(keep >= stub_end, "keep {keep} < {stub_end}");
        let r = d[0].start..d[0].start + d[0].replacement.len();
        assert_eq!(prompt.tokens[r], d[0].replacement[..]);
        // No edit: no directive; empty session: none either.
        let mut same = before.clone();
        same.push(Message::assistant("recorded reply"));
        same.push(Message::user("more"));
        assert!(directives(&held, &render(&same, true), Mode::Forget)
            .unwrap()
            .is_empty());
        assert!(directives(&Rendered::default(), &prompt, Mode::Forget)
            .unwrap()
            .is_empty());
    }
}
