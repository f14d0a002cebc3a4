//! The Discord provider against `common/discord.rs`, a simulator of the REST API and the
//! Gateway written from discord-api-docs: binding and each failure, messages in with their
//! cursor, RESUME after a dropped connection (the replay stored once), a new session's
//! catch-up from the channels' histories, a SIGKILL between an event and its commit, zombie
//! connections, refusals that stop the bot, IDENTIFYs spaced out under refusals, the daily
//! session budget (and how a spent one is said), a full queue, replies, files and rate limits (a global one holding every
//! channel's calls), and a token that never leaves imgate.

use std::time::Duration;

use crate::common::discord::{DiscordSim, Fault, Gw, User, UserMsg, BOT_TOKEN, MESSAGE_CONTENT};
use crate::common::kit::now_ms;
use crate::common::*;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(15);

struct World {
    sim: DiscordSim,
    channel: String,
    ann: User,
}

fn discord(tag: &str, env: &[(&str, &str)]) -> (Daemon, World) {
    discord_with(tag, env, "")
}

/// `discord` with more config (`extra`, after the `[discord]` section).
fn discord_with(tag: &str, env: &[(&str, &str)], extra: &str) -> (Daemon, World) {
    let sim = DiscordSim::start();
    // Short heartbeats, so zombie connections show within seconds.
    sim.knobs(|k| k.heartbeat_interval = Duration::from_millis(1500));
    let guild = sim.add_guild("Home Lab");
    let channel = sim.add_text_channel(&guild, "ops");
    let ann = sim.add_user("ann", false);
    let dir = temp_dir(tag);
    let conf = format!("[discord]\napi_base = {}\n{extra}", sim.base);
    let d = Daemon::start_env(&dir, &config_text(free_port(), &dir, None, &conf), "trace", env);
    (d, World { sim, channel, ann })
}

fn bind(x: &mut Sim, cch: &str, token: &str, channel: &str) -> Value {
    x.request(
        "auth.start",
        Some(cch),
        json!({"flow_id": "discord_bot_binding", "input": {"bot_token": token, "channel_id": channel}}),
    )
}

fn bound(d: &Daemon, w: &World) -> (Sim, String) {
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let a = bind(&mut x, &cch, BOT_TOKEN, &w.channel);
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    assert!(
        w.sim.wait_until(WAIT, |r| r.ready >= 1),
        "the binding starts the bot's Gateway session"
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

/// The next pushes' message IDs, `n` of them.
fn next_ids(x: &mut Sim, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| {
            let push = x.next_push(WAIT).expect("pushed");
            push["payload"]["message_id"].as_str().unwrap().to_string()
        })
        .collect()
}

#[test]
fn binding_checks_the_token_the_intent_and_the_channel_and_keeps_the_token_private() {
    let (d, w) = discord("dc-bind", &[]);
    let guild = w.sim.add_guild("Elsewhere");
    let hidden = w.sim.add_text_channel(&guild, "hidden");
    w.sim.set_perms(&hidden, false, false, false);

    let (_, card) = http_get(&d.url("/connector-card.json"), &[]);
    let card: Value = serde_json::from_str(&card).unwrap();
    assert_card(&card);
    let flow = card["auth_flows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == "discord_bot_binding")
        .cloned()
        .expect("the Card offers discord_bot_binding when [discord] is set");
    assert_eq!(flow["fields"][0]["secret"], true, "{flow}");

    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    failed_because(&bind(&mut x, &cch, "not-a-token", &w.channel), "bot_token must be");
    failed_because(
        &bind(
            &mut x,
            &cch,
            "MTAwMDAwMDAwMDAwMDAwMDAw.Gwrong.wrong-token-wrong-token",
            &w.channel,
        ),
        "rejected the bot token",
    );
    failed_because(&bind(&mut x, &cch, BOT_TOKEN, "12ab"), "channel_id must be");
    failed_because(
        &bind(&mut x, &cch, BOT_TOKEN, "1234567890123"),
        "does not know this channel",
    );
    failed_because(&bind(&mut x, &cch, BOT_TOKEN, &hidden), "cannot see this channel");
    w.sim.knobs(|k| k.app_intents = 0);
    failed_because(&bind(&mut x, &cch, BOT_TOKEN, &w.channel), "Message Content Intent");
    w.sim.knobs(|k| k.app_intents = MESSAGE_CONTENT);
    assert_eq!(
        w.sim.records(|r| r.identifies.len()),
        0,
        "no failed binding opened a session"
    );

    let ok = bind(&mut x, &cch, BOT_TOKEN, &w.channel);
    assert_eq!(ok["payload"]["status"], "authenticated", "{ok}");
    let descriptor = &ok["payload"]["connection_descriptor"];
    assert_descriptor(descriptor);
    assert_eq!(descriptor["target"]["provider"], "discord");
    assert_eq!(
        descriptor["target"]["display_name"], "#ops (Home Lab)",
        "the channel and its server"
    );
    assert!(w.sim.wait_until(WAIT, |r| r.ready >= 1));
    let identify = w.sim.records(|r| r.identifies[0].clone());
    assert_eq!(identify["token"], BOT_TOKEN, "IDENTIFY carries the bare token");
    assert_eq!(identify["intents"].as_u64().unwrap() & MESSAGE_CONTENT, MESSAGE_CONTENT);
    let calls = w.sim.calls("*");
    assert!(
        calls
            .iter()
            .all(|c| c.auth == format!("Bot {BOT_TOKEN}") || c.status == 401),
        "the token goes only in the header"
    );
    let bot = w.sim.bot_user().id;
    let file = d.dir.join(format!("state/discord/{bot}.token"));
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&file).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "the token file is private");
    metrics_once(&d, "imgate_discord_sessions_up 1", WAIT);
    let all = serde_json::to_string(&x.seen).unwrap() + &card.to_string() + &get_json(&d.url("/status")).to_string();
    assert_no_secret(
        &all,
        &[BOT_TOKEN, "discord-simulator-bot-token"],
        "a packet, the Card or /status",
    );
    assert_no_secret(&d.log(), &[BOT_TOKEN, "discord-simulator-bot-token"], "the trace log");
    assert_stops_cleanly(d);
}

