//! Auth flows as a provider-driven state machine (common protocol 5.4, 8.7–8.14).
//!
//! `auth.start` asks the flow's provider: a form finishes at once (bound, or failed); a login
//! the user completes elsewhere (a QR code) is `pending`, and every `auth.status` asks the
//! provider again (`refresh` for new material), until it is `authenticated`, `failed` or
//! `expired`. `auth.cancel` gives a waiting login up. The logins live here, not in the
//! connection: a reconnecting xAgent polls the same `auth_session_id` on the channel it opens
//! again.
//!
//! ```text
//!            start ─▶ pending ◀─▶ scanned ─▶ authenticated
//!              │         │  ▲ refresh │
//!              │         ▼  │         ▼
//!              │  qr_refresh_required  failed
//!              ▼
//!  (form) authenticated | failed        any waiting ─(time)─▶ expired
//!                                       any waiting ─(cancel)─▶ unauthenticated
//! ```
//!
//! Bounded: at most `MAX_LOGINS` at once; a waiting login lives at most `WAIT_CAP` (or less,
//! as its provider says), a finished one answers `auth.status` for `KEEP_FINISHED`. When full,
//! the login closest to its end makes room (a waiting one is cancelled at its provider).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use super::{lock, Plane};
use crate::ids;
use crate::json::{self, obj, s, Object, Value};
use crate::protocol::{code, Packet};
use crate::providers::{AuthStep, Failure, Registry, Stage};
use crate::quiet;
use crate::source::Source;

/// Logins held at once, waiting or finished.
pub const MAX_LOGINS: usize = 64;
/// A waiting login is expired after this at most.
pub const WAIT_CAP: Duration = Duration::from_secs(10 * 60);
/// A finished login still answers `auth.status` this long.
pub const KEEP_FINISHED: Duration = Duration::from_secs(10 * 60);

/// Failed auth flows: xAgent can start them at will, so one line a minute.
static AUTH_FAILURES: quiet::Site = quiet::Site::new();

/// The protocol's seven statuses (8.8, 8.10).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Status {
    Pending,
    Scanned,
    Authenticated,
    Unauthenticated,
    Expired,
    QrRefreshRequired,
    Failed,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Scanned => "scanned",
            Status::Authenticated => "authenticated",
            Status::Unauthenticated => "unauthenticated",
            Status::Expired => "expired",
            Status::QrRefreshRequired => "qr_refresh_required",
            Status::Failed => "failed",
        }
    }

    /// Nothing more will happen to the login.
    pub fn finished(self) -> bool {
        !matches!(self, Status::Pending | Status::Scanned | Status::QrRefreshRequired)
    }
}

/// A login as its acks show it.
#[derive(Debug, Clone, PartialEq)]
pub struct View {
    pub auth_session_id: String,
    pub cch: String,
    pub flow_id: String,
    pub status: Status,
    pub message: String,
    pub qr_code_text: Option<String>,
    pub qr_code_image: Option<String>,
    pub expires_at: Option<u64>,
    pub poll_interval_millis: Option<u64>,
}

struct Login {
    view: View,
    /// The provider's handle while waiting.
    provider_login: Option<String>,
    /// Unix ms: a waiting login expires then; a finished one is forgotten then.
    ends_at: u64,
}

/// The providers as auth asks them.
pub trait Flows {
    fn start(&self, flow_id: &str, input: &Object) -> Result<AuthStep, Failure>;
    fn poll(&self, flow_id: &str, login: &str, refresh: bool) -> Result<AuthStep, Failure>;
    fn cancel(&self, flow_id: &str, login: &str);
}

impl Flows for Registry {
    fn start(&self, flow_id: &str, input: &Object) -> Result<AuthStep, Failure> {
        match self.for_flow(flow_id) {
            Some(p) => p.auth_start(flow_id, input),
            None => Err(Failure::new(
                code::INVALID_ARGUMENTS,
                format!("unknown auth flow `{flow_id}`; see the Connector Card's auth_flows"),
            )),
        }
    }

