//! The first bytes of a connection to the one port, as the front door reads a request head.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some((start, end)) = imgate::fuzzing::front::head::find_end(data) {
        let _ = imgate::fuzzing::front::head::parse(&data[start..end]);
    }
    let _ = imgate::fuzzing::front::head::parse(data);
});
