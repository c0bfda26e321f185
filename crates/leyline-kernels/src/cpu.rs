//! The CPU features the kernels' tiers are made of, detected once.
//!
//! [`crate::Tier`] names the combinations the kernel families dispatch on, so they are
//! spelled in one place. Off x86-64 every feature reads as absent.

use std::sync::OnceLock;

/// The x86-64 extensions the kernels use, as this CPU reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Features {
    /// AVX2.
    pub avx2: bool,
    /// FMA (fused multiply-add, 256-bit).
    pub fma: bool,
    /// F16C (f16 <-> f32 conversions).
    pub f16c: bool,
    /// AVX-512 Foundation.
    pub avx512f: bool,
    /// AVX-512 Byte and Word.
    pub avx512bw: bool,
    /// AVX-512 Vector Length extensions.
    pub avx512vl: bool,
    /// AVX-512 Vector Neural Network Instructions (`vpdpbusd`).
    pub avx512vnni: bool,
}

impl Features {
    /// This CPU's features (detected on the first call, then cached).
    pub fn get() -> Features {
        static FEATURES: OnceLock<Features> = OnceLock::new();
        *FEATURES.get_or_init(Features::detect)
    }

    #[cfg(target_arch = "x86_64")]
    fn detect() -> Features {
        use std::arch::is_x86_feature_detected as has;
        Features {
            avx2: has!("avx2"),
            fma: has!("fma"),
            f16c: has!("f16c"),
            avx512f: has!("avx512f"),
            avx512bw: has!("avx512bw"),
            avx512vl: has!("avx512vl"),
            avx512vnni: has!("avx512vnni"),
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn detect() -> Features {
        Features::default()
    }
}
