//! A long-connection frame as a hostile server could send it: the frame reader (answers,
//! robot messages of every type, events) must never panic; what it reads stays within its
//! bounds and every ID it hands on is printable and short. The same bytes as a media file's
//! ciphertext and as a `Content-Disposition` never panic the decryption or the name reader.
#![no_main]
use imgate::fuzzing::wecom::event::{self, Frame, MAX_ID, MAX_TEXT_BYTES};
use imgate::fuzzing::wecom::media;
use libfuzzer_sys::fuzz_target;

fn printable(id: &str, max: usize) -> bool {
    !id.is_empty() && id.len() <= max && id.bytes().all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
}

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        match event::read_frame(text) {
            Frame::Message { req_id, message } => {
                assert!(req_id.is_empty() || printable(&req_id, MAX_ID));
                assert!(printable(&message.msgid, MAX_ID) && printable(&message.sender, MAX_ID));
                assert!(printable(&message.chat, MAX_ID));
                assert!(message.text.len() <= MAX_TEXT_BYTES);
                assert!(message.media.as_ref().is_none_or(|m| m.url.starts_with("http") && m.aeskey.len() <= 64));
            }
            Frame::Answer { req_id, errmsg, .. } => assert!(printable(&req_id, MAX_ID) && errmsg.len() <= 256),
            Frame::Kicked | Frame::Event(_) | Frame::Unreadable(_) | Frame::Other(_) => {}
        }
        if let Some(name) = media::filename(text) {
            assert!(!name.contains('/') && name.len() <= 200);
        }
    }
    let key = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8";
    if let Some(mut d) = media::Decrypting::new(key) {
        let mut sink = |_: &[u8]| -> Result<(), String> { Ok(()) };
        let _ = d.push(data, &mut sink);
        let _ = d.finish(&mut sink);
    }
});
