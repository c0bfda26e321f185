//! The directive on every GGUF architecture, over the tiny seeded checkpoints of the model
//! crate's fixtures (f32 files): FORGET equals a fresh prefill of the edited tokens, an
//! AMORTIZE that changes nothing equals no edit, and a lazy splice gives an eager one's
//! logits. (That a shift turns a layer's keys into the keys of the new positions is checked
//! against transformers in the model crate's `arch_reference.rs`.) On gemma3 (window 8) the
//! probes' windows hold keys a splice moved: a window counted in the keys' old positions,
//! not their places in the context, would make lazy and eager differ.
//!
//! Bounds: these models' logits are within a few units; two exact computations of the same
//! tokens that chunk their prefill differently are ~1e-6 apart (the model crate's tests
//! measure 1e-5 against transformers), so "equal" is held to [`SAME`] = 1e-4; what is the
//! same computation (an empty batch) is held to the bit.

mod common;

use common::{request, session_with};
use leyline_core::{Directive, Mode};
use leyline_engine::{Engine, EngineConfig, SessionEdits, SessionRequest};
use leyline_kv::shift::RotationMode;
use leyline_kv::KvDtype;
use leyline_model::gguf::GgufFile;
use leyline_model::{load_network, CausalLm};
use std::path::PathBuf;
use std::sync::Arc;

/// See the file's doc.
const SAME: f32 = 1e-4;

/// The architectures with tiny fixtures.
const ARCHS: &[&str] = &["llama", "qwen3", "qwen3moe", "gemma3", "olmo2"];

fn model(arch: &str) -> Arc<dyn CausalLm> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../leyline-model/tests/fixtures")
        .join(arch)
        .join("model.f32.gguf");
    let mut f = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    load_network(&mut f).unwrap_or_else(|e| panic!("{arch}: {e}"))
}

fn engine(m: &Arc<dyn CausalLm>, rotation: RotationMode) -> Engine {
    let cfg = EngineConfig {
        prefill_chunk: 48,
        kv_dtype: KvDtype::F32,
        rotation,
        ..EngineConfig::new(1024)
    };
    Engine::new(Arc::clone(m), cfg).unwrap()
}

/// `n` deterministic token ids below `vocab`.
fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// The session's logits after `probe`, and the tokens it holds.
fn probe(e: &mut Engine, id: leyline_engine::SessionId, probe: &[u32]) -> (Vec<f32>, Vec<u32>) {
    let logits = e.peek_logits(id, probe).unwrap();
    (logits, e.session_info(id).unwrap().tokens)
}

#[test]
fn forget_equals_a_fresh_prefill_of_the_edited_tokens() {
    for arch in ARCHS {
        let m = model(arch);
        let vocab = m.info().vocab_size;
        let ctx = tokens(150, vocab, 11);
        let look = tokens(3, vocab, 12);
        let mut e = engine(&m, RotationMode::Eager);
        let id = session_with(&mut e, &ctx);
        let batch = vec![
            Directive::new(20, 35, tokens(4, vocab, 13), Mode::Forget),
            Directive::new(90, 91, vec![], Mode::Forget),
        ];
        e.apply_directives(id, batch).unwrap();
        let (got, edited) = probe(&mut e, id, &look);
        let mut want_tokens = ctx[..20].to_vec();
        want_tokens.extend(tokens(4, vocab, 13));
        want_tokens.extend_from_slice(&ctx[35..90]);
        want_tokens.extend_from_slice(&ctx[91..]);
        assert_eq!(edited, want_tokens, "{arch}: the edited tokens");
        let mut fresh = engine(&m, RotationMode::Eager);
        let fid = session_with(&mut fresh, &want_tokens);
        let (want, _) = probe(&mut fresh, fid, &look);
        let d = max_diff(&got, &want);
        eprintln!("{arch}: FORGET vs fresh prefill {d:e}");
        assert!(d <= SAME, "{arch}: FORGET is {d} from a fresh prefill");
        e.check_no_leaks().unwrap();
    }
}

#[test]
fn an_amortize_that_changes_nothing_equals_no_edit() {
    for arch in ARCHS {
        let m = model(arch);
        let vocab = m.info().vocab_size;
        let ctx = tokens(150, vocab, 21);
        let look = tokens(3, vocab, 22);
        let mut e = engine(&m, RotationMode::Eager);
        let id = session_with(&mut e, &ctx);
        let (before, _) = probe(&mut e, id, &look);
        e.apply_directives(id, vec![]).unwrap();
        let (after_empty, held) = probe(&mut e, id, &look);
        assert_eq!(held, ctx, "{arch}");
        assert!(
            before
                .iter()
                .zip(&after_empty)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{arch}: an empty batch changed the logits"
        );
        // The same tokens in place of themselves: rerun, downstream keys not moved.
        let same = Directive::new(40, 55, ctx[40..55].to_vec(), Mode::Amortize);
        let report = e.apply_directives(id, vec![same]).unwrap();
        assert_eq!(report.new_len, ctx.len(), "{arch}");
        let (after, held) = probe(&mut e, id, &look);
        assert_eq!(held, ctx, "{arch}");
        let d = max_diff(&before, &after);
        eprintln!("{arch}: identity AMORTIZE vs no edit {d:e}");
        assert!(
            d <= SAME,
            "{arch}: an identity AMORTIZE moved the logits by {d}"
        );
        e.check_no_leaks().unwrap();
    }
}

#[test]
fn lazy_and_eager_amortize_give_the_same_logits() {
    for arch in ARCHS {
        let m = model(arch);
        let vocab = m.info().vocab_size;
        let ctx = tokens(150, vocab, 31);
        let look = tokens(3, vocab, 32);
        let batch = || {
            vec![
                Directive::new(10, 30, vec![], Mode::Amortize),
                Directive::new(60, 62, tokens(9, vocab, 33), Mode::Amortize),
            ]
        };
        let mut out = Vec::new();
        for rotation in [RotationMode::Eager, RotationMode::Lazy] {
            let mut e = engine(&m, rotation);
            let id = session_with(&mut e, &ctx);
            e.apply_directives(id, batch()).unwrap();
            out.push(probe(&mut e, id, &look));
            // A turn decodes from the spliced context.
            let mut t = e.session_info(id).unwrap().tokens;
            t.extend_from_slice(&look);
            let (req, o) = request(t, 6);
            e.submit(req.in_session(SessionRequest {
                id,
                mode: Mode::Amortize,
                edits: SessionEdits::Tokens,
            }));
            e.run_to_completion().unwrap();
            let o = o.lock().unwrap();
            assert!(o.failed.is_none(), "{arch} {rotation:?}: {:?}", o.failed);
            out.last_mut().unwrap().1 = o.tokens.clone();
            e.check_no_leaks().unwrap();
        }
        let d = max_diff(&out[0].0, &out[1].0);
        eprintln!("{arch}: lazy vs eager AMORTIZE {d:e}");
        assert!(d <= SAME, "{arch}: lazy and eager splices {d} apart");
        assert_eq!(out[0].1, out[1].1, "{arch}: the turns after the splice");
    }
}
