//! Log-probabilities of generated tokens on the wire: OpenAI's chat shape (`logprobs.content`,
//! also what `leyline.logprobs` carries in every API) and the legacy completions shape.
//!
//! The engine reports each token's log-probability under the model's own distribution
//! (softmax of the raw logits, before temperature, top-k and top-p), as OpenAI does.

use leyline_engine::TokenLogprobs;
use leyline_model::tokenizer::Tokenizer;
use serde_json::{json, Value};

/// Most alternatives a request may ask for per token (OpenAI's bound on `top_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A token as OpenAI names it: its text (bytes that are part of a character shown as
/// U+FFFD) and its raw bytes.
fn token(id: u32, tok: &Tokenizer) -> (String, Vec<u8>) {
    let bytes = tok.token_bytes(id).unwrap_or_default().to_vec();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// A log-probability as JSON: a number, or -9999 for probability 0 (JSON has no -inf;
/// OpenAI uses the same floor).
fn number(lp: f32) -> Value {
    if lp.is_finite() {
        json!(lp)
    } else {
        json!(-9999.0)
    }
}

/// One generated token's entry of `logprobs.content`: `token`, `logprob`, `bytes`,
/// `top_logprobs`.
pub fn entry(lp: &TokenLogprobs, tok: &Tokenizer) -> Value {
    let (text, bytes) = token(lp.token, tok);
    let top: Vec<Value> = lp
        .top
        .iter()
        .map(|&(id, l)| {
            let (text, bytes) = token(id, tok);
            json!({"token": text, "logprob": number(l), "bytes": bytes})
        })
        .collect();
    json!({"token": text, "logprob": number(lp.logprob), "bytes": bytes, "top_logprobs": top})
}

/// The legacy completions shape of chat entries: `tokens`, `token_logprobs`,
/// `top_logprobs` (one object per token, text to log-probability) and `text_offset`
/// (character offsets into the generated text).
pub fn legacy(entries: &[Value]) -> Value {
    let mut offset = 0usize;
    let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for e in entries {
        let text = e["token"].as_str().unwrap_or_default();
        offsets.push(offset);
        offset += text.chars().count();
        tokens.push(json!(text));
        lps.push(e["logprob"].clone());
        let top: serde_json::Map<String, Value> = e["top_logprobs"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                let k = t["token"].as_str().unwrap_or_default().to_string();
                (k, t["logprob"].clone())
            })
            .collect();
        tops.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_shape_follows_the_entries() {
        let entries = vec![
            json!({"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                   "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                                    {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]}]}),
            json!({"token": " there", "logprob": -9999.0, "bytes": [], "top_logprobs": []}),
        ];
        let l = legacy(&entries);
        assert_eq!(l["tokens"], json!(["Hi", " there"]));
        assert_eq!(l["token_logprobs"], json!([-0.5, -9999.0]));
        assert_eq!(l["top_logprobs"][0]["Yo"], json!(-1.5));
        assert_eq!(l["text_offset"], json!([0, 2]));
        assert_eq!(number(f32::NEG_INFINITY), json!(-9999.0));
    }
}
