//! The Telegram provider against the Bot API simulator: binding and its failures, long-poll
//! inbound, reply and send tools, retries, one poller per bot, offsets across restarts, and a
//! bot token that never leaves imgate.

use std::time::Duration;

use crate::common::botapi::BotApi;
use crate::common::*;
use serde_json::{json, Value};

const TOKEN: &str = "123456:AAsecret-bot-token-xyz";
const BOT: u64 = 123456;
const CHAT: i64 = 7_770_012_345;

fn telegram(tag: &str, extra: &str) -> (Daemon, BotApi) {
    let api = BotApi::start();
    api.add_bot(TOKEN, BOT, "imgate_test_bot");
    api.add_chat(BOT, json!({"id": CHAT, "type": "private", "first_name": "Ada"}));
    let dir = temp_dir(tag);
    let conf = format!("[telegram]\napi_base = {}\n{extra}", api.base);
    (Daemon::start(&dir, &config_text(free_port(), &dir, None, &conf)), api)
}

fn bind(x: &mut Sim, cch: &str, token: &str, chat: &str) -> Value {
    x.request(
        "auth.start",
        Some(cch),
        json!({"flow_id": "telegram_bot_binding", "input": {"bot_token": token, "chat_id": chat}}),
    )
}

/// The group chat of `bound_two`.
const GROUP: i64 = -100200;

/// Two channels: the first bound to the private chat, the second to the group "Ops".
fn bound_two(d: &Daemon, api: &BotApi) -> (Sim, String, String) {
    api.add_chat(BOT, json!({"id": GROUP, "type": "supergroup", "title": "Ops"}));
    let (mut x, first) = bound(d);
    let (second, _) = x.open(None);
    let a = bind(&mut x, &second, TOKEN, &GROUP.to_string());
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    (x, first, second)
}

fn bound(d: &Daemon) -> (Sim, String) {
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let a = bind(&mut x, &cch, TOKEN, &CHAT.to_string());
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    (x, cch)
}

#[test]
fn binding_checks_token_and_chat_and_shows_only_display_names() {
    let (d, api) = telegram("tg-bind", "");
    let (_, card) = http_get(&d.url("/connector-card.json"), &[]);
    let card: Value = serde_json::from_str(&card).unwrap();
    assert_card(&card);
    let flow = card["auth_flows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == "telegram_bot_binding")
        .cloned();
    let flow = flow.expect("the Card offers telegram_bot_binding when [telegram] is set");
    assert_eq!(
        flow["fields"][0]["required"], true,
        "no default bot: the token is required"
    );

    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let bad = bind(&mut x, &cch, "999:wrong", &CHAT.to_string());
    assert_eq!(bad["payload"]["status"], "failed");
    assert!(
        bad["payload"]["message"]
            .as_str()
            .unwrap()
            .contains("rejected the bot token"),
        "{bad}"
    );
    let unknown = bind(&mut x, &cch, TOKEN, "555");
    assert_eq!(unknown["payload"]["status"], "failed");
    assert!(
        unknown["payload"]["message"]
            .as_str()
            .unwrap()
            .contains("does not know this chat"),
        "{unknown}"
    );
    api.kick(BOT, -4001);
    let kicked = bind(&mut x, &cch, TOKEN, "-4001");
    assert_eq!(kicked["payload"]["status"], "failed");
    assert!(
        kicked["payload"]["message"].as_str().unwrap().contains("not a member"),
        "{kicked}"
    );
    let ok = bind(&mut x, &cch, TOKEN, &CHAT.to_string());
    assert_eq!(ok["payload"]["status"], "authenticated", "{ok}");
    let target = &ok["payload"]["connection_descriptor"]["target"];
    assert_eq!(target["provider"], "telegram");
    assert_eq!(target["display_name"], "@imgate_test_bot in Ada");
    assert_eq!(target["account_hint"], "77***45", "a redacted hint only");

    let token_file = d.dir.join("state/telegram/bot123456.token");
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&token_file).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "the token file is private");
    let all = serde_json::to_string(&x.seen).unwrap() + &card.to_string() + &get_json(&d.url("/status")).to_string();
    assert_no_secret(&all, &[TOKEN], "a packet, the Card or /status");
}

