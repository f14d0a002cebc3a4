//! The Matrix provider against a real homeserver: Synapse from PyPI (`common/synapse.rs`), on
//! loopback with SQLite, users registered by its shared secret. Ignored by `cargo test` (it needs
//! Python); `.ci/run` installs Synapse in `target/synapse-venv` and runs
//! `cargo test --test synapse -- --ignored` (docs/testing.md).

mod common;

use std::time::Duration;

use common::synapse::{MatrixUser, Synapse};
use common::*;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(30);

fn imgate(tag: &str, env: &[(&str, &str)]) -> Daemon {
    let dir = temp_dir(tag);
    Daemon::start_env(&dir, &config_text(free_port(), &dir, None, "[matrix]\n"), "trace", env)
}

fn bind(x: &mut Sim, cch: &str, hs: &Synapse, token: &str, room: &str) -> Value {
    x.request(
        "auth.start",
        Some(cch),
        json!({"flow_id": "matrix_room_binding",
               "input": {"homeserver": hs.base, "access_token": token, "room_id": room}}),
    )
}

fn failed_because(a: &Value, needle: &str) {
    assert_eq!(a["payload"]["status"], "failed", "{a}");
    let message = a["payload"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(needle), "{message}");
}

/// A homeserver with the bot and Alice, and a room of the two.
fn homeserver() -> (Synapse, MatrixUser, MatrixUser, String) {
    let hs = Synapse::start_relaxed();
    let bot = hs.register("imgate");
    let alice = hs.register("alice");
    alice.set_displayname("Alice");
    let room = alice.create_room(&[&bot.user_id], false);
    (hs, bot, alice, room)
}

fn bound(d: &Daemon, hs: &Synapse, bot: &MatrixUser, room: &str) -> (Sim, String) {
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let a = bind(&mut x, &cch, hs, &bot.access_token, room);
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    (x, cch)
}

/// The pushes that arrive until `n` are in, or `WAIT` passes without a new one.
fn pushes(x: &mut Sim, n: usize) -> Vec<Value> {
    let mut got = Vec::new();
    while got.len() < n {
        match x.next_push(WAIT) {
            Some(p) => got.push(p),
            None => break,
        }
    }
    got
}

