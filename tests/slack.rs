//! The Slack provider against `common/slack.rs`, a simulator of the Web API and Socket Mode
//! written from Slack's docs and its Python SDK: binding and each failure, messages in and the
//! acknowledgement only after the commit (a SIGKILL in between loses nothing and stores once),
//! thread replies, files both ways, `disconnect` and `link_disabled`, a silent socket, the
//! catch-up after a gap longer than Slack's retries (thread replies too), rate limits, the
//! bot's own messages, and tokens that never leave imgate.

use std::time::Duration;

use crate::common::slack::SlackSim;
use crate::common::*;
use serde_json::{json, Value};

const BOT: &str = "xoxb-1111-2222-botsecretAAA";
const APP: &str = "xapp-1-A0APP1-3333-appsecretBBB";
const BOT_USER: &str = "U0BOT0001";
const BOT_ID: &str = "B0BOT0001";
const CHAN: &str = "C0OPS0001";
const ANN: &str = "U0ANN0001";
const WAIT: Duration = Duration::from_secs(15);

fn slack(tag: &str, env: &[(&str, &str)]) -> (Daemon, SlackSim) {
    let sim = SlackSim::start();
    sim.add_app(BOT, APP, BOT_USER, BOT_ID);
    sim.add_user(ANN, "Ann");
    sim.add_channel(CHAN, "ops", "channel", &[BOT_USER, ANN]);
    let dir = temp_dir(tag);
    let conf = format!("[slack]\napi_base = {}\n", sim.base);
    (
        Daemon::start_env(&dir, &config_text(free_port(), &dir, None, &conf), "trace", env),
        sim,
    )
}

fn bind(x: &mut Sim, cch: &str, bot: &str, app: &str, channel: &str) -> Value {
    x.request(
        "auth.start",
        Some(cch),
        json!({"flow_id": "slack_app_binding", "input": {"bot_token": bot, "app_token": app, "channel_id": channel}}),
    )
}

