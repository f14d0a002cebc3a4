//! The Matrix provider against `common/matrix.rs`, a homeserver simulator written from the Matrix
//! client-server spec, for what a real Synapse (`tests/synapse.rs`) cannot be steered to do on
//! demand: a gap while imgate is polling, 429s on a send, an answer past imgate's cap, a token
//! revoked under a running loop, a server that fails for a while. The simulator's own check too.

use std::time::Duration;

use crate::common::matrix::MatrixSim;
use crate::common::*;
use serde_json::{json, Value};

const BOT: &str = "@bot:sim";
const TOKEN: &str = "syt_sim_bot_token_5f4e3d2c1b";
const ALICE: &str = "@alice:sim";
const BOB: &str = "@bob:sim";
const ROOM: &str = "!ops:sim";
const WAIT: Duration = Duration::from_secs(15);

#[test]
fn the_homeserver_simulator_follows_the_spec() {
    crate::common::matrix::self_check();
}

fn matrix(tag: &str) -> (Daemon, MatrixSim) {
    let sim = MatrixSim::start();
    sim.add_user(BOT, TOKEN);
    sim.add_user(ALICE, "alice-token");
    sim.add_user(BOB, "bob-token");
    sim.set_display_name(ALICE, "Alice");
    sim.add_room(ROOM, &[BOT, ALICE, BOB], false);
    let dir = temp_dir(tag);
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, "[matrix]\n"));
    (d, sim)
}

/// Binds `cch` to the bot's room.
fn bind(x: &mut Sim, cch: &str, sim: &MatrixSim) {
    bind_room(x, cch, sim, ROOM);
}

fn bind_room(x: &mut Sim, cch: &str, sim: &MatrixSim, room: &str) {
    let a = x.request(
        "auth.start",
        Some(cch),
        json!({"flow_id": "matrix_room_binding",
               "input": {"homeserver": sim.base, "access_token": TOKEN, "room_id": room}}),
    );
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
}

/// Bound, with the loop long-polling (its first answers, and the room read back, are behind it).
fn bound(d: &Daemon, sim: &MatrixSim) -> (Sim, String) {
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    bind(&mut x, &cch, sim);
    assert!(sim.wait_syncs(2, WAIT), "the account's loop syncs");
    assert!(sim.wait_polling(WAIT), "and long-polls");
    (x, cch)
}

/// Alice says `text` in the room: the next push is that event (`why` if it is not); the push.
fn alice_says(sim: &MatrixSim, x: &mut Sim, text: &str, why: &str) -> Value {
    let id = sim.post_text(ROOM, ALICE, text);
    let push = x.next_push(WAIT).expect("a message in");
    assert_eq!(push["payload"]["message_id"], id.as_str(), "{why}: {push}");
    push
}

fn raw_texts(x: &mut Sim, n: usize) -> Vec<String> {
    let mut got = Vec::new();
    while got.len() < n {
        let Some(p) = x.next_push(WAIT) else { break };
        got.push(p["payload"]["raw_text"].as_str().unwrap_or_default().to_string());
    }
    got
}

