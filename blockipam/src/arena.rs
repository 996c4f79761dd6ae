//! A bump allocator for the plugin's short life: allocations come from one fixed region and are
//! never given back before the process exits; what does not fit goes to the system allocator.
//!
//! The plugin runs for one CNI call and exits. musl's allocator (the shipped build is a static
//! musl executable) unmaps memory as soon as a group of allocations is free and maps it again
//! for the next one: dozens of `mmap`/`munmap` system calls per call (docs/benchmarks.md, "The
//! shipped build"). Handing out memory by moving one pointer forward costs no system call; the
//! region is zero pages until touched, so only what a call uses counts in its memory.
//!
//! Frees inside the region are ignored (a call through the agent allocates about 1 MiB in all; a
//! reallocation of the newest block grows or shrinks it in place). Once the region is used up, or
//! once [`BumpArena::stop_bumping`] was called, every allocation goes to the system allocator, so a
//! call that allocates more still works, as it would without the arena. The plugin stops bumping
//! before it opens a sled store itself: sled's start allocates and frees megabytes, and touching
//! that many fresh pages of the region costs more than reusing freed memory (docs/benchmarks.md,
//! "The shipped build").

// The one module of the workspace with unsafe code (the workspace denies it elsewhere): a global
// allocator cannot be written without it.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The region's alignment: a page, so that its first block is aligned for any layout up to it.
const REGION_ALIGN: usize = 4096;

/// Every block starts on this boundary, whatever its layout asks, as the system allocator's do
/// (`malloc` returns 16-byte aligned memory on 64-bit targets): code outside Rust's layout rules
/// relies on it. The static build's unwinder (LLVM's libunwind) writes a panic's exception object,
/// which Rust allocates with 8-byte alignment, with 16-byte aligned stores: on a block 8 bytes off
/// that boundary, unwinding a panic (redb's, on a damaged store) crashed the plugin with SIGSEGV.
const MIN_BLOCK_ALIGN: usize = 16;

/// The plugin's arena: 8 MiB, the global allocator of the `blockipam` executable (through
/// [`CallAllocator`]); tests that run the plugin in-process leave it unused.
pub static CALL_ARENA: BumpArena<{ 8 << 20 }> = BumpArena::new();

/// The global allocator of the `blockipam` executable: [`CALL_ARENA`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CallAllocator;

// SAFETY: every call goes to CALL_ARENA, whose blocks are valid as GlobalAlloc requires.
unsafe impl GlobalAlloc for CallAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { CALL_ARENA.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        unsafe { CALL_ARENA.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as in `alloc`.
        unsafe { CALL_ARENA.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as in `alloc`.
        unsafe { CALL_ARENA.realloc(ptr, layout, new_size) }
    }
}

/// The bytes of the region, aligned to a page.
#[repr(C, align(4096))]
struct Region<const BYTES: usize>(UnsafeCell<[u8; BYTES]>);

/// A bump allocator over a region of `BYTES` bytes, falling back to [`System`].
#[allow(missing_debug_implementations)] // its region is megabytes of bytes
pub struct BumpArena<const BYTES: usize> {
    region: Region<BYTES>,
    /// Offset of the first free byte of the region.
    next: AtomicUsize,
    /// True once [`stop_bumping`](Self::stop_bumping) was called. False (a zero byte) at the
    /// start, so that the whole arena's initial value is zero bytes and a `static` of it lives in
    /// `.bss`: one non-zero byte would put all of it, region included, in `.data`, megabytes of
    /// every executable file.
    stopped: AtomicBool,
}

// SAFETY: the region's bytes are only reached through pointers handed out by `alloc`, each range
// to one caller at a time (the offset moves with compare-and-swaps; a range given back by a shrink
// is handed out again only after its former owner's writes, through their Release and Acquire), so
// threads never share a byte through the arena itself.
unsafe impl<const BYTES: usize> Sync for BumpArena<BYTES> {}

impl<const BYTES: usize> BumpArena<BYTES> {
    /// An arena that is all zero bytes, region, offset and flag (so a `static` of it lives in
    /// `.bss`: no page of it is stored in the executable, read from it or touched before it is
    /// used).
    pub const fn new() -> Self {
        BumpArena {
            region: Region(UnsafeCell::new([0; BYTES])),
            next: AtomicUsize::new(0),
            stopped: AtomicBool::new(false),
        }
    }