fn bound(d: &Daemon, sim: &SlackSim) -> (Sim, String) {
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let a = bind(&mut x, &cch, BOT, APP, CHAN);
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    assert!(sim.wait_connected(APP, 1, WAIT), "the binding opens the bot's socket");
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

#[test]
fn binding_checks_both_tokens_the_channel_and_its_history_and_keeps_the_tokens_private() {
    let (d, sim) = slack("sl-bind", &[]);
    sim.add_channel("C0ELSE001", "elsewhere", "channel", &[ANN]);
    sim.add_app("xoxb-9-nosocket", "xapp-9-nosocket", "U0BOT0009", "B0BOT0009");
    sim.set_socket_mode("xapp-9-nosocket", false);
    sim.add_channel("C0NOSOCK1", "nosock", "channel", &["U0BOT0009", ANN]);
    sim.add_app("xoxb-8-noscope", "xapp-8-noscope", "U0BOT0008", "B0BOT0008");
    sim.remove_scope("xoxb-8-noscope", "channels:history");
    sim.add_channel("C0NOSCOP1", "noscope", "channel", &["U0BOT0008", ANN]);

    let (_, card) = http_get(&d.url("/connector-card.json"), &[]);
    let card: Value = serde_json::from_str(&card).unwrap();
    assert_card(&card);
    let flow = card["auth_flows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == "slack_app_binding")
        .cloned()
        .expect("the Card offers slack_app_binding when [slack] is set");
    assert_eq!(flow["fields"][0]["secret"], true, "{flow}");
    assert_eq!(flow["fields"][1]["secret"], true, "{flow}");

    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    failed_because(&bind(&mut x, &cch, "xoxb-0-wrong", APP, CHAN), "rejected the bot token");
    failed_because(&bind(&mut x, &cch, BOT, "xapp-0-wrong", CHAN), "rejected the app token");
    failed_because(
        &bind(&mut x, &cch, BOT, BOT, CHAN),
        "app_token must be an app-level token",
    );
    failed_because(
        &bind(&mut x, &cch, "xoxb-9-nosocket", "xapp-9-nosocket", "C0NOSOCK1"),
        "Socket Mode",
    );
    failed_because(&bind(&mut x, &cch, BOT, APP, "C0ELSE001"), "not in this channel");
    failed_because(&bind(&mut x, &cch, BOT, APP, "C0NOPE001"), "does not know this channel");
    failed_because(
        &bind(&mut x, &cch, "xoxb-8-noscope", "xapp-8-noscope", "C0NOSCOP1"),
        "channels:history",
    );
    failed_because(&bind(&mut x, &cch, BOT, APP, "C0../x"), "channel_id must be");

    let ok = bind(&mut x, &cch, BOT, APP, CHAN);
    assert_eq!(ok["payload"]["status"], "authenticated", "{ok}");
    let descriptor = &ok["payload"]["connection_descriptor"];
    assert_descriptor(descriptor);
    assert_eq!(descriptor["target"]["provider"], "slack");
    assert_eq!(descriptor["target"]["display_name"], "#ops");
    assert_eq!(descriptor["target"]["account_hint"], "C0***01", "a redacted hint only");
    assert!(sim.wait_connected(APP, 1, WAIT));
    assert_eq!(
        sim.auth_header_of_calls("apps.connections.open").last().unwrap(),
        &format!("Bearer {APP}"),
        "the app token goes only in the header"
    );
    for name in [format!("{BOT_USER}.bot"), format!("{BOT_USER}.app")] {
        let file = d.dir.join("state/slack").join(name);
        let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&file).unwrap().permissions());
        assert_eq!(mode & 0o777, 0o600, "the token file is private");
    }
    metrics_once(&d, "imgate_slack_connections_up 1", WAIT);
    let all = serde_json::to_string(&x.seen).unwrap() + &card.to_string() + &get_json(&d.url("/status")).to_string();
    assert_no_secret(
        &all,
        &[BOT, APP, "secretAAA", "secretBBB"],
        "a packet, the Card or /status",
    );
    assert_no_secret(&d.log(), &[BOT, APP, "ticket="], "the trace log");

    // The channel moves to another bot: the first bot's tokens have no binding left.
    sim.add_app("xoxb-7-other", "xapp-7-other", "U0BOT0007", "B0BOT0007");
    sim.add_channel("C0OTHER01", "other", "channel", &["U0BOT0007", ANN]);
    let moved = bind(&mut x, &cch, "xoxb-7-other", "xapp-7-other", "C0OTHER01");
    assert_eq!(moved["payload"]["status"], "authenticated", "{moved}");
    assert!(
        !d.dir.join(format!("state/slack/{BOT_USER}.bot")).exists(),
        "tokens no binding uses are forgotten"
    );
    assert!(sim.wait_open_sockets(APP, 0, WAIT), "and the first bot's socket closes");
}