#[test]
fn a_gap_while_polling_is_read_back_in_order_and_the_filter_asks_only_for_messages() {
    let (d, sim) = matrix("mx-gap");
    sim.post_text(ROOM, ALICE, "said before the binding");
    let (mut x, _) = bound(&d, &sim);
    let filter = sim.filters().last().cloned().expect("a filter");
    assert!(filter["room"].get("rooms").is_none(), "every joined room: {filter}");
    assert_eq!(filter["room"]["timeline"]["limit"], 10, "{filter}");
    assert_eq!(
        filter["room"]["timeline"]["types"],
        json!(["m.room.message", "m.room.encryption"]),
        "{filter}"
    );
    assert_eq!(filter["presence"]["types"], json!([]), "no presence: {filter}");

    let push = alice_says(&sim, &mut x, "one", "what was said before the binding is not pushed");
    assert_eq!(push["payload"]["sender_name"], "Alice");
    assert_eq!(push["payload"]["chat_type"], "group", "three members");
    let paged = sim.paginations().len();
    // 25 at once: the next answer holds the newest 10, `limited`; the rest is read back.
    sim.post_burst(ROOM, BOB, 25);
    let got = raw_texts(&mut x, 25);
    let expected: Vec<String> = (1..=25).map(|i| format!("burst {i}")).collect();
    assert_eq!(got, expected, "every message once, oldest first");
    assert!(sim.paginations().len() > paged, "the gap was read back with /messages");
    assert!(x.next_push(Duration::from_secs(2)).is_none(), "nothing twice");
    // The bot's own messages and notices come back through /sync and are not pushed.
    sim.post_message(ROOM, ALICE, json!({"msgtype": "m.notice", "body": "a notice"}));
    sim.post_text(ROOM, BOT, "my own");
    alice_says(&sim, &mut x, "last", "only Alice's message");
}

#[test]
fn sends_wait_out_a_rate_limit_and_a_retry_is_the_same_transaction() {
    let (d, sim) = matrix("mx-429");
    let (mut x, cch) = bound(&d, &sim);
    sim.rate_limit_next_sends(2, 300);
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "after the limit"}), "rl-1");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let calls = sim.send_calls();
    assert_eq!(calls.len(), 3, "two refused, the third taken: {calls:?}");
    assert!(calls.iter().all(|c| c == &calls[0]), "one transaction ID: {calls:?}");
    let sent = sim.sent(ROOM);
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0]["msgtype"], "m.text");
    // A long text is split at 8,000 characters, each part its own transaction.
    let long = "x".repeat(8_500);
    let a = x.tool(&cch, "imgate_message_send", json!({"text": long}), "rl-2");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let sent = sim.sent(ROOM);
    assert_eq!(sent.len(), 3, "two more parts");
    assert_eq!(sent[1]["body"].as_str().unwrap().len(), 8_000);
    // A limit longer than the call's time is a retryable failure, not a wait past it.
    sim.rate_limit_next_sends(1, 3_600_000);
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "much later"}), "rl-3");
    assert_eq!(a["error"]["code"], "upstream_rejected", "{a}");
    assert!(
        a["error"]["message"].as_str().unwrap().contains("M_LIMIT_EXCEEDED"),
        "{a}"
    );
}

#[test]
fn an_answer_past_the_cap_asks_for_fewer_events_then_more_again() {
    let (d, sim) = matrix("mx-cap");
    let (mut x, _) = bound(&d, &sim);
    sim.pad_sync_answers(1_200_000);
    sim.post_text(ROOM, ALICE, "wakes the poll");
    assert!(
        d.log_shows("asking for 5 events per room", WAIT),
        "a /sync answer over 1 MiB is asked again with fewer events"
    );
    sim.pad_sync_answers(0);
    let id = sim.post_text(ROOM, ALICE, "after the cap");
    pushed_until(&mut x, &id);
    // Each answer that fits doubles the limit again, up to 10.
    for i in 0..3 {
        alice_says(&sim, &mut x, &format!("more {i}"), "each in turn");
    }
    let limits: Vec<Value> = sim
        .filters()
        .iter()
        .map(|f| f["room"]["timeline"]["limit"].clone())
        .collect();
    assert_eq!(limits.last(), Some(&json!(10)), "back to 10 events: {limits:?}");
}

#[test]
fn a_failing_server_is_waited_out() {
    let (d, sim) = matrix("mx-failing");
    let (mut x, _) = bound(&d, &sim);
    sim.fail_next_syncs(3, 502, "");
    // Ends a long poll under way: the next ones fail.
    sim.post_text(ROOM, ALICE, "before the trouble");
    assert!(d.log_shows("/sync failed", WAIT), "{}", d.log());
    let id = sim.post_text(ROOM, ALICE, "after the trouble");
    pushed_until(&mut x, &id);
    assert!(d.log_shows("syncing works again", WAIT), "{}", d.log());
}

