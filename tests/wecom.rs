//! The WeCom provider against `common/wecom.rs`, a simulator of the intelligent robot's long
//! connection written from WeCom's SDKs (docs/providers/wecom-protocol.md): binding and its
//! failures, messages of every kind in with each `msgid` pushed once, a reply on the message's
//! `req_id` (also after a restart), a proactive send, a kicked robot that does not fight back,
//! a silent link and a deaf one replaced, and the secret absent from every log line.

use std::time::Duration;

use crate::common::wecom::{Chat, Download, Part, WecomSim};
use crate::common::*;
use serde_json::{json, Value};

const BOT: &str = "aibSimRobot0001";
const SECRET: &str = "wecom-sim-secret-4f3e2d1c0b";
const GROUP: &str = "wrcGroupOps01";
const ANN: &str = "zhangsan";
const WAIT: Duration = Duration::from_secs(15);

fn wecom(tag: &str, extra: &str) -> (Daemon, WecomSim) {
    let sim = WecomSim::start();
    sim.robot(BOT, SECRET);
    let dir = temp_dir(tag);
    let conf = format!("[wecom]\nws_url = {}\n{extra}", sim.ws_url);
    (
        Daemon::start_env(&dir, &config_text(free_port(), &dir, None, &conf), "trace", &[]),
        sim,
    )
}

fn bind(x: &mut Sim, cch: &str, bot: &str, secret: &str, chat: &str) -> Value {
    x.request(
        "auth.start",
        Some(cch),
        json!({"flow_id": "wecom_bot_binding", "input": {"bot_id": bot, "secret": secret, "chat_id": chat}}),
    )
}

fn bound(d: &Daemon, sim: &WecomSim, chat: &str) -> (Sim, String) {
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let a = bind(&mut x, &cch, BOT, SECRET, chat);
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    assert!(
        sim.wait_open_links(BOT, 1, WAIT),
        "the binding opens the robot's connection"
    );
    (x, cch)
}

fn failed_because(a: &Value, needle: &str) {
    assert_eq!(a["payload"]["status"], "failed", "{a}");
    let message = a["payload"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(needle), "{message}");
}

#[test]
fn binding_checks_the_robot_and_keeps_the_secret_private_and_messages_arrive_once() {
    let (d, sim) = wecom("wc-bind", "");
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    failed_because(
        &bind(&mut x, &cch, BOT, "wrong-secret", GROUP),
        "refused the robot's subscribe",
    );
    failed_because(&bind(&mut x, &cch, "bot id", SECRET, GROUP), "bot_id must be");
    failed_because(&bind(&mut x, &cch, BOT, SECRET, "a/b c"), "chat_id must be");
    let ok = bind(&mut x, &cch, BOT, SECRET, GROUP);
    assert_eq!(ok["payload"]["status"], "authenticated", "{ok}");
    assert_descriptor(&ok["payload"]["connection_descriptor"]);
    assert_eq!(ok["payload"]["connection_descriptor"]["target"]["provider"], "wecom");
    assert!(sim.wait_open_links(BOT, 1, WAIT));
    let file = d.dir.join(format!("state/wecom/{BOT}.secret"));
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&file).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "the secret file is private");

    let group = Chat::group(GROUP, ANN);
    let first = sim.send_text(BOT, &group, "@robot hello");
    let push = x.next_push(WAIT).expect("the group's message is pushed");
    assert_eq!(push["payload"]["message_id"], first.msgid.as_str());
    assert_eq!(push["payload"]["raw_text"], "@robot hello");
    // The same msgid again (a second delivery): stored once.
    let mut again = sim.callback_body(BOT, &group, "text", json!({"content": "@robot hello"}));
    again["msgid"] = json!(first.msgid);
    sim.push_callback(BOT, again);
    let voice = sim.send_voice(BOT, &group, "the recognised words");
    let push = x.next_push(WAIT).expect("the voice message is pushed");
    assert_eq!(
        push["payload"]["message_id"],
        voice.msgid.as_str(),
        "the repeated msgid was not pushed"
    );
    assert_eq!(push["payload"]["raw_text"], "the recognised words");

    // A chat without a binding: not stored, listed so an owner can bind it.
    sim.send_text(BOT, &Chat::single("lisi"), "anyone?");
    wait_until("the unbound chat is listed in /status", || {
        get_json(&d.url("/status"))["unbound_recent"]
            .as_array()
            .is_some_and(|u| {
                u.iter()
                    .any(|e| e["provider"] == "wecom" && e["conversation_id"] == "lisi")
            })
    });
    assert_no_secret(&d.log(), &[SECRET], "the trace log");
}

