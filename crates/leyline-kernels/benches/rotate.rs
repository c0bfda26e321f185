//! Rotation throughput against the memory-bound limit: a plain copy (memcpy) and an in-place
//! read-modify-write of the same bytes. 4096 slots x (3 heads x 64) x 30 layers, as
//! SmolLM2-135M, for bf16/f16/f32 storage and both layouts; a layer loop as the engine runs
//! it (one `shift_table`, then `shift_rows_with` per layer).
//!
//! `cargo bench -p leyline-kernels --bench rotate` prints criterion's numbers, then a report: per
//! dtype, best and median GB/s of N runs, and each rotation's ratio to the copy and to the
//! read-modify-write. Bytes counted are the bytes of the rows (read once, written once).
//! `ROTATE_BENCH_QUICK=1` skips criterion and prints the report only.

use criterion::{Criterion, Throughput};
use leyline_kernels::rope::{RopeSpec, RotaryLayout};
use leyline_kernels::rotate::{shift_rows_with, shift_table};
use leyline_kernels::rows::RowsMut;
use leyline_kernels::Tier;
use std::hint::black_box;
use std::time::{Duration, Instant};

const SLOTS: usize = 4096;
const HEADS: usize = 3;
const DIM: usize = 64;
const LAYERS: usize = 30;
const LAYOUTS: [RotaryLayout; 2] = [RotaryLayout::Interleaved, RotaryLayout::Neox];

/// A storage dtype under test.
trait Dt: Copy + Send + 'static {
    const NAME: &'static str;
    fn from_f32(x: f32) -> Self;
    fn rows(v: &mut [Self]) -> RowsMut<'_>;
    /// The cheapest in-place change of one element (same memory traffic as a rotation).
    fn bump(self) -> Self;
}

impl Dt for u16 {
    const NAME: &'static str = "bf16";
    fn from_f32(x: f32) -> u16 {
        (x.to_bits() >> 16) as u16
    }
    fn rows(v: &mut [u16]) -> RowsMut<'_> {
        RowsMut::Bf16(v)
    }
    fn bump(self) -> u16 {
        self ^ 1
    }
}

/// f16 bits (a separate type so the trait can tell them from bf16 bits).
#[derive(Clone, Copy)]
#[repr(transparent)]
struct F16(u16);

impl Dt for F16 {
    const NAME: &'static str = "f16";
    fn from_f32(x: f32) -> F16 {
        F16(half::f16::from_f32(x).to_bits())
    }
    fn rows(v: &mut [F16]) -> RowsMut<'_> {
        // SAFETY: `F16` is `repr(transparent)` over `u16`: same size, alignment and validity.
        let v = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u16, v.len()) };
        RowsMut::F16(v)
    }
    fn bump(self) -> F16 {
        F16(self.0 ^ 1)
    }
}

impl Dt for f32 {
    const NAME: &'static str = "f32";
    fn from_f32(x: f32) -> f32 {
        x
    }
    fn rows(v: &mut [f32]) -> RowsMut<'_> {
        RowsMut::F32(v)
    }
    fn bump(self) -> f32 {
        -self
    }
}

fn layers<T: Dt>() -> Vec<Vec<T>> {
    (0..LAYERS)
        .map(|l| {
            (0..SLOTS * HEADS * DIM)
                .map(|i| T::from_f32(0.25 + ((i * 7 + l) % 251) as f32 / 128.0))
                .collect()
        })
        .collect()
}

fn bytes<T>() -> f64 {
    (LAYERS * SLOTS * HEADS * DIM * std::mem::size_of::<T>()) as f64
}

/// What the engine does per edit: one table, then every layer's key rows.
fn rotate_all<T: Dt>(ls: &mut [Vec<T>], slots: &[u32], tier: Tier, layout: RotaryLayout) {
    let spec = RopeSpec::plain(100000.0, DIM, layout);
    let rot = shift_table(&spec, -37).expect("shiftable");
    for l in ls.iter_mut() {
        shift_rows_with(T::rows(l), HEADS, DIM, slots, &rot, tier).expect("valid");
    }
}

fn rmw_all<T: Dt>(ls: &mut [Vec<T>]) {
    for l in ls.iter_mut() {
        for x in l.iter_mut() {
            *x = x.bump();
        }
        black_box(&l);
    }
}

fn copy_all<T: Dt>(dst: &mut [Vec<T>], src: &[Vec<T>]) {
    for (d, s) in dst.iter_mut().zip(src) {
        d.copy_from_slice(s);
    }
    black_box(&dst);
}

