//! The DingTalk provider against `common/dingtalk.rs`, a simulator of Stream mode and the robot
//! OpenAPI written from DingTalk's protocol docs and its SDKs: binding and each failure, a
//! message in and its answer only after the commit (a SIGKILL in between: no answer), pings,
//! `disconnect` and a new ticket, the next connection at once after one that worked, replies
//! through the session webhook (a group's @-ing whom they answer) and, once it expired, through
//! the OpenAPI (group and one-to-one), files both ways, a token renewed when refused,
//! throttling and flow control, the Descriptor's conversation ID and title, and the secret and
//! the webhook URL absent from every log line and packet.

use std::time::Duration;

use crate::common::dingtalk::DingTalkSim;
use crate::common::*;
use serde_json::{json, Value};

const APP: &str = "dingsimapp0000000001";
const SECRET: &str = "Sim-Secret_9f8e7d6c5b4a39281706f5e4d3c2b1a0";
/// A group whose ID has every base64 character a key must not hold.
const GROUP: &str = "cidGr0up+Ops/Room==";
const P2P: &str = "cidP2pAnn0001==";
const ANN: &str = "0166503412345";
const BOB: &str = "0166503499999";
const WAIT: Duration = Duration::from_secs(15);

fn dingtalk(tag: &str, env: &[(&str, &str)]) -> (Daemon, DingTalkSim) {
    let sim = DingTalkSim::start();
    sim.add_app(APP, SECRET);
    sim.add_user(ANN, "Ann");
    sim.add_user(BOB, "Bob");
    sim.add_group(GROUP, "Ops room");
    sim.add_p2p(P2P, ANN);
    let dir = temp_dir(tag);
    let conf = format!(
        "[dingtalk]\napi_base = {}\noapi_base = {}\n",
        sim.api_base, sim.oapi_base
    );
    (
        Daemon::start_env(&dir, &config_text(free_port(), &dir, None, &conf), "trace", env),
        sim,
    )
}

fn bind(x: &mut Sim, cch: &str, client_id: &str, secret: &str, conversation: &str) -> Value {
    x.request(
        "auth.start",
        Some(cch),
        json!({"flow_id": "dingtalk_robot_binding",
               "input": {"client_id": client_id, "client_secret": secret, "conversation_id": conversation}}),
    )
}

fn bound_to(d: &Daemon, sim: &DingTalkSim, conversation: &str) -> (Sim, String) {
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let a = bind(&mut x, &cch, APP, SECRET, conversation);
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    assert!(
        sim.wait_connected(APP, 1, WAIT),
        "the binding opens the app's Stream connection"
    );
    (x, cch)
}

fn failed_because(a: &Value, needle: &str) {
    assert_eq!(a["payload"]["status"], "failed", "{a}");
    let message = a["payload"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(needle), "{message}");
}

fn reply_ref(push: &Value) -> String {
    push["payload"]["reply"]["reply_ref"].as_str().unwrap().to_string()
}

