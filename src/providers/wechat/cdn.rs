//! WeChat's media on its CDN: AES-128-ECB with PKCS#7 padding, under a key each item carries
//! (inbound) or that imgate makes (outbound). Downloads go to the configured `cdn_base` (a
//! `full_url` is followed only when it is on that host); uploads go where `getuploadurl` says,
//! and the CDN's `x-encrypted-param` answer header is what a message then names.

use std::time::Duration;

use aes::cipher::generic_array::GenericArray;
use aes::cipher::{BlockDecrypt, BlockEncrypt, KeyInit};
use aes::Aes128;

use crate::json::{self, Object};
use crate::upstream::{self, Streamed};

/// A media item of an inbound message, before it is fetched.
#[derive(Debug, Clone, PartialEq)]
pub struct MediaRef {
    /// `image`, `file`, `video` or `audio`.
    pub kind: &'static str,
    pub query: Option<String>,
    pub full_url: Option<String>,
    /// The key as the item gives it: base64 of 16 bytes or of 32 hex digits, or 32 hex digits.
    pub key: Option<String>,
    pub file_name: Option<String>,
}

const MAX_FIELD: usize = 2048;

fn field(o: &Object, k: &str) -> Option<String> {
    json::get_str(o, k)
        .filter(|v| !v.is_empty() && v.len() <= MAX_FIELD)
        .map(str::to_string)
}

/// The media of one item (`type` 2 image, 3 voice, 4 file, 5 video); `None` for other items.
pub fn media_of(item: &Object) -> Option<MediaRef> {
    let (kind, sub) = match json::get_u64(item, "type")? {
        2 => ("image", "image_item"),
        3 => ("audio", "voice_item"),
        4 => ("file", "file_item"),
        5 => ("video", "video_item"),
        _ => return None,
    };
    let sub = json::get_obj(item, sub)?;
    let media = json::get_obj(sub, "media")?;
    // Images carry the key best as `image_item.aeskey` (hex).
    let key = field(sub, "aeskey").or_else(|| field(media, "aes_key"));
    Some(MediaRef {
        kind,
        query: field(media, "encrypt_query_param"),
        full_url: field(media, "full_url"),
        key,
        file_name: field(sub, "file_name").map(|n| n.chars().take(128).collect()),
    })
}

