//! A small broadcast thread pool for decode-sized work.
//!
//! Design decision: a decode step is a few hundred short parallel regions (tens of
//! microseconds each). Rayon parks idle workers on a futex, so each region pays a wake-up
//! system call that costs as much as the work; profiles of decode showed a quarter of the
//! time in the scheduler. Here workers spin on an epoch counter for a short while after each
//! job (long enough to bridge the serial gaps of a forward pass) and only then park, so
//! back-to-back regions dispatch with a few hundred nanoseconds of latency, while an idle
//! engine does not burn its cores.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_micros(300);

/// The job of one region: called once per thread with `(thread index, thread count)`.
type Job<'a> = dyn Fn(usize, usize) + Sync + 'a;

struct Shared {
    threads: usize,
    /// Bumped (SeqCst) once per region; workers run the job when it changes.
    epoch: AtomicU64,
    /// The current region's job, with its lifetime erased (see [`SpinPool::run`]).
    job: UnsafeCell<Option<*const Job<'static>>>,
    /// Workers that have not finished the current region.
    pending: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Workers parked (or about to park) on `wake`.
    sleeping: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the thread holding `SpinPool::busy` while no worker reads
// it (before the epoch bump that publishes it and after `pending` reached zero), and read by
// workers only between those two points; the pointee is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// The pool behind [`SpinPool::global`].
static GLOBAL: OnceLock<SpinPool> = OnceLock::new();

/// The process's compute threads were already started with another count.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("compute threads already started with {running} threads, {wanted} asked for")]
pub struct ThreadsError {
    /// The count asked for.
    pub wanted: usize,
    /// The count already running.
    pub running: usize,
}

/// Sizes the process's compute threads, once, before the first forward pass: rayon's global
/// pool (the candle and gemm kernels run on it) and [`SpinPool::global`] get `threads`
/// threads each; 0 means rayon's default (one per core). Returns the count in use. Calling it
/// again with the count already in use is a no-op.
///
/// # Errors
/// [`ThreadsError`] when either pool already runs with another count (it was used before
/// this call, or this is a second call with another count).
pub fn init_threads(threads: usize) -> Result<usize, ThreadsError> {
    // `current_num_threads` would start rayon's default pool: ask only after the build.
    let built = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .is_ok();
    let running = rayon::current_num_threads();
    if !built && threads != 0 && running != threads {
        return Err(ThreadsError {
            wanted: threads,
            running,
        });
    }
    let pool = GLOBAL.get_or_init(|| SpinPool::new(running));
    if pool.threads() != running {
        return Err(ThreadsError {
            wanted: running,
            running: pool.threads(),
        });
    }
    Ok(running)
}

/// A fixed set of worker threads that run one job on every thread at once.
pub struct SpinPool {
    shared: Arc<Shared>,
    /// Held by the caller of a region; a second concurrent caller runs its job serially.
    busy: Mutex<()>,
    workers: Vec<JoinHandle<()>>,
}

impl SpinPool {
    /// A pool of `threads` threads in all: the caller of [`Self::run`] and `threads - 1`
    /// workers (at least one thread).
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            threads,
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleeping: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..threads)
            .map(|tid| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("leyline-pool-{tid}"))
                    .spawn(move || worker(&s, tid))
                    .expect("spawning a pool worker thread")
            })
            .collect();
        Self {
            shared,
            busy: Mutex::new(()),
            workers,
        }
    }

    /// The process-wide pool: [`init_threads`]'s size, or, when that was never called, the
    /// size of rayon's global pool when first used.
    pub fn global() -> &'static SpinPool {
        GLOBAL.get_or_init(|| SpinPool::new(rayon::current_num_threads()))
    }

    /// Threads a region runs on.
    pub fn threads(&self) -> usize {
        self.shared.threads
    }

    /// Calls `f(tid, threads)` once for every `tid` in `0..threads`, on distinct threads, and
    /// returns when all calls have returned. If the pool is already running a region for
    /// another caller, the calls run one after another on this thread instead.
    ///
    /// # Panics
    /// Re-raises a panic of any call, after all calls have finished.
    pub fn run(&self, f: &(dyn Fn(usize, usize) + Sync)) {
        let n = self.shared.threads;
        let guard = match self.busy.try_lock() {
            Ok(g) if n > 1 => g,
            // A caller's own part panicked earlier; the protocol state is still consistent.
            Err(TryLockError::Poisoned(g)) if n > 1 => g.into_inner(),
            _ => {
                for tid in 0..n {
                    f(tid, n);
                }
                return;
            }
        };
        let s = &*self.shared;
        s.panicked.store(false, Ordering::SeqCst);
        // SAFETY: only the lifetime is erased. The pointer is cleared below before `run`
        // returns, and `run` returns (or unwinds, via `Finish`) only after every worker has
        // finished calling it (`pending == 0`), so no worker touches `f` after it is gone.
        let erased: *const Job<'static> = unsafe { std::mem::transmute(f as *const Job<'_>) };
        // SAFETY: no worker reads `job` now: the previous region ended with `pending == 0`
        // and the next one is not yet published.
        unsafe { *s.job.get() = Some(erased) };
        s.pending.store(n - 1, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        struct Finish<'a>(&'a Shared);
        impl Drop for Finish<'_> {
            fn drop(&mut self) {
                let mut spins = 0u32;
                while self.0.pending.load(Ordering::Acquire) != 0 {
                    spins = spins.wrapping_add(1);
                    if spins.is_multiple_of(4096) {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
                // SAFETY: every worker is done with this region (`pending == 0`).
                unsafe { *self.0.job.get() = None };
            }
        }
        let finish = Finish(s);
        f(0, n);
        drop(finish);
        drop(guard);
        if s.panicked.swap(false, Ordering::SeqCst) {
            panic!("a leyline pool worker panicked");
        }
    }
}

