//! Matrix: an account (a bot user) on any homeserver, in rooms it has joined. Messages come
//! from one `/sync` long poll per account (`link`), so imgate needs no public URL; the tools
//! send through the client-server API (`api`).
//!
//! Source key: `{account}:{room_id}`, the account being 16 hex digits of SHA-256(homeserver,
//! user ID). A binding stores what it knows of the room in its own table (`matrix_rooms`); the
//! access token is kept in `state_dir/matrix/{account}.token` (mode 0600), never in the
//! database, a packet or a log line, and forgotten with the account's last binding.
//!
//! Encrypted rooms need Olm/Megolm and device verification: not supported, refused at binding.
//! Notices (`m.notice`, what bots send) are not pushed: the spec asks that no bot answers one.

pub mod api;
pub mod event;
pub mod link;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use miniserde::{Deserialize, Serialize};

use self::api::{seg, Account, Api, ApiError, PLATFORM};
use self::event::{valid_id, Event, Media, Message};
use super::bindings::Rows;
use super::inbound::{self, FileItem, Inbound};
use super::intake::Recent;
use super::keyfiles::KeyFiles;
use super::link::Links;
use super::{
    send_id, served_mime, split_text, with_retry, Activity, Declaration, Description, Failure, Field, Flow, Host,
    Outbound, Provider, Registration, Upload,
};
use crate::config::{Config, Fields, Problems, Section, Settings};
use crate::json::{self, obj, s, Object, Value};
use crate::metrics::Counter;
use crate::protocol::code;
use crate::protocol::{TOOL_FILE_SEND, TOOL_REPLY, TOOL_SEND};
use crate::quiet::{shown, Site};
use crate::source::Source;
use crate::store::StoreError;
use crate::upstream::Kind;

const NAME: &str = "matrix";
/// source → `RoomInfo`.
const ROOMS: Rows = Rows::new(NAME, "matrix_rooms", "matrix room");
const FLOW_ID: &str = "matrix_room_binding";
const TOOLS: &[&str] = &[TOOL_SEND, TOOL_REPLY, TOOL_FILE_SEND];
/// A text is split at this many characters: an event is at most 65,536 bytes, which 8,000
/// characters stay below even with every one escaped as `\uXXXX`.
const MAX_TEXT: usize = 8_000;
/// A tool call retries rate limits and server errors for at most this long.
const TOOL_DEADLINE: Duration = Duration::from_secs(20);
/// A message's file is fetched for at most this long before the message goes on with a note.
const FETCH_DEADLINE: Duration = Duration::from_secs(30);
/// A typing notice the homeserver does not take within this is dropped.
const TYPING_DEADLINE: Duration = Duration::from_secs(5);
/// How long the homeserver shows "typing" after a delivery (v1), and while the agent is busy
/// (v2, renewed at most every `TYPING_EVERY`): it ends by itself if `idle` is lost.
const TYPING_AFTER_DELIVERY_MS: u64 = 30_000;
const TYPING_BUSY_MS: u64 = 60_000;
const TYPING_EVERY: Duration = Duration::from_secs(20);
/// Display names remembered (room, user); the cache starts over when full.
const NAMES: usize = 512;
/// Recently stored events remembered: a message read again is not fetched again.
const RECENT: usize = 256;
/// Rooms one account may have bound: each is read back after a start.
const MAX_ROOMS: usize = 100;

pub const REGISTRATION: Registration = Registration::new(NAME, &[], read, start);

/// `[matrix]`: no keys; each binding names its homeserver.
#[derive(Clone)]
pub struct MatrixSettings;

impl Settings for MatrixSettings {
    fn summary(&self) -> String {
        "matrix:            on (each binding names its homeserver)\n".into()
    }
}

fn read(_cfg: &Config, sections: &[&Section], p: &mut Problems) -> Option<Arc<dyn Settings>> {
    let section = sections.first()?;
    Fields::new(section, p, &[]).finish();
    Some(Arc::new(MatrixSettings))
}

fn start(host: &Arc<Host>) -> Result<Option<Arc<dyn Provider>>, StoreError> {
    if host.config.provider::<MatrixSettings>(NAME).is_none() {
        return Ok(None);
    }
    ROOMS.create(&host.db)?;
    Ok(Some(Arc::new_cyclic(|me| Matrix {
        me: me.clone(),
        host: host.clone(),
        api: Api::new(FETCH_DEADLINE),
        syncers: Links::new("matrix: account", "sync loop"),
        bound: Mutex::default(),
        names: Mutex::default(),
        members: Mutex::default(),
        typing: Mutex::default(),
        recent: Recent::new(RECENT),
        newest: Mutex::default(),
        counts: Counts::default(),
        history_log: Site::new(),
        gap_log: Site::new(),
    })))
}

