//! A Telegram Bot API simulator written from the public Bot API documentation: `getMe`,
//! `getChat`, `getUpdates` (offset confirms earlier updates, `timeout` long-polls),
//! `sendMessage`, `sendChatAction`, and error answers with `error_code`, `description` and
//! `parameters.retry_after`. Every call is `POST /bot<token>/<method>` with a JSON body.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

#[derive(Default)]
struct State {
    bots: HashMap<String, (u64, String)>,
    /// (bot id, chat id) → chat object, for chats the bot is a member of.
    chats: HashMap<(u64, i64), Value>,
    /// Chats that removed or blocked the bot: Telegram answers 403.
    kicked: Vec<(u64, i64)>,
    /// bot id → pending updates.
    updates: HashMap<u64, Vec<Value>>,
    next_update_id: u64,
    next_message_id: u64,
    /// Every call: (bot id, method, params).
    calls: Vec<(u64, String, Value)>,
    /// method → errors to answer with first: (error_code, retry_after).
    failures: HashMap<String, Vec<(u16, Option<u64>)>>,
    /// method → how long its next calls hang before they are answered.
    stalls: HashMap<String, Vec<Duration>>,
    /// Methods in the order their calls arrived (before any stall).
    arrived: Vec<String>,
    /// (chat id, message id) → text of every message the bots sent, as edited since.
    texts: HashMap<(i64, u64), String>,
    /// file_path → bytes, served at `/file/bot<token>/<file_path>`; file_id → file_path.
    files: HashMap<String, Vec<u8>>,
    file_ids: HashMap<String, String>,
    /// Raw bodies of multipart uploads (sendPhoto, sendDocument): (method, content type, body).
    uploads: Vec<(String, String, Vec<u8>)>,
    polls_now: HashMap<u64, usize>,
    polls_max: HashMap<u64, usize>,
    /// A hostile server: `getUpdates` answers every update it has, whatever `limit` says.
    ignore_limit: bool,
}

pub struct BotApi {
    pub base: String,
    state: Arc<(Mutex<State>, Condvar)>,
}

impl BotApi {
    pub fn start() -> BotApi {
        let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let port = server.server_addr().to_ip().unwrap().port();
        let state: Arc<(Mutex<State>, Condvar)> = Arc::default();
        state.0.lock().unwrap().next_update_id = 1000;
        for _ in 0..8 {
            let (server, state) = (server.clone(), state.clone());
            std::thread::spawn(move || {
                while let Ok(mut req) = server.recv() {
                    let mut raw = Vec::new();
                    let _ = std::io::Read::read_to_end(req.as_reader(), &mut raw);
                    if let Some(bytes) = file_download(&state, req.url()) {
                        let _ = req.respond(tiny_http::Response::from_data(bytes));
                        continue;
                    }
                    let ctype = req
                        .headers()
                        .iter()
                        .find(|h| h.field.equiv("Content-Type"))
                        .map(|h| h.value.to_string())
                        .unwrap_or_default();
                    if ctype.starts_with("multipart/form-data") {
                        let method = req.url().rsplit('/').next().unwrap_or_default().to_string();
                        state.0.lock().unwrap().uploads.push((method, ctype, raw.clone()));
                    }
                    let body = String::from_utf8_lossy(&raw).to_string();
                    let method = req.url().rsplit('/').next().unwrap_or_default().to_string();
                    let stall = {
                        let mut s = state.0.lock().unwrap();
                        s.arrived.push(method.clone());
                        s.stalls.get_mut(&method).and_then(|l| l.pop())
                    };
                    if let Some(d) = stall {
                        std::thread::sleep(d);
                    }
                    let (status, answer) = handle(&state, req.url(), &body);
                    let resp = tiny_http::Response::from_string(answer.to_string())
                        .with_status_code(status)
                        .with_header(tiny_http::Header::from_bytes("Content-Type", "application/json").unwrap());
                    let _ = req.respond(resp);
                }
            });
        }
        BotApi {
            base: format!("http://127.0.0.1:{port}"),
            state,
        }
    }

    pub fn add_bot(&self, token: &str, id: u64, username: &str) {
        self.state
            .0
            .lock()
            .unwrap()
            .bots
            .insert(token.to_string(), (id, username.to_string()));
    }

