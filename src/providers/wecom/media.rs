//! A message's image or file: downloaded from the URL of its callback (valid a few minutes)
//! and decrypted as it arrives into the file cache. WeCom encrypts it with the message's
//! `aeskey` (base64 of 32 bytes, with or without its `=`): AES-256-CBC, the IV the key's first
//! 16 bytes, PKCS#7 padding to a multiple of 32 bytes (docs/providers/wecom-protocol.md, "Media
//! download"). The file's name comes from `Content-Disposition`.

use std::time::Duration;

use aes::cipher::generic_array::GenericArray;
use aes::cipher::{BlockDecrypt, KeyInit};
use aes::Aes256;

use crate::files::FilePart;
use crate::upstream;

/// The padding's block: WeCom pads to 32 bytes, not AES's 16.
const PAD_BLOCK: usize = 32;

/// AES-256-CBC decryption as the ciphertext arrives: whole blocks are decrypted and handed on,
/// the last `PAD_BLOCK` bytes of plaintext held back until `finish` checks and strips the
/// padding. Memory stays at one piece whatever the file's size.
pub struct Decrypting {
    cipher: Aes256,
    /// The ciphertext block before the next one (the IV first).
    prev: [u8; 16],
    /// Ciphertext short of a whole block.
    carry: Vec<u8>,
    /// Plaintext not handed on yet: the padding may be in it.
    held: Vec<u8>,
}

impl Decrypting {
    /// `None` when `aeskey` is not base64 of 32 bytes.
    pub fn new(aeskey: &str) -> Option<Decrypting> {
        let key = crate::ids::base64_decode(aeskey)?;
        let key: [u8; 32] = key.try_into().ok()?;
        let mut prev = [0u8; 16];
        prev.copy_from_slice(&key[..16]);
        Some(Decrypting {
            cipher: Aes256::new(GenericArray::from_slice(&key)),
            prev,
            carry: Vec::new(),
            held: Vec::new(),
        })
    }

    /// Takes more ciphertext; hands `out` the plaintext it can.
    pub fn push<E>(&mut self, cipher: &[u8], out: &mut impl FnMut(&[u8]) -> Result<(), E>) -> Result<(), E> {
        self.carry.extend_from_slice(cipher);
        let whole = self.carry.len() / 16 * 16;
        for block in self.carry[..whole].chunks_exact(16) {
            let mut plain = [0u8; 16];
            plain.copy_from_slice(block);
            self.cipher.decrypt_block(GenericArray::from_mut_slice(&mut plain));
            for (p, c) in plain.iter_mut().zip(self.prev) {
                *p ^= c;
            }
            self.prev.copy_from_slice(block);
            self.held.extend_from_slice(&plain);
        }
        self.carry.drain(..whole);
        let ready = self.held.len().saturating_sub(PAD_BLOCK);
        if ready == 0 {
            return Ok(());
        }
        let handed = out(&self.held[..ready]);
        self.held.drain(..ready);
        handed
    }

    /// The end of the ciphertext: the padding checked and removed, the rest handed on.
    pub fn finish<E: std::fmt::Display>(self, out: &mut impl FnMut(&[u8]) -> Result<(), E>) -> Result<(), String> {
        if !self.carry.is_empty() || self.held.is_empty() {
            return Err("the file is not whole AES blocks".into());
        }
        let pad = usize::from(self.held[self.held.len() - 1]);
        let ok = (1..=PAD_BLOCK.min(self.held.len())).contains(&pad)
            && self.held[self.held.len() - pad..]
                .iter()
                .all(|b| usize::from(*b) == pad);
        if !ok {
            return Err("the file does not decrypt with its key".into());
        }
        out(&self.held[..self.held.len() - pad]).map_err(|e| e.to_string())
    }
}

