use super::format::Bytes;
use super::*;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use half::f16;
use std::sync::Arc;

/// splitmix64: a small seeded generator for test data.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Random GGML bytes of a `[rows, cols]` matrix: finite f16 scales of either sign, every
/// other byte random (K-quant scale bytes included, so every 6-bit field takes all values).
fn random_ggml(kind: GgmlKind, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let blocks = rows * cols / kind.block_len();
    let mut raw = Vec::with_capacity(blocks * kind.block_bytes());
    let half =
        |rng: &mut Rng, scale: f32| f16::from_f32(rng.unit() * scale).to_bits().to_le_bytes();
    for _ in 0..blocks {
        let start = raw.len();
        raw.extend((0..kind.block_bytes()).map(|_| rng.next() as u8));
        let blk = &mut raw[start..];
        match kind {
            GgmlKind::Q4_0 | GgmlKind::Q5_0 | GgmlKind::Q8_0 => {
                blk[0..2].copy_from_slice(&half(rng, 0.05))
            }
            GgmlKind::Q4_1 => {
                blk[0..2].copy_from_slice(&half(rng, 0.05));
                blk[2..4].copy_from_slice(&half(rng, 0.4));
            }
            GgmlKind::Q4K | GgmlKind::Q5K => {
                blk[0..2].copy_from_slice(&half(rng, 0.002));
                blk[2..4].copy_from_slice(&half(rng, 0.005));
            }
            GgmlKind::Q6K => blk[208..210].copy_from_slice(&half(rng, 0.0005)),
        }
    }
    raw
}

/// Random matrices of `(kind, rows)` and `cols` columns, with their f64 references.
fn random_parts(
    specs: &[(GgmlKind, usize)],
    cols: usize,
    rng: &mut Rng,
) -> (Vec<QMatrix>, Vec<Vec<f64>>) {
    specs
        .iter()
        .map(|&(kind, rows)| {
            let raw = random_ggml(kind, rows, cols, rng);
            (
                QMatrix::from_ggml(kind, &raw, rows, cols).unwrap(),
                dequant_ref(kind, &raw),
            )
        })
        .unzip()
}

/// Columns `col .. col + n` of `y: [m, width]`, row by row.
fn columns(y: &[f32], m: usize, width: usize, col: usize, n: usize) -> Vec<f32> {
    (0..m)
        .flat_map(|i| y[i * width + col..i * width + col + n].to_vec())
        .collect()
}

/// Dequantizes GGML bytes straight from the format description, in f64.
fn dequant_ref(kind: GgmlKind, raw: &[u8]) -> Vec<f64> {
    reference::dequantize(kind, raw)
}

/// Checks `y` against `x W^T` in f64: |y - ref| <= gamma(cols + 2) * sum |w x|, the classic
/// bound for f32 sums of products in any order (u = 2^-24), plus a tiny floor. The kernels'
/// weights are the format's values rounded once to f32 (`format::row_scales`), the "+ 2".
fn check(w: &[f64], rows: usize, cols: usize, x: &[f32], m: usize, y: &[f32], what: &str) {
    let u = f64::powi(2.0, -24);
    let n = (cols + 2) as f64;
    let gamma = n * u / (1.0 - n * u);
    for i in 0..m {
        for r in 0..rows {
            let (mut s, mut a) = (0f64, 0f64);
            for c in 0..cols {
                let p = w[r * cols + c] * f64::from(x[i * cols + c]);
                s += p;
                a += p.abs();
            }
            let got = f64::from(y[i * rows + r]);
            let err = (got - s).abs();
            assert!(
                err <= gamma * a + 1e-30,
                "{what}: y[{i},{r}] = {got}, reference {s}, error {err} > {}",
                gamma * a
            );
        }
    }
}

/// The tiers to compare: every one this CPU runs (those it lacks are noted on stderr).
fn tiers() -> Vec<Tier> {
    Tier::note_lacking();
    Tier::all_available()
}

