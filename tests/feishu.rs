//! The Feishu/Lark provider against `common/feishu.rs`, a simulator of the Open Platform and
//! its long connection: binding and each failure, text, rich text and image round trips, the
//! answer to an event only after its commit (a SIGKILL in between loses nothing and stores
//! once), reconnects, token expiry during a tool call, rate limits, unbound chats, an app
//! secret that never leaves imgate, and a gateway that floods events or pings and reads nothing.

use std::time::{Duration, Instant};

use crate::common::feishu::{FeishuSim, Flood, SERVICE_ID};
use crate::common::*;
use serde_json::{json, Value};

const APP: &str = "cli_a1b2c3d4e5";
const SECRET: &str = "s3cr3t-app-secret-9Zq";
const CHAT: &str = "oc_ops0001";
const WAIT: Duration = Duration::from_secs(10);

fn feishu(tag: &str, env: &[(&str, &str)]) -> (Daemon, FeishuSim) {
    feishu_with(tag, env, "")
}

/// `feishu` with more config (`extra` is appended).
fn feishu_with(tag: &str, env: &[(&str, &str)], extra: &str) -> (Daemon, FeishuSim) {
    let sim = FeishuSim::start();
    sim.add_app(APP, SECRET, true);
    sim.add_chat(CHAT, "Ops", "group", &[APP]);
    let dir = temp_dir(tag);
    let conf = format!("[feishu]\napi_base = {}\n{extra}", sim.base);
    (
        Daemon::start_env(&dir, &config_text(free_port(), &dir, None, &conf), "trace", env),
        sim,
    )
}

fn bind(x: &mut Sim, cch: &str, app: &str, secret: &str, chat: &str) -> Value {
    x.request(
        "auth.start",
        Some(cch),
        json!({"flow_id": "feishu_app_binding", "input": {"app_id": app, "app_secret": secret, "chat_id": chat}}),
    )
}

fn bound(d: &Daemon, sim: &FeishuSim) -> (Sim, String) {
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let a = bind(&mut x, &cch, APP, SECRET, CHAT);
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    assert!(
        sim.wait_connected(APP, 1, WAIT),
        "the binding opens the app's long connection"
    );
    (x, cch)
}

fn text_event(message_id: &str, text: &str) -> Vec<u8> {
    FeishuSim::message_event(APP, CHAT, message_id, "text", json!({"text": text}))
}

fn failed_because(a: &Value, needle: &str) {
    assert_eq!(a["payload"]["status"], "failed", "{a}");
    let message = a["payload"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(needle), "{message}");
}

