//! IM profile v2 against a simulator of xAgent written from the v2 document: inbound
//! `chat.message`s that leave only on their ack (accepted, duplicate, rejected retryable and
//! not), redelivery after a disconnect and after SIGKILL, xAgent's own messages to a webhook
//! and to Telegram (once, conflicts refused), deltas streamed into one Telegram message,
//! activity as typing. Every packet is checked against the envelope schema by the simulator.

use std::time::{Duration, Instant};

use crate::common::botapi::BotApi;
use crate::common::*;
use serde_json::{json, Value};

const V2: &str = "[xagent]\nprofile = xagent.im.v2\n";

fn daemon(tag: &str, extra: &str) -> Daemon {
    let dir = temp_dir(tag);
    Daemon::start(&dir, &config_text(free_port(), &dir, None, &format!("{V2}{extra}")))
}

fn post(d: &Daemon, id: &str, text: &str) {
    let (code, body) = d.post_hook(
        "alerts",
        &json!({"message_id": id, "sender_id": "u1", "sender_name": "Ada", "text": text}),
    );
    assert_eq!(code, 202, "{body}");
}

fn channel_status(d: &Daemon) -> Value {
    get_json(&d.url("/status"))["channels"][0].clone()
}

#[test]
fn the_card_declares_only_v2_and_a_hello_without_it_is_refused_plainly() {
    let d = daemon("v2-card", "");
    let (_, body) = http_get(&d.url("/connector-card.json"), &[]);
    let card: Value = serde_json::from_str(&body).unwrap();
    assert_card(&card);
    assert_eq!(card["supports"]["profiles"], json!(["xagent.im.v2"]));
    assert!(card["tools"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["profile"] == "xagent.im.v2"));
    let (_, skill) = http_get(&d.url("/skill.md"), &[]);
    assert!(
        skill.contains("chat.message") && !skill.contains("message.push"),
        "{skill}"
    );
    let mut x = d.xagent();
    let a = x.request(
        "connector.hello",
        None,
        json!({"connector_card_id": "im.imgate", "protocol_version": "3.0", "supported_profiles": ["xagent.im.v1"]}),
    );
    assert_eq!(a["type"], "error");
    assert_eq!(a["error"]["code"], "profile_not_supported");
    assert!(a["error"]["message"].as_str().unwrap().contains("xagent.im.v2"), "{a}");
    drop(x);
    let mut x2 = d.xagent();
    x2.hello("");
    let (_, open) = x2.open(None);
    assert_eq!(
        open["payload"]["connection_descriptor"]["connection"]["profiles"],
        json!(["xagent.im.v2"])
    );
}

#[test]
fn inbound_messages_go_one_at_a_time_and_leave_only_on_their_ack() {
    let d = daemon("v2-in", "");
    let (mut x, cch) = d.bound_xagent();
    for (id, text) in [("m1", "first"), ("m2", "second"), ("m3", "third")] {
        post(&d, id, text);
    }
    let m1 = x.next_chat(Duration::from_secs(10)).expect("m1");
    assert_eq!(m1["connector_channel_id"], json!(cch));
    let p = &m1["payload"];
    assert_eq!(
        (p["message_id"].as_str(), p["text"].as_str()),
        (Some("m1"), Some("first"))
    );
    assert!(p["created_at"].is_u64());
    for leak in [
        "sender_id",
        "chat_id",
        "session_id",
        "user_id",
        "connector_id",
        "role",
        "reply",
    ] {
        assert!(p.get(leak).is_none(), "no routing fact `{leak}` in {p}");
    }
    assert!(
        x.next_chat(Duration::from_millis(500)).is_none(),
        "one unacked message per channel"
    );
    x.ack_chat(&m1, "accepted", None, false);
    let m2 = x.next_chat(Duration::from_secs(5)).expect("m2 after m1's ack");
    assert_eq!(m2["payload"]["message_id"], "m2");
    x.ack_chat(&m2, "duplicate", None, false);
    let m3 = x.next_chat(Duration::from_secs(5)).expect("m3");
    assert_eq!(m3["payload"]["message_id"], "m3");
    // An ack that answers nothing in flight changes nothing.
    let mut wrong = m3.clone();
    wrong["packet_id"] = json!("pkt_not_sent");
    x.ack_chat(&wrong, "accepted", None, false);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(channel_status(&d)["pending"], 1, "m3 still waits for its own ack");
    x.ack_chat(&m3, "accepted", None, false);
    wait_until("all delivered", || channel_status(&d)["delivered"] == 3);
    assert_eq!(channel_status(&d)["pending"], 0);
}