/// Shapes with odd row counts (not multiples of the 2- and 4-row tiles) and several widths.
fn shapes(kind: GgmlKind) -> &'static [(usize, usize)] {
    if kind.block_len() == 256 {
        &[(37, 256), (130, 768), (5, 4864), (64, 512)]
    } else {
        &[(192, 576), (1000, 576), (37, 1536), (64, 32), (5, 2080)]
    }
}

#[test]
fn every_tier_matches_the_f64_reference() {
    let mut rng = Rng(7);
    for kind in GgmlKind::ALL {
        for &(rows, cols) in shapes(kind) {
            let raw = random_ggml(kind, rows, cols, &mut rng);
            let qm = QMatrix::from_ggml(kind, &raw, rows, cols).unwrap();
            let w = dequant_ref(kind, &raw);
            for m in [1, 2, 3, 4, 5, 6, 9, 16, 24, 33, 70] {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.unit()).collect();
                for tier in tiers() {
                    let mut y = vec![f32::NAN; m * rows];
                    qm.matmul_with(tier, &x, m, &mut y);
                    check(
                        &w,
                        rows,
                        cols,
                        &x,
                        m,
                        &y,
                        &format!("{kind:?} {tier} [{rows},{cols}] m={m}"),
                    );
                }
            }
        }
    }
}

/// Raw bytes of one block of each kind with hand-picked fields, and values of it worked out
/// by hand from the format definitions: `(index, value)`.
fn hand_built(kind: GgmlKind) -> (Vec<u8>, Vec<(usize, f64)>) {
    let h = |v: f32| f16::from_f32(v).to_bits().to_le_bytes();
    let mut b = vec![0u8; kind.block_bytes()];
    let known = match kind {
        GgmlKind::Q4_0 => {
            // d = 0.5; byte j holds j (low) and 15 - j (high): w = d (q - 8).
            b[0..2].copy_from_slice(&h(0.5));
            for j in 0..16 {
                b[2 + j] = j as u8 | ((15 - j as u8) << 4);
            }
            vec![(0, -4.0), (9, 0.5), (15, 3.5), (16, 3.5), (31, -4.0)]
        }
        GgmlKind::Q4_1 => {
            // d = 0.5, m = -1; byte 2 = 0x3c: value 2 is 12, value 18 is 3.
            b[0..2].copy_from_slice(&h(0.5));
            b[2..4].copy_from_slice(&h(-1.0));
            b[4 + 2] = 0x3c;
            vec![(2, 5.0), (18, 0.5), (0, -1.0)]
        }
        GgmlKind::Q5_0 => {
            // d = 0.25; qh bits 0 and 31; byte 0 = 0xf3: value 0 is 3 + 16, value 16 is 15,
            // value 31 is 0 + 16, value 1 is 0: w = d (q - 16).
            b[0..2].copy_from_slice(&h(0.25));
            b[2..6].copy_from_slice(&0x8000_0001u32.to_le_bytes());
            b[6] = 0xf3;
            vec![(0, 0.75), (16, -0.25), (31, 0.0), (1, -4.0), (15, -4.0)]
        }
        GgmlKind::Q8_0 => {
            b[0..2].copy_from_slice(&h(0.125));
            b[2] = 0x80;
            b[33] = 7;
            vec![(0, -16.0), (31, 0.875), (1, 0.0)]
        }
        GgmlKind::Q4K | GgmlKind::Q5K => {
            // d = 2, dmin = 1. Sub-block 0: scale 1, min 2 (bytes 4 + 0, 4 + 4). Sub-block 5:
            // scale 33 = 0b10_0001 (low bits in byte 4 + 9's low nibble, top bits in byte
            // 4 + 1's top 2), min 50 = 0b11_0010 (byte 4 + 9's high nibble, byte 4 + 5's top).
            b[0..2].copy_from_slice(&h(2.0));
            b[2..4].copy_from_slice(&h(1.0));
            b[4] = 1;
            b[4 + 1] = 0b1000_0000;
            b[4 + 4] = 2;
            b[4 + 5] = 0b1100_0000;
            b[4 + 9] = (2 << 4) | 1;
            // Nibbles: sub-blocks 4 and 5 share bytes 64..96 (low: 4, high: 5).
            let qs = if kind == GgmlKind::Q5K { 48 } else { 16 };
            b[qs] = 0x07; // value 0: q = 7
            b[qs + 64 + 3] = 0xa0; // value 5 * 32 + 3: q = 10; value 4 * 32 + 3: q = 0
            if kind == GgmlKind::Q4K {
                // w = d sc q - dmin m.
                vec![(0, 12.0), (1, -2.0), (163, 610.0), (131, 0.0), (160, -50.0)]
            } else {
                // 5th bits: qh byte l, bit j for value l of sub-block j.
                b[16] = 1; // value 0: q = 7 + 16
                b[16 + 3] = 1 << 5; // value 163: q = 10 + 16
                vec![
                    (0, 44.0),
                    (1, -2.0),
                    (163, 1666.0),
                    (131, 0.0),
                    (160, -50.0),
                ]
            }
        }
        GgmlKind::Q6K => {
            // d = 0.5; scales 3 (values 0..16), 1 (16..32), -2 (208..224); w = d sc (q - 32).
            b[208..210].copy_from_slice(&h(0.5));
            b[192] = 3;
            b[193] = 1;
            b[192 + 13] = (-2i8) as u8;
            // Value 0: low nibble of ql[0] = 15, bits 0-1 of qh[0] = 2: q = 47.
            b[0] = 0x0f;
            b[128] = 0b10;
            // Value 213 (half 1, chunk 2, l = 21): high nibble of ql[64 + 21] = 3, bits 4-5
            // of qh[32 + 21] = 1: q = 19.
            b[64 + 21] = 0x30;
            b[128 + 32 + 21] = 0b01_0000;
            vec![(0, 22.5), (213, 13.0), (16, -16.0), (1, -48.0), (100, 0.0)]
        }
    };
    (b, known)
}

