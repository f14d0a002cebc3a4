//! A Feishu/Lark event payload as a hostile server could send it: the event reader (header,
//! `im.message.receive_v1`, message content of every type, mentions, rich text) must never
//! panic, and what it reads stays within its bounds.
#![no_main]
use imgate::fuzzing::feishu::event::{self, MAX_TEXT_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(e) = event::read(data) {
        assert!(e.event_id.len() <= 256 && e.event_type.len() <= 256);
        if let Some(m) = e.message {
            assert!(m.inbound.text.len() <= MAX_TEXT_BYTES + 64);
            assert!(!m.chat_id.is_empty() && m.chat_id.len() <= 128);
            if let Some(r) = m.resource {
                assert!(r.file_key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'));
            }
        }
    }
});
