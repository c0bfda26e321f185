//! The bridge from the engine thread to async handlers: a request's sink decodes tokens to
//! text, cuts at stop strings, and sends [`Piece`]s down a channel.
//!
//! Decoding and stop matching run inside the sink (on the engine thread, a few microseconds
//! per token) so a stop string cancels the request at once and the engine still reports
//! exact usage. A receiver that goes away (client disconnected) cancels the request: in the
//! queue or while it prefills at the engine's next step, while it generates at its next token.

use leyline_engine::{ErrorKind, Event, Failure, Request, SamplingParams, Usage};
use leyline_model::tokenizer::Tokenizer;
use std::ops::ControlFlow;
use std::sync::Arc;
use tokio::sync::mpsc;

/// What a request's receiver gets.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// New text (never splits a character, never contains a stop string).
    Text(String),
    /// The end; nothing follows.
    Done {
        /// OpenAI's finish reason: `stop` or `length`.
        finish_reason: &'static str,
        /// Counts and timings (boxed: the other variants are small).
        usage: Box<Usage>,
        /// Prompt plus generated tokens with KV in the cache.
        tokens: Vec<u32>,
        /// The stop string that ended the text, if one did.
        stop_sequence: Option<String>,
        /// Each generated token's log-probabilities in OpenAI's chat shape
        /// ([`crate::logprobs::entry`]), when the sampling asked for them.
        logprobs: Option<Vec<serde_json::Value>>,
    },
    /// The request failed; nothing follows.
    Failed(Failure),
}

/// Holds back text that may be the start of a stop string.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    matched: Option<String>,
}

impl StopMatcher {
    /// A matcher for `stops` (non-empty strings).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            held: String::new(),
            matched: None,
        }
    }

    /// The stop string that was found, once one was.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Adds `text`; returns the text safe to emit, and whether a stop string was found
    /// (then the text before it is returned and the rest dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        if let Some((at, stop)) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|&(at, _)| at)
        {
            let out = self.held[..at].to_string();
            self.matched = Some(stop.clone());
            self.held.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if i > keep && self.held.ends_with(&s[..i]) {
                    keep = i;
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// Ends the text: whatever was held back is emitted.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateSpec {
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// Most new tokens.
    pub max_tokens: usize,
    /// Sampler settings.
    pub sampling: SamplingParams,
    /// Stop token ids.
    pub stop_tokens: Vec<u32>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// The engine session it continues, with its edits.
    pub session: Option<leyline_engine::SessionRequest>,
    /// Whose prefix cache it uses.
    pub tenant: leyline_engine::Tenant,
    /// Without a session: the cached conversation it may continue.
    pub implicit: Option<leyline_engine::ImplicitTurn>,
    /// The repair of the turn's AMORTIZE edits, if the request names one.
    pub repair: Option<leyline_core::Repair>,
}

/// Builds the engine request and the channel its pieces arrive on.
pub fn request(
    spec: GenerateSpec,
    tokenizer: Arc<Tokenizer>,
) -> (Request, mpsc::UnboundedReceiver<Piece>) {
    let (tx, rx) = mpsc::unbounded_channel();
    // The receiver goes when the client does (the handler or the stream task is dropped).
    let probe = tx.clone();
    let alive: leyline_engine::Liveness = Box::new(move || !probe.is_closed());
    let mut decoder = tokenizer.decode_stream(true);
    let mut matcher = StopMatcher::new(spec.stop);
    let mut stopped = false;
    let mut logprobs = spec.sampling.logprobs.map(|_| Vec::new());
    let sink = Box::new(move |event: Event| -> ControlFlow<()> {
        let send = |p: Piece| {
            if tx.send(p).is_ok() {
                ControlFlow::Continue(())
            } else {
                ControlFlow::Break(())
            }
        };
        match event {
            Event::Logprobs(lp) => {
                if let (Some(v), false) = (logprobs.as_mut(), stopped) {
                    v.push(crate::logprobs::entry(&lp, &tokenizer));
                }
                ControlFlow::Continue(())
            }
            Event::Token(t) => {
                if stopped {
                    return ControlFlow::Break(());
                }
                let text = match decoder.push(&tokenizer, &[t]) {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = tx.send(Piece::Failed(Failure::new(
                            ErrorKind::Internal,
                            format!("decoding token {t}: {e}"),
                        )));
                        stopped = true;
                        return ControlFlow::Break(());
                    }
                };
                let (out, hit) = matcher.push(&text);
                let flow = if out.is_empty() {
                    ControlFlow::Continue(())
                } else {
                    send(Piece::Text(out))
                };
                if hit {
                    stopped = true;
                    return ControlFlow::Break(());
                }
                flow
            }
            Event::Finished {
                reason,
                usage,
                tokens,
            } => {
                let finish_reason = if stopped { "stop" } else { reason.as_openai() };
                if !stopped {
                    let (mut out, hit) = matcher.push(&decoder.finish());
                    if !hit {
                        out.push_str(&matcher.finish());
                    }
                    if !out.is_empty() {
                        let _ = tx.send(Piece::Text(out));
                    }
                }
                let _ = tx.send(Piece::Done {
                    finish_reason,
                    usage: Box::new(usage),
                    tokens,
                    stop_sequence: matcher.matched().map(str::to_string),
                    logprobs: logprobs.take(),
                });
                ControlFlow::Break(())
            }
            Event::Failed(m) => {
                let _ = tx.send(Piece::Failed(m));
                ControlFlow::Break(())
            }
        }
    });
    let req = Request {
        prompt: spec.prompt,
        max_tokens: spec.max_tokens,
        sampling: spec.sampling,
        stop_tokens: spec.stop_tokens,
        session: spec.session,
        sink,
        alive: Some(alive),
        tenant: spec.tenant,
        implicit: spec.implicit,
        repair: spec.repair,
    };
    (req, rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (o, hit) = m.push(p);
            out.push_str(&o);
            if hit {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_string_split_across_pieces_is_cut() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "D more"]),
            ("abc ".to_string(), true)
        );
    }

    #[test]
    fn held_back_prefix_is_released_when_it_does_not_complete() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("xE"), ("x".to_string(), false));
        assert_eq!(m.push("NX"), ("ENX".to_string(), false));
        assert_eq!(run(&["END"], &["aE", "N"]), ("aEN".to_string(), false));
    }

    #[test]
    fn earliest_of_several_stops_wins_and_no_stops_pass_through() {
        assert_eq!(run(&["c", "b"], &["abcd"]), ("a".to_string(), true));
        let mut m = StopMatcher::new(vec!["c".into(), "b".into()]);
        m.push("abcd");
        assert_eq!(m.matched(), Some("b"));
        assert_eq!(run(&[], &["ab", "cd"]), ("abcd".to_string(), false));
        // Multi-byte characters are never split when holding back.
        assert_eq!(run(&["éx"], &["aé", "y"]), ("aéy".to_string(), false));
    }
}
