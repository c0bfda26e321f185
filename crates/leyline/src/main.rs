//! `leyline`: the command line of the Leyline serving engine.

mod bench;
mod bench_bandwidth;
mod bench_batch;
mod bench_policy;
mod bench_splice;
mod eval;
mod replay;
mod serve;
mod verify;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use leyline_engine::{generate, generate_after, reusable_prefix, GenerateParams, SamplingParams};
use leyline_hub::FetchEvent;
use leyline_kv::{KvDtype, KvStorage};
use leyline_model::chat::ChatMessage;
use leyline_model::{AnyModel, LoadedModel};
use std::io::{BufRead, Write};
use std::ops::ControlFlow;
use std::path::PathBuf;

/// Leyline: an LLM serving engine whose KV cache takes directives.
#[derive(Parser)]
#[command(name = "leyline", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Complete a raw prompt (no chat template) and stream the tokens.
    Run(RunArgs),
    /// Talk to the model interactively (chat template applied); empty line or Ctrl-D ends.
    Chat(ChatArgs),
    /// Serve the OpenAI-compatible HTTP API (sessions, directives, SSE, /metrics).
    Serve(serve::ServeArgs),
    /// Manage models: fetch a known model (default: the default model), list known ones.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Fidelity report: AMORTIZE vs. full context and FORGET, and key drift of chained splices.
    Verify(verify::VerifyArgs),
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Download, verify (sha256) and cache a known model under $LEYLINE_HOME/models.
    Fetch {
        /// Model name.
        #[arg(default_value = leyline_hub::DEFAULT_MODEL)]
        name: String,
        /// Download again even if the model is cached.
        #[arg(long)]
        force: bool,
    },
    /// List the models `fetch` knows and whether they are cached.
    List,
}

/// Options shared by every command that loads a model.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// A known model's name (`leyline model list`; fetched on first use), a local GGUF
    /// file (architectures llama, qwen2, qwen3, qwen3moe, gemma3, olmo2), or a DeepSeek-V2
    /// checkpoint directory (config.json + safetensors; it has no tokenizer, so only `verify`
    /// takes it). A name wins over a file of the same name: write ./NAME for the file.
    /// Default: smollm2-135m.
    #[arg(long, short = 'm', env = "LEYLINE_MODEL")]
    pub model: Option<PathBuf>,
    /// KV cache storage type: f16, bf16 or f32 (exact, twice the memory).
    #[arg(long, default_value_t = leyline_engine::DEFAULT_KV_DTYPE)]
    pub kv_dtype: KvDtype,
    /// KV pool size in slots (tokens); default: the model's context length (`serve`: four
    /// times that, room for several sessions).
    #[arg(long)]
    pub kv_slots: Option<usize>,
    /// Quantized products read their activations in f32 (weights dequantized in registers,
    /// prompts through an f32 gemm) instead of rounded to 8 bits per block (the default, as
    /// llama.cpp does, multiplied in integer dot products). A reference path for comparisons:
    /// slower decode, and a sequence may compute other bits batched than alone
    #[arg(long)]
    pub f32_activations: bool,
}

/// How AMORTIZE splices move the keys after an edit (`serve`, `verify`, `bench
/// splice|replay`).
#[derive(Args, Clone, Copy)]
pub struct RotationArgs {
    /// `eager`: rotate every downstream key in storage to its new position (copying slots
    /// shared with the prefix cache or another conversation first). `lazy`: leave the keys
    /// where they are and let attention rotate the query by each run's offset: a splice
    /// copies and rotates nothing, and the original and the edited conversation share every
    /// unchanged slot
    #[arg(long, default_value_t = leyline_kv::shift::RotationMode::Eager)]
    pub rotation: leyline_kv::shift::RotationMode,
    /// With `--rotation lazy`: the most runs of distinct offset a conversation may hold after
    /// a splice; one more and it is compacted (its keys rotated in storage, as eager does),
    /// so attention never cuts its keys at more places (0: never compact)
    #[arg(long, default_value_t = leyline_engine::DEFAULT_MAX_SEGMENTS)]
    pub max_segments: usize,
    /// A replacement's runs of at least this many tokens that repeat tokens the conversation
    /// holds (a message the client moved, a summary the model wrote) take a copy of those
    /// tokens' KV, rotated to the new place, instead of being prefilled; the copies keep
    /// what they attended to where they were, as downstream tokens do. 0 (the default)
    /// prefills every replacement: the copies cost next-token agreement with FORGET on
    /// `verify --moves` (BENCHMARKS.md, "Moved messages"); 8 takes a message's text and
    /// leaves a template's framing alone
    #[arg(long, default_value_t = leyline_engine::DEFAULT_REUSE_MIN_TOKENS)]
    pub reuse_min_tokens: usize,
}

