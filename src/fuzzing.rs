//! What the fuzz targets in fuzz/ reach, and nothing else does: every parser of outside bytes,
//! and the front door's connection loop with the types a stand-in service needs.

pub use crate::config::parse as parse_config;
pub use crate::dataplane::chat::{parse_activity, parse_delta, parse_message};
pub use crate::http::multipart;
pub use crate::json::{as_object, parse as parse_json};
pub use crate::outbox::read_log;
pub use crate::protocol::Packet;
pub use crate::providers::readers as config_readers;
#[cfg(feature = "telegram")]
pub use crate::providers::telegram::event::read_update as read_telegram_update;
pub use crate::providers::webhook::parse_body as parse_webhook_body;
#[cfg(feature = "wechat")]
pub use crate::providers::wechat::cdn::Decrypting as WechatDecrypting;
#[cfg(feature = "wechat")]
pub use crate::providers::wechat::qr::data_url as qr_data_url;
#[cfg(feature = "wechat")]
pub use crate::providers::wechat::update::read_batch as read_wechat_batch;

/// The front door: one connection's request loop and the request-head parser.
pub mod front {
    pub use crate::front::{conn, head, LIMITS};
}

/// Slack's Socket Mode frames and message events, and its markup made readable.
#[cfg(feature = "slack")]
pub mod slack {
    pub use crate::providers::slack::event;
}

/// Discord's Gateway payloads and messages, and its markup made readable.
#[cfg(feature = "discord")]
pub mod discord {
    pub use crate::providers::discord::event;
}

/// DingTalk's Stream mode frames and robot messages.
#[cfg(feature = "dingtalk")]
pub mod dingtalk {
    pub use crate::providers::dingtalk::event;
}

/// WeCom's long-connection frames and robot messages, and its media decryption.
#[cfg(feature = "wecom")]
pub mod wecom {
    pub use crate::providers::wecom::{event, media};
}

/// Matrix's `/sync` answers, history pages and room events.
#[cfg(feature = "matrix")]
pub mod matrix {
    pub use crate::providers::matrix::api::mxc_parts as api_mxc_parts;
    pub use crate::providers::matrix::event;
}

/// Feishu/Lark's long connection: its frame, its protocol, its event payload.
#[cfg(feature = "feishu")]
pub mod feishu {
    pub use crate::providers::feishu::{event, frame::Frame, longconn};
}
