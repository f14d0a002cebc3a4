//! What `imgate check` finds out beyond the file: whether the listen port can be bound and the
//! state dir written, by the user the service runs as. Run as root, `check` probes on a thread
//! running as the `imgate` user (the packages' service user) when there is one, since root can
//! write anywhere and bind any port and so would prove nothing.

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;

/// The user the packages run imgate as.
const SERVICE_USER: &str = "imgate";

/// Lines for `check`: the port and the state dir as the service user finds them.
pub fn report(listen: SocketAddr, state_dir: &Path) -> String {
    let root = rustix::process::geteuid().is_root();
    match root.then(|| service_user(&std::fs::read_to_string("/etc/passwd").unwrap_or_default())) {
        Some(Some((uid, gid))) => as_user(uid, gid, listen, state_dir),
        Some(None) => format!(
            "(as root: no `{SERVICE_USER}` user here to check as)\n{}",
            lines(listen, state_dir, "root")
        ),
        None => lines(listen, state_dir, "this user"),
    }
}

/// Probes on a thread of its own running as `uid`:`gid` with no supplementary groups, as the
/// service does. Linux keeps credentials per thread: the C library's `setuid` changes every
/// thread's, the system calls rustix makes change only the caller's, so the rest of `check`
/// stays root. (A copy of imgate started as the user would do the same, for about 35 KB more
/// of binary: std's process spawning.)
fn as_user(uid: u32, gid: u32, listen: SocketAddr, state_dir: &Path) -> String {
    use rustix::thread::{set_thread_groups, set_thread_res_gid, set_thread_res_uid, Gid, Uid};
    let state_dir = state_dir.to_path_buf();
    let probe = std::thread::spawn(move || {
        let (uid, gid) = (Uid::from_raw(uid), Gid::from_raw(gid));
        // The groups and the gid first: once the uid is not root's, they can no longer change.
        set_thread_groups(&[])
            .and_then(|()| set_thread_res_gid(gid, gid, gid))
            .and_then(|()| set_thread_res_uid(uid, uid, uid))
            .map(|()| lines(listen, &state_dir, SERVICE_USER))
    });
    match probe.join() {
        Ok(Ok(lines)) => lines,
        Ok(Err(e)) => format!("cannot check as {SERVICE_USER}: {e}\n"),
        Err(_) => format!("cannot check as {SERVICE_USER}\n"),
    }
}

/// The uid and gid of the service user in `passwd`'s text.
fn service_user(passwd: &str) -> Option<(u32, u32)> {
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        match f.as_slice() {
            // -1 is no id: to setresuid it means "leave it as it is", which would probe as root.
            [name, _, uid, gid, ..] if *name == SERVICE_USER => {
                Some((uid.parse().ok()?, gid.parse().ok()?)).filter(|&(u, g)| u != u32::MAX && g != u32::MAX)
            }
            _ => None,
        }
    })
}

/// What `who` finds binding `listen` and writing in `state_dir`.
fn lines(listen: SocketAddr, state_dir: &Path, who: &str) -> String {
    let port = match std::net::TcpListener::bind(listen) {
        Ok(_) => "free".to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            "in use (by the running imgate, or another program: `ss -ltnp` names it)".to_string()
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            format!("{who} may not bind it ({e}; a port below 1024 needs CAP_NET_BIND_SERVICE, or choose 8787)")
        }
        Err(e) => format!("cannot be bound: {e}"),
    };
    let dir = state_dir.display();
    let state = match std::fs::metadata(state_dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => format!(
            "does not exist yet (systemd's StateDirectory= and the init scripts make it; by hand: install -d -o {SERVICE_USER} -g {SERVICE_USER} -m 0700 {dir})"
        ),
        Err(e) => format!("cannot be reached by {who} ({e}): a directory on its path is closed to it"),
        Ok(_) => match write_probe(state_dir) {
            Ok(()) => format!("writable by {who}"),
            Err(e) => format!("not writable by {who} ({e}): chown -R {SERVICE_USER}:{SERVICE_USER} {dir}"),
        },
    };
    format!("listen {listen} as {who}: {port}\nstate_dir {dir}: {state}\n")
}

/// Creates, writes and removes a file in `dir`.
fn write_probe(dir: &Path) -> std::io::Result<()> {
    let path = dir.join(format!(".imgate-check-{}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .and_then(|mut f| f.write_all(b"imgate check\n"));
    let _ = std::fs::remove_file(&path);
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_service_user_is_read_from_passwd() {
        let passwd = "root:x:0:0:root:/root:/bin/sh\nimgatex:x:5:5::/:/bin/false\nimgate:x:999:998:imgate daemon:/var/lib/imgate:/usr/sbin/nologin\n";
        assert_eq!(service_user(passwd), Some((999, 998)));
        assert_eq!(service_user("imgate:x:nope:1::/:\n"), None);
        assert_eq!(service_user("imgate:x:4294967295:1::/:\n"), None);
        assert_eq!(service_user("imgate:x:1:4294967295::/:\n"), None);
        assert_eq!(service_user(""), None);
    }

    #[test]
    fn a_taken_port_and_a_missing_or_writable_dir_are_told_apart() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let dir = crate::scratch::scratch_dir("probe");
        let out = lines(addr, &dir, "me");
        assert!(out.contains(": in use (by the running imgate"), "{out}");
        assert!(out.contains("writable by me"), "{out}");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "the probe's file is gone");
        drop(taken);
        let out = lines(addr, &dir.join("later"), "me");
        assert!(
            out.contains(" as me: free") && out.contains("does not exist yet"),
            "{out}"
        );
    }
}
