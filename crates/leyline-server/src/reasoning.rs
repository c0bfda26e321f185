//! Reasoning in generated text: models whose chat template knows `<think>` (Qwen3, QwQ,
//! DeepSeek-R1 distills) write their reasoning between `<think>` and `</think>` before the
//! answer, or, when the prompt already opened the block, from the first token on. The
//! reasoning is split out as it streams ([`Segment::Reasoning`]), so each API returns it in
//! its own form (thinking blocks, `reasoning_content`, reasoning items) and the answer is
//! only the answer. [`OutputSplitter`] chains this with the tool-call splitter, so every API
//! reads a generation's output through one object.

use crate::toolcall::{Segment, ToolCallSplitter};

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Where the reasoning splitter is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before any text: blank text is held until it shows whether `<think>` opens.
    Start,
    /// Inside the block.
    Thinking,
    /// After `</think>`: blank text is held until the answer starts (and dropped then).
    Closed,
    /// Plain answer text.
    Answer,
}

/// Splits the reasoning block at the start of an output from the answer after it.
#[derive(Debug)]
pub struct ThinkSplitter {
    state: State,
    held: String,
}

impl ThinkSplitter {
    /// A splitter for an output whose prompt ends inside an open `<think>` block (`open`),
    /// or that may open one itself.
    pub fn new(open: bool) -> Self {
        Self {
            state: if open { State::Thinking } else { State::Start },
            held: String::new(),
        }
    }

    /// Whether a prompt that ends with `tail` (its last few tokens, decoded) leaves a
    /// `<think>` block open for the output.
    pub fn opened_by(tail: &str) -> bool {
        match (tail.rfind(OPEN), tail.rfind(CLOSE)) {
            (Some(o), Some(c)) => o > c && tail[o + OPEN.len()..].trim().is_empty(),
            (Some(o), None) => tail[o + OPEN.len()..].trim().is_empty(),
            _ => false,
        }
    }

    /// Adds streamed text; returns what is certain: reasoning, then answer text.
    pub fn push(&mut self, text: &str) -> Vec<Segment> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Thinking;
                    } else if OPEN.starts_with(t) {
                        // Blank, or a prefix of `<think>`: wait.
                        return out;
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Thinking => {
                    if let Some(at) = self.held.find(CLOSE) {
                        let rest = self.held.split_off(at);
                        push_reasoning(&mut out, std::mem::take(&mut self.held));
                        self.held = rest[CLOSE.len()..].to_string();
                        self.state = State::Closed;
                    } else {
                        // Keep a tail that may be the start of `</think>`.
                        let keep = partial_suffix(&self.held, CLOSE);
                        let rest = self.held.split_off(self.held.len() - keep);
                        push_reasoning(&mut out, std::mem::replace(&mut self.held, rest));
                        return out;
                    }
                }
                State::Closed => {
                    if self.held.trim_start().is_empty() {
                        return out;
                    }
                    self.held = self.held.trim_start().to_string();
                    self.state = State::Answer;
                }
                State::Answer => {
                    if !self.held.is_empty() {
                        out.push(Segment::Text(std::mem::take(&mut self.held)));
                    }
                    return out;
                }
            }
        }
    }

    /// The rest at the end of the output: an unclosed block's reasoning (the output was cut
    /// off while thinking), or held text as the answer.
    pub fn finish(&mut self) -> Vec<Segment> {
        let held = std::mem::take(&mut self.held);
        let mut out = Vec::new();
        match self.state {
            State::Thinking => push_reasoning(&mut out, held),
            State::Start | State::Answer if !held.is_empty() => out.push(Segment::Text(held)),
            _ => {}
        }
        out
    }
}

fn push_reasoning(out: &mut Vec<Segment>, t: String) {
    if !t.is_empty() {
        out.push(Segment::Reasoning(t));
    }
}

/// The length of the longest suffix of `s` that is a proper prefix of `tag`.
fn partial_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

/// A generation's output read as the APIs answer it: the reasoning block split out (for a
/// model that reasons), then tool calls split from the answer (when tools were offered).
#[derive(Debug)]
pub struct OutputSplitter {
    think: Option<ThinkSplitter>,
    calls: Option<ToolCallSplitter>,
}

impl OutputSplitter {
    /// A splitter for an output: `tool_names` of the offered tools (`None`: no tools, no
    /// calls), `think` for a model that reasons (whether the prompt left a block open).
    pub fn new(tool_names: Option<Vec<String>>, think: Option<bool>) -> Self {
        Self {
            think: think.map(ThinkSplitter::new),
            calls: tool_names.map(ToolCallSplitter::with_tools),
        }
    }

