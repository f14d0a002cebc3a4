//! `tool.invoke`: the checks every provider shares (the channel's binding, the Card's tools, the
//! arguments, `reply_ref` and `file_ref` ownership), the answer to a repeated `tool_call_id`,
//! and the provider's `send`. Owns the `tool_calls` table.

use std::sync::Arc;

use redb::TableDefinition;

use super::Plane;
use crate::ids;
use crate::json::{self, obj, s, Object, Value};
use crate::protocol::{code, TOOL_FILE_SEND, TOOL_REPLY, TOOL_SEND};
use crate::providers::{Failure, Outbound};
use crate::store::{self, Db};

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

/// Results of tool calls, by call, for as long as xAgent may repeat one.
pub struct ToolResults {
    db: Arc<Db>,
}

impl ToolResults {
    pub fn open(db: Arc<Db>) -> store::Result<ToolResults> {
        db.write(|txn| {
            txn.open_table(TOOL_CALLS)?;
            Ok(())
        })?;
        Ok(ToolResults { db })
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

/// Runs a tool on channel `cch`; blocking (the provider's call), so never on the executor.
/// Repeated calls are xAgent's to make as often as it likes: one line a minute.
static REPEATED_CALLS: crate::quiet::Site = crate::quiet::Site::new();

pub fn run(plane: &Plane, cch: &str, tool_id: &str, args: &Object, call_id: Option<&str>) -> Result<Value, Failure> {
    let rec = plane.channels.channel(cch).map_err(Failure::storage)?;
    let Some(source) = rec.and_then(|r| r.source()) else {
        return Err(Failure::new(
            code::CONNECTION_NOT_AUTHENTICATED,
            "the channel is not bound; complete an auth flow first",
        ));
    };
    // A repeated tool_call_id answers with the first result and sends nothing.
    let key = call_id.map(|c| format!("{cch}:{tool_id}:{c}"));
    if let Some(k) = &key {
        if let Some(prev) = plane.tool_results.get(k).map_err(Failure::storage)? {
            if let Some(more) = REPEATED_CALLS.admit() {
                let tool = crate::quiet::shown(tool_id);
                log::info!("data plane: {tool} call repeated; answering with the first result{more}");
            }
            return json::parse(&prev)
                .map_err(|_| Failure::new(code::TOOL_INVOKE_FAILED, "stored result is unreadable"));
        }
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
    let cannot = || Failure::new(code::CHANNEL_UNAVAILABLE, format!("this channel cannot use {tool_id}"));
    let idempotency_key = key.clone().unwrap_or_else(|| ids::token("call_"));
    let file;
    let reply_to;
    let out = match tool_id {
        TOOL_FILE_SEND => {
            let file_ref = required(args, "file_ref")?;
            if !provider.tools().contains(&TOOL_FILE_SEND) {
                return Err(cannot());
            }
            file = plane
                .files
                .get(file_ref)
                .map_err(Failure::storage)?
                .filter(|(r, _)| r.direction == "out" && r.source == source.as_str())
                .ok_or_else(|| {
                    Failure::new(
                        code::FILE_REF_INVALID,
                        "file_ref is unknown, expired or was uploaded for another channel",
                    )
                })?;
            Outbound {
                text: json::get_str(args, "caption").unwrap_or(""),
                reply_to: None,
                files: std::slice::from_ref(&file),
                idempotency_key: &idempotency_key,
                message_id: None,
                streamed: None,
            }
        }
        _ => {
            if tool_id == TOOL_REPLY {
                let reference = required(args, "reply_ref")?;
                reply_to = plane
                    .outbox
                    .reply_ref(reference)
                    .map_err(Failure::storage)?
                    .filter(|r| r.source == source.as_str() && r.expires_at > ids::now_ms())
                    .ok_or_else(|| {
                        Failure::new(
                            code::REPLY_REF_INVALID,
                            "reply_ref is unknown, expired or belongs to another channel",
                        )
                    })?
                    .message_id;
            } else {
                debug_assert_eq!(tool_id, TOOL_SEND);
                reply_to = String::new();
            }
            if !provider.tools().contains(&tool_id) {
                return Err(cannot());
            }
            Outbound {
                text: text(args)?,
                reply_to: Some(reply_to.as_str()).filter(|r| !r.is_empty()),
                files: &[],
                idempotency_key: &idempotency_key,
                message_id: None,
                streamed: None,
            }
        }
    };
    let message_id = provider.send(&source, &out)?;
    let result = obj([("status", s("sent")), ("message_id", s(message_id))]);
    if let Some(k) = &key {
        if let Err(e) = plane.tool_results.save(k, &json::to_string(&result)) {
            log::error!("data plane: cannot remember result of {tool_id}: {e}");
        }
    }
    Ok(result)
}
