//! Socket Mode frames (`hello`, `disconnect`, envelopes) and Slack message events, from the
//! socket or from `conversations.history`. Everything here is outside input: every field is
//! optional until checked, every text bounded, every ID checked against a safe character set
//! before it names a file, a key or a URL parameter.

use crate::json::{self, Object, Value};

/// A message's text is cut at this many bytes (Slack's own cap is 40,000 characters; a packet
/// must stay far below its 1 MiB).
pub const MAX_TEXT_BYTES: usize = 64 << 10;
/// Slack's IDs (`C…`, `U…`, `B…`, `T…`, `F…`) and its `ts` values are short; longer is not Slack.
const MAX_ID: usize = 64;

/// One text frame of the socket.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// The connection is ready.
    Hello,
    /// Slack will close this connection: `warning` and `refresh_requested` ask for a new one
    /// first; `link_disabled` means Socket Mode was turned off for the app.
    Disconnect { reason: String },
    /// An envelope to acknowledge, with what it carries.
    Envelope { envelope_id: String, event: Event },
    /// A frame of another type, or one that cannot be read: nothing to acknowledge.
    Other(String),
}

/// What an envelope carries, as imgate sees it.
#[derive(Debug, PartialEq)]
pub enum Event {
    /// A message to store (if its channel is bound and it is not the bot's own).
    Message(Box<Message>),
    /// A message event imgate does not store (an edit, a delete, a join): counted, acknowledged.
    Skipped(&'static str),
    /// Not a message event (another event, `app_rate_limited`, a slash command): acknowledged.
    Other,
}

/// A message as Slack shows it in an event or in a channel's history.
#[derive(Debug, PartialEq, Clone)]
pub struct Message {
    pub channel: String,
    /// `channel`, `group`, `im` or `mpim`; empty from the history (the binding knows).
    pub channel_type: String,
    pub ts: String,
    /// The thread's parent, when the message is in a thread (its own ts for a parent).
    pub thread_ts: Option<String>,
    pub user: String,
    pub bot_id: Option<String>,
    pub text: String,
    /// `payload.event_id`, for the socket's events.
    pub event_id: String,
    /// The first file of a `file_share` message.
    pub file: Option<SlackFile>,
}

/// A file of a message, before it is fetched.
#[derive(Debug, PartialEq, Clone)]
pub struct SlackFile {
    pub name: String,
    pub mimetype: String,
    /// `url_private_download` (or `url_private`): fetched with the bot token.
    pub url: String,
    pub size: u64,
}

impl Message {
    /// `CHANNEL:TS`, the `message_id` of every delivery of this message, in the channel it was
    /// read from (history messages carry no channel).
    pub fn message_id_in(&self, channel: &str) -> String {
        format!("{channel}:{}", self.ts)
    }

    /// The thread a reply to this message goes to: its thread's parent, else itself.
    pub fn thread(&self) -> &str {
        self.thread_ts.as_deref().unwrap_or(&self.ts)
    }
}

/// Reads one text frame of the socket.
pub fn read_frame(text: &str) -> Frame {
    let Ok(v) = json::parse(text) else {
        return Frame::Other("not JSON".into());
    };
    let Some(o) = json::as_object(&v) else {
        return Frame::Other("not an object".into());
    };
    let kind = bounded(json::get_str(o, "type").unwrap_or_default(), MAX_ID);
    match kind.as_str() {
        "hello" => return Frame::Hello,
        "disconnect" => {
            let reason = bounded(json::get_str(o, "reason").unwrap_or_default(), MAX_ID);
            return Frame::Disconnect { reason };
        }
        _ => {}
    }
    // Every envelope is acknowledged, whatever it carries, so Slack does not deliver it again.
    let Some(envelope_id) = json::get_str(o, "envelope_id").filter(|id| safe_id(id, 128)) else {
        return Frame::Other(format!("a `{kind}` frame without a usable envelope_id"));
    };
    let payload = json::get_obj(o, "payload");
    let event = match (kind.as_str(), payload) {
        ("events_api", Some(p)) => event_of(p),
        _ => Event::Other,
    };
    Frame::Envelope {
        envelope_id: envelope_id.to_string(),
        event,
    }
}

/// The `event_callback` of an `events_api` envelope.
fn event_of(payload: &Object) -> Event {
    let Some(event) = json::get_obj(payload, "event") else {
        return Event::Other;
    };
    if json::get_str(event, "type") != Some("message") {
        return Event::Other;
    }
    let event_id = json::get_str(payload, "event_id")
        .filter(|id| safe_id(id, MAX_ID))
        .unwrap_or_default();
    match message_of(event) {
        Ok(mut m) => {
            m.event_id = event_id.to_string();
            Event::Message(Box::new(m))
        }
        Err(why) => Event::Skipped(why),
    }
}

/// Reads one message (an event's `event`, or an element of a history's `messages`). The `Err`
/// says why it is not stored.
pub fn message_of(m: &Object) -> Result<Message, &'static str> {
    match json::get_str(m, "subtype") {
        // A user's message, with a file, a reply also sent to the channel, a `/me`, another
        // integration's post: messages. Every other subtype is a change to one (an edit, a
        // delete) or a notice (a join, a topic).
        None | Some("file_share" | "thread_broadcast" | "me_message" | "bot_message") => {}
        Some("message_changed") => return Err("an edit"),
        Some("message_deleted") => return Err("a delete"),
        Some(_) => return Err("a notice"),
    }
    let id = |k: &str| json::get_str(m, k).filter(|v| safe_id(v, MAX_ID));
    let ts = id("ts").filter(|t| ts_micros(t).is_some()).ok_or("no usable ts")?;
    let thread_ts = id("thread_ts").filter(|t| ts_micros(t).is_some());
    let file = match json::get(m, "files") {
        Some(Value::Array(files)) => files.iter().filter_map(json::as_object).find_map(file_of),
        _ => None,
    };
    Ok(Message {
        // History messages carry no channel: the caller knows it.
        channel: id("channel").unwrap_or_default().to_string(),
        channel_type: id("channel_type").unwrap_or_default().to_string(),
        ts: ts.to_string(),
        thread_ts: thread_ts.map(str::to_string),
        user: id("user").unwrap_or_default().to_string(),
        bot_id: id("bot_id").map(str::to_string),
        text: bounded(json::get_str(m, "text").unwrap_or_default(), MAX_TEXT_BYTES),
        event_id: String::new(),
        file,
    })
}

