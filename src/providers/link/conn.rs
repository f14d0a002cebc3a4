//! One long connection as every provider's link reads it. The provider's loop asks
//! `Conn::next` for the next frame and sees only what its protocol must answer; the rest is
//! done here, once:
//!
//! - the keepalive: WebSocket pings (`Keepalive::Pings`), and a connection from which nothing
//!   came for its `silent` time ends (half-open links behind NAT are common); or the protocol's
//!   own heartbeat (`Keepalive::Ticks`): `Heard::Tick` when one is due, and the provider writes
//!   it and judges the silence. Silence counts only while reading: a paused reader hears
//!   nothing, pongs included;
//! - the byte budget (`socket::Budget`): past it nothing is read until written answers (or
//!   lanes) give bytes back, and the server holds what it has not sent;
//! - the writer (`socket::writer`): the connection ends when it gives up;
//! - the drain: a connection told to go (`retire_on`, or `drain`) writes what it owes for at
//!   most its drain time, then a close frame, and ends;
//! - fairness: a server that keeps the socket full does not hold up other connections.

use std::time::{Duration, Instant};

use async_tungstenite::tungstenite::protocol::CloseFrame;
use async_tungstenite::tungstenite::{Bytes, Error as WsError, Message, Utf8Bytes};
use smol::channel::{Receiver, Sender, TrySendError};
use smol::future::FutureExt;
use smol::stream::StreamExt;

use crate::providers::socket::{self, Budget, Held, Out, QUEUE_SLOTS};
use crate::runtime;
use crate::wsclient;

/// A close frame gets this long to be written before the connection is dropped.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// How a connection shows it is alive.
#[derive(Clone, Copy, Debug)]
pub enum Keepalive {
    /// A WebSocket ping every `every`; nothing heard for `silent` ends the connection.
    Pings { every: Duration, silent: Duration },
    /// The protocol's own heartbeat: `Heard::Tick` after `first`, then every `every`.
    Ticks { first: Duration, every: Duration },
}

/// What `Conn::next` gives the provider.
#[derive(Debug)]
pub enum Heard {
    Text(Utf8Bytes),
    Binary(Bytes),
    /// The protocol's heartbeat is due; `paused`: reading paused since the last one, so no
    /// answer to it could be heard.
    Tick {
        paused: bool,
    },
    /// The server closed the connection (with its close frame, if it sent one).
    Closed(Option<CloseFrame>),
    /// Reading failed (a frame past the cap is `Error::Capacity`).
    Broken(WsError),
    /// Ended on this side: why (silence, the writer gave up, a drain ended).
    Ended(String),
}

/// A connection told to go: until when it may write what it owes, and whether it reads on
/// meanwhile (a server that sends nothing again must not lose what it still sends).
#[derive(Clone, Copy)]
struct Drain {
    until: Instant,
    reading: bool,
}

/// A retirement the link's supervisor may ask for, and the drain it starts.
struct Retire {
    asked: Receiver<()>,
    within: Duration,
    reading: bool,
}

/// One open connection: its reader, its writer's queue, and its budget.
pub struct Conn {
    reader: wsclient::Reader,
    out: Sender<Out>,
    writer: smol::Task<String>,
    budget: Budget,
    room: Receiver<()>,
    keepalive: Keepalive,
    next_beat: Instant,
    last_heard: Instant,
    paused_since_beat: bool,
    heard: bool,
    drain: Option<Drain>,
    retire: Option<Retire>,
    fair: runtime::Fair,
}

impl Conn {
    /// Takes over `ws`; what it reads counts against `budget` (`room` wakes a paused reader).
    pub fn new(ws: wsclient::Ws, budget: Budget, room: Receiver<()>, keepalive: Keepalive) -> Conn {
        let (sink, reader) = ws.split();
        // Bounded by count; lanes wait for room, and pings are only offered.
        let (out, queue) = smol::channel::bounded::<Out>(QUEUE_SLOTS);
        let now = Instant::now();
        Conn {
            reader,
            out,
            writer: socket::writer(sink, queue),
            budget,
            room,
            keepalive,
            next_beat: now + first_beat(keepalive),
            last_heard: now,
            paused_since_beat: false,
            heard: false,
            drain: None,
            retire: None,
            fair: runtime::Fair::default(),
        }
    }

    /// A connection with a budget of its own of `bytes`.
    pub fn with_budget(ws: wsclient::Ws, bytes: usize, keepalive: Keepalive) -> Conn {
        let (budget, room) = Budget::new(bytes);
        Conn::new(ws, budget, room, keepalive)
    }

    /// When `asked` says so (or its sender is gone), the connection drains within `within`,
    /// reading on or not.
    pub fn retire_on(&mut self, asked: Receiver<()>, within: Duration, reading: bool) {
        self.retire = Some(Retire { asked, within, reading });
    }

    /// The connection is to go: it writes what it owes for at most `within`, then closes.
    pub fn drain(&mut self, within: Duration, reading: bool) {
        if self.drain.is_none() {
            let until = Instant::now() + within;
            self.drain = Some(Drain { until, reading });
        }
    }

    /// Whether the server sent anything on this connection.
    pub fn heard(&self) -> bool {
        self.heard
    }

    /// How long nothing was heard while reading.
    pub fn silent_for(&self) -> Duration {
        self.last_heard.elapsed()
    }

