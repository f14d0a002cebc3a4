//! Every HTTP route except `/ws`, on tiny_http with blocking handlers (the front door relays
//! connections here over a Unix socket in the state dir).

pub mod multipart;
pub mod ops;

use std::path::Path;
use std::sync::Arc;

use tiny_http::{Header, Method, Request, Response, Server};

use crate::app::App;
use crate::ids;
use crate::json::{self, obj, s, Value};
use crate::protocol::card;

/// How long a handler started for a request waits for tiny_http to hand it over.
const HANDOVER: std::time::Duration = std::time::Duration::from_secs(30);

/// tiny_http switches an answer of this many bytes or more to chunked encoding unless told
/// otherwise; every answer of ours has a known length and the front door's relay reads it as
/// `Content-Length` (it refuses chunked answers), so none may be chunked.
const NEVER_CHUNKED: usize = usize::MAX;

/// Called once per request written to the internal socket, so that a handler takes it
/// (tiny_http's `recv`).
pub type Dispatch = Box<dyn Fn() + Send + Sync>;

/// Lines of `/metrics` that layers above this one keep (the front door's refusals).
pub type MoreMetrics = fn(&mut String);

/// Starts the internal HTTP server on `socket`. It has no worker threads of its own: the front
/// door calls the returned function once for every request it writes to the socket, and each
/// call answers one request on a blocking thread (which the pool lets go when idle).
pub fn start(app: &Arc<App>, socket: &Path, more_metrics: MoreMetrics) -> Result<Dispatch, String> {
    let _ = std::fs::remove_file(socket);
    let server =
        Server::http_unix(socket).map_err(|e| format!("cannot bind internal socket {}: {e}", socket.display()))?;
    let server = Arc::new(server);
    let app = Arc::downgrade(app);
    Ok(Box::new(move || {
        let (server, app) = (server.clone(), app.clone());
        crate::runtime::spawn_blocking(move || {
            if let Ok(Some(req)) = server.recv_timeout(HANDOVER) {
                match app.upgrade() {
                    Some(app) => handle(&app, req, more_metrics),
                    None => {
                        let _ = req.respond(error(503, "stopping"));
                    }
                }
            }
        });
    }))
}

fn header(req: &Request, name: &str) -> Option<String> {
    req.headers()
        .iter()
        .find(|h| h.field.as_str().as_str().eq_ignore_ascii_case(name))
        .map(|h| h.value.as_str().to_string())
}

/// A header whose value comes from outside (a provider's file name or MIME type): anything
/// tiny_http cannot carry is left out rather than allowed to fail the answer.
fn header_of(name: &str, value: &str) -> Option<Header> {
    Header::from_bytes(name, value).ok()
}

fn content_type(v: &str) -> Header {
    header_of("Content-Type", v)
        .or_else(|| header_of("Content-Type", "application/octet-stream"))
        .expect("a static header is valid")
}

/// `Content-Disposition` for a file name of any script (RFC 6266): an ASCII `filename` for old
/// clients, the exact name as `filename*` in UTF-8.
fn disposition(name: &str) -> String {
    let ascii: String = name
        .chars()
        .map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '_' })
        .filter(|c| *c != '"' && *c != '\\')
        .collect();
    let mut v = format!("attachment; filename=\"{ascii}\"");
    if !name.is_ascii() {
        v.push_str("; filename*=UTF-8''");
        for b in name.bytes() {
            if b.is_ascii_alphanumeric() || b"!#$&+-.^_`|~".contains(&b) {
                v.push(b as char);
            } else {
                v.push_str(&format!("%{b:02X}"));
            }
        }
    }
    v
}

fn json_response(status: u16, body: &Value) -> Response<std::io::Cursor<Vec<u8>>> {
    Response::from_data(json::to_string(body).into_bytes())
        .with_status_code(status)
        .with_header(content_type("application/json"))
}

fn error(status: u16, code: &str) -> Response<std::io::Cursor<Vec<u8>>> {
    json_response(status, &obj([("error", s(code))]))
}

/// 405 with the methods the route takes (RFC 9110 15.5.6: a 405 carries `Allow`).
fn not_allowed(methods: &str) -> Response<std::io::Cursor<Vec<u8>>> {
    let r = error(405, "method_not_allowed");
    match header_of("Allow", methods) {
        Some(h) => r.with_header(h),
        None => r,
    }
}

/// Bearer check for the routes that need the system API key (when one is configured).
fn authorized(app: &App, req: &Request) -> bool {
    match &app.config.server.api_key {
        None => true,
        Some(key) => header(req, "Authorization")
            .as_deref()
            .and_then(ids::bearer)
            .is_some_and(|t| ids::secret_eq(t, key.expose())),
    }
}

/// The path below the configured base path (`public_url`'s path), query removed.
fn route(app: &App, url: &str) -> String {
    let path = url.split('?').next().unwrap_or(url);
    let prefix = base_path(app);
    match path.strip_prefix(prefix.as_str()) {
        Some(rest) if !prefix.is_empty() && rest.starts_with('/') => rest.to_string(),
        _ => path.to_string(),
    }
}

