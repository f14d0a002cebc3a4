//! The frame of Feishu/Lark's event long connection: one protobuf message (`pbbp2.Frame`) per
//! binary WebSocket message, read and written by this hand-written codec.
//!
//! The official SDKs' `pbbp2.proto` defines it as:
//!
//! ```text
//! message Header { required string key = 1; required string value = 2; }
//! message Frame {
//!   required uint64 SeqID = 1;  required uint64 LogID = 2;
//!   required int32 service = 3; required int32 method = 4;
//!   repeated Header headers = 5;
//!   optional string payload_encoding = 6; optional string payload_type = 7;
//!   optional bytes payload = 8;           optional string LogIDNew = 9;
//! }
//! ```
//!
//! `method` tells control frames (ping/pong, 0) from data frames (events, 1); the headers carry
//! `type`, `message_id`, `sum`, `seq` and `trace_id`, and a payload may be split across `sum`
//! frames. Why our own reader rather than a protobuf crate: the frames come from the network,
//! the message is two small types, and every limit (sizes, header count, varint length) is
//! ours to choose and to fuzz; a generated decoder would be a dependency tree bigger than this
//! file and would allocate whatever a length prefix claims.

use std::fmt;

/// Largest frame accepted (the WebSocket layer's message limit should match it).
pub const MAX_FRAME: usize = 1 << 20;
/// At most this many headers in one frame.
pub const MAX_HEADERS: usize = 64;
/// A header key or value, `payload_encoding`, `payload_type` or `LogIDNew` at most this long.
pub const MAX_TEXT: usize = 4096;

/// `method` of a control frame (ping, pong).
pub const METHOD_CONTROL: i32 = 0;
/// `method` of a data frame (an event, and our response to it).
pub const METHOD_DATA: i32 = 1;

/// One frame, decoded.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Frame {
    pub seq_id: u64,
    pub log_id: u64,
    pub service: i32,
    pub method: i32,
    /// In wire order; keys may repeat (`header` finds the first).
    pub headers: Vec<(String, String)>,
    pub payload_encoding: String,
    pub payload_type: String,
    pub payload: Vec<u8>,
    pub log_id_new: String,
}

/// Why bytes are not a frame.
#[derive(Clone, Debug, PartialEq)]
pub enum FrameError {
    TooLarge(usize),
    /// Ended inside a field.
    Truncated,
    /// A varint longer than 10 bytes, or over 64 bits.
    BadVarint,
    /// A field number of 0, or a wire type that is not 0, 1, 2 or 5 (groups are not used).
    BadTag(u64),
    /// A known field with the wrong wire type.
    WrongType(u32),
    TooManyHeaders,
    TextTooLong,
    NotUtf8,
    /// A required field absent (`SeqID`, `LogID`, `service`, `method`; a header's key or value).
    Missing(&'static str),
    /// `service` or `method` outside `i32`.
    OutOfRange(&'static str),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::TooLarge(n) => write!(f, "frame of {n} bytes over the {MAX_FRAME}-byte limit"),
            FrameError::Truncated => f.write_str("frame cut short"),
            FrameError::BadVarint => f.write_str("malformed varint"),
            FrameError::BadTag(t) => write!(f, "invalid field tag {t}"),
            FrameError::WrongType(n) => write!(f, "field {n} has the wrong wire type"),
            FrameError::TooManyHeaders => write!(f, "more than {MAX_HEADERS} headers"),
            FrameError::TextTooLong => write!(f, "a text field over {MAX_TEXT} bytes"),
            FrameError::NotUtf8 => f.write_str("a text field is not UTF-8"),
            FrameError::Missing(what) => write!(f, "required field {what} missing"),
            FrameError::OutOfRange(what) => write!(f, "{what} out of range"),
        }
    }
}

