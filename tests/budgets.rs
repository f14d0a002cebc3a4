//! Edge budgets of a (cross-)built binary: size, peak RSS idle, with a 50 MiB backlog and at the
//! largest backlog the default caps allow, cold start to READY=1. Prints figures; asserts
//! nothing about them.
//!
//!     cross/budgets.sh     (builds x86_64-unknown-linux-musl, then runs this with IMGATE_BIN)

mod common;

use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Starts the binary under a fake systemd notify socket; returns the time to READY=1.
fn time_to_ready(dir: &std::path::Path, config: &std::path::Path) -> (std::process::Child, Duration) {
    let path = dir.join(format!("notify-{}.sock", ids()));
    let sock = UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let start = Instant::now();
    let mut child = Command::new(bin())
        .args(["run", "--config"])
        .arg(config)
        .env("NOTIFY_SOCKET", &path)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 64];
    loop {
        match sock.recv(&mut buf) {
            Ok(n) if &buf[..n] == b"READY=1" => return (child, start.elapsed()),
            Ok(_) => {}
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("no READY=1 from {}: {e}", bin());
            }
        }
    }
}

fn ids() -> u64 {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
}

fn term(mut child: std::process::Child) {
    Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    child.wait().unwrap();
}

#[test]
#[ignore = "budgets: cross/budgets.sh"]
fn edge_budgets() {
    println!("binary under test: {}", bin());
    let aarch64 = concat!(env!("CARGO_MANIFEST_DIR"), "/dist/imgate-aarch64-unknown-linux-musl");
    match std::fs::metadata(aarch64) {
        Ok(m) => println!(
            "{:<52} {} KiB",
            "stripped aarch64-unknown-linux-musl binary",
            m.len() / 1024
        ),
        Err(_) => println!("aarch64 binary not built (cross/build.sh aarch64-unknown-linux-musl)"),
    }
    let dir = temp_dir("budgets");
    let port = free_port();
    let config = dir.join("imgate.conf");
    let queue =
        "[queue]\nmax_messages_per_channel = 10000000\nmax_bytes_per_channel = 512MiB\nmax_bytes_total = 512MiB\n";
    std::fs::write(
        &config,
        config_text(port, &dir, None, queue).replace("log_level = debug", "log_level = info"),
    )
    .unwrap();

    let (child, ready) = time_to_ready(&dir, &config);
    println!(
        "{:<52} {:.1} ms",
        "cold start to READY, empty state dir",
        ready.as_secs_f64() * 1000.0
    );
    term(child);

    let d = Daemon::start_env(&dir, &std::fs::read_to_string(&config).unwrap(), "warn", &[]);
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    x.bind_webhook(&cch, "alerts", HOOK_SECRET);
    let idle = Instant::now();
    while idle.elapsed() < Duration::from_secs(30) {
        x.recv_within(Duration::from_millis(500));
    }
    println!(
        "{:<52} {} KiB",
        "peak RSS, one bound channel, idle 30 s (VmHWM)",
        hwm_kib(d.pid())
    );
    // Then 30 s more: how often the idle daemon wakes (xAgent connected, keepalive pings).
    // Threads are sampled twice a second: most of the time, and at most.
    let (before, from) = (wakeups(d.pid()), Instant::now());
    let mut threads = std::collections::BTreeMap::<u64, u32>::new();
    while from.elapsed() < Duration::from_secs(30) {
        x.recv_within(Duration::from_millis(500));
        *threads.entry(proc_field(d.pid(), "status", "Threads:")).or_default() += 1;
    }
    let usual = threads.iter().max_by_key(|(_, seen)| **seen).map_or(0, |(n, _)| *n);
    let most = threads.keys().last().copied().unwrap_or(0);
    let per_second = (wakeups(d.pid()) - before) as f64 / from.elapsed().as_secs_f64();
    println!(
        "{:<52} {per_second:.2}",
        "wake-ups a second, all threads, idle (budget 2)"
    );
    println!(
        "{:<52} {usual} most of the time, at most {most}",
        "threads, idle (budget 8)"
    );
    x.close();
    std::thread::sleep(Duration::from_millis(200));

    let text = "b".repeat(1000);
    let mut round = 0;
    while get_json(&d.url("/status"))["outbox"]["pending_bytes"].as_u64().unwrap() < 50 << 20 {
        post_load(&d, 16, 250, &text, &format!("fill{round}"));
        round += 1;
    }
    println!(
        "{:<52} {} KiB",
        "peak RSS while holding a 50 MiB backlog",
        hwm_kib(d.pid())
    );
    let pid = d.pid();
    println!(
        "{:<52} anon {} KiB, file {} KiB, threads {}",
        "  RSS now",
        proc_field(pid, "status", "RssAnon:"),
        proc_field(pid, "status", "RssFile:"),
        proc_field(pid, "status", "Threads:")
    );
    d.signal("TERM");
    let mut d = d;
    d.wait_exit(Duration::from_secs(10)).expect("clean stop");

    let (child, ready) = time_to_ready(&dir, &config);
    println!(
        "{:<52} {:.1} ms",
        "cold start to READY, 50 MiB backlog (after SIGTERM)",
        ready.as_secs_f64() * 1000.0
    );
    std::thread::sleep(Duration::from_secs(2));
    println!("{:<52} {} KiB", "peak RSS after that start, idle", hwm_kib(child.id()));
    let _ = Command::new("kill").arg("-KILL").arg(child.id().to_string()).status();
    let mut child = child;
    let _ = child.wait();
    let (child, ready) = time_to_ready(&dir, &config);
    println!(
        "{:<52} {:.1} ms",
        "start to READY after SIGKILL, 50 MiB backlog",
        ready.as_secs_f64() * 1000.0
    );
    term(child);
}

