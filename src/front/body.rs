//! Request bodies: `Content-Length` bytes, or a chunked body de-chunked here (RFC 9112 7.1),
//! both under the route's cap. The de-chunker is a byte-fed state machine with a bounded
//! chunk-size line and bounded trailers, so it holds nothing the client controls beyond them.

/// Longest chunk-size line (size, extensions, CRLF).
pub const MAX_SIZE_LINE: usize = 1024;
/// Most bytes of trailer fields after the last chunk.
pub const MAX_TRAILERS: usize = 16 * 1024;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BodyError {
    /// Over the route's cap: 413.
    TooLarge,
    /// Malformed chunked framing: 400.
    Malformed(&'static str),
}

/// What follows the size digits: nothing yet, whitespace (only `;` may come), extensions.
#[derive(Debug, Clone, Copy, PartialEq)]
enum After {
    Digits,
    Space,
    Ext,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Reading the chunk-size line: `digits` seen so far, then whitespace, then extensions.
    Size {
        digits: usize,
        after: After,
    },
    /// The LF after the size line's CR.
    SizeLf,
    Data,
    /// The CRLF after a chunk's data (`seen` of its two bytes).
    DataEnd {
        seen: u8,
    },
    /// Trailer lines after the last chunk; `line` bytes in the current one.
    Trailer {
        line: usize,
    },
    /// The LF after a trailer line's CR.
    TrailerLf {
        empty: bool,
    },
    Done,
}

/// De-chunks a body fed in pieces.
#[derive(Debug)]
pub struct Dechunker {
    state: State,
    size: u64,
    line: usize,
    trailers: usize,
}

impl Default for Dechunker {
    fn default() -> Self {
        Dechunker {
            state: State::Size {
                digits: 0,
                after: After::Digits,
            },
            size: 0,
            line: 0,
            trailers: 0,
        }
    }
}

fn bad<T>(why: &'static str) -> Result<T, BodyError> {
    Err(BodyError::Malformed(why))
}

impl Dechunker {
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Feeds `input`; data goes to `out`, which may not pass `cap`. Returns how many bytes of
    /// `input` belong to the body (after the end, the rest is the next request's).
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>, cap: u64) -> Result<usize, BodyError> {
        let mut i = 0;
        while i < input.len() {
            let b = input[i];
            match self.state {
                State::Done => return Ok(i),
                State::Data => {
                    let n = (input.len() - i).min(usize::try_from(self.size).unwrap_or(usize::MAX));
                    if out.len() as u64 + n as u64 > cap {
                        return Err(BodyError::TooLarge);
                    }
                    out.extend_from_slice(&input[i..i + n]);
                    self.size -= n as u64;
                    i += n;
                    if self.size == 0 {
                        self.state = State::DataEnd { seen: 0 };
                    }
                    continue;
                }
                State::Size { digits, after } => {
                    self.line += 1;
                    if self.line > MAX_SIZE_LINE {
                        return bad("chunk-size line too long");
                    }
                    let next = |after| State::Size { digits, after };
                    match (after, b) {
                        (_, b'\r') if digits > 0 => self.state = State::SizeLf,
                        (After::Ext, _) => {
                            if b != b'\t' && (b < 0x20 || b == 0x7f) {
                                return bad("control byte in a chunk extension");
                            }
                        }
                        (_, b';') if digits > 0 => self.state = next(After::Ext),
                        (_, b' ' | b'\t') if digits > 0 => self.state = next(After::Space),
                        (After::Space, _) => return bad("malformed chunk size"),
                        (After::Digits, _) => {
                            let Some(d) = (b as char).to_digit(16) else {
                                return bad("malformed chunk size");
                            };
                            if digits == 16 {
                                return bad("chunk size too large");
                            }
                            self.size = self.size << 4 | u64::from(d);
                            self.state = State::Size {
                                digits: digits + 1,
                                after,
                            };
                        }
                    }
                }
                State::SizeLf => {
                    if b != b'\n' {
                        return bad("chunk-size line without CRLF");
                    }
                    self.line = 0;
                    if self.size == 0 {
                        self.state = State::Trailer { line: 0 };
                    } else {
                        if out.len() as u64 + self.size > cap {
                            // Refused before the chunk's bytes are read.
                            return Err(BodyError::TooLarge);
                        }
                        self.state = State::Data;
                    }
                }
                State::DataEnd { seen } => {
                    let want = if seen == 0 { b'\r' } else { b'\n' };
                    if b != want {
                        return bad("chunk data without CRLF");
                    }
                    self.state = if seen == 0 {
                        State::DataEnd { seen: 1 }
                    } else {
                        State::Size {
                            digits: 0,
                            after: After::Digits,
                        }
                    };
                }
                State::Trailer { line } => {
                    self.trailers += 1;
                    if self.trailers > MAX_TRAILERS {
                        return bad("trailer fields too long");
                    }
                    match b {
                        b'\r' => self.state = State::TrailerLf { empty: line == 0 },
                        b'\t' => self.state = State::Trailer { line: line + 1 },
                        _ if b < 0x20 || b == 0x7f => return bad("control byte in a trailer"),
                        _ => self.state = State::Trailer { line: line + 1 },
                    }
                }
                State::TrailerLf { empty } => {
                    if b != b'\n' {
                        return bad("trailer line without CRLF");
                    }
                    self.state = if empty { State::Done } else { State::Trailer { line: 0 } };
                }
            }
            i += 1;
        }
        Ok(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dechunk(input: &[u8], cap: u64) -> Result<(Vec<u8>, usize), BodyError> {
        let mut d = Dechunker::default();
        let mut out = Vec::new();
        let used = d.feed(input, &mut out, cap)?;
        if !d.is_done() {
            return Err(BodyError::Malformed("incomplete"));
        }
        Ok((out, used))
    }

    #[test]
    fn chunked_bodies_are_decoded_whatever_the_pieces() {
        let body = b"5;name=v\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\nGET / HTTP/1.1";
        let (out, used) = dechunk(body, 100).unwrap();
        assert_eq!(out, b"hello world");
        assert_eq!(&body[used..], b"GET / HTTP/1.1", "the next request stays");
        // Fed one byte at a time, the same.
        let mut d = Dechunker::default();
        let mut out = Vec::new();
        for b in &body[..used] {
            assert_eq!(d.feed(std::slice::from_ref(b), &mut out, 100), Ok(1));
        }
        assert!(d.is_done());
        assert_eq!(out, b"hello world");
    }

    #[test]
    fn malformed_chunks_are_400_and_oversized_ones_413() {
        for bad in [
            &b"zz\r\nhello\r\n0\r\n\r\n"[..],
            b"\r\n",
            b"5\nhello\r\n0\r\n\r\n",
            b"5\r\nhelloXX0\r\n\r\n",
            b"11111111111111111\r\n",
            b"5;\x01\r\nhello\r\n0\r\n\r\n",
            b"5 5\r\nhello\r\n0\r\n\r\n",
        ] {
            assert!(matches!(dechunk(bad, 100), Err(BodyError::Malformed(_))), "{bad:?}");
        }
        assert_eq!(dechunk(b"ffffffffffffffff\r\n", 100), Err(BodyError::TooLarge));
        assert_eq!(
            dechunk(b"5\r\nhello\r\n5\r\nworld\r\n0\r\n\r\n", 8),
            Err(BodyError::TooLarge)
        );
        let endless = vec![b'0'; 5000];
        assert_eq!(
            dechunk(&endless, 100),
            Err(BodyError::Malformed("chunk size too large")),
            "leading zeros count as digits: the line stays bounded"
        );
        let ext = [b"1;".as_slice(), &vec![b'a'; 5000]].concat();
        assert_eq!(
            dechunk(&ext, 100),
            Err(BodyError::Malformed("chunk-size line too long"))
        );
    }

    #[test]
    fn thousands_of_mutated_chunked_bodies_never_panic_or_pass_the_cap() {
        let seeds: [&[u8]; 2] = [
            b"5;a=b\r\nhello\r\n0\r\nT: x\r\n\r\n",
            b"1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\n\r\n",
        ];
        for input in crate::testutil::mutations(&seeds, 4000, 21) {
            let mut d = Dechunker::default();
            let mut out = Vec::new();
            if let Ok(used) = d.feed(&input, &mut out, 16) {
                assert!(used <= input.len());
            }
            assert!(out.len() <= 16);
        }
    }
}
