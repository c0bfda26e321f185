use super::*;
use crate::rope::RopeScaling;
use half::{bf16, f16};

/// splitmix64: seeded, dependency-free test data.
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
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Dt {
    F32,
    F16,
    Bf16,
}

enum Buf {
    F32(Vec<f32>),
    F16(Vec<u16>),
    Bf16(Vec<u16>),
}

impl Buf {
    /// Rounds through `half` (independent of this module's bit tricks).
    fn from_f64(dt: Dt, v: &[f64]) -> Buf {
        match dt {
            Dt::F32 => Buf::F32(v.iter().map(|&x| x as f32).collect()),
            Dt::F16 => Buf::F16(v.iter().map(|&x| f16::from_f64(x).to_bits()).collect()),
            Dt::Bf16 => Buf::Bf16(v.iter().map(|&x| bf16::from_f64(x).to_bits()).collect()),
        }
    }
    fn to_f64(&self) -> Vec<f64> {
        match self {
            Buf::F32(b) => b.iter().map(|&x| x as f64).collect(),
            Buf::F16(b) => b.iter().map(|&x| f16::from_bits(x).to_f64()).collect(),
            Buf::Bf16(b) => b.iter().map(|&x| bf16::from_bits(x).to_f64()).collect(),
        }
    }
    fn bits(&self) -> Vec<u32> {
        match self {
            Buf::F32(b) => b.iter().map(|x| x.to_bits()).collect(),
            Buf::F16(b) | Buf::Bf16(b) => b.iter().map(|&x| x as u32).collect(),
        }
    }
    /// Bits, with every NaN as one value: which NaN operand a sum of two NaNs returns is up
    /// to the compiler (it may commute `a + b`), so no path can promise it.
    fn bits_nan_as_one(&self) -> Vec<u32> {
        let nan = |n: bool, b: u32| if n { u32::MAX } else { b };
        match self {
            Buf::F32(b) => b.iter().map(|x| nan(x.is_nan(), x.to_bits())).collect(),
            Buf::F16(b) => b
                .iter()
                .map(|&x| nan(f16::from_bits(x).is_nan(), x as u32))
                .collect(),
            Buf::Bf16(b) => b
                .iter()
                .map(|&x| nan(bf16::from_bits(x).is_nan(), x as u32))
                .collect(),
        }
    }
    fn rows(&mut self) -> RowsMut<'_> {
        match self {
            Buf::F32(b) => RowsMut::F32(b),
            Buf::F16(b) => RowsMut::F16(b),
            Buf::Bf16(b) => RowsMut::Bf16(b),
        }
    }
}

/// Unit roundoff of the storage type.
fn unit_roundoff(dt: Dt) -> f64 {
    match dt {
        Dt::F32 => 2f64.powi(-24),
        Dt::F16 => 2f64.powi(-11),
        Dt::Bf16 => 2f64.powi(-8),
    }
}

/// Independent f64 RoPE: pairs by layout, frequency `1 / (theta^(2i/rd) * factor * ff[i])`
/// (`ff` empty: no per-frequency factors).
fn ref_rope(
    x: &[f64],
    pos: f64,
    theta: f64,
    rd: usize,
    (factor, ff): (f64, &[f64]),
    layout: RotaryLayout,
) -> Vec<f64> {
    let mut y = x.to_vec();
    for i in 0..rd / 2 {
        let f = 1.0 / (theta.powf(2.0 * i as f64 / rd as f64) * factor * ff.get(i).unwrap_or(&1.0));
        let (j0, j1) = match layout {
            RotaryLayout::Interleaved => (2 * i, 2 * i + 1),
            RotaryLayout::Neox => (i, i + rd / 2),
        };
        let (c, s) = ((pos * f).cos(), (pos * f).sin());
        y[j0] = x[j0] * c - x[j1] * s;
        y[j1] = x[j0] * s + x[j1] * c;
    }
    y
}

fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

const DELTAS: [i64; 11] = [0, 1, -1, 127, -127, 128, -128, 129, -129, 1024, -1024];