    fn poll(&self, flow_id: &str, login: &str, refresh: bool) -> Result<AuthStep, Failure> {
        match self.for_flow(flow_id) {
            Some(p) => p.auth_poll(flow_id, login, refresh),
            None => Err(Failure::new(
                code::AUTH_SESSION_NOT_FOUND,
                "the flow's provider is gone",
            )),
        }
    }

    fn cancel(&self, flow_id: &str, login: &str) {
        if let Some(p) = self.for_flow(flow_id) {
            p.auth_cancel(flow_id, login);
        }
    }
}

/// What `auth.cancel` found.
#[derive(Debug, PartialEq)]
pub enum Cancelled {
    /// A waiting login, given up.
    Canceled(View),
    /// Already finished: nothing to cancel.
    Ignored(View),
    NotFound,
}

/// Stores a finished binding; the channel that lost the source, if one did.
pub type Bind<'a> = &'a mut dyn FnMut(&Source) -> Result<Option<String>, Failure>;

/// Every auth session of the device.
#[derive(Default)]
pub struct Logins {
    inner: Mutex<HashMap<String, Login>>,
}

impl Logins {
    /// `auth.start`: runs the flow; a finished binding is stored with `bind`.
    pub fn start(&self, flows: &dyn Flows, bind: Bind, cch: &str, flow_id: &str, input: &Object, now: u64) -> View {
        let auth_session_id = ids::short("auth_");
        let step = flows.start(flow_id, input);
        let mut login = Login {
            view: View {
                auth_session_id: auth_session_id.clone(),
                cch: cch.to_string(),
                flow_id: flow_id.to_string(),
                status: Status::Pending,
                message: String::new(),
                qr_code_text: None,
                qr_code_image: None,
                expires_at: None,
                poll_interval_millis: None,
            },
            provider_login: None,
            ends_at: now,
        };
        apply(&mut login, step, bind, now);
        let view = login.view.clone();
        let mut g = lock(&self.inner);
        self.make_room(&mut g, flows, now);
        g.insert(auth_session_id, login);
        view
    }

    /// `auth.status`: a waiting login asks its provider again; `None` when `auth_session_id`
    /// is not a login of this channel.
    pub fn status(
        &self,
        flows: &dyn Flows,
        bind: Bind,
        cch: &str,
        auth_id: &str,
        refresh: bool,
        now: u64,
    ) -> Option<View> {
        let (flow_id, provider_login) = {
            let mut g = lock(&self.inner);
            let login = g.get_mut(auth_id).filter(|l| l.view.cch == cch)?;
            if login.view.status.finished() {
                return Some(login.view.clone());
            }
            if now >= login.ends_at {
                expire(login, flows, now);
                return Some(login.view.clone());
            }
            (
                login.view.flow_id.clone(),
                login.provider_login.clone().unwrap_or_default(),
            )
        };
        // The provider is asked without the lock: it may call its IM system.
        let step = flows.poll(&flow_id, &provider_login, refresh);
        let mut g = lock(&self.inner);
        let login = g.get_mut(auth_id)?;
        if !login.view.status.finished() {
            apply(login, step, bind, now);
        }
        Some(login.view.clone())
    }

    /// `auth.cancel`.
    pub fn cancel(&self, flows: &dyn Flows, cch: &str, auth_id: &str, now: u64) -> Cancelled {
        let mut g = lock(&self.inner);
        let Some(login) = g.get_mut(auth_id).filter(|l| l.view.cch == cch) else {
            return Cancelled::NotFound;
        };
        if login.view.status.finished() {
            return Cancelled::Ignored(login.view.clone());
        }
        give_up(login, flows);
        finish(login, Status::Unauthenticated, "Authentication canceled".into(), now);
        Cancelled::Canceled(login.view.clone())
    }

