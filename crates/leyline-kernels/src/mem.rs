//! Large buffers on transparent huge pages.
//!
//! At long context a step reads every cached key and value of its sequences: tens of
//! megabytes per layer pass on 4 KiB pages, that is thousands of page walks, and the
//! hardware prefetchers stop at every page boundary. Where the kernel gives transparent
//! huge pages only on request (`madvise`, the common default), the KV pool and the large
//! f32 weights ask for them. They get a mapping of their own: memory the allocator hands
//! out again already has its small pages, and advice does not replace those. (Buffers much
//! smaller than 2 MiB gain nothing: a huge page must fit whole inside the mapping.)

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Bytes of a transparent huge page on x86-64 and (4 KiB-granule) aarch64.
const HUGE_PAGE: usize = 2 << 20;

/// Element types whose all-zero bytes are a valid value.
///
/// # Safety
/// Implementors must be plain data: no padding, no invalid bit patterns, no drop glue.
pub unsafe trait Zeroable: Copy + Default {}
// SAFETY: primitive numbers; every bit pattern (zero included) is a value.
unsafe impl Zeroable for f32 {}
// SAFETY: as above.
unsafe impl Zeroable for u16 {}
// SAFETY: as above.
unsafe impl Zeroable for u8 {}

/// A zeroed buffer of fixed length in an anonymous mapping of its own (Linux), whose whole
/// 2 MiB pages the kernel is asked to back with transparent huge pages; the pages are not
/// touched here, so the first write to each faults in a huge page where the kernel has one.
/// Elsewhere a plain vector.
pub struct HugeBuf<T: Zeroable> {
    #[cfg(target_os = "linux")]
    map: linux::Mapping<T>,
    #[cfg(not(target_os = "linux"))]
    map: Vec<T>,
}

impl<T: Zeroable> HugeBuf<T> {
    /// `len` zeroed elements.
    ///
    /// # Panics
    /// If the size overflows or the system has no memory to map (as `Vec` aborts).
    pub fn zeroed(len: usize) -> Self {
        #[cfg(target_os = "linux")]
        let map = linux::Mapping::zeroed(len, true);
        #[cfg(not(target_os = "linux"))]
        let map = vec![T::default(); len];
        Self { map }
    }

    /// `len` zeroed elements in a mapping of their own on small pages (the kernel is asked
    /// not to use huge ones): for transient data, whose memory must go back to the system
    /// when it is dropped (heap blocks below 32 MB may stay with the allocator) and whose
    /// size should not round up to 2 MiB.
    ///
    /// # Panics
    /// As [`Self::zeroed`].
    pub fn zeroed_small_pages(len: usize) -> Self {
        #[cfg(target_os = "linux")]
        let map = linux::Mapping::zeroed(len, false);
        #[cfg(not(target_os = "linux"))]
        let map = vec![T::default(); len];
        Self { map }
    }
}

impl<T: Zeroable> Deref for HugeBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.map
    }
}

impl<T: Zeroable> DerefMut for HugeBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.map
    }
}

impl<T: Zeroable> Clone for HugeBuf<T> {
    fn clone(&self) -> Self {
        let mut c = Self::zeroed(self.len());
        c.copy_from_slice(self);
        c
    }
}

impl<T: Zeroable> fmt::Debug for HugeBuf<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "HugeBuf({} x {})",
            self.len(),
            std::any::type_name::<T>()
        )
    }
}

/// Alignment of every piece of an [`Arena`]: a cache line.
const PIECE_ALIGN: usize = 64;

/// A zeroed buffer on transparent huge pages ([`HugeBuf::zeroed`]) handed out in disjoint
/// pieces, each written once by whoever takes it and then shared read-only: a model's
/// matrices are built straight into the place they are streamed from, with no copy and no
/// small pages in between. Pages nobody takes are never touched, so a generous capacity
/// costs address space only.
pub struct Arena {
    /// Owns the memory; never dereferenced after `base` is taken from it, so that the
    /// pieces' borrows are the only ones.
    _buf: HugeBuf<u8>,
    base: NonNull<u8>,
    cap: usize,
    /// Bytes handed out so far.
    next: AtomicUsize,
}

