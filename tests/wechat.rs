//! The WeChat provider against the iLink simulator (`common/ilink.rs`): the QR login through
//! the data plane's auth machine (a PNG code, scanned, confirmed; refresh; a verification
//! code it cannot take), receiving with the sync buffer kept across restarts, replies in the
//! user's context, an ended login, and a bot token that never leaves imgate.

use std::time::Duration;

use crate::common::ilink::{Ilink, BOT_ID, BOT_TOKEN, USER};
use crate::common::*;
use serde_json::{json, Value};

fn wechat(tag: &str) -> (Daemon, Ilink, std::path::PathBuf) {
    wechat_env(tag, &[])
}

/// Logs at debug: no secret may show even there.
fn wechat_env(tag: &str, env: &[(&str, &str)]) -> (Daemon, Ilink, std::path::PathBuf) {
    let api = Ilink::start();
    let dir = temp_dir(tag);
    let conf = format!("[wechat]\napi_base = {}\ncdn_base = {}/c2c\n", api.base, api.base);
    let config = config_text(free_port(), &dir, None, &conf);
    (Daemon::start_env(&dir, &config, "debug", env), api, dir)
}

fn start_login(x: &mut Sim, cch: &str) -> Value {
    x.request("auth.start", Some(cch), json!({"flow_id": "wechat_qr_login"}))
}

fn status(x: &mut Sim, cch: &str, auth_id: &str, refresh: bool) -> Value {
    x.request(
        "auth.status",
        Some(cch),
        json!({"flow_id": "wechat_qr_login", "auth_session_id": auth_id, "refresh": refresh}),
    )
}

/// A channel signed in to the simulator's bot.
fn signed_in(d: &Daemon, api: &Ilink) -> (Sim, String) {
    api.script_next_code(vec![Ilink::confirmed()]);
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let start = start_login(&mut x, &cch);
    let id = start["payload"]["auth_session_id"].as_str().unwrap().to_string();
    let done = status(&mut x, &cch, &id, false);
    assert_eq!(done["payload"]["status"], "authenticated", "{done}");
    (x, cch)
}

