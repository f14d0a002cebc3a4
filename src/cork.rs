//! A stream whose writes wait in memory while its writer knows more are coming, so a burst of
//! WebSocket frames leaves in one write instead of one each (a `message.push` per message, then
//! a `ping`). tungstenite flushes after every frame it sends; each flush is a system call and,
//! on the peer's side, a wake-up. The writer holds the cork while another frame is already
//! queued and lets go for the last one, whose flush writes everything held.
//!
//! Bounds: at most `MAX_HELD` bytes wait, until the next flush the cork does not hold back; a
//! write that would pass it first writes what is held and then goes straight through. Nothing
//! waits unless the writer holds the cork, and it holds it only while it has a frame to send
//! next, whose flush comes at once.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use smol::io::{AsyncRead, AsyncWrite};

/// Bytes held at most; a burst larger than this is written in parts of about this size.
pub const MAX_HELD: usize = 64 * 1024;

/// The writer's handle: whether the next flush may wait for more.
#[derive(Clone, Default)]
pub struct Cork(Arc<AtomicBool>);

impl Cork {
    /// `true`: another write comes at once, flushes may wait for it; `false`: flush for real.
    pub fn hold(&self, more_coming: bool) {
        self.0.store(more_coming, Ordering::Release);
    }

    fn held(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

pub struct Corked<S> {
    inner: S,
    cork: Cork,
    held: Vec<u8>,
    /// Bytes of `held` already written to `inner`.
    written: usize,
}

impl<S> Corked<S> {
    pub fn new(inner: S) -> Corked<S> {
        Corked {
            inner,
            cork: Cork::default(),
            held: Vec::new(),
            written: 0,
        }
    }

    pub fn cork(&self) -> Cork {
        self.cork.clone()
    }
}

impl<S: AsyncWrite + Unpin> Corked<S> {
    /// Writes what is held, in order, before anything else.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.held.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.held[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        // A burst's buffer is not kept: an idle session holds nothing (one allocation a burst).
        self.held = Vec::new();
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Corked<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Corked<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        // Joins what is held (the burst's last frame too, so it leaves with the others at the
        // flush), or starts holding while the cork is held.
        if (me.cork.held() || !me.held.is_empty()) && me.held.len() + buf.len() <= MAX_HELD {
            me.held.extend_from_slice(buf);
            return Poll::Ready(Ok(buf.len()));
        }
        ready!(me.poll_drain(cx))?;
        if me.cork.held() && buf.len() <= MAX_HELD {
            me.held.extend_from_slice(buf);
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut me.inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if me.cork.held() {
            return Poll::Ready(Ok(()));
        }
        ready!(me.poll_drain(cx))?;
        Pin::new(&mut me.inner).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        ready!(me.poll_drain(cx))?;
        Pin::new(&mut me.inner).poll_close(cx)
    }
}

/// A stream that records every write it is given (at most `limit` bytes of each) and never
/// has anything to read: what a writer sent, and in how many writes.
#[cfg(test)]
pub mod recorder {
    use super::*;
    use std::sync::Mutex;

    #[derive(Clone, Default)]
    pub struct Recorder {
        pub writes: Arc<Mutex<Vec<Vec<u8>>>>,
        pub limit: Option<usize>,
    }

    impl Recorder {
        pub fn writes(&self) -> Vec<Vec<u8>> {
            self.writes.lock().unwrap().clone()
        }
    }

    impl AsyncRead for Recorder {
        fn poll_read(self: Pin<&mut Self>, _: &mut Context<'_>, _: &mut [u8]) -> Poll<io::Result<usize>> {
            Poll::Pending
        }
    }

    impl AsyncWrite for Recorder {
        fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            let n = self.limit.map_or(buf.len(), |l| l.min(buf.len()));
            self.writes.lock().unwrap().push(buf[..n].to_vec());
            Poll::Ready(Ok(n))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::recorder::Recorder;
    use super::*;
    use smol::io::AsyncWriteExt;

    fn all(writes: &[Vec<u8>]) -> Vec<u8> {
        writes.concat()
    }

    #[test]
    fn frames_written_while_the_cork_is_held_leave_with_the_next_one_in_one_write_at_its_flush() {
        smol::block_on(async {
            let mut s = Corked::new(Recorder::default());
            let cork = s.cork();
            cork.hold(true);
            for frame in [&b"one"[..], b"two", b"three"] {
                s.write_all(frame).await.unwrap();
                s.flush().await.unwrap();
            }
            assert!(s.inner.writes().is_empty(), "nothing written while held");
            cork.hold(false);
            s.write_all(b"last").await.unwrap();
            s.flush().await.unwrap();
            assert_eq!(s.inner.writes(), [b"onetwothreelast".to_vec()]);
        });
    }

    #[test]
    fn without_the_cork_every_write_goes_straight_through() {
        smol::block_on(async {
            let mut s = Corked::new(Recorder::default());
            s.write_all(b"a").await.unwrap();
            s.write_all(b"b").await.unwrap();
            assert_eq!(s.inner.writes(), [b"a".to_vec(), b"b".to_vec()]);
        });
    }

    #[test]
    fn at_most_max_held_bytes_wait_and_the_order_is_kept() {
        smol::block_on(async {
            let mut s = Corked::new(Recorder::default());
            s.cork().hold(true);
            let big = vec![7u8; MAX_HELD - 10];
            s.write_all(&big).await.unwrap();
            s.write_all(b"0123456789abcdef").await.unwrap();
            // The second write did not fit: what was held went first, the new bytes wait.
            assert_eq!(s.inner.writes().len(), 1);
            assert!(s.held.len() <= MAX_HELD);
            s.cork().hold(false);
            s.flush().await.unwrap();
            let mut expected = big.clone();
            expected.extend_from_slice(b"0123456789abcdef");
            assert_eq!(all(&s.inner.writes()), expected);
        });
    }

    #[test]
    fn held_bytes_written_in_parts_by_a_slow_stream_arrive_whole_and_in_order() {
        smol::block_on(async {
            let mut s = Corked::new(Recorder {
                limit: Some(3),
                ..Recorder::default()
            });
            s.cork().hold(true);
            s.write_all(b"hello ").await.unwrap();
            s.write_all(b"world").await.unwrap();
            s.cork().hold(false);
            s.close().await.unwrap();
            assert_eq!(all(&s.inner.writes()), b"hello world");
        });
    }
}
