//! `leyline bench bandwidth`: how fast this machine's cores read memory, and the decode
//! speed that bounds for a model (issue 59: decode at 80% of the read-bandwidth limit).
//!
//! Each thread sums its share of a buffer several times the last-level cache (so every pass
//! reads DRAM), eight independent accumulators per thread so the loads are the limit, not
//! the adds. The figure is the best of `--repeat` passes: bytes read / wall time of the
//! pass. A decode step reads every weight once (the embedding table excepted: one row of it,
//! unless the output head shares it), so the limit in tokens/s is GB/s over those bytes.

use anyhow::{bail, Context, Result};
use clap::Args;
use std::hint::black_box;
use std::time::Instant;

/// Options of `bench bandwidth`.
#[derive(Args)]
pub struct BandwidthArgs {
    /// Reading threads (the decode benchmarks use 2).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Buffer size in MiB (default: four times the last-level cache, at least 1024).
    #[arg(long)]
    pub mib: Option<usize>,
    /// Passes; the best is reported.
    #[arg(long, default_value_t = 5)]
    pub repeat: usize,
    /// Also print the decode limit of this model (a known name or a GGUF file).
    #[arg(long, short = 'm')]
    pub model: Option<std::path::PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The last-level cache's size in bytes, from sysfs (the largest cache cpu0 lists).
fn llc_bytes() -> Option<usize> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let mut best = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let Ok(s) = std::fs::read_to_string(e.path().join("size")) else {
            continue;
        };
        let s = s.trim();
        let (num, mult) = match s.strip_suffix('K') {
            Some(n) => (n, 1024),
            None => match s.strip_suffix('M') {
                Some(n) => (n, 1024 * 1024),
                None => (s, 1),
            },
        };
        if let Ok(n) = num.parse::<usize>() {
            best = best.max(Some(n * mult));
        }
    }
    best
}

/// Sums `words` with eight accumulators (the compiler keeps them in vector registers).
fn read_sum(words: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = words.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &w) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(w);
        }
    }
    let mut s = tail.iter().fold(0u64, |a, &w| a.wrapping_add(w));
    for a in acc {
        s = s.wrapping_add(a);
    }
    s
}

/// Bytes a decode step reads of the model's weights: every tensor but the token embedding,
/// which is read whole only when it doubles as the output head (no `output.weight`).
fn bytes_per_token(path: &std::path::Path) -> Result<(u64, u64)> {
    let f = leyline_model::gguf::GgufFile::open(path)?;
    let sizes = f.tensor_sizes();
    let tied = !sizes.iter().any(|(n, _)| n == "output.weight");
    let total: u64 = sizes.iter().map(|(_, b)| b).sum();
    let read = sizes
        .iter()
        .filter(|(n, _)| tied || n != "token_embd.weight")
        .map(|(_, b)| b)
        .sum();
    Ok((read, total))
}

/// Runs the probe.
pub fn run(a: BandwidthArgs) -> Result<()> {
    if a.threads == 0 || a.repeat == 0 {
        bail!("--threads and --repeat must be at least 1");
    }
    let llc = llc_bytes();
    let mib = a
        .mib
        .unwrap_or_else(|| (4 * llc.unwrap_or(0)).div_ceil(1 << 20).max(1024));
    let words = mib * (1 << 20) / 8;
    // Written once, so every page is resident and distinct (no shared zero page).
    let buf: Vec<u64> = (0..words as u64)
        .map(|i| i.wrapping_mul(0x9e37_79b9))
        .collect();
    let part = words.div_ceil(a.threads);
    let mut best = f64::INFINITY;
    for _ in 0..=a.repeat {
        let t0 = Instant::now();
        let sum = std::thread::scope(|s| {
            let handles: Vec<_> = buf
                .chunks(part)
                .map(|c| s.spawn(move || read_sum(black_box(c))))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        black_box(sum);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    // The first pass warms (and is one of the passes counted only through `best`).
    let gbs = (words * 8) as f64 / best / 1e9;
    let model = match &a.model {
        Some(m) => {
            let path = crate::resolve_model(Some(m)).context("the model to bound")?;
            let (read, total) = bytes_per_token(&path)?;
            Some((path, read, total))
        }
        None => None,
    };
    if a.json {
        let mut o = serde_json::json!({
            "threads": a.threads, "buffer_mib": mib, "llc_bytes": llc,
            "best_pass_s": best, "read_gb_s": gbs,
        });
        if let Some((path, read, total)) = &model {
            o["model"] = serde_json::json!(path.display().to_string());
            o["bytes_per_token"] = serde_json::json!(read);
            o["weight_bytes"] = serde_json::json!(total);
            o["decode_limit_tok_s"] = serde_json::json!(gbs * 1e9 / *read as f64);
        }
        println!("{o}");
        return Ok(());
    }
    println!(
        "read bandwidth: {gbs:.2} GB/s ({} threads, {mib} MiB buffer, last-level cache {}, best of {} passes)",
        a.threads,
        llc.map_or("unknown".into(), |b| format!("{} KiB", b / 1024)),
        a.repeat
    );
    if let Some((path, read, _)) = model {
        println!(
            "{}: {:.1} MB read per decoded token, limit {:.1} tokens/s",
            path.display(),
            read as f64 / 1e6,
            gbs * 1e9 / read as f64
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_sum_adds_every_word() {
        let v: Vec<u64> = (1..=21).collect();
        assert_eq!(read_sum(&v), 231);
        assert_eq!(read_sum(&[u64::MAX, 2]), 1);
    }
}
