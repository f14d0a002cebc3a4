//! `tool.invoke`: the checks every provider shares (the channel's binding, the Card's tools, the
//! arguments, `reply_ref` and `file_ref` ownership), the answer to a repeated `tool_call_id`,
//! and the provider's `send`. Owns the `tool_calls` table.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use redb::TableDefinition;

use super::Plane;
use crate::files::FileRecord;
use crate::ids;
use crate::json::{self, obj, s, Object, Value};
use crate::outbox::ReplyRef;
use crate::protocol::{code, TOOL_FILE_SEND, TOOL_REPLY};
use crate::providers::{Failure, Outbound};
use crate::source::Source;
use crate::store::{self, Db};
use std::path::PathBuf;

/// `channel:tool:tool_call_id` → `ToolCall` JSON.
const TOOL_CALLS: TableDefinition<&str, &str> = TableDefinition::new("tool_calls");
/// Successful tool results are kept this long to answer a repeated `tool_call_id` (xAgent
/// retries within seconds); the maintenance sweep removes them afterwards.
const RESULT_TTL_MS: u64 = 3600 * 1000;

#[derive(miniserde::Serialize, miniserde::Deserialize)]
struct ToolCall {
    result: String,
    expires_at: u64,
}

/// Results of tool calls, by call, for as long as xAgent may repeat one; and the calls running.
pub struct ToolResults {
    db: Arc<Db>,
    /// Keys of the calls running now. A call answered at the session's deadline may still be
    /// running on its thread: a repeat of it waits for it (`busy`) instead of sending twice.
    running: Mutex<HashSet<String>>,
}

/// A running call's key in `ToolResults::running`, removed when the call ends.
struct Running<'a> {
    results: &'a ToolResults,
    key: String,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.results.lock().remove(&self.key);
    }
}

impl ToolResults {
    pub fn open(db: Arc<Db>) -> store::Result<ToolResults> {
        db.write(|txn| {
            txn.open_table(TOOL_CALLS)?;
            Ok(())
        })?;
        Ok(ToolResults {
            db,
            running: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks the call `key` running; `None` while an earlier call with it still runs.
    fn claim(&self, key: &str) -> Option<Running<'_>> {
        self.lock().insert(key.to_string()).then(|| Running {
            results: self,
            key: key.to_string(),
        })
    }

    fn get(&self, key: &str) -> store::Result<Option<String>> {
        let now = ids::now_ms();
        self.db.read(|txn| {
            let Some(v) = txn.open_table(TOOL_CALLS)?.get(key)? else {
                return Ok(None);
            };
            let rec: ToolCall = miniserde::json::from_str(v.value()).map_err(|_| store::corrupt("tool result"))?;
            Ok((rec.expires_at > now).then_some(rec.result))
        })
    }

    fn save(&self, key: &str, result: &str) -> store::Result<()> {
        let rec = ToolCall {
            result: result.to_string(),
            expires_at: ids::now_ms() + RESULT_TTL_MS,
        };
        self.db.write(|txn| {
            txn.open_table(TOOL_CALLS)?
                .insert(key, miniserde::json::to_string(&rec).as_str())?;
            Ok(())
        })
    }

    /// Drops results past their expiry; returns how many went.
    pub fn sweep(&self, now: u64) -> store::Result<u64> {
        self.db.write(|txn| {
            let mut n = 0;
            txn.open_table(TOOL_CALLS)?.retain(|_, v| {
                let keep = miniserde::json::from_str::<ToolCall>(v).is_ok_and(|r| r.expires_at > now);
                n += u64::from(!keep);
                keep
            })?;
            Ok(n)
        })
    }
}

fn required<'a>(args: &'a Object, key: &str) -> Result<&'a str, Failure> {
    json::get_str(args, key).ok_or_else(|| Failure::new(code::INVALID_ARGUMENTS, format!("`{key}` is required")))
}

fn text(args: &Object) -> Result<&str, Failure> {
    json::get_str(args, "text")
        .filter(|t| !t.trim().is_empty())
        .ok_or_else(|| {
            Failure::new(
                code::INVALID_ARGUMENTS,
                "`text` is required and must be a non-empty string",
            )
        })
}

/// Repeated calls are xAgent's to make as often as it likes: one line a minute.
static REPEATED_CALLS: crate::quiet::Site = crate::quiet::Site::new();