    /// Makes the bot a member of a chat (`private` chats are "started" by the user).
    pub fn add_chat(&self, bot_id: u64, chat: Value) {
        let id = chat["id"].as_i64().unwrap();
        self.state.0.lock().unwrap().chats.insert((bot_id, id), chat);
    }

    /// The bot was removed from (or blocked in) a chat.
    pub fn kick(&self, bot_id: u64, chat_id: i64) {
        self.state.0.lock().unwrap().kicked.push((bot_id, chat_id));
    }

    /// A user writes `text` in `chat_id`; `age` makes the message that much older.
    pub fn user_says(&self, bot_id: u64, chat_id: i64, text: &str, age: Duration) -> u64 {
        let (lock, cv) = &*self.state;
        let mut s = lock.lock().unwrap();
        s.next_update_id += 1;
        s.next_message_id += 1;
        let (update_id, message_id) = (s.next_update_id, s.next_message_id);
        let chat = s
            .chats
            .get(&(bot_id, chat_id))
            .cloned()
            .unwrap_or(json!({"id": chat_id, "type": "private"}));
        let date = (std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            - age)
            .as_secs();
        let update = json!({
            "update_id": update_id,
            "message": {
                "message_id": message_id,
                "from": {"id": 4242, "is_bot": false, "first_name": "Ada", "last_name": "Lovelace", "username": "ada"},
                "chat": chat,
                "date": date,
                "text": text,
            }
        });
        s.updates.entry(bot_id).or_default().push(update);
        cv.notify_all();
        update_id
    }

    /// A user sends a document with its file name and MIME type.
    pub fn user_sends_document(&self, bot_id: u64, chat_id: i64, bytes: &[u8], name: &str, mime: &str) -> u64 {
        let (lock, cv) = &*self.state;
        let mut s = lock.lock().unwrap();
        s.next_update_id += 1;
        s.next_message_id += 1;
        let (update_id, message_id) = (s.next_update_id, s.next_message_id);
        let file_id = format!("BQAD{message_id}");
        let path = format!("documents/file_{message_id}");
        s.files.insert(path.clone(), bytes.to_vec());
        s.file_ids.insert(file_id.clone(), path);
        let chat = s
            .chats
            .get(&(bot_id, chat_id))
            .cloned()
            .unwrap_or(json!({"id": chat_id, "type": "private"}));
        s.updates.entry(bot_id).or_default().push(json!({
            "update_id": update_id,
            "message": {
                "message_id": message_id,
                "from": {"id": 4242, "is_bot": false, "first_name": "Ada"},
                "chat": chat,
                "date": 1_800_000_000u64,
                "document": {"file_id": file_id, "file_unique_id": "d", "file_name": name, "mime_type": mime, "file_size": bytes.len()},
            }
        }));
        cv.notify_all();
        update_id
    }

    /// A user sends a photo (the bytes) with a caption.
    pub fn user_sends_photo(&self, bot_id: u64, chat_id: i64, bytes: &[u8], caption: &str) -> u64 {
        let (lock, cv) = &*self.state;
        let mut s = lock.lock().unwrap();
        s.next_update_id += 1;
        s.next_message_id += 1;
        let (update_id, message_id) = (s.next_update_id, s.next_message_id);
        let file_id = format!("AgAD{message_id}");
        let path = format!("photos/file_{message_id}.jpg");
        s.files.insert(path.clone(), bytes.to_vec());
        s.file_ids.insert(file_id.clone(), path);
        let chat = s
            .chats
            .get(&(bot_id, chat_id))
            .cloned()
            .unwrap_or(json!({"id": chat_id, "type": "private"}));
        let date = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        s.updates.entry(bot_id).or_default().push(json!({
            "update_id": update_id,
            "message": {
                "message_id": message_id,
                "from": {"id": 4242, "is_bot": false, "first_name": "Ada"},
                "chat": chat,
                "date": date,
                "caption": caption,
                "photo": [
                    {"file_id": format!("{file_id}s"), "file_unique_id": "s", "width": 90, "height": 90, "file_size": 10},
                    {"file_id": file_id, "file_unique_id": "l", "width": 800, "height": 600, "file_size": bytes.len()},
                ],
            }
        }));
        cv.notify_all();
        update_id
    }