fn hex16(text: &str) -> Option<[u8; 16]> {
    if text.len() != 32 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut key = [0u8; 16];
    for (i, k) in key.iter_mut().enumerate() {
        *k = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(key)
}

/// The 16-byte key of an item, however it is written.
pub fn key_of(text: &str) -> Option<[u8; 16]> {
    if let Some(k) = hex16(text) {
        return Some(k);
    }
    let raw = crate::ids::base64_decode(text)?;
    match raw.len() {
        16 => raw.try_into().ok(),
        32 => hex16(std::str::from_utf8(&raw).ok()?),
        _ => None,
    }
}

pub fn encrypt(plain: &[u8], key: &[u8; 16]) -> Vec<u8> {
    let cipher = Aes128::new(GenericArray::from_slice(key));
    let pad = 16 - plain.len() % 16;
    let mut out = Vec::with_capacity(plain.len() + pad);
    out.extend_from_slice(plain);
    out.extend(std::iter::repeat_n(pad as u8, pad));
    for block in out.chunks_exact_mut(16) {
        cipher.encrypt_block(GenericArray::from_mut_slice(block));
    }
    out
}

/// AES-128-ECB decryption as the ciphertext arrives: whole blocks are decrypted and handed on
/// at once, the last one held back until `finish` checks and strips its padding. Memory stays
/// at one piece whatever the file's size.
pub struct Decrypting {
    cipher: Aes128,
    /// Ciphertext not handed on yet: at most one read's piece plus a block.
    held: Vec<u8>,
}

impl Decrypting {
    pub fn new(key: &[u8; 16]) -> Decrypting {
        Decrypting {
            cipher: Aes128::new(GenericArray::from_slice(key)),
            held: Vec::new(),
        }
    }

    /// Takes more ciphertext; hands `out` the plaintext of every block but the last.
    pub fn push<E>(&mut self, cipher: &[u8], out: &mut impl FnMut(&[u8]) -> Result<(), E>) -> Result<(), E> {
        self.held.extend_from_slice(cipher);
        // Everything before the last byte's block: that block may be the padded one.
        let ready = self.held.len().saturating_sub(1) / 16 * 16;
        if ready == 0 {
            return Ok(());
        }
        for block in self.held[..ready].chunks_exact_mut(16) {
            self.cipher.decrypt_block(GenericArray::from_mut_slice(block));
        }
        let handed = out(&self.held[..ready]);
        self.held.drain(..ready);
        handed
    }

    /// The end of the ciphertext: the last block, its padding checked and removed.
    pub fn finish<E: std::fmt::Display>(mut self, out: &mut impl FnMut(&[u8]) -> Result<(), E>) -> Result<(), String> {
        let Ok(last) = <&mut [u8; 16]>::try_from(self.held.as_mut_slice()) else {
            return Err("the file is not whole AES blocks".into());
        };
        self.cipher.decrypt_block(GenericArray::from_mut_slice(last));
        let pad = usize::from(last[15]);
        let ok = (1..=16).contains(&pad) && last[16 - pad..].iter().all(|b| usize::from(*b) == pad);
        if !ok {
            return Err("the file does not decrypt with its key".into());
        }
        out(&last[..16 - pad]).map_err(|e| e.to_string())
    }
}

/// `scheme://host[:port]` of a URL.
fn origin(url: &str) -> Option<&str> {
    let rest = url.strip_prefix("https://").or_else(|| url.strip_prefix("http://"))?;
    let end = rest.find('/').unwrap_or(rest.len());
    Some(&url[..url.len() - rest.len() + end])
}

/// Where an item's bytes are: its `full_url` when on the CDN's host, else built from its query.
pub fn download_url(cdn_base: &str, m: &MediaRef) -> Option<String> {
    if let Some(full) = &m.full_url {
        if origin(full).is_some() && origin(full) == origin(cdn_base) {
            return Some(full.clone());
        }
    }
    let q = m.query.as_ref()?;
    Some(format!(
        "{}/download?encrypted_query_param={}",
        cdn_base.trim_end_matches('/'),
        crate::upstream::query_value(q)
    ))
}

/// GETs the bytes at `url` into `write`, 64 KiB at a time. A redirect is not followed
/// (`upstream`): the bytes come from where `download_url` chose (the CDN's host), not from
/// wherever an answer points.
pub fn download<E: std::fmt::Display>(
    http: &ureq::Agent,
    url: &str,
    timeout: Duration,
    write: impl FnMut(&[u8]) -> Result<(), E>,
) -> Result<(), String> {
    let mut resp = upstream::within(http, http.get(url), timeout)
        .call()
        .map_err(|e| format!("the CDN is unreachable: {}", upstream::Error::from(e)))?;
    if resp.status().as_u16() != 200 {
        return Err(format!("the CDN answered HTTP {}", resp.status().as_u16()));
    }
    match upstream::stream_body(&mut resp, write) {
        Ok(()) => Ok(()),
        Err(Streamed::Read(e)) => Err(format!("the CDN's answer broke off: {e}")),
        Err(Streamed::Write(e)) => Err(e.to_string()),
    }
}

/// POSTs a ciphertext; the CDN's `x-encrypted-param` for it.
pub fn upload(http: &ureq::Agent, url: &str, body: &[u8], timeout: Duration) -> Result<String, String> {
    let resp = upstream::within(http, http.post(url), timeout)
        .header("Content-Type", "application/octet-stream")
        .send(body)
        .map_err(|e| format!("the CDN is unreachable: {}", upstream::Error::from(e)))?;
    let status = resp.status().as_u16();
    if status != 200 {
        return Err(format!("the CDN refused the upload (HTTP {status})"));
    }
    resp.headers()
        .get("x-encrypted-param")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= MAX_FIELD)
        .map(str::to_string)
        .ok_or_else(|| "the CDN's answer named no download parameter".into())
}

