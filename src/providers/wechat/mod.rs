//! WeChat through the iLink bot API: a user signs in by scanning a QR code in xAgent
//! (`wechat_qr_login`), and from then on talks to their WeChat bot; the agent answers in the
//! same chat. Everything runs outbound from the device (long polls), so no public URL is needed.
//!
//! Source key: the bot's `ilink_bot_id` (one login is one bot for one WeChat user). The bot
//! token, the login's `baseurl` and the user's ID are kept only in
//! `state_dir/wechat/{ilink_bot_id}.token` (mode 0600), never in the database, a packet or a
//! log line. Receiving (`link`) moves iLink's sync buffer in the outbox transaction of the
//! batch's last message, with the user's latest context token, which every send needs.
//!
//! Media go through the CDN encrypted (`cdn`): a message's first image, file, video or voice is
//! fetched and decrypted into the file cache before the message is stored; the file tool
//! encrypts, uploads and sends. Not yet: typing.

mod api;
pub mod cdn;
mod link;
mod login;
pub mod qr;
pub mod update;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use md5::Digest;

use miniserde::{Deserialize, Serialize};

use self::api::Api;
use super::inbound::FileItem;
use super::keyfiles::KeyFiles;
use super::link::Links;
use super::{
    split_text, with_retry, AuthStep, Declaration, Description, Failure, Flow, Host, Outbound, Provider, Registration,
};
use crate::config::{Config, Fields, Problems, Section, Settings};
use crate::files::FileRecord;
use crate::ids;
use crate::json::{self, arr, obj, s, Object, Value};
use crate::metrics::Counter;
use crate::protocol::code;
use crate::protocol::{TOOL_FILE_SEND, TOOL_REPLY, TOOL_SEND};
use crate::source::Source;
use crate::store::{self, StoreError};

const NAME: &str = "wechat";
const FLOW_ID: &str = "wechat_qr_login";
const TOOLS: &[&str] = &[TOOL_SEND, TOOL_REPLY, TOOL_FILE_SEND];
/// A text message is split at this many characters.
const MAX_TEXT: usize = 2000;
/// A tool call retries server errors for at most this long.
const TOOL_DEADLINE: Duration = Duration::from_secs(20);
/// A message's file is fetched for at most this long before the message goes on with a note.
const FETCH_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes of a file's start kept to tell its type (`cdn::mime_of`).
const SNIFFED: usize = 8;
/// iLink's `media_type` of an upload.
const UPLOAD_IMAGE: u64 = 1;
const UPLOAD_VIDEO: u64 = 2;
const UPLOAD_FILE: u64 = 3;

pub const REGISTRATION: Registration = Registration::new(NAME, &[], read, start);

/// `[wechat]`.
#[derive(Clone)]
pub struct WechatSettings {
    pub api_base: String,
    /// `api_base` was set in the file: every call goes there, not to a login's `baseurl`.
    pub api_base_fixed: bool,
    pub cdn_base: String,
}

impl Settings for WechatSettings {
    fn summary(&self) -> String {
        format!(
            "wechat:            api_base {}, cdn_base {}\n",
            self.api_base, self.cdn_base
        )
    }
}

fn read(_cfg: &Config, sections: &[&Section], p: &mut Problems) -> Option<Arc<dyn Settings>> {
    let section = sections.first()?;
    let mut f = Fields::new(section, p, &[]);
    let given = f.url("api_base");
    let settings = WechatSettings {
        api_base_fixed: given.is_some(),
        api_base: given.unwrap_or_else(|| "https://ilinkai.weixin.qq.com".into()),
        cdn_base: f
            .url("cdn_base")
            .unwrap_or_else(|| "https://novac2c.cdn.weixin.qq.com/c2c".into()),
    };
    f.finish();
    Some(Arc::new(settings))
}

