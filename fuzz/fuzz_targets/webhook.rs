//! The body of POST /webhook/{channel} (contract section 4), any bytes at all.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(inbound) = imgate::fuzzing::parse_webhook_body(data) {
        // What is accepted is stored as JSON and must serialize.
        let _ = miniserde::json::to_string(&inbound);
    }
});
