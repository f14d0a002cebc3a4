//! A small Matrix client-server API client (https://spec.matrix.org/latest/client-server-api/)
//! over `upstream`.
//!
//! Every call carries `Authorization: Bearer TOKEN` (a header, never a URL, so no error text can
//! hold it). A refusal is `{errcode, error}` with its status; a rate limit is `429
//! M_LIMIT_EXCEEDED` with `retry_after_ms` (and, newer, `Retry-After` in seconds). IDs in a path
//! (`!room:server`, `@user:server`, `#alias:server`) are percent-encoded.

use std::time::Duration;

use crate::files::{FileError, FilePart};
use crate::json::{self, Object, Value};
use crate::providers::Upload;
pub use crate::upstream::ApiError;
use crate::upstream::{self, query_value, Kind, Platform};

/// An answer larger than this is refused unread. Past it a /sync asks for half the events per
/// room, down to one, and then for the bound rooms only (`link.rs`).
pub const MAX_ANSWER: u64 = 1 << 20;
/// `/sync` long-polls this long at the server; the HTTP timeout adds a margin.
pub const POLL_MS: u64 = 30_000;
/// Characters of the server's error text kept (it reaches logs and tool results).
const MAX_ERROR: usize = 160;

/// A homeserver: a refusal is `{errcode, error}` with its status.
pub static PLATFORM: Platform = Platform::new("homeserver", |status, errcode| match (status, errcode) {
    (401, _) => Some(Kind::Auth),
    (404, "M_NOT_FOUND") => Some(Kind::Gone),
    _ => None,
});

/// The token was revoked (logged out, deactivated): nothing works until a new binding.
pub fn token_gone(e: &ApiError) -> bool {
    e.kind() == Kind::Auth && e.code == "M_UNKNOWN_TOKEN"
}

/// One account on one homeserver: where to call and with what.
pub struct Account<'a> {
    /// `https://matrix.example.org`, no trailing slash.
    pub homeserver: &'a str,
    pub token: &'a str,
}

#[derive(Clone)]
pub struct Api {
    http: ureq::Agent,
    poll: ureq::Agent,
    /// File downloads and uploads: the longest a fetch may take.
    files: ureq::Agent,
}

/// A path segment (a room, user or alias ID; a transaction ID), percent-encoded.
pub fn seg(id: &str) -> String {
    query_value(id)
}

impl Api {
    pub fn new(file_deadline: Duration) -> Api {
        Api {
            http: upstream::agent(Duration::from_secs(15)),
            poll: upstream::agent(Duration::from_millis(POLL_MS) + Duration::from_secs(15)),
            files: upstream::agent(file_deadline),
        }
    }

    /// `GET /_matrix/client/versions` needs no token: whether `homeserver` speaks Matrix.
    pub fn versions(&self, homeserver: &str) -> Result<Object, ApiError> {
        let req = self.http.get(&format!("{homeserver}/_matrix/client/versions"));
        let mut resp = req.call().map_err(|e| PLATFORM.unreachable(e.into()))?;
        answer(&mut resp, MAX_ERROR_ANSWER)
    }

    /// A GET of the client API (`path` after `/_matrix/client/v3`), within `timeout`.
    pub fn get(&self, acct: &Account, path: &str, timeout: Duration) -> Result<Object, ApiError> {
        let url = format!("{}/_matrix/client/v3{path}", acct.homeserver);
        let req = upstream::within(&self.http, self.http.get(&url), timeout);
        let mut resp = authorized(req, acct.token)
            .call()
            .map_err(|e| PLATFORM.unreachable(e.into()))?;
        answer(&mut resp, MAX_ANSWER).map_err(|e| e.hiding(acct.token, "<token>"))
    }

    /// `/sync` (`query` is its whole query string): a long poll of up to `POLL_MS`.
    pub fn sync(&self, acct: &Account, query: &str) -> Result<Object, ApiError> {
        let url = format!("{}/_matrix/client/v3/sync?{query}", acct.homeserver);
        let mut resp = authorized(self.poll.get(&url), acct.token)
            .call()
            .map_err(|e| PLATFORM.unreachable(e.into()))?;
        answer(&mut resp, MAX_ANSWER).map_err(|e| e.hiding(acct.token, "<token>"))
    }

    /// A PUT or POST of a JSON body to the client API, within `timeout`.
    pub fn send(
        &self,
        acct: &Account,
        method: &str,
        path: &str,
        body: &Value,
        timeout: Duration,
    ) -> Result<Object, ApiError> {
        let url = format!("{}/_matrix/client/v3{path}", acct.homeserver);
        let req = if method == "PUT" {
            self.http.put(&url)
        } else {
            self.http.post(&url)
        };
        let req = upstream::within(&self.http, req, timeout);
        let mut resp = authorized(req, acct.token)
            .header("Content-Type", "application/json")
            .send(json::to_string(body).as_bytes())
            .map_err(|e| PLATFORM.unreachable(e.into()))?;
        answer(&mut resp, MAX_ANSWER).map_err(|e| e.hiding(acct.token, "<token>"))
    }

