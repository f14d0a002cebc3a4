//! Unit tests of the data plane over a real store: a `Plane` on a temp directory whose only
//! provider is a stand-in (`StandIn`) that binds by a form, or by a scripted QR login, and
//! records what it was asked to send.

use std::sync::{Arc, Mutex};

use super::Plane;
use crate::app::App;
use crate::json::{self, Object, Value};
use crate::protocol::descriptor::{Target, ToolState};
use crate::protocol::{TOOL_REPLY, TOOL_SEND};
use crate::providers::{
    AuthStep, Declaration, Description, Failure, Flow, Outbound, Prompt, Provider, Registry, Stage,
};
use crate::source::Source;
use crate::store::StoreError;

/// The stand-in provider: `form` binds `standin:KEY` at once; `qr` waits for the scripted
/// steps, one per poll.
#[derive(Default)]
pub struct StandIn {
    pub script: Mutex<Vec<AuthStep>>,
    pub sent: Mutex<Vec<String>>,
    pub asked: Mutex<Vec<String>>,
}

fn note(m: &Mutex<Vec<String>>, what: String) {
    m.lock().unwrap().push(what);
}

impl StandIn {
    pub fn qr_step(stage: Stage, code: &str) -> AuthStep {
        AuthStep::Waiting(Prompt {
            login: "login-1".into(),
            stage,
            qr_code_text: Some(code.into()),
            qr_code_image: None,
            expires_at: None,
            poll_interval_millis: Some(1500),
            message: "scan it".into(),
        })
    }
}

const DECLARATION: Declaration = Declaration {
    name: "standin",
    label: "Stand-in",
    description: "A provider of the data plane's unit tests.",
    flows: &[Flow::form("form", "", "", &[]), Flow::form("qr", "", "", &[])],
    tools: &[TOOL_SEND, TOOL_REPLY],
};

impl Provider for StandIn {
    fn declaration(&self) -> &'static Declaration {
        &DECLARATION
    }
    fn auth_flows(&self) -> Vec<Value> {
        Vec::new()
    }
    fn auth_start(&self, flow_id: &str, input: &Object) -> Result<AuthStep, Failure> {
        note(&self.asked, format!("start {flow_id}"));
        match flow_id {
            "form" => Ok(AuthStep::Bound(Source::new(
                "standin",
                json::get_str(input, "key").unwrap_or("k"),
            ))),
            _ => Ok(StandIn::qr_step(Stage::Pending, "qr-1")),
        }
    }
    fn auth_poll(&self, _: &str, login: &str, refresh: bool) -> Result<AuthStep, Failure> {
        note(&self.asked, format!("poll {login} {refresh}"));
        let mut script = self.script.lock().unwrap();
        Ok(match script.is_empty() {
            true => StandIn::qr_step(Stage::Pending, "qr-1"),
            false => script.remove(0),
        })
    }
    fn auth_cancel(&self, _: &str, login: &str) {
        note(&self.asked, format!("cancel {login}"));
    }
    fn logout(&self, source: &Source) {
        note(&self.asked, format!("logout {source}"));
    }
    fn describe(&self, source: &Source) -> Result<Description, StoreError> {
        Ok(Description {
            status: "connected",
            target: Target {
                provider: "standin".into(),
                label: source.key().into(),
                display_name: source.key().into(),
                account_hint: None,
            },
            tools: vec![(TOOL_SEND, ToolState::available())],
        })
    }
    fn label(&self, source: &Source) -> String {
        source.key().into()
    }
    fn send(&self, source: &Source, out: &Outbound) -> Result<String, Failure> {
        note(&self.sent, format!("{source} {}", out.text));
        Ok(format!("sent-{}", self.sent.lock().unwrap().len()))
    }
}

/// A plane on a fresh state directory with `provider` as its only provider.
pub fn plane_with(provider: Arc<StandIn>) -> Arc<Plane> {
    let dir = crate::scratch::scratch_dir("plane");
    let text = format!("[server]\nstate_dir = {}\n", dir.display());
    let config = crate::config::parse(&text, "test.conf", None, &crate::providers::readers()).unwrap();
    let app = App::open_with(config, |_| Ok(Registry::of_providers(vec![provider]))).unwrap();
    Plane::open(app).unwrap()
}
