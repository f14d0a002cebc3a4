//! Whole connections through the front door's framing: the input is a byte stream of any
//! number of pipelined requests, delivered in pieces split at points the input chooses, to the
//! same `conn::serve` the daemon runs, with a stand-in service behind it. No input may panic,
//! grow the head buffer past its bound (a debug assertion inside), or reach the service with a
//! body over its cap, read whole or streamed to a sink (`/stream`, as uploads are).
#![no_main]
use std::pin::Pin;
use std::task::{Context, Poll};

use imgate::fuzzing::front::conn::{self, Answer, Plan, Refused, Reply, Service, Sink};
use imgate::fuzzing::front::head::Head;
use libfuzzer_sys::fuzz_target;

const CAP: u64 = 4096;

struct StandIn;

impl Service for StandIn {
    fn plan(&self, head: &Head) -> Plan {
        match head.path.as_str() {
            "/ws" => Plan::Upgrade,
            "/refuse" => Plan::Answer(Answer::error(401, "unauthorized")),
            "/stream" => Plan::Stream {
                cap: CAP,
                hold: Box::new(()),
                sink: Box::new(Counted(0)),
            },
            _ => Plan::Read {
                cap: CAP,
                hold: Box::new(()),
            },
        }
    }

    fn answer<'a>(&'a self, _head: &'a Head, body: Vec<u8>) -> Reply<'a> {
        assert!(body.len() as u64 <= CAP, "a body over its cap reached the service");
        Box::pin(async move { Answer::json(200, format!("{{\"bytes\":{}}}", body.len())) })
    }

    fn refused(&self, _why: Refused, _head: Option<&Head>) {}
}

/// A streamed body's sink: counts the bytes, refuses a body whose first byte is `!`.
struct Counted(u64);

impl Sink for Counted {
    fn feed<'a>(
        &'a mut self,
        bytes: &'a [u8],
    ) -> Pin<Box<dyn std::future::Future<Output = Result<(), Answer>> + Send + 'a>> {
        Box::pin(async move {
            if self.0 == 0 && bytes.first() == Some(&b'!') {
                return Err(Answer::error(400, "refused"));
            }
            self.0 += bytes.len() as u64;
            assert!(self.0 <= CAP, "a streamed body over its cap reached the sink");
            Ok(())
        })
    }

    fn finish(self: Box<Self>) -> Pin<Box<dyn std::future::Future<Output = Answer> + Send>> {
        Box::pin(async move { Answer::json(200, format!("{{\"bytes\":{}}}", self.0)) })
    }
}

/// The client: the input in pieces, then end of stream; what the server writes is counted.
struct Pieces<'a> {
    data: &'a [u8],
    sizes: &'a [u8],
    next: usize,
    written: usize,
}

impl smol::io::AsyncRead for Pieces<'_> {
    fn poll_read(mut self: Pin<&mut Self>, _: &mut Context<'_>, out: &mut [u8]) -> Poll<std::io::Result<usize>> {
        let size = self.sizes.get(self.next % self.sizes.len().max(1)).map_or(64, |s| *s as usize + 1);
        self.next += 1;
        let n = size.min(out.len()).min(self.data.len());
        out[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Poll::Ready(Ok(n))
    }
}

impl smol::io::AsyncWrite for Pieces<'_> {
    fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        self.written += buf.len();
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

fuzz_target!(|data: &[u8]| {
    // The first 8 bytes choose the piece sizes; the rest is the connection.
    let (sizes, data) = data.split_at(data.len().min(8));
    let stream = Pieces {
        data,
        sizes,
        next: 0,
        written: 0,
    };
    let _ = smol::block_on(conn::serve(stream, &StandIn, &imgate::fuzzing::front::LIMITS, &conn::Untracked));
});