#[test]
fn messages_arrive_once_with_names_and_replies_split_and_ping_nobody() {
    let (d, w) = discord("dc-text", &[]);
    let before = w.sim.post(&w.channel, UserMsg::text(&w.ann, "said before the binding"));
    let (mut x, cch) = bound(&d, &w);
    let bob = w.sim.add_user("bob", false);
    let id = w.sim.post(
        &w.channel,
        UserMsg::text(&w.ann, &format!("<@{}> is the door locked?", bob.id)),
    );
    let push = x.next_push(WAIT).expect("the Discord message is pushed");
    assert_packet(&push);
    let p = &push["payload"];
    assert_eq!(p["provider"], "discord");
    assert_eq!(
        p["message_id"], id,
        "history from before the binding is not read: {before}"
    );
    assert_eq!(p["sender_name"], "ann");
    assert_eq!(p["chat_type"], "group");
    assert_eq!(p["raw_text"], "@bob is the door locked?");

    let a = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref(&push), "text": "yes, locked @everyone"}),
        "dc-1",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let posted = w.sim.posted(&w.channel);
    let last = posted.last().unwrap();
    assert_eq!(last.content, "yes, locked @everyone");
    assert_eq!(last.reply_to.as_deref(), Some(id.as_str()), "a reply to the message");
    assert_eq!(last.payload["allowed_mentions"]["parse"], json!([]), "pings nobody");
    assert!(last.nonce.is_some() && last.payload["enforce_nonce"] == true);
    // The push was delivered (its pong came while the tool call was read).
    assert!(
        w.sim
            .wait_until(WAIT, |r| r.typing.get(&w.channel).is_some_and(|n| *n >= 1)),
        "after the delivery the bot is shown typing"
    );

    // Long text is split at Discord's 2,000 characters.
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "z".repeat(4500)}), "dc-2");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let posted = w.sim.posted(&w.channel);
    assert_eq!(posted.len(), 4, "4,500 characters go as three messages");
    assert_eq!(posted[1].content.chars().count(), 2000);

    // The bot's own messages (each came back as MESSAGE_CREATE), other bots', and messages of
    // unbound channels are not pushed.
    let robot = w.sim.add_user("robot", true);
    w.sim.post(&w.channel, UserMsg::text(&robot, "beep"));
    let other = w.sim.add_text_channel(&w.sim.add_guild("Other"), "random");
    w.sim.post(&other, UserMsg::text(&w.ann, "not for imgate"));
    let next = w.sim.post(&w.channel, UserMsg::text(&w.ann, "the next one"));
    let push = x.next_push(WAIT).expect("the next message is pushed");
    assert_eq!(
        push["payload"]["message_id"], next,
        "nothing between: the bot's echoes, the other bot and the unbound channel were not pushed"
    );
    let status = get_json(&d.url("/status"));
    assert!(
        status["unbound_recent"]
            .as_array()
            .unwrap()
            .iter()
            .any(|u| u["provider"] == "discord" && u["conversation_id"] == other.as_str()),
        "{status}"
    );
    assert_stops_cleanly(d);
}

