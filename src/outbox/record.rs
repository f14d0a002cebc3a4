//! How one message is stored: a small JSON header line, a newline, then the payload verbatim.
//! Reading the header never touches the payload, so startup and expiry scans stay cheap, and
//! the payload is not escaped a second time.

use miniserde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Header {
    pub message_id: String,
    pub accepted_at: u64,
    pub expires_at: u64,
    pub attempts: u64,
    /// The reply reference minted for this message, removed with it on expiry or eviction.
    pub reply_ref: Option<String>,
}

/// A stored message: its header and the rendered `message.push` payload.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredMessage {
    pub header: Header,
    pub payload: String,
}

pub fn encode(header: &Header, payload: &str) -> String {
    let mut v = miniserde::json::to_string(header);
    v.push('\n');
    v.push_str(payload);
    v
}

/// The header alone; `None` for a value this version cannot read.
pub fn header(value: &str) -> Option<Header> {
    let line = value.split('\n').next()?;
    miniserde::json::from_str(line).ok()
}

pub fn decode(value: &str) -> Option<StoredMessage> {
    let (line, payload) = value.split_once('\n')?;
    Some(StoredMessage {
        header: miniserde::json::from_str(line).ok()?,
        payload: payload.to_string(),
    })
}

/// Bytes a stored record occupies, as the caps count them: key plus value.
pub fn bytes(source: &str, value: &str) -> u64 {
    (source.len() + 8 + value.len()) as u64
}

/// A delivered-message entry of the dedupe log: `expires_at`, its reply reference (`-` when
/// none), the message ID, separated by spaces (the ID last, as it may contain spaces).
pub fn delivered_entry(expires_at: u64, reply_ref: Option<&str>, message_id: &str) -> String {
    format!("{expires_at} {} {message_id}", reply_ref.unwrap_or("-"))
}

/// `(expires_at, reply_ref, message_id)` of a delivered-log entry.
pub fn parse_delivered(value: &str) -> Option<(u64, Option<&str>, &str)> {
    let (exp, rest) = value.split_once(' ')?;
    let (reply_ref, id) = rest.split_once(' ')?;
    Some((exp.parse().ok()?, Some(reply_ref).filter(|r| *r != "-"), id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_the_header_reads_alone() {
        let h = Header {
            message_id: "m\n1".into(),
            accepted_at: 1,
            expires_at: 2,
            attempts: 0,
            reply_ref: None,
        };
        let v = encode(&h, "{\"text\":\"a\\nb\"}");
        assert_eq!(
            header(&v).unwrap(),
            h,
            "a newline inside the ID is escaped in the header"
        );
        assert_eq!(decode(&v).unwrap().payload, "{\"text\":\"a\\nb\"}");
        assert!(decode("garbage").is_none());
        assert_eq!(
            parse_delivered(&delivered_entry(9, None, "a b")),
            Some((9, None, "a b"))
        );
        assert_eq!(
            parse_delivered(&delivered_entry(9, Some("rr_1"), "x")),
            Some((9, Some("rr_1"), "x"))
        );
    }
}
