//! One full session with every kind of secret in play (API key, webhook secret, dial key, bot
//! tokens, Telegram webhook secret): none of them appears in stderr at trace level, in any
//! packet, the Card, a Descriptor, /status, /metrics or a tool result.

use std::net::TcpListener;
use std::time::Duration;

use crate::common::botapi::BotApi;
use crate::common::*;
use serde_json::json;

const DEFAULT_TOKEN: &str = "111111:AAdefault-token-secret";
const FORM_TOKEN: &str = "222222:AAform-token-secret";
const DIAL_KEY: &str = "dial-key-secret-77";
const TG_HOOK_SECRET: &str = "tg-webhook-secret-88";

#[test]
fn no_secret_leaves_imgate_through_any_channel() {
    let api = BotApi::start();
    api.add_bot(DEFAULT_TOKEN, 111111, "device_bot");
    api.add_bot(FORM_TOKEN, 222222, "user_bot");
    api.add_chat(
        222222,
        json!({"id": 5550001234i64, "type": "private", "first_name": "Ada"}),
    );
    let receiver = ReplyReceiver::start(200);
    let dial = TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = temp_dir("secrets");
    let port = free_port();
    let extra = format!(
        "[xagent]\ndial = ws://127.0.0.1:{}/ws\ndial_api_key = {DIAL_KEY}\n\n[telegram]\napi_base = {}\nbot_token = {DEFAULT_TOKEN}\nwebhook_secret = {TG_HOOK_SECRET}\n",
        dial.local_addr().unwrap().port(),
        api.base
    );
    let d = Daemon::start(&dir, &config_text(port, &dir, Some(&receiver.url), &extra));
    let secrets = [
        API_KEY,
        HOOK_SECRET,
        DIAL_KEY,
        DEFAULT_TOKEN,
        FORM_TOKEN,
        TG_HOOK_SECRET,
    ];

    // The dial-out session: hello and a webhook channel with a message and a reply.
    let (mut x, auth) = accept_dial(&dial);
    assert_eq!(auth.as_deref(), Some(format!("Bearer {DIAL_KEY}").as_str()));
    x.hello("");
    let (hook_ch, _) = x.open(None);
    x.bind_webhook(&hook_ch, "alerts", HOOK_SECRET);
    d.post_hook("alerts", &json!({"message_id": "s1", "sender_id": "u", "text": "hi"}));
    let push = x.next_push(Duration::from_secs(10)).unwrap();
    let reply_ref = push["payload"]["reply"]["reply_ref"].as_str().unwrap().to_string();
    x.tool(
        &hook_ch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref, "text": "ok"}),
        "c1",
    );

    // A Telegram channel bound with a token from the form, a message, a reply, an error.
    let (tg_ch, _) = x.open(None);
    let ok = x.request(
        "auth.start",
        Some(&tg_ch),
        json!({"flow_id": "telegram_bot_binding", "input": {"bot_token": FORM_TOKEN, "chat_id": "5550001234"}}),
    );
    assert_eq!(ok["payload"]["status"], "authenticated", "{ok}");
    api.user_says(222222, 5550001234, "tg hi", Duration::ZERO);
    let push = x.next_push(Duration::from_secs(10)).unwrap();
    let reply_ref = push["payload"]["reply"]["reply_ref"].as_str().unwrap().to_string();
    x.tool(
        &tg_ch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref, "text": "tg ok"}),
        "c2",
    );
    api.fail("sendMessage", 400, None, 1);
    x.tool(&tg_ch, "imgate_message_send", json!({"text": "refused"}), "c3");
    let failed = x.request(
        "auth.start",
        Some(&tg_ch),
        json!({"flow_id": "telegram_bot_binding", "input": {"bot_token": "333:AAwrong-token", "chat_id": "1"}}),
    );
    assert_eq!(failed["payload"]["status"], "failed");
    x.request("connection.descriptor.get", Some(&tg_ch), json!({}));
    x.request("connection.descriptor.get", Some(&hook_ch), json!({}));

    let (_, card) = http_get(&d.url("/connector-card.json"), &[]);
    let (_, skill) = http_get(&d.url("/skill.md"), &[]);
    let status = get_json(&d.url("/status")).to_string();
    let (_, metrics) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
    let health = get_json(&d.url("/health")).to_string();
    std::thread::sleep(Duration::from_millis(300));

    assert_no_secret(
        &serde_json::to_string(&x.seen).unwrap(),
        &secrets,
        "a packet, Descriptor or tool result",
    );
    for (what, text) in [
        ("the Card", &card),
        ("the Skill", &skill),
        ("/status", &status),
        ("/metrics", &metrics),
        ("/health", &health),
    ] {
        assert_no_secret(text, &secrets, what);
    }
    assert_no_secret(&d.log(), &secrets, "stderr at trace level");
    assert!(
        d.log_shows("TRACE", Duration::from_secs(5)),
        "the log really ran at trace level"
    );
}