/// What a binding knows about its account and room.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct RoomInfo {
    pub account: String,
    pub homeserver: String,
    pub user_id: String,
    pub room_id: String,
    /// The room's name (or alias), or empty.
    pub name: String,
    /// Joined members at binding, then as syncs tell: two is a one-to-one chat.
    pub members: u64,
    /// Unix ms: nothing sent before it is stored.
    pub bound_at: u64,
    /// The homeserver said the token is gone (`M_UNKNOWN_TOKEN`): expired until bound again.
    pub revoked: bool,
    /// The room turned on end-to-end encryption after it was bound: its messages can no longer
    /// be read, and nothing is sent in the clear into it.
    pub encrypted: bool,
}

impl RoomInfo {
    fn usable(&self) -> bool {
        !self.revoked && !self.encrypted
    }
}

/// An account as its sync loop and its sends use it.
pub struct AccountState {
    pub id: String,
    pub homeserver: String,
    pub user_id: String,
    token: String,
    pub rooms: Vec<(Source, RoomInfo)>,
}

impl AccountState {
    pub fn account(&self) -> Account<'_> {
        Account {
            homeserver: &self.homeserver,
            token: &self.token,
        }
    }

    fn room(&self, room_id: &str) -> Option<(&Source, &RoomInfo)> {
        self.rooms
            .iter()
            .find(|(_, i)| i.room_id == room_id)
            .map(|(s, i)| (s, i))
    }
}

/// Counters for `/metrics`.
struct Counts {
    gap_unread: Counter,
    tokens_revoked: Counter,
}

impl Default for Counts {
    fn default() -> Counts {
        Counts {
            gap_unread: Counter::new(
                "imgate_matrix_gaps_unread_total",
                "Gaps longer than what is read back after an outage (older messages not fetched).",
            ),
            tokens_revoked: Counter::new(
                "imgate_matrix_tokens_revoked_total",
                "Access tokens the homeserver stopped accepting.",
            ),
        }
    }
}

pub struct Matrix {
    me: Weak<Matrix>,
    host: Arc<Host>,
    api: Api,
    syncers: Links,
    /// The bound rooms, as `bindings_changed` last said.
    bound: Mutex<Vec<(Source, RoomInfo)>>,
    /// `room\0user` → display name.
    names: Mutex<HashMap<String, String>>,
    /// room → joined members, as syncs tell.
    members: Mutex<HashMap<String, u64>>,
    /// room → when "typing" was last asked for while busy.
    typing: Mutex<HashMap<String, Instant>>,
    recent: Recent,
    /// source → the newest event of its room the last answer had: handled, as all before it.
    newest: Mutex<HashMap<String, String>>,
    counts: Counts,
    history_log: Site,
    gap_log: Site,
}

/// `account` of a user on a homeserver: 16 hex digits, safe as a key and a file name.
fn account_of(homeserver: &str, user_id: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, format!("{homeserver}\n{user_id}").as_bytes());
    crate::ids::hex(&digest.as_ref()[..8])
}

/// The homeserver's base URL as given in the form: `https://host[:port]`, or `http://` to a
/// loopback address only (a token must not cross a network in the clear).
fn homeserver_of(given: &str) -> Result<String, Failure> {
    let url = given.trim().trim_end_matches('/');
    let invalid = |why: &str| Failure::new(code::INVALID_ARGUMENTS, format!("homeserver: {why}"));
    let lower = url.to_ascii_lowercase();
    let (scheme, rest) = lower
        .split_once("://")
        .ok_or_else(|| invalid("a URL like https://matrix.example.org"))?;
    let authority = rest.split('/').next().unwrap_or_default();
    if authority.is_empty() || url.len() > 255 || url.bytes().any(|b| !b.is_ascii_graphic() || b"?#@\\".contains(&b)) {
        return Err(invalid("a URL like https://matrix.example.org"));
    }
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => authority.split(':').next().unwrap_or_default(),
    };
    let loopback = host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    match scheme {
        "https" => Ok(url.to_string()),
        "http" if loopback => Ok(url.to_string()),
        "http" => Err(invalid("https:// is required (http:// only to this machine)")),
        _ => Err(invalid("https:// is required")),
    }
}

impl Matrix {
    fn token_files(&self) -> KeyFiles {
        KeyFiles::new(self.host.config.server.state_dir.join("matrix"), "", ".token")
    }