fn start(host: &Arc<Host>) -> Result<Option<Arc<dyn Provider>>, StoreError> {
    let Some(settings) = host.config.provider::<WechatSettings>(NAME).cloned() else {
        return Ok(None);
    };
    Ok(Some(Arc::new_cyclic(|me| Wechat {
        me: me.clone(),
        host: host.clone(),
        settings,
        api: Api::default(),
        logins: login::Logins::default(),
        pollers: Links::new("wechat: bot", "receiver"),
        unbound_messages: Counter::new(
            "imgate_wechat_unbound_messages_total",
            "Messages of users no channel is bound to.",
        ),
    })))
}

/// A bot ID fit for a file name and a source key: `…@im.bot`.
pub fn safe_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '@' | '.' | '_' | '-'))
}

/// What a login left: the bot's token and where to call, and the user it talks to. Kept in its
/// 0600 file, never in the database.
#[derive(Serialize, Deserialize, Clone)]
struct Account {
    bot_token: String,
    baseurl: String,
    user_id: String,
}

pub struct Wechat {
    me: Weak<Wechat>,
    host: Arc<Host>,
    settings: WechatSettings,
    api: Api,
    logins: login::Logins,
    pollers: Links,
    unbound_messages: Counter,
}

fn buf_key(bot: &str) -> String {
    format!("wechat_buf:{bot}")
}

fn context_key(bot: &str) -> String {
    format!("wechat_context:{bot}")
}

/// Set when WeChat ended the bot's login (session timeout): the time, in Unix ms.
fn ended_key(bot: &str) -> String {
    format!("wechat_ended:{bot}")
}

impl Wechat {
    fn token_files(&self) -> KeyFiles {
        KeyFiles::new(self.host.config.server.state_dir.join("wechat"), "", ".token")
    }

    fn account(&self, bot: &str) -> Option<Account> {
        let text = self.token_files().read(bot)?;
        miniserde::json::from_str(&text).ok()
    }

    /// Where the bot's calls go: the login's `baseurl`, unless `api_base` is set in the file.
    fn base_of(&self, account: &Account) -> String {
        match self.settings.api_base_fixed || account.baseurl.is_empty() {
            true => self.settings.api_base.clone(),
            false => account.baseurl.clone(),
        }
    }

    /// A `meta` value; the sync buffer and context tokens are the outbox's cursors.
    fn meta(&self, key: &str) -> Result<Option<String>, StoreError> {
        self.host.outbox.cursor(key)
    }

    /// The bot's login ended at WeChat: remembered, so the Descriptor and tools say so.
    fn login_ended(&self, bot: &str) {
        log::warn!("wechat: bot {bot}: WeChat ended its sign-in (session timeout); sign in again with a QR code");
        // Its receiver stops; a new sign-in starts another.
        self.pollers.forget(bot);
        let now = ids::now_ms().to_string();
        if let Err(e) = self
            .host
            .db
            .write(|txn| store::set_meta(txn, &ended_key(bot), Some(&now)))
        {
            log::error!("wechat: cannot record that bot {bot}'s sign-in ended: {e}");
        }
        self.host.binding_state_changed(&Source::new(NAME, bot));
    }

    /// The binding's account and whether WeChat still takes it, or the tool error that says why not.
    fn route(&self, source: &Source) -> Result<(String, Account), Failure> {
        let bot = source.key();
        if self.meta(&ended_key(bot)).map_err(Failure::storage)?.is_some() {
            return Err(Failure::new(
                code::CONNECTION_NOT_AUTHENTICATED,
                "WeChat ended this sign-in; sign in again with a QR code on this channel",
            ));
        }
        let account = self.account(bot).ok_or_else(|| {
            Failure::new(
                code::CONNECTION_NOT_AUTHENTICATED,
                "the WeChat sign-in of this channel is gone; sign in again with a QR code",
            )
        })?;
        Ok((bot.to_string(), account))
    }

