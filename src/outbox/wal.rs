//! The outbox's write-ahead log, `state_dir/outbox.log` and `outbox.1.log` (`FILES`): what makes
//! an accept durable with one sequential append and one `fdatasync`, instead of a redb commit's
//! scattered page writes. One `Log` is one file; `durable.rs` moves appends from one to the
//! other when a checkpoint starts.
//!
//! Each file is preallocated (zeros written once, at creation) and recycled from offset 0 after
//! every checkpoint, so an append never changes the file's size or extents: `fdatasync` writes
//! the record's pages and nothing else, always the same few pages near the start of the file.
//!
//! Format, little-endian, one record after another from offset 0:
//!
//! ```text
//! record  = length:u32  crc:u32  seq:u64  payload[length]
//! end     = 0:u32                (written after every record, overwritten by the next one)
//! crc     = CRC32C(length ‖ seq ‖ payload)
//! ```
//!
//! Records that fit in a page (4 KiB) never cross into the next one: a write that would, starts
//! at the next page instead and leaves the rest of its page as it was (zeros or an older
//! generation). So a synced append writes one page, not two, and never rewrites the page the
//! last sync wrote. Appends that need no sync (deliveries, attempts, sweeps) are held in memory
//! (a page at most, for at most `HOLD`) and written with the next synced one, in the same page.
//!
//! Reading (`scan`) stops at the first of: an end marker, a record whose `seq` is not the
//! previous one plus one (an older generation of the recycled file), the end of the file, or
//! an unreadable record (bad length or checksum, or cut short: torn by a crash during its
//! write, or corrupt); except that where a record was expected mid-page and is not there, a
//! record header at the next page boundary naming exactly the expected `seq` is the next record
//! (a stale or zero byte cannot name it: sequence numbers only grow across generations).
//! Nothing after the stop is ever read.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The size of each file, unless `[queue] log_file_size` says otherwise (`Policy`). Appends
/// that would not fit are not logged: that transaction is committed to redb durably instead,
/// which is itself a checkpoint.
pub const LOG_BYTES: u64 = 2 << 20;
/// The size on a small state file system (`fit.rs`), where two 2 MiB files are a lot.
pub const SMALL_LOG_BYTES: u64 = 512 << 10;
/// The sizes `log_file_size` may take: a group of messages must fit well inside the smallest;
/// the largest bounds what a replay reads from a file of any size.
pub const MIN_LOG_BYTES: u64 = 128 << 10;
pub const MAX_LOG_BYTES: u64 = 64 << 20;
const HEADER: usize = 16;
const END: [u8; 4] = [0; 4];
/// The unit a disk writes: a write that fits in one never touches two.
pub const PAGE: u64 = 4096;
/// How long an append without sync may wait in memory for a synced one to take it along.
pub const HOLD: Duration = Duration::from_secs(5);

/// Positional reads of a log: the file at start, bytes in tests and the fuzz target.
pub trait ReadAt {
    /// Fills `buf` from `offset` as far as the log goes; the count read.
    fn fill_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
}

impl ReadAt for File {
    fn fill_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let mut n = 0;
        while n < buf.len() {
            match self.read_at(&mut buf[n..], offset + n as u64) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(n)
    }
}

impl ReadAt for [u8] {
    fn fill_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(self.len());
        let n = buf.len().min(self.len() - start);
        buf[..n].copy_from_slice(&self[start..start + n]);
        Ok(n)
    }
}

/// Why a scan stopped before the end of what was written.
#[derive(Debug, Clone, PartialEq)]
pub struct Unreadable {
    pub offset: u64,
    pub why: &'static str,
}

/// What a scan found.
#[derive(Debug, Default, PartialEq)]
pub struct Scanned {
    /// Readable records, in order.
    pub records: u64,
    /// The last readable record's sequence number.
    pub last_seq: Option<u64>,
    /// The record the scan could not read, if it stopped at one.
    pub unreadable: Option<Unreadable>,
}

