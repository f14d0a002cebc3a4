//! A WebSocket text frame from xAgent, as the packet engine decodes it, and the payloads of IM
//! profile v2 as their readers take them.
#![no_main]
use imgate::fuzzing::{parse_activity, parse_delta, parse_message, Packet};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Text frames are UTF-8 by the time they reach the decoder (tungstenite checks that).
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(packet) = Packet::parse(text) {
            let _ = parse_message(&packet.payload);
            let _ = parse_delta(&packet.payload);
            let _ = parse_activity(&packet.payload);
            // Whatever decodes must encode again without a panic.
            let _ = packet.into_json();
        }
    }
});
