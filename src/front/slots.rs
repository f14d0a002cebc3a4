//! Who holds the connection slots, so that holding them is no way to lock others out:
//!
//! - **a cap per client address** (`[server] max_connections_per_client`, a quarter of the slots
//!   unless set; 0 turns it off for a reverse proxy, behind which every client is one address);
//! - **idle keep-alive connections make room**: when every slot is taken, the connection that
//!   has waited longest between two requests is closed to admit the new one;
//! - **a reserve for the data plane**: when every slot is taken by a connection in the middle of
//!   a request, a few more are admitted on probation, for an authenticated `/ws` upgrade only
//!   (anything else there is answered 503), so xAgent is never kept out by webhook senders or
//!   idle clients.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use smol::net::TcpStream;

use super::stats::{self, Cause};

/// Connections admitted past the slots, each for one `/ws` upgrade at most.
pub const RESERVE: usize = 4;

/// The slots of one listener.
pub struct Slots {
    max: usize,
    /// `None`: no cap per address.
    per_client: Option<usize>,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    next: u64,
    conns: HashMap<u64, Entry>,
    per_client: HashMap<IpAddr, usize>,
    /// Connections on a slot, and in the reserve.
    held: usize,
    reserve: usize,
}

struct Entry {
    ip: IpAddr,
    /// Since when it waits between two requests; `None` while it reads or answers one.
    idle_since: Option<Instant>,
    /// A second handle on the socket, to close it from here.
    stream: TcpStream,
    place: Place,
}

/// What a connection counts against.
#[derive(Clone, Copy, PartialEq)]
enum Place {
    Slot,
    Reserve,
    /// Closed to make room: its slot went to a newcomer, its task is ending.
    Closing,
}

/// Why a connection is not admitted.
#[derive(Debug, PartialEq)]
pub enum Refusal {
    /// Its address holds its share of the slots already.
    PerClient,
    /// Every slot and the reserve are held, and none is idle.
    Full,
}

