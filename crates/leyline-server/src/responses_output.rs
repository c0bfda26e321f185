//! The output side of `POST /v1/responses`: output items built from the generated segments,
//! the stream events that announce them (OpenAI's names, numbered), `usage`, and the
//! response object before any output.
//!
//! Design decision: one builder ([`Output`]) serves both answers: a stream sends its events
//! as they come, a whole answer feeds it every segment at once and keeps only the items, so
//! the two cannot disagree on the output.

use crate::responses::{ResponsesRequest, Tools};
use crate::toolcall::Segment;
use serde_json::{json, Value};

fn new_id(prefix: &str) -> String {
    format!("{prefix}_{:024x}", rand::random::<u128>() >> 32)
}

/// A new response id (`resp_...`).
pub fn response_id() -> String {
    new_id("resp")
}

/// The reasoning item being written.
#[derive(Debug)]
struct OpenReasoning {
    index: usize,
    id: String,
    text: String,
}

/// The message item being written.
#[derive(Debug)]
struct OpenMessage {
    index: usize,
    id: String,
    text: String,
}

/// Builds a response's output items from generated segments, and the stream events that
/// announce them (numbered from the events already built): text goes into a message item
/// (opened by its first non-blank text, so blank text around tool calls makes none), each
/// call becomes a `function_call` item, reasoning a `reasoning` item (its text as
/// `reasoning_text` content, as open-weight servers write it; no summary).
#[derive(Debug, Default)]
pub struct Output {
    items: Vec<Value>,
    thinking: Option<OpenReasoning>,
    open: Option<OpenMessage>,
    /// Blank text not yet in a message.
    blank: String,
    seq: u64,
    events: Vec<Value>,
}

impl Output {
    /// A stream event of `kind` with the next sequence number.
    pub fn event(&mut self, kind: &str, mut body: Value) -> Value {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.seq);
        self.seq += 1;
        body
    }

    fn emit(&mut self, kind: &str, body: Value) {
        let e = self.event(kind, body);
        self.events.push(e);
    }

    /// Adds a segment.
    pub fn push(&mut self, s: Segment) {
        if !matches!(s, Segment::Reasoning(_)) {
            self.close_reasoning("completed");
        }
        match s {
            Segment::Text(t) => self.text(t),
            Segment::Reasoning(t) => self.reasoning(t),
            Segment::Call { name, arguments } => {
                self.close_message("completed");
                self.blank.clear();
                let index = self.items.len();
                let id = new_id("fc");
                let call_id = new_id("call");
                let arguments = arguments.to_string();
                let mut item = json!({
                    "type": "function_call", "id": id, "call_id": call_id, "name": name,
                    "arguments": "", "status": "in_progress",
                });
                self.emit(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                );
                self.emit(
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": index, "delta": arguments}),
                );
                self.emit(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "name": name, "arguments": arguments}),
                );
                item["arguments"] = json!(arguments);
                item["status"] = json!("completed");
                self.emit(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                );
                self.items.push(item);
            }
        }
    }

    fn reasoning(&mut self, t: String) {
        self.close_message("completed");
        let r = match &mut self.thinking {
            Some(r) => r,
            None => {
                let r = OpenReasoning {
                    index: self.items.len(),
                    id: new_id("rs"),
                    text: String::new(),
                };
                self.emit(
                    "response.output_item.added",
                    json!({"output_index": r.index, "item": {
                        "type": "reasoning", "id": r.id, "summary": [], "content": [],
                    }}),
                );
                self.emit(
                    "response.content_part.added",
                    json!({"item_id": r.id, "output_index": r.index, "content_index": 0,
                           "part": {"type": "reasoning_text", "text": ""}}),
                );
                self.thinking.insert(r)
            }
        };
        r.text.push_str(&t);
        let body =
            json!({"item_id": r.id, "output_index": r.index, "content_index": 0, "delta": t});
        self.emit("response.reasoning_text.delta", body);
    }

    fn close_reasoning(&mut self, status: &str) {
        let Some(r) = self.thinking.take() else {
            return;
        };
        let part = json!({"type": "reasoning_text", "text": r.text});
        self.emit(
            "response.reasoning_text.done",
            json!({"item_id": r.id, "output_index": r.index, "content_index": 0, "text": r.text}),
        );
        self.emit(
            "response.content_part.done",
            json!({"item_id": r.id, "output_index": r.index, "content_index": 0, "part": part}),
        );
        let item = json!({"type": "reasoning", "id": r.id, "summary": [], "content": [part], "status": status});
        self.emit(
            "response.output_item.done",
            json!({"output_index": r.index, "item": item}),
        );
        self.items.push(item);
    }

    fn text(&mut self, t: String) {
        if self.open.is_none() {
            if t.trim().is_empty() {
                self.blank.push_str(&t);
                return;
            }
            self.open_message();
        }
        let delta = std::mem::take(&mut self.blank) + &t;
        if let Some(m) = &mut self.open {
            m.text.push_str(&delta);
            let body = json!({"item_id": m.id, "output_index": m.index, "content_index": 0, "delta": delta, "logprobs": []});
            self.emit("response.output_text.delta", body);
        }
    }

    fn open_message(&mut self) {
        let m = OpenMessage {
            index: self.items.len(),
            id: new_id("msg"),
            text: String::new(),
        };
        self.emit(
            "response.output_item.added",
            json!({"output_index": m.index, "item": {
                "type": "message", "id": m.id, "status": "in_progress", "role": "assistant", "content": [],
            }}),
        );
        self.emit(
            "response.content_part.added",
            json!({"item_id": m.id, "output_index": m.index, "content_index": 0,
                   "part": {"type": "output_text", "text": "", "annotations": []}}),
        );
        self.open = Some(m);
    }

    fn close_message(&mut self, status: &str) {
        let Some(m) = self.open.take() else { return };
        let part = json!({"type": "output_text", "text": m.text, "annotations": []});
        self.emit(
            "response.output_text.done",
            json!({"item_id": m.id, "output_index": m.index, "content_index": 0, "text": m.text, "logprobs": []}),
        );
        self.emit(
            "response.content_part.done",
            json!({"item_id": m.id, "output_index": m.index, "content_index": 0, "part": part}),
        );
        let item = json!({"type": "message", "id": m.id, "status": status, "role": "assistant", "content": [part]});
        self.emit(
            "response.output_item.done",
            json!({"output_index": m.index, "item": item}),
        );
        self.items.push(item);
    }

    /// Ends the output: the open message closes (`incomplete` when the generation hit its
    /// token limit); a reply with no item at all becomes one message (its text may be blank).
    pub fn finish(&mut self, incomplete: bool) {
        let status = if incomplete {
            "incomplete"
        } else {
            "completed"
        };
        self.close_reasoning(status);
        if self.items.is_empty() && self.open.is_none() {
            self.open_message();
            let blank = std::mem::take(&mut self.blank);
            if !blank.is_empty() {
                self.text(blank);
            }
        }
        self.close_message(status);
    }

    /// The events built since the last call.
    pub fn take_events(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.events)
    }

    /// The finished items.
    pub fn items(&self) -> &[Value] {
        &self.items
    }
}