#[test]
fn a_dropped_connection_is_resumed_and_the_replayed_events_are_stored_once() {
    let (d, w) = discord("dc-resume", &[]);
    let (mut x, _) = bound(&d, &w);
    let first = w.sim.post(&w.channel, UserMsg::text(&w.ann, "before the drop"));
    assert_eq!(next_ids(&mut x, 1), [first]);

    assert!(w.sim.gateway(Gw::Drop));
    let missed: Vec<String> = (0..5)
        .map(|i| {
            w.sim
                .post(&w.channel, UserMsg::text(&w.ann, &format!("while down {i}")))
        })
        .collect();
    assert!(
        w.sim.wait_until(WAIT, |r| r.resumed() >= 1),
        "imgate resumes the session"
    );
    let resume = w.sim.records(|r| r.resumes.last().cloned().unwrap());
    assert_eq!(resume["via_resume_url"], true, "{resume}");
    assert_eq!(w.sim.records(|r| r.identifies.len()), 1, "no new session was needed");
    assert_eq!(next_ids(&mut x, 5), missed, "the replay, in order");

    // Discord asks for a reconnect: resumed again, nothing lost or doubled.
    assert!(w.sim.gateway(Gw::Reconnect));
    assert!(w.sim.wait_until(WAIT, |r| r.resumed() >= 2));
    let after = w.sim.post(&w.channel, UserMsg::text(&w.ann, "after the reconnect"));
    assert_eq!(next_ids(&mut x, 1), [after], "each message once");
    // An INVALID_SESSION that may be resumed is resumed too.
    assert!(w.sim.gateway(Gw::InvalidSession(true)));
    assert!(w.sim.wait_until(WAIT, |r| r.resumed() >= 3));
    let last = w.sim.post(&w.channel, UserMsg::text(&w.ann, "after op 9"));
    assert_eq!(next_ids(&mut x, 1), [last]);
    assert_eq!(w.sim.records(|r| r.identifies.len()), 1, "one session throughout");
    assert_stops_cleanly(d);
}

#[test]
fn a_new_session_catches_up_from_the_history_with_nothing_lost_or_twice() {
    let (d, w) = discord("dc-catchup", &[]);
    let (mut x, _) = bound(&d, &w);
    let live = w.sim.post(&w.channel, UserMsg::text(&w.ann, "live"));
    assert_eq!(next_ids(&mut x, 1), [live]);

    // Messages the Gateway never delivers (imgate "was away"), then a session Discord ends.
    let missed: Vec<String> = (0..150)
        .map(|i| {
            w.sim
                .post(&w.channel, UserMsg::text(&w.ann, &format!("missed {i}")).offline())
        })
        .collect();
    assert!(w.sim.gateway(Gw::InvalidSession(false)));
    assert!(
        w.sim.wait_until(WAIT, |r| r.identifies.len() >= 2 && r.ready >= 2),
        "a new session after INVALID_SESSION"
    );
    assert_eq!(next_ids(&mut x, 150), missed, "read from the history, in order");
    let after = w.sim.post(&w.channel, UserMsg::text(&w.ann, "live again"));
    assert_eq!(next_ids(&mut x, 1), [after], "each missed message once");
    let pages = w.sim.calls("GET /channels/{id}/messages");
    assert!(
        pages.iter().any(|c| c.path.contains("after=")),
        "the catch-up pages by snowflake: {pages:?}"
    );
    assert_stops_cleanly(d);
}

