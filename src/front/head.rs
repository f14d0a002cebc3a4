//! The request head, read strictly (RFC 9112 sections 2 to 6): one request line, then header
//! lines, each ending in CRLF. Everything the front door decides on is read here, once, and the
//! rest of the daemon sees only what passed.
//!
//! Refused: bare CR or LF, obs-fold, whitespace before a colon, control bytes, a method or
//! header name that is not a token, duplicate or malformed `Content-Length`, a
//! `Transfer-Encoding` together with `Content-Length` or on HTTP/1.0 (400), a transfer coding
//! other than `chunked` (501), a version other than HTTP/1.0 and HTTP/1.1 (505), two
//! `Authorization` or `Host` headers, an HTTP/1.1 request without `Host` (400), more than
//! `MAX_HEADERS` lines (431). The HTTP/2 connection preface is recognised so that it can be
//! closed at once.

/// Longest request head accepted; beyond it the answer is 431.
pub const MAX_HEAD: usize = 16 * 1024;
/// Most header lines in one head.
pub const MAX_HEADERS: usize = 100;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Version {
    Http10,
    Http11,
}

/// A request head that passed every check.
#[derive(Debug, Clone, PartialEq)]
pub struct Head {
    pub method: String,
    /// The request target as sent (origin form), query included.
    pub target: String,
    /// The path part of the target.
    pub path: String,
    pub version: Version,
    /// Every header in order, names as sent; values without surrounding whitespace.
    pub headers: Vec<(String, String)>,
    /// How the body is framed.
    pub body: Framing,
    /// The client asked to close (or, on HTTP/1.0, did not ask to stay).
    pub close: bool,
    /// `Expect: 100-continue`.
    pub expect_continue: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Framing {
    None,
    Length(u64),
    Chunked,
}

/// Why a head was refused; `status` is the answer (0: close without one).
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub status: u16,
    pub why: &'static str,
}

fn refuse<T>(status: u16, why: &'static str) -> Result<T, Refusal> {
    Err(Refusal { status, why })
}

/// The request line of HTTP/2's connection preface (RFC 9113 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0";

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn is_token(s: &[u8]) -> bool {
    !s.is_empty() && s.iter().all(|&b| is_tchar(b))
}

/// A field value byte: visible ASCII, SP, HTAB or obs-text (RFC 9110 5.5); no control bytes.
fn is_value_byte(b: u8) -> bool {
    b == b'\t' || b == b' ' || (0x21..=0x7e).contains(&b) || b >= 0x80
}

/// Where the head ends: the index just past its blank line, once the buffer holds one. Empty
/// lines before the request line are skipped, as RFC 9112 2.2 allows (`start` is where the
/// request line begins).
pub fn find_end(buf: &[u8]) -> Option<(usize, usize)> {
    let mut start = 0;
    while buf[start..].starts_with(b"\r\n") && start < 4 {
        start += 2;
    }
    let end = buf[start..].windows(4).position(|w| w == b"\r\n\r\n")?;
    Some((start, start + end + 4))
}

/// Whether `buf` (a head not yet complete) has a line ending in a bare LF at or after `from`
/// (what was checked before need not be again: a head trickled byte by byte costs linear time).
/// RFC 9112 2.2 lets a server take LF alone as a line end; imgate refuses it (400) at once
/// instead, as it refuses every other laxness that lets two parsers read one head differently.
pub fn has_bare_lf(buf: &[u8], from: usize) -> bool {
    (from..buf.len()).any(|i| buf[i] == b'\n' && (i == 0 || buf[i - 1] != b'\r'))
}

/// RFC 9112 3.2 and RFC 3986 3.2.2: a Host is a host name, an IPv4 or bracketed IPv6 address,
/// and an optional port; no spaces, no other characters.
fn valid_host(h: &str) -> bool {
    h.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:[]%".contains(&b))
}