#[test]
fn a_retryable_rejection_is_sent_again_after_a_backoff_and_counted() {
    let d = daemon("v2-retry", "");
    let (mut x, _) = d.bound_xagent();
    post(&d, "r1", "try me");
    let first = x.next_chat(Duration::from_secs(10)).unwrap();
    let rejected_at = Instant::now();
    x.ack_chat(&first, "rejected", Some("busy"), true);
    let again = x.next_chat(Duration::from_secs(10)).expect("sent again");
    let waited = rejected_at.elapsed();
    assert_eq!(again["payload"]["message_id"], "r1", "the same message_id");
    assert_eq!(again["payload"]["created_at"], first["payload"]["created_at"]);
    assert_ne!(again["packet_id"], first["packet_id"], "a new transmission");
    assert!(
        waited >= Duration::from_millis(800),
        "after a backoff, not at once: {waited:?}"
    );
    let st = channel_status(&d);
    assert_eq!(st["attempts"], 1, "{st}");
    assert!(st["last_error"].as_str().unwrap().contains("busy"), "{st}");
    x.ack_chat(&again, "accepted", None, false);
    wait_until("delivered", || channel_status(&d)["delivered"] == 1);
}

#[test]
fn a_final_rejection_is_kept_failed_visible_and_never_retried() {
    let d = daemon("v2-fail", "");
    let (mut x, _) = d.bound_xagent();
    post(&d, "f1", "refuse me");
    post(&d, "f2", "next");
    let f1 = x.next_chat(Duration::from_secs(10)).unwrap();
    x.ack_chat(&f1, "rejected", Some("invalid_content"), false);
    let f2 = x.next_chat(Duration::from_secs(5)).expect("the next message goes on");
    assert_eq!(f2["payload"]["message_id"], "f2");
    x.ack_chat(&f2, "accepted", None, false);
    assert!(x.next_chat(Duration::from_secs(3)).is_none(), "f1 is never sent again");
    wait_until("counted", || channel_status(&d)["failed"] == 1);
    let st = channel_status(&d);
    assert_eq!(
        (st["delivered"].as_u64(), st["pending"].as_u64()),
        (Some(1), Some(0)),
        "{st}"
    );
    assert!(
        st["last_failure"].as_str().unwrap().starts_with("f1: invalid_content"),
        "{st}"
    );
    let (_, metrics) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("imgate_channel_failed_total{") && l.ends_with(" 1")),
        "{metrics}"
    );
    assert!(metrics.contains("code=\"invalid_content\"} 1"), "{metrics}");
    // The sender's retry of f1 is a duplicate: it was accepted once.
    let (code, _) = d.post_hook("alerts", &json!({"message_id": "f1", "sender_id": "u1"}));
    assert_eq!(code, 200);
}

#[test]
fn an_unacked_message_is_sent_again_after_a_reconnect_and_after_sigkill() {
    let d = daemon("v2-redeliver", "");
    let connector_id = d.connector_id();
    let (mut x, cch) = d.bound_xagent();
    post(&d, "k1", "survive");
    let first = x.next_chat(Duration::from_secs(10)).unwrap();
    x.close();
    let mut y = d.xagent();
    y.hello(&connector_id);
    y.open(Some(&cch));
    let again = y.next_chat(Duration::from_secs(10)).expect("after a reconnect");
    assert_eq!(again["payload"], first["payload"], "same message_id, same content");
    // Now between the send and the ack, the process dies (once the first attempt is on disk).
    wait_log_written(&d);
    let mut d = d;
    d.kill();
    let d = d.restart();
    let mut z = d.xagent();
    z.hello(&connector_id);
    z.open(Some(&cch));
    let after = z.next_chat(Duration::from_secs(10)).expect("after SIGKILL");
    assert_eq!(after["payload"], first["payload"]);
    z.ack_chat(&after, "accepted", None, false);
    wait_until("delivered", || channel_status(&d)["delivered"] == 1);
    assert!(channel_status(&d)["attempts"].as_u64().unwrap() >= 1);
}