#[test]
fn binding_checks_the_app_its_long_connection_and_the_chat() {
    let (d, sim) = feishu("fs-bind", &[]);
    sim.add_app("cli_nolongconn", "other-secret", false);
    sim.add_chat("oc_elsewhere", "Elsewhere", "group", &[]);
    let (_, card) = http_get(&d.url("/connector-card.json"), &[]);
    let card: Value = serde_json::from_str(&card).unwrap();
    assert_card(&card);
    let flow = card["auth_flows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == "feishu_app_binding")
        .cloned()
        .expect("the Card offers feishu_app_binding when [feishu] is set");
    assert_eq!(flow["fields"][1]["secret"], true, "{flow}");

    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    failed_because(
        &bind(&mut x, &cch, APP, "wrong", CHAT),
        "rejected the App ID or App Secret",
    );
    failed_because(
        &bind(&mut x, &cch, "cli_nolongconn", "other-secret", CHAT),
        "long connection",
    );
    failed_because(
        &bind(&mut x, &cch, APP, SECRET, "oc_elsewhere"),
        "bot is not in this chat",
    );
    failed_because(
        &bind(&mut x, &cch, APP, SECRET, "oc_nosuchchat"),
        "does not know this chat",
    );
    failed_because(&bind(&mut x, &cch, APP, SECRET, "oc_../x"), "chat_id must be");

    let ok = bind(&mut x, &cch, APP, SECRET, CHAT);
    assert_eq!(ok["payload"]["status"], "authenticated", "{ok}");
    let descriptor = &ok["payload"]["connection_descriptor"];
    assert_descriptor(descriptor);
    assert_eq!(descriptor["target"]["provider"], "feishu");
    assert_eq!(descriptor["target"]["display_name"], "Ops");
    assert_eq!(descriptor["target"]["account_hint"], "oc***01", "a redacted hint only");
    assert!(sim.wait_connected(APP, 1, WAIT));
    assert!(
        sim.wait_ping(SERVICE_ID, WAIT),
        "a ping names the service of the endpoint's URL"
    );

    let secret_file = d.dir.join(format!("state/feishu/{APP}.secret"));
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&secret_file).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "the secret file is private");
    metrics_once(&d, "imgate_feishu_connections_up 1", WAIT);
    let all = serde_json::to_string(&x.seen).unwrap() + &card.to_string() + &get_json(&d.url("/status")).to_string();
    assert_no_secret(&all, &[SECRET, "t-sim"], "a packet, the Card or /status");
    assert_no_secret(&d.log(), &[SECRET, "t-sim", "access_key=ak"], "the trace log");

    // The channel moves to another app: the first app's secret has no binding left.
    sim.add_app("cli_other", "other-app-secret", true);
    sim.add_chat("oc_other", "Other", "group", &["cli_other"]);
    let moved = bind(&mut x, &cch, "cli_other", "other-app-secret", "oc_other");
    assert_eq!(moved["payload"]["status"], "authenticated", "{moved}");
    assert!(!secret_file.exists(), "a secret no binding uses is forgotten");
    assert!(d.dir.join("state/feishu/cli_other.secret").exists());
}

#[test]
fn text_and_rich_text_arrive_after_their_commit_and_replies_go_back() {
    let (d, sim) = feishu("fs-text", &[]);
    let (mut x, cch) = bound(&d, &sim);
    let frame = sim.push_event(APP, &text_event("om_100", "is the door locked?"), 1);
    let push = x.next_push(WAIT).expect("the Feishu message is pushed");
    assert_packet(&push);
    assert_eq!(push["connector_channel_id"], json!(cch));
    let p = &push["payload"];
    assert_eq!(p["provider"], "feishu");
    assert_eq!(p["message_id"], "om_100");
    assert_eq!(p["raw_text"], "is the door locked?");
    assert!(p["text"].as_str().unwrap().starts_with("User message from Feishu:"));
    let (code, biz_rt) = sim.answer(&frame, WAIT).expect("the event is answered");
    assert_eq!(code, 200, "stored, so Feishu may forget it");
    assert!(biz_rt.is_some(), "the answer says how long handling took");
    println!(
        "event answered after its commit, biz_rt {} ms",
        biz_rt.unwrap_or_default()
    );

    let post = json!({"title": "Release", "content": [[{"tag": "text", "text": "v2 is out: "}, {"tag": "a", "text": "notes", "href": "https://x.example/n"}], [{"tag": "at", "user_name": "Ada"}]]});
    // A payload over the server's frame size arrives in parts.
    sim.push_event(APP, &FeishuSim::message_event(APP, CHAT, "om_101", "post", post), 3);
    let push = x.next_push(WAIT).expect("the rich-text message is pushed");
    assert_eq!(
        push["payload"]["raw_text"],
        "Release\nv2 is out: notes (https://x.example/n)\n@Ada"
    );

    let reply_ref = p["reply"]["reply_ref"].as_str().unwrap().to_string();
    let a = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref, "text": "yes, locked"}),
        "fs-1",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let replies = sim.calls("/open-apis/im/v1/messages/om_100/reply");
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0]["msg_type"], "text");
    assert_eq!(replies[0]["content"], json!({"text": "yes, locked"}).to_string());
    assert!(replies[0]["uuid"].as_str().unwrap().len() <= 50);

    let a = x.tool(&cch, "imgate_message_send", json!({"text": "done"}), "fs-2");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let sent = sim.calls("/open-apis/im/v1/messages?receive_id_type=chat_id");
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0]["receive_id"], CHAT);

    let long = "é".repeat(20_001);
    let a = x.tool(&cch, "imgate_message_send", json!({"text": long}), "fs-3");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let sent = sim.calls("/open-apis/im/v1/messages?receive_id_type=chat_id");
    assert_eq!(sent.len(), 3, "20,001 characters go as two messages");
    let part: Value = serde_json::from_str(sent[1]["content"].as_str().unwrap()).unwrap();
    assert_eq!(part["text"].as_str().unwrap().chars().count(), 20_000);
    assert_ne!(
        sent[1]["uuid"], sent[2]["uuid"],
        "each part is its own message to Feishu"
    );
    assert_no_secret(&serde_json::to_string(&x.seen).unwrap(), &[SECRET, "t-sim"], "a packet");
    assert_stops_cleanly(d);
}