// SAFETY: the arena is owned memory of `u8`s; `take` hands each byte out at most once (the
// atomic `next` only grows), so a piece's `&mut [u8]` never aliases another piece or any
// `ArenaBytes`, which read only frozen pieces. Sharing or sending the arena shares or sends
// nothing else.
unsafe impl Send for Arena {}
// SAFETY: as above.
unsafe impl Sync for Arena {}

impl Arena {
    /// An arena of `cap` bytes.
    ///
    /// # Panics
    /// As [`HugeBuf::zeroed`].
    pub fn new(cap: usize) -> Arc<Self> {
        let mut buf = HugeBuf::<u8>::zeroed(cap);
        let base = NonNull::new(buf.as_mut_ptr()).unwrap_or(NonNull::dangling());
        Arc::new(Self {
            _buf: buf,
            base,
            cap,
            next: AtomicUsize::new(0),
        })
    }

    /// The next `len` zeroed bytes, starting on a 64-byte boundary, or `None` when the arena
    /// has not that much room left.
    pub fn take(self: &Arc<Self>, len: usize) -> Option<ArenaPiece> {
        let size = len.checked_next_multiple_of(PIECE_ALIGN)?;
        let start = self
            .next
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |at| {
                at.checked_add(size).filter(|&end| end <= self.cap)
            })
            .ok()?;
        Some(ArenaPiece(ArenaBytes {
            arena: Arc::clone(self),
            start,
            len,
        }))
    }

    /// Bytes handed out so far (pieces rounded up to 64 bytes).
    pub fn used(&self) -> usize {
        self.next.load(Ordering::Relaxed)
    }
}

impl fmt::Debug for Arena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Arena({} of {} bytes used)", self.used(), self.cap)
    }
}

/// A piece of an [`Arena`] being written: the only handle to its bytes until
/// [`Self::freeze`].
#[derive(Debug)]
pub struct ArenaPiece(ArenaBytes);

impl ArenaPiece {
    /// The piece, read-only from now on and shared at will.
    pub fn freeze(self) -> ArenaBytes {
        self.0
    }
}

impl Deref for ArenaPiece {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl DerefMut for ArenaPiece {
    fn deref_mut(&mut self) -> &mut [u8] {
        let b = &self.0;
        // SAFETY: `[start, start + len)` lies inside the arena's `cap` bytes (checked by
        // `take`) and was handed out to this piece alone, which is not `Clone`; `&mut self`
        // makes this the only borrow of it.
        unsafe { std::slice::from_raw_parts_mut(b.arena.base.as_ptr().add(b.start), b.len) }
    }
}

/// A frozen piece of an [`Arena`], which it keeps alive.
#[derive(Clone)]
pub struct ArenaBytes {
    arena: Arc<Arena>,
    start: usize,
    len: usize,
}

impl Deref for ArenaBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the range lies inside the arena (checked by `take`) and belongs to this
        // piece alone; an `ArenaBytes` outside `ArenaPiece` exists only once the piece is
        // frozen, after which nothing writes it. The arena's memory lives while `arena` does.
        unsafe { std::slice::from_raw_parts(self.arena.base.as_ptr().add(self.start), self.len) }
    }
}

