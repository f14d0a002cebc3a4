//! The QR login (`wechat_qr_login`) as iLink runs it: `get_bot_qrcode` gives a code to show and
//! an ID to poll; `get_qrcode_status` says how far the user got: `wait`, `scaned`,
//! `scaned_but_redirect` (go on polling at `redirect_host`), `expired`, `need_verifycode`
//! (a number to type, which a QR flow cannot take), `binded_redirect` (the bot is signed in
//! already) and `confirmed` with the bot's token. Each `auth.status` polls once, briefly, so
//! xAgent's poll is answered in time; the data plane's auth machine keeps the rest.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{lock, qr, safe_id, Account, Wechat, NAME};
use crate::json::{self, Object};
use crate::protocol::code;
use crate::providers::{AuthStep, Failure, Prompt, Stage};
use crate::source::Source;

/// iLink's `bot_type` of this kind of bot.
const BOT_TYPE: &str = "3";
/// How long a code is good for (iLink's own client gives it 5 minutes).
const CODE_TTL: Duration = Duration::from_secs(300);
/// One status poll waits at most this long (iLink holds the request while nothing happens).
const POLL_WAIT: Duration = Duration::from_secs(2);
/// How often xAgent is asked to poll.
const POLL_INTERVAL_MS: u64 = 2000;
/// Logins waiting at once at most (the oldest goes first).
const MAX_WAITING: usize = 16;

struct Waiting {
    /// iLink's ID of the code, polled.
    qrcode: String,
    /// Where to poll (changed by a redirect).
    base: String,
    started: Instant,
}

#[derive(Default)]
pub struct Logins {
    waiting: Mutex<HashMap<String, Waiting>>,
}

/// A code ID or host fit for a URL without escaping.
fn url_safe(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 256
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '~'))
}

/// A host name (and port) for a redirect: no path, no credentials, nothing to escape.
fn host_safe(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 255
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | ':'))
}

impl Logins {
    /// `auth.start`: a new code.
    pub fn start(&self, wx: &Wechat) -> Result<AuthStep, Failure> {
        let handle = crate::ids::token("wxl_");
        let (waiting, shown) = new_code(wx)?;
        let mut g = lock(&self.waiting);
        if g.len() >= MAX_WAITING {
            if let Some(oldest) = g.iter().min_by_key(|(_, w)| w.started).map(|(k, _)| k.clone()) {
                g.remove(&oldest);
            }
        }
        g.insert(handle.clone(), waiting);
        Ok(prompt(
            handle,
            Instant::now(),
            Stage::Pending,
            Some(&shown),
            "Scan the QR code with WeChat to sign in",
        ))
    }

    /// `auth.status`: one short poll, or a new code when asked to refresh.
    pub fn poll(&self, wx: &Wechat, handle: &str, refresh: bool) -> Result<AuthStep, Failure> {
        let (qrcode, base, started) = {
            let g = lock(&self.waiting);
            let w = g.get(handle).ok_or_else(|| {
                Failure::new(
                    code::AUTH_SESSION_NOT_FOUND,
                    "this sign-in is no longer known; start again",
                )
            })?;
            (w.qrcode.clone(), w.base.clone(), w.started)
        };
        if refresh {
            let (waiting, shown) = new_code(wx)?;
            lock(&self.waiting).insert(handle.to_string(), waiting);
            return Ok(prompt(
                handle.into(),
                Instant::now(),
                Stage::Pending,
                Some(&shown),
                "Scan the new QR code with WeChat",
            ));
        }
        // A code past CODE_TTL is never polled: its prompt's `expires_at` ends the login first.
        let path = format!("ilink/bot/get_qrcode_status?qrcode={qrcode}");
        let status = match wx.api.get(&base, &path, POLL_WAIT) {
            Ok(o) => o,
            // iLink holds the poll while nothing happens: no answer yet is still waiting.
            Err(e) if e.status == 0 => {
                return Ok(prompt(
                    handle.into(),
                    started,
                    Stage::Pending,
                    None,
                    "Waiting for the scan",
                ))
            }
            Err(e) => return Err(Failure::api(&e)),
        };
        let step = self.step(wx, handle, started, &status);
        if !matches!(step, Ok(AuthStep::Waiting(_))) {
            lock(&self.waiting).remove(handle);
        }
        step
    }

    /// `auth.cancel` (or the login expired): forget it.
    pub fn cancel(&self, handle: &str) {
        lock(&self.waiting).remove(handle);
    }

