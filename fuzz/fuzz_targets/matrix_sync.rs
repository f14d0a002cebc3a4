//! A `/sync` answer or a `/messages` page as a hostile homeserver could send it: the readers must
//! never panic, every ID they hand on is printable, short and starts with its sigil (it becomes a
//! key, a path segment, a `message_id`), every file URI is one that cannot change a path, and
//! every text stays within its bound.
#![no_main]
use imgate::fuzzing::matrix::event::{self, Event};
use libfuzzer_sys::fuzz_target;

fn checked(e: &Event) {
    assert!(event::valid_id(&e.event_id, b'$') && event::valid_id(&e.sender, b'@'));
    if let Some(m) = &e.message {
        assert!(m.body.len() <= 64 * 1024);
        if let Some(media) = &m.media {
            let (server, id) = imgate::fuzzing::matrix::api_mxc_parts(&media.mxc).expect("a checked mxc URI");
            assert!(!server.contains('/') && !id.contains('/') && !id.contains('.'));
            assert!(media.filename.len() <= 256 && !media.filename.is_empty());
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(value) = imgate::fuzzing::parse_json(text) else { return };
    let Some(o) = imgate::fuzzing::as_object(&value) else { return };
    if let Some(answer) = event::read_sync(o) {
        assert!(!answer.next_batch.is_empty() && answer.next_batch.len() <= 1024);
        assert!(answer.invited.iter().all(|r| event::valid_id(r, b'!')));
        for room in &answer.rooms {
            assert!(event::valid_id(&room.room_id, b'!'));
            room.events.iter().for_each(checked);
            assert!(room.names.iter().all(|(u, n)| event::valid_id(u, b'@') && n.len() <= 256));
        }
    }
    let page = event::read_page(o);
    page.events.iter().for_each(checked);
    assert!(page.end.as_ref().is_none_or(|t| t.len() <= 1024));
});
