//! The outbox's write-ahead log, `state_dir/outbox.log`: what makes an accept durable with one
//! sequential append and one `fdatasync`, instead of a redb commit's scattered page writes.
//!
//! The file is preallocated (zeros written once, at creation) and recycled from offset 0 after
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
//! Reading (`scan`) stops at the first of: an end marker, a record whose `seq` is not the
//! previous one plus one (an older generation of the recycled file), the end of the file, or
//! an unreadable record (bad length or checksum, or cut short: torn by a crash during its
//! write, or corrupt). Nothing after the stop is ever read.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The size of the file. Appends that would not fit are not logged: that transaction is
/// committed to redb durably instead, which is itself a checkpoint.
pub const LOG_BYTES: u64 = 2 << 20;
const HEADER: usize = 16;
const END: [u8; 4] = [0; 4];

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
    r: &mut impl Read,
    capacity: u64,
    mut each: impl FnMut(u64, &[u8]) -> Result<(), E>,
) -> Result<Scanned, E> {
    let mut found = Scanned::default();
    let mut offset = 0u64;
    let mut payload = Vec::new();
    loop {
        let mut head = [0u8; HEADER];
        let stop = |why| Some(Unreadable { offset, why });
        match read_full(r, &mut head) {
            // The file ends at a record boundary: nothing was cut.
            Ok(0) => break,
            Ok(n) if n < 4 => {
                found.unreadable = stop("cut short");
                break;
            }
            Ok(n) => {
                let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
                if len == 0 {
                    break;
                }
                if n < HEADER {
                    found.unreadable = stop("cut short");
                    break;
                }
                let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
                let mut seq_bytes = [0u8; 8];
                seq_bytes.copy_from_slice(&head[8..16]);
                let seq = u64::from_le_bytes(seq_bytes);
                if HEADER as u64 + u64::from(len) > capacity.saturating_sub(offset) {
                    found.unreadable = stop("length past the end of the log");
                    break;
                }
                payload.resize(len as usize, 0);
                if !matches!(read_full(r, &mut payload), Ok(n) if n == payload.len()) {
                    found.unreadable = stop("cut short");
                    break;
                }
                if crc32c_of(&head[0..4], &seq_bytes, &payload) != crc {
                    found.unreadable = stop("checksum mismatch");
                    break;
                }
                if found.last_seq.is_some_and(|last| seq != last.wrapping_add(1)) {
                    // An older generation of the recycled file: the end of this one.
                    break;
                }
                each(seq, &payload)?;
                found.records += 1;
                found.last_seq = Some(seq);
                offset += (HEADER + payload.len()) as u64;
            }
            Err(_) => {
                found.unreadable = stop("read error");
                break;
            }
        }
    }
    Ok(found)
}