#[test]
fn an_image_is_fetched_into_the_file_cache() {
    let (d, sim) = feishu("fs-files", &[]);
    let (mut x, _) = bound(&d, &sim);
    let photo: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
    sim.add_resource("om_200", "img_v3_abc", &photo, "image/jpeg");
    let event = FeishuSim::message_event(APP, CHAT, "om_200", "image", json!({"image_key": "img_v3_abc"}));
    sim.push_event(APP, &event, 1);
    let push = x.next_push(WAIT).expect("the image message is pushed");
    let file = &push["payload"]["files"][0];
    assert_eq!(push["payload"]["message_type"], "image");
    assert_eq!(file["mime_type"], "image/jpeg", "the server's type wins");
    assert_eq!(file["byte_size"], 5000);
    assert_eq!(download(&d, file).1, photo, "the cached bytes are served");
    let fetched = sim.calls("/open-apis/im/v1/messages/om_200/resources/img_v3_abc?type=image");
    assert_eq!(fetched.len(), 1);
}

#[test]
fn files_out_are_uploaded_as_images_or_files_with_their_caption_first() {
    let (d, sim) = feishu("fs-upload", &[]);
    let (mut x, cch) = bound(&d, &sim);
    let (status, up) = upload_as(&d, &cch, "plan.png", "image/png", b"\x89PNG-bytes");
    assert_eq!(status, 200, "{up}");
    let file_ref = up["file_ref"].as_str().unwrap();
    let a = x.tool(
        &cch,
        "imgate_file_send",
        json!({"file_ref": file_ref, "caption": "the plan"}),
        "fs-f1",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let uploads = sim.uploads();
    assert_eq!(uploads.len(), 1);
    assert_eq!(uploads[0].0, "/open-apis/im/v1/images");
    let body = String::from_utf8_lossy(&uploads[0].1);
    assert!(body.contains("name=\"image_type\"\r\n\r\nmessage"), "{body}");
    assert!(body.contains("PNG-bytes"));
    let sent = sim.calls("/open-apis/im/v1/messages?receive_id_type=chat_id");
    assert_eq!(sent.len(), 2, "the caption, then the image");
    assert_eq!(sent[0]["content"], json!({"text": "the plan"}).to_string());
    assert_eq!(sent[1]["msg_type"], "image");
    let content: Value = serde_json::from_str(sent[1]["content"].as_str().unwrap()).unwrap();
    assert!(content["image_key"].as_str().unwrap().starts_with("img_v3_"));

    let (_, up) = upload_as(&d, &cch, "report.pdf", "application/pdf", b"%PDF-1.7");
    let a = x.tool(&cch, "imgate_file_send", json!({"file_ref": up["file_ref"]}), "fs-f2");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let uploads = sim.uploads();
    assert_eq!(uploads[1].0, "/open-apis/im/v1/files");
    assert!(String::from_utf8_lossy(&uploads[1].1).contains("name=\"file_type\"\r\n\r\npdf"));
}

#[test]
fn a_slow_file_in_one_chat_never_holds_up_another_chats_messages_and_a_chat_keeps_its_order() {
    let (d, sim) = feishu("fs-lanes", &[]);
    sim.add_chat("oc_dev0002", "Dev", "group", &[APP]);
    let (mut x, ops) = bound(&d, &sim);
    let (dev, _) = x.open(None);
    let a = bind(&mut x, &dev, APP, SECRET, "oc_dev0002");
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    sim.add_resource("om_600", "img_v3_slow", b"slow-bytes", "image/png");
    sim.stall_next("/resources/img_v3_slow", Duration::from_secs(3));
    let image = FeishuSim::message_event(APP, CHAT, "om_600", "image", json!({"image_key": "img_v3_slow"}));
    sim.push_event(APP, &image, 1);
    sim.push_event(APP, &text_event("om_601", "after the image, same chat"), 1);
    let dev_text = FeishuSim::message_event(APP, "oc_dev0002", "om_602", "text", json!({"text": "other chat"}));
    sim.push_event(APP, &dev_text, 1);
    let order: Vec<(String, String)> = (0..3)
        .map(|_| {
            let p = x.next_push(WAIT).expect("every message arrives");
            (
                p["connector_channel_id"].as_str().unwrap().to_string(),
                p["payload"]["message_id"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        order,
        [
            (dev, "om_602".to_string()),
            (ops.clone(), "om_600".to_string()),
            (ops, "om_601".to_string())
        ],
        "the other chat first; the slow chat in its own order"
    );
}

#[test]
fn a_burst_larger_than_the_read_budget_is_stored_whole_and_in_order() {
    let (d, sim) = feishu("fs-burst", &[]);
    let (mut x, _) = bound(&d, &sim);
    // A first event whose file takes 2 s holds the chat while 59 events of 60 KiB arrive:
    // 3.5 MiB, more than the 2 MiB imgate holds unanswered, so reading pauses, then resumes.
    sim.add_resource("om_700", "img_v3_first", b"first", "image/png");
    sim.stall_next("/resources/img_v3_first", Duration::from_secs(2));
    let first = FeishuSim::message_event(APP, CHAT, "om_700", "image", json!({"image_key": "img_v3_first"}));
    let mut frames = vec![sim.push_event(APP, &first, 1)];
    let text = "x".repeat(60 << 10);
    frames.extend((1..60).map(|i| sim.push_event(APP, &text_event(&format!("om_7{i:02}"), &text), 1)));
    // While answers keep coming: a busy machine answers late, not never.
    assert!(sim.wait_answered(60, QUIET), "every event is answered");
    assert_eq!(sim.answered(500), 0, "none refused");
    for f in &frames {
        assert_eq!(sim.answer(f, WAIT).map(|a| a.0), Some(200));
    }
    let ids: Vec<String> = (0..60)
        .map(|_| {
            let p = x.next_push(WAIT).expect("every message is pushed");
            p["payload"]["message_id"].as_str().unwrap().to_string()
        })
        .collect();
    let expected: Vec<String> = (0..60).map(|i| format!("om_7{i:02}")).collect();
    assert_eq!(ids, expected, "stored whole and in arrival order");
}

#[test]
fn full_caps_under_reject_new_answer_500_so_feishu_keeps_the_event() {
    let (d, sim) = feishu_with(
        "fs-full",
        &[],
        "[queue]\nmax_messages_per_channel = 2\noverflow = reject_new\n",
    );
    let (x, _) = bound(&d, &sim);
    x.close(); // nothing is delivered: the channel's queue stays full
    let frames: Vec<String> = (0..4)
        .map(|i| sim.push_event(APP, &text_event(&format!("om_80{i}"), "t"), 1))
        .collect();
    let codes: Vec<Option<u64>> = frames.iter().map(|f| sim.answer(f, WAIT).map(|a| a.0)).collect();
    assert_eq!(
        codes,
        [Some(200), Some(200), Some(500), Some(500)],
        "stored, stored, refused, refused"
    );
    assert_eq!(
        d.log()
            .matches("queue full; Feishu will deliver the message again")
            .count(),
        1,
        "one line for a run of refusals"
    );
}

#[test]
fn a_sigkill_between_an_event_and_its_commit_loses_nothing_and_stores_it_once() {
    let (mut d, sim) = feishu("fs-crash", &[("IMGATE_TEST_CRASH", "intake-before-commit:1")]);
    let (_, cch) = bound(&d, &sim);
    let frame = sim.push_event(APP, &text_event("om_300", "survive me"), 1);
    assert!(
        d.wait_exit(WAIT).is_some(),
        "killed between receiving the event and its commit"
    );
    assert_eq!(
        sim.answer(&frame, Duration::from_millis(200)),
        None,
        "nothing answered it"
    );

    let d = d.restart_env(&[]);
    assert!(
        sim.wait_connected(APP, 2, WAIT),
        "the app connects again after the restart"
    );
    let (code, _) = sim.answer(&frame, WAIT).expect("the redelivered event is answered");
    assert_eq!(code, 200);
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    let push = x.next_push(WAIT).expect("the message survived the crash");
    assert_eq!(push["payload"]["message_id"], "om_300");

    // Feishu delivering it once more (its answer was lost, say) stores nothing new.
    let again = sim.push_event(APP, &text_event("om_300", "survive me"), 1);
    assert_eq!(sim.answer(&again, WAIT).map(|a| a.0), Some(200));
    assert!(
        x.next_push(Duration::from_secs(2)).is_none(),
        "exactly one message was pushed"
    );
}

#[test]
fn the_long_connection_comes_back_after_the_server_drops_it() {
    let (d, sim) = feishu("fs-reconnect", &[]);
    let (mut x, _) = bound(&d, &sim);
    let calls = sim.endpoint_calls();
    sim.drop_connection(APP);
    assert!(sim.wait_connected(APP, 2, WAIT), "reconnected");
    assert!(
        sim.endpoint_calls() > calls,
        "a new address is asked for each connection"
    );
    sim.push_event(APP, &text_event("om_400", "after the drop"), 1);
    let push = x.next_push(WAIT).expect("events flow on the new connection");
    assert_eq!(push["payload"]["raw_text"], "after the drop");
    assert!(d.log_shows("long connection down (closed by the server)", WAIT));
    assert_eq!(
        d.log().matches("long connection up").count(),
        2,
        "each change of state is logged"
    );
}

#[test]
fn an_expired_token_is_renewed_within_a_tool_call() {
    let (d, sim) = feishu("fs-token", &[]);
    let (mut x, cch) = bound(&d, &sim);
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "one"}), "t-1");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let issued = sim.tokens_issued();
    sim.expire_tokens();
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "two"}), "t-2");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    assert_eq!(sim.tokens_issued(), issued + 1, "one new token, fetched on the refusal");
    let sent = sim.calls("/open-apis/im/v1/messages?receive_id_type=chat_id");
    assert_eq!(sent.len(), 3, "one, two (token refused, then sent)");
    assert_no_secret(&d.log(), &[SECRET, "t-sim"], "the trace log");
}