    /// Expires what ran out, forgets what is old; when still full, the login nearest its end
    /// goes.
    fn make_room(&self, g: &mut HashMap<String, Login>, flows: &dyn Flows, now: u64) {
        for login in g.values_mut() {
            if !login.view.status.finished() && now >= login.ends_at {
                expire(login, flows, now);
            }
        }
        g.retain(|_, l| !(l.view.status.finished() && now >= l.ends_at));
        while g.len() >= MAX_LOGINS {
            let Some(id) = g.iter().min_by_key(|(_, l)| l.ends_at).map(|(id, _)| id.clone()) else {
                break;
            };
            if let Some(mut l) = g.remove(&id) {
                give_up(&mut l, flows);
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.inner).len()
    }
}

/// Tells the provider a waiting login is over.
fn give_up(login: &mut Login, flows: &dyn Flows) {
    if let Some(handle) = login.provider_login.take() {
        flows.cancel(&login.view.flow_id, &handle);
    }
}

fn expire(login: &mut Login, flows: &dyn Flows, now: u64) {
    give_up(login, flows);
    finish(
        login,
        Status::Expired,
        "the login expired before it was completed".into(),
        now,
    );
}

fn finish(login: &mut Login, status: Status, message: String, now: u64) {
    let v = &mut login.view;
    v.status = status;
    v.message = message;
    v.qr_code_text = None;
    v.qr_code_image = None;
    v.expires_at = None;
    v.poll_interval_millis = None;
    login.provider_login = None;
    login.ends_at = now.saturating_add(KEEP_FINISHED.as_millis() as u64);
}

/// Moves a login by what its provider answered.
fn apply(login: &mut Login, step: Result<AuthStep, Failure>, bind: Bind, now: u64) {
    match step {
        Ok(AuthStep::Bound(source)) => match bind(&source) {
            Ok(_) => finish(login, Status::Authenticated, format!("Bound to {source}"), now),
            Err(f) => finish(login, Status::Failed, f.message, now),
        },
        Ok(AuthStep::Waiting(prompt)) => {
            let cap = now.saturating_add(WAIT_CAP.as_millis() as u64);
            let ends_at = prompt.expires_at.map_or(cap, |t| t.min(cap));
            let v = &mut login.view;
            v.status = match prompt.stage {
                Stage::Pending => Status::Pending,
                Stage::Scanned => Status::Scanned,
                Stage::RefreshRequired => Status::QrRefreshRequired,
            };
            v.message = prompt.message;
            // A poll that brings no new material keeps what the user is looking at.
            if prompt.qr_code_text.is_some() || prompt.qr_code_image.is_some() {
                v.qr_code_text = prompt.qr_code_text;
                v.qr_code_image = prompt.qr_code_image;
            }
            v.expires_at = Some(ends_at);
            v.poll_interval_millis = prompt.poll_interval_millis.or(v.poll_interval_millis);
            login.provider_login = Some(prompt.login);
            login.ends_at = ends_at;
        }
        Ok(AuthStep::Expired(message)) => {
            login.provider_login = None;
            finish(login, Status::Expired, message, now);
        }
        Err(f) => {
            if f.code == code::AUTH_SESSION_NOT_FOUND {
                // The provider forgot the login (a restart): nothing left to wait for.
                login.provider_login = None;
            }
            finish(login, Status::Failed, f.message, now);
        }
    }
}

/// The ack of `auth.start` or `auth.status` (8.8): every field the login has.
fn ack(p: &Packet, kind: &str, v: &View, descriptor: Value) -> Packet {
    let mut fields = vec![
        ("connector_channel_id", s(&v.cch)),
        ("flow_id", s(&v.flow_id)),
        ("auth_session_id", s(&v.auth_session_id)),
        ("status", s(v.status.as_str())),
        ("message", s(&v.message)),
    ];
    let text = |k, o: &Option<String>| o.as_ref().map(|x| (k, s(x)));
    fields.extend(text("qr_code_text", &v.qr_code_text));
    fields.extend(text("qr_code_image", &v.qr_code_image));
    fields.extend(v.expires_at.map(|t| ("expires_at", json::n(t))));
    fields.extend(v.poll_interval_millis.map(|t| ("poll_interval_millis", json::n(t))));
    fields.push(("connection_descriptor", descriptor));
    Packet::answer(p, kind).with_payload(obj(fields))
}

/// What an auth packet changed, for the session to follow up.
pub(super) struct Outcome {
    pub answer: Packet,
    /// The channel is bound to this source now (`Some(None)`: unbound).
    pub bound: Option<Option<Source>>,
    /// Another channel lost its source to this one.
    pub moved_from: Option<String>,
}

/// Runs one auth packet (blocking: providers and the store are asked) on channel `cch`. The
/// Descriptor is added by the caller.
pub(super) fn run(plane: &Plane, p: &Packet, auth: &super::request::Auth, cch: &str) -> Outcome {
    use super::request::Auth;
    let now = ids::now_ms();
    let mut bound = None;
    let mut moved_from = None;
    let mut bind = |source: &Source| -> Result<Option<String>, Failure> {
        let previous = plane
            .channels
            .bind(cch, source)
            .map_err(|e| Failure::new(code::TOOL_INVOKE_FAILED, format!("cannot store the binding: {e}")))?;
        log::info!("data plane: channel {cch} bound to {source}");
        bound = Some(Some(source.clone()));
        moved_from.clone_from(&previous);
        Ok(previous)
    };
    let logins = &plane.logins;
    let flows = &plane.providers;
    let answer = match auth {
        Auth::Start { flow_id, input } => {
            let v = logins.start(flows, &mut bind, cch, flow_id, input, now);
            note_failure(&v);
            ack(p, "auth.start.ack", &v, Value::Null)
        }
        Auth::Status {
            auth_session_id,
            refresh,
        } => match logins.status(flows, &mut bind, cch, auth_session_id, *refresh, now) {
            Some(v) => {
                note_failure(&v);
                ack(p, "auth.status.ack", &v, Value::Null)
            }
            None => Packet::answer(p, "auth.status.ack")
                .with_error(code::AUTH_SESSION_NOT_FOUND, "no such auth session on this channel"),
        },
        Auth::Cancel { auth_session_id } => {
            let cancelled = logins.cancel(flows, cch, auth_session_id, now);
            cancel_ack(p, cch, auth_session_id, cancelled)
        }
        Auth::Logout => match logout(plane, cch) {
            Ok(unbound) => {
                bound = unbound.then_some(None);
                Packet::answer(p, "auth.logout.ack").with_payload(obj([("status", s("ok"))]))
            }
            Err(e) => {
                log::error!("data plane: cannot unbind {cch}: {e}");
                Packet::answer(p, "auth.logout.ack")
                    .with_error(code::TOOL_INVOKE_FAILED, "cannot store the change right now")
            }
        },
    };
    Outcome {
        answer,
        bound,
        moved_from,
    }
}

/// The ack of `auth.cancel` (8.12).
fn cancel_ack(p: &Packet, cch: &str, auth_session_id: &str, cancelled: Cancelled) -> Packet {
    let (status, auth_status, message) = match cancelled {
        Cancelled::Canceled(v) => ("canceled", Status::Unauthenticated, v.message),
        Cancelled::Ignored(v) if v.status == Status::Authenticated => ("ignored", Status::Authenticated, v.message),
        Cancelled::Ignored(v) => ("ignored", Status::Unauthenticated, v.message),
        Cancelled::NotFound => (
            "not_found",
            Status::Unauthenticated,
            "no such auth session on this channel".into(),
        ),
    };
    Packet::answer(p, "auth.cancel.ack").with_payload(obj([
        ("connector_channel_id", s(cch)),
        ("auth_session_id", s(auth_session_id)),
        ("status", s(status)),
        ("auth_status", s(auth_status.as_str())),
        ("message", s(message)),
        ("connection_descriptor", Value::Null),
    ]))
}

/// `auth.logout`: the binding goes, and its provider forgets the credentials only it used.
/// True when there was a binding.
fn logout(plane: &Plane, cch: &str) -> Result<bool, crate::store::StoreError> {
    let Some(src) = plane.channels.unbind(cch)?.as_deref().and_then(Source::parse) else {
        return Ok(false);
    };
    log::info!("data plane: channel {cch} unbound from {src}");
    if let Some(provider) = plane.providers.of(&src) {
        provider.logout(&src);
    }
    Ok(true)
}

fn note_failure(v: &View) {
    if v.status != Status::Failed {
        return;
    }
    if let Some(more) = AUTH_FAILURES.admit() {
        log::info!(
            "data plane: channel {}: auth flow `{}` failed: {}{more}",
            v.cch,
            quiet::shown(&v.flow_id),
            quiet::shown(&v.message)
        );
    }
}

/// Whether an answer gets the channel's Descriptor: acks of start and status always (the
/// latest Descriptor corrects the UI), cancel only when the channel is authenticated, logout
/// on success.
pub(super) fn wants_descriptor(answer: &Packet) -> bool {
    if answer.error.is_some() {
        return false;
    }
    match answer.kind.as_str() {
        "auth.cancel.ack" => json::get_str(&answer.payload, "auth_status") == Some("authenticated"),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::Prompt;
    use std::cell::RefCell;

    /// A stand-in QR login provider: each poll returns the next scripted step; it records
    /// what it was asked.
    #[derive(Default)]
    struct QrFlow {
        script: RefCell<Vec<Result<AuthStep, Failure>>>,
        asked: RefCell<Vec<String>>,
    }

    impl QrFlow {
        fn then(self, step: Result<AuthStep, Failure>) -> QrFlow {
            self.script.borrow_mut().push(step);
            self
        }

        fn next(&self) -> Result<AuthStep, Failure> {
            let mut s = self.script.borrow_mut();
            assert!(!s.is_empty(), "the provider was asked more often than scripted");
            s.remove(0)
        }
    }

    impl Flows for QrFlow {
        fn start(&self, flow_id: &str, _: &Object) -> Result<AuthStep, Failure> {
            self.asked.borrow_mut().push(format!("start {flow_id}"));
            self.next()
        }
        fn poll(&self, _: &str, login: &str, refresh: bool) -> Result<AuthStep, Failure> {
            self.asked.borrow_mut().push(format!("poll {login} refresh={refresh}"));
            self.next()
        }
        fn cancel(&self, _: &str, login: &str) {
            self.asked.borrow_mut().push(format!("cancel {login}"));
        }
    }

    fn waiting(stage: Stage, qr: Option<&str>) -> Result<AuthStep, Failure> {
        Ok(AuthStep::Waiting(Prompt {
            login: "L1".into(),
            stage,
            qr_code_text: qr.map(str::to_string),
            qr_code_image: qr.map(|q| format!("data:image/png;base64,{q}")),
            expires_at: Some(300_000),
            poll_interval_millis: Some(2000),
            message: format!("{stage:?}"),
        }))
    }

    fn bound() -> Result<AuthStep, Failure> {
        Ok(AuthStep::Bound(Source::new("qr", "account-1")))
    }

    /// A binder that records what it stored.
    fn binder(stored: &RefCell<Vec<Source>>) -> impl FnMut(&Source) -> Result<Option<String>, Failure> + '_ {
        move |s| {
            stored.borrow_mut().push(s.clone());
            Ok(None)
        }
    }

    #[test]
    fn a_qr_login_goes_pending_scanned_authenticated_and_binds_once() {
        let flow = QrFlow::default()
            .then(waiting(Stage::Pending, Some("qr-1")))
            .then(waiting(Stage::Scanned, None))
            .then(bound());
        let stored = RefCell::new(Vec::new());
        let mut bind = binder(&stored);
        let logins = Logins::default();
        let v = logins.start(&flow, &mut bind, "cch", "qr_login", &Object::new(), 0);
        assert_eq!(v.status, Status::Pending);
        assert_eq!(v.qr_code_text.as_deref(), Some("qr-1"));
        assert_eq!((v.expires_at, v.poll_interval_millis), (Some(300_000), Some(2000)));
        let id = v.auth_session_id.clone();
        let v = logins.status(&flow, &mut bind, "cch", &id, false, 10).unwrap();
        assert_eq!(v.status, Status::Scanned);
        assert_eq!(
            v.qr_code_text.as_deref(),
            Some("qr-1"),
            "a poll without new material keeps the code"
        );
        let v = logins.status(&flow, &mut bind, "cch", &id, false, 20).unwrap();
        assert_eq!(v.status, Status::Authenticated);
        assert_eq!(v.qr_code_text, None);
        // Finished: asked again, the provider is not.
        let v = logins.status(&flow, &mut bind, "cch", &id, true, 30).unwrap();
        assert_eq!(v.status, Status::Authenticated);
        assert_eq!(stored.borrow().as_slice(), [Source::new("qr", "account-1")]);
        assert_eq!(
            flow.asked.borrow().as_slice(),
            ["start qr_login", "poll L1 refresh=false", "poll L1 refresh=false"]
        );
    }

    #[test]
    fn refresh_asks_the_provider_for_new_material() {
        let flow = QrFlow::default()
            .then(waiting(Stage::Pending, Some("qr-1")))
            .then(waiting(Stage::RefreshRequired, None))
            .then(waiting(Stage::Pending, Some("qr-2")));
        let stored = RefCell::new(Vec::new());
        let mut bind = binder(&stored);
        let logins = Logins::default();
        let id = logins
            .start(&flow, &mut bind, "cch", "qr_login", &Object::new(), 0)
            .auth_session_id;
        let v = logins.status(&flow, &mut bind, "cch", &id, false, 1).unwrap();
        assert_eq!(v.status, Status::QrRefreshRequired);
        let v = logins.status(&flow, &mut bind, "cch", &id, true, 2).unwrap();
        assert_eq!((v.status, v.qr_code_text.as_deref()), (Status::Pending, Some("qr-2")));
        assert_eq!(flow.asked.borrow()[2], "poll L1 refresh=true");
    }

    #[test]
    fn a_login_past_its_expiry_is_expired_and_its_provider_told() {
        let flow = QrFlow::default().then(waiting(Stage::Pending, Some("qr")));
        let stored = RefCell::new(Vec::new());
        let mut bind = binder(&stored);
        let logins = Logins::default();
        let id = logins
            .start(&flow, &mut bind, "cch", "qr_login", &Object::new(), 0)
            .auth_session_id;
        let v = logins.status(&flow, &mut bind, "cch", &id, false, 300_000).unwrap();
        assert_eq!(v.status, Status::Expired);
        assert_eq!(flow.asked.borrow().last().map(String::as_str), Some("cancel L1"));
        // The provider's expiry is capped by ours.
        let flow = QrFlow::default().then(Ok(AuthStep::Waiting(Prompt {
            expires_at: Some(u64::MAX),
            ..match waiting(Stage::Pending, None) {
                Ok(AuthStep::Waiting(p)) => p,
                _ => unreachable!(),
            }
        })));
        let v = logins.start(&flow, &mut bind, "cch", "qr_login", &Object::new(), 0);
        assert_eq!(v.expires_at, Some(WAIT_CAP.as_millis() as u64));
        // The provider may find the code expired first.
        let flow = QrFlow::default()
            .then(waiting(Stage::Pending, Some("qr")))
            .then(Ok(AuthStep::Expired("QR code expired".into())));
        let id = logins
            .start(&flow, &mut bind, "cch", "qr_login", &Object::new(), 0)
            .auth_session_id;
        let v = logins.status(&flow, &mut bind, "cch", &id, false, 1).unwrap();
        assert_eq!(
            (v.status, v.message.as_str(), v.qr_code_text),
            (Status::Expired, "QR code expired", None)
        );
    }

    #[test]
    fn cancel_gives_up_a_waiting_login_and_ignores_a_finished_one() {
        let flow = QrFlow::default()
            .then(waiting(Stage::Pending, Some("qr")))
            .then(bound());
        let stored = RefCell::new(Vec::new());
        let mut bind = binder(&stored);
        let logins = Logins::default();
        let id = logins
            .start(&flow, &mut bind, "cch", "qr_login", &Object::new(), 0)
            .auth_session_id;
        assert_eq!(
            logins.cancel(&flow, "other", &id, 1),
            Cancelled::NotFound,
            "another channel's"
        );
        let Cancelled::Canceled(v) = logins.cancel(&flow, "cch", &id, 1) else {
            panic!("a waiting login is cancelled")
        };
        assert_eq!(v.status, Status::Unauthenticated);
        assert_eq!(flow.asked.borrow().last().map(String::as_str), Some("cancel L1"));
        let st = logins.status(&flow, &mut bind, "cch", &id, false, 2).unwrap();
        assert_eq!(st.status, Status::Unauthenticated, "the provider is not asked again");
        let form = logins.start(&flow, &mut bind, "cch", "form", &Object::new(), 3);
        assert_eq!(form.status, Status::Authenticated);
        assert!(matches!(
            logins.cancel(&flow, "cch", &form.auth_session_id, 4),
            Cancelled::Ignored(v) if v.status == Status::Authenticated
        ));
    }

    #[test]
    fn a_failed_provider_or_binding_fails_the_login_and_a_reconnect_polls_the_same_session() {
        let flow = QrFlow::default()
            .then(waiting(Stage::Pending, Some("qr")))
            .then(bound())
            .then(Err(Failure::new(code::INVALID_ARGUMENTS, "wrong token")));
        let logins = Logins::default();
        let mut refuse =
            |_: &Source| -> Result<Option<String>, Failure> { Err(Failure::new(code::TOOL_INVOKE_FAILED, "disk")) };
        let id = logins
            .start(&flow, &mut refuse, "cch", "qr_login", &Object::new(), 0)
            .auth_session_id;
        // A new connection (the logins are the plane's, not the connection's) polls it.
        let v = logins.status(&flow, &mut refuse, "cch", &id, false, 5).unwrap();
        assert_eq!((v.status, v.message.as_str()), (Status::Failed, "disk"));
        let v = logins.start(&flow, &mut refuse, "cch", "form", &Object::new(), 6);
        assert_eq!((v.status, v.message.as_str()), (Status::Failed, "wrong token"));
    }

    #[test]
    fn logins_are_bounded_and_the_nearest_to_its_end_makes_room() {
        let logins = Logins::default();
        let stored = RefCell::new(Vec::new());
        let mut bind = binder(&stored);
        let mut first = None;
        for i in 0..MAX_LOGINS + 5 {
            let flow = QrFlow::default().then(bound());
            let v = logins.start(&flow, &mut bind, "cch", "form", &Object::new(), i as u64);
            first.get_or_insert(v.auth_session_id);
        }
        assert_eq!(logins.len(), MAX_LOGINS);
        let flow = QrFlow::default();
        assert_eq!(
            logins.status(&flow, &mut bind, "cch", &first.unwrap(), false, 100),
            None
        );
        // Finished ones are forgotten after KEEP_FINISHED.
        let later = KEEP_FINISHED.as_millis() as u64 + 1_000;
        let flow = QrFlow::default().then(bound());
        logins.start(&flow, &mut bind, "cch", "form", &Object::new(), later);
        assert_eq!(logins.len(), 1);
    }
}

/// The state machine through the plane: the store's binding, the provider's hooks.
#[cfg(test)]
mod plane_tests {
    use super::super::request::Auth;
    use super::*;
    use crate::dataplane::testing::{plane_with, StandIn};
    use std::sync::Arc;