    /// A message's file: fetched from the CDN, decrypted as it arrives, into the file cache.
    fn fetch_media(&self, source: &Source, m: &cdn::MediaRef) -> Result<FileItem, String> {
        let url = cdn::download_url(&self.settings.cdn_base, m).ok_or("it names no place to fetch it from")?;
        let key = match m.key.as_deref() {
            Some(k) => Some(cdn::key_of(k).ok_or("its key cannot be read")?),
            None => None,
        };
        let files = &self.host.files;
        let mut part = files.begin(source.as_str(), "in").map_err(|e| e.to_string())?;
        // The first bytes, for the type of an image.
        let mut head = Vec::new();
        let mut to_part = |plain: &[u8]| {
            let more = plain.len().min(SNIFFED.saturating_sub(head.len()));
            head.extend_from_slice(&plain[..more]);
            part.write(plain)
        };
        match key {
            Some(key) => {
                let mut decrypting = cdn::Decrypting::new(&key);
                cdn::download(self.api.http(), &url, FETCH_TIMEOUT, |c| {
                    decrypting.push(c, &mut to_part)
                })?;
                decrypting.finish(&mut to_part)?;
            }
            None => cdn::download(self.api.http(), &url, FETCH_TIMEOUT, &mut to_part)?,
        }
        let name = m.file_name.clone().unwrap_or_else(|| {
            match m.kind {
                "image" => "image.jpg",
                "video" => "video.mp4",
                "audio" => "voice.silk",
                _ => "file",
            }
            .into()
        });
        let mime = cdn::mime_of(m.kind, &name, &head);
        let (file_ref, rec) = files.commit(part, &name, mime).map_err(|e| e.to_string())?;
        Ok(FileItem::cached(file_ref, rec))
    }

