//! Every HTTP route except `/ws`, on tiny_http with blocking handlers (the front door relays
//! connections here over a Unix socket in the state dir).

pub mod ops;

use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use tiny_http::{Header, Method, Request, Response, Server};

use crate::app::App;
use crate::ids;
use crate::json::{self, obj, s, Value};
use crate::protocol::card;
use crate::providers::webhook;

/// Worker threads answering HTTP requests; the front door caps connections before them. Enough
/// for 16 concurrent webhook senders to share one group commit.
const WORKERS: usize = 16;
/// How often an idle worker looks at the shutdown flag.
const POLL: std::time::Duration = std::time::Duration::from_millis(100);
/// Handlers parse small bodies and wait on commits; they need little stack.
const WORKER_STACK: usize = 256 * 1024;

/// Starts the internal HTTP server on `socket` and its worker threads.
pub fn start(app: Arc<App>, socket: &Path) -> Result<(), String> {
    let _ = std::fs::remove_file(socket);
    let server =
        Server::http_unix(socket).map_err(|e| format!("cannot bind internal socket {}: {e}", socket.display()))?;
    let server = Arc::new(server);
    for i in 0..WORKERS {
        let (server, app) = (server.clone(), app.clone());
        std::thread::Builder::new()
            .name(format!("http-{i}"))
            .stack_size(WORKER_STACK)
            // A request being answered is finished before the worker exits on shutdown.
            .spawn(move || {
                while !app.is_stopping() {
                    match server.recv_timeout(POLL) {
                        Ok(Some(req)) => handle(&app, req),
                        Ok(None) => {}
                        Err(e) => log::warn!("http: receive failed: {e}"),
                    }
                }
            })
            .map_err(|e| format!("cannot start HTTP worker: {e}"))?;
    }
    Ok(())
}

fn header(req: &Request, name: &str) -> Option<String> {
    req.headers()
        .iter()
        .find(|h| h.field.as_str().as_str().eq_ignore_ascii_case(name))
        .map(|h| h.value.as_str().to_string())
}

fn content_type(v: &str) -> Header {
    Header::from_bytes("Content-Type", v).expect("static header is valid")
}

fn json_response(status: u16, body: &Value) -> Response<std::io::Cursor<Vec<u8>>> {
    Response::from_data(json::to_string(body).into_bytes())
        .with_status_code(status)
        .with_header(content_type("application/json"))
}

fn error(status: u16, code: &str) -> Response<std::io::Cursor<Vec<u8>>> {
    json_response(status, &obj([("error", s(code))]))
}

/// Bearer check for the routes that need the system API key (when one is configured).
fn authorized(app: &App, req: &Request) -> bool {
    match &app.config.server.api_key {
        None => true,
        Some(key) => header(req, "Authorization")
            .as_deref()
            .and_then(|a| a.strip_prefix("Bearer "))
            .is_some_and(|t| ids::secret_eq(t.trim(), key.expose())),
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

/// Reads at most `limit` bytes of body; `Err(())` when it is longer.
fn read_body(req: &mut Request, limit: u64) -> Result<Vec<u8>, ()> {
    if req.body_length().is_some_and(|n| n as u64 > limit) {
        return Err(());
    }
    let mut body = Vec::new();
    let mut reader = req.as_reader().take(limit + 1);
    if reader.read_to_end(&mut body).is_err() {
        return Err(());
    }
    if body.len() as u64 > limit {
        return Err(());
    }
    Ok(body)
}

fn handle(app: &App, mut req: Request) {
    let path = route(app, req.url());
    let method = req.method().clone();
    let response = match (&method, path.as_str()) {
        (Method::Get, "/connector-card.json") => json_response(
            200,
            &card::card(
                app.config.server.api_key.is_some(),
                app.config.telegram.as_ref().map(|t| t.bot_token.is_some()),
            ),
        ),
        (Method::Get, "/skill.md") => Response::from_data(card::SKILL.as_bytes().to_vec())
            .with_header(content_type("text/markdown; charset=utf-8")),
        (Method::Get, "/health") if authorized(app, &req) => json_response(200, &card::health()),
        (Method::Get, "/status") if authorized(app, &req) => match ops::status(app) {
            Ok(v) => json_response(200, &v),
            Err(e) => {
                log::error!("http: /status: {e}");
                error(503, "storage_unavailable")
            }
        },
        (Method::Get, "/metrics") if authorized(app, &req) => match ops::metrics(app) {
            Ok(text) => Response::from_data(text.into_bytes())
                .with_header(content_type("text/plain; version=0.0.4; charset=utf-8")),
            Err(e) => {
                log::error!("http: /metrics: {e}");
                error(503, "storage_unavailable")
            }
        },
        (Method::Get, "/health" | "/status" | "/metrics") => error(401, "unauthorized"),
        (Method::Post, p) if p.starts_with("/hooks/") => {
            let name = &p["/hooks/".len()..];
            if !app.config.webhooks.contains_key(name) {
                error(404, "unknown_endpoint")
            } else {
                match read_body(&mut req, app.config.server.max_body) {
                    Err(()) => {
                        log::info!("webhook {name}: body over max_body refused");
                        error(413, "too_large")
                    }
                    Ok(body) => {
                        let auth = header(&req, "Authorization");
                        let sig = header(&req, "X-Imgate-Signature");
                        let a = webhook::accept(app, name, auth.as_deref(), sig.as_deref(), &body);
                        json_response(a.status, &a.body)
                    }
                }
            }
        }
        (_, "/connector-card.json" | "/skill.md" | "/health" | "/status" | "/metrics") => {
            error(405, "method_not_allowed")
        }
        (_, p) if p.starts_with("/hooks/") => error(405, "method_not_allowed"),
        _ => error(404, "not_found"),
    };
    let status = response.status_code().0;
    if let Err(e) = req.respond(response) {
        log::debug!("http: {method} {path}: client went away: {e}");
    } else {
        log::debug!("http: {method} {path} -> {status}");
    }
}