impl Frame {
    /// The first header named `key`.
    pub fn header(&self, key: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// Reads one frame from a whole binary WebSocket message.
    pub fn decode(bytes: &[u8]) -> Result<Frame, FrameError> {
        if bytes.len() > MAX_FRAME {
            return Err(FrameError::TooLarge(bytes.len()));
        }
        let mut r = Reader { bytes, at: 0 };
        let mut frame = Frame::default();
        let mut seen = [false; 4];
        while !r.done() {
            let (field, wire) = r.tag()?;
            match (field, wire) {
                (1..=4, WIRE_VARINT) => {
                    let v = r.varint()?;
                    seen[field as usize - 1] = true;
                    match field {
                        1 => frame.seq_id = v,
                        2 => frame.log_id = v,
                        // int32 is written as a sign-extended 64-bit varint.
                        3 => frame.service = int32(v, "service")?,
                        _ => frame.method = int32(v, "method")?,
                    }
                }
                (5, WIRE_LEN) => {
                    if frame.headers.len() == MAX_HEADERS {
                        return Err(FrameError::TooManyHeaders);
                    }
                    frame.headers.push(header(r.bytes()?)?);
                }
                (6, WIRE_LEN) => frame.payload_encoding = text(r.bytes()?)?,
                (7, WIRE_LEN) => frame.payload_type = text(r.bytes()?)?,
                (8, WIRE_LEN) => frame.payload = r.bytes()?.to_vec(),
                (9, WIRE_LEN) => frame.log_id_new = text(r.bytes()?)?,
                (1..=9, _) => return Err(FrameError::WrongType(field)),
                // Fields added later are skipped, as protobuf readers do.
                _ => r.skip(wire)?,
            }
        }
        for (i, name) in ["SeqID", "LogID", "service", "method"].into_iter().enumerate() {
            if !seen[i] {
                return Err(FrameError::Missing(name));
            }
        }
        Ok(frame)
    }

    /// Writes the frame as the SDKs do: fields in number order, required ones always present.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + self.payload.len());
        put_varint_field(&mut out, 1, self.seq_id);
        put_varint_field(&mut out, 2, self.log_id);
        put_varint_field(&mut out, 3, self.service as i64 as u64);
        put_varint_field(&mut out, 4, self.method as i64 as u64);
        for (k, v) in &self.headers {
            let mut h = Vec::with_capacity(k.len() + v.len() + 4);
            put_bytes_field(&mut h, 1, k.as_bytes());
            put_bytes_field(&mut h, 2, v.as_bytes());
            put_bytes_field(&mut out, 5, &h);
        }
        put_bytes_field(&mut out, 6, self.payload_encoding.as_bytes());
        put_bytes_field(&mut out, 7, self.payload_type.as_bytes());
        put_bytes_field(&mut out, 8, &self.payload);
        put_bytes_field(&mut out, 9, self.log_id_new.as_bytes());
        out
    }

    /// The length of `encode()`'s bytes, without encoding: what a frame waiting to be written
    /// will take.
    pub fn encoded_len(&self) -> usize {
        let varint_field = |v: u64| 1 + varint_len(v);
        let bytes_field = |n: usize| (1 + varint_len(n as u64)).saturating_add(n);
        let headers = self.headers.iter().fold(0usize, |sum, (k, v)| {
            let h = bytes_field(k.len()).saturating_add(bytes_field(v.len()));
            sum.saturating_add(bytes_field(h))
        });
        [
            varint_field(self.seq_id),
            varint_field(self.log_id),
            varint_field(self.service as i64 as u64),
            varint_field(self.method as i64 as u64),
            headers,
            bytes_field(self.payload_encoding.len()),
            bytes_field(self.payload_type.len()),
            bytes_field(self.payload.len()),
            bytes_field(self.log_id_new.len()),
        ]
        .into_iter()
        .fold(0, usize::saturating_add)
    }
}

/// How many bytes `put_varint` writes for `v`.
fn varint_len(v: u64) -> usize {
    (64 - v.max(1).leading_zeros() as usize).div_ceil(7)
}