#[test]
fn a_qr_login_shows_a_png_code_binds_on_confirmation_and_the_user_talks_to_the_agent() {
    let (d, api, dir) = wechat("wx-login");
    let (_, card) = http_get(&d.url("/connector-card.json"), &[]);
    let card: Value = serde_json::from_str(&card).unwrap();
    assert_card(&card);
    let flow = card["auth_flows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == "wechat_qr_login")
        .cloned()
        .expect("the flow is in the Card");
    assert_eq!(flow["type"], "qr_login");

    api.script_next_code(vec![
        json!({"status": "wait"}),
        json!({"status": "scaned"}),
        Ilink::confirmed(),
    ]);
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let start = start_login(&mut x, &cch);
    assert_packet(&start);
    let p = &start["payload"];
    assert_eq!(p["status"], "pending", "{start}");
    assert!(p["qr_code_text"].as_str().unwrap().contains("qrcode=qr0"), "{p}");
    let image = p["qr_code_image"].as_str().unwrap();
    let png = crate::common::kit::base64_decode(image.strip_prefix("data:image/png;base64,").unwrap());
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "a PNG drawn on the device");
    assert!(p["expires_at"].as_u64().unwrap() > 0);
    assert_eq!(p["poll_interval_millis"], 2000);
    let id = p["auth_session_id"].as_str().unwrap().to_string();

    assert_eq!(status(&mut x, &cch, &id, false)["payload"]["status"], "pending");
    let scanned = status(&mut x, &cch, &id, false);
    assert_eq!(scanned["payload"]["status"], "scanned");
    assert_eq!(
        scanned["payload"]["qr_code_text"], p["qr_code_text"],
        "the code stays while waiting"
    );
    let done = status(&mut x, &cch, &id, false);
    assert_eq!(done["payload"]["status"], "authenticated", "{done}");
    let desc = &done["payload"]["connection_descriptor"];
    assert_descriptor(desc);
    assert_eq!(desc["connection"]["status"], "connected");
    assert_eq!(desc["target"]["provider"], "wechat");
    let token_file = dir.join(format!("state/wechat/{BOT_ID}.token"));
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&token_file).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);

    let id = api.user_says("hello from WeChat", "ctx-1");
    let push = x.next_push(Duration::from_secs(10)).expect("the message is pushed");
    let m = &push["payload"];
    assert_eq!(
        (m["provider"].as_str(), m["chat_type"].as_str()),
        (Some("wechat"), Some("p2p"))
    );
    assert_eq!(m["message_id"], json!(id), "iLink's uint64 ID, exact");
    assert_eq!(m["sender_id"], USER);
    assert_eq!(m["raw_text"], "hello from WeChat");
    let reply_ref = m["reply"]["reply_ref"].as_str().unwrap().to_string();
    let ack = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref, "text": "hi back"}),
        "c1",
    );
    assert!(ack["error"].is_null(), "{ack}");
    let sent = api.wait_sent(1, Duration::from_secs(5));
    let msg = &sent[0]["msg"];
    assert_eq!(
        (msg["to_user_id"].as_str(), msg["context_token"].as_str()),
        (Some(USER), Some("ctx-1"))
    );
    assert_eq!(msg["item_list"][0]["text_item"]["text"], "hi back");
    // The same call again is the same message: one send.
    x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref, "text": "hi back"}),
        "c1",
    );
    assert_eq!(api.sent().len(), 1);
    for (path, kind, auth) in api.posts() {
        assert_eq!(
            (kind.as_str(), auth.as_str()),
            ("ilink_bot_token", &*format!("Bearer {BOT_TOKEN}")),
            "{path}"
        );
    }
    let (_, status_page) = http_get(&d.url("/status"), &[]);
    assert_no_secret(&status_page, &[BOT_TOKEN], "/status");
    assert_no_secret(&d.log(), &[BOT_TOKEN], "the log");
    assert_no_secret(&done.to_string(), &[BOT_TOKEN], "the auth ack");
}

#[test]
fn an_expired_code_asks_for_a_refresh_a_verify_code_fails_in_words_and_cancel_ends_a_login() {
    let (d, api, _dir) = wechat("wx-refresh");
    api.script_next_code(vec![json!({"status": "expired"})]);
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let start = start_login(&mut x, &cch);
    let id = start["payload"]["auth_session_id"].as_str().unwrap().to_string();
    assert_eq!(
        status(&mut x, &cch, &id, false)["payload"]["status"],
        "qr_refresh_required"
    );
    let fresh = status(&mut x, &cch, &id, true);
    assert_eq!(fresh["payload"]["status"], "pending");
    assert!(
        fresh["payload"]["qr_code_text"]
            .as_str()
            .unwrap()
            .contains("qrcode=qr1"),
        "{fresh}"
    );
    let cancel = x.request("auth.cancel", Some(&cch), json!({"auth_session_id": id}));
    assert_eq!(cancel["payload"]["status"], "canceled", "{cancel}");
    assert_eq!(status(&mut x, &cch, &id, false)["payload"]["status"], "unauthenticated");

    api.script_next_code(vec![json!({"status": "need_verifycode"})]);
    let start = start_login(&mut x, &cch);
    let id = start["payload"]["auth_session_id"].as_str().unwrap().to_string();
    let failed = status(&mut x, &cch, &id, false);
    assert_eq!(failed["payload"]["status"], "failed");
    assert!(
        failed["payload"]["message"]
            .as_str()
            .unwrap()
            .contains("verification code"),
        "{failed}"
    );
}