#[test]
fn messages_are_acknowledged_after_their_commit_and_replies_go_to_their_thread() {
    let (d, sim) = slack("sl-text", &[]);
    sim.set_max_text_len(4000);
    let before = sim.post(CHAN, ANN, "said before the binding", None);
    let (mut x, cch) = bound(&d, &sim);
    let ts = sim.post(
        CHAN,
        ANN,
        "<@U0ANN0001> is the door locked? &amp; <https://x.io|the plan>",
        None,
    );
    let push = x.next_push(WAIT).expect("the Slack message is pushed");
    assert_packet(&push);
    let p = &push["payload"];
    assert_eq!(p["provider"], "slack");
    assert_eq!(
        p["message_id"],
        format!("{CHAN}:{ts}"),
        "history from before the binding is not read"
    );
    assert_eq!(p["sender_name"], "Ann");
    assert_eq!(p["chat_type"], "group");
    assert_eq!(p["raw_text"], "@Ann is the door locked? & the plan (https://x.io)");
    assert!(sim.wait_acked_ts(&ts, WAIT), "acknowledged once stored");
    assert!(sim.envelopes_of(&before).is_empty());

    let a = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref(&push), "text": "yes, locked"}),
        "sl-1",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let posted = sim.posted(CHAN);
    assert_eq!(posted.last().unwrap()["text"], "yes, locked");
    assert_eq!(
        posted.last().unwrap()["thread_ts"],
        ts.as_str(),
        "the reply starts a thread"
    );

    // A reply in the thread: answering it goes to the thread's parent, never to the reply.
    let in_thread = sim.post(CHAN, ANN, "and the window?", Some(&ts));
    let push = x.next_push(WAIT).expect("the thread reply is pushed");
    assert_eq!(push["payload"]["message_id"], format!("{CHAN}:{in_thread}"));
    let a = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref(&push), "text": "closed too"}),
        "sl-2",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let last = sim.posted(CHAN).last().unwrap().clone();
    assert_eq!(last["thread_ts"], ts.as_str(), "{last}");
    assert_ne!(last["thread_ts_was_reply"], true);

    // Long text is split at Slack's limit.
    let long = "z".repeat(9000);
    let a = x.tool(&cch, "imgate_message_send", json!({"text": long}), "sl-3");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let posted = sim.posted(CHAN);
    assert_eq!(posted.len(), 5, "9,000 characters go as three messages");
    assert_eq!(posted[2]["text"].as_str().unwrap().chars().count(), 4000);

    // The bot's own messages (each send came back as an event), edits, deletes and
    // messages of unbound channels are acknowledged and not pushed.
    let own = posted.last().unwrap()["ts"].as_str().unwrap().to_string();
    assert!(sim.wait_acked_ts(&own, WAIT), "the bot's own echo is acknowledged");
    // Agent text is text: it cannot notify the whole channel or become a link.
    let a = x.tool(
        &cch,
        "imgate_message_send",
        json!({"text": "ping <!channel> & <https://x.io|y>"}),
        "sl-4",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let last = sim.posted(CHAN).last().unwrap().clone();
    assert_eq!(last["text"], "ping &lt;!channel&gt; &amp; &lt;https://x.io|y&gt;");
    let own = last["ts"].as_str().unwrap().to_string();
    assert!(sim.wait_acked_ts(&own, WAIT));
    let edit = sim.edit(CHAN, &ts, "edited");
    assert!(sim.wait_acked_ts(&edit, WAIT));
    sim.add_channel("C0UNBOUND", "random", "channel", &[BOT_USER, ANN]);
    let elsewhere = sim.post("C0UNBOUND", ANN, "not for imgate", None);
    assert!(sim.wait_acked_ts(&elsewhere, WAIT));
    let next = sim.post(CHAN, ANN, "the next one", None);
    let push = x.next_push(WAIT).expect("the next message is pushed");
    assert_eq!(
        push["payload"]["message_id"],
        format!("{CHAN}:{next}"),
        "nothing between: the bot's echoes, the edit and the unbound channel were not pushed"
    );
    let status = get_json(&d.url("/status"));
    let unbound = &status["unbound_recent"];
    assert!(
        unbound
            .as_array()
            .unwrap()
            .iter()
            .any(|u| u["provider"] == "slack" && u["conversation_id"] == "C0UNBOUND"),
        "{status}"
    );
    assert_stops_cleanly(d);
}

#[test]
fn a_sigkill_between_an_event_and_its_commit_loses_nothing_and_stores_it_once() {
    let (mut d, sim) = slack("sl-crash", &[("IMGATE_TEST_CRASH", "intake-before-commit:1")]);
    sim.set_redelivery(Duration::from_secs(1), 3);
    let (_, cch) = bound(&d, &sim);
    let ts = sim.post(CHAN, ANN, "survive me", None);
    assert!(
        d.wait_exit(WAIT).is_some(),
        "killed between receiving the event and its commit"
    );
    assert!(sim.acked().is_empty(), "nothing acknowledged it");

    let d = d.restart_env(&[]);
    assert!(
        sim.wait_connected(APP, 2, WAIT),
        "the bot connects again after the restart"
    );
    assert!(sim.wait_acked_ts(&ts, WAIT), "a later delivery is acknowledged");
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    let push = x.next_push(WAIT).expect("the message survived the crash");
    assert_eq!(push["payload"]["message_id"], format!("{CHAN}:{ts}"));
    let next = sim.post(CHAN, ANN, "after", None);
    let push = x.next_push(WAIT).expect("the next message");
    assert_eq!(
        push["payload"]["message_id"],
        format!("{CHAN}:{next}"),
        "stored once: the catch-up and Slack's retries brought it again, and nothing was pushed twice"
    );
}