#[test]
fn hand_built_blocks_have_their_known_values() {
    for kind in GgmlKind::ALL {
        let (raw, known) = hand_built(kind);
        let w = dequant_ref(kind, &raw);
        for &(i, v) in &known {
            assert_eq!(w[i], v, "{kind:?} reference, value {i}");
        }
        // Through the kernels: one row, activation rows that pick single columns.
        let cols = kind.block_len();
        let qm = QMatrix::from_ggml(kind, &raw, 1, cols).unwrap();
        let m = known.len();
        let mut x = vec![0f32; m * cols];
        for (r, &(i, _)) in known.iter().enumerate() {
            x[r * cols + i] = 1.0;
        }
        for tier in tiers() {
            let mut y = vec![f32::NAN; m];
            qm.matmul_with(tier, &x, m, &mut y);
            for (&got, &(i, v)) in y.iter().zip(&known) {
                assert_eq!(f64::from(got), v, "{kind:?} {tier}, value {i}");
            }
        }
    }
}

/// candle's name of a kind.
fn dtype_of(kind: GgmlKind) -> GgmlDType {
    match kind {
        GgmlKind::Q4_0 => GgmlDType::Q4_0,
        GgmlKind::Q4_1 => GgmlDType::Q4_1,
        GgmlKind::Q5_0 => GgmlDType::Q5_0,
        GgmlKind::Q8_0 => GgmlDType::Q8_0,
        GgmlKind::Q4K => GgmlDType::Q4K,
        GgmlKind::Q5K => GgmlDType::Q5K,
        GgmlKind::Q6K => GgmlDType::Q6K,
    }
}