/// The session webhook URLs DingTalk handed out (credentials, like the secret).
fn webhooks(sim: &DingTalkSim, ids: &[&str]) -> Vec<String> {
    ids.iter()
        .filter_map(|id| sim.message(id))
        .map(|m| m["sessionWebhook"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn binding_checks_the_credentials_and_stream_mode_and_keeps_the_secret_private() {
    let (d, sim) = dingtalk("dt-bind", &[]);
    sim.add_app("dingnostream00000001", "other-secret");
    sim.set_stream_enabled("dingnostream00000001", false);

    let (_, card) = http_get(&d.url("/connector-card.json"), &[]);
    let card: Value = serde_json::from_str(&card).unwrap();
    assert_card(&card);
    let flow = card["auth_flows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == "dingtalk_robot_binding")
        .cloned()
        .expect("the Card offers dingtalk_robot_binding when [dingtalk] is set");
    assert_eq!(flow["fields"][1]["name"], "client_secret", "{flow}");
    assert_eq!(flow["fields"][1]["secret"], true, "{flow}");

    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    failed_because(
        &bind(&mut x, &cch, APP, "wrong-secret", GROUP),
        "rejected the Client ID or Client Secret",
    );
    failed_because(
        &bind(&mut x, &cch, "dingnostream00000001", "other-secret", GROUP),
        "Stream mode",
    );
    failed_because(&bind(&mut x, &cch, APP, SECRET, "cid../x y"), "conversation_id must be");
    failed_because(&bind(&mut x, &cch, "ding app", SECRET, GROUP), "client_id must be");

    let ok = bind(&mut x, &cch, APP, SECRET, GROUP);
    assert_eq!(ok["payload"]["status"], "authenticated", "{ok}");
    let descriptor = &ok["payload"]["connection_descriptor"];
    assert_descriptor(descriptor);
    assert_eq!(descriptor["target"]["provider"], "dingtalk");
    assert!(sim.wait_connected(APP, 1, WAIT));
    assert_eq!(
        sim.reused_ticket_attempts(),
        0,
        "the binding's own ticket is never used"
    );
    let file = d.dir.join(format!("state/dingtalk/{APP}.secret"));
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&file).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "the secret file is private");

    // Before its first message the conversation's kind is not known; the message tells it.
    let first = sim.send_text(APP, GROUP, ANN, "hello");
    let push = x.next_push(WAIT).expect("the group's message is pushed");
    assert_eq!(push["payload"]["message_id"], first.as_str());
    assert!(sim.wait_answered(&first, WAIT));

    // A conversation without a binding writes: answered, not stored, listed so an owner can
    // bind it; its binding takes the group's title from what was seen.
    sim.add_group("cidOtherGroup01==", "Night shift");
    let other = sim.send_text(APP, "cidOtherGroup01==", BOB, "anyone?");
    assert!(
        sim.wait_answered(&other, WAIT),
        "an unbound conversation's message is answered"
    );
    let status = get_json(&d.url("/status"));
    let listed = status["unbound_recent"]
        .as_array()
        .unwrap()
        .iter()
        .any(|u| u["provider"] == "dingtalk" && u["conversation_id"] == "cidOtherGroup01==");
    assert!(listed, "{status}");
    let (cch2, _) = x.open(None);
    let a = bind(&mut x, &cch2, APP, SECRET, "cidOtherGroup01==");
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    assert_eq!(
        a["payload"]["connection_descriptor"]["target"]["display_name"],
        "Night shift"
    );
    assert_eq!(
        sim.connections(APP),
        1,
        "one connection serves both conversations of the app"
    );

    let metrics = metrics_once(&d, "imgate_dingtalk_connections_up 1", WAIT);
    assert!(
        metrics.contains("imgate_dingtalk_unbound_messages_total 1"),
        "{metrics}"
    );
    let hooks = webhooks(&sim, &[&first, &other]);
    let all = serde_json::to_string(&x.seen).unwrap() + &card.to_string() + &get_json(&d.url("/status")).to_string();
    let mut secrets: Vec<&str> = vec![SECRET];
    secrets.extend(hooks.iter().map(String::as_str));
    assert_no_secret(&all, &secrets, "a packet, the Card or /status");
    secrets.push("ticket=");
    assert_no_secret(&d.log(), &secrets, "the trace log");
}

#[test]
fn messages_are_answered_after_their_commit_and_replies_use_the_session_webhook_then_the_openapi() {
    let (d, sim) = dingtalk("dt-text", &[]);
    let (mut x, cch) = bound_to(&d, &sim, GROUP);
    let id = sim.send_text(APP, GROUP, ANN, " is the door locked? ");
    let push = x.next_push(WAIT).expect("the robot message is pushed");
    assert_packet(&push);
    let p = &push["payload"];
    assert_eq!(p["provider"], "dingtalk");
    assert_eq!(p["message_id"], id.as_str());
    assert_eq!(p["sender_name"], "Ann");
    assert_eq!(p["chat_type"], "group");
    assert_eq!(p["raw_text"], "is the door locked?");
    assert!(sim.wait_answered(&id, WAIT), "answered once stored");
    let answer = sim
        .client_frames()
        .into_iter()
        .find(|f| f["code"] == 200 && f["data"] == "{\"response\":null}")
        .expect("the answer frame follows the protocol");
    assert_eq!(answer["headers"]["contentType"], "application/json", "{answer}");

    // A reply goes through the message's session webhook (robots cannot quote).
    let a = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref(&push), "text": "yes, locked"}),
        "dt-1",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let posts = sim.webhook_posts(GROUP);
    assert_eq!(
        posts.last().unwrap()["body"]["text"]["content"],
        "yes, locked",
        "{posts:?}"
    );
    assert!(
        sim.group_sends(GROUP).is_empty(),
        "no OpenAPI call while the webhook lives"
    );

    // Long text is split.
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "z".repeat(9000)}), "dt-2");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    assert_eq!(
        sim.webhook_posts(GROUP).len(),
        6,
        "9,000 characters go as five messages"
    );

    // The webhook expired (DingTalk answers 300001): the OpenAPI sends, now and afterwards.
    sim.expire_session_webhooks();
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "still here"}), "dt-3");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let sends = sim.group_sends(GROUP);
    let last = sends.last().expect("sent through the OpenAPI");
    assert_eq!(last["msgKey"], "sampleText", "{last}");
    assert_eq!(last["param"]["content"], "still here", "{last}");
    assert_eq!(last["robotCode"], APP);
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "and again"}), "dt-4");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    assert_eq!(sim.group_sends(GROUP).len(), 2);
    assert_eq!(
        sim.webhook_posts(GROUP).len(),
        7,
        "a webhook DingTalk called expired is not tried again"
    );

    // Throttled: waited for, then sent once.
    sim.throttle_next("/v1.0/robot/groupMessages/send", 1);
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "after a pause"}), "dt-5");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    assert_eq!(sim.group_sends(GROUP).len(), 3);

    // A new message brings a new webhook: used again.
    let next = sim.send_text(APP, GROUP, BOB, "the next one");
    let push = x.next_push(WAIT).expect("the next message");
    assert_eq!(push["payload"]["message_id"], next.as_str());
    assert!(sim.wait_answered(&next, WAIT));
    let a = x.tool(
        &cch,
        "imgate_message_send",
        json!({"text": "via the new webhook"}),
        "dt-6",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    assert_eq!(
        sim.webhook_posts(GROUP).last().unwrap()["body"]["text"]["content"],
        "via the new webhook"
    );

    // The robot's own message (senderId is the robot) is answered and not pushed.
    let mut own = sim.robot_message(APP, GROUP, ANN, "text", json!({"content": "echo"}));
    own["senderId"] = json!(sim.chatbot_user_id(APP));
    let own = sim.push_message(APP, own);
    assert!(sim.wait_answered(&own, WAIT));
    let after = sim.send_text(APP, GROUP, ANN, "after the echo");
    let push = x.next_push(WAIT).expect("the message after the echo");
    assert_eq!(push["payload"]["message_id"], after.as_str(), "the echo was not pushed");
    let hooks = webhooks(&sim, &[&id, &next, &after]);
    let hooks: Vec<&str> = hooks.iter().map(String::as_str).collect();
    assert_no_secret(&d.log(), &hooks, "the trace log, after sends through them");
    assert_no_secret(&serde_json::to_string(&x.seen).unwrap(), &hooks, "a packet");
    assert_stops_cleanly(d);
}

