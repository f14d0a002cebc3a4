//! Hostile and broken upstreams, side by side with `IMGATE_BENCH_BASELINE` when set: for each
//! case a fresh release `imgate`, its peak RSS (VmHWM), the worst latency of a legitimate
//! webhook sent every 20 ms beside it, and the log lines the case wrote.

use std::io::Write;
use std::time::{Duration, Instant};

use serde_json::json;

use super::{beside_webhooks, builds, ms};
use crate::common::botapi::BotApi;
use crate::common::feishu::{FeishuSim, Flood};
use crate::common::ilink::Ilink;
use crate::common::*;

const BOT: u64 = 7001;
const TOKEN: &str = "7001:bench-token";
const CHAT: i64 = 4242;
const FILE: usize = 20 << 20;

/// What one case needs: the daemon's extra config, and the case itself once xAgent is bound.
struct Case {
    name: &'static str,
    run: fn(&Daemon, &mut Sim, &str, &Upstreams),
}

/// The fake upstreams every case may use, started once per build.
struct Upstreams {
    telegram: BotApi,
    feishu: FeishuSim,
    wechat: Ilink,
    /// Accepts connections and never answers: a `reply_url` that hangs.
    silent: std::net::TcpListener,
}

impl Upstreams {
    fn start() -> Upstreams {
        let telegram = BotApi::start();
        telegram.add_bot(TOKEN, BOT, "bench_bot");
        telegram.add_chat(BOT, json!({"id": CHAT, "type": "private", "first_name": "Ada"}));
        let feishu = FeishuSim::start();
        feishu.add_app("cli_bench", "bench-secret", true);
        feishu.add_chat("oc_bench", "Ops", "group", &["cli_bench"]);
        Upstreams {
            telegram,
            feishu,
            wechat: Ilink::start(),
            silent: std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
        }
    }

    fn config(&self) -> String {
        format!(
            "[files]\nmax_file_bytes = {FILE}\n[telegram]\napi_base = {}\n[feishu]\napi_base = {}\n\
             [wechat]\napi_base = {}\ncdn_base = {}/c2c\n",
            self.telegram.base, self.feishu.base, self.wechat.base, self.wechat.base
        )
    }

    fn silent_url(&self) -> String {
        format!("http://127.0.0.1:{}/reply", self.silent.local_addr().unwrap().port())
    }
}

fn bound(x: &mut Sim, flow: &str, input: serde_json::Value) -> String {
    let (cch, _) = x.open(None);
    let a = x.request("auth.start", Some(&cch), json!({"flow_id": flow, "input": input}));
    assert_eq!(a["payload"]["status"], "authenticated", "{a}");
    cch
}

fn idle(_: &Daemon, _: &mut Sim, _: &str, _: &Upstreams) {
    std::thread::sleep(Duration::from_secs(3));
}