#[test]
fn messages_arrive_and_replies_go_back_to_the_chat() {
    let (d, api) = telegram("tg-roundtrip", "");
    let (mut x, cch) = bound(&d);
    api.user_says(BOT, CHAT, "is the door locked?", Duration::ZERO);
    let push = x
        .next_push(Duration::from_secs(10))
        .expect("the Telegram message is pushed");
    assert_eq!(push["connector_channel_id"], json!(cch));
    let p = &push["payload"];
    assert_eq!(p["provider"], "telegram");
    assert_eq!(p["profile"], "xagent.im.v1");
    assert_eq!(p["event_kind"], "im.message.received");
    assert!(
        p["message_id"].as_str().unwrap().starts_with(&format!("{CHAT}:")),
        "{p}"
    );
    assert_eq!(p["sender_name"], "Ada Lovelace");
    assert_eq!(p["chat_type"], "p2p");
    assert_eq!(p["message_type"], "text");
    assert_eq!(p["raw_text"], "is the door locked?");
    assert!(p["text"].as_str().unwrap().starts_with("User message from Telegram:"));
    assert_eq!(
        p["skill"]["tool_ids"],
        json!(["imgate_message_send", "imgate_message_reply", "imgate_file_send"])
    );
    let reply_ref = p["reply"]["reply_ref"].as_str().unwrap().to_string();
    let tg_message_id: u64 = p["message_id"]
        .as_str()
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();

    let a = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref, "text": "yes, locked"}),
        "tg-1",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let sent = api.calls("sendMessage");
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0]["chat_id"], CHAT);
    assert_eq!(sent[0]["text"], "yes, locked");
    assert_eq!(sent[0]["reply_parameters"]["message_id"], tg_message_id);

    let long = "z".repeat(5000);
    let a = x.tool(&cch, "imgate_message_send", json!({"text": long}), "tg-2");
    assert_eq!(a["payload"]["result"]["status"], "sent");
    let sent = api.calls("sendMessage");
    assert_eq!(sent.len(), 3, "5000 characters go as two messages");
    assert_eq!(sent[1]["text"].as_str().unwrap().chars().count(), 4096);
    assert!(sent[2].get("reply_parameters").is_none());

    assert!(
        !api.wait_calls("sendChatAction", 1, Duration::from_secs(5)).is_empty(),
        "typing after delivery"
    );
    assert_no_secret(&d.log(), &[TOKEN], "the trace log");
    assert_no_secret(
        &serde_json::to_string(&x.seen).unwrap(),
        &[TOKEN],
        "a packet or tool result",
    );
    // The poller's long poll holds nothing a stop waits for.
    assert_stops_cleanly(d);
}

#[test]
fn a_stalled_typing_indicator_never_delays_another_channels_push() {
    let (d, api) = telegram("tg-typing-stall", "");
    let (mut x, tg) = bound(&d);
    let (hook, _) = x.open(None);
    let a = x.bind_webhook(&hook, "alerts", HOOK_SECRET);
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    api.stall("sendChatAction", Duration::from_secs(8), 1);
    api.user_says(BOT, CHAT, "hello", Duration::ZERO);
    let push = x.next_push(Duration::from_secs(10)).expect("the Telegram message");
    assert_eq!(push["connector_channel_id"], json!(tg));
    // Its pong reaches the delivery boundary; the typing indicator that follows hangs.
    x.recv_within(Duration::from_millis(300));
    assert!(
        api.wait_arrived("sendChatAction", 1, Duration::from_secs(5)),
        "typing is shown after the delivery"
    );
    let posted = std::time::Instant::now();
    let (code, _) = d.post_hook("alerts", &json!({"message_id": "w1", "sender_id": "u", "text": "t"}));
    assert_eq!(code, 202);
    let push = x.next_push(Duration::from_secs(10)).expect("the webhook message");
    let waited = posted.elapsed();
    assert_eq!(push["connector_channel_id"], json!(hook));
    println!("webhook push {waited:?} after its POST, with sendChatAction stalled");
    assert!(
        waited < Duration::from_millis(500),
        "a stalled Bot API held another channel's push for {waited:?}"
    );
}

#[test]
fn a_document_with_a_name_and_type_in_any_script_downloads() {
    let (d, api) = telegram("tg-unicode-file", "");
    let (mut x, _) = bound(&d);
    api.user_sends_document(BOT, CHAT, b"%PDF-1.7", "отчёт.pdf", "application/pdf\u{e9}");
    let push = x.next_push(Duration::from_secs(10)).expect("the document is pushed");
    let file = &push["payload"]["files"][0];
    assert_eq!(file["filename"], "отчёт.pdf");
    let mut resp = load_agent()
        .get(&d.url(file["download_url"].as_str().unwrap()))
        .call()
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let disposition = resp
        .headers()
        .get("Content-Disposition")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert!(disposition.contains("filename*=UTF-8''%D0%BE%D1%82"), "{disposition}");
    assert_eq!(resp.body_mut().read_to_vec().unwrap(), b"%PDF-1.7");
}

