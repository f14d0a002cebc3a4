//! The file cache: inbound media fetched from providers and files xAgent uploads for the file
//! tool, under `state_dir/files/`, each named by its `file_ref` (128 random bits, the only
//! credential of `GET /files/refs/{ref}`).
//!
//! Invariants: a file is written and fsync'd before its record commits (a crash leaves at most
//! an orphan file, removed by the sweep); `[files] max_file_bytes` caps one file and
//! `max_bytes_total` all of them; records expire after `[files] ttl` (independent of the
//! message TTL) and take their bytes with them.

use std::io::Write;
use std::path::PathBuf;

use miniserde::{Deserialize, Serialize};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};

use crate::app::App;
use crate::ids;

/// file_ref → `FileRecord` JSON.
pub(crate) const FILES: TableDefinition<&str, &str> = TableDefinition::new("files");

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct FileRecord {
    /// The source (channel binding) the file belongs to.
    pub source: String,
    /// `image`, `video`, `audio` or `file`.
    pub kind: String,
    pub filename: String,
    pub mime_type: String,
    pub byte_size: u64,
    pub expires_at: u64,
    /// `in`: from the provider, for xAgent to download; `out`: uploaded by xAgent to send.
    pub direction: String,
}

#[derive(Debug, PartialEq)]
pub enum FileError {
    TooLarge,
    CacheFull,
    Storage(String),
}

impl std::fmt::Display for FileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FileError::TooLarge => f.write_str("file over [files] max_file_bytes"),
            FileError::CacheFull => f.write_str("file cache full ([files] max_bytes_total)"),
            FileError::Storage(e) => write!(f, "file cache: {e}"),
        }
    }
}

fn dir(app: &App) -> PathBuf {
    app.config.server.state_dir.join("files")
}

fn storage<E: std::fmt::Display>(e: E) -> FileError {
    FileError::Storage(e.to_string())
}

/// The kind of a file by MIME type, as IM payloads name it.
pub fn kind_of(mime: &str) -> &'static str {
    match mime.split('/').next().unwrap_or("") {
        "image" => "image",
        "video" => "video",
        "audio" => "audio",
        _ => "file",
    }
}

/// Stores bytes as a new file of `source`; returns its ref and record.
pub fn store(
    app: &App,
    source: &str,
    filename: &str,
    mime_type: &str,
    bytes: &[u8],
    direction: &str,
) -> Result<(String, FileRecord), FileError> {
    let limits = &app.config.files;
    let size = bytes.len() as u64;
    if size > limits.max_file_bytes {
        return Err(FileError::TooLarge);
    }
    let now = ids::now_ms();
    // Refused before the bytes are written when it clearly cannot fit.
    if total_bytes(app)? + size > limits.max_bytes_total {
        sweep(app, now);
        if total_bytes(app)? + size > limits.max_bytes_total {
            log::warn!(
                "files: cache full ({} bytes max); a {size}-byte file was refused",
                limits.max_bytes_total
            );
            return Err(FileError::CacheFull);
        }
    }
    let file_ref = ids::token("file_");
    std::fs::create_dir_all(dir(app)).map_err(storage)?;
    let path = dir(app).join(&file_ref);
    let mut f = std::fs::File::create(&path).map_err(storage)?;
    f.write_all(bytes).and_then(|_| f.sync_all()).map_err(storage)?;
    let rec = FileRecord {
        source: source.to_string(),
        kind: kind_of(mime_type).to_string(),
        filename: sanitize(filename),
        mime_type: mime_type.to_string(),
        byte_size: size,
        expires_at: now + limits.ttl.as_millis() as u64,
        direction: direction.to_string(),
    };
    // The cap is checked again in the transaction that adds the record, so concurrent uploads
    // cannot together pass `max_bytes_total`.
    let put = || -> crate::store::Result<bool> {
        let db = app.store.db.get()?;
        let txn = db.begin_write()?;
        {
            let mut t = txn.open_table(FILES)?;
            if sum(&t)? + size > limits.max_bytes_total {
                return Ok(false);
            }
            t.insert(file_ref.as_str(), miniserde::json::to_string(&rec).as_str())?;
        }
        txn.commit()?;
        Ok(true)
    };
    match put() {
        Ok(true) => Ok((file_ref, rec)),
        outcome => {
            let _ = std::fs::remove_file(&path);
            Err(outcome.map_or_else(storage, |_| FileError::CacheFull))
        }
    }
}

/// A file name safe for a `Content-Disposition` header and a log line.
fn sanitize(name: &str) -> String {
    let base = name.rsplit(['/', '\\']).next().unwrap_or("");
    let clean: String = base
        .chars()
        .filter(|c| !c.is_control() && *c != '"')
        .take(128)
        .collect();
    if clean.is_empty() {
        "file".into()
    } else {
        clean
    }
}

/// The unexpired record of `file_ref` and the path of its bytes.
pub fn get(app: &App, file_ref: &str) -> Option<(FileRecord, PathBuf)> {
    if !file_ref.starts_with("file_") || !file_ref[5..].bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let db = app.store.db.get().ok()?;
    let txn = db.begin_read().ok()?;
    let rec: FileRecord = miniserde::json::from_str(txn.open_table(FILES).ok()?.get(file_ref).ok()??.value()).ok()?;
    (rec.expires_at > ids::now_ms()).then(|| (rec, dir(app).join(file_ref)))
}

fn total_bytes(app: &App) -> Result<u64, FileError> {
    let db = app.store.db.get().map_err(storage)?;
    let txn = db.begin_read().map_err(storage)?;
    sum(&txn.open_table(FILES).map_err(storage)?).map_err(storage)
}

/// Bytes of every record in the files table.
fn sum(t: &impl ReadableTable<&'static str, &'static str>) -> crate::store::Result<u64> {
    let mut total = 0;
    for row in t.iter()? {
        let (_, v) = row?;
        total += miniserde::json::from_str::<FileRecord>(v.value()).map_or(0, |r| r.byte_size);
    }
    Ok(total)
}

/// Removes expired files and orphans (bytes without a record); returns how many went.
pub fn sweep(app: &App, now: u64) -> usize {
    let run = || -> crate::store::Result<usize> {
        let db = app.store.db.get()?;
        let txn = db.begin_write()?;
        let mut gone = Vec::new();
        let mut keep = std::collections::HashSet::new();
        {
            let mut t = txn.open_table(FILES)?;
            t.retain(|k, v| {
                let alive = miniserde::json::from_str::<FileRecord>(v).is_ok_and(|r| r.expires_at > now);
                if alive {
                    keep.insert(k.to_string());
                } else {
                    gone.push(k.to_string());
                }
                alive
            })?;
        }
        txn.commit()?;
        let mut n = 0;
        if let Ok(entries) = std::fs::read_dir(dir(app)) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                if !keep.contains(&name) && std::fs::remove_file(e.path()).is_ok() {
                    n += 1;
                }
            }
        }
        Ok(n.max(gone.len()))
    };
    match run() {
        Ok(n) => {
            if n > 0 {
                log::info!("files: {n} expired file(s) removed");
            }
            n
        }
        Err(e) => {
            log::error!("files: sweep failed: {e}");
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_lose_paths_quotes_and_control_characters() {
        assert_eq!(sanitize("../../etc/passwd"), "passwd");
        assert_eq!(sanitize("a\"b\r\n.txt"), "ab.txt");
        assert_eq!(sanitize(""), "file");
        assert_eq!(kind_of("image/png"), "image");
        assert_eq!(kind_of("application/pdf"), "file");
    }
}
