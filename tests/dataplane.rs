//! End to end over real sockets: the control plane, the listen and dial data planes, the
//! webhook channel and its tools, persistence across restarts.

use std::net::TcpListener;
use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

#[test]
fn card_is_public_valid_and_shares_its_build_with_health() {
    let dir = temp_dir("card");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let (status, body) = http_get(&d.url("/connector-card.json"), &[]);
    assert_eq!(status, 200);
    let card: Value = serde_json::from_str(&body).unwrap();
    assert_card(&card);
    assert_eq!(card["protocol_version"], "3.0");
    assert_eq!(card["connector_card_id"], "im.imgate");
    assert_eq!(card["supports"]["profiles"], json!(["xagent.im.v1"]));
    let tools: Vec<&str> = card["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tool_id"].as_str().unwrap())
        .collect();
    assert_eq!(tools, ["imgate_message_send", "imgate_message_reply"]);
    for t in card["tools"].as_array().unwrap() {
        assert!(t["input_schema"]["required"]
            .as_array()
            .unwrap()
            .contains(&json!("connector_channel_id")));
    }
    assert!(!card["build"]["git_rev"].as_str().unwrap().is_empty());

    assert_eq!(http_get(&d.url("/health"), &[]).0, 401);
    assert_eq!(http_get(&d.url("/health"), &[("Authorization", "Bearer wrong")]).0, 401);
    let health = get_json(&d.url("/health"));
    assert_eq!(health["status"], "ok");
    assert_eq!(health["build"], card["build"], "Card and health report one build");
    assert_eq!(health["connector_card_version"], card["connector"]["version"]);
    assert!(!body.contains(API_KEY) && !body.contains(HOOK_SECRET));
}

#[test]
fn skill_is_public_and_names_the_reply_tool() {
    let dir = temp_dir("skill");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let (status, skill) = http_get(&d.url("/skill.md"), &[]);
    assert_eq!(status, 200);
    assert!(skill.contains("name: connector-im-imgate"));
    assert!(skill.contains("imgate_message_reply") && skill.contains("reply_ref"));
    assert!(skill.contains("message.push"));
}

#[test]
fn ws_upgrade_needs_the_api_key_and_the_packet_subprotocol() {
    let dir = temp_dir("wsauth");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    assert_eq!(try_connect(d.port, None, Some(SUBPROTOCOL)).err(), Some(401));
    assert_eq!(try_connect(d.port, Some("wrong"), Some(SUBPROTOCOL)).err(), Some(401));
    assert_eq!(try_connect(d.port, Some(API_KEY), None).err(), Some(400));
    assert!(try_connect(d.port, Some(API_KEY), Some(SUBPROTOCOL)).is_ok());
    assert!(d.log_shows("missing or wrong API key", Duration::from_secs(5)));
}

