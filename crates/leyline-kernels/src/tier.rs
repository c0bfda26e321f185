//! The instruction-set tiers every kernel family dispatches on.
//!
//! Each family (quantized products, attention, rotation, panels, elementwise math) is
//! compiled once per tier it has kernels for and runs the one [`Tier::best`] names, unless a
//! caller (a test, a bench) asks for a tier explicitly. A family without kernels for a tier
//! runs its next lower one (quantized products: AVX-512 kernels exist for some formats only).
//!
//! [`TIER_ENV`] (`LEYLINE_KERNEL_TIER=portable|avx2|avx512|avx512vnni|amx`), read once, caps
//! [`Tier::best`]: every family then dispatches on that tier, so that a machine with AVX-512
//! can run the portable and AVX2 kernels end to end (CI). A tier above what the CPU runs, or
//! a name that is no tier's, is logged as a warning and the CPU's best is used.

use crate::cpu::Features;
use crate::error::KernelError;
use std::sync::OnceLock;

/// The environment variable that caps [`Tier::best`]: `portable`, `avx2`, `avx512`,
/// `avx512vnni` or `amx`.
pub const TIER_ENV: &str = "LEYLINE_KERNEL_TIER";

/// An instruction-set tier, lowest first. A CPU that runs a tier runs every tier below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Portable Rust for the baseline target (what the compiler vectorizes on its own).
    Portable,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
    /// x86-64 AVX-512 F, BW and VL (and everything [`Tier::Avx2`] needs).
    Avx512,
    /// [`Tier::Avx512`] with VNNI: the integer products take `vpdpbusd`; every other family
    /// runs its AVX-512 kernels.
    Avx512Vnni,
    /// [`Tier::Avx512Vnni`] with AMX-INT8 tiles: products of many activation rows take
    /// `tdpbsud` (few rows, and every other family, run the AVX-512 VNNI kernels).
    Amx,
}

impl Tier {
    /// Every tier, lowest first.
    pub const ALL: [Tier; 5] = [
        Tier::Portable,
        Tier::Avx2,
        Tier::Avx512,
        Tier::Avx512Vnni,
        Tier::Amx,
    ];

    /// The tier's name: `portable`, `avx2`, `avx512`, `avx512vnni` or `amx`.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Portable => "portable",
            Tier::Avx2 => "avx2",
            Tier::Avx512 => "avx512",
            Tier::Avx512Vnni => "avx512vnni",
            Tier::Amx => "amx",
        }
    }

    /// Whether this CPU runs the tier (from the features [`Features::get`] detects once).
    pub fn available(self) -> bool {
        let f = Features::get();
        let avx2 = f.avx2 && f.fma && f.f16c;
        match self {
            Tier::Portable => true,
            Tier::Avx2 => avx2,
            Tier::Avx512 => avx2 && f.avx512f && f.avx512bw && f.avx512vl,
            Tier::Avx512Vnni => Tier::Avx512.available() && f.avx512vnni,
            Tier::Amx => Tier::Avx512Vnni.available() && f.amx_int8,
        }
    }

    /// The tier the kernels dispatch on: the highest this CPU runs, or the lower one
    /// [`TIER_ENV`] names (read on the first call; a warning is logged when it names no tier
    /// or one the CPU does not run).
    pub fn best() -> Tier {
        static BEST: OnceLock<Tier> = OnceLock::new();
        *BEST.get_or_init(|| {
            let var = std::env::var_os(TIER_ENV).map(|v| v.to_string_lossy().into_owned());
            let cpu = Tier::cpu_best();
            let (tier, warning) = ceiling(var.as_deref(), cpu);
            match warning {
                Some(w) => tracing::warn!("{w}"),
                None if tier < cpu => tracing::info!("{TIER_ENV}: kernels run the {tier} tier"),
                None => {}
            }
            tier
        })
    }

    /// The highest tier this CPU runs.
    fn cpu_best() -> Tier {
        Tier::all_available()
            .pop()
            .expect("the portable tier runs everywhere")
    }

    /// Every tier this CPU runs, lowest first: what tests that compare the tiers loop over
    /// ([`TIER_ENV`] does not apply).
    pub fn all_available() -> Vec<Tier> {
        Tier::ALL.into_iter().filter(|t| t.available()).collect()
    }

    /// Prints `tier NAME: not verified here (CPU lacks it)` to stderr for each tier this CPU
    /// lacks: a test that loops over [`Tier::all_available`] calls it, so that its log says
    /// what went unchecked.
    pub fn note_lacking() {
        for t in Tier::ALL.into_iter().filter(|t| !t.available()) {
            eprintln!("tier {t}: not verified here (CPU lacks it)");
        }
    }
}

