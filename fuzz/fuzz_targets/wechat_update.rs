//! One iLink `getupdates` answer, as the WeChat receiver reads it, a QR code drawn from
//! whatever text a login shows, and a CDN file decrypted as it arrives (key, piece size,
//! ciphertext): in pieces of any size it decrypts as it does whole, or fails the same.
#![no_main]
use imgate::fuzzing::{as_object, parse_json, qr_data_url, read_wechat_batch, WechatDecrypting};
use libfuzzer_sys::fuzz_target;

fn decrypted(key: &[u8; 16], cipher: &[u8], piece: usize) -> Result<Vec<u8>, String> {
    let mut plain = Vec::new();
    let mut out = |p: &[u8]| {
        plain.extend_from_slice(p);
        Ok::<_, String>(())
    };
    let mut d = WechatDecrypting::new(key);
    for c in cipher.chunks(piece) {
        d.push(c, &mut out)?;
    }
    d.finish(&mut out)?;
    Ok(plain)
}

fuzz_target!(|data: &[u8]| {
    if let (Some(key), Some(&piece)) = (data.get(..16), data.get(16)) {
        let key: [u8; 16] = key.try_into().unwrap_or_default();
        let cipher = &data[17..];
        let whole = decrypted(&key, cipher, cipher.len().max(1));
        assert_eq!(decrypted(&key, cipher, usize::from(piece).max(1)), whole);
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = qr_data_url(text);
    let Some(v) = parse_json(text).ok() else {
        return;
    };
    if let Some(o) = as_object(&v) {
        for m in read_wechat_batch(o).messages {
            // What is read is stored as JSON and must serialize.
            let _ = miniserde::json::to_string(&m.inbound);
        }
    }
});
