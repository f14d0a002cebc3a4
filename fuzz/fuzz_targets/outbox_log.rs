//! The outbox's write-ahead log as a replay reads it at start: record framing, checksums and
//! the redo records inside (a damaged SD card can hand back any bytes).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = imgate::fuzzing::read_log(data);
});
