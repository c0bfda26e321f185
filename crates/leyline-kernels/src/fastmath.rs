//! Branch-free elementwise functions that the compiler vectorizes (libm's `expf` is a
//! call per element).

use crate::Tier;

/// `2^x` for `x <= 0` (what the online softmax needs), within 2e-7 relative, and exactly 0
/// below `2^-126` (masked scores are `-inf`). Branch-free, so loops over it vectorize.
#[inline(always)]
pub fn exp2(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    let xc = x.max(-126.0);
    // Round to nearest through the f32 mantissa: the low bits of `y` then hold `n`.
    let y = xc + MAGIC;
    let n = y - MAGIC;
    let f = xc - n;
    // Taylor series of e^(f ln 2) on |f| <= 0.5, degree 7.
    let p = 1.525_273_4e-5_f32;
    let p = p.mul_add(f, 1.540_353e-4);
    let p = p.mul_add(f, 1.333_355_8e-3);
    let p = p.mul_add(f, 9.618_129e-3);
    let p = p.mul_add(f, 5.550_411e-2);
    let p = p.mul_add(f, 2.402_265e-1);
    let p = p.mul_add(f, std::f32::consts::LN_2);
    let p = p.mul_add(f, 1.0);
    // `n + 127` as a biased exponent, without a float-to-int conversion.
    let e = y.to_bits().wrapping_sub(MAGIC.to_bits()).wrapping_add(127) << 23;
    let r = p * f32::from_bits(e);
    if x < -126.0 {
        0.0
    } else {
        r
    }
}

/// SwiGLU: `out = g * sigmoid(g) * u` elementwise, where each row of `gu` holds `g` and then
/// `u`, `width` values each (the fused gate/up product), within a few ulp of the f64 value.
/// Compiled once more for AVX-512 / AVX2+FMA and run on [`Tier::best`]: in code built for
/// baseline x86-64, `mul_add` is a library call per element.
pub fn silu_mul(gu: &[f32], width: usize, out: &mut [f32]) {
    silu_mul_with(Tier::best(), gu, width, out);
}

/// [`silu_mul`] on the code compiled for `tier`.
///
/// # Panics
/// If this CPU does not run `tier`.
fn silu_mul_with(tier: Tier, gu: &[f32], width: usize, out: &mut [f32]) {
    assert!(
        tier.available(),
        "kernel tier {tier} is not available on this CPU"
    );
    match tier {
        // SAFETY: the CPU runs the AVX-512 tier (asserted just above): it has AVX-512F.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512 | Tier::Avx512Vnni | Tier::Amx => unsafe { silu_mul_avx512(gu, width, out) },
        // SAFETY: the CPU runs the AVX2 tier (asserted just above): it has AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 => unsafe { silu_mul_avx2(gu, width, out) },
        _ => silu_mul_portable(gu, width, out),
    }
}

/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(gu: &[f32], width: usize, out: &mut [f32]) {
    silu_mul_portable(gu, width, out);
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(gu: &[f32], width: usize, out: &mut [f32]) {
    silu_mul_portable(gu, width, out);
}

#[inline(always)]
fn silu_mul_portable(gu: &[f32], width: usize, out: &mut [f32]) {
    for (row, o) in gu.chunks_exact(2 * width).zip(out.chunks_exact_mut(width)) {
        let (g, u) = row.split_at(width);
        for ((o, &x), &v) in o.iter_mut().zip(g).zip(u) {
            // e^-|x| <= 1 never overflows; sigmoid(-|x|) = e / (1 + e).
            let e = exp2(-x.abs() * std::f32::consts::LOG2_E);
            let s = 1.0 / (1.0 + e);
            let sig = if x >= 0.0 { s } else { e * s };
            *o = x * sig * v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp2_is_accurate_on_the_softmax_range() {
        let mut worst = 0f64;
        let mut x = -126.0f32;
        while x <= 0.0 {
            let want = (x as f64).exp2();
            let got = exp2(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.003_7;
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
        assert_eq!(exp2(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2(0.0), 1.0);
    }

    #[test]
    fn silu_mul_matches_f64() {
        let xs: Vec<f32> = (0..20_001).map(|i| (i as f32 - 10_000.0) * 0.004).collect();
        let us: Vec<f32> = xs.iter().map(|x| 0.5 - x * 0.01).collect();
        let gu: Vec<f32> = xs.iter().chain(&us).copied().collect();
        let mut g = vec![f32::NAN; xs.len()];
        silu_mul(&gu, xs.len(), &mut g);
        // Every tier computes the portable loop's values.
        let mut portable = vec![f32::NAN; xs.len()];
        silu_mul_portable(&gu, xs.len(), &mut portable);
        Tier::note_lacking();
        for tier in Tier::all_available() {
            let mut t = vec![f32::NAN; xs.len()];
            silu_mul_with(tier, &gu, xs.len(), &mut t);
            for ((&x, &got), &p) in xs.iter().zip(&t).zip(&portable) {
                assert_eq!(
                    got.to_bits(),
                    p.to_bits(),
                    "x = {x}: {tier} {got}, portable {p}"
                );
            }
        }
        for ((&x, &u), &got) in xs.iter().zip(&us).zip(&g) {
            let (x, u) = (f64::from(x), f64::from(u));
            let want = x / (1.0 + (-x).exp()) * u;
            // The f32 argument `-|x| log2(e)` carries a relative rounding of 2^-24, which
            // moves e^-|x| by about |x| * 6e-8 relative; f32 products add a few 2^-24.
            let tol = (4e-7 + 1e-7 * x.abs()) * want.abs();
            let err = (f64::from(got) - want).abs();
            assert!(err <= tol, "x = {x}: {got} vs {want}");
        }
        // Two rows: each row's gate meets its own up values.
        let gu = [
            100.0f32, -100.0, 0.0, 1.0, 1.0, 1.0, 0.0, 50.0, 80.0, 7.0, 2.0, -1.0,
        ];
        let mut big = [f32::NAN; 6];
        silu_mul(&gu, 3, &mut big);
        assert_eq!(big, [100.0, -0.0, 0.0, 0.0, 100.0, -80.0]);
    }
}