    fn bound_rooms(&self) -> Vec<(Source, RoomInfo)> {
        self.bound.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The account's token and its bound rooms; `None` when it has no usable binding left.
    fn account_state(&self, account: &str) -> Option<AccountState> {
        let rooms: Vec<(Source, RoomInfo)> = self
            .bound_rooms()
            .into_iter()
            .filter(|(_, i)| i.account == account && i.usable())
            .collect();
        let first = rooms.first()?.1.clone();
        Some(AccountState {
            id: account.to_string(),
            token: self.token_files().read(account)?,
            homeserver: first.homeserver,
            user_id: first.user_id,
            rooms,
        })
    }

    fn stored_since(&self, account: &str) -> Option<String> {
        self.host.outbox.cursor(&link::since_key(account)).unwrap_or_else(|e| {
            log::debug!("matrix: cannot read the sync cursor: {e}");
            None
        })
    }

    fn save_since(&self, account: &str, next: &str) {
        let moved = self
            .host
            .outbox
            .move_cursors(&[crate::outbox::Cursor::Set(link::since_key(account), next.to_string())]);
        if let Err(e) = moved {
            log::debug!("matrix: cannot store the sync cursor: {e}");
        }
    }

    fn last_stored(&self, source: &Source) -> Option<String> {
        self.host.outbox.cursor(&link::last_key(source)).ok().flatten()
    }

    /// Whether an event of `source`'s room was handled lately: stored, or as old as the newest
    /// one the previous answer had.
    fn handled(&self, source: &Source, event_id: &str) -> bool {
        self.recent.seen(event_id, event_id)
            || self
                .newest
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(source.as_str())
                .is_some_and(|n| n == event_id)
    }

    fn saw_newest(&self, source: &Source, event_id: &str) {
        let mut newest = self.newest.lock().unwrap_or_else(|e| e.into_inner());
        if newest.len() >= NAMES && !newest.contains_key(source.as_str()) {
            newest.clear();
        }
        newest.insert(source.to_string(), event_id.to_string());
    }

    /// The room of `source` turned on end-to-end encryption: its channel shows why (xAgent is
    /// told), its messages are no longer asked for, nothing is sent into it.
    fn room_encrypted(&self, source: &Source) {
        {
            let mut bound = self.bound.lock().unwrap_or_else(|e| e.into_inner());
            let Some((_, info)) = bound.iter_mut().find(|(s, i)| s == source && !i.encrypted) else {
                return;
            };
            info.encrypted = true;
            if let Err(e) = ROOMS.put(&self.host.db, source.as_str(), &*info) {
                log::error!("matrix: cannot mark the binding of {source} encrypted: {e}");
            }
        }
        log::warn!("matrix: {source}: the room turned on end-to-end encryption, which imgate does not support; its channel stops");
        self.host.binding_state_changed(source);
    }

    /// The homeserver said the account's token is gone: its rooms are expired (xAgent is told)
    /// until a binding brings a new token; its loop ends.
    fn token_revoked(&self, account: &str) {
        self.counts.tokens_revoked.add(1);
        let mut changed = Vec::new();
        {
            let mut bound = self.bound.lock().unwrap_or_else(|e| e.into_inner());
            for (source, info) in bound.iter_mut().filter(|(_, i)| i.account == account && !i.revoked) {
                info.revoked = true;
                if let Err(e) = ROOMS.put(&self.host.db, source.as_str(), &*info) {
                    log::error!("matrix: cannot mark the binding of {source} expired: {e}");
                }
                changed.push((source.clone(), info.user_id.clone()));
            }
        }
        if let Some((_, user)) = changed.first() {
            log::warn!(
                "matrix: the homeserver no longer accepts the access token of {} (logged out or deactivated); its {} room(s) are expired until bound again with a new token",
                shown(user),
                changed.len()
            );
        }
        self.syncers.forget(account);
        for (source, _) in &changed {
            self.host.binding_state_changed(source);
        }
    }

    fn learn_names(&self, room: &str, names: &[(String, String)]) {
        if names.is_empty() {
            return;
        }
        let mut cache = self.names.lock().unwrap_or_else(|e| e.into_inner());
        for (user, name) in names {
            if cache.len() >= NAMES {
                cache.clear();
            }
            cache.insert(format!("{room}\0{user}"), name.clone());
        }
    }

    fn set_members(&self, room: &str, n: u64) {
        let mut members = self.members.lock().unwrap_or_else(|e| e.into_inner());
        if members.len() >= NAMES && !members.contains_key(room) {
            members.clear();
        }
        members.insert(room.to_string(), n);
    }

    /// Joined members of a room, as the syncs told.
    fn members_of(&self, room: &str) -> Option<u64> {
        self.members
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(room)
            .copied()
    }

    /// A message as imgate's inbound event.
    fn inbound_of(&self, info: &RoomInfo, e: &Event, msg: &Message) -> Inbound {
        let name = self
            .names
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&format!("{}\0{}", info.room_id, e.sender))
            .cloned()
            .unwrap_or_else(|| e.sender.clone());
        let members = self.members_of(&info.room_id).unwrap_or(info.members);
        let (message_type, text) = match msg.kind {
            // "/me waves": the name is part of what was said.
            "emote" => ("text", format!("* {name} {}", msg.body)),
            kind => (kind, msg.body.clone()),
        };
        Inbound {
            message_id: e.event_id.clone(),
            sender_id: e.sender.clone(),
            sender_name: Some(name),
            chat_id: Some(info.room_id.clone()),
            chat_type: if members == 2 { "p2p" } else { "group" }.into(),
            message_type: message_type.to_string(),
            text,
            event_time: (e.ts > 0).then_some(e.ts),
            files: None,
        }
    }