#[test]
fn packets_out_of_order_or_malformed_get_the_protocol_error_codes() {
    let dir = temp_dir("errors");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let mut x = d.xagent();

    let a = x.request("channel.open", None, json!({}));
    assert_eq!(
        (a["type"].as_str(), a["error"]["code"].as_str()),
        (Some("error"), Some("hello_required"))
    );

    x.send_raw("{not json");
    let a = x.recv_within(Duration::from_secs(5)).unwrap();
    assert_eq!(a["error"]["code"], "invalid_packet");
    x.send_raw(r#"{"schema":"xagent.connector.packet/v1","type":"ping"}"#);
    assert_eq!(
        x.recv_within(Duration::from_secs(5)).unwrap()["error"]["code"],
        "invalid_packet"
    );

    let wrong_card = x.request(
        "connector.hello",
        None,
        json!({"connector_card_id":"im.other","protocol_version":"3.0","supported_profiles":["xagent.im.v1"]}),
    );
    assert_eq!(wrong_card["error"]["code"], "connector_card_id_mismatch");
    for bad in [json!("2.0"), Value::Null] {
        let mut hello = json!({"connector_card_id":"im.imgate","supported_profiles":["xagent.im.v1"]});
        if !bad.is_null() {
            hello["protocol_version"] = bad;
        }
        let a = x.request("connector.hello", None, hello);
        assert_eq!(a["type"], "error");
        assert_eq!(a["error"]["code"], "unsupported_protocol_version", "{a}");
    }
    let no_profiles = x.request(
        "connector.hello",
        None,
        json!({"connector_card_id":"im.imgate","protocol_version":"3.0"}),
    );
    assert_eq!(no_profiles["error"]["code"], "invalid_packet");

    x.hello("");
    let a = x.request("auth.start", None, json!({"flow_id":"webhook_binding"}));
    assert_eq!(a["error"]["code"], "connector_channel_id_required");
    let a = x.request(
        "tool.invoke",
        Some("cch_not_open"),
        json!({"tool_id":"imgate_message_send"}),
    );
    assert_eq!(a["error"]["code"], "channel_not_open");
    let a = x.request("connection.descriptor.get", Some("cch_not_open"), json!({}));
    assert_eq!(a["error"]["code"], "channel_not_open");
    let a = x.request("chat.message", Some("cch_x"), json!({}));
    assert_eq!(a["error"]["code"], "unsupported_packet");
    let a = x.request("ping", None, json!({}));
    assert_eq!(a["type"], "pong");
}

#[test]
fn listen_session_binds_a_webhook_pushes_its_messages_and_replies_through_the_tools() {
    let receiver = ReplyReceiver::start(200);
    let dir = temp_dir("full");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, Some(&receiver.url), ""));
    let mut x = d.xagent();
    let ack = x.hello("");
    let connector_id = ack["payload"]["connector_id"].as_str().unwrap().to_string();
    assert!(connector_id.starts_with("conn_"));
    assert_eq!(ack["payload"]["protocol_version"], "3.0");

    let (cch, open) = x.open(None);
    let desc = &open["payload"]["connection_descriptor"];
    assert_eq!(desc["connection"]["status"], "created");
    assert_eq!(desc["connection"]["profiles"], json!(["xagent.im.v1"]));
    assert_eq!(desc["connection"]["connector_id"], json!(connector_id));

    let failed = x.bind_webhook(&cch, "alerts", "not-the-secret");
    assert_eq!(failed["type"], "auth.start.ack");
    assert_eq!(failed["payload"]["status"], "failed");
    let unknown = x.bind_webhook(&cch, "nope", HOOK_SECRET);
    assert_eq!(unknown["payload"]["status"], "failed");
    let ok = x.bind_webhook(&cch, "alerts", HOOK_SECRET);
    assert_eq!(ok["payload"]["status"], "authenticated", "{ok}");
    let d2 = &ok["payload"]["connection_descriptor"];
    assert_eq!(d2["connection"]["status"], "connected");
    assert_eq!(d2["target"]["provider"], "webhook");
    assert!(d2["tools"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["status"] == "available"));
    let auth_id = ok["payload"]["auth_session_id"].as_str().unwrap().to_string();
    let st = x.request(
        "auth.status",
        Some(&cch),
        json!({"flow_id":"webhook_binding","auth_session_id":auth_id}),
    );
    assert_eq!(st["payload"]["status"], "authenticated");
    let cancel = x.request("auth.cancel", Some(&cch), json!({"auth_session_id":auth_id}));
    assert_eq!(cancel["payload"]["status"], "ignored");
    let gone = x.request("auth.status", Some(&cch), json!({"auth_session_id":"auth_unknown"}));
    assert_eq!(gone["error"]["code"], "auth_session_not_found");

    let (status, answer) = d.post_hook(
        "alerts",
        &json!({"message_id":"m-1","sender_id":"user-12345","sender_name":"Ada","text":"disk full","chat_type":"group"}),
    );
    assert_eq!((status, answer["status"].as_str()), (202, Some("accepted")));

    let push = x
        .next_push(Duration::from_secs(10))
        .expect("the accepted message is pushed");
    assert_eq!(push["connector_channel_id"], json!(cch));
    let p = &push["payload"];
    for (field, want) in [
        ("provider", "webhook"),
        ("profile", "xagent.im.v1"),
        ("event_kind", "im.message.received"),
        ("message_id", "m-1"),
        ("sender_id", "user-12345"),
        ("sender_name", "Ada"),
        ("chat_type", "group"),
        ("message_type", "text"),
        ("raw_text", "disk full"),
    ] {
        assert_eq!(p[field], want, "payload field {field}: {p}");
    }
    assert_eq!(
        p["text"],
        "User message from Alerts:\nSender: Ada\nConversation type: group\nMessage type: text\nUser text: disk full"
    );
    assert_eq!(p["reply"]["tool_id"], "imgate_message_reply");
    assert_eq!(p["skill"]["skill_id"], "connector-im-imgate");
    assert_eq!(
        p["skill"]["tool_ids"],
        json!(["imgate_message_send", "imgate_message_reply"])
    );
    let reply_ref = p["reply"]["reply_ref"].as_str().unwrap().to_string();
    let text = push.to_string();
    assert!(!text.contains(HOOK_SECRET) && !text.contains(&receiver.url) && !text.contains(API_KEY));

    let ack = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"connector_channel_id": cch, "reply_ref": reply_ref, "text": "on it"}),
        "call-1",
    );
    assert_eq!(ack["type"], "tool.invoke.ack");
    assert_eq!(ack["payload"]["result"]["status"], "sent", "{ack}");
    let out = receiver
        .rx
        .recv_timeout(Duration::from_secs(5))
        .expect("reply reached reply_url");
    let body: Value = serde_json::from_str(&out.body).unwrap();
    assert_eq!(body["endpoint"], "alerts");
    assert_eq!(body["text"], "on it");
    assert_eq!(body["reply_to_message_id"], "m-1");
    assert!(body["idempotency_key"].as_str().is_some_and(|k| !k.is_empty()));
    assert_eq!(
        out.signature.as_deref(),
        Some(hmac_hex(HOOK_SECRET, out.body.as_bytes()).as_str())
    );

    let again = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref, "text": "on it"}),
        "call-1",
    );
    assert_eq!(
        again["payload"]["result"], ack["payload"]["result"],
        "a repeated tool_call_id answers the same"
    );
    assert!(
        receiver.rx.recv_timeout(Duration::from_millis(500)).is_err(),
        "and sends nothing twice"
    );

    let sent = x.tool(&cch, "imgate_message_send", json!({"text": "hello all"}), "call-2");
    assert_eq!(sent["payload"]["result"]["status"], "sent");
    let out = receiver.rx.recv_timeout(Duration::from_secs(5)).unwrap();
    let body: Value = serde_json::from_str(&out.body).unwrap();
    assert_eq!(body["text"], "hello all");
    assert!(body.get("reply_to_message_id").is_none());

    let empty = x.tool(&cch, "imgate_message_send", json!({"text": ""}), "call-3");
    assert_eq!(empty["error"]["code"], "invalid_arguments");
    let bogus = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": "rr_forged", "text": "x"}),
        "call-4",
    );
    assert_eq!(bogus["error"]["code"], "reply_ref_invalid");
    let unknown = x.tool(&cch, "imgate_file_send", json!({}), "call-5");
    assert_eq!(unknown["error"]["code"], "unknown_tool");

    // A second channel cannot use the first one's reply_ref.
    let (other, _) = x.open(None);
    let cross = x.tool(
        &other,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref, "text": "x"}),
        "call-6",
    );
    assert_eq!(
        cross["error"]["code"], "connection_not_authenticated",
        "an unbound channel has no tools"
    );

    let desc = x.request("connection.descriptor.get", Some(&cch), json!({}));
    assert_eq!(
        desc["payload"]["connection_descriptor"]["connection"]["status"],
        "connected"
    );
    let logout = x.request("auth.logout", Some(&cch), json!({}));
    assert_eq!(logout["payload"]["status"], "ok");
    assert_eq!(
        logout["payload"]["connection_descriptor"]["connection"]["status"],
        "created"
    );
    let closed = x.request("channel.close", Some(&cch), json!({}));
    assert_eq!(closed["payload"]["status"], "ok");
    let after = x.request("connection.descriptor.get", Some(&cch), json!({}));
    assert_eq!(after["error"]["code"], "channel_not_open");

    let all = serde_json::to_string(&x.seen).unwrap();
    assert!(
        !all.contains(HOOK_SECRET) && !all.contains(API_KEY),
        "no secret in any packet"
    );
    let log = d.log();
    assert_no_secret(&log, &[HOOK_SECRET, API_KEY], "the trace log");
}

