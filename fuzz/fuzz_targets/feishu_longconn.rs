//! Feishu/Lark's long connection as a hostile server could drive it: the endpoint answer, and a
//! stream of frames (each prefixed with its u16 length) through the reassembly of split events.
#![no_main]
use imgate::fuzzing::feishu::Frame;
use imgate::fuzzing::feishu::longconn::{self, ClientConfig, Reassembly, Received, MAX_PAYLOAD};
use libfuzzer_sys::fuzz_target;
use std::time::{Duration, Instant};

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(e) = longconn::read_endpoint(text, ClientConfig::default()) {
            assert!(e.config.ping_every >= Duration::from_secs(10));
        }
    }
    let mut r = Reassembly::default();
    let start = Instant::now();
    let mut rest = data;
    let mut n = 0u64;
    while rest.len() >= 2 {
        let len = usize::from(u16::from_le_bytes([rest[0], rest[1]])).min(rest.len() - 2);
        let (bytes, tail) = rest[2..].split_at(len);
        rest = tail;
        n += 1;
        let Ok(frame) = Frame::decode(bytes) else { continue };
        if let Received::Event { payload, answer, .. } = r.receive(frame, start + Duration::from_millis(n * 100)) {
            assert!(payload.len() <= MAX_PAYLOAD.max(bytes.len()));
            let reply = longconn::respond(answer, true, Duration::from_millis(1));
            assert!(Frame::decode(&reply.encode()).is_ok());
        }
    }
});