/// The tier to dispatch on when [`TIER_ENV`] holds `var` and the CPU runs at most `cpu`, and
/// the warning to log when `var` cannot be honoured. Unset or blank: `cpu`.
fn ceiling(var: Option<&str>, cpu: Tier) -> (Tier, Option<String>) {
    let Some(v) = var.map(str::trim).filter(|v| !v.is_empty()) else {
        return (cpu, None);
    };
    match v.parse::<Tier>() {
        Ok(t) if t <= cpu => (t, None),
        Ok(t) => (
            cpu,
            Some(format!(
                "{TIER_ENV}={t}: this CPU runs at most the {cpu} tier; using {cpu}"
            )),
        ),
        Err(e) => (cpu, Some(format!("{TIER_ENV} ignored: {e}; using {cpu}"))),
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Tier {
    type Err = KernelError;

    /// A tier's [`Tier::name`], in any case.
    fn from_str(s: &str) -> Result<Tier, KernelError> {
        Tier::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| KernelError::UnknownTier(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_tiers_are_ordered() {
        for t in Tier::ALL {
            assert_eq!(t.to_string().parse::<Tier>(), Ok(t));
        }
        assert_eq!("AVX2".parse::<Tier>(), Ok(Tier::Avx2));
        assert!(Tier::Portable < Tier::Avx2 && Tier::Avx2 < Tier::Avx512);
        let e = "avx-512".parse::<Tier>().unwrap_err();
        assert_eq!(e, KernelError::UnknownTier("avx-512".into()));
        assert!(
            e.to_string()
                .contains("portable, avx2, avx512, avx512vnni or amx"),
            "{e}"
        );
    }

    #[test]
    fn the_override_caps_the_cpus_tier_and_warns_when_it_cannot() {
        use Tier::*;
        assert_eq!(ceiling(None, Avx512), (Avx512, None));
        assert_eq!(ceiling(Some("  "), Avx2), (Avx2, None));
        assert_eq!(ceiling(Some("portable"), Avx512), (Portable, None));
        assert_eq!(ceiling(Some(" avx2\n"), Avx512), (Avx2, None));
        assert_eq!(ceiling(Some("avx2"), Avx2), (Avx2, None));
        // A tier the CPU lacks, and no tier's name: the CPU's best, and a warning saying why.
        for (var, cpu, says) in [
            ("avx512", Avx2, ["LEYLINE_KERNEL_TIER=avx512", "using avx2"]),
            (
                "sse4",
                Avx512,
                ["\"sse4\"", "portable, avx2, avx512, avx512vnni or amx"],
            ),
        ] {
            let (t, w) = ceiling(Some(var), cpu);
            assert_eq!(t, cpu);
            let w = w.expect("a warning");
            assert!(says.iter().all(|s| w.contains(s)), "{w}");
        }
    }

    #[test]
    fn available_tiers_are_a_prefix_ending_at_the_best() {
        let all = Tier::all_available();
        assert_eq!(all, Tier::ALL[..all.len()]);
        assert_eq!(all.last(), Some(&Tier::cpu_best()));
        assert!(Tier::best() <= Tier::cpu_best() && Tier::best().available());
    }
}