#[test]
fn reference_matches_candle_dequantization() {
    // Candle's dequantizers (an independent implementation) compute each value in f32 with
    // exact products and at most one rounded addition, so they give the f64 value rounded to
    // the nearest f32: equality, not a tolerance.
    let mut rng = Rng(23);
    for kind in GgmlKind::ALL {
        let dtype = dtype_of(kind);
        let (rows, cols) = (9, 1024);
        let raw = random_ggml(kind, rows, cols, &mut rng);
        let t = candle_core::quantized::ggml_file::qtensor_from_ggml(
            dtype,
            &raw,
            vec![rows, cols],
            &Device::Cpu,
        )
        .unwrap();
        let theirs: Vec<f32> = t
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let ours = dequant_ref(kind, &raw);
        assert_eq!(ours.len(), theirs.len());
        for (i, (&a, &b)) in ours.iter().zip(&theirs).enumerate() {
            assert_eq!(a as f32, b, "{kind:?} value {i}: reference {a}, candle {b}");
        }
        // And the hand-built block.
        let (raw, _) = hand_built(kind);
        let t = candle_core::quantized::ggml_file::qtensor_from_ggml(
            dtype,
            &raw,
            vec![1, kind.block_len()],
            &Device::Cpu,
        )
        .unwrap();
        let theirs: Vec<f32> = t
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for (i, (&a, &b)) in dequant_ref(kind, &raw).iter().zip(&theirs).enumerate() {
            assert_eq!(a as f32, b, "{kind:?} hand-built value {i}");
        }
    }
}

#[test]
fn matrices_on_shared_pages_keep_their_products() {
    let mut rng = Rng(13);
    // Byte sizes that are not multiples of a cache line, so every start is rounded.
    let specs = [
        (GgmlKind::Q4_1, 37, 1536),
        (GgmlKind::Q8_0, 5, 2080),
        (GgmlKind::Q5_0, 37, 896),
        (GgmlKind::Q4K, 5, 4864),
        (GgmlKind::Q4_1, 64, 32),
        (GgmlKind::Q6K, 3, 256),
        (GgmlKind::Q8_0, 192, 576),
    ];
    let mut mats = Vec::new();
    let mut refs = Vec::new();
    for &(kind, rows, cols) in &specs {
        let raw = random_ggml(kind, rows, cols, &mut rng);
        mats.push(QMatrix::from_ggml(kind, &raw, rows, cols).unwrap());
        refs.push(dequant_ref(kind, &raw));
    }
    let kept = mats.clone();
    QMatrix::share_pages(mats.iter_mut());
    // One buffer, in the order given, no overlaps.
    for pair in mats.windows(2) {
        let end = pair[0].data.as_ptr() as usize + pair[0].data.len();
        assert!(end <= pair[1].data.as_ptr() as usize);
        assert!(pair[1].data.as_ptr() as usize - end < 64);
    }
    for ((qm, w), old) in mats.iter().zip(&refs).zip(&kept) {
        assert!(matches!(qm.data, Bytes::Shared { .. }));
        assert_eq!(&*qm.data, &*old.data);
        let (rows, cols) = (qm.rows(), qm.cols());
        for m in [1, 6] {
            let x: Vec<f32> = (0..m * cols).map(|_| rng.unit()).collect();
            for tier in tiers() {
                let mut y = vec![f32::NAN; m * rows];
                qm.matmul_with(tier, &x, m, &mut y);
                check(
                    w,
                    rows,
                    cols,
                    &x,
                    m,
                    &y,
                    &format!("shared {tier} [{rows},{cols}]"),
                );
            }
            let mut y = vec![f32::NAN; m * rows];
            QMatrix::matmul_concat(SpinPool::global(), &x, m, &[qm], &mut y);
            check(
                w,
                rows,
                cols,
                &super::activations_as_read(qm.kind(), &x, cols),
                m,
                &y,
                &format!("shared, concat [{rows},{cols}]"),
            );
        }
    }
}

