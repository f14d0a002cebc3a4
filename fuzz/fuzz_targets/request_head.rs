//! The first bytes of a connection to the one port, as the front door reads the request head.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = imgate::dataplane::listen::parse_head(data);
});
