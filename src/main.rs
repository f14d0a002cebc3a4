//! imgate: an xAgent IM Connector Server for edge devices. The command line and the wiring are
//! `imgate::cli`; the library exists so that the fuzz targets in fuzz/ can reach the parsers.

fn main() -> std::process::ExitCode {
    one_heap();
    imgate::cli::main()
}

/// glibc gives a thread that finds the heap busy an arena of its own (up to eight per core),
/// and each arena keeps its own freed memory: the pool threads that render pushes, the
/// committer and the executor each held some, and the peak grew with them at no gain in rate
/// (docs/benchmarks.md). One heap for every thread, as dlmalloc on musl has.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn one_heap() {
    const M_ARENA_MAX: std::ffi::c_int = -8;
    extern "C" {
        fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
    }
    // SAFETY: mallopt sets one of glibc's allocator tunables from plain integers; it is called
    // first thing in main, before any other thread exists.
    unsafe {
        mallopt(M_ARENA_MAX, 1);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn one_heap() {}