#[test]
fn concatenated_products_match_the_reference_at_every_row_count() {
    // One activation layout (transposed once per call for the broadcast tiles) feeds
    // every matrix and thread; three threads split the columns unevenly.
    // Kinds mix as in a model's fused products (Qwen2.5's Q/K/V: Q5_0, Q5_0, Q8_0), and the
    // first matrix has no AVX-512 kernel, so the transposition must still happen for the
    // ones that do.
    let mut rng = Rng(17);
    let cols = 512;
    let specs = [
        (GgmlKind::Q5_0, 44),
        (GgmlKind::Q4_1, 72),
        (GgmlKind::Q8_0, 40),
        (GgmlKind::Q4K, 36),
        (GgmlKind::Q4_1, 8),
        (GgmlKind::Q6K, 20),
        (GgmlKind::Q5K, 12),
        (GgmlKind::Q4_0, 28),
    ];
    let (mats, refs) = random_parts(&specs, cols, &mut rng);
    let width: usize = mats.iter().map(QMatrix::rows).sum();
    let pools = [SpinPool::new(1), SpinPool::new(3)];
    for pool in &pools {
        for m in [1, 6, 13, 16, 24, 32, 33, 47, 70, 96] {
            let x: Vec<f32> = (0..m * cols).map(|_| rng.unit()).collect();
            let mut y = vec![f32::NAN; m * width];
            let refs_of: Vec<&QMatrix> = mats.iter().collect();
            QMatrix::matmul_concat(pool, &x, m, &refs_of, &mut y);
            let mut col = 0;
            for (qm, w) in mats.iter().zip(&refs) {
                let rows = qm.rows();
                let part = columns(&y, m, width, col, rows);
                let what = format!("concat, {} threads, m={m}, rows {rows}", pool.threads());
                let x = super::activations_as_read(qm.kind(), &x, cols);
                check(w, rows, cols, &x, m, &part, &what);
                col += rows;
            }
        }
    }
}

#[test]
fn wide_products_match_the_reference() {
    // Row counts that leave partial chunks; every kind, mixed in one product as in a fused
    // layer; 1 and 3 threads taking chunks in turn.
    let mut rng = Rng(23);
    let cols = 512;
    let specs = [
        (GgmlKind::Q4K, 300),
        (GgmlKind::Q6K, 40),
        (GgmlKind::Q5_0, 129),
        (GgmlKind::Q8_0, 17),
        (GgmlKind::Q4_0, 64),
        (GgmlKind::Q4_1, 33),
        (GgmlKind::Q5K, 140),
    ];
    let (mats, refs) = random_parts(&specs, cols, &mut rng);
    let width: usize = mats.iter().map(QMatrix::rows).sum();
    let refs_of: Vec<&QMatrix> = mats.iter().collect();
    for pool in [SpinPool::new(1), SpinPool::new(3)] {
        for m in [1, 7, 33, 130] {
            let x: Vec<f32> = (0..m * cols).map(|_| rng.unit()).collect();
            let mut y = vec![f32::NAN; m * width];
            QMatrix::matmul_wide(&pool, &x, m, &refs_of, &mut y);
            let mut col = 0;
            for (qm, w) in mats.iter().zip(&refs) {
                let rows = qm.rows();
                let part = columns(&y, m, width, col, rows);
                let what = format!("wide, {} threads, m={m}, {:?}", pool.threads(), qm.kind());
                // The activations rounded as the few-row products read them: the reference
                // fails a wide product that skipped the rounding (half a step per value is
                // far beyond the f32 bound).
                let x = super::activations_as_read(qm.kind(), &x, cols);
                check(w, rows, cols, &x, m, &part, &what);
                col += rows;
            }
        }
    }
}