/// Fills `buf` as far as the reader allows; the count read (short only at the end).
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The append side of the log. Sequence numbers are chosen by the caller (the outbox keeps
/// them with its redb state); the log only frames, writes and syncs.
pub struct Log {
    path: PathBuf,
    file: Option<File>,
    /// Where the next record goes.
    offset: u64,
    /// Reused for framing, so an append allocates only when a record is larger than any before.
    buf: Vec<u8>,
}

/// An append that does not fit in what is left of the file.
#[derive(Debug, PartialEq)]
pub struct NoRoom;

impl Log {
    pub fn new(state_dir: &Path) -> Log {
        Log {
            path: state_dir.join("outbox.log"),
            file: None,
            offset: 0,
            buf: Vec::new(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens the file for a scan (a missing file reads as empty).
    pub fn reader(&self) -> io::Result<Option<File>> {
        match File::open(&self.path) {
            Ok(f) => Ok(Some(f)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// After a checkpoint: the file, preallocated to `LOG_BYTES` (created or rebuilt when its
    /// size is not that), is written again from the start.
    pub fn restart(&mut self) -> io::Result<()> {
        crate::faults::fail("outbox-log-write")?;
        let file = match self.file.take() {
            Some(f) => f,
            None => match OpenOptions::new().read(true).write(true).open(&self.path) {
                Ok(f) if f.metadata()?.len() == LOG_BYTES => f,
                Ok(_) | Err(_) => self.preallocate()?,
            },
        };
        // Older records stay behind the marker; they are all covered by the checkpoint.
        file.write_all_at(&END, 0)?;
        self.file = Some(file);
        self.offset = 0;
        Ok(())
    }

    /// Writes a zero-filled file next to the log and renames it into place, so a crash never
    /// leaves a half-made log: the zeros are real blocks, so later appends change no metadata.
    fn preallocate(&self) -> io::Result<File> {
        let tmp = self.path.with_extension("log.tmp");
        let mut f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        let zeros = vec![0u8; 64 << 10];
        let mut left = LOG_BYTES;
        while left > 0 {
            let n = left.min(zeros.len() as u64) as usize;
            f.write_all(&zeros[..n])?;
            left -= n as u64;
        }
        f.sync_all()?;
        std::fs::rename(&tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            File::open(dir)?.sync_all()?;
        }
        Ok(f)
    }

    /// Closes the file (after an I/O error, so a failing disk can be unmounted); `restart`
    /// opens it again.
    pub fn close(&mut self) {
        self.file = None;
    }

    /// After an error: whether the file can be opened for writing and synced again (a disk
    /// remounted read-only cannot), without changing a byte of it.
    pub fn probe(&self) -> io::Result<()> {
        crate::faults::fail("outbox-log-write")?;
        match OpenOptions::new().write(true).open(&self.path) {
            Ok(f) => f.sync_data(),
            // Gone: `restart` makes a new one (and fails if the disk cannot hold it).
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Bytes of records since the last restart.
    pub fn used(&self) -> u64 {
        self.offset
    }

    /// Appends one record; with `sync`, returns only once it (and every record before it) is
    /// on the disk. `Ok(Err(NoRoom))` when the record does not fit: nothing was written.
    pub fn append(&mut self, seq: u64, payload: &[u8], sync: bool) -> io::Result<Result<(), NoRoom>> {
        let Some(file) = &self.file else {
            return Err(io::Error::other("the outbox log is closed after an earlier error"));
        };
        let total = (HEADER + payload.len() + END.len()) as u64;
        if payload.is_empty() || payload.len() > u32::MAX as usize || self.offset + total > LOG_BYTES {
            return Ok(Err(NoRoom));
        }
        crate::faults::fail("outbox-log-write")?;
        let len = (payload.len() as u32).to_le_bytes();
        let seq_bytes = seq.to_le_bytes();
        self.buf.clear();
        self.buf.extend_from_slice(&len);
        self.buf
            .extend_from_slice(&crc32c_of(&len, &seq_bytes, payload).to_le_bytes());
        self.buf.extend_from_slice(&seq_bytes);
        self.buf.extend_from_slice(payload);
        self.buf.extend_from_slice(&END);
        if crate::faults::crash_due("outbox-log-torn") {
            // A crash in the middle of the write: half the record reaches the file.
            let _ = file.write_all_at(&self.buf[..self.buf.len() / 2], self.offset);
            crate::faults::crash("outbox-log-torn");
        }
        file.write_all_at(&self.buf, self.offset)?;
        if sync {
            file.sync_data()?;
        }
        self.offset += total - END.len() as u64;
        crate::faults::crash_at("outbox-log-appended");
        Ok(Ok(()))
    }
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

fn crc32c_update(mut crc: u32, data: &[u8]) -> u32 {
    for &b in data {
        crc = CRC32C_TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_log(tag: &str) -> Log {
        let dir = std::env::temp_dir().join(format!("imgate-log-{tag}-{}", crate::ids::random_hex(4)));
        std::fs::create_dir_all(&dir).unwrap();
        let mut log = Log::new(&dir);
        log.restart().unwrap();
        log
    }

    fn read_all(log: &Log) -> (Vec<(u64, Vec<u8>)>, Scanned) {
        let mut got = Vec::new();
        let mut f = log.reader().unwrap().unwrap();
        let s = scan(&mut f, LOG_BYTES, |seq, p| {
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
            let s = scan(&mut &bytes[..cut], LOG_BYTES, |_, _| {
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
            let s = scan(&mut &b[..], LOG_BYTES, |_, _| Ok::<_, ()>(())).unwrap();
            let hit = (i / rec) as u64;
            assert_eq!(s.records, hit, "flip at {i}");
            let u = s.unreadable.expect("the flipped record is unreadable");
            assert_eq!(u.offset, hit * rec as u64, "flip at {i}");
        }
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
            let _ = scan(&mut &m[..], LOG_BYTES, |_, _| Ok::<_, ()>(()));
        }
    }
}