/// The largest backlog the default `max_bytes_total` (64 MiB) allows: one channel (its own
/// caps raised to the total) fed webhook messages with no text, the smallest a sender can make,
/// until the oldest are evicted; peak RSS and the index, then the same state idle in a new
/// process (the index loaded at start).
#[test]
#[ignore = "budgets: cross/budgets.sh"]
fn largest_backlog_at_the_default_total_cap() {
    let dir = temp_dir("budgets-largest");
    let queue = "[queue]\nmax_messages_per_channel = 10000000\nmax_bytes_per_channel = 64MiB\n";
    let d = Daemon::start_env(&dir, &config_text(free_port(), &dir, None, queue), "warn", &[]);
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    x.bind_webhook(&cch, "alerts", HOOK_SECRET);
    x.close();
    let evicted = |d: &Daemon| {
        get_json(&d.url("/status"))["channels"][0]["evicted"]
            .as_u64()
            .unwrap_or(0)
    };
    let mut round = 0;
    // Until the cap evicts, and a round more at the cap.
    while evicted(&d) == 0 || round % 8 != 0 {
        post_load(&d, 16, 1000, "", &format!("l{round}"));
        round += 1;
    }
    let status = get_json(&d.url("/status"));
    let pending = status["channels"][0]["pending"].as_u64().unwrap_or(0);
    let (_, metrics) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
    let index = metrics
        .lines()
        .find_map(|l| l.strip_prefix("imgate_outbox_index_bytes "))
        .unwrap_or("?")
        .to_string();
    println!(
        "{:<52} {} KiB (budget 16384), index {index} B",
        format!("peak RSS at the default caps' largest backlog ({pending} pending)"),
        hwm_kib(d.pid())
    );
    let d = d.restart();
    std::thread::sleep(Duration::from_secs(3));
    println!(
        "{:<52} {} KiB now, {} KiB at the peak",
        "  the same state in a new process, idle",
        proc_field(d.pid(), "status", "VmRSS:"),
        hwm_kib(d.pid())
    );
}