/// Reads records from the start of `r` (at most `capacity` bytes), handing each to `each`
/// with its sequence number. An error from `each` stops the scan and is returned.
pub fn scan<E>(
    r: &(impl ReadAt + ?Sized),
    capacity: u64,
    mut each: impl FnMut(u64, &[u8]) -> Result<(), E>,
) -> Result<Scanned, E> {
    let mut found = Scanned::default();
    let mut offset = 0u64;
    let mut payload = Vec::new();
    loop {
        let read = read_record(r, offset, capacity, &mut payload);
        let expected = found.last_seq.map(|last| last.wrapping_add(1));
        let in_sequence = matches!(read, Found::Record(seq) if expected.is_none_or(|e| e == seq));
        if !in_sequence && offset % PAGE != 0 {
            // The next record may have been written at the next page (see the module's notes).
            let next = offset.next_multiple_of(PAGE);
            if expected.is_some() && header_seq(r, next) == expected {
                offset = next;
                continue;
            }
        }
        match read {
            Found::Record(seq) if in_sequence => {
                each(seq, &payload)?;
                found.records += 1;
                found.last_seq = Some(seq);
                offset += (HEADER + payload.len()) as u64;
            }
            // An older generation of the recycled file, or the end marker: the end of this one.
            Found::Record(_) | Found::End => break,
            Found::Unreadable(why) => {
                found.unreadable = Some(Unreadable { offset, why });
                break;
            }
        }
    }
    Ok(found)
}

