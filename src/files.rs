//! The file cache: inbound media fetched from providers and files xAgent uploads for the file
//! tool, under `state_dir/files/`, each named by its `file_ref` (128 random bits, the only
//! credential of `GET /files/refs/{ref}`). It owns the `files` table.
//!
//! One path writes every file: `begin` creates `REF.part`, `FilePart::write` appends as the bytes
//! arrive (an upload streams to disk), `commit` makes it a file; `store` is the three at once.
//!
//! Invariants:
//! - Bytes are written and fsync'd under a temporary name (`REF.part`), the record commits, and
//!   only then is the file renamed to its ref: a ref handed out always names a file that
//!   exists. A crash between the commit and the rename is finished when the cache opens. A
//!   `FilePart` dropped before its record committed removes its `.part`.
//! - The sweep lists the directory before it reads the records, so a file renamed after its
//!   record committed is never taken for an orphan; `.part` files are left alone for
//!   `PART_GRACE` since their last write (a store in progress), then removed.
//! - `[files] max_file_bytes` caps one file (no byte past it is written) and `max_bytes_total`
//!   all of them, checked again in the transaction that adds the record, so concurrent stores
//!   cannot pass it together.
//! - Records expire after `[files] ttl` (independent of the message TTL) and take their bytes
//!   with them.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use miniserde::{Deserialize, Serialize};
use redb::{ReadableTable, TableDefinition};

use crate::config;
use crate::ids;
use crate::quiet;
use crate::store::{self, Db, StoreError};

/// file_ref → `FileRecord` JSON.
const FILES: TableDefinition<&str, &str> = TableDefinition::new("files");
/// Suffix of bytes whose record has not committed yet.
const PART: &str = ".part";
/// A `.part` file not written for this long belongs to no store in progress.
const PART_GRACE: Duration = Duration::from_secs(3600);

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
    /// An `out` file whose ref was handed to a receiver that fetches it (a webhook's
    /// `reply_url` under IM v2): downloadable by its ref from then on.
    pub shared: Option<bool>,
}

impl FileRecord {
    /// Whether `GET /files/refs/{ref}` serves it.
    pub fn downloadable(&self) -> bool {
        self.direction == "in" || self.shared == Some(true)
    }
}