/// Reads pushes until the message `id` came: messages arrive once the server answers again.
fn pushed_until(x: &mut Sim, id: &str) {
    let mut ids = Vec::new();
    while let Some(p) = x.next_push(WAIT) {
        ids.push(p["payload"]["message_id"].as_str().unwrap_or_default().to_string());
        if ids.iter().any(|i| i == id) {
            return;
        }
    }
    panic!("{id} never came: {ids:?}");
}

#[test]
fn a_token_revoked_under_the_loop_expires_the_channel_and_stops_polling() {
    let (d, sim) = matrix("mx-revoked");
    let (mut x, cch) = bound(&d, &sim);
    sim.revoke(TOKEN);
    sim.post_text(ROOM, ALICE, "wakes the poll");
    let pushed = x.next_of("connection.descriptor.push", WAIT).expect("xAgent is told");
    assert_eq!(
        pushed["payload"]["connection_descriptor"]["connection"]["status"], "expired",
        "{pushed}"
    );
    let text = metrics_once(&d, "imgate_matrix_sync_loops 0", WAIT);
    assert!(text.contains("imgate_matrix_tokens_revoked_total 1"), "{text}");
    let syncs = sim.syncs();
    let tool = x.tool(&cch, "imgate_message_send", json!({"text": "still there?"}), "rv-1");
    assert_eq!(tool["error"]["code"], "connection_not_authenticated", "{tool}");
    assert!(tool["error"]["message"]
        .as_str()
        .unwrap()
        .contains("bind this channel again"));
    assert_eq!(sim.syncs(), syncs, "no more polling with a token the server refused");
    assert_no_secret(&d.log(), &[TOKEN], "imgate's log at trace level");
}

#[test]
fn a_room_that_turns_on_encryption_stops_its_channel_and_gets_nothing_in_the_clear() {
    let (d, sim) = matrix("mx-encrypted");
    let (mut x, cch) = bound(&d, &sim);
    sim.post_event(
        ROOM,
        ALICE,
        "m.room.encryption",
        json!({"algorithm": "m.megolm.v1.aes-sha2"}),
    );
    let pushed = x.next_of("connection.descriptor.push", WAIT).expect("xAgent is told");
    let connection = &pushed["payload"]["connection_descriptor"]["connection"];
    assert_eq!(connection["status"], "error", "{pushed}");
    let tool = x.tool(&cch, "imgate_message_send", json!({"text": "in the clear?"}), "enc-1");
    assert_eq!(tool["error"]["code"], "connector_channel_unavailable", "{tool}");
    assert!(
        tool["error"]["message"].as_str().unwrap().contains("encryption"),
        "{tool}"
    );
    assert!(sim.sent(ROOM).is_empty(), "nothing sent into the encrypted room");
    assert!(d.log_shows("turned on end-to-end encryption", WAIT));
    metrics_once(&d, "imgate_matrix_sync_loops 0", WAIT);
}

#[test]
fn a_room_bound_again_after_an_unbinding_gets_nothing_said_while_it_was_unbound() {
    let (d, sim) = matrix("mx-rebind");
    let (mut x, cch) = bound(&d, &sim);
    alice_says(&sim, &mut x, "while bound", "pushed while bound");
    let logout = x.request("auth.logout", Some(&cch), json!({}));
    assert_eq!(logout["payload"]["status"], "ok", "{logout}");
    metrics_once(&d, "imgate_matrix_sync_loops 0", WAIT);
    sim.post_text(ROOM, ALICE, "said while unbound");
    bind(&mut x, &cch, &sim);
    alice_says(&sim, &mut x, "bound again", "nothing said while unbound");
}