#[test]
fn disconnects_open_the_next_socket_first_and_a_dropped_socket_comes_back() {
    let (d, sim) = slack("sl-disconnect", &[]);
    let (mut x, _) = bound(&d, &sim);
    sim.set_disconnect_grace(Duration::from_secs(30));
    sim.disconnect(APP, "warning");
    assert!(
        sim.wait_connected(APP, 2, WAIT),
        "a new socket while the old one still works"
    );
    assert!(
        sim.wait_open_sockets(APP, 1, WAIT),
        "the old socket is closed by imgate"
    );
    let ts = sim.post(CHAN, ANN, "on the new socket", None);
    let push = x.next_push(WAIT).expect("pushed");
    assert_eq!(push["payload"]["message_id"], format!("{CHAN}:{ts}"));

    sim.drop_connection(APP);
    assert!(sim.wait_connected(APP, 3, WAIT), "a dropped socket comes back");
    let ts = sim.post(CHAN, ANN, "after the drop", None);
    let push = x.next_push(WAIT).expect("pushed");
    assert_eq!(push["payload"]["message_id"], format!("{CHAN}:{ts}"));
}

#[test]
fn link_disabled_stops_the_bot_and_says_so_once() {
    let (d, sim) = slack("sl-disabled", &[]);
    let (mut x, cch) = bound(&d, &sim);
    sim.disconnect(APP, "link_disabled");
    let pushed = x.next_of("connection.descriptor.push", WAIT).expect("xAgent is told");
    assert_eq!(
        pushed["payload"]["connection_descriptor"]["connection"]["status"], "error",
        "{pushed}"
    );
    assert!(d.log_shows("link_disabled", WAIT));
    assert_eq!(d.log().matches("link_disabled").count(), 1, "said once");
    let page = get_json(&d.url("/status"));
    assert_eq!(page["channels"][0]["status"], "error", "{page}");
    let desc = x.request("connection.descriptor.get", Some(&cch), json!({}));
    let tools = desc["payload"]["connection_descriptor"]["tools"].to_string();
    assert!(tools.contains("Socket Mode"), "{tools}");
}

#[test]
fn a_silent_socket_is_replaced_within_a_minute() {
    let (d, sim) = slack("sl-silent", &[]);
    let (x, cch) = bound(&d, &sim);
    sim.go_silent(APP);
    assert!(
        sim.wait_connected(APP, 2, Duration::from_secs(120)),
        "a half-open socket is replaced"
    );
    assert!(sim.pings(APP) > 0, "imgate pings");
    // The xAgent stand-in read nothing meanwhile: it comes back as xAgent would.
    drop(x);
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    let ts = sim.post(CHAN, ANN, "still here", None);
    let push = x.next_push(WAIT).expect("pushed on the new socket");
    assert_eq!(push["payload"]["message_id"], format!("{CHAN}:{ts}"));
}

