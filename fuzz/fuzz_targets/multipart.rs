//! POST /files/uploads: the first line is the Content-Type header, the rest is the body.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let split = data.iter().position(|&b| b == b'\n').unwrap_or(data.len());
    let (head, body) = (&data[..split], data.get(split + 1..).unwrap_or_default());
    let Ok(content_type) = std::str::from_utf8(head) else {
        return;
    };
    if let Some(boundary) = imgate::fuzzing::multipart::boundary(content_type) {
        let _ = imgate::fuzzing::multipart::parse(body, &boundary);
    }
});