#[test]
fn a_one_to_one_chat_is_answered_through_the_openapi_after_a_restart_and_the_webhook_expiry() {
    let (d, sim) = dingtalk("dt-p2p", &[]);
    let (mut x, cch) = bound_to(&d, &sim, P2P);
    let id = sim.send_text(APP, P2P, ANN, "remind me at six");
    let push = x.next_push(WAIT).expect("the one-to-one message is pushed");
    assert_eq!(push["payload"]["chat_type"], "p2p");
    assert!(sim.wait_answered(&id, WAIT));
    drop(x);
    // The webhook and the user kept with the message survive a restart.
    let d = d.restart_env(&[]);
    assert!(sim.wait_connected(APP, 2, WAIT));
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "noted"}), "dt-p1");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    assert_eq!(
        sim.webhook_posts(P2P).last().unwrap()["body"]["text"]["content"],
        "noted"
    );
    sim.expire_session_webhooks();
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "it is six"}), "dt-p2");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let sends = sim.oto_sends();
    let last = sends.last().expect("sent through the OpenAPI");
    assert_eq!(last["userIds"], json!([ANN]), "{last}");
    assert_eq!(last["param"]["content"], "it is six");
    // A retried call (the same idempotency key) is answered from the first result.
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "it is six"}), "dt-p2");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    assert_eq!(sim.oto_sends().len(), 1, "sent once");
}