/// Runs a tool on channel `cch`; blocking (the provider's call), so never on the executor.
pub fn run(plane: &Plane, cch: &str, tool_id: &str, args: &Object, call_id: Option<&str>) -> Result<Value, Failure> {
    let rec = plane.channels.channel(cch).map_err(Failure::storage)?;
    let Some(source) = rec.and_then(|r| r.source()) else {
        return Err(Failure::new(
            code::CONNECTION_NOT_AUTHENTICATED,
            "the channel is not bound; complete an auth flow first",
        ));
    };
    // A repeated tool_call_id answers with the first result and sends nothing; while the first
    // still runs, it is `busy`.
    let key = call_id.map(|c| format!("{cch}:{tool_id}:{c}"));
    let _running = match key.as_deref() {
        Some(k) => Some(plane.tool_results.claim(k).ok_or_else(|| {
            Failure::temporary(
                code::BUSY,
                "the first call with this tool_call_id is still running; try again",
            )
        })?),
        None => None,
    };
    if let Some(first) = key
        .as_deref()
        .map(|k| first_result(plane, k, tool_id))
        .transpose()?
        .flatten()
    {
        return Ok(first);
    }
    if !plane.providers.tools().contains(&tool_id) {
        return Err(Failure::new(
            code::UNKNOWN_TOOL,
            format!("tool `{tool_id}` is not declared by this connector"),
        ));
    }
    let provider = plane
        .providers
        .of(&source)
        .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the channel's provider is not enabled"))?;
    let idempotency_key = key.clone().unwrap_or_else(|| ids::token("call_"));
    let mut out = Outbound {
        text: "",
        reply_to: None,
        reply_sender: None,
        files: &[],
        idempotency_key: &idempotency_key,
        message_id: None,
        streamed: None,
    };
    let can = || match provider.declaration().tools.contains(&tool_id) {
        true => Ok(()),
        false => Err(Failure::new(
            code::CHANNEL_UNAVAILABLE,
            format!("this channel cannot use {tool_id}"),
        )),
    };
    let (file, reply_to);
    match tool_id {
        TOOL_FILE_SEND => {
            let file_ref = required(args, "file_ref")?;
            can()?;
            file = file_of(plane, file_ref, &source)?;
            out.files = std::slice::from_ref(&file);
            out.text = json::get_str(args, "caption").unwrap_or("");
        }
        TOOL_REPLY => {
            reply_to = answered(plane, required(args, "reply_ref")?, &source)?;
            can()?;
            out.reply_to = Some(&reply_to.message_id);
            out.reply_sender = reply_to.sender_id.as_deref();
            out.text = text(args)?;
        }
        _ => {
            can()?;
            out.text = text(args)?;
        }
    }
    let message_id = provider.send(&source, &out)?;
    // The IM system took it and the result is not kept yet: a crash here makes xAgent's retry
    // reach the provider again (its idempotency key is the same).
    crate::faults::crash_at("tool-sent");
    let result = obj([("status", s("sent")), ("message_id", s(message_id))]);
    if let Some(k) = &key {
        if let Err(e) = plane.tool_results.save(k, &json::to_string(&result)) {
            log::error!("data plane: cannot remember result of {tool_id}: {e}");
        }
    }
    Ok(result)
}

/// The result of the first call under `key`, if there was one.
fn first_result(plane: &Plane, key: &str, tool_id: &str) -> Result<Option<Value>, Failure> {
    let Some(prev) = plane.tool_results.get(key).map_err(Failure::storage)? else {
        return Ok(None);
    };
    if let Some(more) = REPEATED_CALLS.admit() {
        let tool = crate::quiet::shown(tool_id);
        log::info!("data plane: {tool} call repeated; answering with the first result{more}");
    }
    json::parse(&prev)
        .map(Some)
        .map_err(|_| Failure::new(code::TOOL_INVOKE_FAILED, "stored result is unreadable"))
}

/// The file uploaded for this channel under `file_ref`, and where its bytes are.
fn file_of(plane: &Plane, file_ref: &str, source: &Source) -> Result<(FileRecord, PathBuf), Failure> {
    plane
        .files
        .get(file_ref)
        .map_err(Failure::storage)?
        .filter(|(r, _)| r.direction == "out" && r.source == source.as_str())
        .ok_or_else(|| {
            Failure::new(
                code::FILE_REF_INVALID,
                "file_ref is unknown, expired or was uploaded for another channel",
            )
        })
}

/// The message `reply_ref` answers, if it is this channel's and current.
fn answered(plane: &Plane, reply_ref: &str, source: &Source) -> Result<ReplyRef, Failure> {
    plane
        .outbox
        .reply_ref(reply_ref)
        .map_err(Failure::storage)?
        .filter(|r| r.source == source.as_str() && r.expires_at > ids::now_ms())
        .ok_or_else(|| {
            Failure::new(
                code::REPLY_REF_INVALID,
                "reply_ref is unknown, expired or belongs to another channel",
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::testing::{plane_with, StandIn};
    use crate::json::obj;
    use crate::protocol::TOOL_SEND;
    use std::sync::Arc;

    fn args(text: &str) -> Object {
        match obj([("text", s(text))]) {
            Value::Object(o) => o,
            _ => unreachable!(),
        }
    }

    #[test]
    fn a_tool_sends_once_per_call_id_and_needs_a_bound_channel_and_a_declared_tool() {
        let standin = Arc::new(StandIn::default());
        let plane = plane_with(standin.clone());
        let (cch, _) = plane.channels.open_channel(None).unwrap().unwrap();
        let unbound = run(&plane, &cch, TOOL_SEND, &args("hi"), None).unwrap_err();
        assert_eq!(unbound.code, code::CONNECTION_NOT_AUTHENTICATED);
        plane.channels.bind(&cch, &Source::new("standin", "room")).unwrap();
        let first = run(&plane, &cch, TOOL_SEND, &args("hi"), Some("call-1")).unwrap();
        let again = run(&plane, &cch, TOOL_SEND, &args("hi"), Some("call-1")).unwrap();
        assert_eq!(
            json::to_string(&first),
            json::to_string(&again),
            "the first result again"
        );
        assert_eq!(
            standin.sent.lock().unwrap().as_slice(),
            ["standin:room hi"],
            "sent once"
        );
        let unknown = run(&plane, &cch, TOOL_FILE_SEND, &Object::new(), None).unwrap_err();
        assert_eq!(unknown.code, code::UNKNOWN_TOOL, "no provider declares it");
        let empty = run(&plane, &cch, TOOL_SEND, &args("  "), None).unwrap_err();
        assert_eq!(empty.code, code::INVALID_ARGUMENTS);
        let mut reply = args("re");
        reply.insert("reply_ref".into(), s("rr_unknown"));
        let refused = run(&plane, &cch, TOOL_REPLY, &reply, None).unwrap_err();
        assert_eq!(refused.code, code::REPLY_REF_INVALID);
    }
}