#[test]
fn reply_ref_of_one_channel_is_rejected_on_another_bound_channel() {
    let receiver = ReplyReceiver::start(200);
    let dir = temp_dir("crossref");
    let extra = format!("[webhook.ops]\nsecret = ops-secret-1\nreply_url = {}\n", receiver.url);
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, Some(&receiver.url), &extra));
    let (mut x, cch) = d.bound_xagent();
    let (ops, _) = x.open(None);
    assert_eq!(
        x.bind_webhook(&ops, "ops", "ops-secret-1")["payload"]["status"],
        "authenticated"
    );
    d.post_hook("alerts", &json!({"message_id":"a1","sender_id":"u"}));
    let push = x.next_push(Duration::from_secs(10)).unwrap();
    assert_eq!(push["connector_channel_id"], json!(cch));
    let reply_ref = push["payload"]["reply"]["reply_ref"].as_str().unwrap().to_string();
    let a = x.tool(
        &ops,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref, "text": "x"}),
        "c1",
    );
    assert_eq!(a["error"]["code"], "reply_ref_invalid");
    assert!(receiver.rx.recv_timeout(Duration::from_millis(300)).is_err());
}

#[test]
fn failing_reply_url_comes_back_as_a_tool_error_with_a_stable_code() {
    let receiver = ReplyReceiver::start(500);
    let dir = temp_dir("upstream");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, Some(&receiver.url), ""));
    let (mut x, cch) = d.bound_xagent();
    let a = x.tool(&cch, "imgate_message_send", json!({"text":"hi"}), "c1");
    assert_eq!(a["type"], "tool.invoke.ack");
    assert_eq!(a["error"]["code"], "upstream_rejected");
    // A failed call is not remembered: the same tool_call_id may try again.
    let b = x.tool(&cch, "imgate_message_send", json!({"text":"hi"}), "c1");
    assert_eq!(b["error"]["code"], "upstream_rejected");
    assert_eq!(receiver.rx.try_iter().count(), 2);
}