#[test]
fn a_reply_goes_on_the_messages_req_id_even_after_a_restart_and_a_send_is_proactive() {
    let (d, sim) = wecom("wc-reply", "");
    let (mut x, cch) = bound(&d, &sim, GROUP);
    let group = Chat::group(GROUP, ANN);
    let pushed = sim.send_text(BOT, &group, "@robot status?");
    let push = x.next_push(WAIT).expect("pushed");
    let reply_ref = push["payload"]["reply"]["reply_ref"].as_str().unwrap().to_string();
    drop(x);
    let d = d.restart_env(&[]);
    assert!(
        sim.wait_subscribes(BOT, 2, WAIT),
        "the robot subscribes again after the restart"
    );
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    let r = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref, "text": "all green"}),
        "wc-1",
    );
    assert_eq!(r["payload"]["result"]["status"], "sent", "{r}");
    assert!(
        sim.wait_finished(&pushed.req_id, WAIT),
        "the reply names the message's req_id"
    );
    let replies = sim.replies(&pushed.req_id);
    assert_eq!(
        replies[0]["frame"]["body"]["stream"]["content"], "all green",
        "{replies:?}"
    );
    let s = x.tool(&cch, "imgate_message_send", json!({"text": "a notice"}), "wc-2");
    assert_eq!(s["payload"]["result"]["status"], "sent", "{s}");
    let sends = sim.frames_of("aibot_send_msg");
    assert_eq!(sends.len(), 1);
    assert_eq!(sends[0]["frame"]["body"]["chatid"], GROUP);
    assert_eq!(sends[0]["frame"]["body"]["markdown"]["content"], "a notice");
}

#[test]
fn a_kicked_robot_says_so_and_does_not_fight_for_its_connection() {
    let (d, sim) = wecom("wc-kick", "");
    let (mut x, _) = bound(&d, &sim, GROUP);
    assert!(sim.kick(BOT), "another client subscribes as the robot");
    let pushed = x.next_of("connection.descriptor.push", WAIT).expect("xAgent is told");
    assert_eq!(
        pushed["payload"]["connection_descriptor"]["connection"]["status"], "error",
        "{pushed}"
    );
    assert!(d.log_shows("disconnected_event", WAIT));
    let subscribes = sim.subscribes(BOT);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(sim.subscribes(BOT), subscribes, "no subscribe after the kick");
}

#[test]
fn a_silent_link_and_a_deaf_one_are_both_replaced() {
    // Pings every 2 s (a quarter of `replace_quiet`): a silent link ends at the third.
    let (d, sim) = wecom("wc-silent", "replace_quiet = 8s\n");
    let (_x, _) = bound(&d, &sim, GROUP);
    sim.go_silent(BOT);
    assert!(sim.wait_subscribes(BOT, 2, WAIT), "a silent link is replaced");
    assert!(d.log_shows("pings unanswered", WAIT));
    // Pings answered, nothing delivered: replaced once `replace_quiet` passed.
    sim.go_deaf(BOT);
    assert!(sim.wait_subscribes(BOT, 3, WAIT), "a deaf link is replaced");
    assert!(d.log_shows("replaced in case it went deaf", WAIT));
}

#[test]
fn files_go_both_ways_decrypted_in_and_uploaded_in_chunks_out() {
    let (d, sim) = wecom("wc-files", "");
    let (mut x, cch) = bound(&d, &sim, GROUP);
    let group = Chat::group(GROUP, ANN);
    // An image (encrypted with the message's aeskey) is fetched and decrypted.
    let png = patterned(300_000, 7);
    sim.send_image(BOT, &group, &png, "plan.png");
    let push = x.next_push(WAIT).expect("the image is pushed");
    assert_eq!(push["payload"]["message_type"], "image", "{push}");
    let (status, bytes) = download(&d, &push["payload"]["files"][0]);
    assert_eq!(status, 200);
    assert_same_bytes(&bytes, &png, "the WeCom image");
    // A file keeps the name its download names.
    sim.send_file(BOT, &group, b"%PDF-1.4 minutes", "minutes.pdf");
    let push = x.next_push(WAIT).expect("the file is pushed");
    assert_eq!(push["payload"]["files"][0]["filename"], "minutes.pdf", "{push}");
    let (_, bytes) = download(&d, &push["payload"]["files"][0]);
    assert_eq!(bytes, b"%PDF-1.4 minutes");

    // A file out, past one chunk: init, chunks in order, finish, then a media message.
    let report = patterned(1_200_000, 3);
    let (status, up) = upload_as(&d, &cch, "report.pdf", "application/pdf", &report);
    assert_eq!(status, 200, "{up}");
    let a = x.tool(&cch, "imgate_file_send", json!({"file_ref": up["file_ref"]}), "wc-f1");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    assert_eq!(sim.frames_of("aibot_upload_media_chunk").len(), 3, "512 KiB chunks");
    let sends = sim.frames_of("aibot_send_msg");
    assert_eq!(
        sends.len(),
        1,
        "the media message alone, no empty text before it: {sends:?}"
    );
    let body = &sends[0]["frame"]["body"];
    assert_eq!(body["msgtype"], "file", "{body}");
    let media_id = body["file"]["media_id"].as_str().unwrap();
    assert_same_bytes(&sim.uploaded(media_id).expect("uploaded"), &report, "the uploaded file");
}