/// The path part of `public_url`, without a trailing slash ("" when none).
pub fn base_path(app: &App) -> String {
    let Some(url) = &app.config.server.public_url else {
        return String::new();
    };
    let after_scheme = url.split("://").nth(1).unwrap_or("");
    match after_scheme.find('/') {
        Some(i) => after_scheme[i..].trim_end_matches('/').to_string(),
        None => String::new(),
    }
}

/// `GET /files/refs/{ref}`: the bytes of an inbound file; the unguessable ref is the credential.
fn download(app: &App, req: Request, file_ref: &str) {
    let (rec, path) = match app.files.get(file_ref) {
        // Inbound media for xAgent, and files of xAgent's messages handed to a webhook's
        // receiver (IM v2): the unguessable ref is the credential either way.
        Ok(Some(found)) if found.0.downloadable() => found,
        Ok(_) => {
            let _ = req.respond(error(404, "not_found"));
            return;
        }
        Err(e) => {
            log::debug!("files: cannot look a file up: {e}");
            let _ = req.respond(error(503, "storage_unavailable"));
            return;
        }
    };
    match std::fs::File::open(&path) {
        Ok(f) => {
            let mut resp = Response::from_file(f)
                .with_header(content_type(&rec.mime_type))
                .with_chunked_threshold(NEVER_CHUNKED);
            if let Some(h) = header_of("Content-Disposition", &disposition(&rec.filename)) {
                resp = resp.with_header(h);
            }
            let _ = req.respond(resp);
        }
        Err(e) => {
            // The ref is the file's only credential: it stays out of the log.
            log::error!("files: a cached {} file cannot be read: {e}", rec.kind);
            let _ = req.respond(error(404, "not_found"));
        }
    }
}

/// The Card: the union of what the enabled providers bring.
fn card_of(app: &App) -> Value {
    let p = &app.providers;
    card::card(
        &app.config.server.card_id,
        app.config.server.api_key.is_some(),
        app.config.xagent.profile,
        card::Parts {
            targets: p.all().iter().map(|p| p.declaration().target()).collect(),
            auth_flows: p.all().iter().flat_map(|p| p.auth_flows()).collect(),
            tools: p.tools(),
        },
    )
}

fn handle(app: &App, req: Request, more_metrics: MoreMetrics) {
    let path = route(app, req.url());
    let method = req.method().clone();
    let response = match (&method, path.as_str()) {
        (Method::Get, "/connector-card.json") => json_response(200, &card_of(app)),
        (Method::Get, "/skill.md") => {
            Response::from_data(card::skill(&app.config.server.card_id, app.config.xagent.profile).into_bytes())
                .with_header(content_type("text/markdown; charset=utf-8"))
        }
        // 2xx while the endpoint serves (the protocol's meaning); the storage state beside it.
        (Method::Get, "/health") if authorized(app, &req) => {
            let mut health = card::health(&app.config.server.card_id);
            if let Value::Object(o) = &mut health {
                let state = if ops::storage(app).up { "ok" } else { "failing" };
                o.insert("storage".into(), Value::String(state.into()));
            }
            json_response(200, &health)
        }
        (Method::Get, "/status") if authorized(app, &req) => json_response(200, &ops::status(app)),
        (Method::Get, "/metrics") if authorized(app, &req) => {
            Response::from_data(ops::metrics(app, more_metrics).into_bytes())
                .with_header(content_type("text/plain; version=0.0.4; charset=utf-8"))
        }
        (Method::Get, "/health" | "/status" | "/metrics") => error(401, "unauthorized"),
        (Method::Get, p) if p.starts_with("/files/refs/") => {
            return download(app, req, &p["/files/refs/".len()..]);
        }
        (_, "/connector-card.json" | "/skill.md" | "/health" | "/status" | "/metrics") => not_allowed("GET, HEAD"),
        (_, p) if app.providers.has_path(p) => not_allowed("POST"),
        _ => error(404, "not_found"),
    };
    let status = response.status_code().0;
    if let Err(e) = req.respond(response.with_chunked_threshold(NEVER_CHUNKED)) {
        log::debug!("http: {method} {path}: client went away: {e}");
    } else {
        log::debug!("http: {method} {path} -> {status}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_of_any_script_become_a_valid_content_disposition() {
        assert_eq!(disposition("plan.png"), "attachment; filename=\"plan.png\"");
        let d = disposition("отчёт 1.pdf");
        assert_eq!(
            d,
            "attachment; filename=\"_____ 1.pdf\"; filename*=UTF-8''%D0%BE%D1%82%D1%87%D1%91%D1%82%201.pdf"
        );
        assert!(header_of("Content-Disposition", &d).is_some());
        assert!(header_of("Content-Type", "image/p\u{e9}ng").is_none());
        assert_eq!(
            content_type("image/p\u{e9}ng").value.as_str(),
            "application/octet-stream"
        );
    }
}
