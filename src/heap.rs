//! The process's heap: one for every thread, and what a burst took given back once it is over.
//!
//! An allocator keeps the memory a burst (a backlog rendered for delivery, a large upload)
//! made it take from the system: without help, a daemon idles at its last peak until it
//! restarts. `give_back` returns what is free: glibc's `malloc_trim` (which also releases free
//! pages in the middle of the heap), or dlmalloc's `trim` on musl, where the heap is ours,
//! large blocks are not in it, and the pages in the middle go back as each block is freed.

/// Gives the heap's free memory back to the system. It walks the heap under the allocator's
/// lock: call it after a burst, on a pool thread, not in a loop.
pub fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::ffi::c_int;
        }
        // SAFETY: malloc_trim takes a plain integer and only rearranges glibc's own free lists.
        unsafe {
            malloc_trim(0);
        }
    }
    #[cfg(target_env = "musl")]
    dl::trim();
}

/// The whole pages inside the block at `start` of `size` bytes, leaving `margin` bytes clear at
/// either end: its first address and length, if there is a page.
#[cfg_attr(not(target_env = "musl"), allow(dead_code))]
fn inner_pages(start: usize, size: usize, margin: usize, page: usize) -> Option<(usize, usize)> {
    let first = start.checked_add(margin)?.checked_next_multiple_of(page)?;
    let end = start.checked_add(size)?.checked_sub(margin)? / page * page;
    (end > first).then(|| (first, end - first))
}

/// On musl, dlmalloc under a lock of our own, so that it can be trimmed (the crate's own
/// global allocator offers no way to). Large blocks go to musl's own allocator, which maps each
/// on pages of its own and unmaps them when freed: a large buffer freed never leaves a hole in
/// dlmalloc's heap that only a trim of its top could give back.
#[cfg(target_env = "musl")]
mod dl {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::{Mutex, MutexGuard};

    /// Blocks from this size are musl's (its own threshold for a mapping of their own is just
    /// under it).
    const LARGE: usize = 128 * 1024;

    struct Heap(Mutex<dlmalloc::Dlmalloc>);

    #[global_allocator]
    static HEAP: Heap = Heap(Mutex::new(dlmalloc::Dlmalloc::new()));

    impl Heap {
        fn lock(&self) -> MutexGuard<'_, dlmalloc::Dlmalloc> {
            // dlmalloc panics only on a layout its caller got wrong (an assertion in `free`);
            // a poisoned lock still guards the heap as it was.
            self.0.lock().unwrap_or_else(|e| e.into_inner())
        }
    }

    // SAFETY: a block's owner follows from its layout's size, which `dealloc` and `realloc`
    // are given exactly as it was allocated; dlmalloc's calls are made under the one lock,
    // with the layout they were given, as the crate's own `GlobalDlmalloc` makes them.
    unsafe impl GlobalAlloc for Heap {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            match layout.size() >= LARGE {
                true => System.alloc(layout),
                false => self.lock().malloc(layout.size(), layout.align()),
            }
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            match layout.size() >= LARGE {
                true => System.alloc_zeroed(layout),
                false => self.lock().calloc(layout.size(), layout.align()),
            }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            match layout.size() >= LARGE {
                true => System.dealloc(ptr, layout),
                false => {
                    release_inside(ptr, layout.size());
                    self.lock().free(ptr, layout.size(), layout.align());
                }
            }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            match (layout.size() >= LARGE, new_size >= LARGE) {
                (true, true) => System.realloc(ptr, layout, new_size),
                // A block of `RELEASED` bytes or more that grows (a buffer doubling) is moved
                // here rather than by dlmalloc, so that the old one gives its pages back before
                // it is freed.
                (false, false) if new_size <= layout.size() || layout.size() < RELEASED => {
                    self.lock().realloc(ptr, layout.size(), layout.align(), new_size)
                }
                // From one owner to the other, or grown: a new block, the bytes, the old block
                // freed.
                _ => {
                    let moved = Layout::from_size_align_unchecked(new_size, layout.align());
                    let new = self.alloc(moved);
                    if !new.is_null() {
                        std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                    new
                }
            }
        }
    }

    /// Blocks from this size give their whole pages back when freed (fewer pages than this
    /// are not worth a system call).
    const RELEASED: usize = 8 * 1024;
    /// What dlmalloc writes into a block it is given back: its free-list links after the
    /// start (six words), the block's size in the next one's first word (which an allocated
    /// block may use as its last). Generous: a page either side is released or not anyway.
    const BOOKKEEPING: usize = 64;

    /// Hands the whole pages inside a block about to be freed back to the kernel (they read as
    /// zero when next touched). dlmalloc itself gives back only the top of its heap: without
    /// this, a buffer freed in the middle (a rendered push, a stored message read for delivery)
    /// kept its pages after a backlog had drained. Before the free, not after: the block is
    /// still its owner's, so no other thread can be given it, and it is still mapped (a free
    /// may trim the heap and unmap it, and the address be mapped again by someone else).
    unsafe fn release_inside(ptr: *mut u8, size: usize) {
        if size < RELEASED {
            return;
        }
        if let Some((start, len)) = super::inner_pages(ptr as usize, size, BOOKKEEPING, page_size()) {
            // SAFETY: the range lies inside a block its owner is freeing, clear of what dlmalloc
            // writes into a free block. A failure leaves the pages resident, as before.
            let _ = rustix::mm::madvise(start as *mut _, len, rustix::mm::Advice::LinuxDontNeed);
        }
    }

    /// The kernel's page size, from the auxiliary vector musl kept at start (no allocation,
    /// no lock: it is read inside the allocator).
    fn page_size() -> usize {
        const AT_PAGESZ: std::ffi::c_ulong = 6;
        extern "C" {
            fn getauxval(kind: std::ffi::c_ulong) -> std::ffi::c_ulong;
        }
        // SAFETY: getauxval only reads the vector the kernel gave the process.
        match usize::try_from(unsafe { getauxval(AT_PAGESZ) }) {
            Ok(page) if page.is_power_of_two() => page,
            _ => 4096,
        }
    }

    pub fn trim() {
        // SAFETY: trimming releases only memory dlmalloc holds free.
        unsafe {
            HEAP.lock().trim(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::inner_pages;

    #[test]
    fn inner_pages_leave_the_margins_and_partial_pages_alone() {
        // A block from 0x1000 to 0x5000: its first and last pages hold the margins.
        assert_eq!(inner_pages(0x1000, 0x4000, 64, 4096), Some((0x2000, 0x2000)));
        assert_eq!(inner_pages(0x1010, 0x4000, 64, 4096), Some((0x2000, 0x2000)));
        // Margins that end and start on page boundaries leave every page between them.
        assert_eq!(inner_pages(0x1000, 0x4040, 64, 4096), Some((0x2000, 0x3000)));
        assert_eq!(inner_pages(0x0fc0, 0x4080, 64, 4096), Some((0x1000, 0x4000)));
        // Less than a whole page beyond its margins: nothing.
        assert_eq!(inner_pages(0x1010, 0x1000, 64, 4096), None);
        assert_eq!(inner_pages(0x1000, 0x2000 + 63, 64, 4096), None);
        assert_eq!(inner_pages(0x10, 0x8000, 64, 0x4000), None);
        // At the end of the address space the sums would overflow: nothing, and no panic.
        assert_eq!(inner_pages(usize::MAX - 0x10, 0x4000, 64, 4096), None);
        assert_eq!(inner_pages(usize::MAX - 0x100, 0x80, 64, 4096), None);
    }
}
