//! The command line as the contract fixes it: check, init, --version, config errors.

use std::process::Command;
use std::time::Duration;

use crate::common::*;

fn imgate(args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .args(args)
        .env_remove("IMGATE_CONFIG")
        .env_remove("CREDENTIALS_DIRECTORY")
        .env_remove("STATE_DIRECTORY")
        .output()
        .unwrap()
}

#[test]
fn version_names_version_git_rev_and_build_time() {
    let out = imgate(&["--version"]);
    assert!(out.status.success());
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(
        line.starts_with(&format!("imgate {} (git ", env!("CARGO_PKG_VERSION"))),
        "{line}"
    );
    // A person's date and time, not the protocol's `YYMMDDHHMM` (that is the Card's).
    let built = line
        .split("built ")
        .nth(1)
        .and_then(|b| b.split(" UTC").next())
        .unwrap_or_default();
    let shape: String = built
        .chars()
        .map(|c| if c.is_ascii_digit() { '9' } else { c })
        .collect();
    assert_eq!(shape, "9999-99-99 99:99", "{line}");
    assert!(
        line.trim_end()
            .ends_with("; providers: webhook telegram feishu wechat slack discord dingtalk matrix wecom"),
        "the default build carries every provider: {line}"
    );
}

#[test]
fn check_prints_the_effective_policy_for_a_valid_file() {
    let dir = temp_dir("check-ok");
    let conf = dir.join("ok.conf");
    std::fs::write(
        &conf,
        "[queue]\nttl = 20m\ncleanup_interval = 1h\n[webhook.door]\nsecret = s\n",
    )
    .unwrap();
    let out = imgate(&["check", "--config", conf.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("queue ttl:         20m"), "{text}");
    assert!(text.contains("cleanup_interval:  10m"), "clamped to ttl/2: {text}");
    assert!(text.contains("webhook door"));
    assert!(text.contains("listen:            127.0.0.1:8787"));
    assert!(text.contains("profile:           xagent.im.v1"), "{text}");
    assert!(
        text.contains("state_dir:         ./imgate-data (from the default)"),
        "{text}"
    );

    // systemd's StateDirectory= wins over the config, and check says so.
    std::fs::write(&conf, "[server]\nstate_dir = /srv/imgate\n").unwrap();
    let out = Command::new(bin())
        .args(["check", "--config", conf.to_str().unwrap()])
        .env_remove("IMGATE_CONFIG")
        .env("STATE_DIRECTORY", "/var/lib/imgate")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(
            "state_dir:         /var/lib/imgate (from $STATE_DIRECTORY (systemd's StateDirectory=), \
             over /srv/imgate from the config, line 2)"
        ),
        "{text}"
    );
}

#[test]
fn check_states_the_memory_the_queue_caps_allow_and_warns_past_the_budget() {
    let dir = temp_dir("check-memory");
    let conf = dir.join("imgate.conf");
    let state = format!("[server]\nstate_dir = {}\n", dir.join("state").display());
    std::fs::write(&conf, &state).unwrap();
    let out = imgate(&["check", "--config", conf.to_str().unwrap()]);
    let (text, errors) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        text.contains("memory:            up to 14.6 MiB at the caps (budget 16.0 MiB)"),
        "{text}"
    );
    assert!(!errors.contains("memory"), "the defaults keep within it: {errors}");

    std::fs::write(
        &conf,
        format!("{state}[queue]\nmax_bytes_total = 200MiB\nmax_bytes_per_channel = 200MiB\n"),
    )
    .unwrap();
    let out = imgate(&["check", "--config", conf.to_str().unwrap()]);
    assert!(out.status.success(), "a warning, not an error");
    let errors = String::from_utf8_lossy(&out.stderr);
    assert!(
        errors.contains("imgate: warning: [queue] max_bytes_total lets a backlog of small messages take 23.2 MiB of memory, past the 16.0 MiB budget; 86MiB or less keeps within it"),
        "{errors}"
    );
}