#[test]
fn the_sync_buffer_survives_a_restart_so_nothing_is_pushed_twice_or_lost() {
    let (d, api, _dir) = wechat("wx-restart");
    let (mut x, cch) = signed_in(&d, &api);
    api.user_says("one", "ctx-1");
    api.user_says("two", "ctx-2");
    let first = x.next_push(Duration::from_secs(10)).unwrap();
    let second = x.next_push(Duration::from_secs(10)).unwrap();
    assert_eq!(
        (
            first["payload"]["raw_text"].as_str(),
            second["payload"]["raw_text"].as_str()
        ),
        (Some("one"), Some("two"))
    );
    // The barrier confirms both before the restart.
    assert!(wait_for(
        || get_json(&d.url("/status"))["channels"][0]["delivered"] == 2,
        &mut x
    ));
    x.close();
    wait_log_written(&d);
    let d = d.restart();
    let mut y = d.xagent();
    y.hello(&d.connector_id());
    y.open(Some(&cch));
    api.user_says("three", "ctx-3");
    let next = y.next_push(Duration::from_secs(10)).unwrap();
    assert_eq!(
        next["payload"]["raw_text"], "three",
        "the old messages were not received again"
    );
    assert!(y.next_push(Duration::from_secs(2)).is_none());
    // A send goes in the context of the latest message.
    y.tool(&cch, "imgate_message_send", json!({"text": "ok"}), "c9");
    assert_eq!(
        api.wait_sent(1, Duration::from_secs(5))[0]["msg"]["context_token"],
        "ctx-3"
    );
    // The long poll (35 s at iLink, held here for as long) holds nothing a stop waits for.
    api.hold(Duration::from_secs(35));
    let calls = api.getupdates_calls();
    wait_until("a held getupdates is under way", || api.getupdates_calls() > calls);
    assert_stops_cleanly(d);
}

#[test]
fn media_are_decrypted_into_the_file_cache_and_a_file_goes_out_encrypted() {
    let (d, api, _dir) = wechat("wx-media");
    let (mut x, cch) = signed_in(&d, &api);
    let pdf = b"%PDF-1.4 a small report \x00\x01\x02 with binary bytes".repeat(20);
    api.user_sends(4, "report.pdf", &pdf, "ctx-f");
    let push = x
        .next_push(Duration::from_secs(10))
        .expect("the file's message is pushed");
    let file = &push["payload"]["files"][0];
    assert_eq!(
        (file["filename"].as_str(), file["mime_type"].as_str()),
        (Some("report.pdf"), Some("application/pdf")),
        "{push}"
    );
    let (status, bytes) = download(&d, file);
    assert_eq!((status, bytes), (200, pdf.clone()), "decrypted on the device");
    let png = b"\x89PNG\r\n\x1a\n an image".to_vec();
    api.user_sends(2, "", &png, "ctx-i");
    let push = x.next_push(Duration::from_secs(10)).unwrap();
    let image = &push["payload"]["files"][0];
    assert_eq!(image["mime_type"], "image/png", "{push}");
    let (_, bytes) = download(&d, image);
    assert_eq!(bytes, png, "the image's key given as image_item.aeskey (hex)");

    // The file tool: encrypted, uploaded, then sent as a file item in the user's context.
    let (code, up) = upload_as(&d, &cch, "notes.txt", "text/plain", b"meeting at 10");
    assert_eq!(code, 200, "{up}");
    let file_ref = up["file_ref"].as_str().unwrap();
    let ack = x.tool(
        &cch,
        "imgate_file_send",
        json!({"file_ref": file_ref, "caption": "the notes"}),
        "f1",
    );
    assert!(ack["error"].is_null(), "{ack}");
    let sent = api.wait_sent(2, Duration::from_secs(5));
    assert_eq!(sent[0]["msg"]["item_list"][0]["text_item"]["text"], "the notes");
    let item = &sent[1]["msg"]["item_list"][0];
    assert_eq!(
        (item["type"].as_u64(), item["file_item"]["file_name"].as_str()),
        (Some(4), Some("notes.txt"))
    );
    assert_eq!(sent[1]["msg"]["context_token"], "ctx-i");
    assert_eq!(
        api.uploaded(&item["file_item"]["media"]).as_deref(),
        Some(&b"meeting at 10"[..])
    );
    let ask = &api.upload_asks()[0];
    assert_eq!(
        (ask["rawsize"].as_u64(), ask["filesize"].as_u64()),
        (Some(13), Some(16))
    );
    assert_eq!(ask["rawfilemd5"], md5_hex(b"meeting at 10"));
}