/// Uploads bytes for `cch` through `/files/uploads`; its `file_ref`.
fn upload(d: &Daemon, cch: &str, name: &str, mime: &str, bytes: &[u8]) -> String {
    let boundary = "v2b0undary";
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\nContent-Type: {mime}\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(bytes);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let mut r = load_agent()
        .post(&d.url("/files/uploads"))
        .header("Authorization", &format!("Bearer {API_KEY}"))
        .header("X-XAgent-Connector-Channel-ID", cch)
        .header("Content-Type", &format!("multipart/form-data; boundary={boundary}"))
        .send(&body[..])
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
    v["file_ref"].as_str().unwrap().to_string()
}

#[test]
fn xagent_messages_reach_a_webhook_once_with_files_and_conflicts_are_refused() {
    let ok = ReplyReceiver::start(200);
    let failing = ReplyReceiver::start(503);
    let refusing = ReplyReceiver::start(400);
    let dir = temp_dir("v2-out-hook");
    let extra = format!(
        "{V2}[webhook.down]\nsecret = s-down\nreply_url = {}\n[webhook.no]\nsecret = s-no\nreply_url = {}\n",
        failing.url, refusing.url
    );
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, Some(&ok.url), &extra));
    let (mut x, cch) = d.bound_xagent();
    let ack = x.say(&cch, "a1", "hello from the agent", json!([]));
    assert_eq!(ack["payload"]["status"], "accepted", "{ack}");
    let sent = ok.rx.recv_timeout(Duration::from_secs(5)).unwrap();
    let body: Value = serde_json::from_str(&sent.body).unwrap();
    assert_eq!(body["type"], "message");
    assert_eq!(body["message_id"], "a1");
    assert_eq!(body["text"], "hello from the agent");
    assert!(sent.signature.is_some());
    // The same message again: duplicate, nothing sent.
    let again = x.say(&cch, "a1", "hello from the agent", json!([]));
    assert_eq!(again["payload"]["status"], "duplicate");
    assert!(ok.rx.recv_timeout(Duration::from_millis(500)).is_err(), "sent once");
    // Another text under the same message_id: refused for good.
    let conflict = x.say(&cch, "a1", "something else", json!([]));
    assert_eq!(conflict["payload"]["status"], "rejected");
    assert_eq!(conflict["payload"]["code"], "message_conflict");
    assert_eq!(conflict["payload"]["retryable"], false);
    // A file uploaded for the channel goes with the message, downloadable by its URL.
    let file_ref = upload(&d, &cch, "report.txt", "text/plain", b"numbers");
    let ack = x.say(&cch, "a2", "", json!([{"type": "file", "file_ref": file_ref}]));
    assert_eq!(ack["payload"]["status"], "accepted", "{ack}");
    let body: Value = serde_json::from_str(&ok.rx.recv_timeout(Duration::from_secs(5)).unwrap().body).unwrap();
    let url = body["files"][0]["download_url"].as_str().unwrap();
    assert_eq!(http_get(&d.url(url), &[]), (200, "numbers".to_string()));
    // The target's answer decides whether a rejection may be retried.
    for (endpoint, secret, retryable) in [("down", "s-down", true), ("no", "s-no", false)] {
        let (other, _) = x.open(None);
        let a = x.bind_webhook(&other, endpoint, secret);
        assert_eq!(a["payload"]["status"], "authenticated", "{a}");
        let ack = x.say(&other, "b1", "hi", json!([]));
        assert_eq!(ack["payload"]["status"], "rejected", "{ack}");
        assert_eq!(ack["payload"]["retryable"], retryable, "{endpoint}: {ack}");
    }
}