const WIRE_VARINT: u8 = 0;
const WIRE_I64: u8 = 1;
const WIRE_LEN: u8 = 2;
const WIRE_I32: u8 = 5;

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn done(&self) -> bool {
        self.at >= self.bytes.len()
    }

    fn varint(&mut self) -> Result<u64, FrameError> {
        let mut v: u64 = 0;
        for i in 0..10 {
            let b = *self.bytes.get(self.at).ok_or(FrameError::Truncated)?;
            self.at += 1;
            let bits = u64::from(b & 0x7f);
            // The tenth byte may only carry the 64th bit.
            if i == 9 && bits > 1 {
                return Err(FrameError::BadVarint);
            }
            v |= bits << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(FrameError::BadVarint)
    }

    fn tag(&mut self) -> Result<(u32, u8), FrameError> {
        let t = self.varint()?;
        let (field, wire) = (t >> 3, (t & 7) as u8);
        if field == 0
            || field > u64::from(u32::MAX >> 3)
            || ![WIRE_VARINT, WIRE_I64, WIRE_LEN, WIRE_I32].contains(&wire)
        {
            return Err(FrameError::BadTag(t));
        }
        Ok((field as u32, wire))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        let end = self.at.checked_add(n).ok_or(FrameError::Truncated)?;
        let slice = self.bytes.get(self.at..end).ok_or(FrameError::Truncated)?;
        self.at = end;
        Ok(slice)
    }

    /// A length-delimited field's bytes; the length is checked against what is there before
    /// anything is allocated.
    fn bytes(&mut self) -> Result<&'a [u8], FrameError> {
        let n = self.varint()?;
        let n = usize::try_from(n).map_err(|_| FrameError::Truncated)?;
        self.take(n)
    }

    fn skip(&mut self, wire: u8) -> Result<(), FrameError> {
        match wire {
            WIRE_VARINT => self.varint().map(drop),
            WIRE_I64 => self.take(8).map(drop),
            WIRE_I32 => self.take(4).map(drop),
            _ => self.bytes().map(drop),
        }
    }
}

fn int32(v: u64, what: &'static str) -> Result<i32, FrameError> {
    i32::try_from(v as i64).map_err(|_| FrameError::OutOfRange(what))
}

fn text(bytes: &[u8]) -> Result<String, FrameError> {
    if bytes.len() > MAX_TEXT {
        return Err(FrameError::TextTooLong);
    }
    String::from_utf8(bytes.to_vec()).map_err(|_| FrameError::NotUtf8)
}