#[test]
fn rate_limits_and_server_errors_are_retried_as_the_same_send() {
    let (d, sim) = feishu("fs-retry", &[]);
    let (mut x, cch) = bound(&d, &sim);
    sim.fail_next("/open-apis/im/v1/messages", 429, 99991400, 1);
    sim.fail_next("/open-apis/im/v1/messages", 503, 0, 1);
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "three"}), "t-3");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let sent = sim.calls("/open-apis/im/v1/messages?receive_id_type=chat_id");
    assert_eq!(sent.len(), 3, "429, 503, sent");
    let uuids: Vec<&str> = sent.iter().map(|c| c["uuid"].as_str().unwrap()).collect();
    assert!(
        uuids.iter().all(|u| *u == uuids[0]),
        "a retry is the same send to Feishu"
    );
    assert_no_secret(&d.log(), &[SECRET, "t-sim"], "the trace log");
}

#[test]
fn a_send_feishu_refuses_answers_upstream_rejected() {
    let (d, sim) = feishu("fs-refused", &[]);
    let (mut x, cch) = bound(&d, &sim);
    sim.fail_next("/open-apis/im/v1/messages", 400, 230002, 1);
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "four"}), "t-4");
    assert_eq!(a["error"]["code"], "upstream_rejected", "{a}");
    assert_no_secret(&d.log(), &[SECRET, "t-sim"], "the trace log");
}