#[test]
fn rate_limits_are_retried_and_permanent_errors_come_back_with_a_stable_code() {
    let (d, api) = telegram("tg-retry", "");
    let (mut x, cch) = bound(&d);
    api.fail("sendMessage", 429, Some(1), 1);
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "after a pause"}), "r-1");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    assert_eq!(api.calls("sendMessage").len(), 2, "one 429, then the retry");
    api.fail("sendMessage", 400, None, 1);
    let b = x.tool(&cch, "imgate_message_send", json!({"text": "refused"}), "r-2");
    assert_eq!(b["error"]["code"], "upstream_rejected", "{b}");
    assert_no_secret(&b.to_string(), &[TOKEN], "a tool error");
}

#[test]
fn one_poller_per_bot_starts_with_the_first_binding_and_stops_with_the_last() {
    let (d, api) = telegram("tg-pollers", "");
    let (mut x, first, second) = bound_two(&d, &api);
    api.user_says(BOT, GROUP, "group hello", Duration::ZERO);
    let push = x.next_push(Duration::from_secs(10)).unwrap();
    assert_eq!(push["connector_channel_id"], json!(second));
    assert_eq!(push["payload"]["chat_type"], "group");
    assert_eq!(
        api.max_concurrent_polls(BOT),
        1,
        "both bindings share one getUpdates loop"
    );

    x.request("auth.logout", Some(&first), json!({}));
    x.request("auth.logout", Some(&second), json!({}));
    std::thread::sleep(Duration::from_millis(300));
    let before = api.calls("getUpdates").len();
    api.user_says(BOT, CHAT, "nobody listens", Duration::ZERO); // wakes a poll still waiting
    std::thread::sleep(Duration::from_millis(1500));
    let after = api.calls("getUpdates").len();
    assert!(
        after <= before + 1,
        "polling stops with the last binding ({before} -> {after})"
    );
    assert!(
        !d.dir.join("state/telegram/bot123456.token").exists(),
        "the token is forgotten"
    );
}

#[test]
fn the_offset_survives_a_restart_and_old_or_foreign_updates_are_counted_not_pushed() {
    let (d, api) = telegram("tg-offset", "");
    let (mut x, cch) = bound(&d);
    let connector_id = d.connector_id();
    let first = api.user_says(BOT, CHAT, "one", Duration::ZERO);
    x.next_push(Duration::from_secs(10)).unwrap();
    api.user_says(BOT, 31337, "from a chat nobody bound", Duration::ZERO);
    api.user_says(BOT, CHAT, "from yesterday", Duration::from_secs(2 * 3600));
    api.user_says(BOT, CHAT, "two", Duration::ZERO);
    assert_eq!(
        x.next_push(Duration::from_secs(10)).unwrap()["payload"]["raw_text"],
        "two"
    );
    // Let the barrier confirm both before leaving, so nothing is merely redelivered.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while get_json(&d.url("/status"))["channels"][0]["delivered"] != 2 {
        assert!(std::time::Instant::now() < deadline);
        x.recv_within(Duration::from_millis(50));
    }
    x.close();
    wait_log_written(&d);
    let mut d = d;
    d.kill();
    let d = d.restart();
    let polls = api.wait_calls("getUpdates", 1, Duration::from_secs(5));
    let offsets: Vec<u64> = polls.iter().filter_map(|p| p["offset"].as_u64()).collect();
    assert!(
        offsets.last().is_some_and(|o| *o > first + 3),
        "polling resumes after the last update: {offsets:?}"
    );
    let mut y = d.xagent();
    y.hello(&connector_id);
    y.open(Some(&cch));
    assert!(
        y.next_push(Duration::from_secs(1)).is_none(),
        "nothing is accepted twice"
    );
    let s = get_json(&d.url("/status"));
    let ch = s["channels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["connector_channel_id"] == json!(cch))
        .unwrap()
        .clone();
    assert_eq!(
        ch["expired"], 1,
        "the update older than the TTL is counted expired: {s}"
    );
    let (_, metrics) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
    assert!(metrics.contains("imgate_telegram_unbound_updates_total"), "{metrics}");
}