fn md5_hex(bytes: &[u8]) -> String {
    use md5::Digest;
    md5::Md5::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn a_login_follows_a_redirect_and_survives_a_reconnect_of_the_data_plane() {
    let (d, api, dir) = wechat("wx-redirect");
    let other = Ilink::start();
    api.script_next_code(vec![
        json!({"status": "scaned_but_redirect", "redirect_host": other.host()}),
    ]);
    other.script_next_code(vec![Ilink::confirmed()]);
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let id = start_login(&mut x, &cch)["payload"]["auth_session_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(status(&mut x, &cch, &id, false)["payload"]["status"], "scanned");
    x.close();
    // xAgent reconnects and polls the same login; the poll goes to the redirected host.
    let mut y = d.xagent();
    y.hello(&d.connector_id());
    y.open(Some(&cch));
    let done = status(&mut y, &cch, &id, false);
    assert_eq!(done["payload"]["status"], "authenticated", "{done}");
    // Signing in again while the bot is signed in here already reuses the stored token.
    api.script_next_code(vec![json!({"status": "binded_redirect", "ilink_bot_id": BOT_ID})]);
    let (again, _) = y.open(None);
    let id = start_login(&mut y, &again)["payload"]["auth_session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let reused = status(&mut y, &again, &id, false);
    assert_eq!(reused["payload"]["status"], "authenticated", "{reused}");
    // The bot moved to the new channel; the first one lost it.
    let moved = y.request("connection.descriptor.get", Some(&cch), json!({}));
    assert_eq!(
        moved["payload"]["connection_descriptor"]["connection"]["status"],
        "created"
    );
    let cch = again;
    // Logout forgets the token and stops receiving.
    let out = y.request("auth.logout", Some(&cch), json!({}));
    assert_eq!(out["payload"]["status"], "ok");
    assert!(
        !dir.join(format!("state/wechat/{BOT_ID}.token")).exists(),
        "the token is forgotten"
    );
    assert!(d.log_shows("has no binding left; its receiver stops", Duration::from_secs(5)));
}

#[test]
fn a_sigkill_between_getupdates_and_the_commit_loses_nothing_and_a_redelivery_is_stored_once() {
    let (mut d, api, _dir) = wechat_env("wx-crash", &[("IMGATE_TEST_CRASH", "intake-before-commit:1")]);
    let (x, cch) = signed_in(&d, &api);
    let id = api.user_says("survive me", "ctx-1");
    assert!(
        d.wait_exit(Duration::from_secs(10)).is_some(),
        "killed before the commit"
    );
    drop(x);
    let d = d.restart_env(&[]);
    let mut y = d.xagent();
    y.hello(&d.connector_id());
    y.open(Some(&cch));
    let push = y
        .next_push(Duration::from_secs(10))
        .expect("the message survived the crash");
    assert_eq!(push["payload"]["message_id"], json!(id));
    // iLink sends it once more: stored once.
    api.deliver_again();
    assert!(
        y.next_push(Duration::from_secs(3)).is_none(),
        "exactly one message was pushed"
    );
    assert_no_secret(&d.log(), &[BOT_TOKEN, "ctx-1"], "the debug log");
}

/// Reads packets until `done` holds, for at most 10 s.
fn wait_for(mut done: impl FnMut() -> bool, x: &mut Sim) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        if done() {
            return true;
        }
        x.recv_within(Duration::from_millis(100));
    }
    false
}

#[test]
fn an_ended_login_shows_expired_tools_say_so_and_a_new_scan_recovers() {
    let (d, api, _dir) = wechat("wx-ended");
    let (mut x, cch) = signed_in(&d, &api);
    // Before the user wrote, WeChat takes no message: the tool says why in words.
    let refused = x.tool(&cch, "imgate_message_send", json!({"text": "hello?"}), "c0");
    assert_eq!(refused["error"]["code"], "upstream_rejected", "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("write to the bot again"),
        "{refused}"
    );
    api.end_login();
    let pushed = x
        .next_of("connection.descriptor.push", Duration::from_secs(10))
        .expect("xAgent is told");
    assert_eq!(
        pushed["payload"]["connection_descriptor"]["connection"]["status"], "expired",
        "{pushed}"
    );
    assert!(d.log_shows("WeChat ended its sign-in", Duration::from_secs(10)));
    let desc = x.request("connection.descriptor.get", Some(&cch), json!({}));
    assert_eq!(
        desc["payload"]["connection_descriptor"]["connection"]["status"], "expired",
        "{desc}"
    );
    let tool = x.tool(&cch, "imgate_message_send", json!({"text": "still there?"}), "c1");
    assert_eq!(tool["error"]["code"], "connection_not_authenticated", "{tool}");
    assert!(tool["error"]["message"].as_str().unwrap().contains("sign in again"));
    let page = get_json(&d.url("/status"));
    assert_eq!(page["channels"][0]["status"], "expired", "{page}");

    // A new scan on the same channel: connected again, and receiving again.
    api.script_next_code(vec![Ilink::confirmed()]);
    let start = start_login(&mut x, &cch);
    let id = start["payload"]["auth_session_id"].as_str().unwrap().to_string();
    let done = status(&mut x, &cch, &id, false);
    assert_eq!(
        done["payload"]["connection_descriptor"]["connection"]["status"], "connected",
        "{done}"
    );
    api.user_says("back again", "ctx-9");
    let push = x.next_push(Duration::from_secs(10)).expect("receiving again");
    assert_eq!(push["payload"]["raw_text"], "back again");
}

#[test]
fn images_and_files_of_every_size_up_to_max_file_bytes_are_decrypted_and_download_whole() {
    let api = Ilink::start();
    let dir = temp_dir("wx-sizes");
    let conf = format!(
        "[wechat]\napi_base = {}\ncdn_base = {}/c2c\n{MAX_FILE_CONF}",
        api.base, api.base
    );
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, &conf));
    let (mut x, _cch) = signed_in(&d, &api);
    // A photo as an image item, the others as file items (their keys spelled differently).
    every_size_downloads_whole(&d, &mut x, |i, bytes| {
        api.user_sends(if i == 0 { 2 } else { 4 }, "report.pdf", bytes, &format!("ctx-{i}"));
    });
}

/// A CDN answer redirecting to another host was followed; the bytes come from the CDN's host
/// alone now, and the message goes on with a note.
#[test]
fn a_cdn_redirect_to_another_host_is_not_followed() {
    let (d, api, _dir) = wechat("wx-cdn-redirect");
    let (mut x, _) = signed_in(&d, &api);
    let elsewhere = ReplyReceiver::start(200);
    api.redirect_downloads(&elsewhere.url);
    api.user_sends(4, "report.pdf", b"%PDF-1.4 small", "ctx-r");
    let push = x.next_push(Duration::from_secs(20)).expect("the message is pushed");
    let text = push["payload"]["raw_text"].as_str().unwrap_or_default();
    assert!(text.contains("not available"), "{push}");
    assert!(
        elsewhere.rx.recv_timeout(Duration::from_millis(500)).is_err(),
        "nothing was fetched from the other host"
    );
}
