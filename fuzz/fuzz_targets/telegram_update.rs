//! One Telegram update, as `getUpdates` lists them and as POST /telegram/webhook receives one.
#![no_main]
use imgate::fuzzing::{as_object, parse_json};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some(v) = std::str::from_utf8(data).ok().and_then(|t| parse_json(t).ok()) else {
        return;
    };
    if let Some(update) = as_object(&v).and_then(imgate::fuzzing::read_telegram_update) {
        if let Some(message) = update.message {
            // What is read is stored as JSON and must serialize.
            let _ = miniserde::json::to_string(&message.inbound);
        }
    }
});
