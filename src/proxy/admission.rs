//! Who may hold an unauthenticated connection on a loopback TCP listener, by local uid.
//!
//! Any local user can connect to a loopback port. Before its peer is authenticated (the
//! loopback TLS handshake, or an admin request), a connection costs the proxy a descriptor and
//! a task, so their number is bounded. A bound that closes the *new* connection when full lets
//! another uid switch kubectl and kubelet off: keep the budget full with idle connections that
//! reconnect when closed. So admission is by uid, which the kernel knows for a
//! connection between two local sockets ([`tcp_peer_uid`], `NETLINK_SOCK_DIAG` by 4-tuple, as
//! `ss -e` asks it):
//!
//! - the proxy's own uid and `--allow-uid` ("privileged") are never turned away: when the budget
//!   is full, the oldest connection of another uid is shed to make room (only when there is
//!   none, the oldest privileged one of no higher rank: an allowed uid's connections never shed
//!   the owner's, so an allowed uid that reconnects fast cannot keep the owner's kubectl out);
//! - other uids share the budget less a reserve kept for the privileged; past it, the oldest
//!   connection of another uid is shed (a flood churns only itself);
//! - a peer whose uid cannot be learnt counts as another uid.
//!
//! A shed connection's task is told through its [`Ticket`] and closes at once.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// The admission state of one listener.
#[derive(Debug)]
pub struct Admission {
    budget: usize,
    reserved: usize,
    owners: Vec<u32>,
    allowed: Vec<u32>,
    state: Mutex<State>,
}

/// Who a connection's peer is, in the order places are kept for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Rank {
    /// Another uid, or one that could not be learnt.
    Other,
    /// An allowed uid (`--allow-uid`, `--admin-allow-uid`).
    Allowed,
    /// The proxy's own uid (and root, for the admin port).
    Owner,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    /// By admission order: the first is the oldest.
    entries: BTreeMap<u64, Entry>,
}

#[derive(Debug)]
struct Entry {
    rank: Rank,
    shed: Arc<Notify>,
}

impl Entry {
    fn privileged(&self) -> bool {
        self.rank > Rank::Other
    }
}

/// One admitted, not yet authenticated connection; dropping it frees its place.
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    id: u64,
    shed: Arc<Notify>,
    /// Whether the peer is the proxy's own uid or an allowed one.
    pub privileged: bool,
}

impl Ticket {
    /// Resolves when this connection was shed to make room: close it.
    pub async fn shed(&self) {
        self.shed.notified().await;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut state = self.admission.lock();
        state.entries.remove(&self.id);
    }
}

/// What admitting a connection cost: the connections shed for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    /// How many older connections were shed.
    pub shed: usize,
}

impl Admission {
    /// At most `budget` unauthenticated connections, `reserved` of them kept for the uids in
    /// `owners` (the proxy's own) and `allowed`; an allowed uid never sheds an owner's.
    pub fn new(
        budget: usize,
        reserved: usize,
        owners: Vec<u32>,
        allowed: Vec<u32>,
    ) -> Arc<Admission> {
        Arc::new(Admission {
            budget: budget.max(1),
            reserved: reserved.min(budget.saturating_sub(1)),
            owners,
            allowed,
            state: Mutex::default(),
        })
    }