#[test]
fn a_photo_arrives_as_a_cached_file_served_by_its_ref_alone() {
    let (d, api) = telegram("tg-files", "");
    let (mut x, _) = bound(&d);
    let photo: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
    api.user_sends_photo(BOT, CHAT, &photo, "the front door");
    let push = x
        .next_push(Duration::from_secs(10))
        .expect("the photo message is pushed");
    let p = &push["payload"];
    assert_eq!(p["message_type"], "image");
    assert_eq!(p["raw_text"], "the front door");
    let file = &p["files"][0];
    assert_eq!(file["type"], "image");
    assert_eq!(file["byte_size"], 5000);
    assert_eq!(file["mime_type"], "image/jpeg");
    let url = file["download_url"].as_str().unwrap().to_string();
    assert!(url.starts_with("/files/refs/file_"), "{url}");
    assert_no_secret(&push.to_string(), &[TOKEN, "api.telegram", &api.base], "a file item");
    let mut resp = load_agent().get(&d.url(&url)).call().unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(
        resp.body_mut().read_to_vec().unwrap(),
        photo,
        "the cached bytes are served"
    );
    // Bytes lost from the disk: a 404, and the ref (a credential) stays out of the log.
    let file_ref = url.trim_start_matches("/files/refs/");
    std::fs::rename(d.dir.join("state/files").join(file_ref), d.dir.join("moved")).unwrap();
    assert_eq!(http_get(&d.url(&url), &[]).0, 404);
    assert!(d.log_shows("cached image file cannot be read", Duration::from_secs(2)));
    assert_no_secret(&d.log(), &[file_ref], "the log");
    std::fs::rename(d.dir.join("moved"), d.dir.join("state/files").join(file_ref)).unwrap();
    assert_eq!(
        http_get(&d.url("/files/refs/file_0123456789abcdef0123456789abcdef"), &[]).0,
        404
    );
}

