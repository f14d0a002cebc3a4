//! The process's heap: one for every thread, and what a burst took given back once it is over.
//!
//! An allocator keeps the memory a burst (a backlog rendered for delivery, a large upload)
//! made it take from the system: without help, a daemon idles at its last peak until it
//! restarts. `give_back` returns what is free: glibc's `malloc_trim` (which also releases free
//! pages in the middle of the heap), or dlmalloc's `trim` on musl, where the heap is ours and
//! large blocks are not in it.

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
                false => self.lock().free(ptr, layout.size(), layout.align()),
            }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            match (layout.size() >= LARGE, new_size >= LARGE) {
                (true, true) => System.realloc(ptr, layout, new_size),
                (false, false) => self.lock().realloc(ptr, layout.size(), layout.align(), new_size),
                // From one owner to the other: a new block, the bytes, the old block freed.
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

    pub fn trim() {
        // SAFETY: trimming releases only memory dlmalloc holds free.
        unsafe {
            HEAP.lock().trim(0);
        }
    }
}
