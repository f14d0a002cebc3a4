//! `POST /files/uploads`, streamed: the multipart body is parsed as it arrives
//! (`http::multipart::Stream`) and its `file` part written to the file cache's `.part` file in
//! pieces of at most `FLUSH` bytes, each on the blocking pool. An upload holds that much memory
//! whatever its size; the caps, the channel check, the ref and the answer are those of the
//! file cache (`files`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use super::conn::{Answer, Sink};
use crate::files::{FileError, FilePart};
use crate::http::multipart;
use crate::json::{self, obj, s};
use crate::providers::Host;
use crate::quiet;

/// A failing disk fails every upload: one line a minute.
static STORAGE_FAILED: quiet::Site = quiet::Site::new();

/// File bytes gathered before they are written: one write on the pool per this many.
const FLUSH: usize = 64 * 1024;
/// The most body bytes one `feed` brings: one read of the connection.
const READ: usize = super::conn::READ_CHUNK;
/// Memory one upload holds at most: the gathered bytes, one read of the connection on top,
/// and the parser's bounded hold-back. The front door's upload budget counts this.
pub const HELD: u64 = (FLUSH + READ + multipart::MAX_HEAD_BYTES + 128) as u64;

/// Where the body is.
enum Place {
    /// Between parts, or in a part that is not the file.
    Elsewhere,
    /// In the first `file` part.
    InFile,
}

/// The file part's name and type, once its head was read.
struct Meta {
    filename: String,
    mime: String,
}

pub struct Upload {
    host: Arc<Host>,
    /// `X-XAgent-Connector-Channel-ID`.
    channel: Option<String>,
    /// `None`: the `Content-Type` names no multipart boundary.
    parser: Option<multipart::Stream>,
    /// The cache's `.part` file, once the channel was checked (at the first bytes); `None`
    /// before, and while a write has it on the pool.
    part: Option<FilePart>,
    place: Place,
    meta: Option<Meta>,
    /// File bytes not written yet (at most `FLUSH` plus one read).
    pending: Vec<u8>,
}

fn invalid(detail: &str) -> Answer {
    Answer::json(
        400,
        json::to_string(&obj([("error", s("invalid_upload")), ("detail", s(detail))])),
    )
}

fn refused(e: FileError) -> Answer {
    match e {
        FileError::TooLarge => Answer::error(413, "too_large"),
        FileError::CacheFull => Answer::error(503, "capacity_exceeded"),
        FileError::Storage(e) => {
            if let Some(more) = STORAGE_FAILED.admit() {
                log::error!("files: upload failed: {e}{more}");
            }
            Answer::error(503, "storage_unavailable")
        }
    }
}

impl Upload {
    /// An upload for the channel and with the `Content-Type` its head names. What is missing
    /// is answered `400` at the body's first bytes, after the framing's own checks (a body
    /// over the cap is `413` whatever else is wrong).
    pub fn new(host: Arc<Host>, channel: Option<&str>, content_type: Option<&str>) -> Upload {
        Upload {
            host,
            channel: channel.map(str::to_string),
            parser: content_type
                .and_then(multipart::boundary)
                .map(|b| multipart::Stream::new(&b)),
            part: None,
            place: Place::Elsewhere,
            meta: None,
            pending: Vec::new(),
        }
    }

    /// The channel's binding and a fresh `.part` for it, looked up on the pool (a store read
    /// and a file created): before any file byte is kept.
    async fn open(&mut self) -> Result<(), Answer> {
        if self.part.is_some() {
            return Ok(());
        }
        let Some(channel) = self.channel.clone() else {
            return Err(invalid("X-XAgent-Connector-Channel-ID is required"));
        };
        if self.parser.is_none() {
            return Err(invalid("the body must be multipart/form-data with a boundary"));
        }
        let host = self.host.clone();
        let opened = crate::runtime::unblock(move || {
            let source = match host.channels.channel(&channel) {
                Ok(rec) => rec.and_then(|r| r.source),
                Err(e) => {
                    log::debug!("files: cannot read channel {}: {e}", quiet::shown(&channel));
                    return Err(Answer::error(503, "storage_unavailable"));
                }
            };
            let Some(source) = source else {
                return Err(Answer::json(
                    404,
                    json::to_string(&obj([("error", s("connection_not_found"))])),
                ));
            };
            host.files.begin(&source, "out").map_err(refused)
        })
        .await?;
        self.part = Some(opened);
        // Sized once: a flush at `FLUSH` plus the read that passed it never makes it grow.
        self.pending.reserve_exact(FLUSH + READ);
        Ok(())
    }