    /// What one status answer means.
    fn step(&self, wx: &Wechat, handle: &str, started: Instant, o: &Object) -> Result<AuthStep, Failure> {
        let waiting = |stage, message: &str| Ok(prompt(handle.into(), started, stage, None, message));
        match json::get_str(o, "status").unwrap_or("wait") {
            "wait" => waiting(Stage::Pending, "Waiting for the scan"),
            "scaned" => waiting(Stage::Scanned, "Scanned: confirm the sign-in in WeChat on the phone"),
            "scaned_but_redirect" => {
                match json::get_str(o, "redirect_host").filter(|h| host_safe(h)) {
                    Some(host) => {
                        if let Some(w) = lock(&self.waiting).get_mut(handle) {
                            // Same scheme as before (https, but for a local test server).
                            let scheme = w.base.split_once("://").map_or("https", |(s, _)| s);
                            w.base = format!("{scheme}://{host}");
                        }
                    }
                    None => log::debug!("wechat: a login redirect named no usable host; polling on"),
                }
                waiting(Stage::Scanned, "Scanned: confirm the sign-in in WeChat on the phone")
            }
            "expired" => waiting(Stage::RefreshRequired, "The QR code expired; ask for a new one"),
            "need_verifycode" | "verify_code_blocked" => Err(Failure::new(
                code::INVALID_ARGUMENTS,
                "WeChat asks for a verification code for this sign-in, which a QR sign-in cannot take; sign in from WeChat's own client once, then try again",
            )),
            "binded_redirect" => {
                // Signed in already: the stored token is reused if this device has it.
                let bot = json::get_str(o, "ilink_bot_id").filter(|b| safe_id(b));
                match bot.filter(|b| wx.account(b).is_some()) {
                    Some(bot) => Ok(AuthStep::Bound(Source::new(NAME, bot))),
                    None => Err(Failure::new(
                        code::INVALID_ARGUMENTS,
                        "this WeChat bot is signed in elsewhere; sign it out there first",
                    )),
                }
            }
            "confirmed" => confirmed(wx, o),
            other => {
                log::debug!("wechat: login status `{}` is not known; polling on", crate::quiet::shown(other));
                waiting(Stage::Pending, "Waiting for the scan")
            }
        }
    }
}

/// The user confirmed: the token is stored and the channel binds to the bot.
fn confirmed(wx: &Wechat, o: &Object) -> Result<AuthStep, Failure> {
    let field = |k: &str| json::get_str(o, k).filter(|v| !v.is_empty() && v.len() <= 4096);
    let (Some(bot), Some(token)) = (field("ilink_bot_id"), field("bot_token")) else {
        return Err(Failure::new(
            code::UPSTREAM_REJECTED,
            "WeChat confirmed the sign-in but sent no bot ID or token",
        ));
    };
    if !safe_id(bot) {
        return Err(Failure::new(
            code::UPSTREAM_REJECTED,
            "WeChat sent a bot ID imgate cannot use",
        ));
    }
    let baseurl = field("baseurl")
        .filter(|u| u.starts_with("https://") || u.starts_with("http://"))
        .unwrap_or_default();
    let account = Account {
        bot_token: token.to_string(),
        baseurl: baseurl.to_string(),
        user_id: field("ilink_user_id").unwrap_or_default().to_string(),
    };
    wx.token_files()
        .store(bot, &miniserde::json::to_string(&account))
        .map_err(|e| Failure::new(code::TOOL_INVOKE_FAILED, format!("cannot store the sign-in: {e}")))?;
    // A new sign-in recovers a bot whose login WeChat had ended.
    let ended = super::ended_key(bot);
    if let Err(e) = wx.host.db.write(|txn| crate::store::set_meta(txn, &ended, None)) {
        log::error!("wechat: cannot clear the ended sign-in of bot {bot}: {e}");
    }
    log::info!("wechat: bot {bot} signed in");
    Ok(AuthStep::Bound(Source::new(NAME, bot)))
}

/// Asks iLink for a new code; the login to poll and the text the code shows.
fn new_code(wx: &Wechat) -> Result<(Waiting, String), Failure> {
    let path = format!("ilink/bot/get_bot_qrcode?bot_type={BOT_TYPE}");
    let o = wx
        .api
        .get(&wx.settings.api_base, &path, Duration::from_secs(10))
        .map_err(|e| Failure::api(&e))?;
    let qrcode = json::get_str(&o, "qrcode").filter(|q| url_safe(q));
    let shown = json::get_str(&o, "qrcode_img_content").filter(|c| !c.is_empty() && c.len() <= qr::MAX_TEXT);
    let (Some(qrcode), Some(shown)) = (qrcode, shown) else {
        return Err(Failure::temporary(
            code::UPSTREAM_REJECTED,
            "WeChat answered the QR code request without a usable code",
        ));
    };
    let waiting = Waiting {
        qrcode: qrcode.to_string(),
        base: wx.settings.api_base.clone(),
        started: Instant::now(),
    };
    Ok((waiting, shown.to_string()))
}

/// A waiting step of a code shown since `started`; `shown` is the code's text when it is new
/// (drawn here).
fn prompt(login: String, started: Instant, stage: Stage, shown: Option<&str>, message: &str) -> AuthStep {
    let left = CODE_TTL.saturating_sub(started.elapsed());
    let expires_at = crate::ids::now_ms() + left.as_millis() as u64;
    AuthStep::Waiting(Prompt {
        login,
        stage,
        qr_code_text: shown.map(str::to_string),
        qr_code_image: shown.and_then(qr::data_url),
        expires_at: (stage != Stage::RefreshRequired).then_some(expires_at),
        poll_interval_millis: Some(POLL_INTERVAL_MS),
        message: message.into(),
    })
}