/// Keys rotated to p, stored, shifted by delta, vs keys rotated from scratch to p + delta.
#[test]
fn shift_equals_rotation_from_scratch() {
    let (k_heads, head_dim, cap) = (3usize, 64usize, 12usize);
    let width = k_heads * head_dim;
    let theta = 10000.0;
    let mut rng = Rng(7);
    let pre: Vec<Vec<f64>> = (0..cap)
        .map(|_| (0..width).map(|_| rng.unit()).collect())
        .collect();
    let pos = |s: usize| 3000.0 + 13.0 * s as f64;
    let shifted: Vec<u32> = vec![1, 4, 5, 6, 10];
    // Llama 3-like per-frequency factors (1 for short wavelengths, 8 for long ones, a ramp
    // between), composed with a linear factor: what a GGUF `rope_freqs.weight` carries.
    let ff: Vec<f64> = (0..32)
        .map(|i| 1.0 + 7.0 * (i as f64 / 31.0).powi(2))
        .collect();
    for layout in [RotaryLayout::Interleaved, RotaryLayout::Neox] {
        for (rd, factor, ff) in [(64usize, 1.0, &[][..]), (32, 1.5, &[]), (64, 2.0, &ff[..])] {
            let scaling = if factor == 1.0 {
                RopeScaling::None
            } else {
                RopeScaling::Linear { factor }
            };
            let spec = RopeSpec {
                theta,
                head_dim,
                rotary_dim: rd,
                layout,
                scaling,
                freq_factors: (!ff.is_empty()).then(|| ff.into()),
            };
            let at = |s: usize, p: f64| -> Vec<f64> {
                pre[s]
                    .chunks(head_dim)
                    .flat_map(|h| ref_rope(h, p, theta, rd, (factor, ff), layout))
                    .collect()
            };
            for dt in [Dt::F32, Dt::F16, Dt::Bf16] {
                let bound = 2.0 * unit_roundoff(dt) + 1e-6;
                let mut worst = 0f64;
                for delta in DELTAS {
                    let start: Vec<f64> = (0..cap).flat_map(|s| at(s, pos(s))).collect();
                    let mut buf = Buf::from_f64(dt, &start);
                    let before = buf.bits();
                    shift_rows(buf.rows(), k_heads, head_dim, &shifted, &spec, delta).unwrap();
                    let after = buf.to_f64();
                    let bits = buf.bits();
                    for s in 0..cap {
                        let row = s * width..(s + 1) * width;
                        if !shifted.contains(&(s as u32)) {
                            assert_eq!(bits[row.clone()], before[row], "slot {s} untouched");
                            continue;
                        }
                        let want = at(s, pos(s) + delta as f64);
                        let e = rel_l2(&after[row.clone()], &want);
                        worst = worst.max(e);
                        assert!(
                            e <= bound,
                            "{layout:?} rd {rd} {dt:?} delta {delta}: {e} > {bound}"
                        );
                        for h in 0..k_heads {
                            let tail =
                                s * width + h * head_dim + rd..s * width + (h + 1) * head_dim;
                            assert_eq!(bits[tail.clone()], before[tail], "non-rotary tail kept");
                        }
                    }
                }
                if dt == Dt::F32 {
                    assert!(
                        worst > 0.0,
                        "a rounding-free result would mean nothing was checked"
                    );
                }
            }
        }
    }
}

#[test]
fn contiguous_range_equals_list() {
    let spec = RopeSpec::plain(10000.0, 16, RotaryLayout::Neox);
    let mut rng = Rng(3);
    let v: Vec<f64> = (0..10 * 32).map(|_| rng.unit()).collect();
    let (mut a, mut b) = (Buf::from_f64(Dt::Bf16, &v), Buf::from_f64(Dt::Bf16, &v));
    shift_rows(a.rows(), 2, 16, &[2, 3, 4, 5], &spec, -77).unwrap();
    shift_rows_range(b.rows(), 2, 16, 2..6, &spec, -77).unwrap();
    assert_eq!(a.bits(), b.bits());
    assert!(shift_rows_range(b.rows(), 2, 16, 8..11, &spec, 1).is_err());
    shift_rows_range(b.rows(), 2, 16, 4..4, &spec, 1).unwrap();
}