fn bodies(pushes: &[Value]) -> Vec<String> {
    pushes
        .iter()
        .map(|p| p["payload"]["raw_text"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[test]
#[ignore = "needs Synapse from PyPI: run by .ci/run"]
fn binding_messages_both_ways_files_and_typing_against_synapse() {
    let (hs, bot, alice, room) = homeserver();
    let secret_room = alice.create_encrypted_room(&[&bot.user_id]);
    let elsewhere = alice.create_room(&[], false);
    let alias = alice.set_alias(&room, "ops");
    let d = imgate("syn-main", &[]);

    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    failed_because(
        &bind(&mut x, &cch, &hs, "syt_not_a_token", &room),
        "rejected the access token",
    );
    failed_because(
        &bind(&mut x, &cch, &hs, &bot.access_token, &secret_room),
        "end-to-end encrypted",
    );
    failed_because(&bind(&mut x, &cch, &hs, &bot.access_token, &elsewhere), "invite it");
    failed_because(&bind(&mut x, &cch, &hs, &bot.access_token, "room"), "room_id must be");
    // Bound by its alias: the invitation is accepted, the room's ID is what is kept.
    let ok = bind(&mut x, &cch, &hs, &bot.access_token, &alias);
    assert_eq!(ok["payload"]["status"], "authenticated", "{ok}");
    let descriptor = &ok["payload"]["connection_descriptor"];
    assert_descriptor(descriptor);
    assert_eq!(descriptor["target"]["provider"], "matrix");
    alice.wait_joined(&room, &bot.user_id, true, WAIT);
    let token_file = std::fs::read_dir(d.dir.join("state/matrix"))
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().ends_with(".token"))
        .expect("the token is kept in a file")
        .path();
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&token_file).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "the token file is private");

    // A text, a notice (never pushed: bots answer no bot), then an image.
    let text_id = alice.send_text(&room, "hello imgate");
    alice.send_notice(&room, "a bot's notice");
    let picture = patterned(70_000, 5);
    let (image_id, _) = alice.send_image(&room, &picture, "chart.png", "image/png");
    let got = pushes(&mut x, 2);
    assert_eq!(got.len(), 2, "the text and the image: {got:?}");
    let text = &got[0]["payload"];
    assert_eq!(text["message_id"], text_id.as_str());
    assert_eq!(text["provider"], "matrix");
    assert_eq!(text["raw_text"], "hello imgate");
    assert_eq!(text["sender_name"], "Alice", "{text}");
    assert_eq!(text["chat_type"], "p2p", "two members: {text}");
    let image = &got[1]["payload"];
    assert_eq!(image["message_id"], image_id.as_str());
    let file = &image["files"][0];
    assert_eq!(file["byte_size"], picture.len(), "{image}");
    let (status, bytes) = download(&d, file);
    assert_eq!(status, 200);
    assert!(bytes == picture, "the image's bytes come through authenticated media");
    assert!(
        alice.typing_seen(&room, &bot.user_id, WAIT),
        "after a delivery the room shows the bot typing"
    );

    // The tools: send, reply (quoting the event), a file with its caption.
    let sent = x.tool(&cch, "imgate_message_send", json!({"text": "hi Alice"}), "syn-1");
    assert_eq!(sent["payload"]["result"]["status"], "sent", "{sent}");
    let m = alice.wait_message(&room, |m| m["content"]["body"] == "hi Alice", WAIT);
    assert_eq!(m["sender"], bot.user_id.as_str());
    assert_eq!(m["content"]["msgtype"], "m.text");
    let reply_ref = text["reply"]["reply_ref"].as_str().unwrap();
    let replied = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref, "text": "answering"}),
        "syn-2",
    );
    assert_eq!(replied["payload"]["result"]["status"], "sent", "{replied}");
    let m = alice.wait_message(&room, |m| m["content"]["body"] == "answering", WAIT);
    assert_eq!(
        m["content"]["m.relates_to"]["m.in_reply_to"]["event_id"],
        text_id.as_str()
    );
    let report = patterned(120_000, 9);
    let (status, up) = upload(&d, &cch, API_KEY, "report.pdf", "application/pdf", &report);
    assert_eq!(status, 200, "{up}");
    let filed = x.tool(
        &cch,
        "imgate_file_send",
        json!({"file_ref": up["file_ref"], "caption": "the report"}),
        "syn-3",
    );
    assert_eq!(filed["payload"]["result"]["status"], "sent", "{filed}");
    let m = alice.wait_message(&room, |m| m["content"]["msgtype"] == "m.file", WAIT);
    assert_eq!(m["content"]["body"], "the report");
    assert_eq!(m["content"]["filename"], "report.pdf");
    let mxc = m["content"]["url"].as_str().unwrap();
    assert!(
        alice.download(mxc) == report,
        "the file Alice downloads is the one uploaded"
    );

    // The agent's own messages come back through /sync: none is pushed.
    let later = alice.send_text(&room, "thanks");
    let next = x.next_push(WAIT).expect("Alice's next message");
    assert_eq!(next["payload"]["message_id"], later.as_str(), "{next}");

    let log = d.log();
    assert_no_secret(&log, &[&bot.access_token], "imgate's log at trace level");
    let packets = serde_json::to_string(&x.seen).unwrap();
    assert_no_secret(&packets, &[&bot.access_token], "packets");
    let (_, status) = http_get(&d.url("/status"), &[]);
    assert_no_secret(&status, &[&bot.access_token], "/status");
}