    /// From now on every allocation goes to the system allocator; blocks already handed out stay
    /// valid (and their frees are still ignored).
    pub fn stop_bumping(&self) {
        // Relaxed: the flag publishes no memory; it only picks the allocator for later requests,
        // and a request that still sees it unset gets a valid block from the region.
        self.stopped.store(true, Ordering::Relaxed);
    }

    /// True until [`stop_bumping`](Self::stop_bumping) was called.
    fn bumping(&self) -> bool {
        // Relaxed: as in `stop_bumping`.
        !self.stopped.load(Ordering::Relaxed)
    }

    /// Bytes of the region handed out so far (including alignment padding).
    pub fn used(&self) -> usize {
        // Relaxed: a count for reports; no byte of the region is reached through it.
        self.next.load(Ordering::Relaxed)
    }

    fn base(&self) -> usize {
        self.region.0.get() as usize
    }

    /// True when `ptr` points into the region.
    fn owns(&self, ptr: *mut u8) -> bool {
        let address = ptr as usize;
        address >= self.base() && address < self.base() + BYTES
    }

    /// A block for `layout` from the region, `None` when it does not fit in what is left.
    fn bump(&self, layout: Layout) -> Option<*mut u8> {
        if layout.align() > REGION_ALIGN || !self.bumping() {
            return None;
        }
        let base = self.base();
        // Relaxed: only a first guess; the compare-and-swap below checks it and synchronizes.
        let mut current = self.next.load(Ordering::Relaxed);
        loop {
            // Offsets are below BYTES, and BYTES plus an alignment fits a usize: no overflow.
            let align = layout.align().max(MIN_BLOCK_ALIGN);
            let start = (current + align - 1) & !(align - 1);
            let end = start.checked_add(layout.size())?;
            if end > BYTES {
                return None;
            }
            // Acquire on success: the bytes from `start` on may be the tail another thread's newest
            // block gave back by shrinking (`realloc`, whose Release pairs with this). Acquiring
            // makes that thread's writes to them happen before this caller's, so they cannot land
            // later on a weakly ordered CPU (over `alloc_zeroed`'s zeroes, say). Relaxed on
            // failure: the offset seen is only retried with.
            match self.next.compare_exchange_weak(
                current,
                end,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some((base + start) as *mut u8),
                Err(seen) => current = seen,
            }
        }
    }
}

impl<const BYTES: usize> Default for BumpArena<BYTES> {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every block handed out is either a range of the region no other block overlaps
// (`bump`), aligned as the layout asks, or a block of the system allocator; blocks are returned
// to whichever allocator made them.
unsafe impl<const BYTES: usize> GlobalAlloc for BumpArena<BYTES> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match self.bump(layout) {
            Some(ptr) => ptr,
            // SAFETY: the caller's layout has a non-zero size, as GlobalAlloc requires.
            None => unsafe { System.alloc(layout) },
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match self.bump(layout) {
            // Zeroed here: bytes the newest block gave back by shrinking in place are handed out
            // again.
            Some(ptr) => {
                // SAFETY: `bump` handed out `layout.size()` bytes at `ptr` to this caller alone.
                unsafe { std::ptr::write_bytes(ptr, 0, layout.size()) };
                ptr
            }
            // SAFETY: as in `alloc`.
            None => unsafe { System.alloc_zeroed(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !self.owns(ptr) {
            // SAFETY: a block outside the region came from the system allocator with `layout`.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !self.owns(ptr) {
            // SAFETY: a block outside the region came from the system allocator with `layout`.
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // The newest block of the region grows (while bumping) or shrinks in place.
        let offset = ptr as usize - self.base();
        let old_end = offset + layout.size();
        if let Some(new_end) = offset.checked_add(new_size) {
            // AcqRel on success. Release when the block shrinks: its tail goes back to the region,
            // and this thread's earlier writes to the tail must happen before those of whoever
            // gets it next (whose `bump` acquires). Acquire when it grows: the bytes it takes may
            // have been given back by another thread's shrink, as in `bump`. Relaxed on failure:
            // nothing is taken or given back then.
            if new_end <= BYTES
                && (new_size <= layout.size() || self.bumping())
                && self
                    .next
                    .compare_exchange(old_end, new_end, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            {
                return ptr;
            }
        }
        // Any other block shrinks where it is (the bytes past its new end are not reused).
        if new_size <= layout.size() {
            return ptr;
        }
        // SAFETY: GlobalAlloc's contract: `new_size` is non-zero and, rounded up to the alignment,
        // does not overflow.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: as in `alloc`.
        let moved = unsafe { self.alloc(new_layout) };
        if !moved.is_null() {
            // SAFETY: both blocks are valid for the smaller size and do not overlap (the new one
            // was handed out after the old one, from the region or the system).
            unsafe { std::ptr::copy_nonoverlapping(ptr, moved, layout.size().min(new_size)) };
        }
        moved
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(size: usize, align: usize) -> Layout {
        Layout::from_size_align(size, align).expect("a valid layout")
    }

    #[test]
    fn the_region_serves_up_to_its_last_byte_and_a_page_alignment_and_owns_nothing_past_its_end() {
        static ARENA: BumpArena<8192> = BumpArena::new();
        // Aligned to a page (the region's own alignment): from the region, at its start.
        let first = unsafe { ARENA.alloc(layout(4096, 4096)) };
        assert_eq!(
            first as usize,
            ARENA.base(),
            "a page-aligned block from the region"
        );
        // The rest of the region, to its last byte: from the region too.
        let last = unsafe { ARENA.alloc(layout(4096, 16)) };
        assert_eq!(
            last as usize,
            ARENA.base() + 4096,
            "the block ending at the region's end"
        );
        assert_eq!(ARENA.used(), 8192);
        // The region's last byte is its own, the address just past it is not.
        assert!(ARENA.owns((ARENA.base() + 8191) as *mut u8));
        assert!(!ARENA.owns((ARENA.base() + 8192) as *mut u8));
        assert!(!ARENA.owns((ARENA.base() - 1) as *mut u8));
        unsafe {
            ARENA.dealloc(last, layout(4096, 16));
            ARENA.dealloc(first, layout(4096, 4096));
        }
    }

    #[test]
    fn blocks_are_aligned_disjoint_and_from_the_region_until_it_is_full() {
        static ARENA: BumpArena<4096> = BumpArena::new();
        let mut blocks = Vec::new();
        for (size, align) in [(1, 1), (24, 8), (3, 2), (100, 64), (7, 1), (256, 128)] {
            let ptr = unsafe { ARENA.alloc(layout(size, align)) };
            assert!(!ptr.is_null());
            assert_eq!(ptr as usize % align, 0, "{size} bytes aligned to {align}");
            assert!(ARENA.owns(ptr));
            unsafe { std::ptr::write_bytes(ptr, 0xAB, size) };
            blocks.push((ptr as usize, size));
        }
        blocks.sort_unstable();
        for pair in blocks.windows(2) {
            assert!(
                pair[0].0 + pair[0].1 <= pair[1].0,
                "blocks overlap: {pair:?}"
            );
        }
        // What does not fit any more comes from the system allocator, and goes back to it.
        let big = layout(8192, 8);
        let ptr = unsafe { ARENA.alloc(big) };
        assert!(!ptr.is_null());
        assert!(!ARENA.owns(ptr));
        unsafe { ARENA.dealloc(ptr, big) };
        let used = ARENA.used();
        let ptr = unsafe { ARENA.alloc(layout(4096, 8)) };
        assert!(!ARENA.owns(ptr), "a block larger than what is left");
        unsafe { ARENA.dealloc(ptr, layout(4096, 8)) };
        assert_eq!(ARENA.used(), used, "a refused block takes nothing");
    }

    #[test]
    fn every_block_starts_on_a_16_byte_boundary_as_the_system_allocators_do() {
        static ARENA: BumpArena<4096> = BumpArena::new();
        for (size, align) in [(1, 1), (8, 8), (3, 2), (24, 8), (5, 4), (40, 8), (1, 1)] {
            let ptr = unsafe { ARENA.alloc(layout(size, align)) };
            assert!(ARENA.owns(ptr));
            assert_eq!(
                ptr as usize % MIN_BLOCK_ALIGN,
                0,
                "{size} bytes aligned to {align}"
            );
        }
    }

    #[test]
    fn once_stopped_every_block_comes_from_the_system_and_older_ones_stay_valid() {
        static ARENA: BumpArena<4096> = BumpArena::new();
        let before = unsafe { ARENA.alloc(layout(16, 8)) };
        assert!(ARENA.owns(before));
        unsafe { std::ptr::copy_nonoverlapping(b"kept across stop".as_ptr(), before, 16) };
        ARENA.stop_bumping();
        let after = unsafe { ARENA.alloc(layout(16, 8)) };
        assert!(
            !ARENA.owns(after),
            "a block after the stop comes from the system"
        );
        let zeroed = unsafe { ARENA.alloc_zeroed(layout(64, 8)) };
        assert!(!ARENA.owns(zeroed));
        // The block from before the stop moves to the system allocator when it must grow.
        let grown = unsafe { ARENA.realloc(before, layout(16, 8), 1000) };
        assert!(!ARENA.owns(grown));
        assert_eq!(
            unsafe { std::slice::from_raw_parts(grown, 16) },
            b"kept across stop"
        );
        assert_eq!(ARENA.used(), 16, "nothing more was taken from the region");
        for (ptr, size) in [(after, 16), (zeroed, 64), (grown, 1000)] {
            unsafe { ARENA.dealloc(ptr, layout(size, 8)) };
        }
    }

    #[test]
    fn an_alignment_beyond_a_page_goes_to_the_system_allocator() {
        static ARENA: BumpArena<65536> = BumpArena::new();
        let wide = layout(64, 8192);
        let ptr = unsafe { ARENA.alloc(wide) };
        assert!(!ptr.is_null());
        assert!(!ARENA.owns(ptr));
        assert_eq!(ptr as usize % 8192, 0);
        unsafe { ARENA.dealloc(ptr, wide) };
        assert_eq!(ARENA.used(), 0);
    }

    #[test]
    fn the_newest_block_grows_in_place_and_an_older_one_moves_with_its_bytes() {
        static ARENA: BumpArena<4096> = BumpArena::new();
        let first = unsafe { ARENA.alloc(layout(16, 8)) };
        unsafe { std::ptr::copy_nonoverlapping(b"0123456789abcdef".as_ptr(), first, 16) };
        let grown = unsafe { ARENA.realloc(first, layout(16, 8), 64) };
        assert_eq!(grown, first, "the newest block grows in place");
        assert_eq!(ARENA.used(), 64);
        let second = unsafe { ARENA.alloc(layout(8, 8)) };
        let shrunk = unsafe { ARENA.realloc(first, layout(64, 8), 32) };
        assert_eq!(shrunk, first, "an older block shrinks in place");
        assert_eq!(ARENA.used(), 72, "and gives nothing back");
        let moved = unsafe { ARENA.realloc(first, layout(32, 8), 128) };
        assert_ne!(moved, first, "an older block moves");
        assert!(
            moved as usize >= second as usize + 8,
            "it moves past the newer block"
        );
        let bytes = unsafe { std::slice::from_raw_parts(moved, 16) };
        assert_eq!(bytes, b"0123456789abcdef");
        // Moving beyond the region: the bytes go along to the system allocator's block.
        let out = unsafe { ARENA.realloc(moved, layout(128, 8), 10_000) };
        assert!(ARENA.owns(moved));
        assert!(!ARENA.owns(out));
        let bytes = unsafe { std::slice::from_raw_parts(out, 16) };
        assert_eq!(bytes, b"0123456789abcdef");
        let back = unsafe { ARENA.realloc(out, layout(10_000, 8), 20_000) };
        assert!(!ARENA.owns(back));
        assert_eq!(
            unsafe { std::slice::from_raw_parts(back, 16) },
            b"0123456789abcdef"
        );
        unsafe { ARENA.dealloc(back, layout(20_000, 8)) };
    }

    #[test]
    fn a_zeroed_block_is_zero_from_the_region_and_from_the_system() {
        static ARENA: BumpArena<4096> = BumpArena::new();
        // The newest block written, then shrunk in place: its tail is handed out again.
        let written = unsafe { ARENA.alloc(layout(256, 8)) };
        unsafe { std::ptr::write_bytes(written, 0xFF, 256) };
        let shrunk = unsafe { ARENA.realloc(written, layout(256, 8), 16) };
        assert_eq!(shrunk, written);
        assert_eq!(ARENA.used(), 16);
        let reused = unsafe { ARENA.alloc_zeroed(layout(200, 8)) };
        assert_eq!(reused as usize, written as usize + 16, "the tail is reused");
        assert!(unsafe { std::slice::from_raw_parts(reused, 200) }
            .iter()
            .all(|b| *b == 0));
        let inside = unsafe { ARENA.alloc_zeroed(layout(1000, 8)) };
        assert!(ARENA.owns(inside));
        assert!(unsafe { std::slice::from_raw_parts(inside, 1000) }
            .iter()
            .all(|b| *b == 0));
        let outside = unsafe { ARENA.alloc_zeroed(layout(5000, 8)) };
        assert!(!ARENA.owns(outside));
        assert!(unsafe { std::slice::from_raw_parts(outside, 5000) }
            .iter()
            .all(|b| *b == 0));
        unsafe { ARENA.dealloc(outside, layout(5000, 8)) };
    }

    #[test]
    fn threads_allocating_at_once_never_get_overlapping_blocks() {
        static ARENA: BumpArena<{ 256 << 10 }> = BumpArena::new();
        let threads: Vec<_> = (0..4u8)
            .map(|mark| {
                std::thread::spawn(move || {
                    let mut mine = Vec::new();
                    for i in 0..2000usize {
                        let size = 1 + (i * 7 + usize::from(mark)) % 200;
                        let ptr = unsafe { ARENA.alloc(layout(size, 8)) };
                        assert!(!ptr.is_null());
                        unsafe { std::ptr::write_bytes(ptr, mark, size) };
                        mine.push((ptr as usize, size));
                    }
                    // Every byte still holds this thread's mark: nobody else wrote over it.
                    for (ptr, size) in &mine {
                        let bytes = unsafe { std::slice::from_raw_parts(*ptr as *const u8, *size) };
                        assert!(bytes.iter().all(|b| *b == mark), "a block was overwritten");
                    }
                    mine
                })
            })
            .collect();
        let mut all: Vec<(usize, usize)> = threads
            .into_iter()
            .flat_map(|t| t.join().expect("an allocating thread panicked"))
            .collect();
        all.sort_unstable();
        for pair in all.windows(2) {
            assert!(
                pair[0].0 + pair[0].1 <= pair[1].0,
                "blocks overlap: {pair:?}"
            );
        }
        assert!(
            all.iter().any(|(ptr, _)| !ARENA.owns(*ptr as *mut u8)),
            "the region filled up and the rest went to the system allocator"
        );
    }
}
