use super::*;
use leyline_policy::{ByteChatMl, Message};

fn keys(rows: usize, width: usize, seed: u64) -> Vec<f32> {
    // Uniform in [-4, 4) from the deltas generator's bits.
    splice_deltas(rows * width, seed, 1 << 20)
        .into_iter()
        .map(|d| d as f32 / (1 << 18) as f32)
        .collect()
}

fn spec() -> RopeSpec {
    RopeSpec::plain(10_000.0, 64, RotaryLayout::Neox)
}

#[test]
fn reference_rotation_composes_and_inverts() {
    let k = keys(4, 128, 1);
    let s = spec();
    let there = rotate_reference(&k, 64, &s, 300);
    let back: Vec<f32> = there.iter().map(|&x| x as f32).collect();
    let again = rotate_reference(&back, 64, &s, -300);
    for (a, b) in again.iter().zip(&k) {
        assert!((a - f64::from(*b)).abs() < 1e-5, "{a} vs {b}");
    }
    // Norms are kept per pair.
    let n0: f64 = k.iter().map(|&x| f64::from(x).powi(2)).sum();
    let n1: f64 = there.iter().map(|x| x * x).sum();
    assert!((n0 - n1).abs() / n0 < 1e-12);
    // Zero rotation is the identity, exactly.
    let same = rotate_reference(&k, 64, &s, 0);
    assert!(same.iter().zip(&k).all(|(a, b)| *a == f64::from(*b)));
}

#[test]
fn reference_rotation_matches_hand_computed_pair() {
    // One head of width 4, NEOX halves (0, 2) and (1, 3); theta 100: freqs 1 and 0.1.
    let s = RopeSpec::plain(100.0, 4, RotaryLayout::Neox);
    let got = rotate_reference(&[1.0, 0.0, 0.0, 1.0], 4, &s, 2);
    let want = [2f64.cos(), -(0.2f64.sin()), 2f64.sin(), 0.2f64.cos()];
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-12, "{got:?} vs {want:?}");
    }
}

#[test]
fn drift_grows_with_low_precision_math_and_stays_small_in_f32() {
    let k = keys(64, 3 * 64, 7);
    let s = spec();
    let d1 = splice_deltas(1, 3, 512);
    let d100 = splice_deltas(100, 3, 512);
    let f32_100 =
        chained_shift_drift(&k, 3, 64, &s, &d100, KvDtype::F32, RotationMath::F32).unwrap();
    assert!(f32_100 < 1e-5, "f32 storage drifts {f32_100}");
    let bf_1 = chained_shift_drift(&k, 3, 64, &s, &d1, KvDtype::Bf16, RotationMath::F32).unwrap();
    // One bf16 rounding of the stored keys plus one of the result: below 2^-8.
    assert!(bf_1 > 1e-4 && bf_1 < 4e-3, "bf16 one shift {bf_1}");
    let bf_100 =
        chained_shift_drift(&k, 3, 64, &s, &d100, KvDtype::Bf16, RotationMath::F32).unwrap();
    let low_100 =
        chained_shift_drift(&k, 3, 64, &s, &d100, KvDtype::Bf16, RotationMath::Storage).unwrap();
    assert!(bf_100 > bf_1, "{bf_100} <= {bf_1}");
    assert!(
        low_100 > 1.3 * bf_100,
        "bf16 math {low_100} vs f32 math {bf_100}"
    );
    assert!(bf_100.is_finite() && low_100.is_finite());
}

#[test]
fn drift_counts_only_the_rotary_dims() {
    // Heads of 64 with 32 rotary dims and a huge position-free tail: the figure must
    // equal that of the rotary halves alone (a tail in the norm would shrink it ~1000x).
    let mut partial = RopeSpec::plain(10_000.0, 64, RotaryLayout::Neox);
    partial.rotary_dim = 32;
    let rotary_only = RopeSpec::plain(10_000.0, 32, RotaryLayout::Neox);
    let mut k = keys(16, 2 * 64, 5);
    let halves: Vec<f32> = k
        .chunks_exact(64)
        .flat_map(|h| h[..32].iter().copied())
        .collect();
    for h in k.chunks_exact_mut(64) {
        h[32..].iter_mut().for_each(|x| *x *= 1000.0);
    }
    let d = splice_deltas(10, 9, 512);
    for (storage, math) in [
        (KvDtype::Bf16, RotationMath::F32),
        (KvDtype::Bf16, RotationMath::Storage),
    ] {
        let got = chained_shift_drift(&k, 2, 64, &partial, &d, storage, math).unwrap();
        let want = chained_shift_drift(&halves, 2, 32, &rotary_only, &d, storage, math).unwrap();
        assert!(
            (got - want).abs() <= 1e-9 * want,
            "{storage:?} {math:?}: {got} vs {want}"
        );
    }
}