/// Idle cost of one bound channel and how fast it takes 2,000 messages, for a webhook channel
/// and a Feishu chat (its long connection to the simulator) side by side.
#[test]
#[ignore = "budgets: cross/budgets.sh"]
fn feishu_long_connection_beside_a_webhook() {
    use common::feishu::FeishuSim;
    const APP: &str = "cli_budget01";
    const N: usize = 2000;
    let sim = FeishuSim::start();
    sim.add_app(APP, "budget-secret", true);
    sim.add_chat("oc_budget", "Budget", "group", &[APP]);
    let hello =
        |id: String| FeishuSim::message_event(APP, "oc_budget", &id, "text", serde_json::json!({"text": "hello"}));
    let mut rows = Vec::new();
    for kind in ["webhook", "feishu"] {
        let dir = temp_dir(&format!("budgets-{kind}"));
        let extra = format!("[feishu]\napi_base = {}\n", sim.base);
        let conf = config_text(free_port(), &dir, None, &extra).replace("log_level = debug", "log_level = info");
        let d = Daemon::start_env(&dir, &conf, "warn", &[]);
        let mut x = d.xagent();
        x.hello("");
        let (cch, _) = x.open(None);
        if kind == "webhook" {
            x.bind_webhook(&cch, "alerts", HOOK_SECRET);
        } else {
            let input = serde_json::json!({"app_id": APP, "app_secret": "budget-secret", "chat_id": "oc_budget"});
            let a = x.request(
                "auth.start",
                Some(&cch),
                serde_json::json!({"flow_id": "feishu_app_binding", "input": input}),
            );
            assert_eq!(a["payload"]["status"], "authenticated", "{a}");
            assert!(sim.wait_connected(APP, 1, Duration::from_secs(10)));
        }
        let idle = Instant::now();
        while idle.elapsed() < Duration::from_secs(20) {
            x.recv_within(Duration::from_millis(500));
        }
        let (before, from) = (wakeups(d.pid()), Instant::now());
        let mut threads = std::collections::BTreeMap::<u64, u32>::new();
        while from.elapsed() < Duration::from_secs(20) {
            x.recv_within(Duration::from_millis(500));
            *threads.entry(proc_field(d.pid(), "status", "Threads:")).or_default() += 1;
        }
        let usual = threads.iter().max_by_key(|(_, seen)| **seen).map_or(0, |(n, _)| *n);
        let wakes = (wakeups(d.pid()) - before) as f64 / from.elapsed().as_secs_f64();
        let idle_hwm = hwm_kib(d.pid());
        x.close();
        // 2,000 messages, one at a time from one sender (a webhook POST waits for its 202, a
        // Feishu event for its answer frame): what one chat can take.
        let started = Instant::now();
        let mut handling = Vec::with_capacity(N);
        if kind == "webhook" {
            for i in 0..N {
                let body = serde_json::json!({"message_id": format!("b{i}"), "sender_id": "u", "text": "hello"});
                assert_eq!(d.post_hook("alerts", &body).0, 202);
            }
        } else {
            for i in 0..N {
                let frame = sim.push_event(APP, &hello(format!("om_b{i}")), 1);
                let (code, rt) = sim.answer(&frame, Duration::from_secs(10)).expect("answered");
                assert_eq!(code, 200);
                handling.push(rt.and_then(|r| r.parse::<u64>().ok()).unwrap_or(0));
            }
            handling.sort_unstable();
            println!(
                "feishu 1 by 1: imgate's own handling time (biz_rt), p50 {} ms, p99 {} ms; the rest of each round trip is the simulator and the socket",
                handling[N / 2],
                handling[N * 99 / 100]
            );
        }
        let one_by_one = N as f64 / started.elapsed().as_secs_f64();
        // Then a burst: 2,000 more at once (16 senders for the webhook; for Feishu, all pushed
        // on the connection before the first answer), until every one is answered.
        let started = Instant::now();
        if kind == "webhook" {
            post_load(&d, 16, N / 16, "hello", "burst");
        } else {
            for i in 0..N {
                sim.push_event(APP, &hello(format!("om_burst{i}")), 1);
            }
            assert!(sim.wait_answered(2 * N, QUIET), "every event answered");
        }
        let burst = N as f64 / started.elapsed().as_secs_f64();
        rows.push((kind, idle_hwm, usual, wakes, one_by_one, burst, hwm_kib(d.pid())));
    }
    println!(
        "{:<8} {:>15} {:>13} {:>16} {:>16} {:>15} {:>17}",
        "channel",
        "idle VmHWM KiB",
        "idle threads",
        "wake-ups/s idle",
        "msgs/s, 1 by 1",
        "msgs/s, burst",
        "VmHWM after, KiB"
    );
    for (kind, idle, threads, wakes, one, burst, after) in rows {
        println!("{kind:<8} {idle:>15} {threads:>13} {wakes:>16.2} {one:>16.0} {burst:>15.0} {after:>17}");
    }
}