fn file_of(f: &Object) -> Option<SlackFile> {
    let url = json::get_str(f, "url_private_download").or_else(|| json::get_str(f, "url_private"))?;
    if url.len() > 2048 || !(url.starts_with("https://") || url.starts_with("http://")) {
        return None;
    }
    let name = json::get_str(f, "name")
        .or_else(|| json::get_str(f, "title"))
        .unwrap_or("file");
    Some(SlackFile {
        name: bounded(name, 255),
        mimetype: bounded(json::get_str(f, "mimetype").unwrap_or("application/octet-stream"), 128),
        url: url.to_string(),
        size: json::get_u64(f, "size").unwrap_or(0),
    })
}

/// A `ts` (`1700000000.000100`) as microseconds since the epoch: the order of a channel's
/// messages, and the high-water mark kept for its catch-up. `None` for anything else.
pub fn ts_micros(ts: &str) -> Option<u64> {
    let (secs, frac) = ts.split_once('.')?;
    if secs.is_empty() || secs.len() > 12 || frac.len() != 6 {
        return None;
    }
    if !secs.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit()) {
        return None;
    }
    secs.parse::<u64>()
        .ok()?
        .checked_mul(1_000_000)?
        .checked_add(frac.parse().ok()?)
}

/// A high-water mark as the `ts` Slack's `oldest` takes.
pub fn ts_of(micros: u64) -> String {
    format!("{}.{:06}", micros / 1_000_000, micros % 1_000_000)
}

// Slack's IDs, ts values and envelope IDs are `safe_id`s; its texts are `bounded`.
pub use crate::providers::inbound::{bounded, safe_id};

/// The users a text mentions (`<@U…>`), each once, at most `max`.
pub fn mentioned(text: &str, max: usize) -> Vec<String> {
    let mut users: Vec<String> = Vec::new();
    for token in tokens(text) {
        if let Some(user) = token.strip_prefix('@').map(|u| u.split('|').next().unwrap_or(u)) {
            if users.len() < max && safe_id(user, MAX_ID) && !users.iter().any(|u| u == user) {
                users.push(user.to_string());
            }
        }
    }
    users
}

/// The `<…>` tokens of Slack's message format.
fn tokens(text: &str) -> impl Iterator<Item = &str> {
    text.split('<')
        .skip(1)
        .filter_map(|rest| rest.split_once('>').map(|(t, _)| t))
}

