//! Providers: the IM systems imgate bridges, as plug-ins behind one trait.
//!
//! A provider is a folder here plus one line in `REGISTRATIONS`: its config sections (a
//! `config::Reader`), and a constructor that returns the running `Provider` when its config
//! enables it. Everything outside this folder asks the `Registry` and never names a provider:
//! the Card is the union of their targets, auth flows and tools; a channel's Descriptor, label
//! and outbound messages come from the provider named by its source; ingest routes are theirs.
//!
//! The trait is synchronous and object-safe. A provider's blocking work (its HTTP calls, long
//! polls) runs on its own threads or on the caller's blocking thread, never on the async
//! executor; `delivered` must return at once.

pub mod bindings;
#[cfg(feature = "dingtalk")]
pub mod dingtalk;
#[cfg(feature = "discord")]
pub mod discord;
#[cfg(feature = "feishu")]
pub mod feishu;
pub mod inbound;
pub mod intake;
pub mod keyfiles;
pub mod lag;
pub mod link;
#[cfg(feature = "matrix")]
pub mod matrix;
#[cfg(feature = "slack")]
pub mod slack;
pub mod socket;
#[cfg(feature = "telegram")]
pub mod telegram;
pub mod tokens;
pub mod webhook;
#[cfg(feature = "wechat")]
pub mod wechat;
#[cfg(feature = "wecom")]
pub mod wecom;

mod host;
mod kit;
mod provider;

pub use self::host::Host;
pub use self::kit::{
    multipart, send_id, served_mime, split_text, token_kept_for, with_retry, StreamedForm, Transient, Upload,
};
pub use self::provider::{
    Activity, AuthStep, Declaration, Delta, Description, Failure, Field, Flow, HttpAnswer, HttpRequest, Outbound,
    Prompt, Provider, Reply, Route, Stage,
};

use std::sync::Arc;

use crate::channels::Channels;
use crate::config::{self, Config};
use crate::source::Source;
use crate::store::StoreError;

/// Every provider imgate knows, in Card order. Adding a provider: its folder and one line here.
pub const REGISTRATIONS: &[Registration] = &[
    webhook::REGISTRATION,
    #[cfg(feature = "telegram")]
    telegram::REGISTRATION,
    #[cfg(feature = "feishu")]
    feishu::REGISTRATION,
    #[cfg(feature = "wechat")]
    wechat::REGISTRATION,
    #[cfg(feature = "slack")]
    slack::REGISTRATION,
    #[cfg(feature = "discord")]
    discord::REGISTRATION,
    #[cfg(feature = "dingtalk")]
    dingtalk::REGISTRATION,
    #[cfg(feature = "matrix")]
    matrix::REGISTRATION,
    #[cfg(feature = "wecom")]
    wecom::REGISTRATION,
];

/// The providers this build left out (their Cargo feature off). Their sections are refused
/// with a reason that says so, rather than as unknown.
const LEFT_OUT: &[&str] = &[
    #[cfg(not(feature = "telegram"))]
    "telegram",
    #[cfg(not(feature = "feishu"))]
    "feishu",
    #[cfg(not(feature = "wechat"))]
    "wechat",
    #[cfg(not(feature = "slack"))]
    "slack",
    #[cfg(not(feature = "discord"))]
    "discord",
    #[cfg(not(feature = "dingtalk"))]
    "dingtalk",
    #[cfg(not(feature = "matrix"))]
    "matrix",
    #[cfg(not(feature = "wecom"))]
    "wecom",
];

/// One provider's entry: how it reads the config, how it starts.
pub struct Registration {
    pub reader: config::Reader,
    /// The running provider, or `None` when the config leaves it disabled.
    pub start: StartFn,
}

impl Registration {
    /// A provider that owns the section named as it is, `secrets` its keys that hold secrets.
    pub const fn new(
        provider: &'static str,
        secrets: &'static [&'static str],
        read: config::ReadFn,
        start: StartFn,
    ) -> Registration {
        Registration {
            reader: config::Reader {
                provider,
                section: provider,
                secrets,
                read,
                left_out: false,
            },
            start,
        }
    }
}

/// Starts a provider on the layers below it.
pub type StartFn = fn(&Arc<Host>) -> Result<Option<Arc<dyn Provider>>, StoreError>;

