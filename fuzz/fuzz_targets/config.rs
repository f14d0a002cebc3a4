//! The config file, as `imgate check` and `imgate run` read it.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The loader reads the file as UTF-8 and reports other bytes as an error before parsing.
    if let Ok(text) = std::str::from_utf8(data) {
        // No directory: a `*_file` key can only name a file by absolute path, and a missing one
        // is a config error like any other.
        if let Ok(cfg) = imgate::fuzzing::parse_config(text, "fuzz.conf", None, &imgate::fuzzing::config_readers()) {
            let _ = cfg.summary();
        }
    }
});
