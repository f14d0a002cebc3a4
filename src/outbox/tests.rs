//! The outbox's unit tests against a real redb file in a scratch directory: order, caps and
//! overflow, TTL and expiry, dedupe across restarts, the log (checkpoints, crashes, tears,
//! corrupt records, resizes) and cursors.

use super::*;

fn store() -> Outbox {
    store_with(ROOMY)
}

fn store_with(p: Policy) -> Outbox {
    Outbox::open(store::temp_db("outbox").0, p).unwrap()
}

const ROOMY: Policy = Policy {
    max_messages_per_channel: 1000,
    max_bytes_per_channel: 1 << 20,
    max_bytes_total: 1 << 22,
    overflow: Overflow::DropOldest,
    log_file_bytes: wal::LOG_BYTES,
    max_delivered_ids: MAX_DELIVERED_IDS,
};

fn msg(id: &str, now: u64, ttl: u64) -> NewMessage {
    msg_in("hook:a", id, now, ttl)
}

fn msg_in(src: &str, id: &str, now: u64, ttl: u64) -> NewMessage {
    NewMessage {
        source: src.to_string(),
        message_id: id.to_string(),
        payload: format!("{{\"message_id\":\"{id}\"}}"),
        reply_ref: Some((
            format!("rr_{id}"),
            ReplyRef {
                source: src.to_string(),
                message_id: id.to_string(),
                expires_at: now + 2 * ttl,
                sender_id: None,
            },
        )),
        accepted_at: now,
        expires_at: now + ttl,
        cursors: Vec::new(),
    }
}

fn accepted(r: Result<Enqueued>) -> bool {
    matches!(r, Ok(Enqueued::Accepted { .. }))
}

fn ids_of(s: &Outbox, src: &str, now: u64) -> Vec<String> {
    s.pending(src, 1000, now)
        .unwrap()
        .into_iter()
        .map(|p| p.message.header.message_id)
        .collect()
}

fn counters(s: &Outbox, src: &str) -> Counters {
    s.stats()
        .unwrap()
        .into_iter()
        .find(|(k, _)| k == src)
        .map(|(_, c)| c)
        .unwrap_or_default()
}

/// The index must always agree with what the table holds.
fn assert_accounting(s: &Outbox) {
    let mut per: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
    let mut total = 0;
    s.shared
        .view(|read, _| {
            read.all_seq(Which::Messages, |src, _, v| {
                let b = record::bytes(src, v);
                let e = per.entry(src.to_string()).or_default();
                e.0 += 1;
                e.1 += b;
                total += b;
                true
            })
        })
        .unwrap();
    for (src, c) in s.stats().unwrap() {
        let (n, b) = per.get(&src).copied().unwrap_or_default();
        assert_eq!((c.pending, c.pending_bytes), (n, b), "counters of {src}");
    }
    assert_eq!(s.total_bytes(), total);
}

#[test]
fn a_read_within_a_byte_budget_stops_past_it_and_takes_one_message_at_least() {
    let s = store();
    for id in ["m1", "m2", "m3", "m4"] {
        assert!(accepted(s.enqueue(msg(id, 1000, 60_000))));
    }
    // Each payload is `{"message_id":"mN"}`, 19 bytes.
    let ids = |max: usize| -> Vec<String> {
        let p = s.pending_within("hook:a", 10, max, 1000).unwrap();
        p.into_iter().map(|p| p.message.header.message_id).collect()
    };
    assert_eq!(ids(1), ["m1"], "one at least");
    assert_eq!(ids(19), ["m1"]);
    assert_eq!(ids(20), ["m1", "m2"]);
    assert_eq!(ids(usize::MAX), ["m1", "m2", "m3", "m4"]);
    assert_eq!(s.pending_within("hook:a", 3, usize::MAX, 1000).unwrap().len(), 3);
}

#[test]
fn messages_come_out_in_acceptance_order_and_leave_only_when_delivered() {
    let s = store();
    for id in ["m1", "m2", "m3"] {
        assert!(accepted(s.enqueue(msg(id, 1000, 60_000))));
    }
    let p = s.pending("hook:a", 10, 1000).unwrap();
    assert_eq!(ids_of(&s, "hook:a", 1000), ["m1", "m2", "m3"]);
    s.mark_attempt_failed("hook:a", &[p[0].seq], "disconnected").unwrap();
    s.mark_delivered("hook:a", &[p[1].seq]).unwrap();
    let p = s.pending("hook:a", 10, 1000).unwrap();
    assert_eq!(p.len(), 2);
    assert_eq!(p[0].message.header.attempts, 1);
    assert_eq!(
        p[0].message.header.expires_at, 61_000,
        "a failed attempt never moves expires_at"
    );
    let c = counters(&s, "hook:a");
    assert_eq!(
        (c.delivered, c.attempts, c.last_error.as_deref()),
        (1, 1, Some("disconnected"))
    );
    assert_accounting(&s);
}

