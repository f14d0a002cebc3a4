//! A WeChat iLink bot API simulator written from Tencent's public client (openclaw-weixin's
//! `api.ts`, `types.ts`, `login-qr.ts`): the QR login (`get_bot_qrcode`, `get_qrcode_status`
//! with `wait`, `scaned`, `scaned_but_redirect`, `expired`, `need_verifycode`, `confirmed`),
//! `getupdates` (the buffer is the only acknowledgement: a call with an older buffer gets the
//! messages after it again; an idle call is held, then answered empty) and `sendmessage`
//! (`ret: -2` without a fresh context token, `errcode: -14` once the login is ended). POSTs
//! must carry `AuthorizationType: ilink_bot_token` and the bot token as a bearer.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub const BOT_ID: &str = "b0f5c1a2@im.bot";
pub const BOT_TOKEN: &str = "ilink-bot-token-secret-5c9e";
pub const USER: &str = "o9cq80SAMPLEuser@im.wechat";

#[derive(Default)]
struct State {
    next_code: u64,
    /// qrcode → the statuses its polls answer, in turn (the last one repeats).
    codes: HashMap<String, Vec<Value>>,
    /// Every message the user sent, in order; a buffer `n` has seen the first `n`.
    inbox: Vec<Value>,
    /// Every `sendmessage` body.
    sent: Vec<Value>,
    /// The context tokens sendmessage takes.
    good_contexts: Vec<String>,
    ended: bool,
    /// (path, AuthorizationType, Authorization) of every POST.
    posts: Vec<(String, String, String)>,
    getupdates_calls: usize,
}

pub struct Ilink {
    pub base: String,
    state: Arc<(Mutex<State>, Condvar)>,
}

fn header(req: &tiny_http::Request, name: &str) -> String {
    req.headers()
        .iter()
        .find(|h| h.field.as_str().as_str().eq_ignore_ascii_case(name))
        .map(|h| h.value.to_string())
        .unwrap_or_default()
}

impl Ilink {
    pub fn start() -> Ilink {
        let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let port = server.server_addr().to_ip().unwrap().port();
        let state: Arc<(Mutex<State>, Condvar)> = Arc::default();
        for _ in 0..6 {
            let (server, state) = (server.clone(), state.clone());
            std::thread::spawn(move || {
                while let Ok(mut req) = server.recv() {
                    let mut raw = String::new();
                    let _ = std::io::Read::read_to_string(req.as_reader(), &mut raw);
                    let url = req.url().to_string();
                    if *req.method() == tiny_http::Method::Post {
                        let post = (
                            url.clone(),
                            header(&req, "AuthorizationType"),
                            header(&req, "Authorization"),
                        );
                        state.0.lock().unwrap().posts.push(post);
                    }
                    let body: Value = serde_json::from_str(&raw).unwrap_or(Value::Null);
                    let answer = handle(&state, &url, &body);
                    let resp = tiny_http::Response::from_string(answer.to_string())
                        .with_header(tiny_http::Header::from_bytes("Content-Type", "application/json").unwrap());
                    let _ = req.respond(resp);
                }
            });
        }
        Ilink {
            base: format!("http://127.0.0.1:{port}"),
            state,
        }
    }

    /// What the polls of the next code answer, in turn (the last repeats).
    pub fn script_next_code(&self, statuses: Vec<Value>) {
        let mut s = self.state.0.lock().unwrap();
        let code = format!("qr{}", s.next_code);
        s.codes.insert(code, statuses);
    }

    /// The confirmed status of a login, with this bot's token.
    pub fn confirmed() -> Value {
        json!({"status": "confirmed", "bot_token": BOT_TOKEN, "ilink_bot_id": BOT_ID,
               "baseurl": "", "ilink_user_id": USER})
    }

    /// The user writes to the bot; the message's ID.
    pub fn user_says(&self, text: &str, context: &str) -> String {
        let (lock, cv) = &*self.state;
        let mut s = lock.lock().unwrap();
        let id = format!("{}", 7_000_000_000_000_000_000u64 + s.inbox.len() as u64);
        s.inbox.push(json!({
            "message_id": id.parse::<u64>().unwrap(), "from_user_id": USER, "to_user_id": BOT_ID,
            "message_type": 1, "create_time_ms": now_ms(), "context_token": context,
            "item_list": [{"type": 1, "text_item": {"text": text}}]
        }));
        s.good_contexts.push(context.to_string());
        cv.notify_all();
        id
    }

