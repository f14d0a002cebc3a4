//! A Gateway payload as a hostile server could send it: the frame reader (HELLO, heartbeats,
//! READY, MESSAGE_CREATE with mentions, attachments and replies) must never panic; what it
//! reads stays within its bounds, and every ID it hands on is a snowflake, safe as a key, a
//! file name or a URL path.
#![no_main]
use imgate::fuzzing::discord::event::{self, Event, Frame, MAX_MENTIONS, MAX_TEXT_BYTES};
use libfuzzer_sys::fuzz_target;

fn snowflake(id: &str) -> bool {
    event::snowflake(id).is_some()
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Frame::Dispatch { event, .. } = event::read_frame(text) {
        match event {
            Event::Message(m) => {
                assert!(m.id > 0 && snowflake(&m.channel));
                assert!(m.author_id.is_empty() || snowflake(&m.author_id));
                assert!(m.guild.as_deref().is_none_or(snowflake));
                assert!(m.content.len() <= MAX_TEXT_BYTES);
                assert!(m.mentions.len() <= MAX_MENTIONS && m.mentions.iter().all(|(id, _)| snowflake(id)));
                let shown = event::readable(&m.content, &m.mentions);
                // A mention of 4 bytes becomes `@` and a name of at most 80 characters.
                assert!(shown.len() <= m.content.len().saturating_mul(81) + 16);
                let _ = m.created_ms();
            }
            Event::Ready { session_id, resume_url, user_id } => {
                assert!(snowflake(&user_id) && session_id.len() <= 128);
                assert!(resume_url.starts_with("ws"));
            }
            _ => {}
        }
    }
});
