//! `leyline bench policy`: what each context policy does to the cached tokens of recorded
//! agent trajectories, with the model's real tokenizer and chat template. Every turn's prompt
//! is diffed against what the cache holds (previous prompt + recorded reply) and the edits are
//! checked to reproduce the prompt exactly before they are counted.

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use leyline_engine::to_chat_message;
use leyline_model::chat::ChatTemplate;
use leyline_model::tokenizer::Tokenizer;
use leyline_policy::{
    apply_edits, load_traces, replay_turns, replay_turns_stateful, turn_diffs, Message,
    PolicyConfig, PolicyError, PolicyStats, Rendered, Renderer, Trajectory, Turn,
};
use std::cell::RefCell;
use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Instant;

/// Options of `bench policy`.
#[derive(Args)]
pub struct PolicyArgs {
    /// Trace files (JSONL, the format of data/traces/).
    #[arg(long, num_args = 1.., default_values = ["data/traces/tau-bench.jsonl", "data/traces/swe-agent-demos.jsonl"])]
    pub traces: Vec<PathBuf>,
    /// Policies, in the CLI form (`none`, `truncate_tool_outputs:2`, `clear_tool_uses:trigger=4000,keep=3`, JSON).
    #[arg(long, num_args = 1.., default_values = ["none", "truncate_tool_outputs:2", "clear_tool_uses:trigger=4000,keep=3"])]
    pub policy: Vec<String>,
    /// Each prompt is the policy applied to the previous (edited) prompt, its reply and the new
    /// messages, instead of to the original history.
    #[arg(long)]
    pub stateful: bool,
    /// A GGUF file whose tokenizer and chat template to use (default: the default model).
    #[arg(long, short = 'm', env = "LEYLINE_MODEL")]
    pub model: Option<PathBuf>,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// The chat renderer of `leyline_engine::ChatRenderer` (template text cut where each message
/// starts, each piece tokenized on its own), memoized: the piece of message `k` by a hash
/// chained over `messages[..=k]`, the tokens by piece text. A replay then tokenizes each
/// distinct piece once instead of every prompt in full. The engine's tests check that both
/// renderers agree.
struct MemoRenderer<'a> {
    tok: &'a Tokenizer,
    tmpl: &'a ChatTemplate,
    pieces: RefCell<HashMap<u64, (usize, Rc<str>)>>,
    tokens: RefCell<HashMap<Rc<str>, Rc<[u32]>>>,
}

impl<'a> MemoRenderer<'a> {
    fn new(tok: &'a Tokenizer, tmpl: &'a ChatTemplate) -> Self {
        Self {
            tok,
            tmpl,
            pieces: RefCell::default(),
            tokens: RefCell::default(),
        }
    }

    fn clear(&self) {
        self.pieces.borrow_mut().clear();
        self.tokens.borrow_mut().clear();
    }
}

fn chain(h: u64, m: &Message) -> u64 {
    let mut s = DefaultHasher::new();
    h.hash(&mut s);
    m.role.as_str().hash(&mut s);
    m.content.hash(&mut s);
    m.name.hash(&mut s);
    m.tool_call_id.hash(&mut s);
    for c in &m.tool_calls {
        (&c.id, &c.name, &c.arguments).hash(&mut s);
    }
    s.finish()
}

impl Renderer for MemoRenderer<'_> {
    fn render_tokens(&self, messages: &[Message]) -> leyline_policy::Result<Rendered> {
        let err = |e: leyline_model::ModelError| PolicyError::Render(e.to_string());
        let (mut h, mut text_len) = (0u64, 0usize);
        let mut out = Rendered::default();
        for k in 0..messages.len() {
            h = chain(h, &messages[k]);
            let known = self.pieces.borrow().get(&h).cloned();
            let (len, piece) = match known {
                Some(x) => x,
                None => {
                    let chat: Vec<_> = messages[..=k].iter().map(to_chat_message).collect();
                    let text = self.tmpl.render(&chat, false).map_err(err)?;
                    let piece: Rc<str> = text.get(text_len..).unwrap_or_default().into();
                    let x = (text.len(), piece);
                    self.pieces.borrow_mut().insert(h, x.clone());
                    x
                }
            };
            text_len = len;
            let known = self.tokens.borrow().get(&piece).cloned();
            let ids = match known {
                Some(ids) => ids,
                None => {
                    let ids: Rc<[u32]> = self.tok.encode(&piece, false).map_err(err)?.into();
                    self.tokens.borrow_mut().insert(piece, Rc::clone(&ids));
                    ids
                }
            };
            out.bounds.push(out.tokens.len());
            out.tokens.extend_from_slice(&ids);
        }
        out.bounds.push(out.tokens.len());
        Ok(out)
    }
}

