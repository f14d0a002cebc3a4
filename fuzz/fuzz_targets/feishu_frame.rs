//! One binary WebSocket message of Feishu/Lark's long connection, as the frame codec reads it.
#![no_main]
use imgate::fuzzing::feishu::Frame;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(frame) = Frame::decode(data) {
        // What is read writes out again and reads back the same.
        let again = Frame::decode(&frame.encode()).expect("an encoded frame decodes");
        assert_eq!(again, frame);
    }
});