/// The response's `usage`.
pub fn usage(u: &leyline_engine::Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

impl ResponsesRequest {
    /// The response object before any output: `in_progress`, with the request's settings
    /// echoed.
    pub fn skeleton(&self, id: &str, model: &str, tools: &Tools, stored: bool) -> Value {
        let created_at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        json!({
            "id": id,
            "object": "response",
            "created_at": created_at,
            "status": "in_progress",
            "model": model,
            "output": [],
            "usage": null,
            "error": null,
            "incomplete_details": null,
            "instructions": self.instructions,
            "metadata": self.metadata.clone().unwrap_or_else(|| json!({})),
            "parallel_tool_calls": self.parallel_tool_calls,
            "temperature": self.temperature.unwrap_or(1.0),
            "top_p": self.top_p.unwrap_or(1.0),
            "max_output_tokens": self.max_output_tokens,
            "previous_response_id": self.previous_response_id,
            "prompt_cache_key": self.prompt_cache_key,
            "store": stored,
            "tool_choice": self.tool_choice.as_str(),
            "tools": tools.echoed,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "reasoning": null,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::responses::input_to_chat;

    fn kinds(events: &[Value]) -> Vec<&str> {
        events.iter().map(|e| e["type"].as_str().unwrap()).collect()
    }

    #[test]
    fn output_items_and_events_follow_the_segments() {
        let mut o = Output::default();
        o.push(Segment::Text("Let me ".into()));
        o.push(Segment::Text("check.".into()));
        o.push(Segment::Call {
            name: "get_weather".into(),
            arguments: json!({"city": "Paris"}),
        });
        // Blank text between and after calls makes no message.
        o.push(Segment::Text("\n".into()));
        o.finish(false);
        let events = o.take_events();
        assert_eq!(
            kinds(&events),
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
        );
        let seqs: Vec<u64> = events
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(seqs, (0..11).collect::<Vec<_>>());
        let items = o.items();
        assert_eq!(items.len(), 2);
        assert_eq!(items[0]["content"][0]["text"], "Let me check.");
        assert_eq!(items[1]["type"], "function_call");
        assert_eq!(items[1]["arguments"], "{\"city\":\"Paris\"}");
        assert!(items[1]["call_id"].as_str().unwrap().starts_with("call_"));
        // Output items are input items: the stored conversation converts the same way.
        let chat = input_to_chat(&Value::Array(items.to_vec())).unwrap();
        assert_eq!(chat.len(), 1);
        assert_eq!(chat[0].content.as_deref(), Some("Let me check."));
        assert_eq!(chat[0].tool_calls.as_ref().unwrap().len(), 1);
    }

    #[test]
    fn an_empty_or_cut_reply_is_one_message() {
        let mut o = Output::default();
        o.push(Segment::Text(" ".into()));
        o.finish(true);
        assert_eq!(o.items().len(), 1);
        assert_eq!(o.items()[0]["status"], "incomplete");
        assert_eq!(o.items()[0]["content"][0]["text"], " ");
        let mut e = Output::default();
        e.finish(false);
        assert_eq!(e.items()[0]["content"][0]["text"], "");
        assert_eq!(e.items()[0]["status"], "completed");
    }
}
