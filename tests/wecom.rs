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
    let before = sim.subscribes(BOT);
    let a = bind(&mut x, &cch, BOT, SECRET, chat);
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    // The binding's check subscribes on a connection of its own; the robot's link then
    // subscribes again, and is up once imgate heard the answer.
    assert!(
        sim.wait_subscribes(BOT, before + 2, WAIT),
        "the binding opens the robot's connection"
    );
    metrics_once(d, "imgate_wecom_connections_up 1", WAIT);
    assert!(sim.wait_open_links(BOT, 1, WAIT), "the check's connection is closed");
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
    let (_, card) = http_get(&d.url("/connector-card.json"), &[]);
    let all = serde_json::to_string(&x.seen).unwrap() + &card + &get_json(&d.url("/status")).to_string();
    assert_no_secret(&all, &[SECRET], "a packet, the Card or /status");
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
    let subscribed = sim.subscribes(BOT);
    let d = d.restart_env(&[]);
    assert!(
        sim.wait_subscribes(BOT, subscribed + 1, WAIT),
        "the robot subscribes again after the restart"
    );
    metrics_once(&d, "imgate_wecom_connections_up 1", WAIT);
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
    let subscribed = sim.subscribes(BOT);
    sim.go_silent(BOT);
    assert!(
        sim.wait_subscribes(BOT, subscribed + 1, WAIT),
        "a silent link is replaced"
    );
    assert!(d.log_shows("pings unanswered", WAIT));
    // Pings answered, nothing delivered: replaced once `replace_quiet` passed.
    sim.go_deaf(BOT);
    assert!(
        sim.wait_subscribes(BOT, subscribed + 2, WAIT),
        "a deaf link is replaced"
    );
    assert!(d.log_shows("replaced in case it went deaf", WAIT));
}

#[test]
fn images_and_files_in_are_decrypted_into_the_file_cache_with_their_names() {
    let (d, sim) = wecom("wc-files", "");
    let (mut x, _) = bound(&d, &sim, GROUP);
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
}