impl Drop for SpinPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _l = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn worker(s: &Shared, tid: usize) {
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            let e = s.epoch.load(Ordering::SeqCst);
            if e != seen || s.shutdown.load(Ordering::SeqCst) {
                break e;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(256) {
                std::hint::spin_loop();
                continue;
            }
            if start.elapsed() < SPIN {
                continue;
            }
            let mut l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleeping.fetch_add(1, Ordering::SeqCst);
            while s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                l = s.wake.wait(l).unwrap_or_else(|e| e.into_inner());
            }
            s.sleeping.fetch_sub(1, Ordering::SeqCst);
            drop(l);
        };
        if s.shutdown.load(Ordering::SeqCst) {
            return;
        }
        seen = epoch;
        // SAFETY: the epoch bump that we observed was published after `job` was set, and the
        // caller keeps the job alive until this worker decrements `pending`.
        let job = unsafe { (*s.job.get()).map(|p| &*p) };
        if let Some(job) = job {
            if catch_unwind(AssertUnwindSafe(|| job(tid, s.threads))).is_err() {
                s.panicked.store(true, Ordering::SeqCst);
            }
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

/// The `part`-th of `parts` contiguous pieces of `0..len`, each a multiple of `align`
/// long except possibly the last.
pub fn split(len: usize, part: usize, parts: usize, align: usize) -> std::ops::Range<usize> {
    let align = align.max(1);
    let units = len.div_ceil(align);
    let parts = parts.max(1);
    let lo = (units * part / parts * align).min(len);
    let hi = (units * (part + 1) / parts * align).min(len);
    lo..hi
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_thread_runs_once_per_region_on_distinct_threads() {
        let pool = SpinPool::new(3);
        for _ in 0..200 {
            let hits: Vec<AtomicU32> = (0..3).map(|_| AtomicU32::new(0)).collect();
            let ids = Mutex::new(Vec::new());
            pool.run(&|tid, n| {
                assert_eq!(n, 3);
                hits[tid].fetch_add(1, Ordering::SeqCst);
                ids.lock().unwrap().push(std::thread::current().id());
            });
            assert!(hits.iter().all(|h| h.load(Ordering::SeqCst) == 1));
            let mut ids = ids.into_inner().unwrap();
            ids.sort_by_key(|i| format!("{i:?}"));
            ids.dedup();
            assert_eq!(ids.len(), 3, "each part ran on its own thread");
        }
    }

    #[test]
    fn borrowed_data_is_written_in_disjoint_parts_and_visible_after_run() {
        let pool = SpinPool::new(2);
        let mut out = vec![0u64; 1000];
        for round in 1..50u64 {
            let parts: Vec<Mutex<&mut [u64]>> = {
                let (a, b) = out.split_at_mut(split(1000, 1, 2, 8).start);
                vec![Mutex::new(a), Mutex::new(b)]
            };
            pool.run(&|tid, _| {
                let mut p = parts[tid].lock().unwrap();
                for v in p.iter_mut() {
                    *v += round;
                }
            });
            drop(parts);
            let want: u64 = (1..=round).sum();
            assert!(out.iter().all(|&v| v == want));
        }
    }

    #[test]
    fn parked_workers_wake_up() {
        let pool = SpinPool::new(2);
        let count = AtomicU32::new(0);
        for _ in 0..3 {
            std::thread::sleep(SPIN * 4);
            pool.run(&|_, _| {
                count.fetch_add(1, Ordering::SeqCst);
            });
        }
        assert_eq!(count.load(Ordering::SeqCst), 6);
    }

    #[test]
    fn a_worker_panic_reaches_the_caller_and_the_pool_survives() {
        let pool = SpinPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(&|tid, _| {
                if tid == 1 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let count = AtomicU32::new(0);
        pool.run(&|_, _| {
            count.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(count.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn concurrent_callers_fall_back_to_serial_and_stay_correct() {
        let pool = Arc::new(SpinPool::new(2));
        let total = Arc::new(AtomicU32::new(0));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (p, t) = (Arc::clone(&pool), Arc::clone(&total));
                std::thread::spawn(move || {
                    for _ in 0..500 {
                        p.run(&|_, _| {
                            t.fetch_add(1, Ordering::SeqCst);
                        });
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(total.load(Ordering::SeqCst), 4 * 500 * 2);
    }

    #[test]
    fn split_covers_the_range_in_aligned_pieces() {
        for len in [0, 1, 7, 64, 100, 1537] {
            for parts in 1..5 {
                let mut next = 0;
                for p in 0..parts {
                    let r = split(len, p, parts, 4);
                    assert_eq!(r.start, next);
                    if r.end < len {
                        assert_eq!(r.len() % 4, 0);
                    }
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }
}