#[test]
fn dequantized_rows_are_the_format_values_rounded_once() {
    // Both dequantizers (AVX2 where the CPU has it, and the portable one) against the f64
    // reference, from a row in the middle so the offsets are exercised.
    let mut rng = Rng(29);
    let (rows, cols) = (9, 512);
    for kind in GgmlKind::ALL {
        let raw = random_ggml(kind, rows, cols, &mut rng);
        let qm = QMatrix::from_ggml(kind, &raw, rows, cols).unwrap();
        let want = dequant_ref(kind, &raw);
        let g = QMatrix::geom_of(kind, cols);
        let mut fast = vec![f32::NAN; 5 * cols];
        qm.dequantize_rows(3, &mut fast);
        let mut portable = vec![f32::NAN; 5 * cols];
        scalar::dequant_rows(kind, g, &qm.ggml_rows(3, 5)[..5 * g.stride], &mut portable);
        for (what, got) in [("fast", &fast), ("portable", &portable)] {
            for (i, (&v, &r)) in got.iter().zip(&want[3 * cols..8 * cols]).enumerate() {
                let err = (f64::from(v) - r).abs();
                assert!(
                    err <= r.abs() * f64::powi(2.0, -24),
                    "{kind:?} {what}: value {i} is {v}, the format says {r}"
                );
            }
        }
    }
}

/// The tiers with integer kernels that this CPU runs and [`Tier::best`] allows (matrices
/// are interleaved for them only from the AVX2 tier up); the others are named as unverified.
fn int8_tiers() -> Vec<Tier> {
    let kernels = [Tier::Avx2, Tier::Avx512Vnni, Tier::Amx];
    for t in kernels {
        if !t.available() {
            eprintln!("tier {t}: integer kernels not verified here (CPU lacks it)");
        } else if t > Tier::best() {
            eprintln!(
                "tier {t}: integer kernels not verified here (above {})",
                crate::TIER_ENV
            );
        }
    }
    kernels
        .into_iter()
        .filter(|&t| t.available() && t <= Tier::best())
        .collect()
}

/// A row's 8-bit values and each value's step as the integer kernels of `kind` round it:
/// per block of 32, or per super-block of 256 for the K-quants.
fn rounded(kind: GgmlKind, x: &[f32]) -> (Vec<i8>, Vec<f32>) {
    if kind.is_k() {
        let act = q8::Q8KRow::quantize(x);
        let steps = (0..x.len()).map(|c| act.d[c / 256]).collect();
        (act.q, steps)
    } else {
        let act = q8::Q8Row::quantize(x);
        let steps = (0..x.len()).map(|c| act.d[c / 32]).collect();
        (act.q, steps)
    }
}

#[test]
fn integer_products_match_the_reference_on_their_rounded_activations() {
    // Every kind and integer tier, weight rows in fours and alone (5 and 9 rows), 1 to 6
    // activation rows spanning magnitudes across blocks, and 20 (the AMX tier's tiles, one
    // padded), an odd unit count (Q8 kinds: 17 units, the VNNI kernel's lone last unit). Against the f64 product of the format's
    // weights with the activations as rounded (exact but for f32 sums), and against the
    // unrounded activations within the rounding's bound: half a block's step per value.
    let mut rng = Rng(31);
    for tier in int8_tiers() {
        for kind in GgmlKind::ALL {
            let cols = if kind.block_len() == 256 { 512 } else { 544 };
            for (rows, m) in [(5, 1), (9, 3), (5, 6), (9, 20)] {
                let raw = random_ggml(kind, rows, cols, &mut rng);
                let qm = QMatrix::from_ggml(kind, &raw, rows, cols).unwrap();
                let w = dequant_ref(kind, &raw);
                let x: Vec<f32> = (0..m * cols)
                    .map(|i| rng.unit() * if i % 64 < 32 { 1.0 } else { 0.01 })
                    .collect();
                let mut y = vec![f32::NAN; m * rows];
                qm.matmul_int8(tier, &x, m, &mut y)
                    .expect("an integer tier");
                for i in 0..m {
                    let xi = &x[i * cols..(i + 1) * cols];
                    let (qs, steps) = rounded(kind, xi);
                    let u = f64::powi(2.0, -24);
                    let n = (cols / 32 + 16) as f64;
                    let gamma = 2.0 * n * u;
                    for r in 0..rows {
                        let (mut exact, mut mag, mut plain, mut bound) = (0f64, 0f64, 0f64, 0f64);
                        for c in 0..cols {
                            let wv = w[r * cols + c];
                            let step = f64::from(steps[c]);
                            let xq = step * f64::from(qs[c]);
                            exact += wv * xq;
                            mag += (wv * xq).abs();
                            plain += wv * f64::from(xi[c]);
                            bound += wv.abs() * step / 2.0;
                        }
                        let got = f64::from(y[i * rows + r]);
                        assert!(
                            (got - exact).abs() <= gamma * mag + 1e-30,
                            "{tier} {kind:?} {rows}x{m}, row {r} of x {i}: {got} vs {exact} on \
                             the rounded activations"
                        );
                        assert!(
                            (got - plain).abs() <= bound + gamma * mag + 1e-30,
                            "{tier} {kind:?} {rows}x{m}, row {r} of x {i}: {got} vs {plain}, \
                             beyond the rounding bound {bound}"
                        );
                    }
                }
            }
        }
    }
    // A block of zeros stays exact; q never leaves [-127, 127].
    let mut x = vec![0f32; 64];
    x[40] = -3.0;
    x[41] = 3.0;
    let act = q8::Q8Row::quantize(&x);
    assert_eq!(act.d[0], 0.0);
    assert!(act.q[..32].iter().all(|&v| v == 0));
    assert_eq!((act.q[40], act.q[41]), (-127, 127));
}

