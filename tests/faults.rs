//! Faults of the disk: the state dir fills up (ENOSPC) while webhooks arrive. Senders get 503,
//! the process stays up, nothing accepted is lost, and imgate recovers once space returns.
//! Needs root (it mounts a small tmpfs as the state dir), as CI and the dev machines have.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

/// A size-limited tmpfs, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(path: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(path).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(path)
            .status();
        assert!(ok.is_ok_and(|s| s.success()), "mounting a tmpfs needs root");
        Tmpfs(path.to_path_buf())
    }

    fn resize(&self, size: &str) {
        let ok = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.0)
            .status()
            .unwrap();
        assert!(ok.success());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn a_full_disk_answers_503_loses_nothing_and_recovers_when_space_returns() {
    let dir = temp_dir("enospc");
    let fs = Tmpfs::mount(&dir.join("state"), "3m");
    let queue = "[queue]\nmax_messages_per_channel = 1000000\nmax_bytes_per_channel = 1GiB\nmax_bytes_total = 1GiB\n";
    let d = Daemon::start_env(&dir, &config_text(free_port(), &dir, None, queue), "warn", &[]);
    let (x, cch) = d.bound_xagent();
    x.close();

    let text = "f".repeat(3000);
    let mut accepted = BTreeSet::new();
    let mut refused = None;
    for i in 0..5000 {
        let id = format!("m{i:05}");
        let (code, body) = d.post_hook("alerts", &json!({"message_id": id, "sender_id": "u", "text": text}));
        match code {
            202 => {
                accepted.insert(id);
            }
            503 => {
                refused = Some(body);
                break;
            }
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert_eq!(
        refused,
        Some(json!({"error": "storage_unavailable"})),
        "a full disk answers 503"
    );
    assert!(
        accepted.len() > 100,
        "{} accepted before the disk filled",
        accepted.len()
    );
    assert_eq!(
        http_get(&d.url("/connector-card.json"), &[]).0,
        200,
        "the process stays up"
    );

    fs.resize("64m");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut n = 0;
    loop {
        let id = format!("after{n}");
        n += 1;
        let (code, _) = d.post_hook("alerts", &json!({"message_id": id, "sender_id": "u"}));
        if code == 202 {
            accepted.insert(id);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "imgate never recovered after space came back:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(d.log().contains("database reopened"), "{}", d.log());

    // Every message that got a 202 is still there and is delivered.
    let mut y = d.xagent();
    y.hello("");
    y.open(Some(&cch));
    let mut pushed = BTreeSet::new();
    while pushed.len() < accepted.len() {
        match y.next_push(Duration::from_secs(10)) {
            Some(p) => {
                pushed.insert(p["payload"]["message_id"].as_str().unwrap().to_string());
            }
            None => break,
        }
    }
    let lost: Vec<_> = accepted.difference(&pushed).collect();
    assert!(lost.is_empty(), "accepted but never pushed: {lost:?}");
}