#[test]
fn a_sigkill_between_an_event_and_its_commit_loses_nothing_and_stores_it_once() {
    let (mut d, w) = discord("dc-crash", &[("IMGATE_TEST_CRASH", "intake-before-commit:1")]);
    let (_, cch) = bound(&d, &w);
    let id = w.sim.post(&w.channel, UserMsg::text(&w.ann, "survive me"));
    assert!(
        d.wait_exit(WAIT).is_some(),
        "killed between receiving the event and its commit"
    );
    let d = d.restart_env(&[]);
    assert!(
        w.sim.wait_until(WAIT, |r| r.ready >= 2),
        "a new session after the restart"
    );
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    assert_eq!(next_ids(&mut x, 1), [id], "the catch-up brought it");
    let next = w.sim.post(&w.channel, UserMsg::text(&w.ann, "after"));
    assert_eq!(next_ids(&mut x, 1), [next], "stored once");
}

#[test]
fn a_zombie_connection_is_closed_and_resumed() {
    let (d, w) = discord("dc-zombie", &[]);
    let (mut x, _) = bound(&d, &w);
    w.sim.knobs(|k| k.ack_heartbeats = false);
    assert!(
        w.sim.wait_until(WAIT, |r| r
            .client_closes
            .iter()
            .any(|c| c.is_some_and(|c| c != 1000 && c != 1001))),
        "a heartbeat without its ACK ends the connection with a resumable close"
    );
    w.sim.knobs(|k| k.ack_heartbeats = true);
    assert!(w.sim.wait_until(WAIT, |r| r.resumed() >= 1), "and resumes");
    let id = w.sim.post(&w.channel, UserMsg::text(&w.ann, "after the zombie"));
    assert_eq!(next_ids(&mut x, 1), [id]);
    let (_, last_s) = w.sim.current_session().expect("a session");
    assert!(
        w.sim
            .wait_until(WAIT, |r| r.heartbeat_seqs.last() == Some(&json!(last_s))),
        "the next heartbeat carries the last sequence number, {last_s}"
    );
    assert_stops_cleanly(d);
}

#[test]
fn a_frame_over_the_cap_starts_a_new_session_whose_catch_up_reads_what_it_held() {
    let (d, w) = discord("dc-bigframe", &[]);
    let (mut x, _) = bound(&d, &w);
    // A MESSAGE_CREATE the Gateway would send, padded past imgate's 1 MiB: a replay after a
    // RESUME would bring it again, so a new session reads the history instead.
    let held = w.sim.post(&w.channel, UserMsg::text(&w.ann, "held").offline());
    let padded = json!({"op": 0, "s": 999, "t": "MESSAGE_CREATE",
                        "d": {"id": held, "channel_id": w.channel, "content": "x".repeat(1_100_000)}});
    assert!(w.sim.gateway(Gw::Text(padded.to_string())));
    assert!(
        w.sim.wait_until(WAIT, |r| r.identifies.len() >= 2 && r.ready >= 2),
        "a new session, not a RESUME"
    );
    assert_eq!(w.sim.records(|r| r.resumed()), 0);
    assert_eq!(next_ids(&mut x, 1), [held], "read from the history");
    assert_stops_cleanly(d);
}

#[test]
fn a_refusal_only_the_owner_can_fix_stops_the_bot_and_says_why() {
    let (d, w) = discord("dc-refused", &[]);
    let (mut x, cch) = bound(&d, &w);
    // The owner turns the intent off; Discord then refuses every new session with 4014.
    w.sim.knobs(|k| k.app_intents = 0);
    assert!(w.sim.gateway(Gw::InvalidSession(false)));
    let pushed = x.next_of("connection.descriptor.push", WAIT).expect("xAgent is told");
    assert_eq!(
        pushed["payload"]["connection_descriptor"]["connection"]["status"], "error",
        "{pushed}"
    );
    assert!(d.log_shows("Message Content Intent is off (4014)", WAIT));
    let page = get_json(&d.url("/status"));
    assert_eq!(page["channels"][0]["status"], "error", "{page}");
    let identifies = w.sim.records(|r| r.identifies.len());
    assert_eq!(identifies, 2, "one IDENTIFY met the refusal");
    // Posted while the bot is refused, then bound again once the intent is on: connected
    // again, and what was posted meanwhile is read from the history.
    let meanwhile: Vec<String> = (0..3)
        .map(|i| w.sim.post(&w.channel, UserMsg::text(&w.ann, &format!("meanwhile {i}"))))
        .collect();
    w.sim.knobs(|k| k.app_intents = MESSAGE_CONTENT);
    let a = bind(&mut x, &cch, BOT_TOKEN, &w.channel);
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    assert!(
        w.sim.wait_until(WAIT, |r| r.ready >= 2),
        "a new session after binding again"
    );
    assert_eq!(
        d.log().matches("Message Content Intent is off (4014)").count(),
        1,
        "said once"
    );
    assert_eq!(next_ids(&mut x, 3), meanwhile, "nothing posted meanwhile is lost");
    let id = w.sim.post(&w.channel, UserMsg::text(&w.ann, "back"));
    assert_eq!(next_ids(&mut x, 1), [id]);
}