#[test]
fn events_from_unbound_chats_and_unreadable_events_are_counted_not_stored() {
    let (d, sim) = feishu("fs-unbound", &[]);
    let (mut x, _) = bound(&d, &sim);
    let other = FeishuSim::message_event(APP, "oc_notbound", "om_500", "text", json!({"text": "psst"}));
    let frame = sim.push_event(APP, &other, 1);
    assert_eq!(
        sim.answer(&frame, WAIT).map(|a| a.0),
        Some(200),
        "answered: nothing to store"
    );
    let junk = sim.push_event(APP, b"{\"not\": \"an event\"", 1);
    assert_eq!(sim.answer(&junk, WAIT).map(|a| a.0), Some(200));
    assert!(x.next_push(Duration::from_secs(1)).is_none(), "nothing was stored");
    let (_, metrics) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
    assert!(metrics.contains("imgate_feishu_unbound_events_total 1"), "{metrics}");
    assert!(metrics.contains("imgate_feishu_unreadable_events_total 1"), "{metrics}");
    let status = get_json(&d.url("/status"));
    assert_eq!(
        status["unbound_recent"][0]["conversation_id"], "oc_notbound",
        "listed so the owner can find the ID to bind: {status}"
    );
}

#[test]
fn images_and_files_of_every_size_up_to_max_file_bytes_download_whole() {
    let (d, sim) = feishu_with("fs-sizes", &[], MAX_FILE_CONF);
    let (mut x, _cch) = bound(&d, &sim);
    every_size_downloads_whole(&d, &mut x, |i, bytes| {
        let (message_id, key) = (format!("om_size{i}"), format!("file_v3_size{i}"));
        let (msg_type, content, mime) = if i == 0 {
            ("image", json!({"image_key": key}), "image/jpeg")
        } else {
            (
                "file",
                json!({"file_key": key, "file_name": "report.pdf"}),
                "application/pdf",
            )
        };
        sim.add_resource(&message_id, &key, bytes, mime);
        sim.push_event(
            APP,
            &FeishuSim::message_event(APP, CHAT, &message_id, msg_type, content),
            1,
        );
    });
}