    fn rank(&self, uid: Option<u32>) -> Rank {
        match uid {
            Some(u) if self.owners.contains(&u) => Rank::Owner,
            Some(u) if self.allowed.contains(&u) => Rank::Allowed,
            _ => Rank::Other,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits a connection from `uid` (None: unknown), shedding older connections of other uids
    /// as the rules above say. Always admits: the newest connection of a uid is the one most
    /// likely to be a real client, and the oldest unauthenticated ones the likeliest to be idle.
    pub fn admit(self: &Arc<Self>, uid: Option<u32>) -> (Ticket, Admitted) {
        let rank = self.rank(uid);
        let privileged = rank > Rank::Other;
        let mut state = self.lock();
        let mut shed = 0;
        let others = |s: &State| s.entries.values().filter(|e| !e.privileged()).count();
        if privileged {
            // Another uid's first, then the oldest of a rank no higher than this one's (an
            // allowed uid past the budget sheds only allowed ones, at worst one over it).
            while state.entries.len() >= self.budget {
                if !shed_oldest(&mut state, |e| !e.privileged())
                    && !shed_oldest(&mut state, |e| e.rank <= rank)
                {
                    break;
                }
                shed += 1;
            }
        } else {
            let room = self.budget - self.reserved;
            while (others(&state) >= room || state.entries.len() >= self.budget)
                && shed_oldest(&mut state, |e| !e.privileged())
            {
                shed += 1;
            }
        }
        let id = state.next;
        state.next += 1;
        let notify = Arc::new(Notify::new());
        state.entries.insert(
            id,
            Entry {
                rank,
                shed: notify.clone(),
            },
        );
        drop(state);
        (
            Ticket {
                admission: self.clone(),
                id,
                shed: notify,
                privileged,
            },
            Admitted { shed },
        )
    }

    /// Unauthenticated connections held now: (privileged, others).
    pub fn held(&self) -> (usize, usize) {
        let state = self.lock();
        let others = state.entries.values().filter(|e| !e.privileged()).count();
        (state.entries.len() - others, others)
    }
}

/// Sheds the oldest entry `which` selects; false when there is none.
fn shed_oldest(state: &mut State, which: impl Fn(&Entry) -> bool) -> bool {
    let Some(id) = state
        .entries
        .iter()
        .find(|(_, e)| which(e))
        .map(|(id, _)| *id)
    else {
        return false;
    };
    if let Some(entry) = state.entries.remove(&id) {
        // notify_one stores the wake-up if the task is not waiting yet.
        entry.shed.notify_one();
    }
    true
}

/// The uid owning the other end of a TCP connection between two local sockets: `peer` is the
/// connecting socket's address, `local` the listener's side. Asked of the kernel by the exact
/// 4-tuple (`NETLINK_SOCK_DIAG`, `SOCK_DIAG_BY_FAMILY` without a dump, as `ss -e` does): one
/// request, one answer, no table to scan. None when the kernel does not know the socket (not
/// local, already gone) or cannot be asked.
pub fn tcp_peer_uid(peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    use rustix::net::{netlink, AddressFamily, RecvFlags, SendFlags, SocketType};
    let family: u8 = match (peer.ip(), local.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => 2,  // AF_INET
        (IpAddr::V6(_), IpAddr::V6(_)) => 10, // AF_INET6
        _ => return None,
    };
    let fd = rustix::net::socket(
        AddressFamily::NETLINK,
        SocketType::DGRAM,
        Some(netlink::SOCK_DIAG),
    )
    .ok()?;
    rustix::net::sockopt::set_socket_timeout(
        &fd,
        rustix::net::sockopt::Timeout::Recv,
        Some(std::time::Duration::from_millis(200)),
    )
    .ok()?;
    let mut req = Vec::with_capacity(72);
    // struct nlmsghdr: length, SOCK_DIAG_BY_FAMILY (20), NLM_F_REQUEST (1), sequence, port id.
    req.extend_from_slice(&72u32.to_ne_bytes());
    req.extend_from_slice(&20u16.to_ne_bytes());
    req.extend_from_slice(&1u16.to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    // struct inet_diag_req_v2: family, IPPROTO_TCP, no extensions, pad, every state.
    req.extend_from_slice(&[family, 6, 0, 0]);
    req.extend_from_slice(&u32::MAX.to_ne_bytes());
    // struct inet_diag_sockid, from the connecting socket's side: its port and address first.
    req.extend_from_slice(&peer.port().to_be_bytes());
    req.extend_from_slice(&local.port().to_be_bytes());
    req.extend_from_slice(&addr16(peer.ip()));
    req.extend_from_slice(&addr16(local.ip()));
    req.extend_from_slice(&0u32.to_ne_bytes()); // any interface
    req.extend_from_slice(&[0xff; 8]); // INET_DIAG_NOCOOKIE
    rustix::net::send(&fd, &req, SendFlags::empty()).ok()?;
    let mut buf = [0u8; 1024];
    let (_, len) = rustix::net::recv(&fd, &mut buf[..], RecvFlags::empty()).ok()?;
    parse_answer(&buf[..len.min(buf.len())], peer.port(), local.port())
}

/// The uid in a `SOCK_DIAG_BY_FAMILY` answer about (sport, dport); None for an error answer.
fn parse_answer(answer: &[u8], sport: u16, dport: u16) -> Option<u32> {
    let u16_at = |at: usize| answer.get(at..at + 2).map(|b| [b[0], b[1]]);
    let kind = u16::from_ne_bytes(u16_at(4)?);
    if kind != 20 {
        return None; // NLMSG_ERROR (2): no such socket
    }
    // struct inet_diag_msg after the 16-byte header: family, state, timer, retrans (4), id
    // (48: sport, dport, src, dst, if, cookie), expires, rqueue, wqueue (12), uid.
    let (s, d) = (
        u16::from_be_bytes(u16_at(20)?),
        u16::from_be_bytes(u16_at(22)?),
    );
    if (s, d) != (sport, dport) {
        return None;
    }
    let uid = answer.get(80..84)?;
    let inode = answer.get(84..88)?;
    // A socket its owner has already closed (orphaned, or in TIME_WAIT) reports uid 0 and
    // inode 0: that is nobody's answer, not root's.
    if inode == [0, 0, 0, 0] {
        return None;
    }
    Some(u32::from_ne_bytes([uid[0], uid[1], uid[2], uid[3]]))
}

/// An address as `inet_diag_sockid` holds it: 16 bytes, network order, IPv4 in the first four.
fn addr16(ip: IpAddr) -> [u8; 16] {
    let mut out = [0u8; 16];
    match ip {
        IpAddr::V4(v4) => out[..4].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => out.copy_from_slice(&v6.octets()),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_names_the_uid_of_a_local_peer() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let client =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (server, peer) = listener.accept().expect("accept");
        let local = server.local_addr().expect("local");
        assert_eq!(peer, client.local_addr().expect("client addr"));
        assert_eq!(
            tcp_peer_uid(peer, local),
            Some(rustix::process::geteuid().as_raw())
        );
        // A peer that has closed its socket is nobody, not root (uid 0 with inode 0).
        let closed =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (server2, peer2) = listener.accept().expect("accept");
        drop(closed);
        let local2 = server2.local_addr().expect("local");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while tcp_peer_uid(peer2, local2).is_some() {
            assert!(
                std::time::Instant::now() < deadline,
                "a closed peer is still somebody: {:?}",
                tcp_peer_uid(peer2, local2)
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // A 4-tuple nobody holds.
        let nobody = SocketAddr::from(([127, 0, 0, 1], 1));
        assert_eq!(tcp_peer_uid(nobody, local), None);
    }

    #[test]
    fn other_uids_never_push_out_privileged_ones() {
        let gate = Admission::new(8, 2, vec![1000], vec![]);
        // Another uid fills what it may (6), then keeps coming: its own oldest are shed.
        let mut flood: Vec<Ticket> = (0..6).map(|_| gate.admit(Some(65534)).0).collect();
        assert_eq!(gate.held(), (0, 6));
        let (t, admitted) = gate.admit(Some(65534));
        assert_eq!(admitted.shed, 1);
        flood.push(t);
        assert_eq!(gate.held(), (0, 6));
        // The privileged uid gets in, twice, then past the budget by shedding others.
        let mine: Vec<Ticket> = (0..4).map(|_| gate.admit(Some(1000)).0).collect();
        assert_eq!(gate.held(), (4, 4));
        // More of the flood cannot take the privileged places back.
        for _ in 0..20 {
            flood.push(gate.admit(None).0);
        }
        assert_eq!(gate.held(), (4, 4));
        drop(mine);
        assert_eq!(gate.held(), (0, 4));
    }

    /// An allowed uid that reconnects as fast as it can (another user's kubectl, or anything
    /// running as it) filled the privileged places and then shed the owner's oldest
    /// handshakes, one per new connection: the owner's kubectl was kept out. Now it sheds only
    /// its own (and other uids'); the owner's stay.
    #[test]
    fn an_allowed_uid_never_sheds_the_owners_connections() {
        let gate = Admission::new(8, 2, vec![1000], vec![2000]);
        let mine: Vec<Ticket> = (0..3).map(|_| gate.admit(Some(1000)).0).collect();
        let mut allowed = Vec::new();
        for _ in 0..100 {
            allowed.push(gate.admit(Some(2000)).0);
        }
        let owners_left = gate
            .lock()
            .entries
            .values()
            .filter(|e| e.rank == Rank::Owner)
            .count();
        assert_eq!(
            owners_left, 3,
            "the allowed uid shed the owner's connections"
        );
        assert!(gate.held().0 <= 9, "bounded: {:?}", gate.held());
        // The owner still gets in past the budget, shedding the allowed uid's oldest.
        let (_t, admitted) = gate.admit(Some(1000));
        assert_eq!(admitted.shed, 1);
        drop(mine);
    }

    #[test]
    fn a_shed_ticket_is_told() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let gate = Admission::new(2, 1, vec![0], vec![]);
            let (old, _) = gate.admit(Some(7));
            let (_mine, _) = gate.admit(Some(0));
            let (_mine2, admitted) = gate.admit(Some(0));
            assert_eq!(admitted.shed, 1);
            tokio::time::timeout(std::time::Duration::from_secs(1), old.shed())
                .await
                .expect("the shed connection is told");
        });
    }
}