    /// A new keepalive, its first beat counted from now.
    pub fn keep_alive(&mut self, keepalive: Keepalive) {
        self.keepalive = keepalive;
        self.next_beat = Instant::now() + first_beat(keepalive);
    }

    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// The writer's queue, for lanes that answer after their commit.
    pub fn sender(&self) -> Sender<Out> {
        self.out.clone()
    }

    /// Queues `frame` (with the share of the budget it gives back once written), waiting for
    /// room in the queue; an error once the writer stopped.
    pub async fn send(&self, frame: Message, held: Option<Held>) -> Result<(), String> {
        self.out
            .send((frame, held))
            .await
            .map_err(|_| "the writer stopped".to_string())
    }

    /// Offers `frame` without waiting (a heartbeat: a queue full of answers means the server
    /// is not reading, and the writer's deadline ends the connection); an error once the writer
    /// stopped.
    pub fn offer(&self, frame: Message) -> Result<(), String> {
        match self.out.try_send((frame, None)) {
            Err(TrySendError::Closed(_)) => Err("the writer stopped".into()),
            _ => Ok(()),
        }
    }

    /// Writes `frame` (a close) after what is queued, within `CLOSE_WAIT`.
    pub async fn close(&mut self, frame: Message) {
        let _ = self.out.try_send((frame, None));
        let late = async {
            smol::Timer::after(CLOSE_WAIT).await;
            String::new()
        };
        (&mut self.writer).or(late).await;
    }

    /// The next frame the provider must see, or the connection's end.
    pub async fn next(&mut self) -> Heard {
        loop {
            self.fair.turn().await;
            if let Some(drain) = self.drain {
                if self.budget.empty() || Instant::now() >= drain.until {
                    self.close(Message::Close(None)).await;
                    return Heard::Ended("replaced by a new connection".into());
                }
            }
            let paused = self.budget.full() || self.drain.is_some_and(|d| !d.reading);
            if paused {
                self.last_heard = Instant::now();
                self.paused_since_beat = true;
            }
            match self.step(paused).await {
                Step::Read(frame) => {
                    let now = Instant::now();
                    match frame {
                        None => return Heard::Closed(None),
                        Some(Ok(Message::Close(f))) => return Heard::Closed(f),
                        Some(Err(e)) => return Heard::Broken(e),
                        Some(Ok(frame)) => {
                            self.last_heard = now;
                            self.heard = true;
                            match frame {
                                Message::Text(t) => return Heard::Text(t),
                                Message::Binary(b) => return Heard::Binary(b),
                                // Pings are answered by tungstenite; pongs only show life.
                                _ => continue,
                            }
                        }
                    }
                }
                Step::Writer(why) => return Heard::Ended(why),
                Step::Retire(within, reading) => self.drain(within, reading),
                Step::Room => {}
                // Draining: no more heartbeats; the timer is the drain's deadline.
                Step::Beat if self.drain.is_some() => {}
                Step::Beat => {
                    let now = Instant::now();
                    match self.keepalive {
                        Keepalive::Pings { every, silent } => {
                            if now.duration_since(self.last_heard) > silent {
                                return Heard::Ended(format!("nothing heard for {silent:?}"));
                            }
                            if let Err(why) = self.offer(Message::Ping(Bytes::new())) {
                                return Heard::Ended(why);
                            }
                            self.next_beat = now + every;
                        }
                        Keepalive::Ticks { every, .. } => {
                            self.next_beat = now + every;
                            let paused = std::mem::take(&mut self.paused_since_beat);
                            return Heard::Tick { paused };
                        }
                    }
                }
            }
        }
    }

    /// Waits for whatever comes first: a frame (unless `paused`), room in the budget (while
    /// paused), the timer, the writer's end, a retirement.
    async fn step(&mut self, paused: bool) -> Step {
        let Conn {
            reader,
            writer,
            room,
            retire,
            drain,
            next_beat,
            ..
        } = self;
        let at = drain.map_or(*next_beat, |d| d.until);
        let timer = async {
            smol::Timer::at(at).await;
            Step::Beat
        };
        let writer_ended = async { Step::Writer(writer.await) };
        let retired = async {
            match (retire.as_ref(), drain.is_some()) {
                (Some(r), false) => match r.asked.recv().await {
                    Ok(()) => Step::Retire(r.within, r.reading),
                    // The link's loop is gone: nothing will read this connection's end.
                    Err(_) => Step::Writer("the link stopped".into()),
                },
                _ => std::future::pending().await,
            }
        };
        match paused {
            true => {
                let waiting_room = async {
                    let _ = room.recv().await;
                    Step::Room
                };
                waiting_room.or(timer).or(writer_ended).or(retired).await
            }
            // The retirement first: a socket full of frames must not keep it from draining.
            false => {
                retired
                    .or(async { Step::Read(reader.next().await) })
                    .or(timer)
                    .or(writer_ended)
                    .await
            }
        }
    }
}

fn first_beat(keepalive: Keepalive) -> Duration {
    match keepalive {
        Keepalive::Pings { every, .. } => every,
        Keepalive::Ticks { first, .. } => first,
    }
}

enum Step {
    Read(Option<Result<Message, WsError>>),
    Beat,
    Room,
    Retire(Duration, bool),
    Writer(String),
}

/// `read` applied to a frame's text: at once when it is small, on the pool when it is large
/// (parsing is work for the pool, not the executor).
pub async fn parse<T: Send + 'static>(text: Utf8Bytes, read: fn(&str) -> T) -> T {
    match text.len() <= crate::json::INLINE_PARSE {
        true => read(text.as_str()),
        false => runtime::unblock(move || read(text.as_str())).await,
    }
}