    /// WeChat ends the login (session timeout).
    pub fn end_login(&self) {
        let (lock, cv) = &*self.state;
        lock.lock().unwrap().ended = true;
        cv.notify_all();
    }

    pub fn sent(&self) -> Vec<Value> {
        self.state.0.lock().unwrap().sent.clone()
    }

    pub fn posts(&self) -> Vec<(String, String, String)> {
        self.state.0.lock().unwrap().posts.clone()
    }

    pub fn getupdates_calls(&self) -> usize {
        self.state.0.lock().unwrap().getupdates_calls
    }

    /// Waits until `n` messages were sent; them all.
    pub fn wait_sent(&self, n: usize, timeout: Duration) -> Vec<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let sent = self.sent();
            if sent.len() >= n || Instant::now() >= deadline {
                return sent;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn query<'a>(url: &'a str, key: &str) -> Option<&'a str> {
    url.split_once('?')?
        .1
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

fn handle(state: &Arc<(Mutex<State>, Condvar)>, url: &str, body: &Value) -> Value {
    let (lock, cv) = &**state;
    let path = url.split('?').next().unwrap_or_default();
    match path {
        "/ilink/bot/get_bot_qrcode" => {
            let mut s = lock.lock().unwrap();
            let code = format!("qr{}", s.next_code);
            s.next_code += 1;
            s.codes
                .entry(code.clone())
                .or_insert_with(|| vec![json!({"status": "wait"})]);
            json!({"qrcode": code, "qrcode_img_content": format!("https://liteapp.weixin.qq.com/q/7GiQu1?qrcode={code}&bot_type=3")})
        }
        "/ilink/bot/get_qrcode_status" => {
            let code = query(url, "qrcode").unwrap_or_default().to_string();
            let mut s = lock.lock().unwrap();
            let status = match s.codes.get_mut(&code) {
                Some(list) if list.len() > 1 => list.remove(0),
                Some(list) => list[0].clone(),
                None => json!({"status": "expired"}),
            };
            if status["status"] == "confirmed" {
                // A new sign-in is a new session.
                s.ended = false;
            }
            status
        }
        "/ilink/bot/getupdates" => {
            let buf = body["get_updates_buf"].as_str().unwrap_or_default();
            let seen: usize = String::from_utf8(base64_decode(buf))
                .ok()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            let deadline = Instant::now() + Duration::from_secs(2);
            let mut s = lock.lock().unwrap();
            s.getupdates_calls += 1;
            loop {
                if s.ended {
                    return json!({"ret": -14, "errcode": -14, "errmsg": "session timeout"});
                }
                if s.inbox.len() > seen {
                    let msgs: Vec<Value> = s.inbox[seen..].to_vec();
                    let buf = base64_encode(s.inbox.len().to_string().as_bytes());
                    return json!({"ret": 0, "msgs": msgs, "get_updates_buf": buf});
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return json!({"ret": 0, "msgs": [], "get_updates_buf": buf});
                }
                s = cv.wait_timeout(s, left).unwrap().0;
            }
        }
        "/ilink/bot/sendmessage" => {
            let mut s = lock.lock().unwrap();
            if s.ended {
                return json!({"ret": -14, "errcode": -14, "errmsg": "session timeout"});
            }
            let context = body["msg"]["context_token"].as_str().unwrap_or_default().to_string();
            if !s.good_contexts.contains(&context) {
                return json!({"ret": -2});
            }
            s.sent.push(body.clone());
            json!({"ret": 0})
        }
        _ => json!({"ret": -1, "errmsg": "unknown path"}),
    }
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |a, (i, b)| a | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            out.push(if i <= chunk.len() {
                B64[(n >> (18 - 6 * i) & 63) as usize] as char
            } else {
                '='
            });
        }
    }
    out
}

pub fn base64_decode(text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in text.bytes().filter(|c| *c != b'=') {
        let Some(v) = B64.iter().position(|x| *x == c) else {
            break;
        };
        acc = acc << 6 | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}