    /// A message's file, into the file cache.
    fn fetch(&self, state: &AccountState, source: &str, media: &Media) -> Result<FileItem, String> {
        if media.size.is_some_and(|s| s > self.host.config.files.max_file_bytes) {
            return Err("larger than [files] max_file_bytes".into());
        }
        let deadline = Instant::now() + FETCH_DEADLINE;
        let files = &self.host.files;
        let acct = state.account();
        // Each attempt writes a new `.part` (a failed one removes its bytes as it drops).
        let (part, served) = with_retry("matrix: file download", deadline, |left| {
            let mut part = files.begin(source, "in").map_err(|e| PLATFORM.cache(e))?;
            let served = self.api.download(&acct, &media.mxc, &mut part, left)?;
            Ok::<_, ApiError>((part, served))
        })
        .map_err(|e| e.to_string())?;
        let mime = served_mime(served.as_deref(), &media.mime);
        let (file_ref, rec) = files.commit(part, &media.filename, &mime).map_err(|e| e.to_string())?;
        Ok(FileItem::cached(file_ref, rec))
    }

    fn gap_too_long(&self, source: &Source, pages: u64) {
        self.counts.gap_unread.add(1);
        if let Some(more) = self.gap_log.admit() {
            log::warn!(
                "matrix: {source}: more messages arrived while imgate was away than {pages} pages of history hold; the older ones are not fetched{more}"
            );
        }
    }

    fn history_failed(&self, room: &str, e: &ApiError) {
        if let Some(more) = self.history_log.admit() {
            log::warn!(
                "matrix: cannot read the history of room {}: {e}; trying again{more}",
                shown(room)
            );
        }
    }

    /// The binding and account that send for a bound source.
    fn route(&self, source: &Source) -> Result<(RoomInfo, AccountState), Failure> {
        let info = ROOMS
            .get::<RoomInfo>(&self.host.db, source.as_str())
            .map_err(Failure::storage)?
            .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the Matrix binding is gone"))?;
        if info.revoked {
            return Err(Failure::new(
                code::CONNECTION_NOT_AUTHENTICATED,
                "the homeserver no longer accepts the access token: bind this channel again with a new one",
            ));
        }
        if info.encrypted {
            return Err(Failure::new(code::CHANNEL_UNAVAILABLE, ENCRYPTED));
        }
        let token = self
            .token_files()
            .read(&info.account)
            .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the access token is no longer available"))?;
        let state = AccountState {
            id: info.account.clone(),
            homeserver: info.homeserver.clone(),
            user_id: info.user_id.clone(),
            token,
            rooms: Vec::new(),
        };
        Ok((info, state))
    }

    /// A failed call of a tool: a gone token expires the account's bindings.
    fn failed(&self, state: &AccountState, e: &ApiError) -> Failure {
        if api::token_gone(e) {
            self.token_revoked(&state.id);
            return Failure::new(
                code::CONNECTION_NOT_AUTHENTICATED,
                "the homeserver no longer accepts the access token: bind this channel again with a new one",
            );
        }
        Failure::api(e)
    }

    /// Sends one `m.room.message` event under a transaction ID derived from the tool call, so a
    /// retried call (after a lost answer, or a crash) is one event; its `event_id`.
    fn put_event(
        &self,
        state: &AccountState,
        room: &str,
        content: &Value,
        txn: &str,
        deadline: Instant,
    ) -> Result<String, Failure> {
        let path = format!("/rooms/{}/send/m.room.message/{}", seg(room), seg(txn));
        let acct = state.account();
        let sent = with_retry("matrix: send", deadline, |left| {
            self.api.send(&acct, "PUT", &path, content, left)
        })
        .map_err(|e| self.failed(state, &e))?;
        Ok(json::get_str(&sent, "event_id")
            .filter(|id| valid_id(id, b'$'))
            .unwrap_or_default()
            .to_string())
    }