/// The config readers of every provider, for `config::load`.
pub fn readers() -> Vec<config::Reader> {
    let left_out = LEFT_OUT.iter().map(|&name| config::Reader {
        provider: name,
        section: name,
        secrets: &[],
        read: refuse_left_out,
        left_out: true,
    });
    REGISTRATIONS.iter().map(|r| r.reader).chain(left_out).collect()
}

/// The reader of a left-out provider's section: an error naming the feature a build needs.
fn refuse_left_out(
    _: &Config,
    sections: &[&config::Section],
    problems: &mut config::Problems,
) -> Option<Arc<dyn config::Settings>> {
    for s in sections {
        problems.err(
            s.line,
            format_args!(
                "[{0}]: this imgate was built without the {0} provider (Cargo feature `{0}`); \
                 install a build that has it, or remove the section",
                s.name
            ),
        );
    }
    None
}

/// The running providers.
pub struct Registry {
    providers: Vec<Arc<dyn Provider>>,
}

impl Registry {
    /// Starts every provider the config enables, in `REGISTRATIONS` order.
    pub fn start(host: &Arc<Host>) -> Result<Registry, StoreError> {
        let mut providers = Vec::new();
        for r in REGISTRATIONS {
            if let Some(p) = (r.start)(host)? {
                providers.push(p);
            }
        }
        Ok(Registry { providers })
    }

    /// A registry of the given providers (the unit tests' stand-ins).
    #[cfg(test)]
    pub fn of_providers(providers: Vec<Arc<dyn Provider>>) -> Registry {
        Registry { providers }
    }

    pub fn all(&self) -> &[Arc<dyn Provider>] {
        &self.providers
    }

    pub fn get(&self, name: &str) -> Option<&Arc<dyn Provider>> {
        self.providers.iter().find(|p| p.declaration().name == name)
    }

    /// The provider that owns `source`; `None` for one no enabled provider knows.
    pub fn of(&self, source: &Source) -> Option<&Arc<dyn Provider>> {
        self.get(source.provider())
    }

    /// The provider whose auth flow this is.
    pub fn for_flow(&self, flow_id: &str) -> Option<&Arc<dyn Provider>> {
        self.providers
            .iter()
            .find(|p| p.declaration().flows.iter().any(|f| f.id == flow_id))
    }

    /// The provider answering `method path` itself.
    pub fn for_route(&self, method: &str, path: &str) -> Option<&Arc<dyn Provider>> {
        self.providers
            .iter()
            .find(|p| p.routes().iter().any(|r| r.matches(method, path)))
    }

    /// Whether `path` is some provider's route, whatever the method (for 405 answers).
    pub fn has_path(&self, path: &str) -> bool {
        self.providers
            .iter()
            .any(|p| p.routes().iter().any(|r| r.matches(r.method, path)))
    }

    /// The tools the Card declares: every tool some enabled provider serves, in `ALL_TOOLS` order.
    pub fn tools(&self) -> Vec<&'static str> {
        crate::protocol::ALL_TOOLS
            .iter()
            .copied()
            .filter(|t| self.providers.iter().any(|p| p.declaration().tools.contains(t)))
            .collect()
    }

    /// Tells every provider which sources are bound now.
    pub fn bindings_changed(&self, channels: &Channels) {
        match channels.bound_sources() {
            Ok(bound) => {
                for p in &self.providers {
                    p.bindings_changed(&bound);
                }
            }
            Err(e) => log::error!("providers: cannot read the bindings: {e}"),
        }
    }

    pub fn stop(&self) {
        for p in &self.providers {
            p.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_section_of_a_provider_left_out_of_the_build_names_the_feature_it_needs() {
        let readers = [config::Reader {
            provider: "slack",
            section: "slack",
            secrets: &[],
            read: refuse_left_out,
            left_out: true,
        }];
        let text = "[server]\nlisten = 127.0.0.1:8787\n\n[slack]\napi_base = https://x\n";
        let err = config::parse(text, "t.conf", None, &readers)
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some(
                "t.conf:4: [slack]: this imgate was built without the slack provider (Cargo feature \
                 `slack`); install a build that has it, or remove the section"
            )
        );
        let fine = config::parse("[server]\nlisten = 127.0.0.1:8787\n", "t.conf", None, &readers);
        let summary = fine.map(|c| c.summary()).unwrap_or_default();
        assert!(
            summary.contains("\nslack:             not in this build\n"),
            "no section, no error; `check` says the provider is not built in: {summary}"
        );
    }
}