#[test]
fn endpoint_without_reply_url_marks_its_tools_unavailable_and_omits_reply() {
    let dir = temp_dir("noreply");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let ok = x.bind_webhook(&cch, "alerts", HOOK_SECRET);
    let tools = ok["payload"]["connection_descriptor"]["tools"]
        .as_array()
        .unwrap()
        .clone();
    assert!(tools
        .iter()
        .all(|t| t["status"] == "unavailable" && t["reason"].is_string()));
    d.post_hook("alerts", &json!({"message_id":"n1","sender_id":"u"}));
    let push = x.next_push(Duration::from_secs(10)).unwrap();
    assert!(push["payload"].get("reply").is_none());
    let a = x.tool(&cch, "imgate_message_send", json!({"text":"x"}), "c");
    assert_eq!(a["error"]["code"], "connector_channel_unavailable");
}

#[test]
fn webhook_answers_follow_the_contract() {
    let dir = temp_dir("hookhttp");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let url = d.url("/hooks/alerts");
    let bearer = format!("Bearer {HOOK_SECRET}");
    let auth = [("Authorization", bearer.as_str())];
    let msg = json!({"message_id":"h1","sender_id":"u1","text":"x"}).to_string();

    assert_eq!(http_post(&url, &[], &msg).0, 401);
    assert_eq!(
        http_post(&url, &[("Authorization", "Bearer nope")], &msg),
        (401, json!({"error":"unauthorized"}))
    );
    assert_eq!(
        http_post(&d.url("/hooks/missing"), &auth, &msg).1["error"],
        "unknown_endpoint"
    );
    let (s, b) = http_post(&url, &auth, "{\"message_id\":");
    assert_eq!((s, b["error"].as_str()), (400, Some("invalid_payload")));
    assert!(b["detail"].is_string());
    let (s, b) = http_post(&url, &auth, r#"{"message_id":"h2"}"#);
    assert_eq!(s, 400);
    assert!(b["detail"].as_str().unwrap().contains("sender_id"));
    let stale = json!({"message_id":"h3","sender_id":"u","event_time": 1_000u64}).to_string();
    assert_eq!(
        http_post(&url, &auth, &stale),
        (409, json!({"error":"stale","message_id":"h3"}))
    );

    assert_eq!(http_post(&url, &auth, &msg).0, 202);
    assert_eq!(
        http_post(&url, &auth, &msg),
        (200, json!({"status":"duplicate","message_id":"h1"}))
    );

    let sig = hmac_hex(HOOK_SECRET, br#"{"message_id":"h4","sender_id":"u"}"#);
    let signed = http_post(
        &url,
        &[("X-Imgate-Signature", sig.as_str())],
        r#"{"message_id":"h4","sender_id":"u"}"#,
    );
    assert_eq!(signed.0, 202);
    let tampered = http_post(
        &url,
        &[("X-Imgate-Signature", sig.as_str())],
        r#"{"message_id":"h5","sender_id":"u"}"#,
    );
    assert_eq!(tampered.0, 401);

    let big = format!(
        r#"{{"message_id":"h6","sender_id":"u","text":"{}"}}"#,
        "x".repeat(1_100_000)
    );
    assert_eq!(http_post(&url, &auth, &big), (413, json!({"error":"too_large"})));

    let status = get_json(&d.url("/status"));
    assert_eq!(
        status["unbound"]["pending"], 2,
        "h1 and h4 wait for a binding: {status}"
    );
    assert_eq!(status["policy"]["ttl_ms"], 3_600_000);
}

#[test]
fn messages_accepted_before_binding_are_delivered_once_a_channel_binds() {
    let dir = temp_dir("prebind");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    for i in 0..3 {
        assert_eq!(
            d.post_hook("alerts", &json!({"message_id": format!("early-{i}"), "sender_id":"u"}))
                .0,
            202
        );
    }
    let (mut x, _) = d.bound_xagent();
    let ids: Vec<String> = (0..3)
        .map(|_| {
            x.next_push(Duration::from_secs(10)).unwrap()["payload"]["message_id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(ids, ["early-0", "early-1", "early-2"], "acceptance order");
    // Wait for the barrier commit, then check the counters.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let s = get_json(&d.url("/status"));
        if s["channels"][0]["delivered"] == 3 {
            assert_eq!(s["channels"][0]["pending"], 0);
            assert_eq!(s["channels"][0]["status"], "connected");
            assert_eq!(s["dataplane"]["connections"], 1);
            break;
        }
        assert!(std::time::Instant::now() < deadline, "delivery never committed: {s}");
        x.recv_within(Duration::from_millis(100));
    }
}

#[test]
fn unconfirmed_pushes_are_redelivered_with_the_same_message_id_after_reconnect() {
    let dir = temp_dir("redeliver");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let (mut x, cch) = d.bound_xagent();
    let connector_id = d.connector_id();
    x.auto_pong = false;
    d.post_hook("alerts", &json!({"message_id":"r1","sender_id":"u"}));
    let first = x.next_push(Duration::from_secs(10)).unwrap();
    x.close(); // before answering the barrier ping

    let mut y = d.xagent();
    let ack = y.hello(&connector_id);
    assert_eq!(
        ack["payload"]["connector_id"],
        json!(connector_id),
        "connector_id is reused"
    );
    let (again, _) = y.open(Some(&cch));
    assert_eq!(again, cch, "the persisted channel is reused");
    let second = y.next_push(Duration::from_secs(10)).expect("redelivered");
    assert_eq!(second["payload"]["message_id"], "r1");
    assert_eq!(
        second["payload"]["expires_at"], first["payload"]["expires_at"],
        "expiry never moves"
    );
    assert_eq!(second["payload"]["reply"], first["payload"]["reply"]);
    // This time the barrier is answered (auto_pong); after it nothing comes again.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while get_json(&d.url("/status"))["channels"][0]["delivered"] != 1 {
        assert!(std::time::Instant::now() < deadline);
        y.recv_within(Duration::from_millis(100));
    }
    let s = get_json(&d.url("/status"));
    assert_eq!(s["channels"][0]["attempts"], 1, "one failed attempt counted: {s}");
    y.close();
    let mut z = d.xagent();
    z.hello(&connector_id);
    z.open(Some(&cch));
    assert!(
        z.next_push(Duration::from_secs(2)).is_none(),
        "no delivery after the barrier pong"
    );
}

#[test]
fn an_auth_session_is_answered_on_a_new_connection_and_cancel_says_what_it_found() {
    let dir = temp_dir("auth-reconnect");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    let ok = x.bind_webhook(&cch, "alerts", HOOK_SECRET);
    let auth_id = ok["payload"]["auth_session_id"].as_str().unwrap().to_string();
    let failed = x.bind_webhook(&cch, "alerts", "wrong");
    let failed_id = failed["payload"]["auth_session_id"].as_str().unwrap().to_string();
    x.close();

    // xAgent comes back: the same channel, the same auth sessions.
    let mut y = d.xagent();
    y.hello(&d.connector_id());
    y.open(Some(&cch));
    let st = y.request("auth.status", Some(&cch), json!({"auth_session_id": auth_id}));
    assert_eq!(st["type"], "auth.status.ack");
    assert_eq!(st["payload"]["status"], "authenticated", "{st}");
    assert_eq!(st["payload"]["flow_id"], "webhook_binding");
    assert_eq!(
        st["payload"]["connection_descriptor"]["connection"]["status"],
        "connected"
    );
    assert_packet(&st);
    let st = y.request("auth.status", Some(&cch), json!({"auth_session_id": failed_id}));
    assert_eq!(st["payload"]["status"], "failed");
    let cancel = y.request("auth.cancel", Some(&cch), json!({"auth_session_id": failed_id}));
    assert_eq!(
        (&cancel["payload"]["status"], &cancel["payload"]["auth_status"]),
        (&json!("ignored"), &json!("unauthenticated"))
    );
    let cancel = y.request("auth.cancel", Some(&cch), json!({"auth_session_id": "auth_nope"}));
    assert_eq!(cancel["payload"]["status"], "not_found");
    let logout = y.request("auth.logout", Some(&cch), json!({}));
    assert_eq!(
        logout["payload"]["connection_descriptor"]["connection"]["status"],
        "created"
    );
}

#[test]
fn restart_keeps_bindings_and_accepted_messages() {
    let dir = temp_dir("restart");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let (x, cch) = d.bound_xagent();
    let connector_id = d.connector_id();
    x.close();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        d.post_hook("alerts", &json!({"message_id":"k1","sender_id":"u"})).0,
        202
    );
    let mut d = d;
    d.kill(); // SIGKILL right after the 202
    let d = d.restart();
    assert_eq!(get_json(&d.url("/status"))["connector_id"], json!(connector_id));
    let mut y = d.xagent();
    y.hello(&connector_id);
    let (again, open) = y.open(Some(&cch));
    assert_eq!(again, cch);
    assert_eq!(
        open["payload"]["connection_descriptor"]["connection"]["status"], "connected",
        "binding survived"
    );
    let push = y
        .next_push(Duration::from_secs(10))
        .expect("the accepted message survived SIGKILL");
    assert_eq!(push["payload"]["message_id"], "k1");
}

#[test]
fn binding_a_second_channel_to_the_endpoint_moves_it_and_tells_the_first() {
    let dir = temp_dir("move");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let (mut x, first) = d.bound_xagent();
    let (second, _) = x.open(None);
    assert_eq!(
        x.bind_webhook(&second, "alerts", HOOK_SECRET)["payload"]["status"],
        "authenticated"
    );
    let push = x.next_of("connection.descriptor.push", Duration::from_secs(5));
    let push = push.expect("the first channel learns it lost the binding");
    assert_eq!(push["connector_channel_id"], json!(first));
    assert_eq!(
        push["payload"]["connection_descriptor"]["connection"]["status"],
        "created"
    );
    d.post_hook("alerts", &json!({"message_id":"mv1","sender_id":"u"}));
    assert_eq!(
        x.next_push(Duration::from_secs(10)).unwrap()["connector_channel_id"],
        json!(second)
    );
}

#[test]
fn dial_transport_runs_the_same_session_and_reconnects() {
    let receiver = ReplyReceiver::start(200);
    let xagent = TcpListener::bind("127.0.0.1:0").unwrap();
    let dial_port = xagent.local_addr().unwrap().port();
    let dir = temp_dir("dial");
    let extra = format!("[xagent]\ndial = ws://127.0.0.1:{dial_port}/connector/ws\ndial_api_key = dial-key-55\n");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, Some(&receiver.url), &extra));

    let (mut x, auth) = accept_dial(&xagent);
    assert_eq!(auth.as_deref(), Some("Bearer dial-key-55"));
    let before = x.request("channel.open", None, json!({}));
    assert_eq!(
        before["error"]["code"], "hello_required",
        "the far side still says hello first"
    );
    let ack = x.hello("");
    let connector_id = ack["payload"]["connector_id"].as_str().unwrap().to_string();
    let (cch, _) = x.open(None);
    assert_eq!(
        x.bind_webhook(&cch, "alerts", HOOK_SECRET)["payload"]["status"],
        "authenticated"
    );
    assert_eq!(
        d.post_hook("alerts", &json!({"message_id":"d1","sender_id":"u","text":"via dial"}))
            .0,
        202
    );
    let push = x.next_push(Duration::from_secs(10)).unwrap();
    assert_eq!(push["payload"]["raw_text"], "via dial");
    let reply_ref = push["payload"]["reply"]["reply_ref"].as_str().unwrap().to_string();
    let a = x.tool(
        &cch,
        "imgate_message_reply",
        json!({"reply_ref": reply_ref, "text":"ack"}),
        "dc1",
    );
    assert_eq!(a["payload"]["result"]["status"], "sent");
    assert!(receiver.rx.recv_timeout(Duration::from_secs(5)).is_ok());

    // Drop the connection: imgate dials again and the channel comes back.
    x.close();
    xagent.set_nonblocking(false).unwrap();
    let (mut y, _) = accept_dial(&xagent);
    y.hello(&connector_id);
    let (again, open) = y.open(Some(&cch));
    assert_eq!(again, cch);
    assert_eq!(
        open["payload"]["connection_descriptor"]["connection"]["status"],
        "connected"
    );
    let log = d.log();
    assert_no_secret(&log, &["dial-key-55"], "the log");
}