    /// Asks the homeserver to show "typing" for `ms` (0: stop), within its own deadline.
    fn typing(&self, state: &AccountState, room: &str, ms: u64) {
        let path = format!("/rooms/{}/typing/{}", seg(room), seg(&state.user_id));
        let body = match ms {
            0 => obj([("typing", json::b(false))]),
            ms => obj([("typing", json::b(true)), ("timeout", json::n(ms))]),
        };
        if let Err(e) = self.api.send(&state.account(), "PUT", &path, &body, TYPING_DEADLINE) {
            log::debug!("matrix: typing notice failed: {e}");
        }
    }

    /// Whether "typing" was asked for in `room` within `TYPING_EVERY` (else it is noted now).
    fn typing_recently(&self, room: &str) -> bool {
        let mut typing = self.typing.lock().unwrap_or_else(|e| e.into_inner());
        // Kept while the homeserver may still show it, so `idle` knows to stop it.
        typing.retain(|_, t| t.elapsed() < Duration::from_millis(TYPING_BUSY_MS));
        if typing.get(room).is_some_and(|t| t.elapsed() < TYPING_EVERY) {
            return true;
        }
        typing.insert(room.to_string(), Instant::now());
        false
    }
}

const ENCRYPTED: &str =
    "the room turned on end-to-end encryption, which imgate does not support: bind the channel to a room without it";

const DECLARATION: Declaration = Declaration {
    name: NAME,
    label: "Matrix",
    description: "A Matrix account in a room on any homeserver (not end-to-end encrypted rooms).",
    flows: &[FLOW],
    tools: TOOLS,
};

const FLOW: Flow = Flow::form(
    FLOW_ID,
    "Bind a Matrix Room",
    "Bind this channel to one Matrix room of an account.",
    &[
        Field::text(
            "homeserver",
            "Homeserver",
            Some("https://matrix.example.org"),
            "The homeserver's client API address (https://).",
        ),
        Field::secret(
            "access_token",
            "Access Token",
            Some("syt_..."),
            "The access token of the account imgate speaks as (a bot account of its own is best).",
        ),
        Field::text(
            "room_id",
            "Room",
            Some("!abc123:example.org or #room:example.org"),
            "Invite the account to the room first; a room ID (Room settings, Advanced) or an alias.",
        ),
    ],
);

/// The binding's failures as the form shows them.
fn cannot(what: &str, e: &ApiError) -> Failure {
    match e.status {
        401 => Failure::new(
            code::CONNECTION_NOT_AUTHENTICATED,
            "the homeserver rejected the access token",
        ),
        0 | 429 | 500.. => Failure::temporary(code::UPSTREAM_UNREACHABLE, format!("cannot {what}: {e}")),
        _ => Failure::new(code::UPSTREAM_REJECTED, format!("cannot {what}: {e}")),
    }
}

impl Matrix {
    /// A new token for `account`: its other rooms that had expired work again.
    fn token_renewed(&self, account: &str, bound_now: &Source) {
        let mut renewed = Vec::new();
        {
            let mut bound = self.bound.lock().unwrap_or_else(|e| e.into_inner());
            for (source, info) in bound.iter_mut().filter(|(_, i)| i.account == account) {
                if source == bound_now {
                    info.revoked = false;
                    continue;
                }
                if info.revoked {
                    info.revoked = false;
                    if let Err(e) = ROOMS.put(&self.host.db, source.as_str(), &*info) {
                        log::error!("matrix: cannot renew the binding of {source}: {e}");
                    }
                    renewed.push(source.clone());
                }
            }
        }
        for source in &renewed {
            self.host.binding_state_changed(source);
        }
    }

    /// A room ID as given (`!…`), or an alias (`#…:server`) resolved.
    fn room_id_of(&self, acct: &Account, given: &str) -> Result<String, Failure> {
        if valid_id(given, b'!') {
            return Ok(given.to_string());
        }
        if !valid_id(given, b'#') || !given.contains(':') {
            return Err(Failure::new(
                code::INVALID_ARGUMENTS,
                "room_id must be a room ID (!…) or an alias (#room:server)",
            ));
        }
        let found = self
            .api
            .get(acct, &format!("/directory/room/{}", seg(given)), TOOL_DEADLINE)
            .map_err(|e| match e.status {
                404 => Failure::new(code::INVALID_ARGUMENTS, "no room has this alias"),
                _ => cannot("resolve the alias", &e),
            })?;
        json::get_str(&found, "room_id")
            .filter(|r| valid_id(r, b'!'))
            .map(str::to_string)
            .ok_or_else(|| Failure::new(code::UPSTREAM_REJECTED, "the alias resolved to no room ID"))
    }

