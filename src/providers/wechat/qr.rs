//! The login's QR code as xAgent shows it: `qr_code_image`, a `data:image/png;base64,…` drawn on
//! the device. qrcodegen encodes; the PNG is ours: 1-bit grayscale, each module `SCALE` pixels,
//! the standard's 4-module quiet zone, the image data in stored (uncompressed) deflate blocks:
//! a few KiB for the short URL a login shows, and no compressor in the binary.

use qrcodegen::{QrCode, QrCodeEcc};

/// Pixels per module.
const SCALE: usize = 4;
/// Modules of white around the code (ISO/IEC 18004 asks for 4).
const QUIET: usize = 4;
/// The longest text drawn: a login's code is a short URL.
pub const MAX_TEXT: usize = 1024;

/// The PNG data URL of `text` as a QR code; `None` when it is too long for one.
pub fn data_url(text: &str) -> Option<String> {
    if text.len() > MAX_TEXT {
        return None;
    }
    let code = QrCode::encode_text(text, QrCodeEcc::Medium).ok()?;
    let png = png_of(&code);
    Some(format!("data:image/png;base64,{}", crate::ids::base64(&png)))
}

fn png_of(code: &QrCode) -> Vec<u8> {
    let modules = code.size() as usize;
    let side = (modules + 2 * QUIET) * SCALE;
    let row_bytes = side.div_ceil(8);
    // Each row: filter type 0, then the bits, 1 = white (grayscale), most significant first.
    let mut raw = Vec::with_capacity((row_bytes + 1) * side);
    for y in 0..side {
        raw.push(0);
        let my = (y / SCALE) as i32 - QUIET as i32;
        let mut byte = 0u8;
        for x in 0..side {
            let mx = (x / SCALE) as i32 - QUIET as i32;
            let white = !code.get_module(mx, my);
            byte = byte << 1 | u8::from(white);
            if x % 8 == 7 {
                raw.push(byte);
                byte = 0;
            }
        }
        if side % 8 != 0 {
            raw.push(byte << (8 - side % 8));
        }
    }
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::with_capacity(13);
    ihdr.extend_from_slice(&(side as u32).to_be_bytes());
    ihdr.extend_from_slice(&(side as u32).to_be_bytes());
    ihdr.extend_from_slice(&[1, 0, 0, 0, 0]); // bit depth 1, grayscale, deflate, filter 0, no interlace
    chunk(&mut png, b"IHDR", &ihdr);
    chunk(&mut png, b"IDAT", &zlib_stored(&raw));
    chunk(&mut png, b"IEND", &[]);
    png
}

fn chunk(png: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    png.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = png.len();
    png.extend_from_slice(kind);
    png.extend_from_slice(data);
    let crc = crc32(&png[start..]);
    png.extend_from_slice(&crc.to_be_bytes());
}

/// A zlib stream (RFC 1950) of stored deflate blocks (RFC 1951 3.2.4).
fn zlib_stored(data: &[u8]) -> Vec<u8> {
    let mut out = vec![0x78, 0x01];
    let mut blocks = data.chunks(65_535).peekable();
    if blocks.peek().is_none() {
        out.extend_from_slice(&[1, 0, 0, 0xff, 0xff]);
    }
    while let Some(block) = blocks.next() {
        out.push(u8::from(blocks.peek().is_none()));
        let len = block.len() as u16;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(block);
    }
    out.extend_from_slice(&adler32(data).to_be_bytes());
    out
}

fn adler32(data: &[u8]) -> u32 {
    let (mut a, mut b) = (1u32, 0u32);
    for chunk in data.chunks(5552) {
        for &x in chunk {
            a += u32::from(x);
            b += a;
        }
        a %= 65_521;
        b %= 65_521;
    }
    b << 16 | a
}

/// CRC-32 (ISO 3309, as PNG uses it), bit by bit: a few KiB per login.
fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { crc >> 1 ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_match_their_standards_check_values() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(adler32(b"Wikipedia"), 0x11E6_0398);
    }

    #[test]
    fn a_login_url_becomes_a_png_whose_pixels_are_its_modules() {
        let url = data_url("https://liteapp.weixin.qq.com/q/7GiQu1?qrcode=abc123&bot_type=3").unwrap();
        let b64 = url.strip_prefix("data:image/png;base64,").unwrap();
        assert!(b64.len() < 8 * 1024, "{} bytes", b64.len());
        let code = QrCode::encode_text("hello", QrCodeEcc::Medium).unwrap();
        let png = png_of(&code);
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&png[12..16], b"IHDR");
        let side = u32::from_be_bytes(png[16..20].try_into().unwrap()) as usize;
        assert_eq!(side, (code.size() as usize + 2 * QUIET) * SCALE);
        // The first pixel row inside the quiet zone starts with the finder pattern: black.
        let raw_start = 8 + 25 + 8 + 2 + 5; // signature, IHDR chunk, IDAT header, zlib header, block header
        let row_bytes = side.div_ceil(8) + 1;
        let first_code_row = &png[raw_start + QUIET * SCALE * row_bytes..];
        assert_eq!(first_code_row[0], 0, "filter byte");
        assert_eq!(
            first_code_row[1 + QUIET * SCALE / 8],
            0x00,
            "the finder's black modules"
        );
        assert_eq!(first_code_row[1], 0xff, "the quiet zone is white");
        assert!(data_url(&"x".repeat(MAX_TEXT + 1)).is_none());
    }
}