fn criterion_dtype<T: Dt>(c: &mut Criterion) {
    let mut ls = layers::<T>();
    let mut dst = layers::<T>();
    let slots: Vec<u32> = (0..SLOTS as u32).collect();
    let mut g = c.benchmark_group(format!("rotate_{}_4096x3x64x30", T::NAME));
    g.throughput(Throughput::Bytes(bytes::<T>() as u64));
    for layout in LAYOUTS {
        for tier in Tier::all_available() {
            g.bench_function(format!("{layout:?}/{tier:?}"), |b| {
                b.iter(|| rotate_all(&mut ls, &slots, tier, layout))
            });
        }
    }
    g.bench_function("rmw", |b| b.iter(|| rmw_all(&mut ls)));
    g.bench_function("memcpy", |b| b.iter(|| copy_all(&mut dst, &ls)));
    g.finish();
}

/// GB/s of `f` over `bytes`: (best, median) of `n` runs after one warm-up.
fn gbps(bytes: f64, n: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let mut v: Vec<f64> = (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            bytes / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    v.sort_by(f64::total_cmp);
    (v[n - 1], v[n / 2])
}

fn report_dtype<T: Dt>(n: usize) {
    let mut ls = layers::<T>();
    let mut dst = layers::<T>();
    let b = bytes::<T>();
    let slots: Vec<u32> = (0..SLOTS as u32).collect();
    let mut shuffled = slots.clone();
    let mut z = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..shuffled.len()).rev() {
        z ^= z << 13;
        z ^= z >> 7;
        z ^= z << 17;
        shuffled.swap(i, (z % (i as u64 + 1)) as usize);
    }
    let (copy, copy_med) = gbps(b, n, || copy_all(&mut dst, &ls));
    let (rmw, rmw_med) = gbps(b, n, || rmw_all(&mut ls));
    println!(
        "{} ({:.0} MB): memcpy {copy:.1} GB/s (median {copy_med:.1}), \
         in-place rmw {rmw:.1} GB/s (median {rmw_med:.1})",
        T::NAME,
        b / 1e6
    );
    for layout in LAYOUTS {
        for tier in Tier::all_available() {
            let (r, m) = gbps(b, n, || rotate_all(&mut ls, &slots, tier, layout));
            println!(
                "  {:<11} {:<8} {r:6.1} GB/s (median {m:5.1}) = {:.2} x copy, {:.2} x rmw",
                format!("{layout:?}"),
                format!("{tier:?}"),
                r / copy,
                r / rmw
            );
        }
        let tier = Tier::best();
        let (r, m) = gbps(b, n, || rotate_all(&mut ls, &shuffled, tier, layout));
        println!(
            "  {:<11} {:<8} {r:6.1} GB/s (median {m:5.1}) = {:.2} x copy  [slots shuffled]",
            format!("{layout:?}"),
            format!("{tier:?}"),
            r / copy
        );
    }
}

/// The same kernels on 512 rows of one layer (L2-resident): how far compute is from the
/// memory limit.
fn report_cached<T: Dt>(n: usize) {
    const ROWS: usize = 512;
    const REPS: usize = 200;
    let mut ls = layers::<T>();
    ls.truncate(1);
    ls[0].truncate(ROWS * HEADS * DIM);
    let mut dst = ls.clone();
    let b = bytes::<T>() / (LAYERS * SLOTS / ROWS) as f64 * REPS as f64;
    let slots: Vec<u32> = (0..ROWS as u32).collect();
    let (copy, _) = gbps(b, n, || (0..REPS).for_each(|_| copy_all(&mut dst, &ls)));
    let (rmw, _) = gbps(b, n, || (0..REPS).for_each(|_| rmw_all(&mut ls)));
    let tier = Tier::best();
    let mut line = format!(
        "  L2-resident ({} KB): memcpy {copy:.1}, rmw {rmw:.1}",
        b / REPS as f64 / 1e3
    );
    for layout in LAYOUTS {
        let (r, _) = gbps(b, n, || {
            (0..REPS).for_each(|_| rotate_all(&mut ls, &slots, tier, layout))
        });
        line += &format!(", {layout:?} {tier:?} {r:.1}");
    }
    println!("{line} GB/s");
}

fn main() {
    if std::env::var_os("ROTATE_BENCH_QUICK").is_none() {
        let mut c = Criterion::default()
            .sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(2))
            .configure_from_args();
        criterion_dtype::<u16>(&mut c);
        criterion_dtype::<F16>(&mut c);
        criterion_dtype::<f32>(&mut c);
        c.final_summary();
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "\nrotation vs copy, best/median of 9 (load average: {})",
        load.trim()
    );
    report_dtype::<u16>(9);
    report_cached::<u16>(9);
    report_dtype::<F16>(9);
    report_cached::<F16>(9);
    report_dtype::<f32>(9);
    report_cached::<f32>(9);
}