    /// The ID of the room's newest message (empty when it has none).
    fn newest_message(&self, acct: &Account, room_id: &str) -> Result<String, Failure> {
        let filter = crate::upstream::query_value(r#"{"types":["m.room.message"]}"#);
        let path = format!("/rooms/{}/messages?dir=b&limit=1&filter={filter}", seg(room_id));
        let page = self
            .api
            .get(acct, &path, TOOL_DEADLINE)
            .map_err(|e| cannot("read the room's newest message", &e))?;
        Ok(event::read_page(&page)
            .events
            .first()
            .map(|e| e.event_id.clone())
            .unwrap_or_default())
    }

    /// The account is in the room, or joins it (an invitation, a public room), by `given` (the
    /// room's ID or the alias it was given by).
    fn join(&self, acct: &Account, room_id: &str, given: &str) -> Result<(), Failure> {
        let joined = self
            .api
            .get(acct, "/joined_rooms", TOOL_DEADLINE)
            .map_err(|e| cannot("list the account's rooms", &e))?;
        let member = match joined.get("joined_rooms") {
            Some(Value::Array(rooms)) => rooms.iter().any(|r| matches!(r, Value::String(r) if r == room_id)),
            _ => false,
        };
        if member {
            return Ok(());
        }
        match self
            .api
            .send(acct, "POST", &format!("/join/{}", seg(given)), &obj([]), TOOL_DEADLINE)
        {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.status, 403 | 404) => Err(Failure::new(
                code::CONNECTION_NOT_AUTHENTICATED,
                "the account is not in this room and cannot join it: invite it to the room first",
            )),
            Err(e) => Err(cannot("join the room", &e)),
        }
    }

    /// The content of a file's event: its kind's `msgtype`, the caption (or the name) as body.
    fn file_content(rec: &crate::files::FileRecord, mxc: &str, caption: &str) -> Value {
        let msgtype = match rec.kind.as_str() {
            "image" => "m.image",
            "video" => "m.video",
            "audio" => "m.audio",
            _ => "m.file",
        };
        let body = if caption.is_empty() {
            rec.filename.as_str()
        } else {
            caption
        };
        obj([
            ("msgtype", s(msgtype)),
            ("body", s(body)),
            ("filename", s(rec.filename.as_str())),
            ("url", s(mxc)),
            (
                "info",
                obj([
                    ("mimetype", s(rec.mime_type.as_str())),
                    ("size", json::n(rec.byte_size)),
                ]),
            ),
        ])
    }
}

/// The reply relation for a message that answers `event_id`.
fn with_reply(mut content: Value, reply_to: Option<&str>) -> Value {
    if let (Value::Object(o), Some(id)) = (&mut content, reply_to.filter(|r| valid_id(r, b'$'))) {
        o.insert(
            "m.relates_to".into(),
            obj([("m.in_reply_to", obj([("event_id", s(id))]))]),
        );
    }
    content
}