    /// Adds streamed text; returns the segments that are certain.
    pub fn push(&mut self, text: &str) -> Vec<Segment> {
        let first = match &mut self.think {
            Some(t) => t.push(text),
            None => vec![Segment::Text(text.to_string())],
        };
        self.calls_of(first, false)
    }

    /// The rest at the end of the output.
    pub fn finish(&mut self) -> Vec<Segment> {
        let first = match &mut self.think {
            Some(t) => t.finish(),
            None => Vec::new(),
        };
        self.calls_of(first, true)
    }

    /// A whole output split at once.
    pub fn split(text: &str, tool_names: Option<Vec<String>>, think: Option<bool>) -> Vec<Segment> {
        let mut s = Self::new(tool_names, think);
        let mut out = s.push(text);
        out.extend(s.finish());
        crate::toolcall::merge_text(out)
    }

    fn calls_of(&mut self, segments: Vec<Segment>, finish: bool) -> Vec<Segment> {
        let mut out = Vec::with_capacity(segments.len());
        for s in segments {
            match (s, &mut self.calls) {
                (Segment::Text(t), Some(c)) => out.extend(c.push(&t)),
                (s, _) => out.push(s),
            }
        }
        if finish {
            if let Some(c) = &mut self.calls {
                out.extend(c.finish());
            }
        }
        out.retain(|s| !matches!(s, Segment::Text(t) if t.is_empty()));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn reasoning(t: &str) -> Segment {
        Segment::Reasoning(t.into())
    }

    fn text(t: &str) -> Segment {
        Segment::Text(t.into())
    }

    /// Every way of cutting `s` into streamed pieces gives the whole split's segments.
    fn streamed(s: &str, names: Option<Vec<String>>, think: Option<bool>) -> Vec<Segment> {
        let whole = OutputSplitter::split(s, names.clone(), think);
        for cut in 1..=s.len() {
            let mut sp = OutputSplitter::new(names.clone(), think);
            let mut out = Vec::new();
            let mut rest = s;
            while !rest.is_empty() {
                let mut n = cut.min(rest.len());
                while !rest.is_char_boundary(n) {
                    n += 1;
                }
                out.extend(sp.push(&rest[..n]));
                rest = &rest[n..];
            }
            out.extend(sp.finish());
            assert_eq!(
                crate::toolcall::merge_text(out),
                whole,
                "{s:?} cut every {cut}"
            );
        }
        whole
    }

    #[test]
    fn a_think_block_is_reasoning_and_the_rest_is_the_answer() {
        assert_eq!(
            streamed(
                "<think>\nTwo apples, one eaten.\n</think>\n\nOne apple.",
                None,
                Some(false)
            ),
            vec![reasoning("\nTwo apples, one eaten.\n"), text("One apple.")]
        );
        // The prompt opened the block (Qwen3-2507 thinking models).
        assert_eq!(
            streamed("Hmm, 2 - 1 = 1 ✓.</think>\n\n1", None, Some(true)),
            vec![reasoning("Hmm, 2 - 1 = 1 ✓."), text("1")]
        );
        // No block: all answer; a `<think>` later in the answer is text.
        assert_eq!(
            streamed("The tag <think> is Qwen's.", None, Some(false)),
            vec![text("The tag <think> is Qwen's.")]
        );
        // An empty block (thinking switched off) leaves no reasoning.
        assert_eq!(
            streamed("<think>\n\n</think>\n\nHi", None, Some(false)),
            vec![reasoning("\n\n"), text("Hi")]
        );
        // Cut off while thinking: all reasoning, no answer.
        assert_eq!(
            streamed("<think>still going", None, Some(false)),
            vec![reasoning("still going")]
        );
        // A model that does not reason keeps its text as it is.
        assert_eq!(
            streamed("<think>x</think>y", None, None),
            vec![text("<think>x</think>y")]
        );
    }

    #[test]
    fn reasoning_then_a_tool_call() {
        let names = Some(vec!["read_file".to_string()]);
        let out = streamed(
            "<think>I need the file.</think>\n\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a.rs\"}}\n</tool_call>",
            names,
            Some(false),
        );
        assert_eq!(
            out,
            vec![
                reasoning("I need the file."),
                Segment::Call {
                    name: "read_file".into(),
                    arguments: json!({"path": "a.rs"})
                }
            ]
        );
    }

    #[test]
    fn a_prompt_tail_tells_whether_a_block_is_open() {
        assert!(ThinkSplitter::opened_by("<|im_start|>assistant\n<think>\n"));
        assert!(!ThinkSplitter::opened_by(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!ThinkSplitter::opened_by("<|im_start|>assistant\n"));
        assert!(!ThinkSplitter::opened_by("<think>\nsome text"));
    }
}