impl fmt::Debug for ArenaBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ArenaBytes({}..{})", self.start, self.start + self.len)
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use super::{Zeroable, HUGE_PAGE};
    use std::alloc::{handle_alloc_error, Layout};
    use std::ops::{Deref, DerefMut};
    use std::ptr::NonNull;

    /// `len` elements inside a private anonymous mapping of `bytes` bytes at `base`.
    pub(super) struct Mapping<T> {
        ptr: NonNull<T>,
        len: usize,
        base: usize,
        bytes: usize,
    }

    // SAFETY: the mapping is owned memory like a `Vec<T>`'s; sending or sharing it is as
    // safe as sending or sharing `T`s.
    unsafe impl<T: Send> Send for Mapping<T> {}
    // SAFETY: as above; `&Mapping` only hands out `&[T]`.
    unsafe impl<T: Sync> Sync for Mapping<T> {}

    impl<T: Zeroable> Mapping<T> {
        pub(super) fn zeroed(len: usize, huge: bool) -> Self {
            let layout = Layout::array::<T>(len).expect("buffer size overflows");
            if layout.size() == 0 {
                return Self {
                    ptr: NonNull::dangling(),
                    len,
                    base: 0,
                    bytes: 0,
                };
            }
            // Room to start the data on a huge-page boundary.
            let bytes = layout.size() + HUGE_PAGE;
            // SAFETY: a fresh private anonymous mapping; no existing memory is involved.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if base == libc::MAP_FAILED {
                handle_alloc_error(layout);
            }
            let skip = (base as usize).next_multiple_of(HUGE_PAGE) - base as usize;
            // SAFETY: `[base, base + bytes)` is the mapping just made; MADV_(NO)HUGEPAGE only
            // sets how the kernel backs it and neither reads, writes nor unmaps any of it. A
            // refusal (a kernel without transparent huge pages) leaves small pages.
            unsafe {
                let advice = if huge {
                    libc::MADV_HUGEPAGE
                } else {
                    libc::MADV_NOHUGEPAGE
                };
                libc::madvise(base, bytes, advice);
            }
            // SAFETY: `skip < HUGE_PAGE`, so `base + skip` plus `layout.size()` bytes stay in
            // the mapping; mmap returns page-aligned memory, aligned for any primitive `T`.
            let data = unsafe { base.cast::<u8>().add(skip).cast::<T>() };
            Self {
                ptr: NonNull::new(data).expect("mmap never returns null on success"),
                len,
                base: base as usize,
                bytes,
            }
        }
    }

    impl<T> Deref for Mapping<T> {
        type Target = [T];
        fn deref(&self) -> &[T] {
            // SAFETY: `ptr` points at `len` initialized (zeroed, then written) `T`s in the live
            // mapping, or is dangling with `len * size_of::<T>() == 0`.
            unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
        }
    }

    impl<T> DerefMut for Mapping<T> {
        fn deref_mut(&mut self) -> &mut [T] {
            // SAFETY: as in `deref`, and `&mut self` makes this the only borrow.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
        }
    }

    impl<T> Drop for Mapping<T> {
        fn drop(&mut self) {
            if self.bytes > 0 {
                // SAFETY: `[base, base + bytes)` is the mapping `zeroed` made, unmapped once
                // here; no borrow of it outlives `self`.
                unsafe {
                    libc::munmap(self.base as *mut libc::c_void, self.bytes);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `AnonHugePages` kilobytes of the mapping holding `addr`, from `/proc/self/smaps`.
    fn huge_kib_at(addr: usize) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((lo, hi)) = range.split_once('-') {
                    if let (Ok(lo), Ok(hi)) =
                        (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                    {
                        inside = (lo..hi).contains(&addr);
                        continue;
                    }
                }
            }
            if inside {
                if let Some(v) = line.strip_prefix("AnonHugePages:") {
                    return v.trim().trim_end_matches("kB").trim().parse().ok();
                }
            }
        }
        None
    }

    #[test]
    fn buffers_read_zero_keep_writes_and_clone() {
        for len in [0, 1, 1000, 3 * HUGE_PAGE / 4 + 17] {
            let mut v: HugeBuf<f32> = HugeBuf::zeroed(len);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|&x| x == 0.0));
            for (i, x) in v.iter_mut().enumerate().step_by(1021) {
                *x = i as f32;
            }
            let c = v.clone();
            drop(v);
            for (i, &x) in c.iter().enumerate() {
                let want = if i % 1021 == 0 { i as f32 } else { 0.0 };
                assert_eq!(x, want, "element {i} of {len}");
            }
        }
        let b: HugeBuf<u16> = HugeBuf::zeroed(3);
        assert_eq!(format!("{b:?}"), "HugeBuf(3 x u16)");
    }

    /// Where the kernel gives huge pages on request, a written buffer holds some. The kernel
    /// may lack free huge pages; this machine class has had them every time (see
    /// BENCHMARKS.md), so a failure here means the advice was lost.
    #[test]
    #[cfg(target_os = "linux")]
    fn written_buffers_sit_on_huge_pages_where_the_kernel_offers_them() {
        let offered = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .map(|s| s.contains("[always]") || s.contains("[madvise]"))
            .unwrap_or(false);
        if !offered {
            eprintln!("transparent huge pages are off on this kernel; nothing to check");
            return;
        }
        let mut v: HugeBuf<u8> = HugeBuf::zeroed(8 * HUGE_PAGE);
        v.fill(1);
        let kib = huge_kib_at(v.as_ptr() as usize).expect("the buffer's mapping in smaps");
        assert!(
            kib > 0,
            "no huge pages in an advised, written 16 MiB buffer"
        );
    }

    #[test]
    fn arena_pieces_are_zeroed_aligned_disjoint_and_outlive_their_handles() {
        let arena = Arena::new(1000);
        let mut a = arena.take(100).expect("room");
        let mut b = arena.take(37).expect("room");
        assert!(a.iter().chain(b.iter()).all(|&x| x == 0));
        a.fill(1);
        b.fill(2);
        let (a, b) = (a.freeze(), b.freeze());
        assert_eq!((a.len(), b.len()), (100, 37));
        assert_eq!(a.as_ptr() as usize % PIECE_ALIGN, 0);
        assert_eq!(b.as_ptr() as usize - a.as_ptr() as usize, 128);
        assert_eq!(arena.used(), 128 + 64);
        // 808 bytes are left, room for 12 lines: a piece of 769 does not fit, one of 768
        // does, then nothing.
        assert!(arena.take(769).is_none());
        let last = arena.take(768).expect("the rest").freeze();
        assert!(arena.take(1).is_none());
        assert_eq!(last.len(), 768);
        // Frozen pieces keep the memory after the arena's own handle goes.
        drop(arena);
        let c = a.clone();
        drop(a);
        assert!(c.iter().all(|&x| x == 1) && b.iter().all(|&x| x == 2));
    }

    #[test]
    fn arena_pieces_taken_from_several_threads_never_overlap() {
        let arena = Arena::new(64 * 64 * 8);
        let pieces: Vec<ArenaBytes> = std::thread::scope(|s| {
            let hands: Vec<_> = (0..8u8)
                .map(|t| {
                    let arena = &arena;
                    s.spawn(move || {
                        (0..64)
                            .map(|_| {
                                let mut p = arena.take(50).expect("sized for all");
                                p.fill(t + 1);
                                p.freeze()
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            hands.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        assert!(arena.take(1).is_none());
        for (i, p) in pieces.iter().enumerate() {
            let t = (i / 64) as u8 + 1;
            assert!(
                p.iter().all(|&x| x == t),
                "piece {i} was written by another thread"
            );
        }
    }

    /// A small-pages buffer holds no huge page even where the kernel uses them for every
    /// mapping (`always`), and reads and writes like the other kind.
    #[test]
    #[cfg(target_os = "linux")]
    fn small_page_buffers_hold_no_huge_pages() {
        let mut v: HugeBuf<u8> = HugeBuf::zeroed_small_pages(8 * HUGE_PAGE);
        assert!(v.iter().all(|&x| x == 0));
        v.fill(3);
        assert!(v.iter().all(|&x| x == 3));
        if let Some(kib) = huge_kib_at(v.as_ptr() as usize) {
            assert_eq!(kib, 0, "huge pages in a buffer advised against them");
        }
        assert!(HugeBuf::<f32>::zeroed_small_pages(0).is_empty());
    }
}