#[test]
fn drift_of_mla_k_pe_rows_with_yarn() {
    // MLA's key row: one interleaved rotary head of 8 (k_pe), YaRN frequencies as the
    // tiny fixture's: f32 stays tiny, bf16 math drifts further than f32 math.
    let s = RopeSpec {
        theta: 10_000.0,
        head_dim: 8,
        rotary_dim: 8,
        layout: RotaryLayout::Interleaved,
        scaling: leyline_kernels::rope::RopeScaling::Yarn {
            factor: 4.0,
            original_max_position: 128.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 0.707,
            mscale_all_dim: 0.707,
        },
        freq_factors: None,
    };
    let k = keys(256, 8, 13);
    let d = splice_deltas(100, 3, 512);
    let f = chained_shift_drift(&k, 1, 8, &s, &d, KvDtype::F32, RotationMath::F32).unwrap();
    assert!(f < 1e-5, "f32 {f}");
    let b = chained_shift_drift(&k, 1, 8, &s, &d, KvDtype::Bf16, RotationMath::F32).unwrap();
    let low = chained_shift_drift(&k, 1, 8, &s, &d, KvDtype::Bf16, RotationMath::Storage).unwrap();
    assert!(b > f && low > b, "f32 {f}, bf16/f32 {b}, bf16/bf16 {low}");
    // A spec for another head width is refused, not silently mis-chunked.
    let wide = RopeSpec::plain(10_000.0, 16, RotaryLayout::Interleaved);
    assert!(chained_shift_drift(&k, 1, 8, &wide, &[], KvDtype::F32, RotationMath::F32).is_err());
}

#[test]
fn synthetic_probes_are_seeded_bounded_and_evict_an_older_span() {
    let opts = SyntheticOptions {
        probes: 50,
        vocab_size: 512,
        max_tokens: 300,
        seed: 7,
    };
    let probes = synthetic_probes(&opts).unwrap();
    assert_eq!(probes.len(), 50);
    assert_eq!(probes, synthetic_probes(&opts).unwrap());
    let other = synthetic_probes(&SyntheticOptions {
        seed: 8,
        ..opts.clone()
    })
    .unwrap();
    assert_ne!(probes, other);
    for (i, p) in probes.iter().enumerate() {
        let n = p.prompt.len();
        assert_eq!(p.label, format!("synthetic#{i}"));
        assert!((150..=300).contains(&n), "{n}");
        let [e] = p.edits.as_slice() else {
            panic!("one edit: {p:?}")
        };
        assert!(e.start >= 1 && e.end <= 3 * n / 8, "{e:?} of {n}");
        assert!(e.end - e.start >= 2 && e.end - e.start >= n / 8 - 1);
        assert!(!e.replacement.is_empty() && e.replacement.len() < e.end - e.start);
        assert!(e.replacement.len() <= 8);
        assert!(p.prompt.iter().chain(&e.replacement).all(|&t| t < 512));
    }
    // The smallest budget still gives valid edits; below it is an error.
    for p in synthetic_probes(&SyntheticOptions {
        max_tokens: SYNTHETIC_MIN_TOKENS,
        ..opts.clone()
    })
    .unwrap()
    {
        let [e] = p.edits.as_slice() else {
            panic!("one edit: {p:?}")
        };
        assert!(e.end < p.prompt.len() - 1 && e.delta() < 0, "{p:?}");
    }
    assert!(synthetic_probes(&SyntheticOptions {
        max_tokens: SYNTHETIC_MIN_TOKENS - 1,
        ..opts.clone()
    })
    .is_err());
    assert!(synthetic_probes(&SyntheticOptions {
        vocab_size: 1,
        ..opts
    })
    .is_err());
}

#[test]
fn drift_rejects_partial_rows() {
    let err = chained_shift_drift(
        &[0.0; 10],
        3,
        64,
        &spec(),
        &[1],
        KvDtype::F32,
        RotationMath::F32,
    );
    assert!(err.is_err());
}

#[test]
fn deltas_are_bounded_nonzero_and_mixed_in_sign() {
    let d = splice_deltas(1000, 11, 512);
    assert!(d.iter().all(|&x| x != 0 && x.abs() <= 512));
    assert!(d.iter().any(|&x| x < 0) && d.iter().any(|&x| x > 0));
    assert_eq!(d, splice_deltas(1000, 11, 512));
}

#[test]
fn top_margin_finds_the_lead() {
    assert_eq!(top_margin(&[0.5, 3.0, 2.5, -1.0]), (1, 0.5));
    assert_eq!(top_margin(&[2.0, 2.0]), (0, 0.0));
    assert_eq!(top_margin(&[1.0]), (0, 0.0));
}

fn outcome(full: (u32, f32), amortize: u32, forget: u32) -> ProbeOutcome {
    ProbeOutcome {
        label: String::new(),
        tokens: 0,
        removed: 0,
        stub: 0,
        downstream: 0,
        full,
        amortize: (amortize, 0.0),
        forget: (forget, 0.0),
        amortize_gap_in_full: 0.0,
        amortize_forget_max_diff: 0.0,
        amortize_report: EditReport {
            mode: Mode::Amortize,
            directives: 1,
            reused: 0,
            rotated: 0,
            copied: 0,
            prefilled: 0,
            moved: 0,
            prefill_us: 0,
            repaired: 0,
            scanned: 0,
            zeroed: 0,
            new_len: 0,
            compacted: false,
        },
        kl_forget: 0.0,
        repairs: Vec::new(),
    }
}