#[test]
fn a_sigkill_between_a_message_and_its_commit_sends_no_answer() {
    let (mut d, sim) = dingtalk("dt-crash", &[("IMGATE_TEST_CRASH", "intake-before-commit:1")]);
    let (_, cch) = bound_to(&d, &sim, GROUP);
    let id = sim.send_text(APP, GROUP, ANN, "in flight");
    assert!(d.wait_exit(WAIT).is_some(), "killed between the message and its commit");
    assert!(sim.delivered(&id));
    assert!(sim.answered().is_empty(), "nothing answered it: it was not stored");
    let d = d.restart_env(&[]);
    assert!(
        sim.wait_connected(APP, 2, WAIT),
        "the app connects again after the restart"
    );
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    let next = sim.send_text(APP, GROUP, ANN, "after the restart");
    let push = x.next_push(WAIT).expect("the next message");
    assert_eq!(
        push["payload"]["message_id"],
        next.as_str(),
        "DingTalk does not send a robot message again: the one in flight is gone, and was never answered"
    );
    assert!(sim.wait_answered(&next, WAIT));
    assert_eq!(sim.answered(), vec![next], "the one in flight never was");
}

#[test]
fn pings_are_answered_and_a_disconnect_brings_a_new_ticket_and_connection() {
    let (d, sim) = dingtalk("dt-disconnect", &[]);
    let (mut x, _) = bound_to(&d, &sim, GROUP);
    let ping = sim.ping(APP);
    assert!(sim.wait_pong(&ping, WAIT), "a ping is answered with its data");

    // A socket is replaced no sooner than 10 s after it opened: this one is young.
    sim.set_disconnect_grace(Duration::from_secs(30));
    assert!(sim.disconnect(APP));
    assert!(
        sim.wait_connected(APP, 2, Duration::from_secs(30)),
        "a new connection before DingTalk closes the old one"
    );
    assert!(
        sim.tickets_issued(APP) >= 3,
        "a new ticket for it (the binding's, the first, the new)"
    );
    assert!(
        sim.wait_open_sockets(APP, 1, WAIT),
        "the old socket closes once it owes nothing"
    );
    let id = sim.send_text(APP, GROUP, ANN, "on the new connection");
    let push = x.next_push(WAIT).expect("pushed from the new connection");
    assert_eq!(push["payload"]["message_id"], id.as_str());
    assert!(sim.wait_answered(&id, WAIT));

    // A server that says `disconnect` to every new socket gets one new socket per 10 s, not a
    // storm of them.
    let asked = std::time::Instant::now();
    assert!(sim.disconnect(APP));
    assert!(sim.wait_connected(APP, 3, Duration::from_secs(30)));
    assert!(
        asked.elapsed() >= Duration::from_secs(8),
        "replaced after {:?}: a young socket waits",
        asked.elapsed()
    );
    assert!(sim.wait_open_sockets(APP, 1, WAIT));

    // A link that drops without a word: connected again after a backoff, with a new ticket.
    sim.drop_connection(APP);
    assert!(sim.wait_connected(APP, 4, WAIT));
    assert_eq!(sim.reused_ticket_attempts(), 0, "no ticket is ever used twice");
    let id = sim.send_text(APP, GROUP, BOB, "on the fourth");
    let push = x.next_push(WAIT).expect("pushed from the fourth connection");
    assert_eq!(push["payload"]["message_id"], id.as_str());

    // Stream mode turned off: the next connection is refused, the Descriptor says why.
    sim.set_stream_enabled(APP, false);
    sim.drop_connection(APP);
    // The first message's title was pushed before: the push that matters is the error's.
    loop {
        let pushed = x
            .next_of("connection.descriptor.push", WAIT)
            .expect("xAgent is told of the error");
        if pushed["payload"]["connection_descriptor"]["connection"]["status"] == "error" {
            break;
        }
    }
    assert!(d.log_shows("DingTalk refused a Stream connection", WAIT));
}