#[test]
fn answers_past_the_cap_at_one_event_per_room_ask_for_the_bound_rooms_only() {
    let (d, sim) = matrix("mx-narrow");
    let (mut x, _) = bound(&d, &sim);
    // As an account in hundreds of busy rooms: no answer fits, whatever the limit.
    sim.pad_sync_answers(1_200_000);
    sim.post_text(ROOM, ALICE, "wakes the poll");
    assert!(d.log_shows("asking for its bound rooms only", WAIT), "{}", d.log());
    // The line is said before the narrowed /sync reaches the server.
    let narrowed = |f: &Value| f["room"]["rooms"] == json!([ROOM]);
    assert!(sim.wait_filter(WAIT, narrowed), "{:?}", sim.filters().last());
    let filter = sim.filters().last().cloned().expect("a filter");
    assert_eq!(filter["room"]["rooms"], json!([ROOM]), "{filter}");
    assert_eq!(filter["room"]["timeline"]["limit"], 1, "{filter}");
    sim.pad_sync_answers(0);
    let raw = raw_texts(&mut x, 1);
    assert_eq!(
        raw,
        ["wakes the poll"],
        "what waited is stored once the answers fit: {raw:?}"
    );
    alice_says(&sim, &mut x, "after the narrowing", "the bound room goes on");
}

#[test]
fn a_second_room_bound_while_polling_gets_its_first_message_at_once() {
    let (d, sim) = matrix("mx-second");
    let second = "!second:sim";
    sim.add_room(second, &[BOT, ALICE], false);
    let (mut x, cch1) = bound(&d, &sim);
    let (cch2, _) = x.open(None);
    bind_room(&mut x, &cch2, &sim, second);
    let bound_at = std::time::Instant::now();
    // The poll that was under way when the room was bound is ended by this message.
    let id = sim.post_text(second, ALICE, "to the second room");
    let push = x
        .next_push(WAIT)
        .expect("the second room's first message, within the running poll");
    eprintln!("binding to the second room's first push: {:?}", bound_at.elapsed());
    assert_eq!(push["payload"]["message_id"], id.as_str(), "{push}");
    assert_eq!(push["connector_channel_id"], cch2.as_str(), "{push}");
    // And an unbinding too: the first room's messages stop at once, the second's go on.
    let logout = x.request("auth.logout", Some(&cch1), json!({}));
    assert_eq!(logout["payload"]["status"], "ok", "{logout}");
    sim.post_text(ROOM, ALICE, "to the unbound first room");
    let id = sim.post_text(second, ALICE, "the second room goes on");
    let push = x.next_push(WAIT).expect("the second room's message");
    assert_eq!(
        push["payload"]["message_id"],
        id.as_str(),
        "nothing from the unbound room: {push}"
    );
}

#[test]
fn a_room_no_binding_names_is_listed_for_the_owner_when_someone_writes_in_it() {
    let (d, sim) = matrix("mx-unbound");
    // A room ID longer than most: listed whole, or the owner could not bind it.
    let dm = format!("!dm{}:sim", "x".repeat(120));
    let (dm, invite) = (dm.as_str(), "!invite:sim");
    sim.add_room(dm, &[BOT, ALICE], false);
    sim.add_room(invite, &[ALICE], false);
    let (mut x, _) = bound(&d, &sim);
    sim.post_text(dm, ALICE, "is anyone there?");
    sim.invite(invite, BOT);
    let id = sim.post_text(ROOM, ALICE, "in the bound room");
    let push = x.next_push(WAIT).expect("the bound room's message");
    assert_eq!(
        push["payload"]["message_id"],
        id.as_str(),
        "nothing from the unbound room: {push}"
    );
    let (found, status) = unbound_listed(&d, "matrix", &[dm, invite], WAIT);
    let seen = found[0]
        .as_ref()
        .unwrap_or_else(|| panic!("the unbound room is listed: {status}"));
    assert_eq!(seen["kind"], "dm", "two members: {seen}");
    let seen = found[1]
        .as_ref()
        .unwrap_or_else(|| panic!("the invite is listed: {status}"));
    assert_eq!(seen["kind"], "invite", "{seen}");
    let (bound, _) = unbound_listed(&d, "matrix", &[ROOM], Duration::ZERO);
    assert!(bound[0].is_none(), "a bound room is not: {status}");
}