impl RotationArgs {
    /// `cfg` with these settings.
    pub fn apply(&self, cfg: leyline_engine::EngineConfig) -> leyline_engine::EngineConfig {
        leyline_engine::EngineConfig {
            rotation: self.rotation,
            reuse_min_tokens: self.reuse_min_tokens,
            max_segments: if self.max_segments == 0 {
                usize::MAX
            } else {
                self.max_segments
            },
            ..cfg
        }
    }
}

/// The compute threads of a measuring command (`verify`, `bench engine|splice|replay`).
#[derive(Args, Clone, Copy)]
pub struct ThreadsArgs {
    /// Worker threads (sizes the compute thread pools before the model loads).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
}

impl ThreadsArgs {
    /// Sizes the process's compute pools to `--threads`; call before the model loads.
    pub fn init(&self) -> Result<()> {
        leyline_kernels::pool::init_threads(self.threads)?;
        Ok(())
    }
}

/// The compute threads of a serving command (`run`, `chat`, `serve`).
#[derive(Args, Clone, Copy)]
pub struct ServeThreadsArgs {
    /// Compute threads for the model's kernels (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

impl ServeThreadsArgs {
    /// Sizes the process's compute pools to `--threads`; call before the model loads.
    pub fn init(&self) -> Result<()> {
        leyline_kernels::pool::init_threads(self.threads)?;
        Ok(())
    }
}

#[derive(Args, Clone)]
struct SamplingArgs {
    /// Most tokens to generate (at least 1).
    #[arg(long, short = 'n', default_value_t = 128, value_parser = at_least_one)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(
        long,
        short = 't',
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// A count that must be positive, as the HTTP API requires of `max_tokens`.
fn at_least_one(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Args)]
struct RunArgs {
    /// The prompt text.
    #[arg(long, short = 'p')]
    prompt: String,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    threads: ServeThreadsArgs,
    /// Print timing and throughput to stderr at the end.
    #[arg(long)]
    stats: bool,
}

#[derive(Args)]
struct ChatArgs {
    /// System prompt (default: the template's own).
    #[arg(long)]
    system: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    threads: ServeThreadsArgs,
}

fn main() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LEYLINE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Err(e) = dispatch(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn dispatch(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Run(a) => run(a),
        Command::Chat(a) => chat(a),
        Command::Serve(a) => serve::run(a),
        Command::Model(ModelCommand::Fetch { name, force }) => {
            let m = leyline_hub::known_model(&name)?;
            let path = leyline_hub::cached_path(m);
            if path.is_file() && !force {
                println!("{} is cached at {}", m.name, path.display());
                return Ok(());
            }
            let path = fetch_with_progress(m)?;
            println!("{} verified and cached at {}", m.name, path.display());
            Ok(())
        }
        Command::Model(ModelCommand::List) => {
            for m in leyline_hub::KNOWN_MODELS {
                let p = leyline_hub::cached_path(m);
                let state = if p.is_file() {
                    p.display().to_string()
                } else {
                    "not fetched".into()
                };
                println!("{:<20} {}  [{}]", m.name, m.description, state);
            }
            Ok(())
        }
        Command::Bench(b) => bench::run(b),
        Command::Verify(a) => verify::run(a),
    }
}

fn fetch_with_progress(m: &leyline_hub::KnownModel) -> Result<PathBuf> {
    let bar = ProgressBar::new_spinner();
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    // Without a terminal the bar draws nothing: each stage is then one line, for logs.
    let lines = bar.is_hidden();
    let path = leyline_hub::fetch(m, &mut |e| match e {
        FetchEvent::Stage { name, total } => {
            if lines {
                eprintln!("leyline: {name}");
            }
            match total {
                Some(t) => {
                    bar.set_length(t);
                    bar.set_position(0);
                    bar.set_style(
                        ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes}")
                            .unwrap_or_else(|_| ProgressStyle::default_bar()),
                    );
                }
                None => bar.set_style(ProgressStyle::default_spinner()),
            }
            bar.set_message(name);
        }
        FetchEvent::Progress { done } => bar.set_position(done),
        FetchEvent::Finished => bar.finish_and_clear(),
    });
    bar.finish_and_clear();
    Ok(path?)
}

