//! Stamps the binary with its git revision and build time; the Card and /health report them.
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

#[path = "src/civil.rs"]
mod civil;

fn main() {
    let rev = Command::new("git")
        .args(["rev-parse", "--short=7", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string());
    // SOURCE_DATE_EPOCH keeps reproducible builds reproducible.
    let secs = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0)
        });
    println!("cargo:rustc-env=IMGATE_GIT_REV={rev}");
    let (y, m, d, hh, mm, _) = civil::civil(secs);
    // The protocol's form for the Card and /health, a person's for `--version`.
    println!(
        "cargo:rustc-env=IMGATE_BUILD_TIME={:02}{m:02}{d:02}{hh:02}{mm:02}",
        y % 100
    );
    println!("cargo:rustc-env=IMGATE_BUILT={y:04}-{m:02}-{d:02} {hh:02}:{mm:02}");
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs");
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
}
