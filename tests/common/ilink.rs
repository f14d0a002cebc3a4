//! A WeChat iLink bot API simulator written from Tencent's public client (openclaw-weixin's
//! `api.ts`, `types.ts`, `login-qr.ts`): the QR login (`get_bot_qrcode`, `get_qrcode_status`
//! with `wait`, `scaned`, `scaned_but_redirect`, `expired`, `need_verifycode`, `confirmed`),
//! `getupdates` (the buffer is the only acknowledgement: a call with an older buffer gets the
//! messages after it again; an idle call is held, then answered empty) and `sendmessage`
//! (`ret: -2` without a fresh context token, `errcode: -14` once the login is ended). POSTs
//! must carry `AuthorizationType: ilink_bot_token` and the bot token as a bearer. The CDN
//! (`/c2c/download`, `/c2c/upload` after `getuploadurl`) keeps AES-128-ECB ciphertexts, as
//! openclaw-weixin's `cdn/` code reads and writes them.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::kit::{base64, base64_decode, now_ms};

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
    /// How long an idle `getupdates` is held (iLink's is about 35 s).
    hold: Option<Duration>,
    /// encrypted_query_param → ciphertext on the CDN.
    cdn: HashMap<String, Vec<u8>>,
    /// Every `getuploadurl` body.
    upload_asks: Vec<Value>,
    /// Where every CDN download is redirected (`302`), when set.
    redirect_downloads: Option<String>,
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
                    let mut bytes = Vec::new();
                    let _ = std::io::Read::read_to_end(req.as_reader(), &mut bytes);
                    let url = req.url().to_string();
                    if url.starts_with("/c2c/") {
                        let _ = req.respond(cdn(&state, &url, bytes));
                        continue;
                    }
                    let raw = String::from_utf8_lossy(&bytes).to_string();
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

    /// The user sends a file (`type` 4, its key as base64 of hex) or an image (`type` 2, its
    /// key as `image_item.aeskey` hex); the message's ID.
    pub fn user_sends(&self, kind: u64, name: &str, bytes: &[u8], context: &str) -> String {
        let (lock, cv) = &*self.state;
        let mut s = lock.lock().unwrap();
        let key: [u8; 16] = core::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(s.inbox.len() as u8));
        let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
        let param = format!("dl-{}", s.cdn.len());
        s.cdn.insert(param.clone(), aes_ecb(bytes, &key, true));
        let item = match kind {
            2 => {
                json!({"type": 2, "image_item": {"aeskey": hex, "media": {"encrypt_query_param": param, "aes_key": base64(&key)}}})
            }
            _ => json!({"type": 4, "file_item": {"file_name": name, "len": bytes.len().to_string(),
                        "media": {"encrypt_query_param": param, "aes_key": base64(hex.as_bytes())}}}),
        };
        let id = format!("{}", 7_100_000_000_000_000_000u64 + s.inbox.len() as u64);
        s.inbox.push(json!({
            "message_id": id, "from_user_id": USER, "message_type": 1, "context_token": context,
            "item_list": [item]
        }));
        s.good_contexts.push(context.to_string());
        cv.notify_all();
        id
    }

    /// Every CDN download from now on answers `302` to `to`.
    pub fn redirect_downloads(&self, to: &str) {
        self.state.0.lock().unwrap().redirect_downloads = Some(to.to_string());
    }

    /// The plaintext of what a `sendmessage` item points at on the CDN, decrypted with its key.
    pub fn uploaded(&self, media: &Value) -> Option<Vec<u8>> {
        let key_text = String::from_utf8(base64_decode(media["aes_key"].as_str()?)).ok()?;
        let key: Vec<u8> = (0..16)
            .map(|i| u8::from_str_radix(&key_text[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        let cipher = self
            .state
            .0
            .lock()
            .unwrap()
            .cdn
            .get(media["encrypt_query_param"].as_str()?)?
            .clone();
        Some(aes_ecb(&cipher, &key.try_into().ok()?, false))
    }

    pub fn upload_asks(&self) -> Vec<Value> {
        self.state.0.lock().unwrap().upload_asks.clone()
    }

    /// iLink delivers the last message once more (it does, about a second apart).
    pub fn deliver_again(&self) {
        let (lock, cv) = &*self.state;
        let mut s = lock.lock().unwrap();
        let last = s.inbox.last().cloned().unwrap();
        s.inbox.push(last);
        cv.notify_all();
    }

    /// Holds an idle `getupdates` this long (default 2 s).
    pub fn hold(&self, d: Duration) {
        self.state.0.lock().unwrap().hold = Some(d);
    }

    /// `host:port` of this server, as a redirect names it.
    pub fn host(&self) -> String {
        self.base.trim_start_matches("http://").to_string()
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
            let mut s = lock.lock().unwrap();
            let deadline = Instant::now() + s.hold.unwrap_or(Duration::from_secs(2));
            s.getupdates_calls += 1;
            loop {
                if s.ended {
                    return json!({"ret": -14, "errcode": -14, "errmsg": "session timeout"});
                }
                if s.inbox.len() > seen {
                    let msgs: Vec<Value> = s.inbox[seen..].to_vec();
                    let buf = base64(s.inbox.len().to_string().as_bytes());
                    return json!({"ret": 0, "msgs": msgs, "get_updates_buf": buf});
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return json!({"ret": 0, "msgs": [], "get_updates_buf": buf});
                }
                s = cv.wait_timeout(s, left).unwrap().0;
            }
        }
        "/ilink/bot/getuploadurl" => {
            let mut s = lock.lock().unwrap();
            s.upload_asks.push(body.clone());
            json!({"ret": 0, "upload_param": format!("up-{}", s.upload_asks.len())})
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

/// The CDN: downloads by `encrypted_query_param`; an upload answers `x-encrypted-param`.
fn cdn(
    state: &Arc<(Mutex<State>, Condvar)>,
    url: &str,
    body: Vec<u8>,
) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    let mut s = state.0.lock().unwrap();
    let param = query(url, "encrypted_query_param").unwrap_or_default().to_string();
    if url.starts_with("/c2c/download") {
        if let Some(to) = &s.redirect_downloads {
            return tiny_http::Response::from_data(Vec::new())
                .with_status_code(302)
                .with_header(tiny_http::Header::from_bytes("Location", to.as_bytes()).unwrap());
        }
        return match s.cdn.get(&param) {
            Some(bytes) => tiny_http::Response::from_data(bytes.clone()),
            None => tiny_http::Response::from_data(Vec::new()).with_status_code(404),
        };
    }
    if query(url, "filekey").is_none() || !param.starts_with("up-") || body.len() % 16 != 0 {
        return tiny_http::Response::from_data(Vec::new()).with_status_code(400);
    }
    let download = format!("dl-up-{}", s.cdn.len());
    s.cdn.insert(download.clone(), body);
    tiny_http::Response::from_data(Vec::new())
        .with_header(tiny_http::Header::from_bytes("x-encrypted-param", download.as_bytes()).unwrap())
}

/// AES-128-ECB with PKCS#7, as the CDN keeps files.
fn aes_ecb(data: &[u8], key: &[u8; 16], encrypt: bool) -> Vec<u8> {
    use aes::cipher::generic_array::GenericArray;
    use aes::cipher::{BlockDecrypt, BlockEncrypt, KeyInit};
    let cipher = aes::Aes128::new(GenericArray::from_slice(key));
    let mut out = data.to_vec();
    if encrypt {
        let pad = 16 - out.len() % 16;
        out.extend(std::iter::repeat_n(pad as u8, pad));
    }
    for block in out.chunks_exact_mut(16) {
        let b = GenericArray::from_mut_slice(block);
        if encrypt {
            cipher.encrypt_block(b)
        } else {
            cipher.decrypt_block(b)
        }
    }
    if !encrypt {
        let pad = *out.last().unwrap() as usize;
        out.truncate(out.len() - pad);
    }
    out
}