/// A far side that accepts the dial and breaks every session at once was redialled every 1.3 s
/// with four log lines each. A short session now counts as a failure for the backoff (1, 2,
/// 4 s … up to a minute), and that is said once a minute.
#[test]
fn a_dial_target_that_breaks_every_session_is_redialled_with_growing_backoff() {
    let xagent = TcpListener::bind("127.0.0.1:0").unwrap();
    let dial_port = xagent.local_addr().unwrap().port();
    let dir = temp_dir("dial-flap");
    let extra = format!("[xagent]\ndial = ws://127.0.0.1:{dial_port}/ws\n");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, &extra));
    let mut accepted = Vec::new();
    for _ in 0..4 {
        let (x, _) = accept_dial(&xagent);
        accepted.push(std::time::Instant::now());
        drop(x);
    }
    // The waits before the 2nd, 3rd and 4th dial are at least 1, 2 and 4 s (plus jitter); a
    // slow machine only makes them longer.
    let third_gap = accepted[3] - accepted[2];
    assert!(
        third_gap >= Duration::from_millis(3900),
        "{:?}",
        accepted.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>()
    );
    let log = d.log();
    assert_eq!(log.matches("dial: sessions with").count(), 1, "{log}");
}

#[test]
fn status_requires_the_api_key_and_reports_the_policy() {
    let dir = temp_dir("status");
    let d = Daemon::start(
        &dir,
        &config_text(free_port(), &dir, None, "[queue]\nttl = 10m\noverflow = reject_new\n"),
    );
    assert_eq!(http_get(&d.url("/status"), &[]).0, 401);
    assert_eq!(http_get(&d.url("/metrics"), &[]).0, 401);
    let s = get_json(&d.url("/status"));
    assert_eq!(s["policy"]["ttl_ms"], 600_000);
    assert_eq!(s["policy"]["overflow"], "reject_new");
    assert_eq!(s["policy"]["cleanup_interval_ms"], 300_000);
    let (code, metrics) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
    assert_eq!(code, 200);
    assert!(metrics.contains("imgate_queue_ttl_seconds 600"));
    assert!(metrics.contains("imgate_dataplane_connections 0"));

    let status = || {
        let out = std::process::Command::new(bin())
            .args(["status", "--config"])
            .arg(&d.config)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let table = status();
    assert!(table.contains("pending") && table.contains("(unbound)"), "{table}");
    assert!(table.contains(" · up ") && table.contains("storage  ok, "), "{table}");
    assert!(table.contains("xAgent   not connected for "), "{table}");

    // A bound channel is shown with its name; xAgent gone, the lease counts down.
    let (x, cch) = d.bound_xagent();
    let table = status();
    assert!(
        table.contains("xAgent   connected (1 data-plane connection(s))"),
        "{table}"
    );
    let row = table.lines().find(|l| l.starts_with(&cch)).unwrap_or_default();
    assert!(
        row.contains("Webhook ") && row.contains("webhook") && row.contains("connected"),
        "{table}"
    );
    drop(x);
    wait_until("the lease runs", || {
        let s = get_json(&d.url("/status"));
        s["xagent"]["connected"] == false && s["lease"]["expires_in_ms"].as_u64().is_some_and(|l| l <= 3_600_000)
    });
    let table = status();
    assert!(
        table.contains("channels are unregistered in ") && table.contains("(lease 1h)"),
        "{table}"
    );
}

/// HMAC-SHA256 as the contract defines `X-Imgate-Signature`, computed independently of imgate.
fn hmac_hex(key: &str, body: &[u8]) -> String {
    let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key.as_bytes());
    let tag = ring::hmac::sign(&k, body);
    let hex: String = tag.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256={hex}")
}