#[test]
#[ignore = "needs Synapse from PyPI: run by .ci/run"]
fn a_sigkill_before_the_commit_and_a_gap_while_down_lose_nothing_and_push_nothing_twice() {
    let (hs, bot, alice, room) = homeserver();
    let mut d = imgate("syn-crash", &[("IMGATE_TEST_CRASH", "intake-before-commit:2")]);
    let (mut x, cch) = bound(&d, &hs, &bot, &room);
    let first = alice.send_text(&room, "before");
    let push = x.next_push(WAIT).expect("the first message");
    assert_eq!(push["payload"]["message_id"], first.as_str());
    // Read by the sync, killed before its commit.
    alice.send_text(&room, "in flight");
    assert!(d.wait_exit(WAIT).is_some(), "killed between the sync and the commit");
    drop(x);
    // More than a sync's timeline holds (10) while imgate is down: a gap to read back.
    let mut sent = vec!["in flight".to_string()];
    for i in 0..25 {
        let body = format!("while down {i}");
        alice.send_text(&room, &body);
        sent.push(body);
    }
    let d = d.restart_env(&[]);
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    let got = pushes(&mut x, sent.len() + 1);
    let got = bodies(&got);
    let after_first: Vec<String> = got.into_iter().filter(|b| b != "before").collect();
    assert_eq!(after_first, sent, "every message once, in order");
    assert!(
        x.next_push(Duration::from_secs(3)).is_none(),
        "nothing more, nothing twice"
    );
}

#[test]
#[ignore = "needs Synapse from PyPI: run by .ci/run"]
fn a_tool_call_retried_after_a_crash_is_one_event() {
    let (hs, bot, alice, room) = homeserver();
    let mut d = imgate("syn-retry", &[("IMGATE_TEST_CRASH", "tool-sent:1")]);
    let (mut x, cch) = bound(&d, &hs, &bot, &room);
    let call = json!({"text": "exactly once"});
    let (_, request) = x.send(
        "tool.invoke",
        Some(&cch),
        json!({"tool_id": "imgate_message_send", "arguments": call, "context": {"session_id": "s1", "tool_call_id": "once-1"}}),
    );
    assert!(!request.is_empty());
    assert!(
        d.wait_exit(WAIT).is_some(),
        "killed after Synapse took the event, before the result was kept"
    );
    drop(x);
    let d = d.restart_env(&[]);
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    let again = x.tool(&cch, "imgate_message_send", call, "once-1");
    assert_eq!(again["payload"]["result"]["status"], "sent", "{again}");
    let first = alice.wait_message(&room, |m| m["content"]["body"] == "exactly once", WAIT);
    assert_eq!(
        again["payload"]["result"]["message_id"], first["event_id"],
        "the same event"
    );
    let copies = alice
        .messages(&room, 50)
        .into_iter()
        .filter(|m| m["content"]["body"] == "exactly once")
        .count();
    assert_eq!(copies, 1, "the retry is the same transaction: one event");
}

#[test]
#[ignore = "needs Synapse from PyPI: run by .ci/run"]
fn a_revoked_token_expires_the_channel_until_it_is_bound_again() {
    let (hs, bot, alice, room) = homeserver();
    let d = imgate("syn-revoked", &[]);
    let (mut x, cch) = bound(&d, &hs, &bot, &room);
    bot.logout();
    let refused = x.tool(&cch, "imgate_message_send", json!({"text": "anyone?"}), "rv-1");
    assert_eq!(refused["error"]["code"], "connection_not_authenticated", "{refused}");
    let pushed = x.next_of("connection.descriptor.push", WAIT).expect("xAgent is told");
    assert_eq!(
        pushed["payload"]["connection_descriptor"]["connection"]["status"], "expired",
        "{pushed}"
    );
    let page = get_json(&d.url("/status"));
    assert_eq!(page["channels"][0]["status"], "expired", "{page}");
    // A new token (a new login) on the same channel: connected and receiving again.
    let renewed = hs.login("imgate");
    let a = bind(&mut x, &cch, &hs, &renewed.access_token, &room);
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    let id = alice.send_text(&room, "back?");
    let push = x.next_push(WAIT).expect("messages arrive again");
    assert_eq!(push["payload"]["message_id"], id.as_str());
    assert_no_secret(
        &d.log(),
        &[&bot.access_token, &renewed.access_token],
        "imgate's log at trace level",
    );
}