/// Resolves `--model` or the default model (fetching it on first use) and loads it with its
/// tokenizer; a checkpoint directory (no tokenizer) is a one-line error.
pub fn load_model(args: &ModelArgs) -> Result<LoadedModel> {
    set_activations(args);
    Ok(leyline_model::load_with_tokenizer(&model_path(args)?)?)
}

/// Resolves `--model` like [`load_model`] and loads whatever it names: a GGUF file with its
/// tokenizer, or a DeepSeek-V2 checkpoint directory without one.
pub fn load_any_model(args: &ModelArgs) -> Result<AnyModel> {
    set_activations(args);
    Ok(leyline_model::load_model_path(&model_path(args)?)?)
}

/// The activations every quantized product reads, from `--f32-activations`.
fn set_activations(args: &ModelArgs) {
    use leyline_kernels::qmatmul::{set_activations, Activations};
    set_activations(if args.f32_activations {
        Activations::F32
    } else {
        Activations::Int8
    });
}

/// `--model`, or the default model's cached file (fetched on first use).
fn model_path(args: &ModelArgs) -> Result<PathBuf> {
    resolve_model(args.model.as_deref())
}

/// A `--model` value as a path: a known model's name becomes its cached file, fetched with
/// progress on first use; an existing path is itself; `None` is the default model. Anything
/// else is a one-line error listing the known names.
pub fn resolve_model(value: Option<&std::path::Path>) -> Result<PathBuf> {
    let m = match value {
        None => leyline_hub::known_model(leyline_hub::DEFAULT_MODEL)?,
        Some(v) => match leyline_hub::model_ref(v)? {
            leyline_hub::ModelRef::Path(p) => return Ok(p),
            leyline_hub::ModelRef::Known(m) => m,
        },
    };
    let p = leyline_hub::cached_path(m);
    if p.is_file() {
        return Ok(p);
    }
    eprintln!("leyline: fetching {} (first use)", m.name);
    fetch_with_progress(m)
}

/// Storage for one sequence of the loaded model.
pub fn storage_for(lm: &LoadedModel, args: &ModelArgs) -> Result<KvStorage> {
    let info = lm.model.info();
    let slots = args.kv_slots.unwrap_or(info.context_length);
    Ok(KvStorage::new(info.geometry, args.kv_dtype, slots)?)
}

fn params(s: &SamplingArgs, lm: &LoadedModel) -> Result<GenerateParams> {
    let sampling = SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        seed: s.seed,
        logprobs: None,
    };
    if let Err(e) = sampling.validate() {
        bail!(e);
    }
    Ok(GenerateParams {
        max_tokens: s.max_tokens,
        sampling,
        stop_tokens: lm.tokenizer.stop_ids().to_vec(),
        ..Default::default()
    })
}