/// A YaRN spec with an attention factor != 1: 100 shifts must keep every norm, and land
/// where one rotation by the sum lands.
#[test]
fn yarn_norms_survive_100_shifts() {
    let spec = RopeSpec {
        theta: 10000.0,
        head_dim: 24,
        rotary_dim: 8,
        layout: RotaryLayout::Interleaved,
        scaling: RopeScaling::Yarn {
            factor: 40.0,
            original_max_position: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 0.0,
        },
        freq_factors: None,
    };
    assert!(spec.attention_factor() > 1.3);
    let mut rng = Rng(11);
    let v: Vec<f32> = (0..4 * 24).map(|_| rng.unit() as f32).collect();
    let mut buf = v.clone();
    let mut total = 0i64;
    for _ in 0..100 {
        let d = (rng.next() % 2001) as i64 - 1000;
        total += d;
        shift_rows(RowsMut::F32(&mut buf), 1, 24, &[0, 1, 2, 3], &spec, d).unwrap();
    }
    let mut once = v.clone();
    shift_rows(RowsMut::F32(&mut once), 1, 24, &[0, 1, 2, 3], &spec, total).unwrap();
    for s in 0..4 {
        let r = s * 24..(s + 1) * 24;
        let n = |x: &[f32]| x.iter().map(|&a| (a as f64).powi(2)).sum::<f64>().sqrt();
        let (n0, n1) = (n(&v[r.clone()]), n(&buf[r.clone()]));
        assert!((n1 / n0 - 1.0).abs() < 2e-5, "norm ratio {}", n1 / n0);
        let a: Vec<f64> = buf[r.clone()].iter().map(|&x| x as f64).collect();
        let b: Vec<f64> = once[r].iter().map(|&x| x as f64).collect();
        assert!(rel_l2(&a, &b) < 2e-5);
    }
}

/// Every SIMD tier this CPU runs equals the portable tier bit for bit (odd shapes,
/// specials), except for the sign/payload of a NaN computed from two NaNs.
#[test]
fn simd_paths_equal_portable() {
    let specials = [
        f32::NAN,
        f32::INFINITY,
        -0.0,
        1e-40,
        6.0e-8,
        70000.0,
        65519.0,
        3.0e38,
        -f32::NAN,
    ];
    let mut tested = 0;
    Tier::note_lacking();
    for tier in Tier::all_available() {
        if tier == Tier::Portable {
            continue;
        }
        for (k_heads, head_dim, rd) in [
            (3, 64, 64),
            (2, 24, 18),
            (1, 8, 8),
            (4, 128, 64),
            (5, 6, 2),
            (3, 64, 32),
            (2, 100, 98),
            (1, 256, 256),
            (2, 96, 80),
        ] {
            for layout in [RotaryLayout::Interleaved, RotaryLayout::Neox] {
                let spec = RopeSpec {
                    rotary_dim: rd,
                    ..RopeSpec::plain(1e6, head_dim, layout)
                };
                let mut rng = Rng(rd as u64 * 31 + head_dim as u64);
                let n = 9 * k_heads * head_dim;
                let mut v: Vec<f64> = (0..n).map(|_| rng.unit() * 4.0).collect();
                for (i, &s) in specials.iter().enumerate() {
                    v[i * 7 % n] = s as f64;
                }
                // A pair of NaNs (which payload wins is part of the operation order).
                let last = n - head_dim;
                v[last] = f64::NAN;
                v[last + 1] = -f64::NAN;
                v[last + rd / 2] = -f64::NAN;
                for dt in [Dt::F32, Dt::F16, Dt::Bf16] {
                    for delta in [1i64, -129, 100_003] {
                        let rot = shift_table(&spec, delta).unwrap();
                        let slots = [0u32, 2, 3, 8, 5];
                        let (mut a, mut b) = (Buf::from_f64(dt, &v), Buf::from_f64(dt, &v));
                        shift_rows_with(a.rows(), k_heads, head_dim, &slots, &rot, Tier::Portable)
                            .unwrap();
                        shift_rows_with(b.rows(), k_heads, head_dim, &slots, &rot, tier).unwrap();
                        assert_eq!(
                            a.bits_nan_as_one(),
                            b.bits_nan_as_one(),
                            "{tier} {dt:?} {layout:?} {head_dim}/{rd}"
                        );
                        tested += 1;
                    }
                }
            }
        }
    }
    eprintln!("{tested} SIMD comparisons");
}

