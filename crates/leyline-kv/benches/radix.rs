//! Prefix-cache throughput: match and insert of long sequences, and LRU eviction.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use leyline_kv::radix::{Namespace, PrefixCache};

const NS: Namespace = Namespace::shared(0);

/// `n` sequences of `len` tokens sharing a 512-token system prompt, inserted and released.
fn filled(n: usize, len: usize) -> (PrefixCache, Vec<Vec<u32>>) {
    let mut c = PrefixCache::new(n * len + 1024).expect("pool");
    let mut seqs = Vec::new();
    for i in 0..n {
        let t: Vec<u32> = (0..len as u32)
            .map(|j| if j < 512 { j } else { j * 31 + i as u32 })
            .collect();
        let s = c.pool_mut().alloc(len).expect("slots");
        c.insert(NS, &t, &s).expect("insert");
        c.pool_mut().release_all(&s).expect("release");
        seqs.push(t);
    }
    (c, seqs)
}

fn bench(c: &mut Criterion) {
    let len = 4096;
    let (mut cache, seqs) = filled(64, len);
    let mut g = c.benchmark_group("radix");
    g.throughput(Throughput::Elements(len as u64));
    let mut i = 0;
    g.bench_function("match_prefix_4k", |b| {
        b.iter(|| {
            i = (i + 1) % seqs.len();
            cache.match_prefix(NS, &seqs[i]).len
        })
    });
    g.bench_function("insert_4k_new", |b| {
        b.iter_batched(
            || {
                let mut c = PrefixCache::new(len).expect("pool");
                let s = c.pool_mut().alloc(len).expect("slots");
                (c, s)
            },
            |(mut c, s)| c.insert(NS, &seqs[0], &s).expect("insert").inserted,
            BatchSize::LargeInput,
        )
    });
    g.throughput(Throughput::Elements(64 * (len as u64 - 512)));
    g.bench_function("evict_all_64x4k", |b| {
        b.iter_batched(
            || filled(64, len).0,
            |mut c| c.evict(usize::MAX).tokens,
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