impl Slots {
    pub fn new(max: usize, per_client: Option<usize>) -> Arc<Slots> {
        Arc::new(Slots {
            max,
            per_client,
            inner: Mutex::new(Inner::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits a connection from `ip`, closing the longest-idle one if that makes room.
    pub fn admit(self: &Arc<Self>, ip: IpAddr, stream: &TcpStream) -> Result<Held, Refusal> {
        let mut g = self.lock();
        if let Some(cap) = self.per_client {
            if g.per_client.get(&ip).copied().unwrap_or(0) >= cap {
                return Err(Refusal::PerClient);
            }
        }
        let place = if g.held < self.max {
            Place::Slot
        } else if let Some(id) = longest_idle(&g) {
            // Its slot passes to the newcomer now; the closed connection's task frees nothing.
            if let Some(e) = g.conns.get_mut(&id) {
                e.idle_since = None;
                e.place = Place::Closing;
                let _ = e.stream.shutdown(std::net::Shutdown::Both);
            }
            g.held -= 1;
            stats::IDLE_CLOSED.fetch_add(1, Ordering::Relaxed);
            Place::Slot
        } else if g.reserve < RESERVE {
            Place::Reserve
        } else {
            return Err(Refusal::Full);
        };
        let id = g.next;
        g.next += 1;
        g.conns.insert(
            id,
            Entry {
                ip,
                idle_since: None,
                stream: stream.clone(),
                place,
            },
        );
        *g.per_client.entry(ip).or_default() += 1;
        match place {
            Place::Reserve => g.reserve += 1,
            _ => g.held += 1,
        }
        stats::CONNECTIONS.fetch_add(1, Ordering::SeqCst);
        Ok(Held {
            slots: self.clone(),
            id,
            reserve: place == Place::Reserve,
        })
    }
}

/// The connection that has waited longest between two requests (on a slot, not in the reserve).
fn longest_idle(g: &Inner) -> Option<u64> {
    g.conns
        .iter()
        .filter(|(_, e)| e.place == Place::Slot)
        .filter_map(|(id, e)| e.idle_since.map(|t| (t, *id)))
        .min()
        .map(|(_, id)| id)
}

/// One admitted connection; frees its slot (or its place in the reserve) when dropped.
pub struct Held {
    slots: Arc<Slots>,
    id: u64,
    reserve: bool,
}

impl Held {
    /// Admitted past the slots: it may only upgrade to the data plane with the API key.
    pub fn in_reserve(&self) -> bool {
        self.reserve
    }

    /// Between two requests (`true`) or in one (`false`); only an idle connection is closed to
    /// make room.
    pub fn idle(&self, idle: bool) {
        if let Some(e) = self.slots.lock().conns.get_mut(&self.id) {
            // A connection closed to make room stays closed.
            if e.place != Place::Closing {
                e.idle_since = idle.then(Instant::now);
            }
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut g = self.slots.lock();
        if let Some(e) = g.conns.remove(&self.id) {
            if let Some(n) = g.per_client.get_mut(&e.ip) {
                *n -= 1;
                if *n == 0 {
                    g.per_client.remove(&e.ip);
                }
            }
            match e.place {
                Place::Slot => g.held -= 1,
                Place::Reserve => g.reserve -= 1,
                Place::Closing => {}
            }
        }
        stats::CONNECTIONS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Notes a refused connection for `/metrics` and the (quiet) log.
pub fn note_refusal(why: &Refusal, ip: IpAddr, max: usize) {
    match why {
        Refusal::PerClient => stats::note(
            Cause::TooManyFromClient,
            Some(ip),
            "it holds its share of the connections already; refusing another with 503",
        ),
        Refusal::Full => stats::note(
            Cause::TooManyConnections,
            Some(ip),
            &format!("{max} connections busy and none idle; refusing it with 503"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_connections_make_room_the_reserve_takes_the_rest_and_drops_free_what_they_held() {
        smol::block_on(async {
            let listener = smol::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let mut streams = Vec::new();
            for _ in 0..8 {
                streams.push(TcpStream::connect(addr).await.unwrap());
            }
            let (me, other): (IpAddr, IpAddr) = ("127.0.0.1".parse().unwrap(), "127.0.0.2".parse().unwrap());
            let slots = Slots::new(2, Some(6));
            let a = slots.admit(me, &streams[0]).unwrap();
            let b = slots.admit(me, &streams[1]).unwrap();
            a.idle(true);
            smol::Timer::after(std::time::Duration::from_millis(5)).await;
            b.idle(true);
            // Full: the longest idle (a) makes room.
            let c = slots.admit(other, &streams[2]).unwrap();
            assert!(!c.in_reserve());
            a.idle(true); // a closed connection stays closed
            b.idle(false); // b reads a request now: nothing idle
            let reserve: Vec<Held> = (0..RESERVE)
                .map(|i| slots.admit(other, &streams[3 + i % 5]).unwrap())
                .collect();
            assert!(reserve.iter().all(Held::in_reserve));
            assert_eq!(slots.admit(other, &streams[7]).err(), Some(Refusal::Full));
            drop(a); // a's slot went to c already
            assert_eq!(slots.admit(other, &streams[7]).err(), Some(Refusal::Full));
            drop(b);
            let d = slots.admit(me, &streams[7]).unwrap();
            assert!(!d.in_reserve(), "b's slot is free again");
            drop((c, d, reserve));
            let g = slots.lock();
            assert_eq!((g.held, g.reserve, g.conns.len(), g.per_client.len()), (0, 0, 0, 0));
        });
    }

    #[test]
    fn one_address_holds_at_most_its_share() {
        smol::block_on(async {
            let listener = smol::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let stream = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
            let ip: IpAddr = "127.0.0.1".parse().unwrap();
            let slots = Slots::new(8, Some(2));
            let held = [slots.admit(ip, &stream).unwrap(), slots.admit(ip, &stream).unwrap()];
            assert_eq!(slots.admit(ip, &stream).err(), Some(Refusal::PerClient));
            assert!(slots.admit("127.0.0.2".parse().unwrap(), &stream).is_ok());
            drop(held);
            assert!(slots.admit(ip, &stream).is_ok());
            let unlimited = Slots::new(8, None);
            let many: Vec<Held> = (0..8).map(|_| unlimited.admit(ip, &stream).unwrap()).collect();
            assert_eq!(many.len(), 8);
        });
    }
}