/// Parses the head `buf` (the request line through the blank line, CRLFs included).
pub fn parse(buf: &[u8]) -> Result<Head, Refusal> {
    if buf.len() > MAX_HEAD {
        return refuse(431, "request head over 16 KiB");
    }
    // Without the blank line's CRLF, every line ends in CRLF.
    let lines = buf.strip_suffix(b"\r\n").unwrap_or(buf);
    let mut lines = lines.split_inclusive(|&b| b == b'\n').map(|l| l.strip_suffix(b"\r\n"));
    let Some(Some(request_line)) = lines.next() else {
        return refuse(400, "malformed request line");
    };
    if request_line == H2_PREFACE {
        return refuse(0, "HTTP/2 connection preface");
    }
    if request_line.contains(&b'\r') {
        return refuse(400, "bare CR in the request line");
    }
    let mut parts = request_line.split(|&b| b == b' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return refuse(400, "the request line is not METHOD SP TARGET SP VERSION");
    };
    if !is_token(method) {
        return refuse(400, "malformed method");
    }
    let version = match version {
        b"HTTP/1.1" => Version::Http11,
        b"HTTP/1.0" => Version::Http10,
        v if v.len() == 8
            && v.starts_with(b"HTTP/")
            && v[5].is_ascii_digit()
            && v[6] == b'.'
            && v[7].is_ascii_digit() =>
        {
            return refuse(505, "only HTTP/1.0 and HTTP/1.1 are served")
        }
        _ => return refuse(400, "malformed HTTP version"),
    };
    if target.is_empty() || !target.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return refuse(400, "malformed request target");
    }
    // Origin form, or absolute form (a proxy's request), reduced to its path.
    let target = std::str::from_utf8(target).map_err(|_| Refusal {
        status: 400,
        why: "malformed request target",
    })?;
    let target = match target
        .strip_prefix("http://")
        .or_else(|| target.strip_prefix("https://"))
    {
        Some(rest) => match rest.find('/') {
            Some(i) => &rest[i..],
            None => "/",
        },
        None => target,
    };
    if !target.starts_with('/') {
        return refuse(400, "the request target must be an absolute path");
    }
    let path = target.split(['?', '#']).next().unwrap_or(target);

    let mut headers: Vec<(String, String)> = Vec::new();
    for line in lines {
        let Some(line) = line else {
            return refuse(400, "bare LF in the request head");
        };
        if line.contains(&b'\r') {
            return refuse(400, "bare CR in a header line");
        }
        if line.first().is_some_and(|b| *b == b' ' || *b == b'\t') {
            return refuse(400, "obsolete line folding");
        }
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            return refuse(400, "a header line without a colon");
        };
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        if !is_token(name) {
            return refuse(400, "malformed header name (or whitespace before the colon)");
        }
        if !value.iter().all(|&b| is_value_byte(b)) {
            return refuse(400, "control bytes in a header value");
        }
        if headers.len() == MAX_HEADERS {
            return refuse(431, "more than 100 header lines");
        }
        let value = String::from_utf8_lossy(value).trim_matches([' ', '\t']).to_string();
        // Checked above: a token is ASCII.
        headers.push((String::from_utf8_lossy(name).into_owned(), value));
    }
    fn all<'h>(headers: &'h [(String, String)], name: &'h str) -> impl Iterator<Item = &'h str> {
        headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    let all = |name: &'static str| all(&headers, name);
    if all("authorization").count() > 1 {
        return refuse(400, "two Authorization headers");
    }
    match all("host").count() {
        0 if version == Version::Http11 => return refuse(400, "an HTTP/1.1 request without Host"),
        0 | 1 => {}
        _ => return refuse(400, "two Host headers"),
    }
    if all("host").any(|h| !valid_host(h)) {
        return refuse(400, "a malformed Host");
    }
    let lengths: Vec<&str> = all("content-length").collect();
    let codings: Vec<&str> = all("transfer-encoding").collect();
    let body = match (lengths.as_slice(), codings.as_slice()) {
        ([], []) => Framing::None,
        ([n], []) => {
            if n.is_empty() || n.len() > 20 || !n.bytes().all(|b| b.is_ascii_digit()) {
                return refuse(400, "malformed Content-Length");
            }
            match n.parse::<u64>() {
                Ok(n) => Framing::Length(n),
                Err(_) => return refuse(400, "malformed Content-Length"),
            }
        }
        (_, []) => return refuse(400, "more than one Content-Length"),
        ([], _) if version == Version::Http10 => return refuse(400, "Transfer-Encoding on HTTP/1.0"),
        ([], [coding]) if coding.eq_ignore_ascii_case("chunked") => Framing::Chunked,
        ([], _) => return refuse(501, "only the chunked transfer coding is supported"),
        (_, _) => return refuse(400, "Transfer-Encoding together with Content-Length"),
    };
    let connection =
        |token: &str| all("connection").any(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)));
    let close = match version {
        Version::Http11 => connection("close"),
        Version::Http10 => !connection("keep-alive"),
    };
    let expect_continue = all("expect").any(|v| v.eq_ignore_ascii_case("100-continue"));
    Ok(Head {
        method: String::from_utf8_lossy(method).into_owned(),
        target: target.to_string(),
        path: path.to_string(),
        version,
        headers,
        body,
        close,
        expect_continue,
    })
}