/// Upload for this channel, then send it: a photo, a document, never a forged ref.
#[test]
fn uploaded_files_go_out_with_the_file_tool() {
    let (d, api) = telegram("tg-upload", "");
    let (mut x, cch) = bound(&d);
    let png: &[u8] = b"\x89PNG-bytes";
    let wrong = upload(&d, &cch, "wrong", "plan.png", "image/png", png);
    assert_eq!(wrong.0, 401, "{wrong:?}");
    let (status, up) = upload_as(&d, &cch, "plan.png", "image/png", png);
    assert_eq!(status, 200, "{up}");
    assert_eq!(up["file_type"], "image");
    assert_eq!(up["filename"], "plan.png");
    assert_eq!(up["byte_size"], 10);
    let file_ref = up["file_ref"].as_str().unwrap().to_string();
    assert_eq!(
        http_get(&d.url(&format!("/files/refs/{file_ref}")), &[]).0,
        404,
        "uploads are not downloadable"
    );

    let a = x.tool(
        &cch,
        "imgate_file_send",
        json!({"file_ref": file_ref, "caption": "here"}),
        "f-1",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let uploads = api.uploads();
    let (method, ctype, raw) = uploads.last().unwrap();
    assert_eq!(method, "sendPhoto");
    assert!(ctype.starts_with("multipart/form-data; boundary="));
    assert!(
        raw.windows(10).any(|w| w == b"\x89PNG-bytes"),
        "the file bytes go to Telegram"
    );
    // A document goes as sendDocument.
    let (_, doc) = upload_as(&d, &cch, "report.pdf", "application/pdf", b"%PDF-1.4");
    assert_eq!(doc["file_type"], "file");
    let a = x.tool(&cch, "imgate_file_send", json!({"file_ref": doc["file_ref"]}), "f-3");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    assert_eq!(api.uploads().last().unwrap().0, "sendDocument");
    let forged = x.tool(
        &cch,
        "imgate_file_send",
        json!({"file_ref": "file_0123456789abcdef0123456789abcdef"}),
        "f-2",
    );
    assert_eq!(forged["error"]["code"], "file_ref_invalid");

    let desc = x.request("connection.descriptor.get", Some(&cch), json!({}));
    let tools = desc["payload"]["connection_descriptor"]["tools"]
        .as_array()
        .unwrap()
        .clone();
    assert!(
        tools
            .iter()
            .any(|t| t["tool_id"] == "imgate_file_send" && t["status"] == "available"),
        "{tools:?}"
    );
}

#[test]
fn webhook_mode_takes_updates_with_the_right_secret_only_and_does_not_poll() {
    let api = BotApi::start();
    api.add_bot(TOKEN, BOT, "imgate_test_bot");
    api.add_chat(BOT, json!({"id": CHAT, "type": "private", "first_name": "Ada"}));
    let dir = temp_dir("tg-webhook");
    let port = free_port();
    let conf = config_text(port, &dir, None, "").replace(
        "log_level = debug",
        &format!("log_level = debug\npublic_url = http://127.0.0.1:{port}"),
    ) + &format!(
        "[telegram]\napi_base = {}\nbot_token = {TOKEN}\nmode = webhook\nwebhook_secret = hook-secret-tg-1\n",
        api.base
    );
    let d = Daemon::start(&dir, &conf);
    let set = api.wait_calls("setWebhook", 1, Duration::from_secs(5));
    assert_eq!(set[0]["url"], format!("http://127.0.0.1:{port}/telegram/webhook"));
    assert_eq!(set[0]["secret_token"], "hook-secret-tg-1");

    let (_, card) = http_get(&d.url("/connector-card.json"), &[]);
    let card: Value = serde_json::from_str(&card).unwrap();
    let token = &card["auth_flows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == "telegram_bot_binding")
        .expect("the Telegram flow")["fields"][0];
    assert_eq!(
        token["required"], false,
        "the device's bot: the token may be left empty: {token}"
    );
    assert!(
        token["help_text"].as_str().unwrap().starts_with("Leave empty"),
        "{token}"
    );

    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let ok = bind(&mut x, &cch, "", &CHAT.to_string());
    assert_eq!(
        ok["payload"]["status"], "authenticated",
        "the device's default bot: {ok}"
    );
    // A fresh date, so the update is not stale.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let update = json!({"update_id": 9001, "message": {"message_id": 5, "from": {"id": 1, "first_name": "Ada"},
        "chat": {"id": CHAT, "type": "private"}, "date": now, "text": "pushed to us"}});
    let url = d.url("/telegram/webhook");
    assert_eq!(
        http_post(
            &url,
            &[("X-Telegram-Bot-Api-Secret-Token", "wrong")],
            &update.to_string()
        )
        .0,
        401
    );
    assert_eq!(http_post(&url, &[], &update.to_string()).0, 401);
    assert_eq!(
        http_post(&url, &[("X-Telegram-Bot-Api-Secret-Token", "hook-secret-tg-1")], "{bad").0,
        400
    );
    let (code, _) = http_post(
        &url,
        &[("X-Telegram-Bot-Api-Secret-Token", "hook-secret-tg-1")],
        &update.to_string(),
    );
    assert_eq!(code, 200);
    let push = x
        .next_push(Duration::from_secs(5))
        .expect("the pushed update reaches xAgent");
    assert_eq!(push["payload"]["raw_text"], "pushed to us");
    // Telegram retries: the same update is accepted once.
    http_post(
        &url,
        &[("X-Telegram-Bot-Api-Secret-Token", "hook-secret-tg-1")],
        &update.to_string(),
    );
    assert!(x.next_push(Duration::from_millis(800)).is_none());
    assert!(
        api.calls("getUpdates").is_empty(),
        "the default bot is not polled in webhook mode"
    );
    assert_no_secret(&d.log(), &[TOKEN, "hook-secret-tg-1"], "the trace log");
}

#[test]
fn sigkill_between_get_updates_and_commit_neither_skips_nor_accepts_twice() {
    let (d, api) = telegram("tg-crash", "");
    let (x, cch) = bound(&d);
    let connector_id = d.connector_id();
    x.close();
    let api = std::sync::Arc::new(api);
    let mut sent = 0usize;
    let mut d = d;
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    for round in 0..10 {
        if round > 0 {
            d = d.restart();
        }
        // The user keeps writing while imgate polls; imgate dies at a random moment.
        for _ in 0..20 {
            api.user_says(BOT, CHAT, &format!("msg {sent:04}"), Duration::ZERO);
            sent += 1;
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            std::thread::sleep(Duration::from_millis(seed % 15));
        }
        d.kill();
    }
    let d = d.restart();
    let mut y = d.xagent();
    y.hello(&connector_id);
    y.open(Some(&cch));
    let mut texts = std::collections::BTreeSet::new();
    // For as long as they keep coming (a new text pushed, fewer pending): a busy machine is
    // slower, not red.
    let mut progress = Progress::new(QUIET);
    loop {
        while let Some(p) = y.next_push(Duration::from_millis(300)) {
            texts.insert(p["payload"]["raw_text"].as_str().unwrap().to_string());
        }
        let s = get_json(&d.url("/status"));
        let c = s["channels"][0].clone();
        if c["pending"] == 0 && texts.len() >= sent {
            assert_eq!(c["delivered"], sent as u64, "every update accepted exactly once: {c}");
            break;
        }
        assert!(
            progress.moving((texts.len(), c["pending"].clone())),
            "{} of {sent} pushed, and none more for {QUIET:?}: {c}",
            texts.len()
        );
    }
    assert_eq!(texts.len(), sent, "no update was skipped");
}