/// A gateway flooding events of a chat bound to no channel, each frame with 58 headers of
/// 4,000 bytes, and never reading what imgate writes. Every answer once echoed the event's
/// headers and waited in an unbounded queue, its budget given back before it was written: GiBs.
/// Now an event's budget covers its answer until the answer is written: reading stops, a write
/// that takes 30 s ends the connection, the app connects again, and the port answers throughout.
#[test]
fn a_gateway_flooding_events_that_never_reads_the_answers_costs_bounded_memory_and_is_dropped() {
    let (d, sim) = feishu("fs-flood", &[]);
    let (mut x, _) = bound(&d, &sim);
    let (hook, _) = x.open(None);
    let a = x.bind_webhook(&hook, "alerts", HOOK_SECRET);
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    sim.flood_next(
        APP,
        Flood::Events {
            chat: "oc_unbound0".into(),
            headers: 58,
            header_len: 4000,
            // imgate's most (`longconn::MAX_ECHOED`): its answers as large as they come.
            echoed_len: 256,
        },
    );
    let idle = hwm_kib(d.pid());
    sim.drop_connection(APP);
    assert!(
        sim.wait_connected(APP, 2, Duration::from_secs(60)),
        "the app connects again: the flooding gateway"
    );
    // A debug build idles near 20 MiB; what the connection holds is 2 MiB of budget and
    // tungstenite's write buffer (1.2 MiB), besides the frame being read (up to 1 MiB).
    const PEAK_KIB: u64 = 40 << 10;
    let deadline = Instant::now() + Duration::from_secs(150);
    let mut slowest = Duration::ZERO;
    let mut posted = 0;
    // Until the flooding connection is dropped and the app connects a third time; the peak is
    // checked all along, so a build that queues without bound fails within a few hundred MiB.
    while !sim.wait_connected(APP, 3, Duration::from_millis(500)) {
        let peak = hwm_kib(d.pid());
        assert!(
            peak < PEAK_KIB,
            "peak RSS {peak} KiB after {} flooded events",
            sim.flood_sent()
        );
        assert!(
            Instant::now() < deadline,
            "the flooding connection was never dropped ({} events sent)",
            sim.flood_sent()
        );
        let started = Instant::now();
        let (status, _) = http_get(&d.url("/health"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
        assert_eq!(status, 200);
        posted += 1;
        let (status, _) = d.post_hook(
            "alerts",
            &json!({"message_id": format!("h{posted}"), "sender_id": "u", "text": "still here"}),
        );
        assert_eq!(status, 202, "a webhook is stored during the flood");
        slowest = slowest.max(started.elapsed());
    }
    let peak = hwm_kib(d.pid());
    println!(
        "{} flooded events; peak RSS {idle} KiB before, {peak} KiB after; slowest /health and webhook {slowest:?} ({posted} webhooks)",
        sim.flood_sent()
    );
    assert!(peak < PEAK_KIB, "peak RSS {peak} KiB");
    assert!(sim.floods_ended() >= 1, "the flood's connection is closed");
    assert!(d.log_shows("long connection down (", WAIT));
    assert!(
        d.log().contains("nothing could be written for 30s"),
        "the reason is logged:\n{}",
        d.log()
    );
    // The new connection works: an event is stored and answered.
    let frame = sim.push_event(APP, &text_event("om_900", "after the flood"), 1);
    assert_eq!(
        sim.answer(&frame, WAIT).map(|a| a.0),
        Some(200),
        "stored after the flood"
    );
}

/// The same gateway sending at least 200,000 WebSocket pings of 125 bytes (more than the
/// machine's socket buffers hold) and reading nothing: their pongs, queued, would be 26 MB or
/// more; tungstenite keeps the latest only once its write buffer is full
/// (`wsclient::bounded_config`), so imgate goes on reading at bounded cost.
#[test]
fn a_gateway_flooding_pings_that_never_reads_costs_bounded_memory() {
    let (d, sim) = feishu("fs-pingflood", &[]);
    // Pings every 10 s (the least imgate takes): a link that goes silent after the flood is
    // found dead within three of them, whatever its socket says.
    sim.set_ping_interval(10);
    let _x = bound(&d, &sim);
    let before = hwm_kib(d.pid());
    sim.flood_next(APP, Flood::Pings);
    sim.drop_connection(APP);
    assert!(
        sim.wait_connected(APP, 2, Duration::from_secs(60)),
        "the flooding gateway"
    );
    // For as long as bursts keep going out: a busy machine reads slowly, but a reader that
    // stopped writes none for 30 s (the simulator's write timeout), which ends the flood short.
    assert!(sim.wait_floods_ended(1, QUIET), "the ping flood ended");
    let grew = hwm_kib(d.pid()).saturating_sub(before);
    println!("{} ping frames sent; peak RSS grew {grew} KiB", sim.flood_sent() * 1000);
    assert_eq!(
        sim.flood_sent(),
        crate::common::feishu::ping_bursts(),
        "imgate went on reading the pings"
    );
    assert!(grew < 8 * 1024, "peak RSS grew {grew} KiB");
    let (status, _) = http_get(&d.url("/health"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
    assert_eq!(status, 200);
    // The pings still in the socket's buffers are read first (a debug build beside other tests
    // takes its time), then the reconnect interval after a quick drop, the endpoint and the
    // handshake: on a busy machine, well over `WAIT`.
    let cpu = |pid: u32| -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
        fields.get(11).and_then(|u| u.parse().ok()).unwrap_or(0)
    };
    let connected = sim.wait_connected(APP, 3, Duration::from_secs(180));
    let busy = cpu(d.pid());
    std::thread::sleep(Duration::from_secs(1));
    let busy = cpu(d.pid()) - busy;
    assert!(
        connected,
        "the app connects again after the flood (imgate used {busy} ticks of CPU in the last second); the log ends:\n{}",
        d.log().lines().rev().filter(|l| !l.contains("data plane")).take(30).collect::<Vec<_>>().join("\n")
    );
}
