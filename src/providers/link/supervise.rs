//! The loop of one account's long connection, the same for every provider: open the next
//! connection (the provider's handshake, `Dial::open`), serve it (`Dial::serve`), and when it
//! ends, or the server asks for another, open the next one as `Pace` says.
//!
//! - A server that asks for a new connection (Slack's and DingTalk's `disconnect`) gets it
//!   next-before-old: the old connection goes on until the new one is open, then drains (writes
//!   what it owes, at most the provider's drain time) and closes.
//! - A refusal only the owner can fix (a wrong secret, the mode turned off) is said once, shown
//!   in the account's bindings' Descriptors and `/status` (`Line::refused`), and asked again
//!   every `Dial::REFUSED_WAIT`.
//! - Each change of state is one log line; a server that closes every connection for the same
//!   reason gets a "down" line a minute at most.

use std::future::Future;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use smol::channel::{Receiver, Sender};
use smol::future::FutureExt;

use super::accounts::Line;
use super::workers::Worker;
use super::Pace;
use crate::peer_wait;
use crate::providers::socket::Up;
use crate::quiet::{Quiet, Subjects};
use crate::runtime;

/// One provider's side of an account's long connection: its handshake and its frames.
pub trait Dial: Send + Sync + Sized + 'static {
    /// What `open` hands `serve`: the socket, and what the handshake learned.
    type Socket: Send + 'static;

    /// A refused account is asked again this often; `None`: not until it is bound again
    /// (`Links::forget`).
    const REFUSED_WAIT: Option<Duration> = Some(Duration::from_secs(600));

    /// Opens the next connection: the provider's open call, the socket, its hello. `None` once
    /// the provider is gone.
    fn open(&self) -> impl Future<Output = Option<Opened<Self::Socket>>> + Send;

    /// Serves one open connection until it ends.
    fn serve(self: Arc<Self>, socket: Self::Socket, session: Session) -> impl Future<Output = Ended> + Send;

    /// The wait before the next attempt, which `Pace` set at `wait`, as the server's own
    /// rules may lengthen it (`ended`: after a connection, not after a failed open).
    fn paced(&self, wait: Duration, ended: bool) -> Duration {
        let _ = ended;
        wait
    }
}

/// How an attempt to open a connection went.
pub enum Opened<S> {
    Up(S),
    /// The IM system refuses the account: why, for its owner.
    Refused(String),
    /// Could not connect now; the wait the server asked for, if it did.
    Failed(String, Option<Duration>),
    /// Not now, for a reason the provider's rules know (Discord's spent session budget): the
    /// wait, and the state to say, if it is new.
    Later(Duration, Option<String>),
}

/// How a connection ended.
pub struct Ended {
    why: String,
    /// The server sent anything on it: it worked.
    worked: bool,
    /// The IM system refuses the account from now on: why.
    refused: Option<String>,
    /// The next connection waits at least this long (the server asked for a pause).
    pause: Duration,
}

impl Ended {
    pub fn down(why: String, worked: bool) -> Ended {
        Ended {
            why,
            worked,
            refused: None,
            pause: Duration::ZERO,
        }
    }

    /// The next connection waits at least `pause`.
    pub fn pausing(self, pause: Duration) -> Ended {
        Ended { pause, ..self }
    }

    pub fn refused(why: String) -> Ended {
        Ended {
            why: String::new(),
            worked: true,
            refused: Some(why),
            pause: Duration::ZERO,
        }
    }
}

/// What a connection being served may tell its loop, and hear from it.
pub struct Session {
    serial: u64,
    signals: Sender<Signal>,
    replace_asked: bool,
    /// The loop asks the connection to go (a newer one is open), or is gone.
    pub retire: Receiver<()>,
    up: Arc<AtomicUsize>,
}

impl Session {
    /// Counts the connection as up (`/metrics`' `…_up`) while the `Up` lives: from the open, or
    /// from when the protocol says it is ready.
    pub fn up(&self) -> Up {
        Up::new(&self.up)
    }

    /// The server asked for a new connection: the next one is opened now (once per connection:
    /// a flood of asks asks for one).
    pub async fn replace(&mut self) {
        if !self.replace_asked {
            self.replace_asked = true;
            let _ = self.signals.send(Signal::Replace(self.serial)).await;
        }
    }
}

enum Signal {
    Replace(u64),
    Ended(u64, Ended),
}

/// A connection the loop holds: dropping it cancels it.
struct Running {
    serial: u64,
    retire: Sender<()>,
    _task: smol::Task<()>,
}

/// The link of `line`'s account, on the executor: `run` as a worker.
pub fn start<D: Dial>(dial: Arc<D>, line: Line) -> Option<Worker> {
    Some(Worker::Task(runtime::spawn(run(dial, line))))
}

