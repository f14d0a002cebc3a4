//! imgate: an xAgent IM Connector Server for edge devices. The command line and the wiring are
//! `imgate::cli`; the library exists so that the fuzz targets in fuzz/ can reach the parsers.

#[cfg(target_env = "musl")]
#[global_allocator]
static ALLOCATOR: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

fn main() -> std::process::ExitCode {
    imgate::cli::main()
}