#[test]
fn messages_posted_while_imgate_was_down_arrive_once_and_in_order() {
    let (mut d, sim) = slack("sl-catchup", &[]);
    let (mut x, cch) = bound(&d, &sim);
    let first = sim.post(CHAN, ANN, "live", None);
    let push = x.next_push(WAIT).expect("pushed");
    assert_eq!(push["payload"]["message_id"], format!("{CHAN}:{first}"));
    drop(x);
    d.signal("TERM");
    assert!(d.wait_exit(WAIT).is_some());

    // Down for longer than Slack retries: only the history has these. Pages smaller than
    // asked make the catch-up follow the cursor.
    sim.set_history_page_cap(37);
    let mut missed = Vec::new();
    for i in 0..150 {
        missed.push(sim.post(CHAN, ANN, &format!("missed {i}"), None));
        if i == 70 {
            sim.post_as_bot(CHAN, BOT, "the bot's own", None);
        }
    }
    let d = d.restart();
    assert!(sim.wait_connected(APP, 2, WAIT));
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    let mut push = x.next_push(WAIT).expect("pushed");
    if push["payload"]["message_id"] == format!("{CHAN}:{first}") {
        // Its delivery was not confirmed before the stop: pushed again, as the contract allows.
        push = x.next_push(WAIT).expect("pushed");
    }
    for (i, ts) in missed.iter().enumerate() {
        if i > 0 {
            push = x.next_push(WAIT).expect("every missed message arrives");
        }
        assert_eq!(push["payload"]["message_id"], format!("{CHAN}:{ts}"), "in order");
    }
    let after = sim.post(CHAN, ANN, "live again", None);
    let push = x.next_push(WAIT).expect("pushed");
    assert_eq!(
        push["payload"]["message_id"],
        format!("{CHAN}:{after}"),
        "each missed message once, and the bot's own not at all"
    );
}

#[test]
fn thread_replies_posted_while_imgate_was_down_arrive_once_and_in_order() {
    let (mut d, sim) = slack("sl-threads", &[]);
    let (mut x, cch) = bound(&d, &sim);
    let mut live = |text: &str, thread: Option<&str>| {
        let ts = sim.post(CHAN, ANN, text, thread);
        let push = x.next_push(WAIT).expect("pushed live");
        assert_eq!(push["payload"]["message_id"], format!("{CHAN}:{ts}"));
        ts
    };
    let quiet = live("a thread with no reply in the gap", None);
    let quiet_reply = live("its only reply", Some(&quiet));
    let old = live("a thread from before", None);
    let live = live("its first reply", Some(&old));
    drop(x);
    d.signal("TERM");
    assert!(d.wait_exit(WAIT).is_some());
    let read_before = sim.calls("conversations.replies").len();

    // Down: replies in a thread whose parent is older than the mark (not in the history read
    // from it), in a thread started during the gap, one also sent to the channel (in both the
    // history and the thread), and the bot's own reply (never pushed). Pages of two make the
    // catch-up follow the history's and the threads' cursors.
    sim.set_history_page_cap(2);
    let in_old = sim.post(CHAN, ANN, "a reply in the old thread", Some(&old));
    let new = sim.post(CHAN, ANN, "a new thread", None);
    let in_new = sim.post(CHAN, ANN, "a reply in the new thread", Some(&new));
    let again_old = sim.post(CHAN, ANN, "another reply in the old thread", Some(&old));
    let broadcast = sim.post_broadcast(CHAN, ANN, "a reply also sent to the channel", &old);
    sim.post_as_bot(CHAN, BOT, "the bot's own reply", Some(&new));
    let last_new = sim.post(CHAN, ANN, "the new thread's last reply", Some(&new));
    let missed = [in_old, new.clone(), in_new, again_old, broadcast, last_new];
    let d = d.restart();
    assert!(sim.wait_connected(APP, 2, WAIT));
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    let before = [&quiet, &quiet_reply, &old, &live].map(|ts| format!("{CHAN}:{ts}"));
    let mut push = x.next_push(WAIT).expect("pushed");
    while before.iter().any(|id| push["payload"]["message_id"] == id.as_str()) {
        // Its delivery was not confirmed before the stop: pushed again, as the contract allows.
        push = x.next_push(WAIT).expect("pushed");
    }
    for (i, ts) in missed.iter().enumerate() {
        if i > 0 {
            push = x.next_push(WAIT).expect("every missed reply arrives");
        }
        assert_eq!(push["payload"]["message_id"], format!("{CHAN}:{ts}"), "in order ({i})");
    }
    // Only the threads with replies in the gap were read.
    let read: Vec<String> = sim.calls("conversations.replies")[read_before..]
        .iter()
        .map(|c| c["ts"].as_str().unwrap_or_default().to_string())
        .collect();
    assert!(read.iter().all(|t| *t == old || *t == new), "{read:?}");
    // The replies came as the live ones do: answering one goes to its thread's parent.
    let a = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref(&push), "text": "seen"}),
        "sl-t1",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    assert_eq!(sim.posted(CHAN).last().unwrap()["thread_ts"], new.as_str());
    let after = sim.post(CHAN, ANN, "live again", None);
    let push = x.next_push(WAIT).expect("pushed");
    assert_eq!(
        push["payload"]["message_id"],
        format!("{CHAN}:{after}"),
        "each missed reply once (the one also in the history too), the bot's own not at all"
    );
}

