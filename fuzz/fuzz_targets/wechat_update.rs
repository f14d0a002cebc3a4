//! One iLink `getupdates` answer, as the WeChat receiver reads it, and a QR code drawn from
//! whatever text a login shows.
#![no_main]
use imgate::fuzzing::{as_object, parse_json, qr_data_url, read_wechat_batch};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = qr_data_url(text);
    let Some(v) = parse_json(text).ok() else {
        return;
    };
    if let Some(o) = as_object(&v) {
        for m in read_wechat_batch(o).messages {
            // What is read is stored as JSON and must serialize.
            let _ = miniserde::json::to_string(&m.inbound);
        }
    }
});