fn run(a: RunArgs) -> Result<()> {
    if a.prompt.is_empty() {
        bail!("the prompt is empty: pass some text with --prompt");
    }
    let start = std::time::Instant::now();
    a.threads.init()?;
    let lm = load_model(&a.model)?;
    let loaded = start.elapsed();
    let prompt = lm.tokenizer.encode(&a.prompt, true)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let mut kv = storage_for(&lm, &a.model)?;
    let params = params(&a.sampling, &lm)?;
    let before_prompt = start.elapsed();
    let stats = stream(&lm, &mut kv, &prompt, &params)?;
    println!();
    if a.stats {
        let pf = stats.prompt_tokens as f64 / stats.prefill_time.as_secs_f64();
        let dec = stats.generated_tokens.saturating_sub(1) as f64 / stats.decode_time.as_secs_f64();
        eprintln!(
            "prompt {} tokens in {:.1} ms ({pf:.1} tok/s); generated {} tokens ({dec:.1} tok/s); stop: {:?}",
            stats.prompt_tokens,
            stats.prefill_time.as_secs_f64() * 1e3,
            stats.generated_tokens,
            stats.stop
        );
        eprintln!(
            "model loaded in {:.1} ms; first token {:.1} ms after the start; KV pool {:.1} MB",
            loaded.as_secs_f64() * 1e3,
            (before_prompt + stats.prefill_time).as_secs_f64() * 1e3,
            kv.bytes() as f64 / 1e6
        );
    }
    Ok(())
}

fn stream(
    lm: &LoadedModel,
    kv: &mut KvStorage,
    prompt: &[u32],
    params: &GenerateParams,
) -> Result<leyline_engine::GenerateStats> {
    let mut out = std::io::stdout().lock();
    let mut dec = lm.tokenizer.decode_stream(true);
    let mut err = None;
    let stats = generate(lm.model.as_ref(), kv, prompt, params, |t| {
        match dec.push(&lm.tokenizer, &[t]) {
            Ok(text) => {
                let _ = out.write_all(text.as_bytes());
                let _ = out.flush();
                ControlFlow::Continue(())
            }
            Err(e) => {
                err = Some(e);
                ControlFlow::Break(())
            }
        }
    })?;
    if let Some(e) = err {
        return Err(e.into());
    }
    let _ = out.write_all(dec.finish().as_bytes());
    Ok(stats)
}

fn chat(a: ChatArgs) -> Result<()> {
    a.threads.init()?;
    let lm = load_model(&a.model)?;
    let template = lm.chat.as_ref().with_context(|| {
        format!(
            "{} has no chat template; use `leyline run`",
            lm.path.display()
        )
    })?;
    if let Some(arch) = template.builtin_for() {
        eprintln!(
            "leyline: the file has no chat template; using Leyline's built-in {arch} template"
        );
    }
    let params = params(&a.sampling, &lm)?;
    let mut messages = Vec::new();
    if let Some(s) = &a.system {
        messages.push(ChatMessage::new("system", s.clone()));
    }
    let mut kv = storage_for(&lm, &a.model)?;
    // Tokens whose KV is in the storage: each turn prefills only what follows their common
    // prefix with the newly rendered conversation.
    let mut held: Vec<u32> = Vec::new();
    let stdin = std::io::stdin();
    let interactive = std::io::IsTerminal::is_terminal(&stdin);
    loop {
        if interactive {
            eprint!("> ");
        }
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        messages.push(ChatMessage::new("user", line.trim_end().to_string()));
        let text = template.render(&messages, true)?;
        let prompt = lm.tokenizer.encode(&text, false)?;
        let mut reply = Vec::new();
        let mut dec = lm.tokenizer.decode_stream(true);
        let mut out = std::io::stdout().lock();
        let cached = reusable_prefix(&held, &prompt);
        let stats = generate_after(lm.model.as_ref(), &mut kv, &prompt, cached, &params, |t| {
            reply.push(t);
            if let Ok(s) = dec.push(&lm.tokenizer, &[t]) {
                let _ = out.write_all(s.as_bytes());
                let _ = out.flush();
            }
            ControlFlow::Continue(())
        })?;
        held = prompt
            .iter()
            .chain(&reply)
            .take(stats.kv_tokens)
            .copied()
            .collect();
        let _ = writeln!(out, "{}", dec.finish());
        messages.push(ChatMessage::new(
            "assistant",
            lm.tokenizer.decode(&reply, true)?,
        ));
    }
    Ok(())
}