/// A legitimate webhook sender, one request at a time, until `stop`: its latencies.
fn legitimate_sender(d: &Daemon, tag: &str, stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> Vec<Duration> {
    let mut times = Vec::new();
    let mut i = 0;
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let started = Instant::now();
        let (status, _) = d.post_hook(
            "alerts",
            &serde_json::json!({"message_id": format!("{tag}-{i}"), "sender_id": "u"}),
        );
        times.push(started.elapsed());
        assert_eq!(status, 202, "the legitimate webhook is accepted");
        i += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
    times
}

fn quantile(times: &mut [Duration], q: f64) -> Duration {
    times.sort();
    times[((times.len() as f64 - 1.0) * q).round() as usize]
}

/// Peak RSS and a legitimate webhook's latency while a peer with a credential attacks, side by
/// side with idle; each phase on a fresh daemon so VmHWM is that phase's peak.
#[test]
#[ignore = "budgets: cross/budgets.sh"]
fn hostile_peers_side_by_side_with_idle() {
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    const PHASE: Duration = Duration::from_secs(5);
    println!("binary under test: {}", bin());
    println!("| phase | peak RSS (VmHWM) | legitimate webhook p50 | worst | requests | attack |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for phase in [
        "idle",
        "1 MiB JSON bombs, 2 senders back to back",
        "a /ws client flooding pings, reading nothing",
    ] {
        let dir = temp_dir("hostile");
        let conf = config_text(free_port(), &dir, None, "").replace("log_level = debug", "log_level = info");
        let d = Daemon::start_logging(&dir, &conf, "info");
        let stop = Arc::new(AtomicBool::new(false));
        let attack_note = std::thread::scope(|scope| {
            let attackers: Vec<_> = match phase {
                "idle" => vec![],
                p if p.starts_with("1 MiB") => (0..2)
                    .map(|_| {
                        let (stop, url) = (stop.clone(), d.url("/hooks/alerts"));
                        scope.spawn(move || {
                            let bomb = "[".repeat((1 << 20) - 64);
                            let mut n = 0;
                            while !stop.load(Ordering::SeqCst) {
                                let (status, _) =
                                    http_post(&url, &[("Authorization", &format!("Bearer {HOOK_SECRET}"))], &bomb);
                                assert_eq!(status, 400);
                                n += 1;
                            }
                            format!("{n} bombs")
                        })
                    })
                    .collect(),
                _ => {
                    let (stop, port) = (stop.clone(), d.port);
                    vec![scope.spawn(move || {
                        let mut ws = raw_upgrade(port, &format!("Bearer {API_KEY}"));
                        ws.write_all(&hello_frame()).unwrap();
                        let _ = next_text(&mut ws);
                        let ping = text_frame(
                            serde_json::json!({"schema": "xagent.connector.packet/v1", "packet_id": "p",
                                               "request_id": "r".repeat(256), "type": "ping"})
                            .to_string()
                            .as_bytes(),
                        );
                        ws.set_write_timeout(Some(Duration::from_millis(500))).unwrap();
                        let mut n = 0;
                        while !stop.load(Ordering::SeqCst) && ws.write_all(&ping).is_ok() {
                            n += 1;
                        }
                        format!("{n} pings until the daemon stopped reading")
                    })]
                }
            };
            let legit = {
                let stop = stop.clone();
                let d = &d;
                scope.spawn(move || legitimate_sender(d, "legit", stop))
            };
            std::thread::sleep(PHASE);
            stop.store(true, Ordering::SeqCst);
            let notes: Vec<String> = attackers.into_iter().map(|a| a.join().unwrap()).collect();
            let mut times = legit.join().unwrap();
            let (p50, worst) = (quantile(&mut times, 0.5), quantile(&mut times, 1.0));
            (notes.join(", "), p50, worst, times.len())
        });
        let (note, p50, worst, n) = attack_note;
        println!(
            "| {phase} | {} KiB | {:.1} ms | {:.1} ms | {n} | {} |",
            hwm_kib(d.pid()),
            p50.as_secs_f64() * 1000.0,
            worst.as_secs_f64() * 1000.0,
            if note.is_empty() { "none".into() } else { note }
        );
    }
}

/// Idle cost of one signed-in WeChat bot (its long poll held 35 s, as iLink holds it) beside one
/// bound webhook channel: the wake-ups the receiver adds beyond the long poll itself.
#[test]
#[ignore = "budgets: cross/budgets.sh"]
fn wechat_bot_idle_beside_a_webhook() {
    use common::ilink::Ilink;
    let mut rows = Vec::new();
    for kind in ["webhook", "wechat"] {
        let api = Ilink::start();
        api.hold(Duration::from_secs(35));
        let dir = temp_dir(&format!("budgets-wx-{kind}"));
        let extra = format!("[wechat]\napi_base = {}\ncdn_base = {}/c2c\n", api.base, api.base);
        let conf = config_text(free_port(), &dir, None, &extra).replace("log_level = debug", "log_level = info");
        let d = Daemon::start_env(&dir, &conf, "warn", &[]);
        let mut x = d.xagent();
        x.hello("");
        let (cch, _) = x.open(None);
        if kind == "webhook" {
            x.bind_webhook(&cch, "alerts", HOOK_SECRET);
        } else {
            api.script_next_code(vec![Ilink::confirmed()]);
            let a = x.request(
                "auth.start",
                Some(&cch),
                serde_json::json!({"flow_id": "wechat_qr_login"}),
            );
            let id = a["payload"]["auth_session_id"].as_str().unwrap().to_string();
            let st = x.request("auth.status", Some(&cch), serde_json::json!({"auth_session_id": id}));
            assert_eq!(st["payload"]["status"], "authenticated", "{st}");
        }
        let idle = Instant::now();
        while idle.elapsed() < Duration::from_secs(10) {
            x.recv_within(Duration::from_millis(500));
        }
        let (before, polls, from) = (wakeups(d.pid()), api.getupdates_calls(), Instant::now());
        while from.elapsed() < Duration::from_secs(30) {
            x.recv_within(Duration::from_millis(500));
        }
        let secs = from.elapsed().as_secs_f64();
        let wakes = (wakeups(d.pid()) - before) as f64 / secs;
        rows.push((
            kind,
            wakes,
            api.getupdates_calls() - polls,
            proc_field(d.pid(), "status", "Threads:"),
            hwm_kib(d.pid()),
        ));
    }
    println!(
        "{:<8} {:>16} {:>22} {:>8} {:>12}",
        "channel", "wake-ups/s idle", "getupdates in 30 s", "threads", "VmHWM KiB"
    );
    for (kind, wakes, polls, threads, hwm) in rows {
        println!("{kind:<8} {wakes:>16.2} {polls:>22} {threads:>8} {hwm:>12}");
    }
}

/// A bot of a provider with a long connection (Slack's Socket Mode, Discord's Gateway,
/// DingTalk's Stream mode) or a long poll (Matrix's /sync) beside
/// the webhook channel, against its simulator.
enum Bot {
    None,
    Slack(common::slack::SlackSim),
    Discord(common::discord::DiscordSim, String, common::discord::User),
    DingTalk(common::dingtalk::DingTalkSim),
    Matrix(common::matrix::MatrixSim),
    WeCom(common::wecom::WecomSim),
}

impl Bot {
    const SLACK_CHANNEL: &str = "C0BUDGET1";
    const DINGTALK_APP: &str = "dingbudget0000000001";
    const DINGTALK_GROUP: &str = "cidBudget0001==";
    const MATRIX_ROOM: &str = "!budget:sim";
    const MATRIX_TOKEN: &str = "syt_budget_bot";
    const WECOM_BOT: &str = "aibBudget01";
    const WECOM_GROUP: &str = "wrcBudget01";

    fn start(kind: &str) -> Bot {
        match kind {
            "slack" => {
                let sim = common::slack::SlackSim::start();
                sim.add_app("xoxb-budget", "xapp-budget", "U0BUDGET1", "B0BUDGET1");
                sim.add_user("U0PEOPLE1", "Ann");
                sim.add_channel(Self::SLACK_CHANNEL, "budget", "channel", &["U0BUDGET1", "U0PEOPLE1"]);
                Bot::Slack(sim)
            }
            "discord" => {
                let sim = common::discord::DiscordSim::start();
                // Discord's own interval (gateway.mdx's example).
                sim.knobs(|k| k.heartbeat_interval = Duration::from_millis(41_250));
                let guild = sim.add_guild("Budget");
                let channel = sim.add_text_channel(&guild, "budget");
                let ann = sim.add_user("ann", false);
                Bot::Discord(sim, channel, ann)
            }
            "dingtalk" => {
                let sim = common::dingtalk::DingTalkSim::start();
                sim.add_app(Self::DINGTALK_APP, "budget-secret");
                sim.add_user("0100001", "Ann");
                sim.add_group(Self::DINGTALK_GROUP, "Budget");
                Bot::DingTalk(sim)
            }
            "matrix" => {
                let sim = common::matrix::MatrixSim::start();
                sim.add_user("@bot:sim", Self::MATRIX_TOKEN);
                sim.add_user("@ann:sim", "ann-token");
                sim.add_room(Self::MATRIX_ROOM, &["@bot:sim", "@ann:sim"], false);
                Bot::Matrix(sim)
            }
            "wecom" => {
                let sim = common::wecom::WecomSim::start();
                sim.robot(Self::WECOM_BOT, "budget-secret");
                Bot::WeCom(sim)
            }
            _ => Bot::None,
        }
    }

    fn section(&self) -> String {
        match self {
            Bot::None => String::new(),
            Bot::Slack(sim) => format!("[slack]\napi_base = {}\n", sim.base),
            Bot::Discord(sim, ..) => format!("[discord]\napi_base = {}\n", sim.base),
            Bot::DingTalk(sim) => format!(
                "[dingtalk]\napi_base = {}\noapi_base = {}\n",
                sim.api_base, sim.oapi_base
            ),
            Bot::Matrix(_) => "[matrix]\n".into(),
            Bot::WeCom(sim) => format!("[wecom]\nws_url = {}\n", sim.ws_url),
        }
    }

    /// Binds the bot's channel to a new channel of `x`; its ID.
    fn bind(&self, x: &mut Sim) -> Option<String> {
        let (flow, input) = match self {
            Bot::None => return None,
            Bot::Slack(_) => (
                "slack_app_binding",
                serde_json::json!({"bot_token": "xoxb-budget", "app_token": "xapp-budget", "channel_id": Self::SLACK_CHANNEL}),
            ),
            Bot::Discord(_, channel, _) => (
                "discord_bot_binding",
                serde_json::json!({"bot_token": common::discord::BOT_TOKEN, "channel_id": channel}),
            ),
            Bot::DingTalk(_) => (
                "dingtalk_robot_binding",
                serde_json::json!({"client_id": Self::DINGTALK_APP, "client_secret": "budget-secret", "conversation_id": Self::DINGTALK_GROUP}),
            ),
            Bot::Matrix(sim) => (
                "matrix_room_binding",
                serde_json::json!({"homeserver": sim.base, "access_token": Self::MATRIX_TOKEN, "room_id": Self::MATRIX_ROOM}),
            ),
            Bot::WeCom(_) => (
                "wecom_bot_binding",
                serde_json::json!({"bot_id": Self::WECOM_BOT, "secret": "budget-secret", "chat_id": Self::WECOM_GROUP}),
            ),
        };
        let (cch, _) = x.open(None);
        let a = x.request(
            "auth.start",
            Some(&cch),
            serde_json::json!({"flow_id": flow, "input": input}),
        );
        assert_eq!(a["payload"]["status"], "authenticated", "{a}");
        let up = match self {
            Bot::Slack(sim) => sim.wait_connected("xapp-budget", 1, Duration::from_secs(10)),
            Bot::Discord(sim, ..) => sim.wait_until(Duration::from_secs(10), |r| r.ready >= 1),
            Bot::DingTalk(sim) => sim.wait_connected(Self::DINGTALK_APP, 1, Duration::from_secs(10)),
            Bot::Matrix(sim) => sim.wait_polling(Duration::from_secs(10)),
            Bot::WeCom(sim) => sim.wait_open_links(Self::WECOM_BOT, 1, Duration::from_secs(10)),
            Bot::None => true,
        };
        assert!(up, "the bot is connected");
        Some(cch)
    }

    /// Its keepalives so far (Slack's and DingTalk's pings, Discord's heartbeats, Matrix's syncs).
    fn keepalives(&self) -> u64 {
        match self {
            Bot::None => 0,
            Bot::Slack(sim) => sim.pings("xapp-budget") as u64,
            Bot::Discord(sim, ..) => sim.records(|r| r.heartbeats),
            Bot::DingTalk(sim) => sim.ws_pings(Self::DINGTALK_APP) as u64,
            // A long poll's answer (every 30 s when idle).
            Bot::Matrix(sim) => sim.syncs() as u64,
            Bot::WeCom(sim) => sim.pings(Self::WECOM_BOT).len() as u64,
        }
    }

    fn post(&self, text: &str) {
        match self {
            Bot::None => {}
            Bot::Slack(sim) => {
                sim.post(Self::SLACK_CHANNEL, "U0PEOPLE1", text, None);
            }
            Bot::Discord(sim, channel, ann) => {
                sim.post(channel, common::discord::UserMsg::text(ann, text));
            }
            Bot::DingTalk(sim) => {
                sim.send_text(Self::DINGTALK_APP, Self::DINGTALK_GROUP, "0100001", text);
            }
            Bot::Matrix(sim) => {
                sim.post_text(Self::MATRIX_ROOM, "@ann:sim", text);
            }
            Bot::WeCom(sim) => {
                let group = common::wecom::Chat::group(Self::WECOM_GROUP, "ann");
                sim.send_text(Self::WECOM_BOT, &group, text);
            }
        }
    }

    /// Whether what is posted while imgate is stopped reaches it afterwards: DingTalk sends a
    /// robot message once, so its messages are posted live instead, once it is connected again.
    fn keeps_history(&self) -> bool {
        !matches!(self, Bot::DingTalk(_) | Bot::WeCom(_))
    }
}

/// Idle cost of one bound bot of each long-connection provider (its connection to the
/// simulator) beside a bound webhook channel, and the peak RSS while a catch-up of 1,000
/// messages (posted while imgate was stopped; DingTalk's, which keeps no history, posted live
/// after the restart) runs beside webhook load, side by side with the webhook alone under the
/// same load.
#[test]
#[ignore = "budgets: cross/budgets.sh"]
fn a_bot_idle_and_a_catch_up_beside_webhooks() {
    const N: usize = 1000;
    let text = "a message of a busy channel, about two hundred bytes long, as people write them: ".repeat(2);
    let mut rows = Vec::new();
    for kind in ["webhook", "slack", "discord", "dingtalk", "matrix", "wecom"] {
        let bot = Bot::start(kind);
        let dir = temp_dir(&format!("budgets-bot-{kind}"));
        let conf =
            config_text(free_port(), &dir, None, &bot.section()).replace("log_level = debug", "log_level = info");
        let mut d = Daemon::start_env(&dir, &conf, "warn", &[]);
        let mut x = d.xagent();
        x.hello("");
        let (hook, _) = x.open(None);
        x.bind_webhook(&hook, "alerts", HOOK_SECRET);
        let channels: Vec<String> = std::iter::once(hook).chain(bot.bind(&mut x)).collect();
        let settle = Instant::now();
        while settle.elapsed() < Duration::from_secs(10) {
            x.recv_within(Duration::from_millis(500));
        }
        let (before, from) = (wakeups(d.pid()), Instant::now());
        while from.elapsed() < Duration::from_secs(30) {
            x.recv_within(Duration::from_millis(500));
        }
        let wakes = (wakeups(d.pid()) - before) as f64 / from.elapsed().as_secs_f64();
        // Right after a keepalive: what the bot costs beyond it.
        let kept = bot.keepalives();
        while kind != "webhook" && bot.keepalives() == kept {
            x.recv_within(Duration::from_millis(100));
        }
        let settle = Instant::now();
        while settle.elapsed() < Duration::from_secs(1) {
            x.recv_within(Duration::from_millis(100));
        }
        let (before, from, kept) = (wakeups(d.pid()), Instant::now(), bot.keepalives());
        while from.elapsed() < Duration::from_secs(12) {
            x.recv_within(Duration::from_millis(500));
        }
        assert_eq!(bot.keepalives(), kept, "a window without a keepalive");
        let between = (wakeups(d.pid()) - before) as f64 / from.elapsed().as_secs_f64();
        let threads = proc_field(d.pid(), "status", "Threads:");
        let connector = d.connector_id();
        x.close();
        d.signal("TERM");
        assert!(d.wait_exit(Duration::from_secs(20)).is_some());
        let post_all = || {
            for i in 0..N {
                bot.post(&format!("{i} {text}"));
            }
        };
        if bot.keeps_history() {
            post_all();
        }
        let d = d.restart();
        let mut x = d.xagent();
        x.hello(&connector);
        for cch in &channels {
            x.open(Some(cch));
        }
        let started = Instant::now();
        let want = N * channels.len();
        std::thread::scope(|scope| {
            // One webhook sender beside the catch-up, while xAgent takes every push.
            scope.spawn(|| post_load(&d, 1, N, &text, "load"));
            if let Bot::DingTalk(sim) = &bot {
                assert!(sim.wait_connected(Bot::DINGTALK_APP, 2, Duration::from_secs(30)));
                scope.spawn(post_all);
            }
            if let Bot::WeCom(sim) = &bot {
                // The binding's check, the first link, and the link after the restart.
                assert!(sim.wait_subscribes(Bot::WECOM_BOT, 3, Duration::from_secs(30)));
                scope.spawn(post_all);
            }
            for _ in 0..want {
                x.next_push(Duration::from_secs(60)).expect("every message is pushed");
            }
        });
        rows.push((kind, wakes, between, threads, started.elapsed(), hwm_kib(d.pid())));
    }
    println!(
        "{:<8} {:>16} {:>22} {:>13} {:>34} {:>12}",
        "bound",
        "wake-ups/s idle",
        "between keepalives",
        "idle threads",
        "1,000 webhook + catch-up pushed in",
        "VmHWM KiB"
    );
    for (kind, wakes, between, threads, took, hwm) in rows {
        println!(
            "{kind:<8} {wakes:>16.2} {between:>22.2} {threads:>13} {:>31.1} s {hwm:>12}",
            took.as_secs_f64()
        );
    }
}

/// Memory back to idle after a backlog: eight webhook channels fill a 4 MiB outbox with
/// messages of up to 60 KiB while xAgent is away, then xAgent comes back and takes them all.
/// Three such cycles; RSS printed fresh and idle, after each drain (at once and a minute
/// later) and at its peak.
#[test]
#[ignore = "budgets: cross/budgets.sh"]
fn idle_memory_after_backlogs_drain() {
    println!("binary under test: {}", bin());
    const CHANNELS: usize = 8;
    let dir = temp_dir("budget-drain");
    let mut extra =
        String::from("[queue]\nmax_messages_per_channel = 200\nmax_bytes_per_channel = 1MiB\nmax_bytes_total = 4MiB\n");
    for c in 1..CHANNELS {
        extra.push_str(&format!("[webhook.c{c}]\nsecret = {HOOK_SECRET}\n"));
    }
    let d = Daemon::start_logging(&dir, &config_text(free_port(), &dir, None, &extra), "warn");
    let names: Vec<String> = std::iter::once("alerts".to_string())
        .chain((1..CHANNELS).map(|c| format!("c{c}")))
        .collect();
    let mut x = d.xagent();
    x.hello("");
    let mut channels = Vec::new();
    for name in &names {
        let (cch, _) = x.open(None);
        x.bind_webhook(&cch, name, HOOK_SECRET);
        channels.push(cch);
    }
    let rss = || proc_field(d.pid(), "status", "VmRSS:");
    // Fresh and idle twice: as after the drains below, with xAgent connected (its socket's
    // buffers included), and with no one connected.
    std::thread::sleep(Duration::from_secs(5));
    let fresh_connected = rss();
    x.close();
    std::thread::sleep(Duration::from_secs(5));
    let fresh = rss();
    let mut after = Vec::new();
    for cycle in 0..3 {
        // About 3 MiB: 12 messages of 4 to 60 KiB on each channel.
        let mut accepted = 0;
        for (i, name) in names.iter().enumerate() {
            for m in 0..12 {
                let text = "m".repeat(4096 + ((i * 12 + m) * 8191) % (56 * 1024));
                let id = format!("c{cycle}-{name}-{m}");
                let (status, _) = d.post_hook(
                    name,
                    &serde_json::json!({"message_id": id, "sender_id": "u", "text": text}),
                );
                accepted += usize::from(status == 202);
            }
        }
        let mut x = d.xagent();
        x.hello("");
        for cch in &channels {
            x.open(Some(cch));
        }
        let mut pushed = std::collections::HashSet::new();
        let mut progress = Progress::new(QUIET);
        while pushed.len() < accepted {
            if let Some(p) = x.next_push(Duration::from_secs(1)) {
                pushed.insert(p["payload"]["message_id"].as_str().unwrap_or_default().to_string());
            }
            assert!(progress.moving(pushed.len()), "{} of {accepted} pushed", pushed.len());
        }
        // The last round's pong, then idle with xAgent still connected.
        x.recv_within(Duration::from_secs(2));
        let drained = rss();
        for _ in 0..60 {
            x.recv_within(Duration::from_secs(1));
        }
        after.push((accepted, drained, rss()));
        x.close();
    }
    let peak = proc_field(d.pid(), "status", "VmHWM:");
    // The same state in a new process: what idle costs with what the backlogs left (delivered
    // IDs kept for dedupe, a fuller file), without what the allocator kept.
    let mut d = d;
    d.signal("TERM");
    d.wait_exit(Duration::from_secs(10)).expect("exits after SIGTERM");
    let d = d.restart();
    std::thread::sleep(Duration::from_secs(5));
    let restarted = proc_field(d.pid(), "status", "VmRSS:");
    println!("fresh idle RSS: {fresh_connected} KiB with xAgent connected, {fresh} KiB with no one");
    for (i, (accepted, drained, later)) in after.iter().enumerate() {
        println!("backlog {i}: {accepted} messages; RSS at the drain {drained} KiB, a minute later {later} KiB");
    }
    println!("peak RSS: {peak} KiB");
    println!("idle RSS of a new process on the state the backlogs left: {restarted} KiB");
}