#[test]
fn a_sigkill_in_a_thread_catch_up_loses_no_reply() {
    let (mut d, sim) = slack("sl-thread-crash", &[]);
    let (mut x, cch) = bound(&d, &sim);
    let old = sim.post(CHAN, ANN, "a thread from before", None);
    let push = x.next_push(WAIT).expect("pushed live");
    assert_eq!(push["payload"]["message_id"], format!("{CHAN}:{old}"));
    drop(x);
    d.signal("TERM");
    assert!(d.wait_exit(WAIT).is_some());

    let in_old = sim.post(CHAN, ANN, "a reply in the old thread", Some(&old));
    let new = sim.post(CHAN, ANN, "a new thread", None);
    let in_new = sim.post(CHAN, ANN, "a reply in the new thread", Some(&new));
    let again_old = sim.post(CHAN, ANN, "another reply in the old thread", Some(&old));
    // Killed before the commit of the catch-up's second message: the first is stored, the mark
    // has not moved (its window is not all in). The history's first answer is a 429, so the
    // kill comes after imgate listens (which the restart waits for).
    sim.rate_limit_next("conversations.history", 1, 2);
    let mut d = d.restart_env(&[("IMGATE_TEST_CRASH", "intake-before-commit:2")]);
    assert!(d.wait_exit(WAIT).is_some(), "killed in the catch-up");
    let d = d.restart_env(&[]);
    assert!(sim.wait_connected(APP, 3, WAIT));
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    let mut push = x.next_push(WAIT).expect("pushed");
    if push["payload"]["message_id"] == format!("{CHAN}:{old}") {
        // Its delivery was not confirmed before the stop: pushed again, as the contract allows.
        push = x.next_push(WAIT).expect("pushed");
    }
    for (i, ts) in [&in_old, &new, &in_new, &again_old].iter().enumerate() {
        if i > 0 {
            push = x.next_push(WAIT).expect("every missed reply arrives");
        }
        assert_eq!(push["payload"]["message_id"], format!("{CHAN}:{ts}"), "in order ({i})");
    }
    let after = sim.post(CHAN, ANN, "live again", None);
    let push = x.next_push(WAIT).expect("pushed");
    assert_eq!(
        push["payload"]["message_id"],
        format!("{CHAN}:{after}"),
        "each once: the one stored before the kill was a duplicate the second time"
    );
}

#[test]
fn a_posted_file_arrives_in_the_file_cache_fetched_with_the_bot_token() {
    let (d, sim) = slack("sl-files", &[]);
    let (mut x, _) = bound(&d, &sim);
    let png = patterned(300_000, 7);
    let ts = sim.post_file(CHAN, ANN, "the plan", "plan.png", "image/png", &png);
    let push = x.next_push(WAIT).expect("the file message is pushed");
    let file = &push["payload"]["files"][0];
    assert_eq!(file["filename"], "plan.png", "{push}");
    assert_eq!(push["payload"]["message_type"], "image");
    let (status, bytes) = download(&d, file);
    assert_eq!(status, 200);
    assert_same_bytes(&bytes, &png, "the Slack file");
    assert!(sim.wait_acked_ts(&ts, WAIT));
    assert!(
        sim.downloads().iter().all(|dl| dl["auth"] == format!("Bearer {BOT}")),
        "{:?}",
        sim.downloads()
    );
}