/// 9,000 updates of a chat bound to no channel, about 8 MB, answered whole to every poll
/// whatever its `limit`: until they are all read, or for 10 polls (waited on while polls keep
/// coming: a retry waits 30 s at most, so `QUIET` without one means polling stopped).
fn telegram_8_mb_of_updates(_: &Daemon, x: &mut Sim, _: &str, up: &Upstreams) {
    let text = "x".repeat(800);
    let mut last = 0;
    for _ in 0..9000 {
        last = up.telegram.user_says(BOT, 999, &text, Duration::ZERO);
    }
    up.telegram.ignore_limit();
    bound(
        x,
        "telegram_bot_binding",
        json!({"bot_token": TOKEN, "chat_id": CHAT.to_string()}),
    );
    let mut progress = Progress::new(QUIET);
    loop {
        let polls = up.telegram.calls("getUpdates");
        let offset = polls.last().and_then(|c| c["offset"].as_u64());
        if offset.is_some_and(|o| o > last) || polls.len() >= 10 {
            return;
        }
        assert!(
            progress.moving(polls.len()),
            "{} polls of 10, and none more for {QUIET:?}",
            polls.len()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits for the push of the provider's file (the webhooks beside it are pushed too).
fn pushed_file(x: &mut Sim) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        let Some(push) = x.next_push(Duration::from_secs(5)) else {
            continue;
        };
        let payload = &push["payload"];
        if payload["files"][0]["byte_size"] == json!(FILE) {
            return;
        }
        // An older build may have noted the file as not available instead: shown, not asserted.
        if payload["raw_text"]
            .as_str()
            .is_some_and(|t| t.contains("not available"))
        {
            println!("  (no file: {})", payload["raw_text"]);
            return;
        }
    }
    panic!("the file's message was not pushed");
}

fn telegram_file(_: &Daemon, x: &mut Sim, _: &str, up: &Upstreams) {
    bound(
        x,
        "telegram_bot_binding",
        json!({"bot_token": TOKEN, "chat_id": CHAT.to_string()}),
    );
    up.telegram
        .user_sends_document(BOT, CHAT, &patterned(FILE, 1), "big.pdf", "application/pdf");
    pushed_file(x);
}

fn feishu_file(_: &Daemon, x: &mut Sim, _: &str, up: &Upstreams) {
    let input = json!({"app_id": "cli_bench", "app_secret": "bench-secret", "chat_id": "oc_bench"});
    bound(x, "feishu_app_binding", input);
    assert!(up.feishu.wait_connected("cli_bench", 1, Duration::from_secs(30)));
    up.feishu
        .add_resource("om_big", "file_v3_big", &patterned(FILE, 2), "application/pdf");
    let content = json!({"file_key": "file_v3_big", "file_name": "big.pdf"});
    let event = FeishuSim::message_event("cli_bench", "oc_bench", "om_big", "file", content);
    up.feishu.push_event("cli_bench", &event, 1);
    pushed_file(x);
}

fn wechat_file(_: &Daemon, x: &mut Sim, _: &str, up: &Upstreams) {
    up.wechat.script_next_code(vec![Ilink::confirmed()]);
    let (cch, _) = x.open(None);
    let start = x.request("auth.start", Some(&cch), json!({"flow_id": "wechat_qr_login"}));
    let id = start["payload"]["auth_session_id"].as_str().unwrap().to_string();
    let done = x.request(
        "auth.status",
        Some(&cch),
        json!({"flow_id": "wechat_qr_login", "auth_session_id": id, "refresh": false}),
    );
    assert_eq!(done["payload"]["status"], "authenticated", "{done}");
    up.wechat.user_sends(4, "big.pdf", &patterned(FILE, 3), "ctx-big");
    pushed_file(x);
}

/// Feishu's gateway floods events of a chat bound to no channel, each with 58 headers of 4,000
/// bytes, and reads nothing: for 15 s, or until imgate drops the link and connects again.
fn feishu_event_flood(d: &Daemon, x: &mut Sim, _: &str, up: &Upstreams) {
    let input = json!({"app_id": "cli_bench", "app_secret": "bench-secret", "chat_id": "oc_bench"});
    bound(x, "feishu_app_binding", input);
    // The binding's own checks may connect too: the flood is for the long connection.
    assert!(d.log_shows("long connection up", Duration::from_secs(30)));
    let connected = up.feishu.connections("cli_bench");
    let flood = Flood::Events {
        chat: "oc_unbound".into(),
        headers: 58,
        header_len: 4000,
        echoed_len: 256,
    };
    up.feishu.flood_next("cli_bench", flood);
    up.feishu.drop_connection("cli_bench");
    assert!(up
        .feishu
        .wait_connected("cli_bench", connected + 1, Duration::from_secs(30)));
    up.feishu
        .wait_connected("cli_bench", connected + 2, Duration::from_secs(15));
}

/// 200,000 ping frames of 125 bytes on the data plane's `/ws`, nothing read.
fn ws_ping_flood(_: &Daemon, x: &mut Sim, _: &str, _: &Upstreams) {
    // Masked with a zero key, as a client must mask (the payload reads the same).
    let mut ping = vec![0x89u8, 0x80 | 125, 0, 0, 0, 0];
    ping.extend_from_slice(&[b'p'; 125]);
    let burst: Vec<u8> = ping.iter().copied().cycle().take(ping.len() * 1000).collect();
    let socket = x.socket();
    socket.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    for _ in 0..200 {
        if socket.write_all(&burst).is_err() {
            break;
        }
    }
}

/// 20,000 `tool.invoke`s as fast as they go, to a `reply_url` that never answers.
fn tool_flood(_: &Daemon, x: &mut Sim, cch: &str, _: &Upstreams) {
    const CALLS: usize = 20_000;
    for i in 0..CALLS {
        x.send(
            "tool.invoke",
            Some(cch),
            json!({"tool_id": "imgate_message_send", "arguments": {"text": format!("flood {i}")},
                   "context": {"session_id": "s1", "tool_call_id": format!("flood-{i}")}}),
        );
    }
    // Until all but the 16 running are answered, or a minute (an older build answers each
    // call only when its reply_url times out).
    let (mut acks, mut quiet_since, started) = (0, Instant::now(), Instant::now());
    while acks < CALLS - 16
        && quiet_since.elapsed() < Duration::from_secs(20)
        && started.elapsed() < Duration::from_secs(60)
    {
        if let Some(p) = x.recv_within(Duration::from_millis(200)) {
            if p["type"] == "tool.invoke.ack" {
                acks += 1;
                quiet_since = Instant::now();
            }
        }
    }
}

/// 10 tool calls a second for 20 s to a `reply_url` that never answers.
fn silent_reply_url(_: &Daemon, x: &mut Sim, cch: &str, _: &Upstreams) {
    let started = Instant::now();
    for i in 0..200 {
        // What arrives meanwhile is read (the webhooks' pushes, the acks) until the call is due.
        let due = started + Duration::from_millis(100 * i);
        while let Some(left) = due.checked_duration_since(Instant::now()) {
            let _ = x.recv_within(left);
        }
        x.send(
            "tool.invoke",
            Some(cch),
            json!({"tool_id": "imgate_message_send", "arguments": {"text": "hello"},
                   "context": {"session_id": "s1", "tool_call_id": format!("silent-{i}")}}),
        );
    }
}

/// 5,000 `channel.open`s as fast as they go.
fn channel_flood(_: &Daemon, x: &mut Sim, _: &str, _: &Upstreams) {
    const OPENS: usize = 5000;
    for _ in 0..OPENS {
        x.send("channel.open", None, json!({}));
    }
    let (mut answers, mut quiet_since) = (0, Instant::now());
    while answers < OPENS && quiet_since.elapsed() < Duration::from_secs(20) {
        // The webhooks' pushes arrive meanwhile: only the channels' answers count.
        if x.recv_within(Duration::from_millis(200))
            .is_some_and(|p| p["type"] != "message.push")
        {
            answers += 1;
            quiet_since = Instant::now();
        }
    }
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "idle",
            run: idle,
        },
        Case {
            name: "tg 8 MB of updates",
            run: telegram_8_mb_of_updates,
        },
        Case {
            name: "tg 20 MiB file",
            run: telegram_file,
        },
        Case {
            name: "feishu 20 MiB file",
            run: feishu_file,
        },
        Case {
            name: "wechat 20 MiB file",
            run: wechat_file,
        },
        Case {
            name: "feishu event flood",
            run: feishu_event_flood,
        },
        Case {
            name: "/ws ping flood",
            run: ws_ping_flood,
        },
        Case {
            name: "tool.invoke flood",
            run: tool_flood,
        },
        Case {
            name: "silent reply_url",
            run: silent_reply_url,
        },
        Case {
            name: "channel.open flood",
            run: channel_flood,
        },
    ]
}