impl Head {
    /// The value of a header (names compare case-insensitively); the first when repeated.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Whether a comma-separated header contains `token`.
    pub fn has_token(&self, name: &str, token: &str) -> bool {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .any(|(_, v)| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_bare_lf_is_found_in_what_was_not_checked_before() {
        assert!(has_bare_lf(b"GET / HTTP/1.1\nHost: x", 0));
        assert!(!has_bare_lf(b"GET / HTTP/1.1\r\nHost: x\r\n", 0));
        // The CR of a CRLF split across two reads: the LF is checked against it.
        assert!(!has_bare_lf(b"GET / HTTP/1.1\r\n", 15));
        assert!(has_bare_lf(b"\nGET", 0));
        assert!(
            !has_bare_lf(b"GET / HTTP/1.1\nHost", 15),
            "before `from` was checked already"
        );
        assert!(valid_host("[::1]:8787") && valid_host("imgate.local") && !valid_host("a b"));
    }

    use super::*;

    fn head(text: &str) -> Result<Head, Refusal> {
        parse(text.as_bytes())
    }

    fn status(text: &str) -> u16 {
        head(text).err().map_or(200, |r| r.status)
    }

    #[test]
    fn a_plain_request_parses_with_its_framing() {
        let h = head("POST /hooks/a?x=1 HTTP/1.1\r\nHost: d\r\nContent-Length: 5\r\nAuthorization: bearer k\r\n\r\n")
            .unwrap();
        assert_eq!(
            (h.method.as_str(), h.path.as_str(), h.target.as_str()),
            ("POST", "/hooks/a", "/hooks/a?x=1")
        );
        assert_eq!(h.body, Framing::Length(5));
        assert_eq!(h.header("AUTHORIZATION"), Some("bearer k"));
        assert!(!h.close);
        let h = head("GET http://d:8787/skill.md HTTP/1.0\r\n\r\n").unwrap();
        assert_eq!((h.path.as_str(), h.close), ("/skill.md", true));
        let h =
            head("POST / HTTP/1.1\r\nHost: d\r\nTransfer-Encoding: Chunked\r\nConnection: keep-alive, close\r\n\r\n")
                .unwrap();
        assert_eq!((h.body, h.close), (Framing::Chunked, true));
    }

    #[test]
    fn each_malformed_head_gets_its_status() {
        let cases: [(&str, u16); 20] = [
            ("GET / HTTP/2.0\r\nHost: d\r\n\r\n", 505),
            ("GET / HTTP/3.1\r\n\r\n", 505),
            ("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 0),
            ("GET / HTTP/1.1\r\n\r\n", 400),
            ("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
            (
                "GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
                400,
            ),
            ("GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\n\r\n", 400),
            ("GET / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", 400),
            (
                "GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999\r\n\r\n",
                400,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
                400,
            ),
            ("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
            ("POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
            ("GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n", 400),
            ("GET / HTTP/1.1\r\nHost : a\r\n\r\n", 400),
            ("GET / HTTP/1.1\r\nHost: a\x01b\r\n\r\n", 400),
            (
                "GET / HTTP/1.1\r\nHost: a\r\nAuthorization: a\r\nAuthorization: b\r\n\r\n",
                400,
            ),
            ("GET /  HTTP/1.1\r\nHost: a\r\n\r\n", 400),
            ("GET / HTTP/1.1\nHost: a\r\n\r\n", 400),
            ("G\x00T / HTTP/1.1\r\nHost: a\r\n\r\n", 400),
            ("GET noslash HTTP/1.1\r\nHost: a\r\n\r\n", 400),
        ];
        for (text, want) in cases {
            assert_eq!(status(text), want, "{text:?}");
        }
        let many = format!("GET / HTTP/1.1\r\nHost: a\r\n{}\r\n", "X: y\r\n".repeat(100));
        assert_eq!(status(&many), 431);
        let big = format!("GET / HTTP/1.1\r\nHost: a\r\nX: {}\r\n\r\n", "y".repeat(MAX_HEAD));
        assert_eq!(status(&big), 431);
    }

    #[test]
    fn non_ascii_values_are_kept_but_never_match_ascii_secrets() {
        let h = head("GET / HTTP/1.1\r\nHost: a\r\nX-Name: caf\u{e9}\r\n\r\n").unwrap();
        assert_eq!(h.header("x-name"), Some("caf\u{e9}"));
    }

    #[test]
    fn the_end_of_a_head_is_found_after_leading_empty_lines() {
        assert_eq!(find_end(b"\r\nGET / HTTP/1.1\r\n\r\nbody"), Some((2, 20)));
        assert_eq!(find_end(b"GET / HTTP/1.1\r\n"), None);
    }

    #[test]
    fn thousands_of_mutated_heads_never_panic() {
        let seeds: [&[u8]; 3] = [
            b"POST /files/uploads?x=1 HTTP/1.1\r\nHost: d\r\nAuthorization: Bearer k\r\nUpgrade: websocket\r\nSec-WebSocket-Protocol: a, xagent.connector.packet.v1\r\nContent-Length: 12\r\n\r\n",
            b"POST /hooks/a HTTP/1.1\r\nHost: d\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n",
            b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
        ];
        for input in crate::testutil::mutations(&seeds, 4000, 9) {
            let _ = parse(&input);
            let _ = find_end(&input);
        }
    }
}