#[test]
fn a_message_refused_for_good_leaves_counted_failed_and_stays_a_duplicate() {
    let s = store();
    s.enqueue(msg("m1", 1000, 60_000)).unwrap();
    s.enqueue(msg("m2", 1000, 60_000)).unwrap();
    let p = s.pending("hook:a", 10, 1000).unwrap();
    s.mark_failed("hook:a", p[0].seq, "invalid_content", "no").unwrap();
    assert_eq!(ids_of(&s, "hook:a", 1000), ["m2"]);
    let c = counters(&s, "hook:a");
    assert_eq!((c.failed, c.delivered), (1, 0));
    assert_eq!(c.last_failure.as_deref(), Some("m1: invalid_content: no"));
    assert_eq!(s.enqueue(msg("m1", 2000, 60_000)).unwrap(), Enqueued::Duplicate);
    assert_accounting(&s);
    // Counters written before `failed` existed still read.
    let old: Tally =
        miniserde::json::from_str(r#"{"delivered":1,"expired":0,"evicted":0,"attempts":2,"last_error":null}"#).unwrap();
    assert_eq!((old.failed, old.attempts), (None, 2));
}

#[test]
fn a_repeated_message_id_is_a_duplicate_even_after_delivery_until_its_ttl() {
    let s = store();
    s.enqueue(msg("m1", 1000, 60_000)).unwrap();
    assert_eq!(
        s.enqueue(msg("m1", 1500, 60_000)).unwrap(),
        Enqueued::Duplicate,
        "while pending"
    );
    let p = s.pending("hook:a", 10, 1000).unwrap();
    s.mark_delivered("hook:a", &[p[0].seq]).unwrap();
    assert_eq!(
        s.enqueue(msg("m1", 2000, 60_000)).unwrap(),
        Enqueued::Duplicate,
        "after delivery"
    );
    assert!(s.pending("hook:a", 10, 2000).unwrap().is_empty());
    s.sweep_expired(60_999).unwrap();
    assert_eq!(delivered_kept(&s, "hook:a"), ["m1"], "kept until its expiry");
    // After the TTL the dedupe entry is gone and the ID is new again.
    s.sweep_expired(62_000).unwrap();
    assert!(delivered_kept(&s, "hook:a").is_empty());
    assert_eq!(s.index_report().0, 0, "nothing known");
    assert!(accepted(s.enqueue(msg("m1", 62_000, 60_000))));
}

#[test]
fn expired_messages_are_never_pending_and_the_sweep_counts_them_and_drops_their_reply_refs() {
    let s = store();
    s.enqueue(msg("old", 1000, 10)).unwrap();
    s.enqueue(msg("new", 1000, 60_000)).unwrap();
    assert_eq!(ids_of(&s, "hook:a", 2000), ["new"], "expiry on read");
    assert!(s.reply_ref("rr_old").unwrap().is_some());
    assert_eq!(s.sweep_expired(2000).unwrap(), 1);
    assert!(
        s.reply_ref("rr_old").unwrap().is_none(),
        "temporary state goes with the message"
    );
    assert!(s.reply_ref("rr_new").unwrap().is_some());
    let c = counters(&s, "hook:a");
    assert_eq!((c.pending, c.expired), (1, 1));
    assert_accounting(&s);
}

#[test]
fn enqueue_expires_the_head_of_its_source() {
    let s = store();
    s.enqueue(msg("old", 1000, 10)).unwrap();
    s.enqueue(msg("new", 5000, 60_000)).unwrap();
    assert_eq!(counters(&s, "hook:a").expired, 1);
    assert!(s.reply_ref("rr_old").unwrap().is_none());
    assert_accounting(&s);
}

#[test]
fn enqueue_expires_the_head_once_the_expiry_it_last_saw_there_has_passed() {
    let s = store();
    s.enqueue(msg("a", 1000, 100)).unwrap();
    // Reads the head ("a", until 1100): nothing to expire before then.
    s.enqueue(msg("b", 1050, 100)).unwrap();
    s.enqueue(msg("c", 1080, 100)).unwrap();
    assert_eq!(counters(&s, "hook:a").expired, 0);
    // Past 1100 and 1150: "a" and "b" go, "c" (until 1180) stays the head.
    s.enqueue(msg("d", 1160, 100)).unwrap();
    assert_eq!(counters(&s, "hook:a").expired, 2);
    assert_eq!(ids_of(&s, "hook:a", 1160), ["c", "d"]);
    assert_accounting(&s);
}

#[test]
fn drop_oldest_evicts_at_the_message_cap() {
    let s = store_with(Policy {
        max_messages_per_channel: 3,
        ..ROOMY
    });
    for i in 0..5 {
        s.enqueue(msg(&format!("m{i}"), 1000, 60_000)).unwrap();
    }
    assert_eq!(ids_of(&s, "hook:a", 1000), ["m2", "m3", "m4"]);
    assert_eq!(counters(&s, "hook:a").evicted, 2);
    assert!(s.reply_ref("rr_m0").unwrap().is_none());
    assert_accounting(&s);
}

#[test]
fn drop_oldest_evicts_at_the_channel_byte_cap() {
    let header = Header {
        message_id: "m0".into(),
        accepted_at: 1000,
        expires_at: 61_000,
        attempts: 0,
        reply_ref: Some("rr_m0".into()),
    };
    let one = record::bytes("hook:a", &record::encode(&header, "{\"message_id\":\"m0\"}"));
    let s = store_with(Policy {
        max_bytes_per_channel: one * 2,
        ..ROOMY
    });
    for i in 0..4 {
        s.enqueue(msg(&format!("m{i}"), 1000, 60_000)).unwrap();
    }
    assert_eq!(ids_of(&s, "hook:a", 1000), ["m2", "m3"]);
    assert_eq!(counters(&s, "hook:a").evicted, 2);
    assert!(counters(&s, "hook:a").pending_bytes <= one * 2);
    assert_accounting(&s);
}

#[test]
fn reject_new_refuses_at_each_cap_and_stores_nothing() {
    let p = Policy {
        max_messages_per_channel: 2,
        overflow: Overflow::RejectNew,
        ..ROOMY
    };
    let (db, _dir) = store::temp_db("outbox");
    let s = Outbox::open(db.clone(), p).unwrap();
    s.enqueue(msg("m0", 1000, 60_000)).unwrap();
    s.enqueue(msg("m1", 1000, 60_000)).unwrap();
    assert_eq!(s.enqueue(msg("m2", 1000, 60_000)).unwrap(), Enqueued::CapacityExceeded);
    assert!(s.reply_ref("rr_m2").unwrap().is_none());
    assert_eq!(ids_of(&s, "hook:a", 1000), ["m0", "m1"]);
    assert_eq!(s.enqueue(msg("m1", 1000, 60_000)).unwrap(), Enqueued::Duplicate);
    // accepted, duplicate, full, failed, stale: what /metrics shows for the provider.
    assert_eq!(s.intake_counts("hook"), [2, 1, 1, 0, 0, 0]);
    // Not deduped: the sender may retry once there is room.
    drop(s);
    let s = Outbox::open(
        db,
        Policy {
            max_messages_per_channel: 3,
            ..p
        },
    )
    .unwrap();
    assert!(accepted(s.enqueue(msg("m2", 1000, 60_000))));

    let s = store_with(Policy {
        max_bytes_total: 150,
        overflow: Overflow::RejectNew,
        ..ROOMY
    });
    s.enqueue(msg_in("hook:a", "a0", 1000, 60_000)).unwrap();
    assert_eq!(
        s.enqueue(msg_in("hook:b", "b0", 1000, 60_000)).unwrap(),
        Enqueued::CapacityExceeded
    );
    assert_eq!(counters(&s, "hook:a").evicted, 0);
    assert_accounting(&s);
}

/// At the caps every accept evicts: each eviction reads the queue from where the last one
/// ended, not from a head that every row evicted since the checkpoint lies behind.
#[test]
fn at_the_caps_each_eviction_starts_where_the_last_one_ended() {
    let s = store_with(Policy {
        max_messages_per_channel: 3,
        ..ROOMY
    });
    for i in 0..10 {
        assert!(accepted(s.enqueue(msg(&format!("m{i}"), 1000, 60_000))));
    }
    let first = s.shared.lock().index.source("hook:a").first_seq;
    let head = s.pending("hook:a", 1, 1000).unwrap()[0].seq;
    assert_eq!(first, head, "the next eviction starts at the head");
    assert_eq!(ids_of(&s, "hook:a", 1000), ["m7", "m8", "m9"]);
    assert_accounting(&s);
}

#[test]
fn the_total_cap_reclaims_expired_messages_before_it_refuses() {
    let one = {
        let tmp = store();
        tmp.enqueue(msg_in("hook:b", "b0", 1000, 10)).unwrap();
        tmp.total_bytes()
    };
    let s = store_with(Policy {
        max_bytes_total: one + one / 2,
        ..ROOMY
    });
    s.enqueue(msg_in("hook:b", "b0", 1000, 10)).unwrap();
    // b0 expired; a0 needs its room, in another source.
    let r = s.enqueue(msg_in("hook:a", "a0", 5000, 60_000)).unwrap();
    assert!(matches!(r, Enqueued::Accepted { .. }), "{r:?}");
    assert_eq!(counters(&s, "hook:b").expired, 1);
    // With drop_oldest, a full total cap held by another source refuses rather than
    // evicting someone else's messages.
    let r = s.enqueue(msg_in("hook:c", "c0", 5000, 60_000)).unwrap();
    assert_eq!(r, Enqueued::CapacityExceeded);
    assert_accounting(&s);
}

#[test]
fn drop_oldest_at_the_total_cap_evicts_from_the_new_messages_own_source() {
    let one = {
        let tmp = store();
        tmp.enqueue(msg_in("hook:a", "a0", 1000, 60_000)).unwrap();
        tmp.total_bytes()
    };
    let p = Policy {
        max_bytes_total: one * 3 + one / 2,
        ..ROOMY
    };
    let s = store_with(p);
    s.enqueue(msg_in("hook:b", "b0", 1000, 60_000)).unwrap();
    for i in 0..4 {
        assert!(accepted(s.enqueue(msg_in("hook:a", &format!("a{i}"), 1000, 60_000))));
    }
    assert_eq!(ids_of(&s, "hook:a", 1000), ["a2", "a3"]);
    assert_eq!(
        ids_of(&s, "hook:b", 1000),
        ["b0"],
        "another channel's messages are never evicted"
    );
    assert_eq!(counters(&s, "hook:a").evicted, 2);
    assert!(s.total_bytes() <= p.max_bytes_total);
    assert_accounting(&s);
}

#[test]
fn dedupe_state_survives_restart_and_is_bounded_per_source() {
    let p = Policy {
        max_messages_per_channel: 1,
        ..ROOMY
    }; // delivered_cap() = 1000
    let (db, dir) = store::temp_db("outbox");
    let s = Outbox::open(db, p).unwrap();
    for i in 0..1005 {
        s.enqueue(msg(&format!("d{i}"), 1000, 60_000)).unwrap();
        let seqs: Vec<u64> = s.pending("hook:a", 10, 1000).unwrap().iter().map(|p| p.seq).collect();
        s.mark_delivered("hook:a", &seqs).unwrap();
    }
    s.enqueue(msg("pending-one", 1000, 60_000)).unwrap();
    assert!(
        s.reply_ref("rr_d0").unwrap().is_none(),
        "reply refs leave with the trimmed log entry"
    );
    assert!(
        s.reply_ref("rr_d1004").unwrap().is_some(),
        "a delivered message can still be answered"
    );
    drop(s);
    let s = Outbox::open(Db::open(&dir).unwrap(), p).unwrap();
    assert_eq!(
        s.enqueue(msg("d1004", 2000, 60_000)).unwrap(),
        Enqueued::Duplicate,
        "delivered IDs persist"
    );
    assert_eq!(
        s.enqueue(msg("pending-one", 2000, 60_000)).unwrap(),
        Enqueued::Duplicate,
        "pending IDs persist"
    );
    // Only the newest 1000 delivered IDs are kept: the oldest ones are new again.
    assert!(accepted(s.enqueue(msg("d0", 2000, 60_000))));
    let mut kept = 0;
    s.shared
        .view(|read, _| {
            read.all_seq(Which::Delivered, |_, _, _| {
                kept += 1;
                true
            })
        })
        .unwrap();
    assert_eq!(kept, 1000);
    assert_accounting(&s);
}

/// Accepts `ids` in `src` and delivers them, a hundred at a time (one group commit each).
fn accept_and_deliver(s: &Outbox, src: &str, ids: impl Iterator<Item = String>, now: u64) {
    let ids: Vec<String> = ids.collect();
    for hundred in ids.chunks(100) {
        let tickets: Vec<Ticket> = hundred
            .iter()
            .map(|id| s.submit(msg_in(src, id, now, 60_000)))
            .collect();
        for t in tickets {
            assert!(accepted(t.wait()));
        }
        let seqs: Vec<u64> = s.pending(src, usize::MAX, now).unwrap().iter().map(|p| p.seq).collect();
        s.mark_delivered(src, &seqs).unwrap();
    }
}

fn delivered_kept(s: &Outbox, src: &str) -> Vec<String> {
    let mut kept = Vec::new();
    s.shared
        .view(|read, _| {
            read.source_delivered(src, 0, |_, v| {
                kept.push(record::parse_delivered(v).unwrap().2.to_string());
                true
            })
        })
        .unwrap();
    kept
}

#[test]
fn the_delivered_log_is_bounded_over_all_sources_and_the_source_holding_most_gives_way() {
    let s = store_with(Policy {
        max_messages_per_channel: 100, // delivered_cap() = 1000
        max_delivered_ids: 1500,
        ..ROOMY
    });
    accept_and_deliver(&s, "hook:a", (0..1000).map(|i| format!("a{i}")), 1000);
    accept_and_deliver(&s, "hook:b", (0..650).map(|i| format!("b{i}")), 1000);
    let (a, b) = (delivered_kept(&s, "hook:a"), delivered_kept(&s, "hook:b"));
    assert_eq!((a.len(), b.len()), (850, 650), "the busier source gave way");
    assert_eq!(a[0], "a150", "its oldest went");
    accept_and_deliver(&s, "hook:b", (650..1000).map(|i| format!("b{i}")), 1000);
    let (a, b) = (delivered_kept(&s, "hook:a"), delivered_kept(&s, "hook:b"));
    assert_eq!((a.len(), b.len()), (750, 750), "then each in turn");
    assert_eq!((a[0].as_str(), b[0].as_str()), ("a250", "b250"));
    assert!(
        s.reply_ref("rr_a249").unwrap().is_none(),
        "reply refs leave with their entries"
    );
    assert!(s.reply_ref("rr_a250").unwrap().is_some());
    assert!(
        accepted(s.enqueue(msg_in("hook:a", "a249", 2000, 60_000))),
        "forgotten: new again"
    );
    assert!(accepted(s.enqueue(msg_in("hook:b", "b249", 2000, 60_000))));
    for (src, id) in [("hook:a", "a250"), ("hook:b", "b250"), ("hook:b", "b999")] {
        assert_eq!(s.enqueue(msg_in(src, id, 2000, 60_000)).unwrap(), Enqueued::Duplicate);
    }
    let (ids, _, _) = s.index_report();
    assert_eq!(ids, 1500 + 2, "the index holds the kept entries and the two pending");
}

/// A v2 batch may be answered out of order: the later message delivered first, the earlier
/// after it. Both delivered-log entries still leave at their expiry, with their reply refs.
#[test]
fn delivered_entries_written_out_of_order_still_expire() {
    let s = store();
    s.enqueue(msg("first", 1000, 60_000)).unwrap();
    s.enqueue(msg("second", 1000, 60_000)).unwrap();
    let p = s.pending("hook:a", 10, 1000).unwrap();
    s.mark_delivered("hook:a", &[p[1].seq]).unwrap();
    s.sweep_expired(2000).unwrap();
    s.mark_failed("hook:a", p[0].seq, "rejected", "no").unwrap();
    assert_eq!(delivered_kept(&s, "hook:a"), ["first", "second"]);
    s.sweep_expired(61_000).unwrap();
    assert!(delivered_kept(&s, "hook:a").is_empty(), "both expired and went");
    assert!(s.reply_ref("rr_first").unwrap().is_none());
    assert_eq!(s.index_report().0, 0, "nothing known");
}

/// A delivered-log entry this version cannot read (written by a bug, or by a version to come)
/// confirms nothing: the sweep that passes it takes it with the expired ones before it.
#[test]
fn an_unreadable_delivered_entry_goes_with_the_expired_ones() {
    let (db, dir) = store::temp_db("outbox");
    let s = Outbox::open(db, ROOMY).unwrap();
    s.shared
        .write(true, |tx, _| tx.put_delivered("hook:a", 5, "garbage"))
        .unwrap();
    drop(s);
    let s = Outbox::open(Db::open(&dir).unwrap(), ROOMY).unwrap();
    s.enqueue(msg("m1", 1000, 60_000)).unwrap();
    let p = s.pending("hook:a", 10, 1000).unwrap();
    s.mark_delivered("hook:a", &[p[0].seq]).unwrap();
    let rows = || {
        let mut n = 0;
        s.shared
            .view(|read, _| {
                read.source_delivered("hook:a", 0, |_, _| {
                    n += 1;
                    true
                })
            })
            .unwrap();
        n
    };
    assert_eq!(rows(), 2);
    s.sweep_expired(61_000).unwrap();
    assert_eq!(rows(), 0, "both went");
    assert_eq!(s.index_report().0, 0);
    assert!(accepted(s.enqueue(msg("m1", 61_000, 60_000))));
    assert_accounting(&s);
}

/// Two IDs whose keyed hashes share the index's 24 bits (about one pair in 2^24; found by
/// trying): both are stored, each is still recognised, and a read of the stored ID tells them
/// apart, pending and delivered.
#[test]
fn ids_that_share_the_index_bits_are_both_kept_and_each_is_still_a_duplicate() {
    let s = store();
    let pair = {
        let st = s.shared.lock();
        let mut seen = std::collections::HashMap::new();
        (0u64..)
            .find_map(|i| {
                let id = format!("id-{i}");
                let tag = st.index.hash(&id) >> 40;
                seen.insert(tag, id.clone()).map(|other| (other, id))
            })
            .unwrap()
    };
    let (first, second) = (pair.0.as_str(), pair.1.as_str());
    assert!(accepted(s.enqueue(msg(first, 1000, 60_000))));
    let reads = s.index_report().2;
    assert!(
        accepted(s.enqueue(msg(second, 1000, 60_000))),
        "the second ID is not taken for the first"
    );
    assert_eq!(s.index_report().2, reads + 1, "one read told them apart");
    for id in [first, second] {
        assert_eq!(s.enqueue(msg(id, 1500, 60_000)).unwrap(), Enqueued::Duplicate);
    }
    let p = s.pending("hook:a", 10, 1500).unwrap();
    assert_eq!(p.len(), 2);
    s.mark_delivered("hook:a", &[p[0].seq]).unwrap();
    for id in [first, second] {
        assert_eq!(
            s.enqueue(msg(id, 2000, 60_000)).unwrap(),
            Enqueued::Duplicate,
            "one delivered, one pending: both recognised"
        );
    }
    // Past the TTL, before any sweep: the stored expiry says the ID is new again.
    assert!(accepted(s.enqueue(msg(first, 70_000, 60_000))));
    assert_eq!(ids_of(&s, "hook:a", 70_000), [first]);
    assert_accounting(&s);
}

/// What a process crash at this moment leaves behind: the files as the page cache holds
/// them (no outbox write runs while they are copied). `cut` truncates the log copy.
fn crash_copy(s: &Outbox, dir: &std::path::Path, cut: Option<u64>) -> Outbox {
    let to = crate::scratch::scratch_dir("crash");
    {
        let _no_writes = s.shared.lock();
        for f in ["imgate.redb", wal::FILES[0], wal::FILES[1]] {
            if dir.join(f).exists() {
                std::fs::copy(dir.join(f), to.join(f)).unwrap();
            }
        }
    }
    if let Some(len) = cut {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(to.join("outbox.log"))
            .unwrap();
        f.set_len(len).unwrap();
    }
    Outbox::open(Db::open(&to).unwrap(), s.shared.policy).unwrap()
}

/// Fifty accepts (one log record each), two deliveries and a failed attempt, nothing
/// checkpointed since the start.
fn logged_history() -> (Outbox, std::path::PathBuf) {
    let (db, dir) = store::temp_db("crash");
    let s = Outbox::open(db, ROOMY).unwrap();
    s.shared.hold_checkpoints();
    for i in 0..50 {
        assert!(accepted(s.enqueue(msg(&format!("m{i:02}"), 1000, 60_000))));
    }
    let p = s.pending("hook:a", 3, 1000).unwrap();
    s.mark_delivered("hook:a", &[p[0].seq, p[1].seq]).unwrap();
    s.mark_attempt_failed("hook:a", &[p[2].seq], "disconnected").unwrap();
    s.shared.flush_log();
    (s, dir)
}

#[test]
fn a_log_written_at_another_size_is_replayed_whole_and_made_at_the_new_size() {
    let (s, dir) = logged_history();
    let checkpoints = s.log_report().checkpoints;
    // Past what the new size would read: 300 KB more in the 2 MiB log.
    for i in 0..150 {
        let mut m = msg(&format!("big{i:03}"), 1000, 60_000);
        m.payload = "b".repeat(2000);
        assert!(accepted(s.enqueue(m)));
    }
    s.shared.flush_log();
    assert_eq!(s.log_report().checkpoints, checkpoints, "all of it only in the log");
    let before = ids_of(&s, "hook:a", 1000);
    assert!(before.last().is_some_and(|id| id == "big149"), "{before:?}");
    let to = crate::scratch::scratch_dir("resized");
    {
        let _no_writes = s.shared.lock();
        for f in ["imgate.redb", wal::FILES[0], wal::FILES[1]] {
            std::fs::copy(dir.join(f), to.join(f)).unwrap();
        }
    }
    let small = Policy {
        log_file_bytes: wal::MIN_LOG_BYTES,
        ..ROOMY
    };
    let r = Outbox::open(Db::open(&to).unwrap(), small).unwrap();
    let same = crash_copy(&s, &dir, None).log_report().replayed;
    assert!(same >= 50, "{same}");
    assert_eq!(r.log_report().replayed, same, "every record of the 2 MiB file");
    assert_eq!(ids_of(&r, "hook:a", 1000), before);
    // Messages go on: the small log fills, checkpoints and is recycled, each file made
    // again at the new size when its turn comes.
    for i in 0..400 {
        assert!(accepted(r.enqueue(msg(&format!("n{i:03}"), 1000, 60_000))));
    }
    assert!(r.log_report().checkpoints > 1);
    for f in wal::FILES {
        assert_eq!(std::fs::metadata(to.join(f)).unwrap().len(), wal::MIN_LOG_BYTES, "{f}");
    }
    drop(r);
    let r = Outbox::open(Db::open(&to).unwrap(), small).unwrap();
    assert_eq!(ids_of(&r, "hook:a", 1000).len(), before.len() + 400);
}

#[test]
fn a_delivery_held_in_memory_when_the_process_dies_is_delivered_again() {
    let (db, dir) = store::temp_db("held");
    let s = Outbox::open(db, ROOMY).unwrap();
    for i in 0..3 {
        assert!(accepted(s.enqueue(msg(&format!("m{i}"), 1000, 60_000))));
    }
    let p = s.pending("hook:a", 1, 1000).unwrap();
    s.mark_delivered("hook:a", &[p[0].seq]).unwrap();
    assert_eq!(ids_of(&s, "hook:a", 1000), ["m1", "m2"]);
    // Its record waits for the next synced append (or `HOLD`): a crash now loses it, and
    // the message comes again, with its ID (at least once, as after a power cut).
    let r = crash_copy(&s, &dir, None);
    assert_eq!(ids_of(&r, "hook:a", 1000), ["m0", "m1", "m2"]);
    // The next accept takes it to the disk.
    assert!(accepted(s.enqueue(msg("m3", 1000, 60_000))));
    let r = crash_copy(&s, &dir, None);
    assert_eq!(ids_of(&r, "hook:a", 1000), ["m1", "m2", "m3"]);
}

#[test]
fn after_a_crash_the_log_restores_every_accept_delivery_and_count() {
    let (s, dir) = logged_history();
    let r = crash_copy(&s, &dir, None);
    r.shared.hold_checkpoints();
    assert_eq!(r.log_report().replayed, 52, "every record came back from the log");
    assert_eq!(r.log_report().unreadable, 0);
    assert_eq!(ids_of(&r, "hook:a", 1000), ids_of(&s, "hook:a", 1000));
    assert_eq!(counters(&r, "hook:a"), counters(&s, "hook:a"));
    assert_eq!(r.pending("hook:a", 1, 1000).unwrap()[0].message.header.attempts, 1);
    assert_eq!(
        r.enqueue(msg("m00", 2000, 60_000)).unwrap(),
        Enqueued::Duplicate,
        "delivered"
    );
    assert_eq!(
        r.enqueue(msg("m49", 2000, 60_000)).unwrap(),
        Enqueued::Duplicate,
        "pending"
    );
    assert!(r.reply_ref("rr_m01").unwrap().is_some());
    assert_accounting(&r);
    assert!(accepted(r.enqueue(msg("m50", 2000, 60_000))));
    // The replay was a checkpoint: a second crash replays only what came after it.
    let dir_r = r.shared.db.dir().to_path_buf();
    let again = crash_copy(&r, &dir_r, None);
    assert_eq!(again.log_report().replayed, 1, "only the accept made since");
    assert_eq!(ids_of(&again, "hook:a", 1000), ids_of(&r, "hook:a", 1000));
}

#[test]
fn a_checkpoint_is_due_only_once_the_log_holds_512_kib() {
    let (db, _dir) = store::temp_db("due");
    let s = Outbox::open(db, ROOMY).unwrap();
    assert_eq!(s.shared.upkeep_due(), None, "an empty log needs no checkpoint");
    assert!(accepted(s.enqueue(msg("a", 1000, 60_000))));
    assert_eq!(s.shared.upkeep_due(), None, "no timer: one record waits for more");
    // 8 KB messages: the committer checkpoints by itself once 512 KiB are logged.
    let before = s.log_report().checkpoints;
    let mut sent = 0;
    while sent < 200 {
        sent += 1;
        assert!(accepted(s.enqueue(big(&format!("b{sent}"), 8000))));
        if s.log_report().checkpoints > before
            || s.shared.upkeep_due() == Some(Duration::ZERO)
            || s.shared.checkpoint_in_flight()
        {
            break;
        }
    }
    assert!((60..=70).contains(&sent), "due after {sent} messages of 8 KB");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while s.log_report().checkpoints == before {
        assert!(
            std::time::Instant::now() < deadline,
            "the committer checkpoints by itself"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(s.shared.upkeep_due(), None, "the log is empty again");
}

/// A message of `bytes` bytes of payload.
fn big(id: &str, bytes: usize) -> NewMessage {
    NewMessage {
        payload: "x".repeat(bytes),
        ..msg(id, 1000, 60_000)
    }
}

/// Accepts of 4 KB until a checkpoint is due, then waits for the committer to start it (it
/// is held at `checkpoint_gate`); how many were sent, all of them in what it writes.
fn fill_until_a_checkpoint_starts(s: &Outbox, prefix: &str) -> usize {
    let mut sent = 0;
    while s.shared.upkeep_due() != Some(Duration::ZERO) && !s.shared.checkpoint_in_flight() {
        assert!(sent < 400, "no checkpoint due after {sent} messages of 4 KB");
        sent += 1;
        assert!(accepted(s.enqueue(big(&format!("{prefix}{sent:03}"), 4000))));
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !s.shared.checkpoint_in_flight() {
        assert!(
            std::time::Instant::now() < deadline,
            "the committer starts the checkpoint"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    sent
}

#[test]
fn accepts_and_deliveries_go_on_during_a_checkpoint_and_a_crash_meanwhile_loses_nothing() {
    let (db, dir) = store::temp_db("inflight");
    let s = Outbox::open(db.clone(), ROOMY).unwrap();
    let gate = s.shared.checkpoint_gate.clone();
    let held = gate.lock().unwrap();
    let checkpoints = s.log_report().checkpoints;
    let before = fill_until_a_checkpoint_starts(&s, "a");
    // While the checkpoint waits at the gate: new accepts (into the other log file), and
    // deliveries of messages it is writing and of one accepted since.
    for i in 0..20 {
        assert!(accepted(s.enqueue(msg(&format!("n{i:02}"), 1000, 60_000))));
    }
    let p = s.pending("hook:a", 1000, 1000).unwrap();
    assert_eq!(p.len(), before + 20);
    s.mark_delivered("hook:a", &[p[0].seq, p[1].seq, p[before].seq])
        .unwrap();
    let live = ids_of(&s, "hook:a", 1000);
    assert_eq!(live.len(), before + 17);
    assert!(s.shared.checkpoint_in_flight(), "it still waits");
    // The deliveries' records, held for a sync, written as `wal::HOLD` after them would.
    s.shared.flush_log();
    let r = crash_copy(&s, &dir, None);
    assert_eq!(ids_of(&r, "hook:a", 1000), live, "a crash replays both files");
    assert_accounting(&r);
    drop(r);

    drop(held);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while s.shared.checkpoint_in_flight() {
        assert!(std::time::Instant::now() < deadline, "the checkpoint ends");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(s.log_report().checkpoints, checkpoints + 1);
    assert_eq!(ids_of(&s, "hook:a", 1000), live, "the same after it");
    assert_eq!(
        s.shared.overlay_messages(),
        19,
        "the overlay holds only what came since: the 19 accepted and still pending"
    );
    s.shared.flush_log();
    let r = crash_copy(&s, &dir, None);
    assert_eq!(ids_of(&r, "hook:a", 1000), live, "and after a crash now");
    assert_accounting(&r);
    drop(r);
    // The two delivered while it ran are removed from redb by the next checkpoint.
    s.shared.checkpoint();
    let in_redb = db
        .read(|txn| {
            use redb::ReadableTableMetadata;
            Ok(txn.open_table(tables::MESSAGES)?.len()?)
        })
        .unwrap();
    assert_eq!(in_redb as usize, live.len());
    assert_accounting(&s);
}

#[test]
fn a_checkpoint_that_fails_in_flight_loses_nothing_and_the_next_writes_it_all() {
    let (db, dir) = store::temp_db("inflight-fail");
    let s = Outbox::open(db.clone(), ROOMY).unwrap();
    let gate = s.shared.checkpoint_gate.clone();
    let mut held = gate.lock().unwrap();
    let before = fill_until_a_checkpoint_starts(&s, "a");
    for i in 0..5 {
        assert!(accepted(s.enqueue(msg(&format!("n{i}"), 1000, 60_000))));
    }
    let (commits, checkpoints) = (db.commits(), s.log_report().checkpoints);
    *held = true;
    drop(held);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while s.shared.checkpoint_in_flight() {
        assert!(std::time::Instant::now() < deadline, "the checkpoint ends");
        std::thread::sleep(Duration::from_millis(2));
    }
    let retried = || s.log_report().checkpoints > checkpoints;
    match s.shared.upkeep_due() {
        Some(due) => assert!(due > Duration::ZERO, "a retry after a pause, not at once"),
        None => assert!(retried(), "a retry is due unless it was made already"),
    }
    let live = ids_of(&s, "hook:a", 1000);
    assert_eq!(live.len(), before + 5);
    // Both files hold records redb lacks (or, once retried, redb holds all): a crash now
    // loses nothing either way.
    let r = crash_copy(&s, &dir, None);
    assert_eq!(ids_of(&r, "hook:a", 1000), live);
    drop(r);
    // The committer retries by itself, in place (the other file is not free): one commit
    // writes them all.
    while !retried() {
        assert!(std::time::Instant::now() < deadline, "the checkpoint is retried");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(db.commits(), commits + 1);
    assert!(!s.shared.checkpoint_in_flight());
    assert_eq!(s.shared.overlay_messages(), 0);
    let in_redb = db
        .read(|txn| {
            use redb::ReadableTableMetadata;
            Ok(txn.open_table(tables::MESSAGES)?.len()?)
        })
        .unwrap();
    assert_eq!(in_redb as usize, live.len());
    let r = crash_copy(&s, &dir, None);
    assert_eq!(ids_of(&r, "hook:a", 1000), live);
    assert_eq!(r.log_report().replayed, 0, "nothing left to replay");
    assert_accounting(&r);
}

#[test]
fn when_the_second_log_file_cannot_be_made_the_checkpoint_is_made_in_place_and_loses_nothing() {
    let (db, dir) = store::temp_db("nospare");
    // A directory where the second file is made: it cannot be, as on a full disk.
    std::fs::create_dir_all(dir.join(format!("{}.tmp", wal::FILES[1]))).unwrap();
    let s = Outbox::open(db, ROOMY).unwrap();
    let checkpoints = s.log_report().checkpoints;
    let mut sent = 0;
    while s.log_report().checkpoints == checkpoints {
        assert!(sent < 400, "no checkpoint after {sent} messages of 4 KB");
        sent += 1;
        assert!(accepted(s.enqueue(big(&format!("a{sent:03}"), 4000))));
    }
    assert!(!s.shared.checkpoint_in_flight());
    assert!(
        s.shared.upkeep_due().is_none(),
        "done, not failed: {:?}",
        s.shared.upkeep_due()
    );
    let live = ids_of(&s, "hook:a", 1000);
    assert_eq!(live.len(), sent);
    let r = crash_copy(&s, &dir, None);
    assert_eq!(ids_of(&r, "hook:a", 1000), live);
    assert_accounting(&r);
}

#[test]
fn a_message_accepted_and_delivered_between_checkpoints_never_reaches_redb() {
    let (db, dir) = store::temp_db("hot");
    let s = Outbox::open(db.clone(), ROOMY).unwrap();
    let commits = db.commits();
    for id in ["m1", "m2", "m3"] {
        assert!(accepted(s.enqueue(msg(id, 1000, 60_000))));
    }
    let p = s.pending("hook:a", 10, 1000).unwrap();
    s.mark_delivered("hook:a", &[p[0].seq, p[1].seq]).unwrap();
    s.mark_attempt_failed("hook:a", &[p[2].seq], "disconnected").unwrap();
    s.sweep_expired(1000).unwrap();
    assert_eq!(
        db.commits(),
        commits,
        "accepts, deliveries and sweeps commit nothing to redb"
    );
    assert_eq!(
        s.shared.overlay_messages(),
        1,
        "only the pending message waits for redb"
    );
    s.shared.checkpoint();
    assert_eq!(db.commits(), commits + 1, "one commit for the checkpoint");
    assert_eq!(s.log_report().checkpointed_messages, 1);
    let in_redb: Vec<u64> = db
        .read(|txn| {
            use redb::ReadableTable;
            let table = txn.open_table(tables::MESSAGES)?;
            let seqs = table.iter()?.map(|r| Ok(r?.0.value().1)).collect();
            seqs
        })
        .unwrap();
    assert_eq!(in_redb, [p[2].seq], "m1 and m2 were never written");
    s.shared.checkpoint();
    assert_eq!(db.commits(), commits + 1, "nothing logged since: no commit");
    drop((s, db));
    let r = Outbox::open(Db::open(&dir).unwrap(), ROOMY).unwrap();
    assert_eq!(r.log_report().replayed, 0, "a clean stop leaves nothing to replay");
    assert_eq!(ids_of(&r, "hook:a", 1000), ["m3"]);
    assert_eq!(r.enqueue(msg("m1", 2000, 60_000)).unwrap(), Enqueued::Duplicate);
    assert_eq!(counters(&r, "hook:a").delivered, 2);
    assert!(
        r.reply_ref("rr_m1").unwrap().is_some(),
        "a delivered message can be answered"
    );
}

#[test]
fn reads_after_a_checkpoint_start_at_the_head_not_at_the_rows_delivered_since() {
    let s = store();
    for i in 0..100 {
        assert!(accepted(s.enqueue(msg(&format!("m{i:03}"), 1000, 60_000))));
    }
    s.shared.checkpoint();
    let seqs: Vec<u64> = s.pending("hook:a", 99, 1000).unwrap().iter().map(|p| p.seq).collect();
    s.mark_delivered("hook:a", &seqs).unwrap();
    assert_eq!(ids_of(&s, "hook:a", 1000), ["m099"]);
    let first = s.shared.lock().index.source("hook:a").first_seq;
    assert!(
        first > seqs[98],
        "the next read starts past the 99 delivered rows redb still holds"
    );
    assert!(accepted(s.enqueue(msg("m100", 1000, 60_000))));
    assert_eq!(ids_of(&s, "hook:a", 1000), ["m099", "m100"]);
    assert_accounting(&s);
}

#[test]
fn cursors_read_back_what_the_last_change_moved_before_and_after_a_checkpoint() {
    let (db, _dir) = store::temp_db("cursor");
    let s = Outbox::open(db, ROOMY).unwrap();
    let mut m = msg("c1", 1000, 60_000);
    m.cursors = vec![Cursor::Forward("off".into(), 7), Cursor::Set("buf".into(), "a".into())];
    assert!(accepted(s.enqueue(m)));
    s.move_cursors(&[Cursor::Forward("off".into(), 5), Cursor::Set("buf".into(), "b".into())])
        .unwrap();
    assert_eq!(s.cursor("off").unwrap().as_deref(), Some("7"), "forward only");
    assert_eq!(s.cursor("buf").unwrap().as_deref(), Some("b"));
    s.shared.checkpoint();
    assert_eq!(s.cursor("buf").unwrap().as_deref(), Some("b"));
    assert_eq!(s.cursor("off").unwrap().as_deref(), Some("7"));
}

#[test]
fn a_torn_log_keeps_exactly_the_whole_records_before_the_tear() {
    let (s, dir) = logged_history();
    let live = ids_of(&s, "hook:a", 1000);
    let full = s.shared.lock().log_used();
    let mut last_kept = 0;
    // Records never cross a page, so one starts each page: 100 bytes in is inside it.
    let page = wal::PAGE;
    for cut in [0, 1, 15, 16, 17, page + 100, 2 * page + 100, full - 5, full - 1] {
        let r = crash_copy(&s, &dir, Some(cut));
        let ids = ids_of(&r, "hook:a", 1000);
        let report = r.log_report();
        // Accepts are the first 50 records, then the delivery of m00 and m01: what survives
        // is the accepts before the cut, without the two once their delivery survived too.
        let all: Vec<String> = (0..50).map(|i| format!("m{i:02}")).collect();
        let start = all.iter().position(|id| Some(id) == ids.first()).unwrap_or(0);
        assert!(start == 0 || start == 2, "cut at {cut}: {ids:?}");
        assert_eq!(ids[..], all[start..start + ids.len()], "cut at {cut}");
        assert!(start + ids.len() >= last_kept, "cut at {cut}");
        last_kept = start + ids.len();
        assert_eq!(report.unreadable, u64::from(cut != 0), "cut at {cut}: {report:?}");
        assert_accounting(&r);
    }
    assert_eq!(last_kept, 50, "a cut in the last record loses that record only");
    let r = crash_copy(&s, &dir, Some(full));
    assert_eq!(ids_of(&r, "hook:a", 1000), live);
    assert_eq!(r.log_report().unreadable, 0);
}

#[test]
fn a_corrupt_record_stops_the_replay_there_and_is_counted() {
    let (s, dir) = logged_history();
    let r = {
        let to = crate::scratch::scratch_dir("flip");
        let _no_writes = s.shared.lock();
        std::fs::copy(dir.join("imgate.redb"), to.join("imgate.redb")).unwrap();
        let mut log = std::fs::read(dir.join("outbox.log")).unwrap();
        log[2000] ^= 0x40;
        std::fs::write(to.join("outbox.log"), log).unwrap();
        drop(_no_writes);
        Outbox::open(Db::open(&to).unwrap(), ROOMY).unwrap()
    };
    let ids = ids_of(&r, "hook:a", 1000);
    assert!(!ids.is_empty() && ids.len() < 50, "{} kept", ids.len());
    assert_eq!(r.log_report().unreadable, 1);
    assert!(accepted(r.enqueue(msg("new", 2000, 60_000))), "the outbox works on");
    assert_accounting(&r);
}

#[test]
fn the_other_log_file_is_cleared_after_a_replay_that_stopped_short_and_otherwise_left_alone() {
    let (s, dir) = logged_history();
    // Both files hold the same 50 records: a copy of the log in place of the other file.
    let start_with = |flip: bool| {
        let to = crate::scratch::scratch_dir("spare");
        let _no_writes = s.shared.lock();
        std::fs::copy(dir.join("imgate.redb"), to.join("imgate.redb")).unwrap();
        let mut log = std::fs::read(dir.join(wal::FILES[0])).unwrap();
        if flip {
            log[2000] ^= 0x40;
        }
        std::fs::write(to.join(wal::FILES[0]), &log).unwrap();
        std::fs::write(to.join(wal::FILES[1]), &log).unwrap();
        drop(_no_writes);
        let r = Outbox::open(Db::open(&to).unwrap(), ROOMY).unwrap();
        let spare = std::fs::read(to.join(wal::FILES[1])).unwrap();
        (r, log, spare)
    };
    let records = |bytes: &[u8]| {
        wal::scan(bytes, wal::LOG_BYTES, |_, _| Ok::<_, ()>(()))
            .unwrap()
            .records
    };

    let (r, log, spare) = start_with(false);
    assert_eq!(r.log_report().unreadable, 0);
    assert_eq!(
        spare, log,
        "all of it is in redb now and numbered below what comes next"
    );
    let (r, log, spare) = start_with(true);
    assert_eq!(r.log_report().unreadable, 1);
    assert!(records(&log) > 0);
    assert_eq!(
        records(&spare),
        0,
        "what lies past the stop can never pass for a later record"
    );
}

#[test]
fn a_change_too_large_for_the_log_is_committed_durably_instead() {
    let big = Policy {
        max_bytes_per_channel: 8 << 20,
        max_bytes_total: 8 << 20,
        ..ROOMY
    };
    let (db, dir) = store::temp_db("big");
    let s = Outbox::open(db, big).unwrap();
    s.shared.hold_checkpoints();
    let mut m = msg("huge", 1000, 60_000);
    m.payload = "x".repeat(wal::LOG_BYTES as usize + 1);
    let before = s.log_report().checkpoints;
    assert!(accepted(s.enqueue(m)));
    assert_eq!(s.log_report().checkpoints, before + 1, "the commit was the checkpoint");
    assert!(
        accepted(s.enqueue(msg("small", 1000, 60_000))),
        "the log takes the next one"
    );
    let r = crash_copy(&s, &dir, None);
    assert_eq!(ids_of(&r, "hook:a", 1000), ["huge", "small"]);
}

#[test]
fn concurrent_enqueues_all_commit_and_keep_per_source_order() {
    let s = std::sync::Arc::new(store());
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let s = s.clone();
            std::thread::spawn(move || {
                for i in 0..50 {
                    let src = format!("hook:t{t}");
                    assert!(accepted(s.enqueue(msg_in(&src, &format!("{i:03}"), 1000, 60_000))));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for t in 0..8 {
        let ids = ids_of(&s, &format!("hook:t{t}"), 1000);
        let want: Vec<String> = (0..50).map(|i| format!("{i:03}")).collect();
        assert_eq!(ids, want);
    }
    assert_accounting(&s);
}

#[test]
fn a_reply_reference_an_older_imgate_stored_reads_without_its_sender() {
    let old: ReplyRef = miniserde::json::from_str(r#"{"source":"s:k","message_id":"m1","expires_at":5}"#)
        .expect("a reference without sender_id still reads");
    assert_eq!((old.message_id.as_str(), old.sender_id), ("m1", None));
}
