//! A strict `multipart/form-data` parser (RFC 7578) for `POST /files/uploads`: whole body in
//! memory (its size is capped before), parts split on the boundary, headers read per part.
//! Malformed input is an error that names the problem, never a panic.

#[derive(Debug, PartialEq)]
pub struct Part<'a> {
    pub name: String,
    pub filename: Option<String>,
    pub content_type: Option<String>,
    pub data: &'a [u8],
}

/// The boundary of a `Content-Type: multipart/form-data; boundary=...` header.
pub fn boundary(content_type: &str) -> Option<String> {
    let mut parts = content_type.split(';');
    if !parts.next()?.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    parts
        .filter_map(|p| p.trim().split_once('='))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("boundary"))
        .map(|(_, v)| v.trim().trim_matches('"').to_string())
        .filter(|b| !b.is_empty() && b.len() <= 70)
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() || from > hay.len() {
        return None;
    }
    hay[from..]
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|i| i + from)
}

pub fn parse<'a>(body: &'a [u8], boundary: &str) -> Result<Vec<Part<'a>>, String> {
    let delim = format!("--{boundary}").into_bytes();
    let mut pos = find(body, &delim, 0).ok_or("no multipart boundary in the body")? + delim.len();
    let mut parts = Vec::new();
    loop {
        if body[pos..].starts_with(b"--") {
            return if parts.is_empty() {
                Err("multipart body has no parts".into())
            } else {
                Ok(parts)
            };
        }
        if !body[pos..].starts_with(b"\r\n") {
            return Err("malformed multipart boundary line".into());
        }
        pos += 2;
        let head_end = find(body, b"\r\n\r\n", pos).ok_or("multipart part without a header end")?;
        let head = std::str::from_utf8(&body[pos..head_end]).map_err(|_| "multipart headers are not UTF-8")?;
        let data_start = head_end + 4;
        let mut next_delim = delim.clone();
        next_delim.splice(0..0, *b"\r\n");
        let data_end = find(body, &next_delim, data_start).ok_or("multipart part is not terminated")?;
        let (mut name, mut filename, mut content_type) = (None, None, None);
        for line in head.split("\r\n") {
            let Some((k, v)) = line.split_once(':') else {
                return Err("malformed multipart header".into());
            };
            match k.trim().to_ascii_lowercase().as_str() {
                "content-disposition" => {
                    for param in v.split(';').skip(1) {
                        let Some((pk, pv)) = param.trim().split_once('=') else {
                            continue;
                        };
                        let pv = pv.trim().trim_matches('"').to_string();
                        match pk.trim() {
                            "name" => name = Some(pv),
                            "filename" => filename = Some(pv),
                            _ => {}
                        }
                    }
                }
                "content-type" => content_type = Some(v.trim().to_string()),
                _ => {}
            }
        }
        parts.push(Part {
            name: name.ok_or("multipart part without a name")?,
            filename,
            content_type,
            data: &body[data_start..data_end],
        });
        pos = data_end + next_delim.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &[u8] = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.png\"\r\nContent-Type: image/png\r\n\r\n\x89PNG\r\n--XyZ\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nhi\r\n--XyZ--\r\n";

    #[test]
    fn parts_come_out_with_names_filenames_and_exact_bytes() {
        assert_eq!(boundary("multipart/form-data; boundary=XyZ").as_deref(), Some("XyZ"));
        assert_eq!(boundary("application/json"), None);
        let parts = parse(BODY, "XyZ").unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].name, "file");
        assert_eq!(parts[0].filename.as_deref(), Some("a.png"));
        assert_eq!(parts[0].content_type.as_deref(), Some("image/png"));
        assert_eq!(parts[0].data, b"\x89PNG");
        assert_eq!(parts[1].data, b"hi");
    }

    #[test]
    fn malformed_bodies_are_errors_not_panics() {
        for bad in [
            &b""[..],
            b"--XyZ",
            b"--XyZ\r\n",
            b"--XyZ\r\nContent-Disposition: form-data\r\n\r\nx",
            b"--XyZ--",
            b"--XyZ\r\nno colon\r\n\r\nx\r\n--XyZ--",
        ] {
            assert!(parse(bad, "XyZ").is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        for input in crate::testutil::mutations(&[BODY], 5000, 5) {
            let _ = parse(&input, "XyZ");
        }
    }
}