#[test]
#[ignore = "benchmark: cargo test --release --test bench -- --ignored --nocapture --test-threads=1"]
fn bench_upstreams() {
    // `IMGATE_BENCH_ONLY=wechat` (a part of a case's name) runs only the cases it names.
    let only = std::env::var("IMGATE_BENCH_ONLY").unwrap_or_default();
    println!(
        "\n{:<12} {:<20} {:>10} {:>10} {:>16} {:>10}",
        "build", "case", "start", "peak", "worst webhook", "log lines"
    );
    for (build, program) in builds() {
        for case in cases().into_iter().filter(|c| c.name.contains(only.as_str())) {
            let up = Upstreams::start();
            let dir = temp_dir("bench-upstreams");
            let config = config_text(free_port(), &dir, Some(&up.silent_url()), &up.config())
                .replace("log_level = debug", "log_level = info");
            let d = Daemon::start_program(&program, &dir, &config, "info", &[]);
            let (mut x, cch) = d.bound_xagent();
            let start = hwm_kib(d.pid());
            let lines_before = d.log().lines().count();
            let ((), worst) = beside_webhooks(&d, || (case.run)(&d, &mut x, &cch, &up));
            let peak = hwm_kib(d.pid());
            // Lines reach the log through a reader thread, a moment after they are written.
            std::thread::sleep(Duration::from_millis(500));
            let lines = d.log().lines().count().saturating_sub(lines_before);
            println!(
                "{build:<12} {:<20} {:>10} {:>10} {:>16} {:>10}",
                case.name,
                format!("{:.1} MiB", start as f64 / 1024.0),
                format!("{:.1} MiB", peak as f64 / 1024.0),
                format!("{:.0} ms", ms(worst)),
                lines
            );
        }
    }
    println!("(a fresh process per case; peak = VmHWM after the case; a webhook every 20 ms beside it)");
}
