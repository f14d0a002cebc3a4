//! The process's heap: one for every thread, and what a burst took given back once it is over.
//!
//! An allocator keeps the memory a burst (a backlog rendered for delivery, a large upload)
//! made it take from the system: without help, a daemon idles at its last peak until it
//! restarts. `give_back` returns what is free: glibc's `malloc_trim` (which also releases free
//! pages in the middle of the heap), or dlmalloc's `trim` on musl, where the heap is ours.

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
/// global allocator offers no way to).
#[cfg(target_env = "musl")]
mod dl {
    use std::alloc::{GlobalAlloc, Layout};
    use std::sync::{Mutex, MutexGuard};

    struct Heap(Mutex<dlmalloc::Dlmalloc>);

    #[global_allocator]
    static HEAP: Heap = Heap(Mutex::new(dlmalloc::Dlmalloc::new()));

    impl Heap {
        fn lock(&self) -> MutexGuard<'_, dlmalloc::Dlmalloc> {
            // Nothing panics while it is held; a poisoned lock still guards a sound heap.
            self.0.lock().unwrap_or_else(|e| e.into_inner())
        }
    }

    // SAFETY: every call goes to dlmalloc under the one lock, with the layout it was given,
    // exactly as the crate's own `GlobalDlmalloc` does under its lock.
    unsafe impl GlobalAlloc for Heap {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            self.lock().malloc(layout.size(), layout.align())
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            self.lock().calloc(layout.size(), layout.align())
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            self.lock().free(ptr, layout.size(), layout.align())
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            self.lock().realloc(ptr, layout.size(), layout.align(), new_size)
        }
    }

    pub fn trim() {
        // SAFETY: trimming releases only memory dlmalloc holds free.
        unsafe {
            HEAP.lock().trim(0);
        }
    }
}
