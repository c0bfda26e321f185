//! The one entry to the gemm crate: f32 matrix products with many rows.

/// `y: [m, out] = x: [m, inp] W^T` with `W(i, k) = w[i * rs + k * cs]` for `(rs, cs) =
/// strides`, on gemm's f32 kernels (its run-time dispatch picks AVX-512 where the CPU has it),
/// split over `threads` of rayon's pool (1: on the calling thread).
///
/// # Panics
/// If a length does not match, or `w` is too short for the strides.
// The shape, the weight with its strides, the activations and the thread count: one call's
// parameters, each used once; a struct would only rename them.
#[allow(clippy::too_many_arguments)]
pub fn gemm_into(
    out: usize,
    inp: usize,
    w: &[f32],
    strides: (usize, usize),
    x: &[f32],
    m: usize,
    y: &mut [f32],
    threads: usize,
) {
    let (rs, cs) = strides;
    assert_eq!(x.len(), m * inp, "x must be [m, in]");
    assert_eq!(y.len(), m * out, "y must be [m, out]");
    if m == 0 || out == 0 {
        return;
    }
    if inp == 0 {
        y.fill(0.0);
        return;
    }
    assert!(
        (out - 1) * rs + (inp - 1) * cs < w.len(),
        "weight too short for its strides"
    );
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // gemm's view is column-major: dst = y^T [out, m], lhs = W [out, inp], rhs = x^T [inp, m].
    // SAFETY: every index gemm forms is (i, j) with i < out, j < m for dst (offset j * out + i <
    // y.len()), (i, k) with k < inp for lhs (offset i * rs + k * cs < w.len(), asserted above),
    // and (k, j) for rhs (offset j * inp + k < x.len()); dst does not alias lhs or rhs (it is a
    // unique borrow), and read_dst = false so y's old contents are not read.
    unsafe {
        gemm::gemm(
            out,
            m,
            inp,
            y.as_mut_ptr(),
            out as isize,
            1,
            false,
            w.as_ptr(),
            cs as isize,
            rs as isize,
            x.as_ptr(),
            inp as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}