    /// Writes the pending bytes on the pool.
    async fn flush(&mut self) -> Result<(), Answer> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let Some(mut part) = self.part.take() else {
            return Err(Answer::error(503, "storage_unavailable"));
        };
        let mut bytes = std::mem::take(&mut self.pending);
        let (part, bytes, written) = crate::runtime::unblock(move || {
            let written = part.write(&bytes);
            bytes.clear();
            (part, bytes, written)
        })
        .await;
        // The buffer comes back to be filled again: one allocation for the whole upload.
        self.pending = bytes;
        self.part = Some(part);
        written.map_err(refused)
    }

    /// Parses `bytes`, keeping the file part's data in `pending`.
    fn parse(&mut self, bytes: &[u8]) -> Result<(), Answer> {
        let (place, meta, pending) = (&mut self.place, &mut self.meta, &mut self.pending);
        let Some(parser) = self.parser.as_mut() else {
            return Err(invalid("the body must be multipart/form-data with a boundary"));
        };
        parser
            .feed(bytes, &mut |event| {
                match event {
                    // The first part named `file` is the upload; any other part is skipped.
                    multipart::Event::Part(head) if head.name == "file" && meta.is_none() => {
                        *meta = Some(Meta {
                            filename: head.filename.unwrap_or_else(|| "file".into()),
                            mime: head.content_type.unwrap_or_else(|| "application/octet-stream".into()),
                        });
                        *place = Place::InFile;
                    }
                    multipart::Event::Part(_) | multipart::Event::PartEnd => *place = Place::Elsewhere,
                    multipart::Event::Data(data) => {
                        if let Place::InFile = place {
                            pending.extend_from_slice(data);
                        }
                    }
                }
                Ok(())
            })
            .map_err(|why| invalid(&why))
    }
}

impl Drop for Upload {
    /// An upload cut short: its `.part` file is removed on the pool, not on the executor.
    fn drop(&mut self) {
        if let Some(part) = self.part.take() {
            crate::runtime::spawn_blocking(move || drop(part));
        }
    }
}

impl Sink for Upload {
    fn feed<'a>(&'a mut self, bytes: &'a [u8]) -> Pin<Box<dyn Future<Output = Result<(), Answer>> + Send + 'a>> {
        Box::pin(async move {
            self.open().await?;
            self.parse(bytes)?;
            if self.pending.len() >= FLUSH {
                self.flush().await?;
            }
            Ok(())
        })
    }

    fn finish(mut self: Box<Self>) -> Pin<Box<dyn Future<Output = Answer> + Send>> {
        Box::pin(async move {
            if let Err(a) = self.open().await {
                return a;
            }
            if let Err(why) = self.parser.as_ref().map_or(Ok(()), |p| p.finish()) {
                return invalid(&why);
            }
            let Some(meta) = self.meta.take() else {
                return invalid("the multipart body has no `file` part");
            };
            if let Err(a) = self.flush().await {
                return a;
            }
            let Some(part) = self.part.take() else {
                return Answer::error(503, "storage_unavailable");
            };
            let host = self.host.clone();
            let committed = crate::runtime::unblock(move || host.files.commit(part, &meta.filename, &meta.mime)).await;
            match committed {
                Ok((file_ref, rec)) => Answer::json(
                    200,
                    json::to_string(&obj([
                        ("file_ref", s(file_ref)),
                        ("file_type", s(&rec.kind)),
                        ("filename", s(&rec.filename)),
                        ("byte_size", json::n(rec.byte_size)),
                        ("expires_at", json::n(rec.expires_at)),
                    ])),
                ),
                Err(e) => refused(e),
            }
        })
    }
}