/// A MIME type for a received file: from the bytes for images, the name for files.
pub fn mime_of(kind: &str, name: &str, bytes: &[u8]) -> &'static str {
    let sniffed = [
        (&b"\xff\xd8\xff"[..], "image/jpeg"),
        (b"\x89PNG", "image/png"),
        (b"GIF8", "image/gif"),
        (b"%PDF", "application/pdf"),
    ]
    .iter()
    .find(|(magic, _)| bytes.starts_with(magic))
    .map(|(_, m)| *m);
    let extension = name
        .rsplit_once('.')
        .map_or(String::new(), |(_, e)| e.to_ascii_lowercase());
    let by_name = match extension.as_str() {
        "pdf" => Some("application/pdf"),
        "txt" => Some("text/plain"),
        "jpg" | "jpeg" => Some("image/jpeg"),
        "png" => Some("image/png"),
        "zip" => Some("application/zip"),
        "mp4" => Some("video/mp4"),
        _ => None,
    };
    match kind {
        "audio" => "audio/silk",
        "video" => "video/mp4",
        "image" => sniffed.unwrap_or("image/jpeg"),
        _ => sniffed.or(by_name).unwrap_or("application/octet-stream"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Decrypting` fed `data` in pieces of `piece` bytes; the plaintext.
    fn decrypt(data: &[u8], key: &[u8; 16], piece: usize) -> Result<Vec<u8>, String> {
        let mut plain = Vec::new();
        let mut out = |p: &[u8]| {
            plain.extend_from_slice(p);
            Ok::<_, String>(())
        };
        let mut d = Decrypting::new(key);
        for c in data.chunks(piece.max(1)) {
            d.push(c, &mut out)?;
        }
        d.finish(&mut out)?;
        Ok(plain)
    }

    #[test]
    fn aes_128_ecb_matches_fips_197_and_pads_as_pkcs7() {
        // FIPS-197 appendix C.1.
        let key: [u8; 16] = core::array::from_fn(|i| i as u8);
        let plain: [u8; 16] = core::array::from_fn(|i| (i as u8) * 0x11);
        let c = encrypt(&plain, &key);
        assert_eq!(crate::ids::hex(&c[..16]), "69c4e0d86a7b0430d8cdb78070b4c55a");
        assert_eq!(c.len(), 32, "a whole block of padding follows");
        assert_eq!(decrypt(&c, &key, 16).unwrap(), plain);
        let short = encrypt(b"hi", &key);
        assert_eq!(short.len(), 16);
        assert_eq!(decrypt(&short, &key, 7).unwrap(), b"hi");
        let other: [u8; 16] = [7; 16];
        assert!(decrypt(&short, &other, 16).is_err() || decrypt(&short, &other, 16).unwrap() != b"hi");
        assert!(decrypt(&short[..15], &key, 16).is_err());
    }

    #[test]
    fn decryption_is_the_same_in_pieces_of_any_size() {
        let key: [u8; 16] = core::array::from_fn(|i| 3 * i as u8);
        for len in [0, 1, 15, 16, 17, 1000, 65_536, 70_001] {
            let plain: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let cipher = encrypt(&plain, &key);
            for piece in [1, 5, 16, 17, 4096, 65_536, cipher.len()] {
                assert_eq!(
                    decrypt(&cipher, &key, piece).unwrap(),
                    plain,
                    "{len} bytes in pieces of {piece}"
                );
            }
        }
        assert!(decrypt(&[], &key, 16).is_err(), "no bytes at all");
        let cipher = encrypt(&[1; 20], &key);
        assert!(decrypt(&cipher[..16 + 3], &key, 4).is_err(), "not whole blocks");
    }

    #[test]
    fn keys_are_read_in_every_spelling_the_api_uses() {
        let raw: [u8; 16] = core::array::from_fn(|i| i as u8 + 1);
        let hex = crate::ids::hex(&raw);
        assert_eq!(key_of(&hex), Some(raw));
        assert_eq!(key_of(&crate::ids::base64(&raw)), Some(raw));
        assert_eq!(key_of(&crate::ids::base64(hex.as_bytes())), Some(raw));
        assert_eq!(key_of("not a key"), None);
    }

    #[test]
    fn a_full_url_is_followed_only_on_the_cdn_host() {
        let m = MediaRef {
            kind: "image",
            query: Some("a b/c".into()),
            full_url: Some("http://10.0.0.1/secret".into()),
            key: None,
            file_name: None,
        };
        let url = download_url("https://cdn.example/c2c", &m).unwrap();
        assert_eq!(url, "https://cdn.example/c2c/download?encrypted_query_param=a%20b%2Fc");
        let on_cdn = MediaRef {
            full_url: Some("https://cdn.example/d?x=1".into()),
            ..m
        };
        assert_eq!(
            download_url("https://cdn.example/c2c", &on_cdn).unwrap(),
            "https://cdn.example/d?x=1"
        );
    }
}