    /// Uploads a file from the cache (`POST /_matrix/media/v3/upload`), streamed from disk;
    /// its `mxc://` URI.
    pub fn upload(&self, acct: &Account, file: &Upload, timeout: Duration) -> Result<String, ApiError> {
        let url = format!(
            "{}/_matrix/media/v3/upload?filename={}",
            acct.homeserver,
            query_value(file.filename)
        );
        let mut bytes = std::fs::File::open(file.path)
            .map(|f| std::io::Read::take(f, file.size))
            .map_err(|e| PLATFORM.cache(FileError::Storage(e.to_string())))?;
        let req = upstream::within(&self.files, self.files.post(&url), timeout);
        let mut resp = authorized(req, acct.token)
            .header("Content-Type", file.mime)
            .header("Content-Length", &file.size.to_string())
            .send(ureq::SendBody::from_reader(&mut bytes))
            .map_err(|e| PLATFORM.unreachable(e.into()))?;
        let o = answer(&mut resp, MAX_ERROR_ANSWER).map_err(|e| e.hiding(acct.token, "<token>"))?;
        json::get_str(&o, "content_uri")
            .filter(|u| u.starts_with("mxc://"))
            .map(str::to_string)
            .ok_or_else(|| PLATFORM.refused(502, "the upload's answer has no content_uri"))
    }

    /// Downloads `mxc://server/id` into `part` through authenticated media (Matrix 1.11), or the
    /// older unauthenticated path when the server does not know the newer one; the type it
    /// served.
    pub fn download(
        &self,
        acct: &Account,
        mxc: &str,
        part: &mut FilePart,
        timeout: Duration,
    ) -> Result<Option<String>, ApiError> {
        let (server, id) = mxc_parts(mxc).ok_or_else(|| PLATFORM.refused(400, "not an mxc:// URI"))?;
        let path = format!("{}/{}", seg(server), seg(id));
        let authenticated = format!("{}/_matrix/client/v1/media/download/{path}", acct.homeserver);
        let req = upstream::within(&self.files, self.files.get(&authenticated), timeout);
        let mut resp = authorized(req, acct.token)
            .call()
            .map_err(|e| PLATFORM.unreachable(e.into()))?;
        let status = resp.status().as_u16();
        // A server older than Matrix 1.11 does not know the route (404 M_UNRECOGNIZED, 405).
        if status == 404 || status == 405 {
            let unknown_route =
                matches!(answer(&mut resp, MAX_ERROR_ANSWER), Err(e) if e.code == "M_UNRECOGNIZED" || e.status == 405);
            if !unknown_route {
                return Err(PLATFORM.refused(404, "the homeserver does not have this file"));
            }
            let legacy = format!("{}/_matrix/media/v3/download/{path}", acct.homeserver);
            let req = upstream::within(&self.files, self.files.get(&legacy), timeout);
            resp = req.call().map_err(|e| PLATFORM.unreachable(e.into()))?;
        }
        if resp.status().as_u16() != 200 {
            return answer(&mut resp, MAX_ERROR_ANSWER)
                .and(Err(PLATFORM.refused(502, "file download refused")))
                .map_err(|e| e.hiding(acct.token, "<token>"));
        }
        let served = upstream::content_type(&resp);
        PLATFORM.save(&mut resp, part)?;
        Ok(served)
    }
}

/// Refusals and small answers are read up to this.
const MAX_ERROR_ANSWER: u64 = 64 * 1024;

/// `mxc://server/media_id`: both parts as the spec allows them (a server name; an ID of letters,
/// digits, `_` and `-`), so neither can change the path they are put in.
pub fn mxc_parts(mxc: &str) -> Option<(&str, &str)> {
    let (server, id) = mxc.strip_prefix("mxc://")?.split_once('/')?;
    let server_ok = !server.is_empty()
        && server.len() <= 255
        && server
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']'));
    let id_ok = !id.is_empty()
        && id.len() <= 255
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'));
    (server_ok && id_ok).then_some((server, id))
}

fn authorized<B>(req: ureq::RequestBuilder<B>, token: &str) -> ureq::RequestBuilder<B> {
    req.header("Authorization", &format!("Bearer {token}"))
}

/// A success's JSON object, or the refusal it is.
fn answer(resp: &mut upstream::Response, cap: u64) -> Result<Object, ApiError> {
    let header_wait = upstream::retry_after(resp);
    let (status, body) = upstream::read_json(resp, cap).map_err(|e| PLATFORM.unreachable(e))?;
    match body {
        Some(o) if (200..300).contains(&status) => Ok(o),
        Some(o) => Err(ApiError {
            code: json::get_str(&o, "errcode")
                .unwrap_or_default()
                .chars()
                .take(64)
                .collect(),
            // `retry_after_ms` first (the spec's field), else the header; clamped by the caller.
            retry_after: json::get_u64(&o, "retry_after_ms")
                .map(Duration::from_millis)
                .or(header_wait),
            from_peer: true,
            ..PLATFORM.refused(
                status,
                json::get_str(&o, "error")
                    .unwrap_or("no reason given")
                    .chars()
                    .take(MAX_ERROR)
                    .collect::<String>(),
            )
        }),
        None => Err(ApiError {
            retry_after: header_wait,
            ..PLATFORM.refused(status, format!("an answer that is not a JSON object (status {status})"))
        }),
    }
}