#[derive(Debug, PartialEq, Clone)]
pub enum FileError {
    TooLarge,
    CacheFull,
    /// The disk: the file could not be written or its record stored.
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

/// The ref of a cached file, from the path `Files::get` gave for it (its bytes are named by it).
pub fn ref_of(path: &std::path::Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// A well-formed ref: `file_` and hex. Anything else names no file (and no path).
fn valid_ref(file_ref: &str) -> bool {
    file_ref
        .strip_prefix("file_")
        .is_some_and(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

pub struct Files {
    db: Arc<Db>,
    dir: PathBuf,
    limits: config::Files,
}

/// A file refused for want of room, logged at most once a minute: uploads and downloads come
/// as fast as peers send them.
fn cache_full() -> FileError {
    static CACHE_FULL: quiet::Site = quiet::Site::new();
    if let Some(more) = CACHE_FULL.admit() {
        log::warn!("files: cache full ([files] max_bytes_total); a file was refused{more}");
    }
    FileError::CacheFull
}

fn decode(v: &str) -> store::Result<FileRecord> {
    miniserde::json::from_str(v).map_err(|_| store::corrupt("file record"))
}

impl Files {
    /// Creates the table and finishes what a crash interrupted: bytes whose record committed are
    /// renamed to their ref, bytes without a record are removed.
    pub fn open(db: Arc<Db>, state_dir: &std::path::Path, limits: config::Files) -> store::Result<Files> {
        db.write(|txn| {
            txn.open_table(FILES)?;
            Ok(())
        })?;
        let files = Files {
            db,
            dir: state_dir.join("files"),
            limits,
        };
        if let Ok(entries) = std::fs::read_dir(&files.dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                let Some(file_ref) = name.strip_suffix(PART) else {
                    continue;
                };
                if files.record(file_ref)?.is_some() {
                    let _ = std::fs::rename(e.path(), files.dir.join(file_ref));
                } else {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        Ok(files)
    }

    fn record(&self, file_ref: &str) -> store::Result<Option<FileRecord>> {
        self.db.read(|txn| {
            txn.open_table(FILES)?
                .get(file_ref)?
                .map(|v| decode(v.value()))
                .transpose()
        })
    }

    /// Stores bytes as a new file of `source`; returns its ref and record. Files arrive as
    /// streams (`begin`, `FilePart::write`, `commit`); this is the tests' shortcut.
    #[cfg(test)]
    pub fn store(
        &self,
        source: &str,
        filename: &str,
        mime_type: &str,
        bytes: &[u8],
        direction: &str,
    ) -> Result<(String, FileRecord), FileError> {
        let size = bytes.len() as u64;
        if size > self.limits.max_file_bytes {
            return Err(FileError::TooLarge);
        }
        let mut part = self.begin_sized(source, direction, size)?;
        part.write(bytes)?;
        self.commit(part, filename, mime_type)
    }

    /// A new file of `source` being written: `REF.part` created under `state_dir/files/`.
    /// Refuses (CacheFull) when the cache is already full (after a sweep), as store does.
    pub fn begin(&self, source: &str, direction: &str) -> Result<FilePart, FileError> {
        self.begin_sized(source, direction, 1)
    }

    /// `begin` refusing when `size` more bytes clearly cannot fit.
    fn begin_sized(&self, source: &str, direction: &str, size: u64) -> Result<FilePart, FileError> {
        let max_total = self.limits.max_bytes_total;
        let fits = |total: u64| total.saturating_add(size) <= max_total;
        let mut total = self.total_bytes().map_err(storage)?;
        if !fits(total) {
            self.sweep(ids::now_ms());
            total = self.total_bytes().map_err(storage)?;
            if !fits(total) {
                return Err(cache_full());
            }
        }
        let file_ref = ids::token("file_");
        std::fs::create_dir_all(&self.dir).map_err(storage)?;
        let path = self.dir.join(format!("{file_ref}{PART}"));
        let file = std::fs::File::create(&path).map_err(storage)?;
        Ok(FilePart {
            file: Some(file),
            path,
            file_ref,
            source: source.to_string(),
            direction: direction.to_string(),
            written: 0,
            max_bytes: self.limits.max_file_bytes,
            room: max_total.saturating_sub(total),
            failed: None,
            committed: false,
        })
    }

    /// fsyncs the bytes, adds the record under the caps (in the transaction, so concurrent
    /// stores cannot pass them together), renames the bytes to the ref.
    pub fn commit(
        &self,
        mut part: FilePart,
        filename: &str,
        mime_type: &str,
    ) -> Result<(String, FileRecord), FileError> {
        if let Some(e) = part.failed.clone() {
            return Err(e);
        }
        let file = part.file.take().ok_or_else(|| storage("file part already closed"))?;
        file.sync_all().map_err(storage)?;
        drop(file);
        let size = part.written;
        let rec = FileRecord {
            source: part.source.clone(),
            kind: kind_of(mime_type).to_string(),
            filename: sanitize(filename),
            mime_type: mime_type.to_string(),
            byte_size: size,
            expires_at: ids::now_ms() + self.limits.ttl.as_millis() as u64,
            direction: part.direction.clone(),
            shared: None,
        };
        let (max_file, max_total) = (self.limits.max_file_bytes, self.limits.max_bytes_total);
        let put = self.db.write(|txn| {
            let mut t = txn.open_table(FILES)?;
            if size > max_file {
                return Ok(Err(FileError::TooLarge));
            }
            if sum(&t)? + size > max_total {
                return Ok(Err(cache_full()));
            }
            t.insert(part.file_ref.as_str(), miniserde::json::to_string(&rec).as_str())?;
            Ok(Ok(()))
        });
        // Refused or failed: dropping `part` removes the bytes.
        put.map_err(storage)??;
        // Committed: the bytes are the record's now (a failed rename is finished by the next
        // open), so the drop must not remove them.
        part.committed = true;
        std::fs::rename(&part.path, self.dir.join(&part.file_ref)).map_err(storage)?;
        Ok((std::mem::take(&mut part.file_ref), rec))
    }

    /// The unexpired record of `file_ref` and the path of its bytes. `Ok(None)`: no such file
    /// (unknown, expired or malformed ref); `Err`: the store cannot tell right now.
    pub fn get(&self, file_ref: &str) -> Result<Option<(FileRecord, PathBuf)>, StoreError> {
        if !valid_ref(file_ref) {
            return Ok(None);
        }
        let rec = self.record(file_ref)?;
        Ok(rec
            .filter(|r| r.expires_at > ids::now_ms())
            .map(|r| (r, self.dir.join(file_ref))))
    }

    /// Makes a file downloadable by its ref (see `FileRecord::shared`).
    pub fn share(&self, file_ref: &str) -> store::Result<()> {
        self.db.write(|txn| {
            let mut t = txn.open_table(FILES)?;
            let rec = t.get(file_ref)?.map(|v| decode(v.value())).transpose()?;
            if let Some(mut rec) = rec.filter(|r| r.shared != Some(true)) {
                rec.shared = Some(true);
                t.insert(file_ref, miniserde::json::to_string(&rec).as_str())?;
            }
            Ok(())
        })
    }

    fn total_bytes(&self) -> store::Result<u64> {
        self.db.read(|txn| sum(&txn.open_table(FILES)?))
    }

    /// Removes expired files and orphans (bytes without a record); returns how many went.
    pub fn sweep(&self, now: u64) -> usize {
        // The listing comes first: a file renamed before it has a committed record, which the
        // transaction below (begun after it) sees.
        let listed: Vec<(String, PathBuf, Option<std::time::SystemTime>)> = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries
                .flatten()
                .map(|e| {
                    let modified = e.metadata().and_then(|m| m.modified()).ok();
                    (e.file_name().to_string_lossy().to_string(), e.path(), modified)
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        let swept = self.db.write(|txn| {
            let mut alive = std::collections::HashSet::new();
            let mut gone = 0;
            txn.open_table(FILES)?.retain(|k, v| {
                let keep = decode(v).is_ok_and(|r| r.expires_at > now);
                if keep {
                    alive.insert(k.to_string());
                } else {
                    gone += 1;
                }
                keep
            })?;
            Ok((alive, gone))
        });
        let (alive, gone) = match swept {
            Ok(v) => v,
            Err(e) => {
                log::error!("files: sweep failed: {e}");
                return 0;
            }
        };
        let mut removed = 0;
        for (name, path, modified) in listed {
            let orphan = match name.strip_suffix(PART) {
                // A store in progress, unless it is far too old for one.
                Some(_) => modified
                    .and_then(|m| m.elapsed().ok())
                    .is_some_and(|age| age > PART_GRACE),
                None => !alive.contains(&name),
            };
            if orphan && std::fs::remove_file(path).is_ok() {
                removed += 1;
            }
        }
        let n = removed.max(gone);
        if n > 0 {
            log::info!("files: {n} expired file(s) removed");
        }
        n
    }
}

/// A file being written by `Files::begin`; `Files::commit` makes it a file. Dropped before
/// that, it removes its bytes.
pub struct FilePart {
    /// `None` once closed by `commit`.
    file: Option<std::fs::File>,
    /// `state_dir/files/REF.part`.
    path: PathBuf,
    file_ref: String,
    source: String,
    direction: String,
    written: u64,
    max_bytes: u64,
    /// What the cache had room for at `begin`: a file past it would be refused at commit, so
    /// it is refused before its bytes fill the disk (as `store` refused a known size).
    room: u64,
    /// The error a write returned: the bytes on disk are not the file's, so it never commits.
    failed: Option<FileError>,
    committed: bool,
}

impl FilePart {
    /// Appends bytes; TooLarge once the total would pass max_file_bytes (nothing more
    /// written), CacheFull once it would pass the room the cache had at `begin`. After an
    /// error the bytes are removed and every later call returns it.
    pub fn write(&mut self, bytes: &[u8]) -> Result<(), FileError> {
        let result = self.append(bytes);
        if let Err(e) = &result {
            self.failed = Some(e.clone());
            // These bytes can never be a file: they go now, before whoever wrote them answers
            // (a refused upload leaves nothing behind once it is answered), not at the drop.
            self.file = None;
            let _ = std::fs::remove_file(&self.path);
        }
        result
    }

    fn append(&mut self, bytes: &[u8]) -> Result<(), FileError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let total = self.written.saturating_add(bytes.len() as u64);
        if total > self.max_bytes {
            return Err(FileError::TooLarge);
        }
        if total > self.room {
            return Err(cache_full());
        }
        let file = self.file.as_mut().ok_or_else(|| storage("file part already closed"))?;
        file.write_all(bytes).map_err(storage)?;
        self.written = total;
        Ok(())
    }

    /// Bytes written so far.
    #[cfg(test)]
    pub fn written(&self) -> u64 {
        self.written
    }
}

impl Drop for FilePart {
    fn drop(&mut self) {
        if !self.committed {
            self.file = None;
            let _ = std::fs::remove_file(&self.path);
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

/// Bytes of every record in the files table.
fn sum(t: &impl ReadableTable<&'static str, &'static str>) -> store::Result<u64> {
    let mut total = 0;
    for row in t.iter()? {
        let (_, v) = row?;
        total += decode(v.value())?.byte_size;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(max_total: u64) -> (Arc<Files>, PathBuf) {
        let (db, dir) = store::temp_db("files");
        let limits = config::Files {
            ttl: Duration::from_secs(3600),
            max_file_bytes: 1 << 20,
            max_bytes_total: max_total,
        };
        (Arc::new(Files::open(db, &dir, limits).unwrap()), dir)
    }

    #[test]
    fn file_names_lose_paths_quotes_and_control_characters() {
        assert_eq!(sanitize("../../etc/passwd"), "passwd");
        assert_eq!(sanitize("a\"b\r\n.txt"), "ab.txt");
        assert_eq!(sanitize(""), "file");
        assert_eq!(kind_of("image/png"), "image");
        assert_eq!(kind_of("application/pdf"), "file");
        assert!(!valid_ref("file_../x") && !valid_ref("file_") && valid_ref("file_0a"));
    }

    #[test]
    fn every_ref_handed_out_downloads_while_sweeps_run_alongside_stores_near_the_cap() {
        // 300 stores of 100 bytes against a 20,000-byte cap: most are refused, and sweeps run
        // the whole time. Every ref a store returned must name bytes on disk.
        let (files, _dir) = cache(20_000);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sweeper = {
            let (files, stop) = (files.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    files.sweep(ids::now_ms());
                    n += 1;
                }
                n
            })
        };
        let stores: Vec<_> = (0..6u8)
            .map(|t| {
                let files = files.clone();
                std::thread::spawn(move || {
                    (0..50)
                        .filter_map(|_| {
                            files
                                .store("s:x", "a.bin", "application/octet-stream", &[t; 100], "in")
                                .ok()
                        })
                        .map(|(r, _)| r)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let refs: Vec<_> = stores.into_iter().flat_map(|t| t.join().unwrap()).collect();
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let sweeps = sweeper.join().unwrap();
        assert!(sweeps > 10, "only {sweeps} sweeps ran alongside");
        assert!(refs.len() >= 150, "only {} stores fit", refs.len());
        for r in &refs {
            let (rec, path) = files.get(r).unwrap().expect("record");
            assert_eq!(
                std::fs::metadata(&path).map(|m| m.len()).ok(),
                Some(rec.byte_size),
                "{r}"
            );
        }
        assert!(files.total_bytes().unwrap() <= 20_000);
    }

    #[test]
    fn an_upload_becomes_downloadable_only_once_shared() {
        let (files, _dir) = cache(1 << 20);
        let (r, _) = files.store("s:x", "a.txt", "text/plain", b"x", "out").unwrap();
        assert!(!files.get(&r).unwrap().unwrap().0.downloadable());
        files.share(&r).unwrap();
        assert!(files.get(&r).unwrap().unwrap().0.downloadable());
    }

    /// The `.part` files in the cache's directory.
    fn parts(files: &Files) -> Vec<String> {
        let names = std::fs::read_dir(&files.dir).into_iter().flatten().flatten();
        names
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(PART))
            .collect()
    }

    #[test]
    fn a_file_streamed_in_pieces_is_its_bytes_and_its_record() {
        let (files, _dir) = cache(1 << 20);
        let bytes: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut part = files.begin("s:x", "out").unwrap();
        assert_eq!(parts(&files).len(), 1, "the bytes go to a .part as they come");
        // Each piece on a thread of its own, as the front door moves it to the blocking pool.
        for piece in bytes.chunks(7919) {
            let piece = piece.to_vec();
            part = std::thread::spawn(move || {
                part.write(&piece).unwrap();
                part
            })
            .join()
            .unwrap();
        }
        part.write(b"").unwrap();
        assert_eq!(part.written(), bytes.len() as u64);
        let (r, rec) = files.commit(part, "dir/a.bin", "application/pdf").unwrap();
        assert_eq!(
            (rec.byte_size, rec.kind.as_str(), rec.filename.as_str()),
            (100_000, "file", "a.bin")
        );
        assert_eq!((rec.source.as_str(), rec.direction.as_str()), ("s:x", "out"));
        let (stored, path) = files.get(&r).unwrap().unwrap();
        assert_eq!(stored, rec);
        assert_eq!(std::fs::read(path).unwrap(), bytes);
        assert!(parts(&files).is_empty());
    }

    #[test]
    fn a_part_over_the_cap_or_dropped_uncommitted_leaves_nothing() {
        let (files, _dir) = cache(1 << 20);
        let max = files.limits.max_file_bytes as usize;
        let mut part = files.begin("s:x", "out").unwrap();
        part.write(&vec![1; max - 10]).unwrap();
        assert_eq!(part.write(&[2; 11]), Err(FileError::TooLarge));
        assert_eq!(part.written(), max as u64 - 10, "nothing of the refused write");
        assert_eq!(part.write(b"x"), Err(FileError::TooLarge), "refused for good");
        assert_eq!(files.commit(part, "a", "b/c").map(|_| ()), Err(FileError::TooLarge));
        assert!(parts(&files).is_empty());

        let mut part = files.begin("s:x", "out").unwrap();
        part.write(b"half an upload").unwrap();
        drop(part);
        assert!(parts(&files).is_empty());
        assert_eq!(files.total_bytes().unwrap(), 0);
    }

    #[test]
    fn a_full_cache_refuses_a_part_at_begin_and_past_its_room() {
        let (files, _dir) = cache(1000);
        let mut part = files.begin("s:x", "out").unwrap();
        assert_eq!(part.write(&[0; 1001]), Err(FileError::CacheFull));
        drop(part);
        files.store("s:x", "a", "b/c", &[0; 1000], "in").unwrap();
        assert_eq!(files.begin("s:x", "out").map(|_| ()).err(), Some(FileError::CacheFull));
        assert!(parts(&files).is_empty());
    }

    #[test]
    fn a_commit_past_the_total_cap_is_refused_in_its_transaction() {
        // Two parts each fit when they begin; the second to commit finds the room taken.
        let (files, _dir) = cache(1000);
        let (mut a, mut b) = (files.begin("s:x", "out").unwrap(), files.begin("s:x", "out").unwrap());
        a.write(&[1; 600]).unwrap();
        b.write(&[2; 600]).unwrap();
        files.commit(a, "a", "b/c").unwrap();
        assert_eq!(files.commit(b, "b", "b/c").map(|_| ()), Err(FileError::CacheFull));
        assert!(parts(&files).is_empty());
        assert_eq!(files.total_bytes().unwrap(), 600);
    }

    #[test]
    fn a_crash_between_the_record_and_the_rename_is_finished_at_open() {
        let (files, dir) = cache(1 << 20);
        let (r, _) = files.store("s:x", "a.txt", "text/plain", b"hello", "in").unwrap();
        let path = files.dir.join(&r);
        std::fs::rename(&path, files.dir.join(format!("{r}{PART}"))).unwrap();
        std::fs::write(files.dir.join(format!("file_00{PART}")), b"orphan").unwrap();
        let limits = files.limits.clone();
        let db = files.db.clone();
        drop(files);
        let files = Files::open(db, &dir, limits).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"hello");
        assert!(!files.dir.join(format!("file_00{PART}")).exists());
    }
}
