//! What an installed device shows beyond the wire basics: its own card ID in a fleet, a warning
//! when its state would not survive a reboot, and the init scripts the packages install, run
//! under stand-ins for OpenWrt's procd and Alpine's OpenRC.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use crate::common::*;

const KITCHEN: &str = "im.imgate.kitchen";

#[test]
fn card_id_names_the_card_health_hello_ack_skill_and_every_push() {
    let dir = temp_dir("card-id");
    let conf = config_text(free_port(), &dir, None, "")
        .replace("log_level = debug", &format!("log_level = debug\ncard_id = {KITCHEN}"));
    let d = Daemon::start(&dir, &conf);

    let card = get_json(&d.url("/connector-card.json"));
    assert_card(&card);
    assert_eq!(card["connector_card_id"], KITCHEN);
    for t in card["tools"].as_array().unwrap() {
        assert_eq!(t["related_skill_ids"], json!(["connector-im-imgate-kitchen"]), "{t}");
    }
    let (status, health) = http_get(&d.url("/health"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
    assert_eq!(status, 200);
    let health: Value = serde_json::from_str(&health).unwrap();
    assert_eq!(health["connector_card_id"], KITCHEN);
    let (_, skill) = http_get(&d.url("/skill.md"), &[]);
    assert!(skill.starts_with("---\nname: connector-im-imgate-kitchen\n"), "{skill}");

    // An xAgent that knows this board as the default card is refused by name.
    let mut x = d.xagent();
    let wrong = x.request(
        "connector.hello",
        None,
        json!({"connector_card_id": "im.imgate", "protocol_version": "3.0", "supported_profiles": ["xagent.im.v1"]}),
    );
    assert_eq!(wrong["error"]["code"], "connector_card_id_mismatch", "{wrong}");
    assert!(wrong["error"]["message"].as_str().unwrap().contains(KITCHEN), "{wrong}");

    let ack = x.hello_to(KITCHEN, "");
    assert_packet(&ack);
    assert_eq!(ack["payload"]["connector_card_id"], KITCHEN);
    let (cch, _) = x.open(None);
    let bound = x.bind_webhook(&cch, "alerts", HOOK_SECRET);
    assert_eq!(bound["payload"]["status"], "authenticated", "{bound}");
    let desc = &bound["payload"]["connection_descriptor"];
    assert_descriptor(desc);
    assert_eq!(desc["connection"]["connector_card_id"], KITCHEN, "{bound}");
    let (status, _) = d.post_hook("alerts", &json!({"message_id": "k-1", "sender_id": "u", "text": "hi"}));
    assert_eq!(status, 202);
    let push = x.next_push(Duration::from_secs(10)).expect("the message is pushed");
    assert_eq!(
        push["payload"]["skill"]["skill_id"], "connector-im-imgate-kitchen",
        "{push}"
    );
}

#[test]
fn a_bad_card_id_is_refused_with_its_file_and_line() {
    let dir = temp_dir("card-id-bad");
    let conf = dir.join("imgate.conf");
    std::fs::write(&conf, "[server]\nlisten = 127.0.0.1:1\ncard_id = Kitchen Pi\n").unwrap();
    for cmd in ["check", "run"] {
        let out = Command::new(bin())
            .args([cmd, "--config", conf.to_str().unwrap()])
            .env_remove("STATE_DIRECTORY")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{cmd}: {err}");
        assert!(
            err.contains(&format!("{}:3: card_id: `Kitchen Pi` may only hold", conf.display())),
            "{cmd}: {err}"
        );
    }
}

/// A tmpfs this test can use: `/dev/shm` on Linux, checked rather than assumed.
fn tmpfs_dir(tag: &str) -> std::path::PathBuf {
    let out = Command::new("stat")
        .args(["-f", "-c", "%T", "/dev/shm"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "tmpfs",
        "/dev/shm is a tmpfs here"
    );
    let dir = Path::new("/dev/shm").join(format!("imgate-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_state_dir_on_tmpfs_is_warned_about_by_check_and_at_start() {
    const WARNING: &str = "is on tmpfs: accepted messages do not survive a reboot";
    let ram = tmpfs_dir("volatile");
    let disk = temp_dir("durable");
    for (dir, warned) in [(&ram, true), (&disk, false)] {
        // The state dir itself does not exist yet: its nearest existing parent decides.
        let conf = config_text(free_port(), dir, None, "");
        let path = dir.join("imgate.conf");
        std::fs::write(&path, &conf).unwrap();
        let out = Command::new(bin())
            .args(["check", "--config", path.to_str().unwrap()])
            .env_remove("STATE_DIRECTORY")
            .output()
            .unwrap();
        assert!(out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.contains(WARNING), warned, "check, {}: {err}", dir.display());

        // The warning comes before the listener's line: once that is in, the log is complete.
        let d = Daemon::start(dir, &conf);
        assert!(d.log_shows("listening on", Duration::from_secs(10)), "{}", d.log());
        assert_eq!(
            d.log().contains(WARNING),
            warned,
            "start log, {}: {}",
            dir.display(),
            d.log()
        );
    }
    let _ = std::fs::remove_dir_all(&ram);
}

/// Runs `script` (an init script's text) with `sh` after `prelude`, then `then`; returns what the
/// stand-ins recorded, a line per call with each argument in brackets.
fn run_init_script(tag: &str, script: &str, prelude: &str, then: &str) -> String {
    let dir = temp_dir(tag);
    let record = dir.join("calls");
    let path = dir.join("init");
    std::fs::write(&path, script).unwrap();
    let driver = format!(
        "set -e\nrecord() {{ printf '%s' \"$1\" >> '{rec}'; shift; if [ $# -gt 0 ]; then printf ' [%s]' \"$@\" >> '{rec}'; fi; echo >> '{rec}'; }}\n\
         {prelude}\n. '{init}'\n{then}\n",
        rec = record.display(),
        init = path.display(),
    );
    let out = Command::new("sh").arg("-c").arg(&driver).output().unwrap();
    assert!(
        out.status.success(),
        "{tag}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(&record).unwrap_or_default()
}

#[test]
fn the_openwrt_init_script_checks_the_config_then_asks_procd_for_a_respawned_unprivileged_logged_instance() {
    let dir = temp_dir("procd-conf");
    let conf = dir.join("imgate.conf");
    std::fs::write(
        &conf,
        format!("[server]\nstate_dir = /srv/imgate  # on flash\nlisten = 0.0.0.0:8787\napi_key = {API_KEY}\n"),
    )
    .unwrap();
    let keep = dir.join("keep.d-imgate");
    let script = |conf: &std::path::Path| {
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/openwrt/imgate.init"))
            .unwrap()
            .replace("/etc/imgate/imgate.conf", conf.to_str().unwrap())
            .replace("/lib/upgrade/keep.d/imgate", keep.to_str().unwrap())
    };
    // procd.sh's functions, logd's logger and the commands that would touch the real /srv,
    // recorded instead; the binary under test stands in for /usr/bin/imgate.
    let stand_in = "procd_open_instance() { record procd_open_instance \"$@\"; }\n\
                    procd_set_param() { record procd_set_param \"$@\"; }\n\
                    procd_close_instance() { record procd_close_instance \"$@\"; }\n\
                    logger() { record logger \"$@\"; while read -r l; do record line \"$l\"; done; }\n\
                    mkdir() { record mkdir \"$@\"; }\nchown() { record chown \"$@\"; }\nchmod() { record chmod \"$@\"; }";
    let then = format!(
        "PROG='{}'\nrecord globals \"$START\" \"$STOP\" \"$USE_PROCD\"\nstart_service",
        bin()
    );
    let calls = run_init_script("procd", &script(&conf), stand_in, &then);
    // A warning of `check` (a state dir on a RAM file system, as some machines' / is) goes to
    // logd as a warning; nothing else is logged.
    assert!(!calls.contains("daemon.err"), "{calls}");
    let calls: String = calls
        .lines()
        .filter(|l| !l.starts_with("logger [-t] [imgate] [-p] [daemon.warn]") && !l.starts_with("line ["))
        .map(|l| format!("{l}\n"))
        .collect();
    let (c, b) = (conf.display(), bin());
    let want = format!(
        "globals [95] [10] [1]\n\
         mkdir [-p] [/srv/imgate]\n\
         chown [imgate:imgate] [/srv/imgate]\n\
         chmod [0700] [/srv/imgate]\n\
         procd_open_instance\n\
         procd_set_param [command] [{b}] [run] [--config] [{c}]\n\
         procd_set_param [user] [imgate]\n\
         procd_set_param [group] [imgate]\n\
         procd_set_param [file] [{c}]\n\
         procd_set_param [respawn] [3600] [5] [0]\n\
         procd_set_param [env] [IMGATE_LOG_FORMAT=syslog]\n\
         procd_set_param [stdout] [1]\n\
         procd_set_param [stderr] [1]\n\
         procd_set_param [limits] [nofile=4096 4096]\n\
         procd_set_param [term_timeout] [10]\n\
         procd_close_instance\n"
    );
    assert_eq!(calls, want);
    // sysupgrade keeps the config, the key and the state dir the config names.
    assert_eq!(std::fs::read_to_string(&keep).unwrap(), "/etc/imgate/\n/srv/imgate/\n");

    // A config error: logged at daemon.err with its line, and no instance for procd to respawn.
    let bad = dir.join("bad.conf");
    std::fs::write(&bad, "[server]\nlisten = nowhere\n").unwrap();
    let then = format!(
        "PROG='{}'\nif start_service; then record started; else record refused; fi",
        bin()
    );
    let calls = run_init_script("procd-bad", &script(&bad), stand_in, &then);
    assert!(
        calls.starts_with("logger [-t] [imgate] [-p] [daemon.err]\nline ["),
        "{calls}"
    );
    assert!(calls.contains("bad.conf:2: listen: `nowhere`"), "{calls}");
    assert!(
        calls.ends_with("refused\n") && !calls.contains("procd_open_instance"),
        "{calls}"
    );
}

#[test]
fn the_openrc_script_supervises_imgate_as_its_user_and_checks_the_config_first() {
    let dir = temp_dir("openrc");
    let good = dir.join("good.conf");
    std::fs::write(&good, "[server]\nlisten = 127.0.0.1:8787\n").unwrap();
    let bad = dir.join("bad.conf");
    std::fs::write(&bad, "[server]\nlisten = nowhere\n").unwrap();
    let script =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/alpine/imgate.initd")).unwrap();
    let stand_in = format!(
        "IMGATE_CONFIG='{}'\ncheckpath() {{ record checkpath \"$@\"; }}\n\
         need() {{ record need \"$@\"; }}\nuse() {{ record use \"$@\"; }}\nafter() {{ record after \"$@\"; }}",
        good.display()
    );
    // The installed binary is /usr/bin/imgate; the one under test stands in for it.
    let then = format!(
        "record vars \"$supervisor\" \"$command\" \"$command_args\" \"$command_user\" \"$supervise_daemon_args\" \"$respawn_max\" \"$rc_ulimit\"\n\
         depend\ncommand='{}'\nstart_pre\nrecord checked",
        bin()
    );
    let calls = run_init_script("openrc", &script, &stand_in, &then);
    let want = format!(
        "vars [supervise-daemon] [/usr/bin/imgate] [run --config {}] [imgate:imgate] [--env STATE_DIRECTORY=/var/lib/imgate --env IMGATE_LOG_FORMAT=syslog] [0] [-n 4096]\n\
         need [net]\nuse [logger]\nafter [firewall]\n\
         checkpath [--directory] [--owner] [imgate:imgate] [--mode] [0700] [/var/lib/imgate]\n\
         checked\n",
        good.display()
    );
    assert_eq!(calls, want);

    // A bad config stops start_pre with the config's own error instead of a respawn loop.
    let driver = format!(
        "checkpath() {{ :; }}\nIMGATE_CONFIG='{}'\n. '{}'\ncommand='{}'\nstart_pre",
        bad.display(),
        concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/alpine/imgate.initd"),
        bin()
    );
    let out = Command::new("sh").arg("-c").arg(&driver).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("bad.conf:2: listen: `nowhere`"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