#[test]
fn check_reports_every_bad_line_as_file_line_message_and_exits_2() {
    let dir = temp_dir("check-bad");
    let conf = dir.join("bad.conf");
    std::fs::write(
        &conf,
        "[server]\nlisten = somewhere\nmax_body = huge\n[queue]\noverflow = explode\ncolour = blue\n[nope]\n[webhook.x]\nlabel = X\n",
    )
    .unwrap();
    let out = imgate(&["check", "--config", conf.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    let name = conf.display().to_string();
    for line in [2, 3, 5, 6, 7, 8] {
        assert!(
            err.contains(&format!("{name}:{line}: ")),
            "line {line} missing in:\n{err}"
        );
    }
    assert!(err.contains("unknown key `colour`"));
    assert!(err.contains("needs `secret`"));
}

#[test]
fn a_missing_secret_file_is_an_error_naming_the_key() {
    let dir = temp_dir("check-file");
    let conf = dir.join("f.conf");
    std::fs::write(&conf, "[server]\napi_key_file = /nonexistent/imgate-key\n").unwrap();
    let out = imgate(&["check", "--config", conf.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("{}:2: api_key_file", conf.display())), "{err}");
}

#[test]
fn secret_file_bare_name_comes_from_the_credentials_directory() {
    let dir = temp_dir("cred");
    std::fs::write(dir.join("imgate-api-key"), "from-credentials\n").unwrap();
    let conf = dir.join("c.conf");
    std::fs::write(&conf, "[server]\napi_key_file = imgate-api-key\n").unwrap();
    let out = Command::new(bin())
        .args(["check", "--config", conf.to_str().unwrap()])
        .env("CREDENTIALS_DIRECTORY", &dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("api_key:           set"));
    assert!(!text.contains("from-credentials"), "check never prints a secret");
}

#[test]
fn init_writes_the_shipped_config_with_a_fresh_key_for_its_owner_alone_and_never_overwrites() {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("init");
    let target = dir.join("imgate.conf");
    let out = imgate(&["init", target.to_str().unwrap()]);
    assert!(out.status.success());
    let mode = std::fs::metadata(&target).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the config holds secrets");
    let written = std::fs::read_to_string(&target).unwrap();
    let shipped = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/systemd/imgate.conf")).unwrap();
    let key_line = written.lines().find(|l| l.starts_with("api_key = ")).unwrap();
    let key = key_line.trim_start_matches("api_key = ");
    assert!(
        key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit()),
        "{key_line}"
    );
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains(key),
        "the key is not printed"
    );
    assert_eq!(
        written.replace(key_line, "api_key ="),
        shipped,
        "systemd/imgate.conf is what init writes, with a key"
    );
    let other = dir.join("other.conf");
    assert!(imgate(&["init", other.to_str().unwrap()]).status.success());
    assert!(
        !std::fs::read_to_string(&other).unwrap().contains(key),
        "every config gets its own key"
    );
    let again = imgate(&["init", target.to_str().unwrap()]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
    let stdout = imgate(&["init", "-"]);
    assert_eq!(String::from_utf8_lossy(&stdout.stdout), shipped);
    // An option is not a file name: no config named `--help` appears where it was asked.
    let help = imgate(&["init", "--help"]);
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).contains("imgate init [FILE|-]"));
    let unknown = imgate(&["init", "--force"]);
    assert_eq!(unknown.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("unknown option --force"));
    assert!(!std::path::Path::new("--help").exists() && !std::path::Path::new("--force").exists());
    // The written config is valid, also once it listens on the LAN: it has a key.
    std::fs::write(
        &target,
        written.replace("listen = 127.0.0.1:8787", "listen = 0.0.0.0:8787"),
    )
    .unwrap();
    let check = imgate(&["check", "--config", target.to_str().unwrap()]);
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
}