    /// Encrypts and uploads a file for the user; the message item that shows it.
    fn upload(&self, account: &Account, file: &(FileRecord, PathBuf)) -> Result<Value, Failure> {
        let (rec, path) = file;
        let plain = std::fs::read(path)
            .map_err(|e| Failure::new(code::FILE_REF_INVALID, format!("the file cannot be read: {e}")))?;
        let key_hex = ids::random_hex(16);
        let key = cdn::key_of(&key_hex).ok_or_else(|| Failure::new(code::TOOL_INVOKE_FAILED, "no key"))?;
        let cipher = cdn::encrypt(&plain, &key);
        let media_type = match rec.mime_type.split('/').next() {
            Some("image") => UPLOAD_IMAGE,
            Some("video") => UPLOAD_VIDEO,
            _ => UPLOAD_FILE,
        };
        let filekey = ids::random_hex(16);
        let md5 = ids::hex(&md5::Md5::digest(&plain));
        let ask = object(obj([
            ("filekey", s(&filekey)),
            ("media_type", json::n(media_type)),
            ("to_user_id", s(&account.user_id)),
            ("rawsize", json::n(plain.len() as u64)),
            ("rawfilemd5", s(md5)),
            ("filesize", json::n(cipher.len() as u64)),
            ("no_need_thumb", json::b(true)),
            ("aeskey", s(&key_hex)),
        ]));
        let base = self.base_of(account);
        let deadline = Instant::now() + TOOL_DEADLINE;
        let answer = with_retry("wechat: getuploadurl", deadline, |left| {
            self.api
                .post(&base, "ilink/bot/getuploadurl", &account.bot_token, ask.clone(), left)
        })
        .map_err(|e| Failure::api(&e))?;
        let cdn_base = self.settings.cdn_base.trim_end_matches('/');
        let url = match (
            json::get_str(&answer, "upload_full_url"),
            json::get_str(&answer, "upload_param"),
        ) {
            (Some(full), _) if full.starts_with(cdn_base) => full.to_string(),
            (_, Some(param)) if !param.is_empty() => format!(
                "{cdn_base}/upload?encrypted_query_param={}&filekey={filekey}",
                crate::upstream::query_value(param)
            ),
            _ => {
                return Err(Failure::new(
                    code::UPSTREAM_REJECTED,
                    "WeChat gave no place to upload the file",
                ))
            }
        };
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(1));
        let param = cdn::upload(self.api.http(), &url, &cipher, left)
            .map_err(|why| Failure::temporary(code::UPSTREAM_UNREACHABLE, why))?;
        let media = obj([
            ("encrypt_query_param", s(param)),
            ("aes_key", s(ids::base64(key_hex.as_bytes()))),
            ("encrypt_type", json::n(1)),
        ]);
        let size = json::n(cipher.len() as u64);
        Ok(match media_type {
            UPLOAD_IMAGE => obj([
                ("type", json::n(2)),
                ("image_item", obj([("media", media), ("mid_size", size)])),
            ]),
            UPLOAD_VIDEO => obj([
                ("type", json::n(5)),
                ("video_item", obj([("media", media), ("video_size", size)])),
            ]),
            _ => obj([
                ("type", json::n(4)),
                (
                    "file_item",
                    obj([
                        ("media", media),
                        ("file_name", s(&rec.filename)),
                        ("len", s(plain.len().to_string())),
                    ]),
                ),
            ]),
        })
    }

    /// Sends one text in the user's context.
    fn send_text(&self, bot: &str, account: &Account, text: &str, client_id: &str) -> Result<(), Failure> {
        let item = obj([("type", json::n(1)), ("text_item", obj([("text", s(text))]))]);
        self.send_item(bot, account, item, client_id)
    }

    /// Sends one item in the user's context; `client_id` names it to WeChat.
    fn send_item(&self, bot: &str, account: &Account, item: Value, client_id: &str) -> Result<(), Failure> {
        let context = self.meta(&context_key(bot)).map_err(Failure::storage)?;
        let mut msg = vec![
            ("from_user_id", s("")),
            ("to_user_id", s(&account.user_id)),
            ("client_id", s(client_id)),
            ("message_type", json::n(2)),
            ("message_state", json::n(2)),
            ("item_list", arr([item])),
        ];
        if let Some(c) = &context {
            msg.push(("context_token", s(c)));
        }
        let body = object(obj([("msg", obj(msg))]));
        let base = self.base_of(account);
        let deadline = Instant::now() + TOOL_DEADLINE;
        let sent = with_retry("wechat: sendmessage", deadline, |left| {
            self.api
                .post(&base, "ilink/bot/sendmessage", &account.bot_token, body.clone(), left)
        });
        match sent {
            Ok(_) => Ok(()),
            Err(e) if api::session_ended(&e) => {
                self.login_ended(bot);
                Err(Failure::new(
                    code::CONNECTION_NOT_AUTHENTICATED,
                    "WeChat ended this sign-in; sign in again with a QR code on this channel",
                ))
            }
            Err(e) if e.status == 200 => Err(Failure::new(
                code::UPSTREAM_REJECTED,
                format!(
                    "WeChat did not deliver the message (code {}): a bot may only answer for a while after the user's last message, so the user has to write to the bot again first",
                    e.code
                ),
            )),
            Err(e) => Err(Failure::api(&e)),
        }
    }

    /// The bots with a binding and a token, for the receivers.
    fn bound_bots(&self, bound: &[Source]) -> Vec<String> {
        let mut bots: Vec<String> = bound
            .iter()
            .filter(|s| s.provider() == NAME && safe_id(s.key()))
            .map(|s| s.key().to_string())
            .collect();
        bots.sort();
        bots.dedup();
        bots
    }
}

fn object(v: Value) -> Object {
    match v {
        Value::Object(o) => o,
        _ => Object::new(),
    }
}

/// A client ID for WeChat from the tool call's idempotency key: a retried call sends the same.
fn client_id(idempotency_key: &str, part: usize) -> String {
    format!("imgate-{}", super::send_id(idempotency_key, part, 12))
}