#[test]
fn identifies_refused_again_and_again_are_spaced_out() {
    let (d, w) = discord("dc-ration", &[]);
    let (_x, _) = bound(&d, &w);
    // From now on every IDENTIFY is refused (op 9 false: the one allowed per window is spent,
    // and the window is an hour).
    w.sim.knobs(|k| k.identify_window = Duration::from_secs(3600));
    assert!(w.sim.gateway(Gw::InvalidSession(false)));
    assert!(
        w.sim
            .wait_until(Duration::from_secs(120), |r| r.identified_at.len() >= 4),
        "imgate keeps trying"
    );
    let at = w.sim.records(|r| r.identified_at.clone());
    let gaps: Vec<Duration> = at.windows(2).map(|p| p[1].duration_since(p[0])).collect();
    // At least 6 s apart, the gap doubling after each new session that failed: 12 s, 24 s
    // (three quarters of each asserted: the sim stamps an IDENTIFY when it reads it).
    assert!(
        gaps[1] >= Duration::from_secs(9) && gaps[2] >= Duration::from_secs(18),
        "{gaps:?}"
    );
    assert_eq!(w.sim.records(|r| r.ready), 1, "no new session was granted");
    assert_stops_cleanly(d);
}

#[test]
fn no_session_is_started_while_the_daily_budget_is_used_up() {
    let (d, w) = discord("dc-budget", &[]);
    w.sim.knobs(|k| {
        k.session_start_remaining = 0;
        k.session_start_reset_after = 1000;
    });
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let a = bind(&mut x, &cch, BOT_TOKEN, &w.channel);
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    assert!(d.log_shows("daily budget of new sessions is used up", WAIT));
    assert!(
        w.sim.wait_until(WAIT, |r| r.calls_to("/gateway/bot").count() >= 3),
        "the binding's question, then the session's, asked again after the reset Discord named (at least the IDENTIFY gap)"
    );
    assert_eq!(
        w.sim.records(|r| r.identifies.len()),
        0,
        "no IDENTIFY while the budget is 0"
    );
    w.sim.knobs(|k| k.session_start_remaining = 1000);
    assert!(
        w.sim.wait_until(WAIT, |r| r.ready >= 1),
        "a session once the budget is back"
    );
    assert_stops_cleanly(d);
}

#[test]
fn a_posted_attachment_arrives_in_the_file_cache() {
    let (d, w) = discord("dc-files", &[]);
    let (mut x, _) = bound(&d, &w);
    let png = patterned(300_000, 7);
    let id = w.sim.post(
        &w.channel,
        UserMsg::text(&w.ann, "the plan").file("plan.png", "image/png", &png),
    );
    let push = x.next_push(WAIT).expect("the file message is pushed");
    assert_eq!(push["payload"]["message_id"], id);
    let file = &push["payload"]["files"][0];
    assert_eq!(file["filename"], "plan.png", "{push}");
    assert_eq!(push["payload"]["message_type"], "image");
    let (status, bytes) = download(&d, file);
    assert_eq!(status, 200);
    assert_same_bytes(&bytes, &png, "the Discord attachment");
    assert_stops_cleanly(d);
}

#[test]
fn a_sent_file_is_posted_with_its_caption() {
    let (d, w) = discord("dc-upload", &[]);
    let (mut x, cch) = bound(&d, &w);
    let (status, up) = upload_as(&d, &cch, "report.pdf", "application/pdf", b"%PDF-1.4 report");
    assert_eq!(status, 200, "{up}");
    let a = x.tool(
        &cch,
        "imgate_file_send",
        json!({"file_ref": up["file_ref"], "caption": "the report"}),
        "dc-f1",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let last = w.sim.posted(&w.channel).last().cloned().unwrap();
    assert_eq!(last.content, "the report");
    assert_eq!(last.files.len(), 1);
    assert_eq!(last.files[0].filename, "report.pdf");
    assert_eq!(last.files[0].bytes, b"%PDF-1.4 report");
    assert_stops_cleanly(d);
}

#[test]
fn a_rate_limited_send_waits_and_is_sent_once() {
    let (d, w) = discord("dc-rate", &[]);
    let (mut x, cch) = bound(&d, &w);
    // A rate limit within the tool's deadline: waited for, then sent once.
    w.sim.fault(
        "POST /channels/{id}/messages",
        1,
        Fault::RateLimit {
            retry_after: 0.5,
            global: false,
        },
    );
    let before = w.sim.calls("POST /channels/{id}/messages").len();
    let sent_before = w.sim.posted(&w.channel).len();
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "after a pause"}), "dc-r1");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    assert_eq!(
        w.sim.calls("POST /channels/{id}/messages").len(),
        before + 2,
        "one refused, one sent"
    );
    assert_eq!(w.sim.posted(&w.channel).len(), sent_before + 1, "sent once");
    assert_stops_cleanly(d);
}

