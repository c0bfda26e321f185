//! Scalar conversions between f32 and the 16-bit storage formats (bf16, f16): widening is
//! exact, narrowing rounds once to nearest even. The pool's storage and the rotation kernels
//! both use them (the SIMD kernels round the same way).

/// bf16 bits to f32: exact, a shift.
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 to bf16 bits, round to nearest even; NaN stays a (quiet) NaN.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) as u16) | 0x0040;
    if x.is_nan() {
        nan
    } else {
        rounded
    }
}

/// f16 bits to f32: exact, including subnormals, infinities and NaN.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let em = (h & 0x7fff) as u32;
    let exp = em & 0x7c00;
    // Normal: rebias the exponent (+112 << 23 after the shift).
    let normal = (em << 13) + (112 << 23);
    // Inf/NaN: exponent all ones.
    let special = (em << 13) | 0x7f80_0000;
    // Subnormal: value = mantissa * 2^-24, exact in f32.
    let sub = ((em as f32) * f32::from_bits(0x3380_0000)).to_bits(); // 2^-24
    let mag = if exp == 0x7c00 {
        special
    } else if exp == 0 {
        sub
    } else {
        normal
    };
    f32::from_bits(mag | sign)
}

/// f32 to f16 bits, round to nearest even; overflow to infinity. A NaN stays NaN, quiet, with
/// the top 9 payload bits kept (as the x86 F16C conversion does).
#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let a = b & 0x7fff_ffff;
    // Normal range: rebias, then round the 13 dropped bits to nearest even.
    let normal = {
        let r = a.wrapping_sub(112 << 23);
        (r.wrapping_add(0x0fff + ((r >> 13) & 1)) >> 13) as u16
    };
    // Subnormal range (|x| < 2^-14): adding 0.5 makes the FPU round to the 2^-24 grid (RNE).
    let sub = (f32::from_bits(a) + 0.5f32)
        .to_bits()
        .wrapping_sub(0.5f32.to_bits()) as u16;
    let mag = if a > 0x7f80_0000 {
        0x7e00 | ((a >> 13) & 0x1ff) as u16
    } else if a >= 0x4780_0000 {
        // >= 65536: infinity (65520 and up round to infinity via `normal` too).
        0x7c00
    } else if a < 0x3880_0000 {
        sub
    } else {
        normal.min(0x7c00)
    };
    mag | sign
}