#[test]
#[ignore = "needs Synapse from PyPI: run by .ci/run"]
fn sends_past_synapses_rate_limit_are_waited_out() {
    // A stock Synapse: 0.2 messages/s with a burst of 10 per user.
    let hs = Synapse::start();
    let bot = hs.register("imgate");
    let alice = hs.register("alice");
    let room = alice.create_room(&[&bot.user_id], false);
    let d = imgate("syn-limits", &[]);
    let (mut x, cch) = bound(&d, &hs, &bot, &room);
    for i in 0..12 {
        let a = x.tool(
            &cch,
            "imgate_message_send",
            json!({"text": format!("burst {i}")}),
            &format!("burst-{i}"),
        );
        assert_eq!(a["payload"]["result"]["status"], "sent", "call {i}: {a}");
    }
    let seen = alice
        .messages(&room, 50)
        .into_iter()
        .filter(|m| m["content"]["body"].as_str().is_some_and(|b| b.starts_with("burst ")))
        .count();
    assert_eq!(
        seen, 12,
        "every send arrived once, the ones past the burst after waiting"
    );
    assert!(d.log_shows("M_LIMIT_EXCEEDED", WAIT), "Synapse's 429s were met");
}

#[test]
#[ignore = "needs Synapse from PyPI: run by .ci/run"]
fn a_second_room_takes_effect_within_the_running_poll_and_unbound_rooms_are_listed() {
    let (hs, bot, alice, room) = homeserver();
    let second = alice.create_room(&[&bot.user_id], false);
    let unbound = alice.create_room(&[&bot.user_id], false);
    let invited = alice.create_room(&[], false);
    bot.join(&unbound);
    let d = imgate("syn-rooms", &[]);
    let (mut x, _) = bound(&d, &hs, &bot, &room);
    let first = alice.send_text(&room, "first");
    let push = x.next_push(WAIT).expect("the first room's message");
    assert_eq!(push["payload"]["message_id"], first.as_str());

    // Bound while the account's loop long-polls: its first message ends that poll.
    let (cch2, _) = x.open(None);
    let ok = bind(&mut x, &cch2, &hs, &bot.access_token, &second);
    assert_eq!(ok["payload"]["status"], "authenticated", "{ok}");
    let bound_at = std::time::Instant::now();
    let id = alice.send_text(&second, "to the second room");
    let push = x
        .next_push(Duration::from_secs(15))
        .expect("the second room's first message within 15 s of its binding");
    eprintln!("binding to the second room's first push: {:?}", bound_at.elapsed());
    assert_eq!(push["payload"]["message_id"], id.as_str(), "{push}");
    assert_eq!(push["connector_channel_id"], cch2.as_str(), "{push}");

    // A joined room no binding names, and an invitation: listed for the owner, never pushed.
    alice.send_text(&unbound, "is anyone there?");
    alice.invite(&invited, &bot.user_id);
    let (found, status) = unbound_listed(&d, "matrix", &[&unbound, &invited], WAIT);
    let seen = found[0]
        .as_ref()
        .unwrap_or_else(|| panic!("the unbound room is listed: {status}"));
    assert_eq!(seen["kind"], "dm", "Alice and the bot: {seen}");
    let seen = found[1]
        .as_ref()
        .unwrap_or_else(|| panic!("the invitation is listed: {status}"));
    assert_eq!(seen["kind"], "invite", "{seen}");
    let last = alice.send_text(&room, "last");
    let push = x.next_push(WAIT).expect("the bound room's next message");
    assert_eq!(
        push["payload"]["message_id"],
        last.as_str(),
        "nothing from the unbound room: {push}"
    );
}