const DECLARATION: Declaration = Declaration {
    name: NAME,
    label: "WeChat",
    description: "Your WeChat bot, signed in by scanning a QR code.",
    flows: &[FLOW],
    tools: TOOLS,
};

const FLOW: Flow = Flow {
    id: FLOW_ID,
    kind: "qr_login",
    title: "Sign in to WeChat with a QR code",
    description: "Scan the code with WeChat on your phone and confirm: this channel then talks to your WeChat bot.",
    fields: &[],
};

impl Provider for Wechat {
    fn declaration(&self) -> &'static Declaration {
        &DECLARATION
    }

    fn auth_start(&self, _flow_id: &str, _input: &Object) -> Result<AuthStep, Failure> {
        self.logins.start(self)
    }

    fn auth_poll(&self, _flow_id: &str, login: &str, refresh: bool) -> Result<AuthStep, Failure> {
        self.logins.poll(self, login, refresh)
    }

    fn auth_cancel(&self, _flow_id: &str, login: &str) {
        self.logins.cancel(login);
    }

    fn logout(&self, source: &Source) {
        let bot = source.key();
        if safe_id(bot) {
            let _ = std::fs::remove_file(self.token_files().path(bot));
            log::info!("wechat: bot {bot} signed out; its token is forgotten");
        }
    }

    fn describe(&self, source: &Source) -> Result<Description, StoreError> {
        let bot = source.key();
        let ended = self.meta(&ended_key(bot))?.is_some();
        let account = self.account(bot);
        let hint = account.as_ref().map(|a| crate::providers::inbound::redact(&a.user_id));
        let name = format!("WeChat ({bot})");
        let why = match (ended, &account) {
            (true, _) => Some("WeChat ended this sign-in; sign in again with a QR code"),
            (false, None) => Some("the sign-in is gone; sign in again with a QR code"),
            (false, Some(_)) => None,
        };
        Ok(match why {
            None => DECLARATION.connected(name, hint),
            Some(why) => DECLARATION.unusable("expired", name, hint, why),
        })
    }

    fn send(&self, source: &Source, out: &Outbound) -> Result<String, Failure> {
        let (bot, account) = self.route(source)?;
        // The text (a file's caption) first, each file after it as a message of its own.
        let parts = match out.text.is_empty() && !out.files.is_empty() {
            true => Vec::new(),
            false => split_text(out.text, MAX_TEXT),
        };
        let mut last = String::new();
        for (i, part) in parts.iter().enumerate() {
            last = client_id(out.idempotency_key, i);
            self.send_text(&bot, &account, part, &last)?;
        }
        for (i, file) in out.files.iter().enumerate() {
            let item = self.upload(&account, file)?;
            last = client_id(out.idempotency_key, parts.len() + i);
            self.send_item(&bot, &account, item, &last)?;
        }
        Ok(last)
    }

    fn bindings_changed(&self, bound: &[Source]) {
        let bots = self.bound_bots(bound);
        let receiving: Vec<String> = bots
            .iter()
            .filter(|b| self.account(b).is_some() && !matches!(self.meta(&ended_key(b)), Ok(Some(_))))
            .cloned()
            .collect();
        self.pollers.sync(&receiving, |line| link::start(&self.me, line));
        self.token_files().forget_unused(&bots, "wechat: token of bot");
    }

    fn metrics(&self, out: &mut String) {
        crate::metrics::singles(
            out,
            &[(
                "imgate_wechat_receivers",
                "gauge",
                "WeChat bots received from, one per bound sign-in.",
                self.pollers.count() as u64,
            )],
        );
        crate::metrics::counters(out, &[&self.unbound_messages]);
    }

    fn stop(&self) {
        self.pollers.stop_all();
    }
}

/// Shared by `login` and `poll`: a lock that a panic elsewhere does not poison.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