fn header(bytes: &[u8]) -> Result<(String, String), FrameError> {
    let mut r = Reader { bytes, at: 0 };
    let (mut key, mut value) = (None, None);
    while !r.done() {
        match r.tag()? {
            (1, WIRE_LEN) => key = Some(text(r.bytes()?)?),
            (2, WIRE_LEN) => value = Some(text(r.bytes()?)?),
            (n @ (1 | 2), _) => return Err(FrameError::WrongType(n)),
            (_, wire) => r.skip(wire)?,
        }
    }
    Ok((
        key.ok_or(FrameError::Missing("header key"))?,
        value.ok_or(FrameError::Missing("header value"))?,
    ))
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_varint_field(out: &mut Vec<u8>, field: u64, v: u64) {
    put_varint(out, (field << 3) | u64::from(WIRE_VARINT));
    put_varint(out, v);
}

fn put_bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    put_varint(out, (field << 3) | u64::from(WIRE_LEN));
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> Frame {
        Frame {
            seq_id: 7,
            log_id: 1 << 40,
            service: 12,
            method: METHOD_DATA,
            headers: vec![
                ("type".into(), "event".into()),
                ("message_id".into(), "m-1".into()),
                ("sum".into(), "2".into()),
                ("seq".into(), "0".into()),
            ],
            payload: br#"{"schema":"2.0"}"#.to_vec(),
            ..Frame::default()
        }
    }

    #[test]
    fn a_frame_survives_encode_and_decode() {
        let f = event();
        assert_eq!(Frame::decode(&f.encode()), Ok(f.clone()));
        assert_eq!(f.encoded_len(), f.encode().len());
        assert_eq!(f.header("message_id"), Some("m-1"));
        assert_eq!(f.header("trace_id"), None);
    }

    #[test]
    fn the_encoded_length_is_known_without_encoding() {
        for n in [0, 1, 127, 128, 300, 16_383, 16_384, 70_000] {
            let mut f = event();
            f.seq_id = n as u64;
            f.headers.push(("k".repeat(n.min(MAX_TEXT)), "v".repeat(n % 500)));
            f.payload = vec![b'x'; n];
            f.log_id_new = "l".repeat(n % 200);
            assert_eq!(f.encoded_len(), f.encode().len(), "{n}");
        }
    }

    #[test]
    fn the_encoding_matches_protobuf_byte_for_byte() {
        // SeqID 1, LogID 2, service 3, method 0, header ("type","ping"): laid out by hand from
        // the protobuf encoding rules (tag = field << 3 | wire type), empty optional strings
        // written as the SDKs write them.
        let f = Frame {
            seq_id: 1,
            log_id: 2,
            service: 3,
            method: METHOD_CONTROL,
            headers: vec![("type".into(), "ping".into())],
            ..Frame::default()
        };
        let want: &[u8] = &[
            0x08, 1, 0x10, 2, 0x18, 3, 0x20, 0, //
            0x2a, 12, 0x0a, 4, b't', b'y', b'p', b'e', 0x12, 4, b'p', b'i', b'n', b'g', //
            0x32, 0, 0x3a, 0, 0x42, 0, 0x4a, 0,
        ];
        assert_eq!(f.encode(), want);
        assert_eq!(Frame::decode(want), Ok(f));
    }

    #[test]
    fn negative_int32_fields_use_ten_byte_varints_both_ways() {
        let f = Frame {
            service: -1,
            method: i32::MIN,
            ..event()
        };
        let bytes = f.encode();
        assert_eq!(f.encoded_len(), bytes.len());
        assert_eq!(Frame::decode(&bytes), Ok(f));
        // -1 as int32 on the wire: ten bytes.
        assert!(bytes
            .windows(10)
            .any(|w| w == [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]));
    }

    #[test]
    fn unknown_fields_are_skipped() {
        let mut bytes = event().encode();
        // field 15 varint, field 16 fixed64, field 17 bytes, field 18 fixed32
        bytes.extend_from_slice(&[0x78, 0x96, 0x01]);
        bytes.extend_from_slice(&[0x81, 0x01, 1, 2, 3, 4, 5, 6, 7, 8]);
        bytes.extend_from_slice(&[0x8a, 0x01, 2, b'h', b'i']);
        bytes.extend_from_slice(&[0x95, 0x01, 1, 2, 3, 4]);
        assert_eq!(Frame::decode(&bytes), Ok(event()));
    }

    #[test]
    fn a_frame_cut_inside_a_field_is_truncated_and_no_cut_panics() {
        let f = event();
        let bytes = f.encode();
        let payload_at = bytes.windows(f.payload.len()).position(|w| w == f.payload).unwrap();
        for end in 0..bytes.len() {
            let got = Frame::decode(&bytes[..end]);
            if (payload_at..payload_at + f.payload.len()).contains(&end) {
                assert_eq!(got, Err(FrameError::Truncated), "cut at {end}");
            }
        }
    }

    #[test]
    fn malformed_frames_get_a_clear_error() {
        let ok = event().encode();
        let cases: Vec<(Vec<u8>, FrameError)> = vec![
            (vec![], FrameError::Missing("SeqID")),
            (vec![0x08], FrameError::Truncated),
            (
                vec![0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f],
                FrameError::BadVarint,
            ),
            (
                vec![0x08, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01],
                FrameError::BadVarint,
            ),
            (vec![0x00], FrameError::BadTag(0)),
            (vec![0x0b], FrameError::BadTag(0x0b)), // wire type 3: groups
            (vec![0x0a, 0], FrameError::WrongType(1)),
            (vec![0x08, 1, 0x10, 1, 0x18, 1], FrameError::Missing("method")),
            // A length far beyond the bytes: refused before any allocation.
            (vec![0x42, 0xff, 0xff, 0xff, 0xff, 0x0f], FrameError::Truncated),
            (
                vec![0x18, 0x80, 0x80, 0x80, 0x80, 0x10],
                FrameError::OutOfRange("service"),
            ),
            (vec![0x32, 2, 0xc3, 0x28], FrameError::NotUtf8),
            (vec![0x2a, 2, 0x0a, 0], FrameError::Missing("header value")),
        ];
        for (bytes, want) in cases {
            assert_eq!(Frame::decode(&bytes), Err(want.clone()), "{bytes:02x?}");
        }
        let mut long = ok.clone();
        long.extend_from_slice(&[0x32, 0x81, 0x20]);
        long.extend(std::iter::repeat_n(b'a', MAX_TEXT + 1));
        assert_eq!(Frame::decode(&long), Err(FrameError::TextTooLong));
        let mut many = ok.clone();
        for _ in 0..MAX_HEADERS {
            many.extend_from_slice(&[0x2a, 4, 0x0a, 0, 0x12, 0]);
        }
        assert_eq!(Frame::decode(&many), Err(FrameError::TooManyHeaders));
        assert_eq!(
            Frame::decode(&vec![0; MAX_FRAME + 1]),
            Err(FrameError::TooLarge(MAX_FRAME + 1))
        );
    }
}