#[test]
fn the_file_tool_is_declared_with_telegram_and_refused_on_a_webhook_channel() {
    let (d, _api) = telegram("tg-cross", "");
    let (mut x, hook_ch) = d.bound_xagent();
    let desc = x.request("connection.descriptor.get", Some(&hook_ch), json!({}));
    let tools = desc["payload"]["connection_descriptor"]["tools"]
        .as_array()
        .unwrap()
        .clone();
    let file = tools
        .iter()
        .find(|t| t["tool_id"] == "imgate_file_send")
        .expect("listed, as the Card declares it");
    assert_eq!(file["status"], "unavailable");
    let a = x.tool(
        &hook_ch,
        "imgate_file_send",
        json!({"file_ref": "file_0123456789abcdef0123456789abcdef"}),
        "x-1",
    );
    assert_eq!(a["error"]["code"], "connector_channel_unavailable", "{a}");
}

#[test]
fn a_file_ref_stops_working_when_the_file_ttl_ends() {
    let (d, api) = telegram("tg-file-ttl", "[files]\nttl = 1s\n");
    let (mut x, _) = bound(&d);
    api.user_sends_photo(BOT, CHAT, b"short-lived", "");
    let push = x.next_push(Duration::from_secs(10)).unwrap();
    let url = push["payload"]["files"][0]["download_url"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(http_get(&d.url(&url), &[]).0, 200);
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(http_get(&d.url(&url), &[]).0, 404, "an expired ref is refused");
}

#[test]
fn polling_through_5xx_and_429_keeps_its_place_and_delivers_each_message_once() {
    let (d, api) = telegram("tg-poll-faults", "");
    // Waiting at Telegram before the binding: the first polls meet a sick Bot API.
    api.user_says(BOT, CHAT, "one", Duration::ZERO);
    let last = api.user_says(BOT, CHAT, "two", Duration::ZERO);
    api.fail("getUpdates", 502, None, 2);
    api.fail("getUpdates", 429, Some(1), 1);
    let (mut x, _) = bound(&d);

    let mut texts = Vec::new();
    while let Some(p) = x.next_push(Duration::from_secs(15)) {
        texts.push(p["payload"]["raw_text"].as_str().unwrap().to_string());
        if texts.len() == 2 {
            break;
        }
    }
    assert_eq!(texts, ["one", "two"], "both arrive, in order, after the errors");
    let polls = api.calls("getUpdates");
    assert!(polls.len() >= 4, "three failed polls, then one that worked: {polls:?}");
    for p in &polls[..4] {
        assert_eq!(
            p["offset"].as_u64().unwrap_or(0),
            0,
            "nothing is confirmed to Telegram before it is stored: {polls:?}"
        );
    }
    let next = api.wait_calls("getUpdates", 5, Duration::from_secs(5));
    assert_eq!(
        next[4]["offset"],
        json!(last + 1),
        "the offset moves past exactly what was stored"
    );

    // A failure in the middle of the stream neither loses nor repeats a message.
    api.fail("getUpdates", 500, None, 1);
    api.user_says(BOT, CHAT, "three", Duration::ZERO);
    let p = x.next_push(Duration::from_secs(15)).expect("three arrives");
    assert_eq!(p["payload"]["raw_text"], "three");
    assert!(
        x.next_push(Duration::from_secs(3)).is_none(),
        "no message is pushed twice"
    );
    let log = d.log();
    assert_eq!(
        log.matches("getUpdates failed: Telegram answered 502").count(),
        1,
        "a repeated error is logged once:\n{log}"
    );
    assert!(log.contains("polling works again"), "{log}");
}

#[test]
fn a_stalled_bot_api_gets_a_tool_error_in_time_and_a_stalled_poll_is_retried() {
    let (d, api) = telegram("tg-stall", "");
    // Telegram takes the connection and never answers: the first poll hangs past its timeout.
    api.stall("getUpdates", Duration::from_secs(45), 1);
    api.user_says(BOT, CHAT, "while the API hung", Duration::ZERO);
    let (mut x, cch) = bound(&d);

    api.stall("sendMessage", Duration::from_secs(45), 3);
    let (a, took) = x.timed_tool(
        &cch,
        "imgate_message_send",
        json!({"text": "hello?"}),
        Duration::from_secs(40),
    );
    assert_eq!(a["error"]["code"], "upstream_unreachable", "{a}");
    assert!(
        took < Duration::from_secs(25),
        "the tool answered after {took:?}; its deadline is 20 s"
    );
    assert_no_secret(&a.to_string(), &[TOKEN], "a tool error");

    // The hung poll times out (25 s long poll + 10 s margin) and the next one gets the message.
    let p = x
        .next_push(Duration::from_secs(40))
        .expect("the message arrives after the stalled poll");
    assert_eq!(p["payload"]["raw_text"], "while the API hung");
    assert!(
        d.log_shows("getUpdates failed: Telegram unreachable", Duration::from_secs(5)),
        "{}",
        d.log()
    );
    assert_no_secret(&d.log(), &[TOKEN], "the log");
}

#[test]
fn a_file_uploaded_for_one_channel_is_refused_on_another() {
    let (d, api) = telegram("tg-foreign-file", "");
    let (mut x, first, second) = bound_two(&d, &api);
    let (status, up) = upload_as(&d, &first, "notes.txt", "text/plain", b"for the first chat");
    assert_eq!(status, 200, "{up}");
    let file_ref = up["file_ref"].as_str().unwrap();

    let a = x.tool(&second, "imgate_file_send", json!({"file_ref": file_ref}), "ff-1");
    assert_eq!(a["error"]["code"], "file_ref_invalid", "{a}");
    assert!(api.uploads().is_empty(), "nothing went to Telegram");
    let b = x.tool(&first, "imgate_file_send", json!({"file_ref": file_ref}), "ff-2");
    assert_eq!(b["payload"]["result"]["status"], "sent", "{b}");
    assert_eq!(api.uploads().len(), 1);
}

#[test]
fn a_photo_still_arrives_as_a_file_when_get_file_first_fails() {
    let (d, api) = telegram("tg-getfile-retry", "");
    let (mut x, _) = bound(&d);
    api.fail("getFile", 502, None, 1);
    api.fail("getFile", 429, Some(1), 1);
    let photo = vec![7u8; 1000];
    api.user_sends_photo(BOT, CHAT, &photo, "retry me");
    let push = x
        .next_push(Duration::from_secs(15))
        .expect("the photo message is pushed");
    let p = &push["payload"];
    assert_eq!(p["raw_text"], "retry me", "no 'not available' note: {p}");
    assert_eq!(p["files"][0]["byte_size"], 1000, "{p}");
    assert_eq!(api.calls("getFile").len(), 3, "a 502, a 429, then the answer");

    // A permanent refusal is not retried: the message goes on with a note.
    api.fail("getFile", 400, None, 1);
    api.user_sends_photo(BOT, CHAT, &photo, "broken");
    let push = x.next_push(Duration::from_secs(15)).expect("pushed with a note");
    let text = push["payload"]["raw_text"].as_str().unwrap();
    assert!(text.starts_with("broken [image not available"), "{text}");
    assert_eq!(api.calls("getFile").len(), 4);
    assert_no_secret(&push.to_string(), &[TOKEN], "a note");
}

#[test]
fn uploads_over_the_file_cap_get_413_and_past_the_cache_cap_503() {
    let (d, _api) = telegram(
        "tg-file-caps",
        "[files]\nmax_file_bytes = 1KiB\nmax_bytes_total = 2KiB\n",
    );
    let (_x, cch) = bound(&d);
    let big = upload_as(&d, &cch, "big.bin", "application/octet-stream", &[1; 1025]);
    assert_eq!(
        big,
        (413, json!({"error": "too_large"})),
        "one byte over max_file_bytes"
    );
    for i in 0..2 {
        let (status, up) = upload_as(&d, &cch, "part.bin", "application/octet-stream", &[2; 1000]);
        assert_eq!(status, 200, "upload {i}: {up}");
    }
    for _ in 0..3 {
        let full = upload_as(&d, &cch, "more.bin", "application/octet-stream", &[3; 100]);
        assert_eq!(
            full,
            (503, json!({"error": "capacity_exceeded"})),
            "2,000 of 2,048 bytes are held: 100 more do not fit"
        );
    }
    assert!(d.log_shows("files: cache full", Duration::from_secs(5)), "{}", d.log());
    assert_eq!(
        d.log().matches("files: cache full").count(),
        1,
        "refusals at the client's rate are one line a minute:\n{}",
        d.log()
    );
    let files = std::fs::read_dir(d.dir.join("state/files")).unwrap().count();
    assert_eq!(files, 2, "a refused upload leaves no bytes behind");
}

#[test]
fn documents_and_photos_of_every_size_up_to_max_file_bytes_download_whole() {
    let (d, api) = telegram("tg-sizes", MAX_FILE_CONF);
    let (mut x, _cch) = bound(&d);
    every_size_downloads_whole(&d, &mut x, |i, bytes| {
        if i == 0 {
            api.user_sends_photo(BOT, CHAT, bytes, "a photo");
        } else {
            api.user_sends_document(BOT, CHAT, bytes, "report.pdf", "application/pdf");
        }
    });
    // One byte over the cap: the message still arrives, its text says why the file did not.
    api.user_sends_document(
        BOT,
        CHAT,
        &patterned(MAX_FILE + 1, 9),
        "big.bin",
        "application/octet-stream",
    );
    let push = x.next_push(Duration::from_secs(20)).expect("the message is pushed");
    let text = push["payload"]["raw_text"].as_str().unwrap_or_default();
    assert!(text.contains("max_file_bytes"), "{push}");
}

/// A `retry_after` past what an `Instant` can hold once crashed imgate: `Instant + Duration`
/// overflowed. Clamped to a minute, the wait now passes the fetch's deadline: a note, no crash.
#[test]
fn a_retry_after_that_overflows_the_clock_does_not_crash_imgate() {
    let (d, api) = telegram("tg-retry-overflow", "");
    let (mut x, _) = bound(&d);
    api.fail("getFile", 429, Some(u64::MAX), 1);
    api.user_sends_photo(BOT, CHAT, &[7u8; 1000], "overflow");
    let push = x.next_push(Duration::from_secs(40)).expect("the message is pushed");
    let text = push["payload"]["raw_text"].as_str().unwrap();
    assert!(text.starts_with("overflow [image not available"), "{text}");
    let (code, _) = d.post_hook("alerts", &json!({"message_id": "alive", "sender_id": "u"}));
    assert_eq!(code, 202, "still serving:\n{}", d.log());
}

/// getUpdates told to wait 31 years once stopped polling for good; polling now goes on after
/// the clamp (a minute).
#[test]
fn a_huge_retry_after_on_get_updates_delays_polling_by_the_clamp_at_most() {
    let (d, api) = telegram("tg-retry-huge", "");
    api.user_says(BOT, CHAT, "after the wait", Duration::ZERO);
    api.fail("getUpdates", 429, Some(1_000_000_000), 1);
    let (mut x, _) = bound(&d);
    let push = x
        .next_push(Duration::from_secs(120))
        .expect("polling resumes within the clamp");
    assert_eq!(push["payload"]["raw_text"], "after the wait");
    assert!(api.calls("getUpdates").len() >= 2, "the refused poll, then the next");
}

/// An answer past 1 MiB is refused unread (an 8 MB `getUpdates` once held 110 MiB): the poller
/// asks for fewer updates until the answer fits, and back up after; nothing is skipped.
#[test]
fn updates_too_large_for_one_answer_are_asked_for_in_smaller_batches_and_none_is_lost() {
    let (d, api) = telegram("tg-big-batch", "");
    // 100 messages of 4,096 three-byte characters: about 1.2 MB in one answer of 100.
    let long = "€".repeat(4096);
    for i in 0..100 {
        api.user_says(BOT, CHAT, &format!("{i} {long}"), Duration::ZERO);
    }
    let (mut x, _) = bound(&d);
    for i in 0..100 {
        let push = x.next_push(Duration::from_secs(60)).expect("every message is pushed");
        let text = push["payload"]["raw_text"].as_str().unwrap_or_default();
        assert!(
            text.starts_with(&format!("{i} €")),
            "message {i} in order: {}",
            text.chars().take(20).collect::<String>()
        );
    }
    let limits: Vec<u64> = api
        .calls("getUpdates")
        .iter()
        .map(|c| c["limit"].as_u64().unwrap_or(100))
        .collect();
    assert!(limits.iter().any(|l| *l < 100), "asked for fewer: {limits:?}");
    assert!(limits.iter().all(|l| *l >= 1), "{limits:?}");
    // And as many as before once the answers fit again.
    let smaller = limits.iter().position(|l| *l < 100).unwrap_or(0);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !api.calls("getUpdates")[smaller..]
        .iter()
        .any(|c| c["limit"].as_u64() == Some(100))
    {
        assert!(std::time::Instant::now() < deadline, "the batch grew back to 100");
        std::thread::sleep(Duration::from_millis(50));
    }
}