/// Slack's message format as a person reads it: `<@U1>` as `@name` (`name_of` knows the
/// names it could look up), `<#C1|general>` as `#general`, `<!here>` as `@here`, `<url|label>`
/// as `label (url)`, and `&lt;` `&gt;` `&amp;` as the characters they stand for.
pub fn readable(text: &str, name_of: impl Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find('<') {
        out.push_str(&unescape(&rest[..open]));
        let after = &rest[open + 1..];
        let Some(close) = after.find('>') else {
            out.push_str(&unescape(&rest[open..]));
            return out;
        };
        let token = &after[..close];
        let (target, label) = match token.split_once('|') {
            Some((t, l)) => (t, Some(l)),
            None => (token, None),
        };
        let shown = if let Some(user) = target.strip_prefix('@') {
            let name = label.map(str::to_string).or_else(|| name_of(user));
            format!("@{}", name.unwrap_or_else(|| user.to_string()))
        } else if let Some(channel) = target.strip_prefix('#') {
            format!("#{}", label.unwrap_or(channel))
        } else if let Some(special) = target.strip_prefix('!') {
            // `<!here>`, `<!channel>`, `<!subteam^S1|@team>`, `<!date^…|fallback>`.
            let name = label.map_or_else(
                || special.split('^').next().unwrap_or(special),
                |l| l.trim_start_matches('@'),
            );
            match special.starts_with("date") {
                true => name.to_string(),
                false => format!("@{name}"),
            }
        } else {
            match label {
                Some(l) if l != target => format!("{} ({target})", unescape(l)),
                _ => target.to_string(),
            }
        };
        out.push_str(&unescape(&shown));
        rest = &after[close + 1..];
    }
    out.push_str(&unescape(rest));
    out
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope(event: &str) -> String {
        format!(
            r#"{{"envelope_id":"e-1","type":"events_api","accepts_response_payload":false,"retry_attempt":0,"retry_reason":"",
            "payload":{{"type":"event_callback","event_id":"Ev01","event":{event}}}}}"#
        )
    }

    #[test]
    fn a_message_event_is_read_with_its_thread_and_first_file() {
        let frame = read_frame(&envelope(
            r#"{"type":"message","subtype":"file_share","channel":"C01","channel_type":"channel","user":"U01","text":"look","ts":"1700000000.000200","thread_ts":"1700000000.000100",
            "files":[{"name":"a.png","mimetype":"image/png","size":3,"url_private_download":"https://files.slack.com/a.png"}]}"#,
        ));
        let Frame::Envelope {
            envelope_id,
            event: Event::Message(m),
        } = frame
        else {
            panic!("{frame:?}")
        };
        assert_eq!(envelope_id, "e-1");
        assert_eq!(m.message_id_in(&m.channel), "C01:1700000000.000200");
        assert_eq!(m.thread(), "1700000000.000100");
        assert_eq!(m.event_id, "Ev01");
        assert_eq!(m.file.unwrap().url, "https://files.slack.com/a.png");
    }

    #[test]
    fn edits_deletes_and_other_envelopes_are_acknowledged_without_a_message() {
        let edit = read_frame(&envelope(
            r#"{"type":"message","subtype":"message_changed","channel":"C01","ts":"1700000000.000300"}"#,
        ));
        assert!(
            matches!(
                edit,
                Frame::Envelope {
                    event: Event::Skipped("an edit"),
                    ..
                }
            ),
            "{edit:?}"
        );
        let limited = read_frame(r#"{"envelope_id":"e-2","type":"events_api","payload":{"type":"app_rate_limited"}}"#);
        assert!(
            matches!(
                limited,
                Frame::Envelope {
                    event: Event::Other,
                    ..
                }
            ),
            "{limited:?}"
        );
        assert_eq!(read_frame(r#"{"type":"hello","num_connections":1}"#), Frame::Hello);
        assert_eq!(
            read_frame(r#"{"type":"disconnect","reason":"link_disabled"}"#),
            Frame::Disconnect {
                reason: "link_disabled".into()
            }
        );
        assert!(matches!(
            read_frame(r#"{"envelope_id":"../x","type":"events_api"}"#),
            Frame::Other(_)
        ));
        assert!(matches!(read_frame("{"), Frame::Other(_)));
    }

    #[test]
    fn malformed_frames_never_panic_and_unsafe_ids_are_not_taken() {
        let valid = envelope(
            r#"{"type":"message","channel":"C01","user":"U01","text":"<@U02|ann> hi","ts":"1700000000.000200"}"#,
        );
        for bad in crate::testutil::mutations(&[valid.as_bytes()], 3000, 36) {
            if let Ok(text) = std::str::from_utf8(&bad) {
                if let Frame::Envelope {
                    event: Event::Message(m),
                    ..
                } = read_frame(text)
                {
                    assert!(ts_micros(&m.ts).is_some());
                    assert!(m.channel.is_empty() || safe_id(&m.channel, MAX_ID));
                    let _ = readable(&m.text, |_| None);
                }
            }
        }
    }

    #[test]
    fn ts_values_order_as_microseconds_and_only_slack_shaped_ones_are_read() {
        assert_eq!(ts_micros("1700000000.000100"), Some(1_700_000_000_000_100));
        assert_eq!(ts_of(1_700_000_000_000_100), "1700000000.000100");
        for bad in [
            "",
            ".",
            "1.1",
            "abc.000001",
            "1700000000.0001000",
            "-1.000001",
            "99999999999999.000000",
        ] {
            assert_eq!(ts_micros(bad), None, "{bad}");
        }
    }

    #[test]
    fn slack_markup_reads_as_a_person_would_write_it() {
        let names = |u: &str| (u == "U01").then(|| "ann".to_string());
        assert_eq!(
            readable(
                "<@U01> and <@U02>: see <#C9|general>, <!here> &amp; <https://x.io|docs> &lt;3",
                names
            ),
            "@ann and @U02: see #general, @here & docs (https://x.io) <3"
        );
        assert_eq!(readable("<https://x.io>", names), "https://x.io");
        assert_eq!(readable("a < b", names), "a < b");
        assert_eq!(mentioned("<@U01> <@U01> <@U02|b> <#C1>", 8), ["U01", "U02"]);
    }
}
