//! A Stream mode frame as a hostile server could send it: the frame reader (pings, disconnects,
//! robot messages of every type, rich text) must never panic; what it reads stays within its
//! bounds, every ID it hands on is printable and short, every conversation ID becomes a safe
//! key, and every answer it builds is JSON.
#![no_main]
use imgate::fuzzing::dingtalk::event::{self, Frame, MAX_TEXT_BYTES};
use libfuzzer_sys::fuzz_target;

fn printable(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic())
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    match event::read_frame(text) {
        Frame::Robot { message_id, message } => {
            assert!(printable(&message_id) && printable(&message.msg_id));
            assert!(event::conversation_shaped(&message.conversation));
            let key = event::conversation_key(&message.conversation);
            assert!(key.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)));
            assert!(message.text.len() <= MAX_TEXT_BYTES);
            assert!(message.webhook.as_ref().is_none_or(|(u, _)| u.starts_with("http") && u.len() <= 1024));
            assert!(imgate::fuzzing::parse_json(&event::stored(&message_id)).is_ok());
        }
        Frame::Ping { message_id, data } => {
            assert!(printable(&message_id) && data.len() <= 1024);
            assert!(imgate::fuzzing::parse_json(&event::answer(&message_id, 200, "OK", &data)).is_ok());
        }
        Frame::Unreadable { message_id, .. } | Frame::Unwanted { message_id } => assert!(printable(&message_id)),
        Frame::Disconnect { reason } => assert!(reason.len() <= 256),
        Frame::Other(_) => {}
    }
});