/// A file out, past one chunk: init, chunks in order, finish, then a media message.
#[test]
fn a_file_out_is_uploaded_in_chunks_then_sent_as_a_media_message() {
    let (d, sim) = wecom("wc-upload", "");
    let (mut x, cch) = bound(&d, &sim, GROUP);
    // WeCom sends only to a chat that talked to the robot.
    sim.send_text(BOT, &Chat::group(GROUP, ANN), "@robot the report, please");
    x.next_push(WAIT).expect("pushed");
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
    let subscribed = sim.subscribes(BOT);
    sim.send_huge_text(BOT, &group, 8 << 20);
    assert!(
        sim.wait_subscribes(BOT, subscribed + 1, WAIT),
        "the connection is replaced"
    );
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

/// Runs `node validate.js` (tests/wecom-sdk) against the simulator: stdout's JSON lines, the
/// exit status and stderr (the SDK's log), or a panic when it runs past `limit`.
fn run_node_sdk(sim: &WecomSim, dir: &std::path::Path, upload_bytes: usize, limit: Duration) -> (Vec<Value>, String) {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let mut child = Command::new("node")
        .arg("validate.js")
        .arg(&sim.ws_url)
        .current_dir(dir)
        .env("WECOM_BOT_ID", BOT)
        .env("WECOM_SECRET", SECRET)
        .env("UPLOAD_BYTES", upload_bytes.to_string())
        .env("HEARTBEAT_MS", "300")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("node runs");
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let pushed = sim.wait_subscribes(BOT, 1, WAIT);
    if pushed {
        let group = Chat::group(GROUP, ANN);
        sim.send_text(BOT, &group, "hello from the simulator");
        sim.send_image(BOT, &group, &patterned(3000, 7), "sim picture.png");
    }
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    let lines: Vec<Value> = out.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    for l in &lines {
        let mut shown = l.clone();
        if let Some(b) = shown.get_mut("base64") {
            *b = json!("…");
        }
        println!("validate.js: {shown}");
    }
    assert!(pushed, "the SDK never subscribed\nstdout:\n{out}\nstderr:\n{err}");
    let status = status.unwrap_or_else(|| panic!("node ran past {limit:?}\nstdout:\n{out}\nstderr:\n{err}"));
    assert!(
        status.success(),
        "validate.js: {status}\nstdout:\n{out}\nstderr:\n{err}"
    );
    (lines, err)
}

#[test]
#[ignore = "the official WeCom Node SDK against the simulator: needs node and npm"]
fn the_official_node_sdk_works_against_the_simulator() {
    use crate::common::kit::base64_decode;
    use crate::common::wecom::{SEND_MSG, SUBSCRIBE, UPLOAD_CHUNK, UPLOAD_FINISH, UPLOAD_INIT};
    // The script and its package.json run from a copy under target/, where node_modules stays
    // between runs and nothing untracked is left in the repository.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = root.join("target/wecom-sdk");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["package.json", "validate.js"] {
        std::fs::copy(root.join("tests/wecom-sdk").join(f), dir.join(f)).unwrap();
    }
    let npm = std::process::Command::new("npm")
        .args(["install", "--no-audit", "--no-fund"])
        .current_dir(&dir)
        .output()
        .expect("npm runs");
    assert!(
        npm.status.success(),
        "npm install: {}",
        String::from_utf8_lossy(&npm.stderr)
    );

    let sim = WecomSim::start();
    sim.robot(BOT, SECRET);
    // Two chunks: 512 KiB and the rest.
    let upload_len = 600 << 10;
    let (lines, log) = run_node_sdk(&sim, &dir, upload_len, Duration::from_secs(45));
    let step = |name: &str| {
        lines
            .iter()
            .find(|l| l["step"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} step in {lines:?}\n{log}"))
    };
    for name in [
        "subscribe",
        "reply",
        "send",
        "download",
        "upload",
        "send_media",
        "heartbeat",
        "done",
    ] {
        assert_eq!(step(name)["ok"], true, "{name}: {}", step(name));
    }

    let subscribe = sim.frames_of(SUBSCRIBE);
    assert_eq!(subscribe.len(), 1, "{subscribe:?}");
    assert_eq!(subscribe[0]["frame"]["body"]["bot_id"], BOT);
    assert_eq!(subscribe[0]["frame"]["body"]["secret"], SECRET);
    assert!(sim.auth_failures().is_empty());

    // The finished stream on the text callback's req_id.
    let pushes = sim.pushes();
    let text = pushes
        .iter()
        .find(|p| p["body"]["msgtype"] == "text")
        .expect("the text was pushed");
    let req_id = text["headers"]["req_id"].as_str().unwrap();
    let reply = step("reply");
    assert_eq!(reply["req_id"], req_id);
    assert_eq!(reply["errcode"], 0);
    let replies = sim.replies(req_id);
    assert_eq!(replies.len(), 1, "{replies:?}");
    let r = &replies[0];
    assert_eq!(r["frame"]["cmd"], "aibot_respond_msg", "{r}");
    assert_eq!(r["errcode"], 0, "{r}");
    assert_eq!(r["frame"]["body"]["msgtype"], "stream", "{r}");
    assert_eq!(r["frame"]["body"]["stream"]["finish"], true, "{r}");
    assert_eq!(r["frame"]["body"]["stream"]["id"], reply["stream_id"], "{r}");
    assert_eq!(
        r["frame"]["body"]["stream"]["content"], "echo: hello from the simulator",
        "{r}"
    );

    // The markdown send and the file send, to the group's chatid.
    let sends = sim.frames_of(SEND_MSG);
    assert_eq!(sends.len(), 2, "{sends:?}");
    let markdown = &sends[0];
    assert_eq!(markdown["errcode"], 0, "{markdown}");
    assert_eq!(markdown["frame"]["body"]["chatid"], GROUP, "{markdown}");
    assert_eq!(markdown["frame"]["body"]["msgtype"], "markdown", "{markdown}");
    assert_eq!(
        markdown["frame"]["body"]["markdown"]["content"],
        "**proactive** from the official SDK"
    );
    assert_eq!(step("send")["req_id"], markdown["frame"]["headers"]["req_id"]);

    // The image, downloaded and decrypted by the SDK, its name from Content-Disposition.
    let download = step("download");
    let image = pushes
        .iter()
        .find(|p| p["body"]["msgtype"] == "image")
        .expect("the image was pushed");
    assert_eq!(download["req_id"], image["headers"]["req_id"]);
    assert_eq!(download["filename"], "sim picture.png", "{download}");
    let got = base64_decode(download["base64"].as_str().unwrap());
    assert_same_bytes(&got, &patterned(3000, 7), "the SDK's decrypted image");
    assert!(
        sim.downloads().iter().all(|d| d["status"] == 200),
        "{:?}",
        sim.downloads()
    );

    // The upload: init, two chunks from index 0, finish; the bytes whole under its media_id.
    let upload = step("upload");
    let media_id = upload["media_id"].as_str().unwrap();
    let init = sim.frames_of(UPLOAD_INIT);
    assert_eq!(init.len(), 1, "{init:?}");
    let b = &init[0]["frame"]["body"];
    assert_eq!(init[0]["errcode"], 0, "{}", init[0]);
    assert_eq!(b["type"], "file", "{b}");
    assert_eq!(b["filename"], "sdk-upload.bin", "{b}");
    assert_eq!(b["total_size"], upload_len, "{b}");
    assert_eq!(b["total_chunks"], 2, "{b}");
    assert_eq!(b["md5"], upload["md5"], "{b}");
    let chunks = sim.frames_of(UPLOAD_CHUNK);
    let mut indexes: Vec<u64> = chunks
        .iter()
        .map(|c| {
            assert_eq!(c["errcode"], 0, "{c}");
            c["frame"]["body"]["chunk_index"].as_u64().unwrap()
        })
        .collect();
    indexes.sort_unstable();
    assert_eq!(indexes, [0, 1], "{chunks:?}");
    let finish = sim.frames_of(UPLOAD_FINISH);
    assert_eq!(finish.len(), 1, "{finish:?}");
    assert_eq!(finish[0]["errcode"], 0, "{}", finish[0]);
    assert_eq!(upload["type"], "file", "{upload}");
    let stored = sim.uploaded(media_id).expect("the upload is kept");
    assert_same_bytes(&stored, &patterned(upload_len, 0), "the SDK's upload");

    let media = &sends[1];
    assert_eq!(media["errcode"], 0, "{media}");
    assert_eq!(media["frame"]["body"]["chatid"], GROUP, "{media}");
    assert_eq!(media["frame"]["body"]["msgtype"], "file", "{media}");
    assert_eq!(media["frame"]["body"]["file"]["media_id"], media_id, "{media}");

    // Nothing the SDK could not place: every answer matched a request of its own.
    for odd in ["Received unknown frame", "Heartbeat ack error", "Reply ack timeout"] {
        assert!(!log.contains(odd), "the SDK logged {odd:?}:\n{log}");
    }
    // Pings every 300 ms, each answered: the link was never dropped or made again.
    assert!(sim.pings(BOT).len() >= 3, "{:?}", sim.pings(BOT));
    assert_eq!(sim.subscribes(BOT), 1);
    assert_eq!(sim.handshakes(), 1);
    assert!(sim.overlaps().is_empty(), "{:?}", sim.overlaps());
    assert!(
        sim.frames().iter().all(|f| f["errcode"].is_null() || f["errcode"] == 0),
        "every frame answered 0: {:?}",
        sim.frames()
    );
}

#[test]
fn a_reply_past_wecoms_window_goes_as_a_send() {
    let (d, sim) = wecom("wc-window", "");
    let (mut x, cch) = bound(&d, &sim, GROUP);
    // WeCom closes the message's window at once (its answer: 846608).
    sim.set_reply_window(Duration::ZERO);
    let pushed = sim.send_text(BOT, &Chat::group(GROUP, ANN), "@robot late?");
    let push = x.next_push(WAIT).expect("pushed");
    let reply_ref = push["payload"]["reply"]["reply_ref"].as_str().unwrap().to_string();
    let r = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref, "text": "late answer"}),
        "wc-w1",
    );
    assert_eq!(r["payload"]["result"]["status"], "sent", "{r}");
    assert_eq!(
        sim.replies(&pushed.req_id).len(),
        1,
        "the reply was tried on the req_id"
    );
    let sends = sim.frames_of("aibot_send_msg");
    assert_eq!(sends.len(), 1, "then sent as a message: {sends:?}");
    assert_eq!(sends[0]["frame"]["body"]["markdown"]["content"], "late answer");
}
