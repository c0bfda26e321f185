//! The portable score products: plain Rust loops that the compiler vectorizes.

use super::task::KB;

/// [`super::kernel::scores`] without SIMD intrinsics: four keys against 16 query lanes
/// at a time.
pub(super) fn scores_portable(
    qt: &[f32],
    lanes: usize,
    krows: &[&[f32]; KB],
    st: &mut [f32],
    hd: usize,
) {
    for c0 in (0..lanes).step_by(16) {
        for (kg, sg) in krows.chunks_exact(4).zip(st.chunks_exact_mut(4 * lanes)) {
            let mut acc = [[0f32; 16]; 4];
            for (d, col) in qt.chunks_exact(lanes).take(hd).enumerate() {
                let qv: &[f32; 16] = col[c0..c0 + 16].try_into().expect("16 lanes");
                for (a, kr) in acc.iter_mut().zip(kg) {
                    let kd = kr[d];
                    for (x, &y) in a.iter_mut().zip(qv) {
                        *x = kd.mul_add(y, *x);
                    }
                }
            }
            for (a, srow) in acc.iter().zip(sg.chunks_exact_mut(lanes)) {
                srow[c0..c0 + 16].copy_from_slice(a);
            }
        }
    }
}