impl Provider for Matrix {
    fn declaration(&self) -> &'static Declaration {
        &DECLARATION
    }

    /// The form flow: homeserver, token and room checked; the room joined when invited.
    fn bind(&self, input: &Object) -> Result<Source, Failure> {
        let homeserver = homeserver_of(json::get_str(input, "homeserver").unwrap_or_default())?;
        let token = json::get_str(input, "access_token").map(str::trim).unwrap_or_default();
        if token.is_empty() || token.len() > 4096 || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Failure::new(code::INVALID_ARGUMENTS, "access_token is required"));
        }
        let room_given = json::get_str(input, "room_id").map(str::trim).unwrap_or_default();
        let versions = self.api.versions(&homeserver).map_err(|e| match e.status {
            0 => Failure::temporary(code::UPSTREAM_UNREACHABLE, format!("cannot reach the homeserver: {e}")),
            _ => Failure::new(code::UPSTREAM_REJECTED, format!("not a Matrix homeserver ({e})")),
        })?;
        if !matches!(versions.get("versions"), Some(Value::Array(_))) {
            return Err(Failure::new(
                code::UPSTREAM_REJECTED,
                "not a Matrix homeserver (no versions)",
            ));
        }
        let acct = Account {
            homeserver: &homeserver,
            token,
        };
        let t = TOOL_DEADLINE;
        let me = self
            .api
            .get(&acct, "/account/whoami", t)
            .map_err(|e| cannot("check the token", &e))?;
        let user_id = json::get_str(&me, "user_id")
            .filter(|u| valid_id(u, b'@'))
            .ok_or_else(|| Failure::new(code::UPSTREAM_REJECTED, "whoami gave no user ID"))?
            .to_string();
        let room_id = self.room_id_of(&acct, room_given)?;
        // By the alias when one was given: it names the servers to join through.
        self.join(&acct, &room_id, room_given)?;
        let state_of = |kind: &str| {
            self.api
                .get(&acct, &format!("/rooms/{}/state/{kind}/", seg(&room_id)), t)
        };
        match state_of("m.room.encryption") {
            Ok(_) => {
                return Err(Failure::new(
                    code::INVALID_ARGUMENTS,
                    "this room is end-to-end encrypted, which imgate does not support: use a room without encryption",
                ))
            }
            Err(e) if e.kind() == Kind::Gone => {}
            Err(e) => return Err(cannot("check the room's encryption", &e)),
        }
        let members = match self
            .api
            .get(&acct, &format!("/rooms/{}/joined_members", seg(&room_id)), t)
        {
            Ok(m) => json::get_obj(&m, "joined").map_or(0, |j| j.len() as u64),
            // Too many members to list: a group, whatever their number.
            Err(e) if e.too_large => u64::MAX,
            Err(e) => return Err(cannot("read the room's members", &e)),
        };
        let name = state_of("m.room.name")
            .ok()
            .and_then(|o| json::get_str(&o, "name").map(str::to_string))
            .or_else(|| room_given.starts_with('#').then(|| room_given.to_string()))
            .map(|n| inbound::bounded(n.trim(), 256))
            .unwrap_or_default();
        let account = account_of(&homeserver, &user_id);
        let source = Source::new(NAME, &format!("{account}:{room_id}"));
        let others = self
            .bound_rooms()
            .iter()
            .filter(|(s, i)| i.account == account && *s != source)
            .count();
        if others >= MAX_ROOMS {
            return Err(Failure::new(
                code::INVALID_ARGUMENTS,
                format!("this account has {MAX_ROOMS} bound rooms already, the most one account may have"),
            ));
        }
        // What the room said before this binding is not pushed: its newest message is where
        // reading starts. A room bound already (a new token after a revoked one, the same form
        // again) keeps where it was and catches up.
        let before = ROOMS
            .get::<RoomInfo>(&self.host.db, source.as_str())
            .map_err(Failure::storage)?;
        let renewed = before.is_some() && self.bound_rooms().iter().any(|(s, _)| *s == source);
        if !renewed {
            let newest = self.newest_message(&acct, &room_id)?;
            self.host
                .outbox
                .move_cursors(&[crate::outbox::Cursor::Set(link::last_key(&source), newest)])
                .map_err(Failure::storage)?;
        }
        self.token_files()
            .store(&account, token)
            .map_err(|e| Failure::new(code::TOOL_INVOKE_FAILED, format!("cannot store the access token: {e}")))?;
        let info = RoomInfo {
            account: account.clone(),
            homeserver,
            user_id,
            room_id,
            name,
            members,
            bound_at: match (renewed, before) {
                (true, Some(b)) => b.bound_at,
                _ => crate::ids::now_ms(),
            },
            revoked: false,
            encrypted: false,
        };
        ROOMS
            .put(&self.host.db, source.as_str(), &info)
            .map_err(Failure::storage)?;
        self.token_renewed(&account, &source);
        Ok(source)
    }

    fn describe(&self, source: &Source) -> Result<Description, StoreError> {
        Ok(match ROOMS.get::<RoomInfo>(&self.host.db, source.as_str())? {
            None => DECLARATION.lost("the Matrix binding is gone"),
            Some(info) if self.token_files().read(&info.account).is_none() => {
                DECLARATION.lost("the access token is no longer available")
            }
            Some(info) => {
                let shown = if info.name.is_empty() {
                    &info.room_id
                } else {
                    &info.name
                };
                let (name, hint) = (shown.clone(), Some(info.user_id.clone()));
                match (info.revoked, info.encrypted) {
                    (true, _) => DECLARATION.unusable(
                        "expired",
                        name,
                        hint,
                        "the homeserver no longer accepts the access token: bind again with a new one",
                    ),
                    (_, true) => DECLARATION.unusable("error", name, hint, ENCRYPTED),
                    _ => DECLARATION.connected(name, hint),
                }
            }
        })
    }

    /// Text (split at 8,000 characters, the first part replying when asked) as `m.text`, then
    /// each file uploaded and sent as its kind's event. A tool's file takes the text as its
    /// caption. Every event's transaction ID comes from the call, so a retry is one event.
    fn send(&self, source: &Source, out: &Outbound) -> Result<String, Failure> {
        let (info, state) = self.route(source)?;
        let deadline = Instant::now() + TOOL_DEADLINE;
        let tool_file = out.message_id.is_none() && out.files.len() == 1;
        let texts = match out.text.is_empty() || tool_file {
            true => Vec::new(),
            false => split_text(out.text, MAX_TEXT),
        };
        let acct = state.account();
        let texts = texts
            .into_iter()
            .map(|chunk| Ok(obj([("msgtype", s("m.text")), ("body", s(chunk))])));
        // Each file is uploaded when its turn comes, after the parts before it were sent.
        let files = out.files.iter().map(|(rec, path)| {
            let upload = Upload {
                filename: &rec.filename,
                mime: &rec.mime_type,
                size: rec.byte_size,
                path,
            };
            let mxc = with_retry("matrix: upload", deadline, |left| self.api.upload(&acct, &upload, left))
                .map_err(|e| self.failed(&state, &e))?;
            let caption = if tool_file { out.text } else { "" };
            Ok(Self::file_content(rec, &mxc, caption))
        });
        let mut last = String::new();
        let mut reply_to = out.reply_to;
        for (part, content) in texts.chain(files).enumerate() {
            let content = with_reply(content?, reply_to.take());
            let txn = send_id(out.idempotency_key, part, 16);
            last = self.put_event(&state, &info.room_id, &content, &txn, deadline)?;
        }
        Ok(last)
    }

    /// Busy: "typing" for up to a minute (renewed at most every 20 s); idle: stopped.
    fn activity(&self, source: &Source, activity: Activity) {
        let Some(me) = self.me.upgrade() else { return };
        let Ok((info, state)) = self.route(source) else { return };
        // Decided here, so a peer that flips busy and idle queues no work: one notice per room
        // per 20 s while busy, and "stopped" only after one was shown.
        let ms = match activity {
            Activity::Busy if self.typing_recently(&info.room_id) => return,
            Activity::Busy => TYPING_BUSY_MS,
            Activity::Idle => {
                let shown = self
                    .typing
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&info.room_id);
                if shown.is_none() {
                    return;
                }
                0
            }
        };
        crate::runtime::spawn_blocking(move || me.typing(&state, &info.room_id, ms));
    }

    /// Loops follow the bindings; tokens no binding uses are forgotten.
    fn bindings_changed(&self, bound: &[Source]) {
        let rooms = ROOMS.of_bound::<RoomInfo>(&self.host.db, bound);
        let mut wanted: Vec<(String, String)> = Vec::new();
        for (_, info) in rooms.iter().filter(|(_, i)| i.usable()) {
            if !wanted.iter().any(|(a, _)| a == &info.account) {
                wanted.push((info.account.clone(), info.user_id.clone()));
            }
        }
        let in_use: Vec<String> = rooms.iter().map(|(_, i)| i.account.clone()).collect();
        *self.bound.lock().unwrap_or_else(|e| e.into_inner()) = rooms;
        let accounts: Vec<String> = wanted.iter().map(|(a, _)| a.clone()).collect();
        self.syncers.sync(&accounts, |line| {
            let user = wanted
                .iter()
                .find(|(a, _)| a == line.account())
                .map(|(_, u)| u.clone())?;
            link::start(&self.me, &user, line)
        });
        self.token_files().forget_unused(&in_use, "matrix: token of account");
    }

    /// Shows "typing" in the room after a delivery (IM profile v1), on a blocking thread with its
    /// own deadline, so a stalled homeserver never holds up delivery.
    fn delivered(&self, source: &Source) {
        let Some(me) = self.me.upgrade() else { return };
        let Ok((info, state)) = self.route(source) else { return };
        if self.typing_recently(&info.room_id) {
            return;
        }
        crate::runtime::spawn_blocking(move || me.typing(&state, &info.room_id, TYPING_AFTER_DELIVERY_MS));
    }

    fn metrics(&self, out: &mut String) {
        crate::metrics::singles(
            out,
            &[(
                "imgate_matrix_sync_loops",
                "gauge",
                "Matrix accounts synced, one loop per bound account.",
                self.syncers.count() as u64,
            )],
        );
        crate::metrics::counters(out, &[&self.counts.gap_unread, &self.counts.tokens_revoked]);
    }

    fn stop(&self) {
        self.syncers.stop_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_homeserver_needs_https_except_on_this_machine() {
        assert_eq!(
            homeserver_of(" https://matrix.example.org/ ").ok().as_deref(),
            Some("https://matrix.example.org")
        );
        assert!(homeserver_of("http://127.0.0.1:8008").is_ok());
        assert!(homeserver_of("http://[::1]:8008").is_ok());
        assert!(homeserver_of("http://localhost:8008").is_ok());
        for bad in [
            "http://matrix.example.org",
            "matrix.example.org",
            "ftp://x",
            "https://",
            "https://u:p@x",
            "https://x/?a",
        ] {
            assert!(homeserver_of(bad).is_err(), "{bad} refused");
        }
    }

    #[test]
    fn an_account_is_named_by_homeserver_and_user_and_safe_as_a_file_name() {
        let a = account_of("https://a.org", "@bot:a.org");
        assert_eq!(a.len(), 16);
        assert!(inbound::safe_id(&a, 16));
        assert_ne!(a, account_of("https://b.org", "@bot:a.org"));
    }
}