#[test]
fn pictures_rich_text_and_voice_arrive_with_their_files() {
    let (d, sim) = dingtalk("dt-files", &[]);
    let (mut x, _) = bound_to(&d, &sim, GROUP);
    let png = patterned(300_000, 7);
    sim.add_media("dcPlan01", &png, "plan.png");
    let id = sim.send_message(
        APP,
        GROUP,
        ANN,
        "picture",
        json!({"downloadCode": "dcPlan01", "pictureDownloadCode": "pdc01"}),
    );
    let push = x.next_push(WAIT).expect("the picture is pushed");
    assert_eq!(push["payload"]["message_type"], "image", "{push}");
    let (status, bytes) = download(&d, &push["payload"]["files"][0]);
    assert_eq!(status, 200);
    assert_same_bytes(&bytes, &png, "the DingTalk picture");
    assert!(sim.wait_answered(&id, WAIT));

    // Rich text: its words as the text, its first picture fetched like a picture.
    sim.add_media("dcRich01", b"GIF89a-rich", "rich.gif");
    sim.send_message(
        APP,
        GROUP,
        BOB,
        "richText",
        json!({"richText": [{"text": "see "}, {"type": "picture", "downloadCode": "dcRich01", "pictureDownloadCode": "p"}, {"text": "this"}]}),
    );
    let push = x.next_push(WAIT).expect("the rich text is pushed");
    assert_eq!(push["payload"]["raw_text"], "see this");
    let (_, bytes) = download(&d, &push["payload"]["files"][0]);
    assert_eq!(bytes, b"GIF89a-rich");

    // Audio: its recognition is the text.
    sim.add_media("dcVoice1", b"#!AMR\n", "voice.amr");
    sim.send_message(
        APP,
        GROUP,
        ANN,
        "audio",
        json!({"recognition": "call me back", "duration": 2, "downloadCode": "dcVoice1"}),
    );
    let push = x.next_push(WAIT).expect("the voice message is pushed");
    assert_eq!(push["payload"]["raw_text"], "call me back");
    let urls: Vec<String> = sim
        .calls("/v1.0/robot/messageFiles/download")
        .iter()
        .filter_map(|c| c["answer"]["downloadUrl"].as_str().map(str::to_string))
        .collect();
    assert_eq!(urls.len(), 3, "a download URL for each file in");
    let mut secrets: Vec<&str> = urls.iter().map(String::as_str).collect();
    secrets.extend(["access_token=", SECRET]);
    assert_no_secret(&d.log(), &secrets, "the trace log");
}