#[test]
fn a_port_other_machines_reach_without_an_api_key_is_refused_unless_allowed_explicitly() {
    let dir = temp_dir("open-port");
    let conf = dir.join("open.conf");
    let check = |text: &str| {
        std::fs::write(&conf, text).unwrap();
        imgate(&["check", "--config", conf.to_str().unwrap()])
    };
    let name = conf.display().to_string();
    for (text, line) in [
        (
            "[server]
listen = 0.0.0.0:8787
",
            2,
        ),
        (
            "[server]
listen = [::]:8787
",
            2,
        ),
        (
            "[server]
listen = 192.168.1.20:8787
",
            2,
        ),
        (
            "[server]
api_key =
public_url = https://pi.example.net/imgate
",
            3,
        ),
    ] {
        let out = check(text);
        assert_eq!(out.status.code(), Some(2), "{text}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("{name}:{line}: ")), "{text}: {err}");
        assert!(
            err.contains("no api_key") && err.contains("allow_unauthenticated"),
            "{err}"
        );
    }
    for text in [
        "[server]
listen = 127.0.0.1:8787
",
        "[server]
listen = [::1]:8787
public_url = http://localhost:8787
",
        "[server]
listen = 0.0.0.0:8787
api_key = k
",
        "[server]
listen = 0.0.0.0:8787
allow_unauthenticated = true
",
    ] {
        let out = check(text);
        assert!(out.status.success(), "{text}: {}", String::from_utf8_lossy(&out.stderr));
    }
    // Allowed on purpose: it runs, and says so at every start.
    // (a public_url on another host makes the port reachable, as a non-loopback listen does)
    let open_dir = dir.join("allowed");
    std::fs::create_dir_all(&open_dir).unwrap();
    let allowed = config_text(free_port(), &open_dir, None, "")
        .replace(
            "log_level = debug",
            "log_level = debug\npublic_url = https://pi.example.net",
        )
        .replace(&format!("api_key = {API_KEY}\n"), "allow_unauthenticated = true\n");
    let d = Daemon::start(&open_dir, &allowed);
    let warning = "no api_key on a port other machines reach (allow_unauthenticated = true)";
    assert!(d.log_shows(warning, Duration::from_secs(5)), "{}", d.log());
    let d = d.restart();
    wait_until("the second start warns too", || d.log().matches(warning).count() == 2);
    drop(d);
    // `run` reads the config the same way: it exits 2 before it binds anything.
    let port = free_port();
    std::fs::write(
        &conf,
        format!(
            "[server]
listen = 0.0.0.0:{port}
state_dir = {}
",
            dir.join("s").display()
        ),
    )
    .unwrap();
    let out = imgate(&["run", "--config", conf.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("{name}:2: ")));
    assert!(!dir.join("s").exists(), "nothing was started");
}

#[test]
fn no_config_file_means_embedded_defaults() {
    let dir = temp_dir("defaults");
    let out = Command::new(bin())
        .arg("check")
        .current_dir(&dir)
        .env_remove("IMGATE_CONFIG")
        .output()
        .unwrap();
    // /etc/imgate/imgate.conf may exist on a developer box; only assert when it does not.
    if !std::path::Path::new("/etc/imgate/imgate.conf").exists() {
        assert!(out.status.success());
        assert!(String::from_utf8_lossy(&out.stdout).contains("<embedded defaults>"));
    }
}

#[test]
fn unknown_commands_and_arguments_exit_2_with_usage() {
    let out = imgate(&["frobnicate"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("usage:"));
    let out = imgate(&["check", "--config"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_database_written_by_a_newer_imgate_is_refused_with_a_clear_message() {
    let dir = temp_dir("format");
    let state = dir.join("state");
    // The file as a newer imgate would leave it: its `meta` table names a later format.
    std::fs::create_dir_all(&state).unwrap();
    let db = redb::Database::create(state.join("imgate.redb")).unwrap();
    let txn = db.begin_write().unwrap();
    {
        let meta: redb::TableDefinition<&str, &str> = redb::TableDefinition::new("meta");
        txn.open_table(meta).unwrap().insert("format_version", "999").unwrap();
    }
    txn.commit().unwrap();
    drop(db);
    let conf = dir.join("imgate.conf");
    let text = format!(
        "[server]\nlisten = 127.0.0.1:{}\nstate_dir = {}\n",
        free_port(),
        state.display()
    );
    std::fs::write(&conf, text).unwrap();
    let out = imgate(&["run", "--config", conf.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "refused at start");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("format_version 999") && err.contains("newer imgate"),
        "{err}"
    );
}

/// `check` says whether the port can be bound and the state dir written (as the `imgate` user
/// when run as root and there is one: `cross/package-test.sh` checks that on an installed
/// package).
#[test]
fn check_says_whether_the_port_is_free_and_the_state_dir_writable() {
    let dir = temp_dir("probe");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let conf = dir.join("probe.conf");
    std::fs::write(&conf, config_text(port, &dir, None, "")).unwrap();
    let check = || {
        let out = imgate(&["check", "--config", conf.to_str().unwrap()]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let out = check();
    assert!(out.contains(&format!("listen 127.0.0.1:{port} as ")), "{out}");
    assert!(
        out.contains(": in use (by the running imgate, or another program"),
        "{out}"
    );
    assert!(
        out.contains("state_dir ") && out.contains("/state: does not exist yet"),
        "{out}"
    );
    drop(taken);
    std::fs::create_dir_all(dir.join("state")).unwrap();
    let out = check();
    assert!(
        out.contains(": free\n") && out.contains("/state: writable by "),
        "{out}"
    );
}