/// The link of one account: forever, until its task is dropped.
async fn run<D: Dial>(dial: Arc<D>, mut line: Line) {
    let link = line.link();
    let then = match D::REFUSED_WAIT {
        Some(wait) => format!("asking again in {}", crate::config::fmt_duration(wait)),
        None => "not connecting until it is bound again".to_string(),
    };
    // Unbounded by count, bounded by connections: each sends at most one `Replace` and one
    // `Ended`.
    let (signals, signaled) = smol::channel::unbounded::<Signal>();
    let mut current: Option<Running> = None;
    // Replaced connections, writing what they owe before they close.
    let mut retiring: Vec<Running> = Vec::new();
    let mut pace = Pace::default();
    // The ends, by reason: a server that closes every connection gets a line a minute, and a
    // new reason is said at once.
    let drops = Subjects::new();
    let mut asks = Quiet::new();
    let mut serial = 0u64;
    loop {
        // Open the next connection; `wait`: how long until trying again, when it did not open.
        let wait = match dial.open().await {
            None => return,
            Some(Opened::Up(socket)) => {
                serial = serial.wrapping_add(1);
                pace.opened();
                line.accepted().await;
                line.set(format!("{link} up"), false);
                let (retire, retired) = smol::channel::bounded(1);
                let session = Session {
                    serial,
                    signals: signals.clone(),
                    replace_asked: false,
                    retire: retired,
                    up: line.counter(),
                };
                let (d, tell) = (dial.clone(), signals.clone());
                let task = runtime::spawn(async move {
                    let end = d.serve(socket, session).await;
                    let _ = tell.send(Signal::Ended(serial, end)).await;
                });
                let next = Running {
                    serial,
                    retire,
                    _task: task,
                };
                if let Some(old) = current.replace(next) {
                    let _ = old.retire.try_send(());
                    retiring.push(old);
                }
                None
            }
            // A replacement the server asked for failed: the connection in use goes on.
            Some(Opened::Refused(why) | Opened::Failed(why, None)) if current.is_some() => {
                line.set(
                    format!("cannot open the next {link}: {why}; the current one goes on"),
                    true,
                );
                Some(pace.failed())
            }
            Some(Opened::Refused(why)) => {
                line.refused(why, &then).await;
                let Some(wait) = D::REFUSED_WAIT else {
                    return std::future::pending().await;
                };
                Some(wait)
            }
            Some(Opened::Later(wait, say)) => {
                if let Some(now) = say {
                    line.set(now, true);
                }
                Some(wait)
            }
            Some(Opened::Failed(why, retry_after)) => {
                line.set(format!("cannot open the {link}: {why}; retrying"), true);
                Some(peer_wait::retry_after(retry_after, dial.paced(pace.failed(), false)))
            }
        };
        // Wait for what the connections say, and for `wait` to pass when it is set.
        let until = wait.map(|w| Instant::now() + w);
        loop {
            let next = async { signaled.recv().await.ok().map(Some) };
            let passed = async {
                match until {
                    Some(t) => {
                        smol::Timer::at(t).await;
                        Some(None)
                    }
                    None => std::future::pending().await,
                }
            };
            let signal = match next.or(passed).await {
                None => return,
                Some(None) => break,
                Some(Some(signal)) => signal,
            };
            let serial_now = current.as_ref().map_or(0, |c| c.serial);
            match signal {
                Signal::Replace(s) if s == serial_now => {
                    if let Some(more) = asks.admit() {
                        line.note(&format!("the server asked for a new {link}; opening it{more}"));
                    }
                    // A server that asks at every hello gets a new connection every
                    // `link::MIN_AGE`.
                    smol::Timer::after(pace.after_work()).await;
                    break;
                }
                Signal::Ended(s, end) if s == serial_now => {
                    current = None;
                    match end.refused {
                        Some(why) => {
                            line.refused(why, &then).await;
                            let Some(wait) = D::REFUSED_WAIT else {
                                return std::future::pending().await;
                            };
                            smol::Timer::after(wait).await;
                        }
                        None => {
                            // A connection that worked and ended is routine (servers rotate
                            // them); one that never worked is a warning.
                            if let Some(more) = drops.admit(&end.why) {
                                line.set(format!("{link} down ({}); reconnecting{more}", end.why), !end.worked);
                            }
                            let wait = dial.paced(pace.ended(end.worked), true);
                            smol::Timer::after(wait.max(end.pause)).await;
                        }
                    }
                    break;
                }
                Signal::Ended(s, _) => retiring.retain(|r| r.serial != s),
                Signal::Replace(_) => {}
            }
        }
    }
}