/// A file out: uploaded on the legacy API, then sent through the OpenAPI with its caption
/// first. The token DingTalk no longer takes is fetched again once.
#[test]
fn a_file_out_is_uploaded_and_sent_once_a_refused_token_is_renewed() {
    let (d, sim) = dingtalk("dt-upload", &[]);
    let (mut x, cch) = bound_to(&d, &sim, GROUP);
    // A message brings the session webhook the caption goes through.
    sim.send_text(APP, GROUP, ANN, "send me the report");
    x.next_push(WAIT).expect("pushed");
    let grants = sim.token_grants(APP);
    sim.expire_tokens();
    let (status, up) = upload_as(&d, &cch, "report.pdf", "application/pdf", b"%PDF-1.4 report");
    assert_eq!(status, 200, "{up}");
    let a = x.tool(
        &cch,
        "imgate_file_send",
        json!({"file_ref": up["file_ref"], "caption": "the report"}),
        "dt-f1",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    assert_eq!(sim.token_grants(APP), grants + 1, "one new token after the refusal");
    let uploads = sim.uploads();
    let u = uploads.last().expect("the file was uploaded");
    assert_eq!(u["type"], "file", "{u}");
    let media = u["media_id"].as_str().unwrap();
    assert_eq!(sim.uploaded_bytes(media), b"%PDF-1.4 report");
    let sends = sim.group_sends(GROUP);
    let last = sends.last().unwrap();
    assert_eq!(last["msgKey"], "sampleFile", "{last}");
    assert_eq!(last["param"]["mediaId"], media);
    assert_eq!(last["param"]["fileName"], "report.pdf");
    assert_eq!(last["param"]["fileType"], "pdf");
    assert_eq!(
        sim.webhook_posts(GROUP).last().unwrap()["body"]["text"]["content"],
        "the report",
        "the caption went first, through the webhook"
    );

    // An image goes as an image message.
    let png = patterned(300_000, 7);
    let (_, up) = upload_as(&d, &cch, "chart.png", "image/png", &png);
    let a = x.tool(&cch, "imgate_file_send", json!({"file_ref": up["file_ref"]}), "dt-f2");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let last = sim.group_sends(GROUP).last().unwrap().clone();
    assert_eq!(last["msgKey"], "sampleImageMsg", "{last}");
    let media = last["param"]["photoURL"].as_str().unwrap();
    assert_same_bytes(&sim.uploaded_bytes(media), &png, "the uploaded image");
    assert_no_secret(&d.log(), &["access_token=", SECRET], "the trace log");
}

#[test]
fn a_message_refused_by_full_caps_gets_no_answer() {
    let queue = "[queue]\nmax_messages_per_channel = 2\noverflow = reject_new\n";
    let sim = DingTalkSim::start();
    sim.add_app(APP, SECRET);
    sim.add_user(ANN, "Ann");
    sim.add_group(GROUP, "Ops room");
    let dir = temp_dir("dt-full");
    let conf = format!(
        "{queue}[dingtalk]\napi_base = {}\noapi_base = {}\n",
        sim.api_base, sim.oapi_base
    );
    let d = Daemon::start_env(&dir, &config_text(free_port(), &dir, None, &conf), "debug", &[]);
    let (x, cch) = bound_to(&d, &sim, GROUP);
    // xAgent away: the queue fills at two.
    drop(x);
    let mut stored: Vec<String> = (0..2)
        .map(|i| sim.send_text(APP, GROUP, ANN, &format!("m{i}")))
        .collect();
    for id in &stored {
        assert!(sim.wait_answered(id, WAIT), "stored and answered");
    }
    let refused = sim.send_text(APP, GROUP, ANN, "one too many");
    assert!(d.log_shows("queue full", WAIT), "said in the log");
    assert!(sim.delivered(&refused));
    // xAgent back: the queue drains, and the next message is stored and answered. Its answer
    // comes after any the refused one could have had (one conversation, one lane, one writer).
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    for id in &stored {
        let push = x.next_push(WAIT).expect("the stored messages are pushed");
        assert_eq!(push["payload"]["message_id"], id.as_str());
    }
    let later = sim.send_text(APP, GROUP, ANN, "room again");
    let push = x.next_push(WAIT).expect("the next message is pushed");
    assert_eq!(push["payload"]["message_id"], later.as_str(), "the refused one is gone");
    assert!(sim.wait_answered(&later, WAIT));
    stored.push(later);
    assert_eq!(sim.answered(), stored, "no 200 for the message that was not stored");
}

#[test]
fn two_bound_groups_show_their_ids_and_a_group_its_title_once_a_message_brought_it() {
    let (d, sim) = dingtalk("dt-names", &[]);
    let other = "cidOtherGroup01==";
    sim.add_group(other, "Night shift");
    let mut x = d.xagent();
    x.hello("");
    let (ops, _) = x.open(None);
    let (night, _) = x.open(None);
    // Bound before either wrote: neither kind nor title is known yet, the IDs tell them apart.
    let a = bind(&mut x, &ops, APP, SECRET, GROUP);
    let b = bind(&mut x, &night, APP, SECRET, other);
    let (a, b) = (
        &a["payload"]["connection_descriptor"]["target"],
        &b["payload"]["connection_descriptor"]["target"],
    );
    assert_eq!(a["account_hint"], GROUP, "a conversation ID is no secret: {a}");
    assert_eq!(b["account_hint"], other, "{b}");
    assert!(sim.wait_connected(APP, 1, WAIT));

    // The group's first message brings its title: xAgent is told.
    let id = sim.send_text(APP, GROUP, ANN, "hello");
    let push = x.next_push(WAIT).expect("the message is pushed");
    assert_eq!(push["payload"]["message_id"], id.as_str());
    let told = x
        .next_of("connection.descriptor.push", WAIT)
        .expect("the title a message brought is pushed");
    assert_packet(&told);
    assert_eq!(told["connector_channel_id"], ops.as_str(), "{told}");
    let target = &told["payload"]["connection_descriptor"]["target"];
    assert_eq!(target["display_name"], "Ops room", "{told}");
    assert_eq!(target["account_hint"], GROUP, "{told}");
}

/// imgate's floor against a server that closes every connection: at most one new one per 10 s.
const FLOOR: Duration = Duration::from_secs(10);
/// "At once" on a loaded machine.
const PROMPT: Duration = Duration::from_secs(4);

/// Asks for the app's next connection by closing the current one once it worked (a ping
/// answered); how long after the close the next one was up, and the connection's age then.
fn close_after_work(sim: &DingTalkSim, opened: std::time::Instant, n: u64) -> (Duration, Duration) {
    let ping = sim.ping(APP);
    assert!(sim.wait_pong(&ping, WAIT), "connection {n} works");
    let age = opened.elapsed();
    let closed = std::time::Instant::now();
    assert!(sim.close_connection(APP));
    assert!(
        sim.wait_connected(APP, n + 1, Duration::from_secs(60)),
        "connection {} after the close",
        n + 1
    );
    (closed.elapsed(), age)
}

#[test]
fn a_connection_that_worked_and_was_closed_by_dingtalk_is_followed_by_the_next_at_once() {
    let (d, sim) = dingtalk("dt-reconnect", &[]);
    let (_x, _) = bound_to(&d, &sim, GROUP);
    let mut opened = std::time::Instant::now();
    // One connection that lived past the floor: nothing but the clock to wait for.
    std::thread::sleep(FLOOR.saturating_sub(opened.elapsed()));
    // Five closes in a minute: the first of a connection that lived, then each as soon as the
    // new one worked (the floor's pace). Messages sent meanwhile are lost at DingTalk.
    let mut n = 1;
    for close in 1..=5 {
        let (gap, age) = close_after_work(&sim, opened, n);
        opened = std::time::Instant::now();
        n += 1;
        eprintln!("close {close}: connection aged {age:.1?}; the next up {gap:.2?} after the close");
        let floor = FLOOR.saturating_sub(age);
        assert!(
            gap <= floor + PROMPT,
            "close {close}: the next connection {gap:?} after the close of one that worked (aged {age:?})"
        );
    }

    // The next ticket is refused at the handshake: the failed attempt waits a short backoff,
    // not one grown by the closes before it.
    let refused = sim.refused_handshakes().len();
    sim.set_ticket_ttl(Duration::ZERO);
    let ping = sim.ping(APP);
    assert!(sim.wait_pong(&ping, WAIT));
    let age = opened.elapsed();
    let closed = std::time::Instant::now();
    assert!(sim.close_connection(APP));
    assert!(sim.wait_refused_handshakes(refused + 1, Duration::from_secs(60)));
    sim.set_ticket_ttl(Duration::from_secs(90));
    assert!(sim.wait_connected(APP, n + 1, Duration::from_secs(60)));
    let gap = closed.elapsed();
    eprintln!("close with a refused ticket: connection aged {age:.1?}; the next up {gap:.2?} after the close");
    assert!(
        gap < Duration::from_secs(30) && gap <= FLOOR.saturating_sub(age) + PROMPT + Duration::from_secs(2),
        "a refused ticket after a close left the app down for {gap:?}"
    );
    let id = sim.send_text(APP, GROUP, ANN, "after the closes");
    assert!(sim.delivered(&id), "the last connection carries messages");
    assert!(sim.wait_answered(&id, WAIT), "and stores them");
    assert_eq!(sim.reused_ticket_attempts(), 0);
}

#[test]
fn a_flow_controlled_user_is_sent_to_again_after_a_second_and_then_told_to_retry() {
    let (d, sim) = dingtalk("dt-flow", &[]);
    let (mut x, cch) = bound_to(&d, &sim, P2P);
    let id = sim.send_text(APP, P2P, ANN, "remind me");
    x.next_push(WAIT).expect("the one-to-one message is pushed");
    assert!(sim.wait_answered(&id, WAIT));
    sim.expire_session_webhooks();

    // DingTalk holds the message back twice: sent on the third call, at least a second apart.
    sim.flow_control_next(ANN, 2);
    let started = std::time::Instant::now();
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "it is six"}), "dt-fc1");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let sends = sim.oto_sends();
    assert_eq!(sends.len(), 3, "{sends:?}");
    assert_eq!(sends[2]["flowControlledStaffIdList"], json!([]), "{sends:?}");
    assert_eq!(sends[2]["param"]["content"], "it is six");
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "two waits of a second at least: {:?}",
        started.elapsed()
    );

    // Held back for longer than a tool call may take: an error the agent retries, nothing sent.
    sim.flow_control_next(ANN, 1000);
    let (a, took) = x.timed_tool(
        &cch,
        "imgate_message_send",
        json!({"text": "and now"}),
        Duration::from_secs(40),
    );
    assert_eq!(a["error"]["code"], "busy", "{a}");
    assert!(took < Duration::from_secs(25), "within the tool's time: {took:?}");
    let sends = sim.oto_sends();
    assert!(sends.len() > 4, "retried: {}", sends.len());
    assert!(sends.len() < 40, "bounded: {}", sends.len());
    assert!(
        sends[3..]
            .iter()
            .all(|s| s["flowControlledStaffIdList"] == json!([ANN])),
        "nothing reached the user"
    );
}