/// Contiguous ranges run the same kernels as lists, on every tier.
#[test]
fn range_selection_on_every_tier() {
    Tier::note_lacking();
    for layout in [RotaryLayout::Interleaved, RotaryLayout::Neox] {
        let spec = RopeSpec::plain(10000.0, 64, layout);
        let rot = shift_table(&spec, 333).unwrap();
        let mut rng = Rng(23);
        let v: Vec<f64> = (0..20 * 3 * 64).map(|_| rng.unit()).collect();
        for dt in [Dt::F32, Dt::F16, Dt::Bf16] {
            let mut want = Buf::from_f64(dt, &v);
            let list: Vec<u32> = (3..17).collect();
            shift_rows_with(want.rows(), 3, 64, &list, &rot, Tier::Portable).unwrap();
            for tier in Tier::all_available() {
                let mut got = Buf::from_f64(dt, &v);
                let rows = got.rows();
                let head = check_rows(&rows, 3, 64, &rot).unwrap();
                dispatch(rows, head, &Sel::Range(3..17), &rot, tier);
                assert_eq!(got.bits(), want.bits(), "{tier} {dt:?} {layout:?}");
            }
        }
    }
}

/// The SIMD store conversions (f16 by F16C, bf16 by integer rounding) equal the scalar
/// ones bit for bit, NaN payloads included: random bit patterns and every edge.
#[test]
fn simd_conversions_equal_scalar() {
    let mut rng = Rng(29);
    let mut xs: Vec<f32> = (0..400_000)
        .map(|_| f32::from_bits(rng.next() as u32))
        .collect();
    for h in 0..=u16::MAX {
        let lo = f16::from_bits(h).to_f32();
        xs.extend([lo, f32::from_bits(lo.to_bits() + (1 << 12))]);
        xs.push(f32::from_bits(((h as u32) << 16) | 0x8000));
        xs.push(f32::from_bits(((h as u32) << 16) | 0xffff));
    }
    xs.extend([f32::from_bits(0x7f80_0001), f32::from_bits(0x7fff_ffff)]);
    xs.extend([f32::from_bits(0xffa0_1234), f32::MAX, f32::MIN_POSITIVE]);
    let mut checked = 0;
    Tier::note_lacking();
    for tier in Tier::all_available() {
        match tier {
            Tier::Portable => {}
            Tier::Avx2 => {
                for x in xs.chunks_exact(8) {
                    let x: &[f32; 8] = x.try_into().unwrap();
                    let (h, b) = avx2::convert(x);
                    for k in 0..8 {
                        assert_eq!(h[k], f32_to_f16(x[k]), "f16 of {:#x}", x[k].to_bits());
                        assert_eq!(b[k], f32_to_bf16(x[k]), "bf16 of {:#x}", x[k].to_bits());
                    }
                    checked += 1;
                }
            }
            Tier::Avx512 | Tier::Avx512Vnni | Tier::Amx => {
                for x in xs.chunks_exact(16) {
                    let x: &[f32; 16] = x.try_into().unwrap();
                    let (h, b) = avx512::convert(x);
                    for k in 0..16 {
                        assert_eq!(h[k], f32_to_f16(x[k]), "f16 of {:#x}", x[k].to_bits());
                        assert_eq!(b[k], f32_to_bf16(x[k]), "bf16 of {:#x}", x[k].to_bits());
                    }
                    checked += 1;
                }
            }
        }
    }
    eprintln!("{checked} SIMD conversion blocks");
}