/// What lies at one offset of the log.
enum Found {
    /// A whole record with this sequence number (its payload in the caller's buffer).
    Record(u64),
    /// An end marker, or the end of the file at a record boundary.
    End,
    Unreadable(&'static str),
}

fn read_record(r: &(impl ReadAt + ?Sized), offset: u64, capacity: u64, payload: &mut Vec<u8>) -> Found {
    let mut head = [0u8; HEADER];
    let n = match r.fill_at(&mut head, offset) {
        Ok(n) => n,
        Err(_) => return Found::Unreadable("read error"),
    };
    if n == 0 {
        return Found::End;
    }
    if n < 4 {
        return Found::Unreadable("cut short");
    }
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
    if len == 0 {
        return Found::End;
    }
    if n < HEADER {
        return Found::Unreadable("cut short");
    }
    if HEADER as u64 + u64::from(len) > capacity.saturating_sub(offset) {
        return Found::Unreadable("length past the end of the log");
    }
    payload.resize(len as usize, 0);
    match r.fill_at(payload, offset + HEADER as u64) {
        Ok(n) if n == payload.len() => {}
        Ok(_) => return Found::Unreadable("cut short"),
        Err(_) => return Found::Unreadable("read error"),
    }
    let seq_bytes: [u8; 8] = head[8..16].try_into().unwrap_or_default();
    let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    if crc32c_of(&head[0..4], &seq_bytes, payload) != crc {
        return Found::Unreadable("checksum mismatch");
    }
    Found::Record(u64::from_le_bytes(seq_bytes))
}

/// The sequence number a record header at `offset` names, whole or not.
fn header_seq(r: &(impl ReadAt + ?Sized), offset: u64) -> Option<u64> {
    let mut head = [0u8; HEADER];
    match r.fill_at(&mut head, offset) {
        Ok(HEADER) if head[0..4] != END => Some(u64::from_le_bytes(head[8..16].try_into().ok()?)),
        _ => None,
    }
}

/// The append side of the log. Sequence numbers are chosen by the caller (the outbox keeps
/// them with its redb state); the log only frames, writes and syncs.
pub struct Log {
    path: PathBuf,
    file: Option<File>,
    /// Where the written records end.
    offset: u64,
    /// Framed records not written yet (appends without sync), then the one being written; kept,
    /// so an append allocates only when records are larger than any before.
    held: Vec<u8>,
    /// When the oldest held record was appended.
    held_since: Option<Instant>,
    /// The file's size: made so, appends kept within it.
    size: u64,
}

/// How far a replay reads `f`: all of it, whatever size the run that wrote it used, up to
/// `MAX_LOG_BYTES`.
pub fn replay_capacity(f: &File) -> u64 {
    f.metadata().map_or(0, |m| m.len()).min(MAX_LOG_BYTES)
}

/// An append that does not fit in what is left of the file.
#[derive(Debug, PartialEq)]
pub struct NoRoom;

/// The log's two files in the state dir. Appends go to one while a checkpoint of what the other
/// holds runs; the files trade places at every checkpoint (`durable.rs`).
pub const FILES: [&str; 2] = ["outbox.log", "outbox.1.log"];

/// The sequence number of a file's first record, when it has one (a replay reads the files
/// oldest first). A torn or garbled first header may name anything: such a file has no
/// readable record, so where it sorts changes nothing.
pub fn first_seq(r: &(impl ReadAt + ?Sized)) -> Option<u64> {
    header_seq(r, 0)
}

impl Log {
    pub fn new(path: PathBuf, size: u64) -> Log {
        Log {
            path,
            file: None,
            offset: 0,
            held: Vec::new(),
            held_since: None,
            size,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Opens the file for a scan (a missing file reads as empty).
    pub fn reader(&self) -> io::Result<Option<File>> {
        // A file another `log_file_size` made is read whole (`replay_capacity`) and rebuilt at
        // its next `restart`.
        match File::open(&self.path) {
            Ok(f) => Ok(Some(f)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// After a checkpoint: the file, preallocated to its size (created or rebuilt when it has
    /// another: `log_file_size` changed), is written again from the start.
    pub fn restart(&mut self) -> io::Result<()> {
        crate::faults::fail("outbox-log-write")?;
        let file = match self.file.take() {
            Some(f) => f,
            None => match OpenOptions::new().read(true).write(true).open(&self.path) {
                Ok(f) if f.metadata()?.len() == self.size => f,
                Ok(_) | Err(_) => self.preallocate()?,
            },
        };
        // Older records stay behind the marker; they are all covered by the checkpoint.
        file.write_all_at(&END, 0)?;
        self.file = Some(file);
        self.offset = 0;
        self.drop_held();
        Ok(())
    }

    /// Writes a zero-filled file next to the log and renames it into place, so a crash never
    /// leaves a half-made log: the zeros are real blocks, so later appends change no metadata.
    fn preallocate(&self) -> io::Result<File> {
        let tmp = self.path.with_extension("log.tmp");
        let made = self.write_zeros(&tmp);
        if made.is_err() {
            // A full disk: the part written would only take space the database needs.
            let _ = std::fs::remove_file(&tmp);
        }
        made
    }

    fn write_zeros(&self, tmp: &Path) -> io::Result<File> {
        let mut f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(tmp)?;
        let zeros = vec![0u8; 64 << 10];
        let mut left = self.size;
        while left > 0 {
            let n = left.min(zeros.len() as u64) as usize;
            f.write_all(&zeros[..n])?;
            left -= n as u64;
        }
        f.sync_all()?;
        std::fs::rename(tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            File::open(dir)?.sync_all()?;
        }
        Ok(f)
    }

    /// The file appends do not go to, at start: made as `restart` makes it (at the first start,
    /// so its zeros are written once, like the other's), or made to read as empty, durably
    /// (after a replay that stopped short: what it holds may be numbered past what comes next).
    pub fn clear(&mut self) -> io::Result<()> {
        self.restart()?;
        opened(&self.file)?.sync_data()
    }

    /// Writes the held records and syncs the file: nothing it holds is left only in memory or
    /// in the page cache (before appends move to the other file, so a power cut cannot keep a
    /// later record and lose an earlier one).
    pub fn seal(&mut self) -> io::Result<()> {
        if !self.held.is_empty() {
            return self.write_held(true);
        }
        opened(&self.file)?.sync_data()
    }

    /// Closes the file (after an I/O error, so a failing disk can be unmounted); `restart`
    /// opens it again.
    pub fn close(&mut self) {
        self.file = None;
        self.drop_held();
    }

    fn drop_held(&mut self) {
        self.held.clear();
        self.held_since = None;
    }

    /// After an error: whether the file can be opened for writing and synced again (a disk
    /// remounted read-only cannot), without changing a byte of it.
    pub fn probe(&self) -> io::Result<()> {
        crate::faults::fail("outbox-log-write")?;
        match OpenOptions::new().write(true).open(&self.path) {
            Ok(f) => crate::faults::fail("outbox-log-sync").and_then(|()| f.sync_data()),
            // Gone: `restart` makes a new one (and fails if the disk cannot hold it).
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Bytes of records since the last restart, held ones included.
    pub fn used(&self) -> u64 {
        self.offset + self.held.len() as u64
    }

    /// Bytes of records held in memory.
    pub fn held(&self) -> u64 {
        self.held.len() as u64
    }

    /// When the held records are due to be written (`flush`); `None` when none are held.
    pub fn held_until(&self) -> Option<Instant> {
        self.held_since.map(|t| t + HOLD)
    }

    /// Writes the held records (without a sync: the kernel's writeback or the next sync takes
    /// them to the disk).
    pub fn flush(&mut self) -> io::Result<()> {
        if self.held.is_empty() {
            return Ok(());
        }
        self.write_held(false)
    }

    /// Where `len` bytes are written: after the last record, or at the next page when that
    /// touches fewer pages (a record never needlessly rewrites the page the last sync wrote).
    fn place(&self, len: u64) -> u64 {
        let pages = |from: u64| (from % PAGE + len).div_ceil(PAGE);
        let next = self.offset.next_multiple_of(PAGE);
        if pages(next) < pages(self.offset) {
            next
        } else {
            self.offset
        }
    }

    /// Appends one record; with `sync`, returns only once it (and every record before it) is
    /// on the disk. Without, it may be held in memory (see the module's notes). `Ok(Err(NoRoom))`
    /// when the record does not fit: nothing was written or held.
    pub fn append(&mut self, seq: u64, payload: &[u8], sync: bool) -> io::Result<Result<(), NoRoom>> {
        opened(&self.file)?;
        let with_held = (self.held.len() + HEADER + payload.len()) as u64;
        let fits = self.place(with_held) + with_held + END.len() as u64 <= self.size;
        if payload.is_empty() || payload.len() > u32::MAX as usize || !fits {
            return Ok(Err(NoRoom));
        }
        crate::faults::fail("outbox-log-write")?;
        let len = (payload.len() as u32).to_le_bytes();
        let seq_bytes = seq.to_le_bytes();
        self.held.extend_from_slice(&len);
        self.held
            .extend_from_slice(&crc32c_of(&len, &seq_bytes, payload).to_le_bytes());
        self.held.extend_from_slice(&seq_bytes);
        self.held.extend_from_slice(payload);
        if !sync && (self.held.len() as u64) < PAGE {
            self.held_since.get_or_insert_with(Instant::now);
            return Ok(Ok(()));
        }
        self.write_held(sync)?;
        Ok(Ok(()))
    }

    /// Writes the held records and an end marker after them, synced with `sync`.
    fn write_held(&mut self, sync: bool) -> io::Result<()> {
        let file = opened(&self.file)?;
        let at = self.place(self.held.len() as u64);
        let records = self.held.len();
        self.held.extend_from_slice(&END);
        if crate::faults::crash_due("outbox-log-torn") {
            // A crash in the middle of the write: half of it reaches the file.
            let _ = file.write_all_at(&self.held[..self.held.len() / 2], at);
            crate::faults::crash("outbox-log-torn");
        }
        let written = file.write_all_at(&self.held, at).and_then(|()| match sync {
            // Written but not durable: the change is taken back all the same.
            true => crate::faults::fail("outbox-log-sync").and_then(|()| file.sync_data()),
            false => Ok(()),
        });
        // Written or not, they are gone: after an error the log is closed and the overlay,
        // which still holds every change, is checkpointed by the recovery.
        self.drop_held();
        written?;
        self.offset = at + records as u64;
        crate::faults::crash_at("outbox-log-appended");
        Ok(())
    }
}

/// The log's file, unless it was closed after an error (`restart` opens it again).
fn opened(file: &Option<File>) -> io::Result<&File> {
    file.as_ref()
        .ok_or_else(|| io::Error::other("the outbox log is closed after an earlier error"))
}

/// CRC32C (Castagnoli) of a record's length, sequence number and payload.
fn crc32c_of(len: &[u8], seq: &[u8], payload: &[u8]) -> u32 {
    !crc32c_update(crc32c_update(crc32c_update(!0, len), seq), payload)
}

const CRC32C_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ 0x82F6_3B78 } else { c >> 1 };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

/// With the CPU's own CRC32C instruction where it has one (x86_64 with SSE4.2, aarch64 with
/// its CRC extension: every 64-bit board imgate is built for), a table otherwise. The one
/// function of imgate's own that stood out in a profile of webhook ingest (7% of its user time
/// with the table).
fn crc32c_update(crc: u32, data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("sse4.2") {
        // SAFETY: the CPU has SSE4.2, as just asked.
        return unsafe { crc32c_x86_64(crc, data) };
    }
    #[cfg(target_arch = "aarch64")]
    if std::arch::is_aarch64_feature_detected!("crc") {
        // SAFETY: the CPU has the CRC extension, as just asked.
        return unsafe { crc32c_aarch64(crc, data) };
    }
    crc32c_table(crc, data)
}

fn crc32c_table(mut crc: u32, data: &[u8]) -> u32 {
    for &b in data {
        crc = CRC32C_TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    crc
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn word(chunk: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(chunk);
    u64::from_le_bytes(w)
}

// `unsafe fn` and the blocks inside keep the crate building with its `rust-version` (1.85),
// where these intrinsics are unsafe to call; later compilers call them safe in a function with
// the feature, hence `unused_unsafe` allowed.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
#[allow(unused_unsafe)]
unsafe fn crc32c_x86_64(crc: u32, data: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    let mut words = data.chunks_exact(8);
    let mut c = u64::from(crc);
    for chunk in &mut words {
        // SAFETY: the caller checked that the CPU has SSE4.2.
        c = unsafe { _mm_crc32_u64(c, word(chunk)) };
    }
    let mut c = c as u32;
    for &b in words.remainder() {
        // SAFETY: as above.
        c = unsafe { _mm_crc32_u8(c, b) };
    }
    c
}

#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "crc")]
#[allow(unused_unsafe)]
unsafe fn crc32c_aarch64(crc: u32, data: &[u8]) -> u32 {
    use std::arch::aarch64::{__crc32cb, __crc32cd};
    let mut words = data.chunks_exact(8);
    let mut c = crc;
    for chunk in &mut words {
        // SAFETY: the caller checked that the CPU has the CRC extension.
        c = unsafe { __crc32cd(c, word(chunk)) };
    }
    for &b in words.remainder() {
        // SAFETY: as above.
        c = unsafe { __crc32cb(c, b) };
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn temp_log(tag: &str) -> Log {
        let dir = crate::scratch::scratch_dir(&format!("log-{tag}"));
        let mut log = Log::new(dir.join(FILES[0]), LOG_BYTES);
        log.restart().unwrap();
        log
    }

    fn read_all(log: &Log) -> (Vec<(u64, Vec<u8>)>, Scanned) {
        let mut got = Vec::new();
        let f = log.reader().unwrap().unwrap();
        let s = scan(&f, LOG_BYTES, |seq, p| {
            got.push((seq, p.to_vec()));
            Ok::<_, ()>(())
        })
        .unwrap();
        (got, s)
    }

    #[test]
    fn crc32c_matches_the_published_check_value() {
        // RFC 3720 B.4 / the CRC catalogue: CRC-32C("123456789") = 0xE3069283.
        assert_eq!(!crc32c_update(!0, b"123456789"), 0xE306_9283);
        assert_eq!(!crc32c_table(!0, b"123456789"), 0xE306_9283);
        // The CPU's instruction and the table agree at every length and alignment.
        let bytes: Vec<u8> = (0..300u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for start in 0..9 {
            for end in start..bytes.len() {
                let part = &bytes[start..end];
                assert_eq!(crc32c_update(0x1234_5678, part), crc32c_table(0x1234_5678, part));
            }
        }
    }

    #[test]
    fn records_read_back_in_order_and_a_restart_hides_the_old_generation() {
        let mut log = temp_log("order");
        for seq in 1..=3 {
            log.append(seq, format!("r{seq}").as_bytes(), true).unwrap().unwrap();
        }
        let (got, s) = read_all(&log);
        assert_eq!(got.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(got[2].1, b"r3");
        assert_eq!((s.records, s.last_seq, s.unreadable), (3, Some(3), None));

        log.restart().unwrap();
        assert_eq!(read_all(&log).0, [], "nothing after a restart until the next append");
        log.append(4, b"a-longer-record", true).unwrap().unwrap();
        let (got, s) = read_all(&log);
        assert_eq!((got.len(), s.last_seq, s.unreadable), (1, Some(4), None));
    }

    #[test]
    fn a_record_that_does_not_fit_is_refused_and_nothing_is_written() {
        let mut log = temp_log("full");
        let big = vec![7u8; (LOG_BYTES / 2) as usize];
        log.append(1, &big, false).unwrap().unwrap();
        assert_eq!(log.append(2, &big, false).unwrap(), Err(NoRoom));
        assert_eq!(read_all(&log).1.records, 1);
    }

    #[test]
    fn a_cut_anywhere_keeps_exactly_the_whole_records_before_it() {
        let mut log = temp_log("cut");
        let mut ends = vec![0u64];
        for seq in 1..=20u64 {
            log.append(seq, &vec![seq as u8; 10 + seq as usize * 3], true)
                .unwrap()
                .unwrap();
            ends.push(log.used());
        }
        let mut bytes = vec![0u8; log.used() as usize];
        log.reader().unwrap().unwrap().read_exact(&mut bytes).unwrap();
        for cut in 0..=bytes.len() {
            let mut got = 0;
            let s = scan(&bytes[..cut], LOG_BYTES, |_, _| {
                got += 1;
                Ok::<_, ()>(())
            })
            .unwrap();
            let whole = ends.iter().filter(|&&e| e > 0 && e <= cut as u64).count() as u64;
            assert_eq!(s.records, whole, "cut at {cut}");
            assert_eq!(
                s.unreadable.is_some(),
                !ends.contains(&(cut as u64)),
                "cut at {cut}: {s:?}"
            );
        }
    }

    #[test]
    fn a_flipped_byte_stops_the_scan_at_its_record() {
        let mut log = temp_log("flip");
        for seq in 1..=5 {
            log.append(seq, b"0123456789", true).unwrap().unwrap();
        }
        let mut bytes = vec![0u8; log.used() as usize + 4];
        log.reader().unwrap().unwrap().read_exact(&mut bytes).unwrap();
        let rec = HEADER + 10;
        for i in 0..bytes.len() - 4 {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            let s = scan(&b[..], LOG_BYTES, |_, _| Ok::<_, ()>(())).unwrap();
            let hit = (i / rec) as u64;
            assert_eq!(s.records, hit, "flip at {i}");
            let u = s.unreadable.expect("the flipped record is unreadable");
            assert_eq!(u.offset, hit * rec as u64, "flip at {i}");
        }
    }

    fn file_bytes(log: &Log, len: u64) -> Vec<u8> {
        let mut bytes = vec![0u8; len as usize];
        log.reader().unwrap().unwrap().read_exact(&mut bytes).unwrap();
        bytes
    }

    #[test]
    fn a_record_that_would_cross_a_page_starts_the_next_one_and_reads_back() {
        let mut log = temp_log("page");
        // A page of stale bytes (an older generation) where the skipped tail will be.
        let stale = vec![0xA5u8; PAGE as usize];
        log.file.as_ref().unwrap().write_all_at(&stale, 0).unwrap();
        log.restart().unwrap();
        let (small, big) = (vec![1u8; 3000], vec![2u8; 2000]);
        log.append(1, &small, true).unwrap().unwrap();
        assert_eq!(log.used(), (HEADER + 3000) as u64);
        log.append(2, &big, true).unwrap().unwrap();
        assert_eq!(
            log.used(),
            PAGE + (HEADER + 2000) as u64,
            "the second record starts page 2"
        );
        log.append(3, b"after", true).unwrap().unwrap();
        let (got, s) = read_all(&log);
        assert_eq!(got.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!((got[1].1.as_slice(), s.unreadable), (big.as_slice(), None));
        // A record larger than a page moves to the next one only when that saves a page.
        let mut log = temp_log("large");
        log.append(1, &small, true).unwrap().unwrap();
        log.append(2, &vec![3u8; 5000], true).unwrap().unwrap();
        assert_eq!(log.used(), (2 * HEADER + 8000) as u64, "two pages either way");
        log.append(3, &vec![4u8; 7000], true).unwrap().unwrap();
        assert_eq!(log.used(), 2 * PAGE + (HEADER + 7000) as u64, "two pages, not three");
        assert_eq!(read_all(&log).1.records, 3);
    }

    #[test]
    fn a_torn_record_at_the_next_page_is_unreadable_there_and_stale_bytes_are_not() {
        let mut log = temp_log("torn-page");
        log.append(1, &vec![1u8; 3000], true).unwrap().unwrap();
        log.append(2, &vec![2u8; 2000], true).unwrap().unwrap();
        let mut bytes = file_bytes(&log, log.used() + 4);
        let whole = scan(&bytes[..], LOG_BYTES, |_, _| Ok::<_, ()>(())).unwrap();
        assert_eq!((whole.records, whole.unreadable.clone()), (2, None));
        // Torn: its tail never reached the disk.
        bytes[PAGE as usize + 100] ^= 0xFF;
        let s = scan(&bytes[..], LOG_BYTES, |_, _| Ok::<_, ()>(())).unwrap();
        assert_eq!(s.records, 1);
        assert_eq!(s.unreadable.map(|u| u.offset), Some(PAGE), "counted where it lies");
        // A header at the page that names another record is not ours: the log ends before it.
        bytes[PAGE as usize + 8] ^= 0x01;
        let s = scan(&bytes[..], LOG_BYTES, |_, _| Ok::<_, ()>(())).unwrap();
        assert_eq!((s.records, s.unreadable), (1, None));
    }

    #[test]
    fn appends_without_sync_are_held_until_a_synced_one_takes_them_along() {
        let mut log = temp_log("held");
        log.append(1, b"delivered", false).unwrap().unwrap();
        assert_eq!(read_all(&log).1.records, 0, "held in memory");
        assert!(log.held_until().is_some_and(|t| t > Instant::now()));
        assert_eq!(log.used(), (HEADER + 9) as u64, "held records count as used");
        log.append(2, b"accepted", true).unwrap().unwrap();
        assert_eq!(read_all(&log).1.records, 2, "written with the synced one");
        assert_eq!(log.held_until(), None);
        log.append(3, b"delivered", false).unwrap().unwrap();
        log.flush().unwrap();
        assert_eq!(read_all(&log).1.last_seq, Some(3), "written by flush");
        // At most a page is held.
        let mut seq = 4;
        while read_all(&log).1.last_seq == Some(seq - 1) && seq < 100 {
            log.append(seq, &[7u8; 500], false).unwrap().unwrap();
            seq += 1;
        }
        assert!(seq <= 4 + (PAGE / 516) + 1, "written once a page was held ({seq})");
        // A restart drops what is held: the checkpoint before it wrote those changes.
        log.append(seq, b"held", false).unwrap().unwrap();
        log.restart().unwrap();
        assert_eq!((log.used(), log.held_until()), (0, None));
    }

    #[test]
    fn malformed_logs_never_panic() {
        let mut log = temp_log("fuzz");
        for seq in 1..=4 {
            log.append(seq, format!("payload {seq}").as_bytes(), true)
                .unwrap()
                .unwrap();
        }
        let mut seed = vec![0u8; log.used() as usize + 4];
        log.reader().unwrap().unwrap().read_exact(&mut seed).unwrap();
        for m in crate::testutil::mutations(&[&seed], 3000, 17) {
            let _ = scan(&m[..], LOG_BYTES, |_, _| Ok::<_, ()>(()));
        }
    }
}