#[test]
fn an_unreachable_reply_url_is_reported_without_echoing_the_url() {
    let dead = free_port(); // nothing listens here
    let url = format!("http://127.0.0.1:{dead}/reply?token=url-secret-31");
    let dir = temp_dir("deadurl");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, Some(&url), ""));
    let (mut x, cch) = d.bound_xagent();
    let a = x.tool(&cch, "imgate_message_send", json!({"text": "hi"}), "u1");
    assert_eq!(a["error"]["code"], "upstream_unreachable", "{a}");
    assert_no_secret(&a.to_string(), &["url-secret-31"], "a tool error");
    assert_no_secret(&d.log(), &["url-secret-31"], "the log");
}

#[test]
fn every_route_works_below_the_path_prefix_of_public_url() {
    use tungstenite::client::IntoClientRequest;
    let dir = temp_dir("prefix");
    let port = free_port();
    let conf = config_text(port, &dir, None, "").replace(
        "log_level = debug",
        &format!("log_level = debug\npublic_url = http://127.0.0.1:{port}/edge/imgate/"),
    );
    let d = Daemon::start(&dir, &conf);
    let (status, card) = http_get(&d.url("/edge/imgate/connector-card.json"), &[]);
    assert_eq!(status, 200);
    assert_card(&serde_json::from_str(&card).unwrap());
    assert_eq!(
        http_get(
            &d.url("/edge/imgate/health"),
            &[("Authorization", &format!("Bearer {API_KEY}"))]
        )
        .0,
        200
    );
    let (code, _) = http_post(
        &d.url("/edge/imgate/hooks/alerts"),
        &[("Authorization", &format!("Bearer {HOOK_SECRET}"))],
        &json!({"message_id": "p1", "sender_id": "u"}).to_string(),
    );
    assert_eq!(code, 202);
    let mut req = format!("ws://127.0.0.1:{port}/edge/imgate/ws")
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("Authorization", format!("Bearer {API_KEY}").parse().unwrap());
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", SUBPROTOCOL.parse().unwrap());
    let stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let (ws, _) = tungstenite::client(req, stream).expect("the data plane answers below the prefix too");
    let mut x = Sim::from_ws(ws);
    x.hello("");
}

