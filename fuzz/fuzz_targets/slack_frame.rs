//! A Socket Mode frame as a hostile server could send it: the frame reader (hello, disconnect,
//! envelopes, message events with threads and files) must never panic; what it reads stays
//! within its bounds, and every ID it hands on is safe as a key, a file name or a URL parameter.
#![no_main]
use imgate::fuzzing::slack::event::{self, Event, Frame, MAX_TEXT_BYTES};
use libfuzzer_sys::fuzz_target;

fn safe(id: &str) -> bool {
    id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    match event::read_frame(text) {
        Frame::Envelope { envelope_id, event } => {
            assert!(!envelope_id.is_empty() && envelope_id.len() <= 128 && safe(&envelope_id));
            if let Event::Message(m) = event {
                assert!(event::ts_micros(&m.ts).is_some());
                assert!(safe(&m.channel) && safe(&m.user) && safe(&m.event_id));
                assert!(m.text.len() <= MAX_TEXT_BYTES);
                let shown = event::readable(&m.text, |u| Some(u.to_string()));
                assert!(shown.len() <= m.text.len() * 3 + 16);
                assert!(event::mentioned(&m.text, 8).len() <= 8);
            }
        }
        Frame::Disconnect { reason } => assert!(reason.len() <= 64),
        Frame::Hello | Frame::Other(_) => {}
    }
});