#[test]
fn a_reply_through_the_session_webhook_in_a_group_ats_the_sender_of_the_message_answered() {
    let (d, sim) = dingtalk("dt-at", &[]);
    let (mut x, cch) = bound_to(&d, &sim, GROUP);
    let from_ann = sim.send_text(APP, GROUP, ANN, "who has the keys?");
    let ann = x.next_push(WAIT).expect("Ann's message");
    assert_eq!(ann["payload"]["message_id"], from_ann.as_str());
    let from_bob = sim.send_text(APP, GROUP, BOB, "and the badge?");
    let bob = x.next_push(WAIT).expect("Bob's message");
    assert_eq!(bob["payload"]["message_id"], from_bob.as_str());

    // As the SDK's reply_text does: the answer @s whom it answers, even an earlier message's
    // sender.
    for (push, who, call) in [(&ann, ANN, "dt-at1"), (&bob, BOB, "dt-at2")] {
        let a = x.tool(
            &cch,
            "imgate_message_reply",
            json!({"reply_ref": reply_ref(push), "text": "I do"}),
            call,
        );
        assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
        let post = sim.webhook_posts(GROUP).last().cloned().unwrap();
        assert_eq!(post["errcode"], 0, "{post}");
        assert_eq!(post["body"]["at"]["atUserIds"], json!([who]), "{post}");
    }
    // A message that answers nobody @s nobody; a long reply @s once, with its first part.
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "noted"}), "dt-at3");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let post = sim.webhook_posts(GROUP).last().cloned().unwrap();
    assert!(post["body"]["at"].is_null(), "{post}");
    let before = sim.webhook_posts(GROUP).len();
    let a = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref(&ann), "text": "k".repeat(3000)}),
        "dt-at4",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let posts = sim.webhook_posts(GROUP);
    let ats: Vec<&Value> = posts[before..].iter().map(|p| &p["body"]["at"]).collect();
    assert_eq!(ats, [&json!({"atUserIds": [ANN]}), &Value::Null], "{posts:?}");
}
