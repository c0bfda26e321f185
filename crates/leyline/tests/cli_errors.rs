//! Bad input to the `leyline` binary: each case is a one-line error and a non-zero exit,
//! never a panic.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn leyline(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_leyline"))
        .args(args)
        .output()
        .expect("run the leyline binary")
}

/// A fresh directory, removed with everything in it when the returned guard drops.
fn scratch_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("leyline-cli-")
        .tempdir()
        .expect("create a scratch directory")
}

/// Asserts a clean failure: non-zero exit, no panic, one line on stderr containing `want`.
fn assert_one_line_error(out: &Output, want: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "exit 0; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "expected one error line, got: {stderr}");
    for w in want {
        assert!(lines[0].contains(w), "{:?} lacks {w:?}", lines[0]);
    }
}

fn default_model() -> PathBuf {
    leyline_hub::default_model_path().expect("fetch the default model")
}

#[test]
fn missing_model_file() {
    let out = leyline(&[
        "run",
        "--prompt",
        "hi",
        "--model",
        "/nonexistent/model.gguf",
    ]);
    assert_one_line_error(&out, &["/nonexistent/model.gguf", "cannot open"]);
}

#[test]
fn truncated_gguf() {
    let bytes = std::fs::read(default_model()).unwrap();
    let dir = scratch_dir();
    let path = dir.path().join("truncated.gguf");
    std::fs::write(&path, &bytes[..bytes.len() / 3]).unwrap();
    let out = leyline(&["run", "--prompt", "hi", "--model", path.to_str().unwrap()]);
    assert_one_line_error(&out, &["truncated.gguf", "truncated"]);
}

#[test]
fn not_a_gguf() {
    let dir = scratch_dir();
    let path = dir.path().join("garbage.gguf");
    std::fs::write(&path, b"this is not a model").unwrap();
    let out = leyline(&["run", "--prompt", "hi", "--model", path.to_str().unwrap()]);
    assert_one_line_error(&out, &["garbage.gguf", "GGUF"]);
}

fn write_gguf(path: &Path, arch: &str) {
    let t = Tensor::zeros((32, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, GgmlDType::F32).unwrap();
    let arch = Value::String(arch.to_string());
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(
        &mut f,
        &[("general.architecture", &arch)],
        &[("token_embd.weight", &q)],
    )
    .unwrap();
}

#[test]
fn unsupported_architecture() {
    let dir = scratch_dir();
    let path = dir.path().join("gpt2.gguf");
    write_gguf(&path, "gpt2");
    let out = leyline(&["run", "--prompt", "hi", "--model", path.to_str().unwrap()]);
    assert_one_line_error(&out, &["gpt2.gguf", "unsupported", "gpt2"]);
}

#[test]
fn empty_prompt() {
    let out = leyline(&["run", "--prompt", ""]);
    assert_one_line_error(&out, &["prompt is empty"]);
}

#[test]
fn prompt_longer_than_the_context() {
    let long = "word ".repeat(400);
    let out = leyline(&["run", "--prompt", &long, "--kv-slots", "128"]);
    assert_one_line_error(&out, &["tokens", "context"]);
}

#[test]
fn bad_sampling_values() {
    let out = leyline(&["run", "--prompt", "hi", "--temperature=-1"]);
    assert_one_line_error(&out, &["temperature"]);
    // A negative number after a space is the value, not an unknown flag.
    let out = leyline(&["run", "--prompt", "hi", "--temperature", "-1"]);
    assert_one_line_error(&out, &["temperature must be"]);
    let out = leyline(&["run", "--prompt", "hi", "--max-tokens", "0"]);
    assert_one_line_error(&out, &["--max-tokens", "at least 1"]);
}

#[test]
fn a_good_run_says_paris() {
    let out = leyline(&[
        "run",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Paris"), "{text}");
}

#[test]
fn unknown_model_name_lists_the_known_ones() {
    let out = leyline(&["run", "--prompt", "hi", "--model", "qwen-9000"]);
    assert_one_line_error(
        &out,
        &[
            "qwen-9000",
            "cannot open",
            "known models: smollm2-135m, qwen2.5-coder-0.5b",
        ],
    );
}

/// `--model NAME` of a known model loads its cached file: the same run as the default's.
#[test]
fn a_registry_name_is_a_model() {
    default_model();
    let out = leyline(&[
        "run",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
        "--model",
        "smollm2-135m",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("Paris"));
}

fn mla_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../leyline-model/tests/fixtures/mla")
        .join(name)
}

#[test]
fn checkpoint_directory_has_no_tokenizer() {
    let dir = mla_fixture("plain");
    let d = dir.to_str().unwrap();
    let out = leyline(&["run", "--model", d, "--prompt", "hi"]);
    assert_one_line_error(&out, &[d, "has no tokenizer; this command needs one"]);
    let out = leyline(&["bench", "splice", "--model", d]);
    assert_one_line_error(&out, &[d, "has no tokenizer"]);
    // verify takes the directory, but not with probes that need a chat template.
    let out = leyline(&["verify", "--model", d, "--probe-source", "traces"]);
    assert_one_line_error(&out, &[d, "has no tokenizer"]);
}

#[test]
fn directory_that_is_not_a_checkpoint() {
    let dir = scratch_dir();
    let empty = dir.path().join("empty-dir");
    std::fs::create_dir_all(&empty).unwrap();
    let e = empty.to_str().unwrap();
    for args in [&["run", "--prompt", "hi"][..], &["verify"]] {
        let out = leyline(&[args, &["--model", e]].concat());
        assert_one_line_error(&out, &[e, "no config.json"]);
    }
    let llama = dir.path().join("llama-dir");
    std::fs::create_dir_all(&llama).unwrap();
    std::fs::write(
        llama.join("config.json"),
        r#"{"model_type": "llama", "num_hidden_layers": 2}"#,
    )
    .unwrap();
    let out = leyline(&["verify", "--model", llama.to_str().unwrap()]);
    assert_one_line_error(&out, &["llama-dir", "config.json", "unsupported", "llama"]);
}

#[test]
fn serve_takes_its_valued_flags_and_names_a_bad_value() {
    // Good values parse: the run gets as far as the model, which does not exist.
    let good = leyline(&[
        "serve",
        "--implicit-splices",
        "off",
        "--repair",
        "before_end:8",
        "--model",
        "/nonexistent/model.gguf",
    ]);
    assert_one_line_error(&good, &["/nonexistent/model.gguf"]);
    for (flag, value, want) in [
        ("--implicit-splices", "true", "on or off"),
        ("--repair", "sideways:3", "unknown repair rule"),
        ("--repair", "lots", "not a token count"),
    ] {
        let out = leyline(&["serve", flag, value, "--model", "/nonexistent/model.gguf"]);
        assert_one_line_error(&out, &[flag, want]);
    }
}