#[test]
fn margin_bands_split_at_their_edges() {
    let o = [
        outcome((7, 0.05), 8, 8),  // near-tie: both arms move
        outcome((7, 0.125), 7, 8), // on an edge: the upper band
        outcome((7, 0.3), 7, 7),   // agrees
        outcome((7, 0.49), 9, 7),  // AMORTIZE alone moves
        outcome((7, 5.0), 7, 7),   // open last band
        outcome((7, -1.0), 7, 7),  // below the first edge: not counted
    ];
    let bands = by_reference_margin(&o, &[0.0, 0.125, 0.25, 1.0]);
    let rows: Vec<(f64, usize, usize, usize)> = bands
        .iter()
        .map(|b| (b.lo, b.probes, b.agree_full, b.forget_agree_full))
        .collect();
    assert_eq!(
        rows,
        vec![
            (0.0, 1, 0, 0),
            (0.125, 1, 1, 0),
            (0.25, 2, 1, 2),
            (1.0, 1, 1, 1)
        ]
    );
    assert_eq!(bands[0].hi, 0.125);
    assert!(bands[3].hi.is_infinite());
    assert!(by_reference_margin(&o, &[]).is_empty());
}

fn traj(id: &str, messages: Vec<Message>) -> Trajectory {
    Trajectory {
        id: id.into(),
        source: "test".into(),
        meta: serde_json::Value::Null,
        messages,
    }
}

#[test]
fn probes_replace_the_oldest_tool_output_when_a_newer_one_exists() {
    let t = traj(
        "t",
        vec![
            Message::system("sys"),
            Message::user("hi"),
            Message::assistant("call a"),
            Message::tool("a", "first output"),
            Message::assistant("call b"),
            Message::tool("b", "second output"),
            Message::assistant("done"),
        ],
    );
    let one_tool = traj(
        "u",
        vec![
            Message::user("hi"),
            Message::assistant("call"),
            Message::tool("a", "only output"),
            Message::assistant("done"),
        ],
    );
    let opts = ProbeOptions {
        max_probes: 10,
        max_tokens: 10_000,
        stub: "[x]".into(),
        moves: false,
    };
    let probes = build_probes(&[one_tool.clone(), t.clone()], &ByteChatMl, &opts).unwrap();
    assert_eq!(
        probes.len(),
        1,
        "only the last turn of `t` has two tool outputs"
    );
    let p = &probes[0];
    assert_eq!(p.label, "t#2");
    let [edit] = p.edits.as_slice() else {
        panic!("one edit: {p:?}")
    };
    let text: String = p.prompt[edit.start..edit.end]
        .iter()
        .map(|&b| b as u8 as char)
        .collect();
    assert!(
        "first output".contains(&text) && !text.is_empty(),
        "{text:?}"
    );
    let repl: String = edit.replacement.iter().map(|&b| b as u8 as char).collect();
    assert!("[x]".contains(&repl), "{repl:?}");
    // The rendered history ends the prompt (ByteChatMl has no generation prompt).
    let want = ByteChatMl.render_tokens(&t.messages[..6]).unwrap().tokens;
    assert_eq!(p.prompt, want);

    // Moved instead: the oldest output goes just before the last message, and the edits
    // turn the prompt into that rendering.
    let moves = ProbeOptions {
        moves: true,
        ..opts.clone()
    };
    let probes = build_probes(&[one_tool, t.clone()], &ByteChatMl, &moves).unwrap();
    assert_eq!(probes.len(), 1);
    let mut reordered = t.messages[..6].to_vec();
    let tool = reordered.remove(3);
    reordered.insert(4, tool);
    let moved = ByteChatMl.render_tokens(&reordered).unwrap().tokens;
    assert_ne!(moved, want);
    assert_eq!(
        leyline_policy::apply_edits(&want, &probes[0].edits).unwrap(),
        moved
    );
    assert!(probes[0].edits.len() >= 2, "{:?}", probes[0].edits);

    // A budget below the prompt leaves no probe.
    let tight = ProbeOptions {
        max_tokens: want.len() - 1,
        ..opts
    };
    assert!(build_probes(&[t], &ByteChatMl, &tight).unwrap().is_empty());
}

#[test]
fn kl_divergence_matches_a_hand_computed_pair() {
    // softmax([0, ln 3]) = (1/4, 3/4), softmax([0, 0]) = (1/2, 1/2):
    // KL = 1/4 ln(1/2) + 3/4 ln(3/2).
    let want = 0.25 * 0.5f64.ln() + 0.75 * 1.5f64.ln();
    let got = kl_divergence(&[0.0, 3f32.ln()], &[0.0, 0.0]);
    assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    assert_eq!(kl_divergence(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]), 0.0);
    // A shift of every logit is the same distribution.
    assert!(kl_divergence(&[1.0, 2.0], &[11.0, 12.0]) < 1e-9);
}