/// Created, but the answer lost on the way: the retry carries the same nonce, and Discord
/// answers with the first message instead of a second.
#[test]
fn a_send_whose_answer_was_lost_is_retried_with_its_nonce_and_creates_one_message() {
    let (d, w) = discord("dc-nonce", &[]);
    let (mut x, cch) = bound(&d, &w);
    w.sim.fault("POST /channels/{id}/messages", 1, Fault::Lost(502));
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "said once"}), "dc-r2");
    assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    let said: Vec<_> = w
        .sim
        .posted(&w.channel)
        .into_iter()
        .filter(|p| p.content == "said once")
        .collect();
    assert_eq!(said.len(), 1, "a retried call creates one message");
    assert_eq!(w.sim.records(|r| r.nonce_hits.len()), 1, "the retry met its nonce");
    assert_stops_cleanly(d);
}

#[test]
fn messages_a_full_queue_refused_are_read_again_from_the_history() {
    let queue = "[queue]\nmax_messages_per_channel = 3\noverflow = reject_new\n";
    let (d, w) = discord_with("dc-full", &[], queue);
    let (x, cch) = bound(&d, &w);
    // xAgent away: the queue fills at three, and the Gateway brings two more.
    drop(x);
    let ids: Vec<String> = (0..5)
        .map(|i| w.sim.post(&w.channel, UserMsg::text(&w.ann, &format!("busy {i}"))))
        .collect();
    assert!(d.log_shows("queue full", WAIT));
    let mut x = d.xagent();
    x.hello(&d.connector_id());
    x.open(Some(&cch));
    // The first three now; the two refused once a catch-up (at a heartbeat 30 s after the
    // refusal) reads them from the history.
    let mut got = next_ids(&mut x, 3);
    let late = x
        .next_push(Duration::from_secs(60))
        .expect("the refused messages come back");
    got.push(late["payload"]["message_id"].as_str().unwrap().to_string());
    got.extend(next_ids(&mut x, 1));
    assert_eq!(got, ids, "all five, in order, once");
    let after = w.sim.post(&w.channel, UserMsg::text(&w.ann, "after"));
    assert_eq!(next_ids(&mut x, 1), [after]);
    assert_stops_cleanly(d);
}