    /// Multipart uploads received: (method, content type, raw body).
    pub fn uploads(&self) -> Vec<(String, String, Vec<u8>)> {
        self.state.0.lock().unwrap().uploads.clone()
    }

    /// The next `n` calls of `method` hang for `d` before they are answered, as a Bot API that
    /// accepted the connection and then stalled.
    pub fn stall(&self, method: &str, d: Duration, n: usize) {
        let mut s = self.state.0.lock().unwrap();
        s.stalls
            .entry(method.to_string())
            .or_default()
            .extend(std::iter::repeat_n(d, n));
    }

    /// From now on `getUpdates` answers every update it has, whatever `limit` asks for.
    pub fn ignore_limit(&self) {
        self.state.0.lock().unwrap().ignore_limit = true;
    }

    /// The next `n` calls of `method` fail with `code` (and `retry_after` seconds).
    pub fn fail(&self, method: &str, code: u16, retry_after: Option<u64>, n: usize) {
        let mut s = self.state.0.lock().unwrap();
        s.failures
            .entry(method.to_string())
            .or_default()
            .extend(std::iter::repeat_n((code, retry_after), n));
    }

    /// Parameters of every call of `method`.
    pub fn calls(&self, method: &str) -> Vec<Value> {
        let s = self.state.0.lock().unwrap();
        s.calls
            .iter()
            .filter(|(_, m, _)| m == method)
            .map(|(_, _, p)| p.clone())
            .collect()
    }

    pub fn max_concurrent_polls(&self, bot_id: u64) -> usize {
        self.state
            .0
            .lock()
            .unwrap()
            .polls_max
            .get(&bot_id)
            .copied()
            .unwrap_or(0)
    }

    /// The current text of a message a bot sent.
    pub fn text_of(&self, chat_id: i64, message_id: u64) -> Option<String> {
        self.state.0.lock().unwrap().texts.get(&(chat_id, message_id)).cloned()
    }