#[test]
fn byte_layout_matches_candle() {
    let mut rng = Rng(11);
    let (rows, cols) = (48, 768);
    let data: Vec<f32> = (0..rows * cols).map(|_| rng.unit()).collect();
    let t = Tensor::from_vec(data, (rows, cols), &Device::Cpu).unwrap();
    for kind in GgmlKind::ALL {
        let dt = dtype_of(kind);
        let q = QTensor::quantize(&t, dt).unwrap();
        let w: Vec<f64> = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect();
        let qm = QMatrix::from_ggml(kind, &q.data().unwrap(), rows, cols).unwrap();
        assert_eq!((qm.rows(), qm.cols()), (rows, cols));
        let m = 3;
        let x: Vec<f32> = (0..m * cols).map(|_| rng.unit()).collect();
        for tier in tiers() {
            let mut y = vec![0f32; m * rows];
            qm.matmul_with(tier, &x, m, &mut y);
            check(&w, rows, cols, &x, m, &y, &format!("candle {dt:?} {tier}"));
        }
    }
}

#[test]
fn rejects_bad_shapes() {
    assert!(QMatrix::from_ggml(GgmlKind::Q4_1, &[0; 20], 1, 16).is_err());
    assert!(QMatrix::from_ggml(GgmlKind::Q4_1, &[0; 21], 1, 32).is_err());
    assert!(QMatrix::from_ggml(GgmlKind::Q8_0, &[0; 34 * 2], 2, 32).is_ok());
    // K-quants need whole super-blocks of 256 per row.
    assert!(QMatrix::from_ggml(GgmlKind::Q4K, &[0; 144], 1, 256).is_ok());
    assert!(QMatrix::from_ggml(GgmlKind::Q4K, &[0; 144], 2, 128).is_err());
    assert!(QMatrix::from_ggml(GgmlKind::Q6K, &[0; 210 * 2], 1, 288).is_err());
}

