//! Test-only disks: an ext4 image on a loop device as the state dir, so a test can fail it as
//! the kernel fails an SD card, or count exactly what was written to it (the journal included)
//! with no other process's writes mixed in. Needs root.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// An ext4 image on a loop device, mounted with `errors=remount-ro` (what Debian's installer
/// writes into fstab); unmounted and detached when dropped.
pub struct Ext4 {
    dev: String,
    mnt: PathBuf,
}

pub fn run(cmd: &str, args: &[&str]) -> std::process::Output {
    Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"))
}

impl Ext4 {
    pub fn mount(image: &Path, mnt: &Path) -> Ext4 {
        std::fs::write(image, b"").unwrap();
        let image = image.to_str().unwrap();
        // Sparse, so only what is written takes space; large enough that imgate's default caps
        // fit it whole (a small state file system gets smaller caps and log files, `fit.rs`).
        assert!(run("truncate", &["-s", "1G", image]).status.success());
        let mkfs = run("mkfs.ext4", &["-q", "-F", "-b", "4096", image]);
        assert!(mkfs.status.success(), "mkfs.ext4: {mkfs:?}");
        let losetup = run("losetup", &["-f", "--show", image]);
        assert!(losetup.status.success(), "a loop device needs root: {losetup:?}");
        let dev = String::from_utf8(losetup.stdout).unwrap().trim().to_string();
        std::fs::create_dir_all(mnt).unwrap();
        let fs = Ext4 {
            dev,
            mnt: mnt.to_path_buf(),
        };
        fs.mount_again();
        fs
    }

    pub fn mount_again(&self) {
        let m = run(
            "mount",
            &["-o", "errors=remount-ro", &self.dev, self.mnt.to_str().unwrap()],
        );
        assert!(m.status.success(), "mount: {m:?}");
    }

    pub fn mnt(&self) -> &Path {
        &self.mnt
    }

    /// Bytes the file system has written to its device since it was mounted (data, metadata
    /// and journal: what an SD card would have been asked to write).
    pub fn device_written(&self) -> u64 {
        let name = self.dev.trim_start_matches("/dev/");
        let stat = std::fs::read_to_string(format!("/sys/block/{name}/stat")).unwrap_or_default();
        // Field 7: sectors written, in 512-byte units whatever the device's sector size.
        stat.split_whitespace()
            .nth(6)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 512
    }

    /// What the kernel does when ext4 meets an error: abort the journal and remount read-only.
    pub fn fail(&self) {
        let name = self.dev.trim_start_matches("/dev/");
        std::fs::write(format!("/sys/fs/ext4/{name}/trigger_fs_error"), "imgate fault test\n").unwrap();
    }

    /// What an operator does: unmount (once imgate has let go of the file), fsck, mount again.
    pub fn repair(&self, pid: u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let umount = run("umount", &[self.mnt.to_str().unwrap()]);
            if umount.status.success() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "cannot unmount the read-only disk: {umount:?}; imgate holds {:?}",
                self.open_by(pid)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        let fsck = run("e2fsck", &["-fy", &self.dev]);
        assert!(
            fsck.status.code().is_some_and(|c| c < 4),
            "e2fsck could not repair: {fsck:?}"
        );
        self.mount_again();
    }

    /// The files under the mount point that process `pid` holds open.
    pub fn open_by(&self, pid: u32) -> Vec<PathBuf> {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|p| p.starts_with(&self.mnt))
            .collect()
    }
}

impl Drop for Ext4 {
    fn drop(&mut self) {
        let _ = run("umount", &["-l", self.mnt.to_str().unwrap()]);
        let _ = run("losetup", &["-d", &self.dev]);
    }
}