#[test]
fn a_webhook_gets_deltas_only_when_it_asks_for_them_and_always_one_final() {
    let finals_only = ReplyReceiver::start(200);
    let live = ReplyReceiver::start(200);
    let dir = temp_dir("v2-hook-stream");
    let extra = format!(
        "{V2}[webhook.live]\nsecret = s-live\nreply_url = {}\nstream = true\n",
        live.url
    );
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, Some(&finals_only.url), &extra));
    let (mut x, quiet) = d.bound_xagent();
    let (streaming, _) = x.open(None);
    assert_eq!(
        x.bind_webhook(&streaming, "live", "s-live")["payload"]["status"],
        "authenticated"
    );
    for cch in [&quiet, &streaming] {
        x.delta(cch, "d1", 1, "Hel");
        x.delta(cch, "d1", 2, "lo");
        assert_eq!(x.say(cch, "d1", "Hello", json!([]))["payload"]["status"], "accepted");
    }
    let bodies = |r: &ReplyReceiver| -> Vec<Value> {
        std::iter::from_fn(|| r.rx.recv_timeout(Duration::from_millis(500)).ok())
            .map(|o| serde_json::from_str(&o.body).unwrap())
            .collect()
    };
    let quiet_bodies = bodies(&finals_only);
    assert_eq!(quiet_bodies.len(), 1, "finals only: {quiet_bodies:?}");
    assert_eq!(
        (quiet_bodies[0]["type"].as_str(), quiet_bodies[0]["text"].as_str()),
        (Some("message"), Some("Hello"))
    );
    let live_bodies = bodies(&live);
    let kinds: Vec<&str> = live_bodies.iter().map(|b| b["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["delta", "delta", "message"], "{live_bodies:?}");
    assert_eq!(
        (live_bodies[1]["sequence"].as_u64(), live_bodies[1]["text"].as_str()),
        (Some(2), Some("lo"))
    );
}

const TOKEN: &str = "654321:AAv2-bot-token";
const BOT: u64 = 654321;
const CHAT: i64 = 5_550_012_345;

fn telegram(tag: &str) -> (Daemon, BotApi, Sim, String) {
    let api = BotApi::start();
    api.add_bot(TOKEN, BOT, "imgate_v2_bot");
    api.add_chat(BOT, json!({"id": CHAT, "type": "private", "first_name": "Ada"}));
    let d = daemon(tag, &format!("[telegram]\napi_base = {}\n", api.base));
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let a = x.request(
        "auth.start",
        Some(&cch),
        json!({"flow_id": "telegram_bot_binding", "input": {"bot_token": TOKEN, "chat_id": CHAT.to_string()}}),
    );
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    (d, api, x, cch)
}

#[test]
fn deltas_stream_into_one_telegram_message_that_the_final_replaces() {
    let (_d, api, mut x, cch) = telegram("v2-tg-stream");
    x.activity(&cch, "thinking", None);
    assert!(
        api.wait_arrived("sendChatAction", 1, Duration::from_secs(5)),
        "typing while thinking"
    );
    x.delta(&cch, "s1", 1, "The door");
    x.delta(&cch, "s1", 2, " is");
    x.delta(&cch, "s1", 2, " is"); // a retransmission changes nothing
    x.delta(&cch, "s1", 3, " locked");
    let first = api.wait_calls("sendMessage", 1, Duration::from_secs(5));
    assert_eq!(first[0]["text"], "The door", "the first delta sends a message");
    let ack = x.say(&cch, "s1", "The door is locked.", json!([]));
    assert_eq!(ack["payload"]["status"], "accepted", "{ack}");
    assert_eq!(api.calls("sendMessage").len(), 1, "never a second message");
    let edits = api.calls("editMessageText");
    assert!(!edits.is_empty());
    let id = edits.last().unwrap()["message_id"].as_u64().unwrap();
    assert_eq!(
        api.text_of(CHAT, id).as_deref(),
        Some("The door is locked."),
        "the final replaced the text"
    );
    // A late delta of a completed message starts nothing.
    x.delta(&cch, "s1", 4, " twice");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(api.calls("sendMessage").len(), 1);
}

#[test]
fn a_final_without_deltas_is_one_message_and_out_of_order_deltas_are_refused() {
    let (d, api, mut x, cch) = telegram("v2-tg-final");
    let ack = x.say(&cch, "f1", "Done.", json!([]));
    assert_eq!(ack["payload"]["status"], "accepted");
    let sent = api.wait_calls("sendMessage", 1, Duration::from_secs(5));
    assert_eq!(sent[0]["text"], "Done.");
    assert_eq!(x.say(&cch, "f1", "Done.", json!([]))["payload"]["status"], "duplicate");
    assert_eq!(api.calls("sendMessage").len(), 1);
    // A gap, then another text for a sequence already applied: both refused with their codes.
    let r = x.delta(&cch, "g1", 2, "too early");
    let e = x.answer_to(&r);
    assert_eq!(
        (e["type"].as_str(), e["error"]["code"].as_str()),
        (Some("error"), Some("delta_sequence_gap"))
    );
    x.delta(&cch, "g1", 1, "one");
    let r = x.delta(&cch, "g1", 1, "uno");
    let e = x.answer_to(&r);
    assert_eq!(e["error"]["code"], "delta_conflict");
    // A photo uploaded for the channel goes with a final.
    let file_ref = upload(&d, &cch, "plan.png", "image/png", b"\x89PNG");
    let ack = x.say(&cch, "f2", "the plan", json!([{"type": "image", "file_ref": file_ref}]));
    assert_eq!(ack["payload"]["status"], "accepted", "{ack}");
    assert_eq!(api.wait_calls("sendPhoto", 1, Duration::from_secs(5)).len(), 1);
    // A file_ref that is not this channel's: refused for good.
    let ack = x.say(&cch, "f3", "", json!([{"type": "file", "file_ref": "file_00"}]));
    assert_eq!(
        (ack["payload"]["code"].as_str(), ack["payload"]["retryable"].as_bool()),
        (Some("file_ref_invalid"), Some(false))
    );
}

#[test]
fn a_telegram_photo_reaches_xagent_as_a_chat_message_with_a_download_url() {
    let (d, api, mut x, _) = telegram("v2-tg-photo");
    let photo: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
    api.user_sends_photo(BOT, CHAT, &photo, "look");
    let m = x.next_chat(Duration::from_secs(10)).expect("the photo message");
    let p = &m["payload"];
    assert_eq!(p["text"], "look");
    let file = &p["files"][0];
    assert_eq!(
        (file["type"].as_str(), file["byte_size"].as_u64()),
        (Some("image"), Some(3000))
    );
    assert_eq!(download(&d, file).1, photo);
    x.ack_chat(&m, "accepted", None, false);
}

#[test]
fn activity_shows_typing_while_busy_and_stops_on_idle() {
    let (_d, api, mut x, cch) = telegram("v2-tg-activity");
    x.activity(&cch, "tool", Some("web_search"));
    assert!(api.wait_arrived("sendChatAction", 1, Duration::from_secs(5)));
    assert!(
        api.wait_arrived("sendChatAction", 2, Duration::from_secs(6)),
        "refreshed while busy"
    );
    x.activity(&cch, "idle", None);
    std::thread::sleep(Duration::from_millis(500));
    let n = api.calls("sendChatAction").len();
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(api.calls("sendChatAction").len(), n, "no typing after idle");
    // A malformed activity is an invalid packet.
    let r = x
        .send(
            "chat.activity",
            Some(&cch),
            json!({"status": "thinking", "tool_name": "x"}),
        )
        .1;
    assert_eq!(x.answer_to(&r)["error"]["code"], "invalid_packet");
}

#[test]
fn files_of_every_size_up_to_max_file_bytes_upload_and_reach_a_webhook_receiver_whole() {
    let ok = ReplyReceiver::start(200);
    let dir = temp_dir("v2-sizes");
    let d = Daemon::start(
        &dir,
        &config_text(free_port(), &dir, Some(&ok.url), &format!("{V2}{MAX_FILE_CONF}")),
    );
    let (mut x, cch) = d.bound_xagent();
    for (i, n) in file_sizes().into_iter().enumerate() {
        let bytes = patterned(n, i as u8);
        let file_ref = upload(&d, &cch, "report.pdf", "application/pdf", &bytes);
        let ack = x.say(
            &cch,
            &format!("s{i}"),
            "",
            json!([{"type": "file", "file_ref": file_ref}]),
        );
        assert_eq!(ack["payload"]["status"], "accepted", "{ack}");
        let body: Value = serde_json::from_str(&ok.rx.recv_timeout(Duration::from_secs(10)).unwrap().body).unwrap();
        let (status, got) = download_url(&d, body["files"][0]["download_url"].as_str().unwrap());
        assert_eq!(status, 200, "a {n}-byte file");
        assert_same_bytes(&got, &bytes, &format!("a {n}-byte file"));
    }
}