    /// Waits until `n` calls of `method` have arrived, answered or still stalled.
    pub fn wait_arrived(&self, method: &str, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let arrived = self
                .state
                .0
                .lock()
                .unwrap()
                .arrived
                .iter()
                .filter(|m| *m == method)
                .count();
            if arrived >= n {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until `method` has been called `n` times.
    pub fn wait_calls(&self, method: &str, n: usize, timeout: Duration) -> Vec<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let calls = self.calls(method);
            if calls.len() >= n || Instant::now() >= deadline {
                return calls;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// `GET /file/bot<token>/<file_path>`: the file bytes, for a known token.
fn file_download(state: &Arc<(Mutex<State>, Condvar)>, url: &str) -> Option<Vec<u8>> {
    let rest = url.strip_prefix("/file/bot")?;
    let (token, path) = rest.split_once('/')?;
    let s = state.0.lock().unwrap();
    s.bots.contains_key(token).then(|| s.files.get(path).cloned()).flatten()
}

fn error(code: u16, description: &str, retry_after: Option<u64>) -> (u16, Value) {
    let mut v = json!({"ok": false, "error_code": code, "description": description});
    if let Some(r) = retry_after {
        v["parameters"] = json!({"retry_after": r});
    }
    (code, v)
}

fn ok(result: Value) -> (u16, Value) {
    (200, json!({"ok": true, "result": result}))
}

fn handle(state: &Arc<(Mutex<State>, Condvar)>, url: &str, body: &str) -> (u16, Value) {
    let Some(rest) = url.strip_prefix("/bot") else {
        return error(404, "Not Found", None);
    };
    let Some((token, method)) = rest.split_once('/') else {
        return error(404, "Not Found", None);
    };
    let params: Value = serde_json::from_str(body).unwrap_or(json!({}));
    let (lock, cv) = &**state;
    let mut s = lock.lock().unwrap();
    let Some((bot_id, username)) = s.bots.get(token).cloned() else {
        return error(401, "Unauthorized", None);
    };
    s.calls.push((bot_id, method.to_string(), params.clone()));
    if let Some(list) = s.failures.get_mut(method) {
        if !list.is_empty() {
            let (code, retry) = list.remove(0);
            let desc = if code == 429 {
                "Too Many Requests: retry later"
            } else {
                "Bad Request: simulated failure"
            };
            return error(code, desc, retry);
        }
    }
    match method {
        "getMe" => ok(json!({"id": bot_id, "is_bot": true, "first_name": "imgate test", "username": username})),
        "getChat" => {
            let id = params["chat_id"]
                .as_i64()
                .or_else(|| params["chat_id"].as_str().and_then(|c| c.parse().ok()));
            if id.is_some_and(|id| s.kicked.contains(&(bot_id, id))) {
                return error(403, "Forbidden: bot was kicked from the group chat", None);
            }
            match id.and_then(|id| s.chats.get(&(bot_id, id)).cloned()) {
                Some(chat) => ok(chat),
                None => error(400, "Bad Request: chat not found", None),
            }
        }
        "getUpdates" => {
            let offset = params["offset"].as_u64().unwrap_or(0);
            let timeout = Duration::from_secs(params["timeout"].as_u64().unwrap_or(0).min(30));
            // An offset confirms every earlier update: Telegram forgets them.
            s.updates
                .entry(bot_id)
                .or_default()
                .retain(|u| u["update_id"].as_u64().unwrap() >= offset);
            *s.polls_now.entry(bot_id).or_default() += 1;
            let now = s.polls_now[&bot_id];
            let max = s.polls_max.entry(bot_id).or_default();
            *max = (*max).max(now);
            let deadline = Instant::now() + timeout;
            while s.updates.get(&bot_id).is_none_or(|u| u.is_empty()) && Instant::now() < deadline {
                let left = deadline.saturating_duration_since(Instant::now());
                s = cv.wait_timeout(s, left).unwrap().0;
            }
            *s.polls_now.get_mut(&bot_id).unwrap() -= 1;
            // `limit`: 1 to 100 updates, 100 when not given (the Bot API's documented bounds).
            let limit = match s.ignore_limit {
                true => usize::MAX,
                false => params["limit"].as_u64().unwrap_or(100).clamp(1, 100) as usize,
            };
            let updates = s.updates.get(&bot_id).map_or(&[][..], |u| &u[..u.len().min(limit)]);
            ok(Value::Array(updates.to_vec()))
        }
        "sendMessage" => {
            let chat_id = params["chat_id"].as_i64().unwrap_or(0);
            if !s.chats.contains_key(&(bot_id, chat_id)) {
                return error(400, "Bad Request: chat not found", None);
            }
            s.next_message_id += 1;
            let id = s.next_message_id;
            let text = params["text"].as_str().unwrap_or_default().to_string();
            s.texts.insert((chat_id, id), text);
            ok(json!({"message_id": id, "chat": {"id": chat_id}, "date": 1, "text": params["text"]}))
        }
        "editMessageText" => {
            let chat_id = params["chat_id"].as_i64().unwrap_or(0);
            let id = params["message_id"].as_u64().unwrap_or(0);
            let text = params["text"].as_str().unwrap_or_default().to_string();
            match s.texts.get_mut(&(chat_id, id)) {
                None => error(400, "Bad Request: message to edit not found", None),
                Some(old) if *old == text => error(
                    400,
                    "Bad Request: message is not modified: specified new message content and reply markup are exactly the same as a current content and reply markup of the message",
                    None,
                ),
                Some(old) => {
                    *old = text;
                    ok(json!({"message_id": id, "chat": {"id": chat_id}, "date": 1, "text": params["text"]}))
                }
            }
        }
        "sendChatAction" | "setWebhook" => ok(json!(true)),
        "getFile" => match params["file_id"].as_str().and_then(|id| s.file_ids.get(id).cloned()) {
            Some(path) => {
                let size = s.files.get(&path).map_or(0, Vec::len);
                ok(json!({"file_id": params["file_id"], "file_unique_id": "u", "file_size": size, "file_path": path}))
            }
            None => error(400, "Bad Request: invalid file_id", None),
        },
        "sendPhoto" | "sendDocument" => {
            s.next_message_id += 1;
            let id = s.next_message_id;
            ok(json!({"message_id": id, "chat": {"id": 0}, "date": 1}))
        }
        _ => error(404, "Not Found: method not found", None),
    }
}
