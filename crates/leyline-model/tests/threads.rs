//! `pool::init_threads` sizes rayon's global pool and the global `SpinPool` alike, in a
//! process of its own (both pools are process-wide).

use leyline_kernels::pool::{init_threads, SpinPool, ThreadsError};

#[test]
fn init_threads_sizes_both_pools_once() {
    assert_eq!(init_threads(3), Ok(3));
    assert_eq!(rayon::current_num_threads(), 3);
    assert_eq!(SpinPool::global().threads(), 3);
    // The same count again is a no-op; 0 (the default) accepts what runs.
    assert_eq!(init_threads(3), Ok(3));
    assert_eq!(init_threads(0), Ok(3));
    assert_eq!(
        init_threads(5),
        Err(ThreadsError {
            wanted: 5,
            running: 3
        })
    );
    assert!(init_threads(5)
        .unwrap_err()
        .to_string()
        .contains("already started with 3 threads"));
}