#[test]
fn integer_products_of_a_batch_equal_each_row_alone_bit_for_bit() {
    // Batch sizes 1-16, 33 and 70 within each integer tier, every kind: row i of a batch's
    // product is the product of row i alone, to the bit (the batch-invariance the engine's
    // greedy decoding relies on). The second shape's rows are wide enough that the many-row
    // loop cuts them into several cached blocks, with an odd row left over.
    let mut rng = Rng(77);
    const M: usize = 70;
    for tier in int8_tiers() {
        for kind in GgmlKind::ALL {
            for (rows, cols) in [(9, 512), (75, 4864)] {
                let raw = random_ggml(kind, rows, cols, &mut rng);
                let qm = QMatrix::from_ggml(kind, &raw, rows, cols).unwrap();
                let x: Vec<f32> = (0..M * cols).map(|_| rng.unit()).collect();
                let mut alone = vec![0f32; M * rows];
                for i in 0..M {
                    let out = &mut alone[i * rows..(i + 1) * rows];
                    qm.matmul_int8(tier, &x[i * cols..(i + 1) * cols], 1, out)
                        .unwrap();
                }
                for m in (1..=16).chain([33, M]) {
                    let mut y = vec![0f32; m * rows];
                    qm.matmul_int8(tier, &x[..m * cols], m, &mut y).unwrap();
                    for (k, (a, b)) in y.iter().zip(&alone).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{tier} {kind:?} [{rows}, {cols}] batch {m}: row {} output {}",
                            k / rows,
                            k % rows
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn k_quant_tables_left_where_they_are_stored_read_back_their_rows() {
    let mut rng = Rng(29);
    for kind in [GgmlKind::Q4K, GgmlKind::Q5K, GgmlKind::Q6K] {
        let (rows, cols) = (21, 512);
        let raw = random_ggml(kind, rows, cols, &mut rng);
        let want = dequant_ref(kind, &raw);
        // The matrix at byte 7 of a buffer, then 64 bytes that belong to something else.
        let mut buf = vec![0xa5u8; 7];
        buf.extend_from_slice(&raw);
        buf.extend_from_slice(&[0x5a; 64]);
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(buf);
        let m = QMatrix::from_stored(kind, rows, cols, Arc::clone(&owner), 7)
            .unwrap()
            .expect("a K-quant with its slack");
        assert!(matches!(m.data, Bytes::Stored(_)) && !m.interleaved);
        for (r0, n) in [(0, 1), (5, 3), (20, 1), (0, rows)] {
            let mut got = vec![f32::NAN; n * cols];
            m.dequantize_rows(r0, &mut got);
            for (i, (&g, &w)) in got.iter().zip(&want[r0 * cols..]).enumerate() {
                assert!(
                    (f64::from(g) - w).abs() <= 1e-6 * w.abs().max(1.0),
                    "{kind:?} row {}: {g} vs {w}",
                    r0 + i / cols
                );
            }
        }
        // Too little room after it, a range past the end: not stored, or refused.
        let short: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(raw.clone());
        assert!(QMatrix::from_stored(kind, rows, cols, short, 0)
            .unwrap()
            .is_none());
        assert!(QMatrix::from_stored(kind, rows, cols, owner, 100).is_err());
    }
    let raw = random_ggml(GgmlKind::Q4_0, 2, 64, &mut rng);
    let mut buf = raw.clone();
    buf.extend_from_slice(&[0; 64]);
    let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(buf);
    assert!(QMatrix::from_stored(GgmlKind::Q4_0, 2, 64, owner, 0)
        .unwrap()
        .is_none());
}

#[test]
fn feature_major_outputs_land_in_their_rows_and_columns() {
    // Whole 16 x 16 blocks (transposed in registers on AVX-512) and ragged edges, a subset
    // of the activation rows, an offset column: every output where the plain index says.
    for (n, m, rows, stride, col) in [
        (37, 53, 5..50, 45, 3),
        (32, 32, 0..32, 32, 0),
        (16, 17, 1..17, 20, 4),
    ] {
        let yt: Vec<f32> = (0..n * m).map(|v| v as f32).collect();
        let mut y = vec![f32::NAN; rows.len() * stride];
        super::feature_major_rows_into(&yt, m, rows.clone(), &mut y, stride, col);
        for (k, i) in rows.clone().enumerate() {
            for c in 0..stride {
                let want = if (col..col + n).contains(&c) {
                    ((c - col) * m + i) as f32
                } else {
                    f32::NAN
                };
                let got = y[k * stride + c];
                assert!(
                    got == want || (got.is_nan() && want.is_nan()),
                    "row {k} column {c}: {got} != {want}"
                );
            }
        }
    }
}
