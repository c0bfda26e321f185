use super::*;

/// The lane-sum trees alone ([`avx512::sum16`], [`avx2::sum8`]). Lane i of vector j holds
/// `1024 j + 2^i`, so every sum is exact in f32 and a lane taken from another vector,
/// dropped or counted twice changes it.
#[cfg(target_arch = "x86_64")]
#[test]
fn lane_sum_trees_put_each_vectors_sum_in_its_lane() {
    use std::arch::x86_64::*;
    fn check<const N: usize>(sum: impl Fn(&[[f32; N]; N]) -> [f32; N]) {
        let rows: [[f32; N]; N] = std::array::from_fn(|j| {
            std::array::from_fn(|i| j as f32 * 1024.0 + (1u32 << i) as f32)
        });
        let want: [f32; N] = std::array::from_fn(|j| rows[j].iter().sum());
        assert_eq!(sum(&rows), want, "{N}-way lane sums");
    }
    Tier::note_lacking();
    for tier in Tier::all_available() {
        match tier {
            Tier::Portable => {}
            Tier::Avx512 | Tier::Avx512Vnni => check::<16>(|rows| {
                let mut out = [0f32; 16];
                // SAFETY: the CPU runs the AVX-512 tier (it has AVX-512F); each load reads one
                // 16-float row and the store writes the 16 floats of `out`.
                unsafe {
                    let a: [__m512; 16] =
                        std::array::from_fn(|j| _mm512_loadu_ps(rows[j].as_ptr()));
                    _mm512_storeu_ps(out.as_mut_ptr(), avx512::sum16(&a));
                }
                out
            }),
            Tier::Avx2 => check::<8>(|rows| {
                let mut out = [0f32; 8];
                // SAFETY: the CPU runs the AVX2 tier (it has AVX2); each load reads one 8-float
                // row and the store writes the 8 floats of `out`.
                unsafe {
                    let a: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(rows[j].as_ptr()));
                    _mm256_storeu_ps(out.as_mut_ptr(), avx2::sum8(&a));
                }
                out
            }),
        }
    }
}