#[test]
fn a_sent_file_is_uploaded_to_the_channel_with_its_caption() {
    let (d, sim) = slack("sl-upload", &[]);
    let (mut x, cch) = bound(&d, &sim);
    let (status, up) = upload_as(&d, &cch, "report.pdf", "application/pdf", b"%PDF-1.4 report");
    assert_eq!(status, 200, "{up}");
    let a = x.tool(
        &cch,
        "imgate_file_send",
        json!({"file_ref": up["file_ref"], "caption": "the report"}),
        "sl-f1",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let uploads = sim.uploads();
    let u = uploads.last().expect("the upload was completed");
    assert_eq!(u["channel_id"], CHAN, "{u}");
    assert_eq!(u["initial_comment"], "the report", "{u}");
    let file_id = u["file_id"].as_str().unwrap();
    assert_eq!(sim.uploaded_bytes(file_id), b"%PDF-1.4 report");
}

#[test]
fn a_rate_limited_send_waits_and_is_sent_once() {
    let (d, sim) = slack("sl-rate", &[]);
    let (mut x, cch) = bound(&d, &sim);
    // A rate limit within the tool's deadline: waited for, then sent once.
    sim.rate_limit_next("chat.postMessage", 1, 1);
    let before = sim.calls("chat.postMessage").len();
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "after a pause"}), "sl-r1");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    assert_eq!(sim.calls("chat.postMessage").len(), before + 2, "one refused, one sent");
    assert_eq!(sim.posted(CHAN).last().unwrap()["text"], "after a pause");
}

#[test]
fn a_rate_limited_reconnect_waits_as_asked_then_connects() {
    let (d, sim) = slack("sl-reconnect", &[]);
    let _bound = bound(&d, &sim);
    let opens = sim.calls("apps.connections.open").len();
    sim.rate_limit_next("apps.connections.open", 1, 2);
    sim.drop_connection(APP);
    assert!(sim.wait_connected(APP, 2, WAIT));
    assert_eq!(
        sim.calls("apps.connections.open").len(),
        opens + 2,
        "one refused, one answered: no retry storm"
    );
}

/// A server that ignores `oldest` pages a long thread from its start: ten pages bring no reply
/// past the mark. The thread's gap is given up (logged), not the channel's: what else the gap
/// holds is stored, and the mark moves on.
#[test]
fn a_thread_whose_pages_never_pass_the_mark_holds_the_channel_back_no_longer() {
    let (mut d, sim) = slack("sl-endless", &[]);
    let (mut x, cch) = bound(&d, &sim);
    let mut live = |text: &str, thread: Option<&str>| {
        let ts = sim.post(CHAN, ANN, text, thread);
        let push = x.next_push(WAIT).expect("pushed live");
        assert_eq!(push["payload"]["message_id"], format!("{CHAN}:{ts}"));
        ts
    };
    let long = live("a long thread", None);
    let replies: Vec<String> = (0..25).map(|i| live(&format!("old reply {i}"), Some(&long))).collect();
    drop(x);
    d.signal("TERM");
    assert!(d.wait_exit(WAIT).is_some());

    sim.set_history_page_cap(2);
    sim.set_replies_ignore_oldest(true);
    sim.post(CHAN, ANN, "a reply in the gap", Some(&long));
    let gap = sim.post(CHAN, ANN, "a message in the gap", None);
    let d = d.restart();
    assert!(sim.wait_connected(APP, 2, WAIT));
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    let before: Vec<String> = std::iter::once(&long)
        .chain(&replies)
        .map(|ts| format!("{CHAN}:{ts}"))
        .collect();
    let mut push = x.next_push(WAIT).expect("pushed");
    while before.iter().any(|id| push["payload"]["message_id"] == id.as_str()) {
        // Its delivery was not confirmed before the stop: pushed again, as the contract allows.
        push = x.next_push(WAIT).expect("pushed");
    }
    assert_eq!(
        push["payload"]["message_id"],
        format!("{CHAN}:{gap}"),
        "the gap's message: {push}"
    );
    assert!(d.log_shows("brought no reply past the mark", WAIT), "{}", d.log());
    let after = sim.post(CHAN, ANN, "live again", None);
    let push = x.next_push(WAIT).expect("pushed");
    assert_eq!(push["payload"]["message_id"], format!("{CHAN}:{after}"), "{push}");
}