#[test]
fn bit_conversions_match_half() {
    for h in 0..=u16::MAX {
        let (a, b) = (f16_to_f32(h), f16::from_bits(h).to_f32());
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "f16 {h:#06x}"
        );
        let (a, b) = (bf16_to_f32(h), bf16::from_bits(h).to_f32());
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "bf16 {h:#06x}"
        );
    }
    let mut rng = Rng(5);
    let check = |x: f32| {
        let (a, b) = (f32_to_f16(x), f16::from_f32(x).to_bits());
        assert!(
            a == b || (x.is_nan() && f16::from_bits(a).is_nan()),
            "f16 of {x:e}: {a:#x} vs {b:#x}"
        );
        let (a, b) = (f32_to_bf16(x), bf16::from_f32(x).to_bits());
        assert!(
            a == b || (x.is_nan() && bf16::from_bits(a).is_nan()),
            "bf16 of {x:e}: {a:#x} vs {b:#x}"
        );
    };
    for _ in 0..2_000_000 {
        check(f32::from_bits(rng.next() as u32));
    }
    // Ties and edges: halfway points of both grids, subnormals, overflow.
    for h in 0..=u16::MAX {
        let lo = f16::from_bits(h).to_f32();
        check(lo);
        check(f32::from_bits(lo.to_bits() + (1 << 12)));
        check(f32::from_bits(lo.to_bits() + (1 << 12) + 1));
        let lo = bf16::from_bits(h).to_f32();
        check(f32::from_bits(lo.to_bits() + 0x8000));
    }
    for x in [
        65504.0,
        65519.99,
        65520.0,
        1e9,
        5.96e-8,
        2.98e-8,
        2.99e-8,
        6.1e-5,
        f32::MAX,
    ] {
        check(x);
        check(-x);
    }
}

#[test]
fn bad_input_is_refused_before_writing() {
    let spec = RopeSpec::plain(10000.0, 8, RotaryLayout::Neox);
    let mut v = vec![1.0f32; 32];
    let e = shift_rows(RowsMut::F32(&mut v), 2, 8, &[0, 2], &spec, 3).unwrap_err();
    assert_eq!(e, KernelError::RowOutOfRange { row: 2, rows: 2 });
    assert!(v.iter().all(|&x| x == 1.0), "nothing written on error");
    assert!(matches!(
        shift_rows(RowsMut::F32(&mut v[..30]), 2, 8, &[0], &spec, 3),
        Err(KernelError::WidthMismatch { .. })
    ));
    assert!(matches!(
        shift_rows(RowsMut::F32(&mut v), 4, 4, &[0], &spec, 3),
        Err(KernelError::InvalidRope(_))
    ));
    let ntk = RopeSpec {
        scaling: RopeScaling::DynamicNtk {
            factor: 2.0,
            original_max_position: 2048.0,
        },
        ..spec
    };
    assert!(matches!(
        shift_rows(RowsMut::F32(&mut v), 2, 8, &[0], &ntk, 3),
        Err(KernelError::NotShiftable(_))
    ));
}

/// bf16 arithmetic drifts more than f32 arithmetic over a chain of shifts.
#[test]
fn lowprec_rotation_drifts_more() {
    let spec = RopeSpec::plain(10000.0, 64, RotaryLayout::Neox);
    let mut rng = Rng(19);
    let pre: Vec<f64> = (0..8 * 64).map(|_| rng.unit()).collect();
    let (mut hi, mut lo) = (Buf::from_f64(Dt::Bf16, &pre), Buf::from_f64(Dt::Bf16, &pre));
    let slots: Vec<u32> = (0..8).collect();
    for _ in 0..20 {
        shift_rows(hi.rows(), 1, 64, &slots, &spec, 37).unwrap();
        shift_rows_lowprec(lo.rows(), 1, 64, &slots, &spec, 37).unwrap();
    }
    let want: Vec<f64> = pre
        .chunks(64)
        .flat_map(|h| ref_rope(h, 740.0, 10000.0, 64, (1.0, &[]), RotaryLayout::Neox))
        .collect();
    let (e_hi, e_lo) = (rel_l2(&hi.to_f64(), &want), rel_l2(&lo.to_f64(), &want));
    assert!(e_hi < e_lo, "f32 math {e_hi} vs bf16 math {e_lo}");
    assert!(e_hi < 20.0 * 2f64.powi(-8));
}