#[test]
fn a_sigkill_right_after_messages_arrive_loses_none_and_pushes_each_once() {
    let sim = WecomSim::start();
    sim.robot(BOT, SECRET);
    let dir = temp_dir("wc-crash");
    let conf = format!("[wecom]\nws_url = {}\n", sim.ws_url);
    // Killed right after the third message's commit reached the log.
    let crash = [("IMGATE_TEST_CRASH", "outbox-log-appended:3")];
    let mut d = Daemon::start_env(&dir, &config_text(free_port(), &dir, None, &conf), "trace", &crash);
    let (x, cch) = bound(&d, &sim, GROUP);
    x.close();
    let group = Chat::group(GROUP, ANN);
    // One at a time, each stored before the next (one commit, one log append each); the third
    // append is the last thing the process does.
    let mut sent = Vec::new();
    for i in 0..3u64 {
        sent.push(sim.send_text(BOT, &group, &format!("m{i}")).msgid);
        if i < 2 {
            wait_until("the message is stored", || {
                get_json(&d.url("/status"))["channels"][0]["pending"].as_u64() == Some(i + 1)
            });
        }
    }
    assert!(d.wait_exit(WAIT).is_some(), "killed after the third commit");
    let d = d.restart_env(&[]);
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    let pushed: Vec<String> = (0..3)
        .map(|_| {
            x.next_push(WAIT).expect("every stored message is pushed")["payload"]["message_id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(pushed, sent, "each once, in order");
    let after = sim.send_text(BOT, &group, "after the restart");
    let next = x.next_push(WAIT).expect("the next message");
    assert_eq!(
        next["payload"]["message_id"],
        after.msgid.as_str(),
        "nothing pushed twice"
    );
}

#[test]
fn a_frame_past_the_cap_ends_its_connection_in_bounded_memory_and_the_next_one_works() {
    let (d, sim) = wecom("wc-huge", "");
    let (mut x, _) = bound(&d, &sim, GROUP);
    let before = hwm_kib(d.pid());
    let group = Chat::group(GROUP, ANN);
    // 8 MiB of text in one frame: past the 1 MiB cap, never read whole.
    sim.send_huge_text(BOT, &group, 8 << 20);
    assert!(sim.wait_subscribes(BOT, 3, WAIT), "the connection is replaced");
    let after = sim.send_text(BOT, &group, "small again");
    let push = x.next_push(WAIT).expect("the next message");
    assert_eq!(push["payload"]["message_id"], after.msgid.as_str());
    let peak = hwm_kib(d.pid());
    println!("peak RSS {before} KiB before the 8 MiB frame, {peak} KiB after");
    assert!(peak < before + (6 << 10), "peak RSS {peak} KiB, {before} KiB before");
}

#[test]
fn a_mixed_message_brings_its_words_and_its_first_image() {
    let (d, sim) = wecom("wc-mixed", "");
    let (mut x, _) = bound(&d, &sim, GROUP);
    let group = Chat::group(GROUP, ANN);
    let gif = b"GIF89a-mixed-picture";
    sim.send_mixed(
        BOT,
        &group,
        &[
            Part::Text("see"),
            Part::Image {
                bytes: gif,
                filename: "p.gif",
            },
            Part::Text("this"),
        ],
    );
    let push = x.next_push(WAIT).expect("the mixed message is pushed");
    assert_eq!(push["payload"]["raw_text"], "see\nthis", "{push}");
    let (_, bytes) = download(&d, &push["payload"]["files"][0]);
    assert_eq!(bytes, gif);
}

#[test]
fn a_download_that_never_ends_is_given_up_in_bounded_memory_and_the_message_still_arrives() {
    let (d, sim) = wecom("wc-endless", "");
    let (mut x, _) = bound(&d, &sim, GROUP);
    let before = hwm_kib(d.pid());
    sim.set_download(Download::Endless);
    let pushed = sim.send_image(BOT, &Chat::group(GROUP, ANN), &patterned(1000, 1), "never.png");
    // The fetch's deadline is a minute; the message goes on without its file.
    let push = x
        .next_push(Duration::from_secs(120))
        .expect("the message arrives without its file");
    assert_eq!(push["payload"]["message_id"], pushed.msgid.as_str());
    assert!(
        push["payload"]["files"].as_array().is_none_or(|f| f.is_empty()),
        "{push}"
    );
    let peak = hwm_kib(d.pid());
    assert!(peak < before + (4 << 10), "peak RSS {peak} KiB, {before} KiB before");
}
