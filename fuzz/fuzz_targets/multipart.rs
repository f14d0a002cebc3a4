//! POST /files/uploads: the first line is the Content-Type header, the rest is the body, parsed
//! whole and streamed in two pieces split where its first byte says: both must agree.
#![no_main]
use imgate::fuzzing::multipart::{self, Event, Stream};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let split = data.iter().position(|&b| b == b'\n').unwrap_or(data.len());
    let (head, body) = (&data[..split], data.get(split + 1..).unwrap_or_default());
    let Ok(content_type) = std::str::from_utf8(head) else {
        return;
    };
    let Some(boundary) = multipart::boundary(content_type) else {
        return;
    };
    let whole = multipart::parse(body, &boundary);
    let (first, second) = body.split_at(body.first().map_or(0, |&b| usize::from(b) * body.len() / 256));
    let (mut stream, mut streamed_bytes) = (Stream::new(&boundary), 0);
    let mut on = |e: Event<'_>| {
        if let Event::Data(d) = e {
            streamed_bytes += d.len();
        }
        Ok(())
    };
    let streamed = stream.feed(first, &mut on).and_then(|()| stream.feed(second, &mut on));
    match (whole, streamed.and_then(|()| stream.finish())) {
        (Ok(parts), Ok(())) => assert_eq!(parts.iter().map(|p| p.data.len()).sum::<usize>(), streamed_bytes),
        (Err(a), Err(b)) => assert_eq!(a, b),
        (a, b) => panic!("whole {a:?}, streamed {b:?}"),
    }
});