    fn status(id: &str) -> Auth {
        Auth::Status {
            auth_session_id: id.into(),
            refresh: false,
        }
    }

    #[test]
    fn a_qr_login_binds_on_its_last_poll_from_a_new_connection_and_logout_tells_the_provider() {
        let standin = Arc::new(StandIn::default());
        let plane = plane_with(standin.clone());
        let (cch, _) = plane.channels.open_channel(None).unwrap().unwrap();
        let p = Packet::new("auth.start");
        let start = Auth::Start {
            flow_id: "qr".into(),
            input: Object::new(),
        };
        let out = run(&plane, &p, &start, &cch);
        assert_eq!(json::get_str(&out.answer.payload, "status"), Some("pending"));
        assert_eq!(json::get_str(&out.answer.payload, "qr_code_text"), Some("qr-1"));
        assert!(
            out.answer.payload.contains_key("expires_at") && out.answer.payload.contains_key("poll_interval_millis")
        );
        assert!(out.bound.is_none(), "nothing bound while waiting");
        let id = json::get_str(&out.answer.payload, "auth_session_id")
            .unwrap()
            .to_string();
        // The user scans; then, after xAgent reconnected (the logins are the plane's), it binds.
        standin
            .script
            .lock()
            .unwrap()
            .push(StandIn::qr_step(Stage::Scanned, "qr-1"));
        standin
            .script
            .lock()
            .unwrap()
            .push(AuthStep::Bound(Source::new("standin", "scanned")));
        let scanned = run(&plane, &p, &status(&id), &cch);
        assert_eq!(json::get_str(&scanned.answer.payload, "status"), Some("scanned"));
        let done = run(&plane, &p, &status(&id), &cch);
        assert_eq!(json::get_str(&done.answer.payload, "status"), Some("authenticated"));
        assert_eq!(done.bound, Some(Some(Source::new("standin", "scanned"))));
        let stored = plane.channels.channel(&cch).unwrap().and_then(|r| r.source());
        assert_eq!(stored, Some(Source::new("standin", "scanned")));
        // Another channel polling that session finds nothing.
        let other = run(&plane, &p, &status(&id), "cch_other");
        assert!(other.answer.error.is_some());
        let out = run(&plane, &p, &Auth::Logout, &cch);
        assert_eq!(out.bound, Some(None));
        assert_eq!(plane.channels.channel(&cch).unwrap().and_then(|r| r.source()), None);
        assert_eq!(
            standin.asked.lock().unwrap().as_slice(),
            [
                "start qr",
                "poll login-1 false",
                "poll login-1 false",
                "logout standin:scanned"
            ]
        );
    }

    #[test]
    fn a_form_binding_moves_a_source_from_the_channel_that_had_it() {
        let standin = Arc::new(StandIn::default());
        let plane = plane_with(standin);
        let (first, _) = plane.channels.open_channel(None).unwrap().unwrap();
        let (second, _) = plane.channels.open_channel(None).unwrap().unwrap();
        let p = Packet::new("auth.start");
        let form = Auth::Start {
            flow_id: "form".into(),
            input: Object::new(),
        };
        assert_eq!(run(&plane, &p, &form, &first).moved_from, None);
        let moved = run(&plane, &p, &form, &second);
        assert_eq!(moved.moved_from, Some(first));
        let id = json::get_str(&moved.answer.payload, "auth_session_id")
            .unwrap()
            .to_string();
        let cancel = Auth::Cancel { auth_session_id: id };
        let ack = run(&plane, &Packet::new("auth.cancel"), &cancel, &second).answer;
        assert_eq!(
            (
                json::get_str(&ack.payload, "status"),
                json::get_str(&ack.payload, "auth_status")
            ),
            (Some("ignored"), Some("authenticated"))
        );
        assert!(wants_descriptor(&ack));
    }
}