#[test]
fn a_global_rate_limit_holds_every_call_of_the_bot_until_it_ends() {
    let (d, w) = discord("dc-global", &[]);
    let (mut x, first) = bound(&d, &w);
    let workshop = w.sim.add_guild("Workshop");
    let other = w.sim.add_text_channel(&workshop, "lathe");
    let (second, _) = x.open(None);
    let a = bind(&mut x, &second, BOT_TOKEN, &other);
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    // Both channels' catch-ups (after READY, and at the heartbeat after the second binding)
    // are done before the limit starts: the first send is what meets it.
    for channel in [&w.channel, &other] {
        let read = format!("/channels/{channel}/messages?after=");
        assert!(
            w.sim
                .wait_until(WAIT, |r| r.calls.iter().any(|c| c.path.contains(&read))),
            "{channel} caught up"
        );
    }
    let start = w.sim.records(|r| r.calls.len());
    let ends = w.sim.global_limit(Duration::from_secs(2));
    let send = |x: &mut Sim, cch: &str, text: &str| {
        x.send(
            "tool.invoke",
            Some(cch),
            json!({"tool_id": "imgate_message_send", "arguments": {"text": text},
                   "context": {"session_id": "s1", "tool_call_id": text}}),
        )
        .1
    };
    let to_first = send(&mut x, &first, "to the first channel");
    assert!(
        d.log_shows("discord: send: Discord answered 429", WAIT),
        "the first send met the global limit"
    );
    // The second channel's send starts while the limit holds.
    let to_second = send(&mut x, &second, "to the second channel");
    // Answered in either order.
    let mut waiting = vec![to_first, to_second];
    while !waiting.is_empty() {
        let a = x.recv_within(WAIT).expect("both sends are answered");
        let Some(i) = waiting.iter().position(|r| a["request_id"] == r.as_str()) else {
            continue;
        };
        waiting.swap_remove(i);
        assert_eq!(a["payload"]["result"]["status"], "sent", "{a}");
    }
    let during: Vec<String> = w.sim.records(|r| {
        r.calls[start..]
            .iter()
            .filter(|c| c.at < ends)
            .map(|c| format!("{} {} {}", c.method, c.path, c.status))
            .collect()
    });
    assert_eq!(
        during.len(),
        1,
        "only the call that met the global limit reached Discord during it: {during:?}"
    );
    assert!(
        !during.iter().any(|c| c.contains(&other)),
        "nothing for the second channel during the limit: {during:?}"
    );
    assert_eq!(w.sim.posted(&w.channel).len(), 1, "each sent once");
    assert_eq!(w.sim.posted(&other).len(), 1, "each sent once");
    assert_stops_cleanly(d);
}

/// `ms` since 1970 as `YYYY-MM-DDTHH:MM:SSZ`, as the system's `date` writes it (not imgate's code).
fn utc(ms: u64) -> String {
    let out = std::process::Command::new("date")
        .args(["-u", "-d", &format!("@{}", ms / 1000), "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .expect("date runs");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn a_spent_session_budget_is_said_in_the_descriptor_status_and_one_log_line() {
    let (d, w) = discord("dc-spent", &[]);
    w.sim.knobs(|k| {
        k.session_start_remaining = 0;
        k.session_start_reset_after = 7000;
    });
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let before = now_ms();
    // Bound (the token and channel are good, sends work), and the Descriptor says that no
    // message arrives until the budget resets.
    let a = bind(&mut x, &cch, BOT_TOKEN, &w.channel);
    let after = now_ms();
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    let descriptor = &a["payload"]["connection_descriptor"];
    assert_descriptor(descriptor);
    assert_eq!(descriptor["connection"]["status"], "degraded", "{descriptor}");
    let reason = descriptor["tools"][0]["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("daily budget of new sessions"), "{descriptor}");
    // When it resets, as a time: Discord's `reset_after` from the moment it answered.
    let resets: Vec<String> = ((before + 7000) / 1000..=(after + 7000) / 1000 + 1)
        .map(|s| utc(s * 1000))
        .collect();
    let page = get_json(&d.url("/status"));
    let row = &page["channels"][0];
    assert_eq!(row["status"], "degraded", "{page}");
    let shown = row["reason"].as_str().unwrap_or_default();
    assert!(
        resets.iter().any(|t| shown.contains(t.as_str())),
        "{shown} names none of {resets:?}"
    );
    assert!(d.log_shows("daily budget of new sessions is used up", WAIT));

    // Asked again after the reset Discord named (its countdown lower now): no new line.
    w.sim.knobs(|k| k.session_start_reset_after = 5000);
    assert!(
        w.sim
            .wait_until(Duration::from_secs(30), |r| r.calls_to("/gateway/bot").count() >= 3),
        "the binding's question and the session's two"
    );
    assert_eq!(w.sim.records(|r| r.identifies.len()), 0, "no IDENTIFY meanwhile");
    assert_eq!(
        d.log().matches("daily budget of new sessions is used up").count(),
        1,
        "one log line, not one per question"
    );

    // The budget is back: a session, and the channel is connected again.
    w.sim.knobs(|k| k.session_start_remaining = 1000);
    assert!(w.sim.wait_until(Duration::from_secs(30), |r| r.ready >= 1));
    let pushed = x.next_of("connection.descriptor.push", WAIT).expect("xAgent is told");
    assert_eq!(
        pushed["payload"]["connection_descriptor"]["connection"]["status"], "connected",
        "{pushed}"
    );
    let page = get_json(&d.url("/status"));
    assert_eq!(page["channels"][0]["status"], "connected", "{page}");
    assert!(page["channels"][0].get("reason").is_none(), "{page}");
    assert_stops_cleanly(d);
}