/// Tokenizer and chat template from the GGUF metadata, without the weights.
fn tokenizer_and_template(model: Option<PathBuf>) -> Result<(Tokenizer, ChatTemplate)> {
    let path = match model {
        Some(p) => p,
        None => leyline_model::registry::default_model_path()?,
    };
    let f = leyline_model::gguf::GgufFile::open(&path)?;
    let tok = Tokenizer::from_gguf_metadata(f.metadata())?;
    let tmpl = ChatTemplate::from_gguf_metadata(f.metadata(), &tok)
        .with_context(|| format!("{}: no usable chat template", path.display()))?;
    Ok((tok, tmpl))
}

/// Runs `bench policy`.
pub fn run(a: PolicyArgs) -> Result<()> {
    if a.traces.is_empty() || a.policy.is_empty() {
        bail!("give at least one --traces file and one --policy");
    }
    let policies: Vec<(String, PolicyConfig)> = a
        .policy
        .iter()
        .map(|s| Ok((s.clone(), s.parse::<PolicyConfig>()?)))
        .collect::<Result<_>>()?;
    let mut trajectories: Vec<Trajectory> = Vec::new();
    for path in &a.traces {
        let t = load_traces(path).with_context(|| {
            format!(
                "{} (run from the repository root, or pass --traces)",
                path.display()
            )
        })?;
        trajectories.extend(t);
    }
    let (tok, tmpl) = tokenizer_and_template(a.model)?;
    let renderer = MemoRenderer::new(&tok, &tmpl);

    let bar = ProgressBar::new(trajectories.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} trajectories {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message("replaying");
    let started = Instant::now();
    // (policy index, source) -> sums
    let mut stats: BTreeMap<(usize, String), PolicyStats> = BTreeMap::new();
    for t in &trajectories {
        renderer.clear();
        for (pi, (spec, cfg)) in policies.iter().enumerate() {
            let policy = cfg.build();
            let turns: Vec<Turn> = if a.stateful {
                replay_turns_stateful(&t.messages, policy.as_ref()).collect()
            } else {
                replay_turns(&t.messages, policy.as_ref()).collect()
            };
            let s = stats.entry((pi, t.source.clone())).or_default();
            for d in turn_diffs(turns, &renderer) {
                let d = d.with_context(|| format!("{spec} on {}", t.id))?;
                if apply_edits(&d.old.tokens, &d.edits)? != d.new.tokens {
                    bail!(
                        "{spec} on {} turn {}: the edits do not reproduce the prompt",
                        t.id,
                        d.turn
                    );
                }
                s.record(d.old.tokens.len(), d.new.tokens.len(), &d.edits);
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();

    let per = |x: u64, n: u64| if n == 0 { 0.0 } else { x as f64 / n as f64 };
    if a.json {
        let rows: Vec<_> = stats
            .iter()
            .map(|((pi, source), s)| {
                serde_json::json!({
                    "policy": policies[*pi].0,
                    "source": source,
                    "stats": s,
                    "edits_per_turn": s.edits_per_turn(),
                    "tokens_removed_per_turn": s.tokens_removed_per_turn(),
                    "mean_abs_delta": s.mean_abs_delta(),
                    "edit_share": s.edit_share(),
                    "prompt_tokens_per_turn": per(s.prompt_tokens, s.turns),
                    "prefix_cache_prefill_per_turn": per(s.prefix_cache_prefill, s.turns),
                })
            })
            .collect();
        let out = serde_json::json!({"stateful": a.stateful, "seconds": secs, "rows": rows});
        println!("{out}");
        return Ok(());
    }
    println!(
        "| policy | source | turns | edits/turn | tokens removed/turn | mean \\|delta\\| | turns with an edit | prompt tokens/turn | prefix-cache prefill/turn |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for ((pi, source), s) in &stats {
        println!(
            "| `{}` | {source} | {} | {:.2} | {:.1} | {:.1} | {:.1}% | {:.0} | {:.0} |",
            policies[*pi].0,
            s.turns,
            s.edits_per_turn(),
            s.tokens_removed_per_turn(),
            s.mean_abs_delta(),
            100.0 * s.edit_share(),
            per(s.prompt_tokens, s.turns),
            per(s.prefix_cache_prefill, s.turns),
        );
    }
    eprintln!(
        "{} trajectories, {} policies, {}: every turn's edits reproduced its prompt ({secs:.1} s)",
        trajectories.len(),
        policies.len(),
        if a.stateful { "stateful" } else { "stateless" },
    );
    Ok(())
}
