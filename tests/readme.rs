//! The README's commands, taken from README.md itself and run as a newcomer with a source tree
//! runs them: the key one-liner, `imgate init`, the edit (the README's own endpoint section),
//! `check`, `run`, the `curl` a sender runs (its answer as the README prints it), `status` and
//! `--version`, and the README's config blocks through `check`. What only an installed package
//! can run (`apt install`, `cat /etc/imgate/api_key`, `check` on `/etc/imgate/imgate.conf`) is
//! run by `cross/package-test.sh`; `systemctl`, `journalctl` and `opkg` are not on the CI machine.
//! Only the port changes: 8787 may be taken where tests run.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, Output};

use crate::common::*;

fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap()
}

/// The fenced blocks of `lang`, in order.
fn blocks(text: &str, lang: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut open: Option<String> = None;
    for line in text.lines() {
        match (&mut open, line.trim_start().strip_prefix("```")) {
            (None, Some(l)) if l == lang => open = Some(String::new()),
            (Some(b), Some(_)) => {
                out.push(std::mem::take(b));
                open = None;
            }
            (Some(b), None) => {
                b.push_str(line);
                b.push('\n');
            }
            _ => {}
        }
    }
    out
}

/// The one `sh` block holding `marker`, its continuation lines joined.
fn sh_block(md: &str, marker: &str) -> String {
    let found: Vec<String> = blocks(md, "sh").into_iter().filter(|b| b.contains(marker)).collect();
    assert_eq!(found.len(), 1, "README: one sh block with `{marker}`");
    found[0].replace("\\\n", " ")
}

/// A line of a block without its trailing comment (`#` after whitespace).
fn command(line: &str) -> &str {
    line.split(" #").next().unwrap_or(line).trim()
}

fn sh(cmd: &str, dir: &Path) -> Output {
    let out = Command::new("sh").arg("-c").arg(cmd).current_dir(dir).output().unwrap();
    assert!(
        out.status.success(),
        "`{cmd}`: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs an `imgate …` line of the README with the binary under test.
fn imgate(line: &str, dir: &Path) -> Output {
    let args: Vec<&str> = line.split_whitespace().skip(1).collect();
    let out = Command::new(bin()).args(&args).current_dir(dir).output().unwrap();
    assert!(
        out.status.success(),
        "`{line}`: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_first_start_runs_as_the_readme_gives_it() {
    let md = readme();
    let dir = temp_dir("readme");
    let port = free_port().to_string();

    // The key in a file of its own, made by the README's one-liner (in this test's dir).
    let one_liner = md
        .split('`')
        .find(|s| s.contains("/dev/urandom"))
        .expect("README: the key one-liner")
        .replace("/etc/imgate/api_key", "api_key");
    sh(&one_liner, &dir);
    let key = std::fs::read_to_string(dir.join("api_key")).unwrap();
    assert!(key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit()), "{key:?}");
    let mode = std::fs::metadata(dir.join("api_key")).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);

    // init, the edit (the README's endpoint section), check, run.
    let first = sh_block(&md, "imgate init imgate.conf");
    let ini = blocks(&md, "ini");
    let minimal = ini
        .iter()
        .find(|b| b.contains("[webhook.alerts]"))
        .expect("README: the minimal config");
    let endpoint = &minimal[minimal.find("[webhook.alerts]").unwrap()..];
    let mut daemon = None;
    for line in first.lines().map(command).filter(|l| !l.is_empty()) {
        if line.starts_with("$EDITOR") {
            let conf = dir.join("imgate.conf");
            let text = std::fs::read_to_string(&conf).unwrap().replace("8787", &port);
            std::fs::write(&conf, format!("{text}\n{endpoint}")).unwrap();
        } else if line.starts_with("imgate run") {
            let args: Vec<&str> = line.split_whitespace().skip(1).collect();
            let log = std::fs::File::create(dir.join("run.log")).unwrap();
            let child = Command::new(bin())
                .args(&args)
                .current_dir(&dir)
                .stderr(log)
                .spawn()
                .unwrap();
            daemon = Some(Running(child));
        } else {
            let out = imgate(line, &dir);
            if line.starts_with("imgate init") {
                let mode = std::fs::metadata(dir.join("imgate.conf")).unwrap().permissions().mode();
                assert_eq!(mode & 0o777, 0o600, "init writes 0600");
            }
            if line.starts_with("imgate check") {
                assert!(String::from_utf8_lossy(&out.stdout).contains("config is valid"));
            }
        }
    }
    let _daemon = daemon.expect("README: `imgate run` in the first start");
    let base = format!("http://127.0.0.1:{port}");
    let addr = format!("127.0.0.1:{port}");
    wait_until("imgate listens", || std::net::TcpStream::connect(&addr).is_ok());
    assert_eq!(http_get(&format!("{base}/connector-card.json"), &[]).0, 200);

    // A sender's curl, and the answer the README shows.
    let curl = sh_block(&md, "/hooks/alerts");
    let (cmd, answer) = curl.split_once("\n#").expect("README: curl and its answer");
    let out = sh(&cmd.replace("127.0.0.1:8787", &format!("127.0.0.1:{port}")), &dir);
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let shown: serde_json::Value = serde_json::from_str(answer.trim()).unwrap();
    assert_eq!(got, shown);

    // status, from the README's sentence, and the version.
    let status = md
        .split('`')
        .find(|s| s.starts_with("imgate status --config imgate.conf"))
        .expect("README: imgate status");
    let out = imgate(status, &dir);
    assert!(String::from_utf8_lossy(&out.stdout).contains("(unbound)"));
    let out = imgate("imgate --version", &dir);
    assert!(String::from_utf8_lossy(&out.stdout).contains("webhook"));
}

#[test]
fn the_readme_config_blocks_pass_check() {
    let md = readme();
    let dir = temp_dir("readme-ini");
    std::fs::write(dir.join("api_key"), "k".repeat(32)).unwrap();
    let ini = blocks(&md, "ini");
    assert!(ini.len() >= 2, "the minimal config and the Telegram section");
    // The minimal config alone, then with each section the README adds to it.
    let minimal = ini[0].replace("/etc/imgate/api_key", "api_key");
    for (i, block) in ini.iter().enumerate() {
        let text = match i {
            0 => minimal.clone(),
            _ => format!("{minimal}\n{block}"),
        };
        std::fs::write(dir.join("c.conf"), &text).unwrap();
        let out = imgate("imgate check --config c.conf", &dir);
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("config is valid"),
            "{text}"
        );
    }
}