/// Downloads `url` into `part`, decrypted with `aeskey`, within `timeout`: the file's name and
/// type, if the server named them.
pub fn download(
    agent: &ureq::Agent,
    url: &str,
    aeskey: &str,
    part: &mut FilePart,
    timeout: Duration,
) -> Result<(Option<String>, Option<String>), String> {
    // No key: the bytes are the file, as the SDK takes them.
    let mut decrypting = match aeskey.is_empty() {
        true => None,
        false => Some(Decrypting::new(aeskey).ok_or("the message's aeskey is not a key")?),
    };
    let mut resp = upstream::within(agent, agent.get(url), timeout)
        .call()
        .map_err(|e| upstream::Error::from(e).hiding(url, "the file's URL").to_string())?;
    let status = resp.status().as_u16();
    if status != 200 {
        return Err(format!("WeCom answered {status} to the file's download"));
    }
    let name = resp
        .headers()
        .get("Content-Disposition")
        .and_then(|v| v.to_str().ok())
        .and_then(filename);
    let content_type = upstream::content_type(&resp);
    let mut write = |plain: &[u8]| part.write(plain);
    let streamed = upstream::stream_body(&mut resp, |piece| match decrypting.as_mut() {
        Some(d) => d.push(piece, &mut write),
        None => write(piece),
    });
    match streamed {
        Ok(()) => {}
        Err(upstream::Streamed::Read(e)) => return Err(e.to_string()),
        Err(upstream::Streamed::Write(e)) => return Err(e.to_string()),
    }
    if let Some(d) = decrypting {
        d.finish(&mut write)?;
    }
    Ok((name, content_type))
}

/// The file name of a `Content-Disposition`: `filename*=UTF-8''…` first (percent-decoded),
/// else `filename="…"`; only a plain name (no path), at most 200 bytes.
pub fn filename(header: &str) -> Option<String> {
    let param = |key: &str| {
        header.split(';').map(str::trim).find_map(|p| {
            let (k, v) = p.split_once('=')?;
            k.trim().eq_ignore_ascii_case(key).then(|| v.trim().to_string())
        })
    };
    let name = match param("filename*") {
        Some(v) => {
            let v = v.strip_prefix("UTF-8''").or_else(|| v.strip_prefix("utf-8''"))?;
            percent_decoded(v)?
        }
        None => param("filename")?.trim_matches('"').to_string(),
    };
    let plain =
        !name.is_empty() && name.len() <= 200 && !name.contains(['/', '\\']) && !name.chars().any(char::is_control);
    plain.then_some(name)
}

fn percent_decoded(v: &str) -> Option<String> {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = v.get(i + 1..i + 3)?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use aes::cipher::BlockEncrypt;

    /// WeCom's side, as the SDK's tests do it: PKCS#7 to 32 bytes, AES-256-CBC, IV = key[..16].
    fn encrypt(key: &[u8; 32], plain: &[u8]) -> Vec<u8> {
        let pad = PAD_BLOCK - plain.len() % PAD_BLOCK;
        let mut data = plain.to_vec();
        data.extend(std::iter::repeat_n(pad as u8, pad));
        let cipher = Aes256::new(GenericArray::from_slice(key));
        let mut prev: [u8; 16] = key[..16].try_into().unwrap();
        for block in data.chunks_exact_mut(16) {
            for (b, p) in block.iter_mut().zip(prev) {
                *b ^= p;
            }
            cipher.encrypt_block(GenericArray::from_mut_slice(block));
            prev.copy_from_slice(block);
        }
        data
    }

    #[test]
    fn a_file_decrypts_piece_by_piece_whatever_the_pieces_and_a_wrong_key_is_refused() {
        let key: [u8; 32] = std::array::from_fn(|i| (i * 7 + 3) as u8);
        let aeskey = crate::ids::base64(&key);
        let aeskey = aeskey.trim_end_matches('=');
        for len in [0, 1, 31, 32, 33, 1000] {
            let plain: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let sealed = encrypt(&key, &plain);
            for piece in [1, 7, 16, 64, 4096] {
                let mut d = Decrypting::new(aeskey).unwrap();
                let mut got = Vec::new();
                let mut out = |p: &[u8]| -> Result<(), String> {
                    got.extend_from_slice(p);
                    Ok(())
                };
                for chunk in sealed.chunks(piece) {
                    d.push(chunk, &mut out).unwrap();
                }
                d.finish(&mut out).unwrap();
                assert_eq!(got, plain, "{len} bytes in pieces of {piece}");
            }
        }
        let other = crate::ids::base64(&[9u8; 32]);
        let mut d = Decrypting::new(&other).unwrap();
        let mut sink = |_: &[u8]| -> Result<(), String> { Ok(()) };
        d.push(&encrypt(&key, b"secret report"), &mut sink).unwrap();
        assert!(d.finish(&mut sink).is_err(), "a wrong key is found at the padding");
        assert!(Decrypting::new("short").is_none());
        assert_eq!(
            filename("attachment; filename*=UTF-8''%E6%8A%A5%E5%91%8A.pdf").as_deref(),
            Some("报告.pdf")
        );
        assert_eq!(filename("attachment; filename=\"a.txt\"").as_deref(), Some("a.txt"));
        assert_eq!(filename("attachment; filename=\"../etc/passwd\""), None);
    }
}