#[test]
fn every_bearer_route_refuses_a_missing_or_wrong_key() {
    let dir = temp_dir("bearer");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let longer = format!("Bearer {API_KEY}x");
    let shorter = format!("Bearer {}", &API_KEY[..API_KEY.len() - 1]);
    let basic = format!("Basic {API_KEY}");
    let refused: [&[(&str, &str)]; 5] = [
        &[],
        &[("Authorization", "Bearer wrong")],
        &[("Authorization", &longer)],
        &[("Authorization", &shorter)],
        &[("Authorization", &basic)],
    ];
    for headers in refused {
        for path in ["/health", "/status", "/metrics"] {
            assert_eq!(http_get(&d.url(path), headers).0, 401, "GET {path} with {headers:?}");
        }
        let mut upload = headers.to_vec();
        upload.push(("X-XAgent-Connector-Channel-ID", "cch_any"));
        assert_eq!(
            http_post(&d.url("/files/uploads"), &upload, "").0,
            401,
            "POST /files/uploads with {headers:?}"
        );
    }
    for key in [None, Some("wrong"), Some(&API_KEY[1..])] {
        assert_eq!(
            try_connect(d.port, key, Some(SUBPROTOCOL)).err(),
            Some(401),
            "/ws with {key:?}"
        );
    }
    let key = format!("Bearer {API_KEY}");
    for path in ["/health", "/status", "/metrics"] {
        assert_eq!(http_get(&d.url(path), &[("Authorization", &key)]).0, 200, "GET {path}");
    }
}

#[test]
fn a_reply_url_that_accepts_and_never_answers_gets_the_tool_an_error_in_time() {
    // A receiver that takes the connection and then says nothing.
    let hang = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/hang", hang.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in hang.incoming() {
            held.push(conn); // kept open, never answered
        }
    });
    let dir = temp_dir("reply-hang");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, Some(&url), ""));
    let (mut x, cch) = d.bound_xagent();
    let (a, took) = x.timed_tool(
        &cch,
        "imgate_message_send",
        json!({"text": "anyone?"}),
        Duration::from_secs(40),
    );
    assert_eq!(a["error"]["code"], "upstream_unreachable", "{a}");
    assert!(
        took < Duration::from_secs(20),
        "the tool answered after {took:?}; the HTTP client gives up after 15 s"
    );
    assert!(!a.to_string().contains(&url), "the reply_url is not echoed: {a}");
}
