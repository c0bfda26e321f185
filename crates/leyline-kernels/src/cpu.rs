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
    /// AMX tiles with 8-bit products (AMX-TILE and AMX-INT8), and the kernel's permission
    /// for this process to use them (Linux asks for it, `ARCH_REQ_XCOMP_PERM`).
    pub amx_int8: bool,
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
            amx_int8: amx_int8(),
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn detect() -> Features {
        Features::default()
    }
}

/// Whether this CPU has AMX-TILE and AMX-INT8 and the process may use them: CPUID leaf 7
/// (`std`'s detection of AMX is unstable), then, on Linux, the permission for the tile data
/// state, which the kernel grants once for the whole process.
#[cfg(target_arch = "x86_64")]
fn amx_int8() -> bool {
    // Leaf 0 names the highest basic leaf.
    let top = std::arch::x86_64::__cpuid(0).eax;
    if top < 7 {
        return false;
    }
    let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
    let (tile, int8) = (edx & (1 << 24) != 0, edx & (1 << 25) != 0);
    tile && int8 && amx_permission()
}

/// Asks Linux for the AMX tile data state (`XFEATURE_XTILEDATA`, 18): without it the first
/// tile instruction raises SIGILL.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn amx_permission() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM reads no memory; it returns -1 (EINVAL or
    // EPERM) where the kernel or the CPU cannot grant the state.
    let r = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    r == 0
}

/// Off Linux the permission is not asked for, so the tiles stay unused.
#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn amx_permission() -> bool {
    false
}
