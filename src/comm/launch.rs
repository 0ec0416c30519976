//! Launch as torchrun does: a rank learns its place from the environment (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), and rank 0 hands the NCCL unique id to every
//! other rank over TCP, each side under a deadline.
//!
//! The exchange: a rank connects to rank 0 (retrying until rank 0 listens) and sends the bytes
//! `FSDPID01`, its world size and its rank; rank 0 answers a hello that agrees with its own world
//! size, from a rank not served yet, with status 0 and the id, and any other with status 1 and
//! the reason, which both sides report (rank 0 names the last refusal if its deadline passes).
//! Rank 0 returns once every other rank was served. Every exchange ends by its side's deadline,
//! however slowly the other side sends.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Bytes of the id handed over (an NCCL unique id).
pub const ID_BYTES: usize = 128;

/// What a hello starts with: this protocol, version 1.
const HELLO_MAGIC: [u8; 8] = *b"FSDPID01";

/// Bytes of a hello: the magic, the world size and the rank (little-endian u32 each).
const HELLO_BYTES: usize = 16;

/// The longest refusal read back.
const MAX_REASON: usize = 4096;

/// How long rank 0 waits for a hello once a peer connected: one that connects and says
/// nothing holds up the others only this long.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a rank waits between attempts to reach rank 0.
const RETRY: Duration = Duration::from_millis(50);

/// One rank's place, as a launcher such as torchrun gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    /// The rank's place among the ranks of its node: its GPU.
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// Whether torchrun's agent serves its own store on `MASTER_PORT`
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`).
    pub agent_store: bool,
}

impl LaunchEnv {
    /// The process's launch environment.
    pub fn from_env() -> Result<LaunchEnv> {
        LaunchEnv::from_vars(|name| std::env::var(name).ok())
    }

    /// The launch environment read through `var`; each variable missing or malformed is an
    /// error naming it.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let read = |name: &'static str| -> Result<String> {
            var(name).ok_or_else(|| Error::LaunchEnv {
                variable: name,
                reason: "is not set (launch with torchrun, or set it)".into(),
            })
        };
        let number = |name: &'static str| -> Result<usize> {
            let text = read(name)?;
            text.trim().parse().map_err(|_| Error::LaunchEnv {
                variable: name,
                reason: format!("is {text:?}, not a number"),
            })
        };
        let rank = number("RANK")?;
        let world_size = number("WORLD_SIZE")?;
        if world_size == 0 || u32::try_from(world_size).is_err() {
            return Err(Error::LaunchEnv {
                variable: "WORLD_SIZE",
                reason: format!("is {world_size}, not 1 to {}", u32::MAX),
            });
        }
        if rank >= world_size {
            return Err(Error::LaunchEnv {
                variable: "RANK",
                reason: format!("is {rank}, not below WORLD_SIZE {world_size}"),
            });
        }
        let local_rank = number("LOCAL_RANK")?;
        let master_addr = read("MASTER_ADDR")?;
        if master_addr.trim().is_empty() {
            return Err(Error::LaunchEnv {
                variable: "MASTER_ADDR",
                reason: "is empty".into(),
            });
        }
        let port = number("MASTER_PORT")?;
        let master_port = u16::try_from(port)
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| Error::LaunchEnv {
                variable: "MASTER_PORT",
                reason: format!("is {port}, not a port (1 to 65535)"),
            })?;
        let agent_store = var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v == "True");
        if agent_store && master_port == u16::MAX {
            return Err(Error::LaunchEnv {
                variable: "MASTER_PORT",
                reason: "is 65535: torchrun's store holds it and the id needs the next".into(),
            });
        }
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            master_addr: master_addr.trim().to_string(),
            master_port,
            agent_store,
        })
    }

    /// The port rank 0 serves the id on: `MASTER_PORT`, or the next one when torchrun's agent
    /// already serves its store there.
    pub fn id_port(&self) -> u16 {
        match self.agent_store {
            // `from_vars` refused 65535 with an agent store.
            true => self.master_port.saturating_add(1),
            false => self.master_port,
        }
    }

    /// Every rank's copy of the id: rank 0 makes it with `make`, serves it and returns it once
    /// every rank has it; the others fetch it, looking `MASTER_ADDR` up again while it does not
    /// resolve (a name that never does is `Error::Timeout` at the deadline). At most `timeout`
    /// in all, but for a lookup that the system's resolver holds past it.
    pub fn share_id(
        &self,
        make: impl FnOnce() -> Result<[u8; ID_BYTES]>,
        timeout: Duration,
    ) -> Result<[u8; ID_BYTES]> {
        if self.world_size == 1 {
            return make();
        }
        let deadline = deadline_after(timeout);
        let port = self.id_port();
        if self.rank == 0 {
            let listener = listen(port)?;
            let id = make()?;
            serve_id(&listener, self.world_size, &id, deadline)?;
            Ok(id)
        } else {
            let addrs = resolve_by(&self.master_addr, port, deadline)?;
            fetch_id(&addrs, self.rank, self.world_size, deadline)
        }
    }
}

/// `timeout` from now, or as far as the clock counts.
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(u64::from(u32::MAX))))
        .unwrap_or(now)
}

/// Rank 0's listener on `port` of every interface, IPv6 and IPv4 (IPv4 alone where the host has
/// no IPv6): whatever address `MASTER_ADDR` gives the other ranks reaches it, and rank 0 need not
/// resolve it.
fn listen(port: u16) -> Result<TcpListener> {
    dual_stack_listener(port)
        .or_else(|e| match no_ipv6(&e) {
            true => TcpListener::bind(SocketAddr::from(([0u8; 4], port))),
            false => Err(e),
        })
        .map_err(|e| Error::Rendezvous {
            peer: format!("rank 0 listening on port {port}"),
            reason: e.to_string(),
        })
}

/// Whether `e` says the host has no IPv6 (none built in, or none configured).
fn no_ipv6(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EAFNOSUPPORT | libc::EADDRNOTAVAIL)
    )
}

/// A listener on `port` of every IPv6 interface that takes IPv4 connections too: the socket
/// says so itself (`IPV6_V6ONLY` off) rather than rely on the host's default
/// (`net.ipv6.bindv6only`), under which an IPv6 listener would never see an IPv4 peer.
fn dual_stack_listener(port: u16) -> std::io::Result<TcpListener> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let check = |r: libc::c_int| match r {
        -1 => Err(std::io::Error::last_os_error()),
        _ => Ok(()),
    };
    // SAFETY: socket(2) takes no pointers; a descriptor it returns is ours alone.
    let raw = unsafe { libc::socket(libc::AF_INET6, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    check(raw)?;
    // SAFETY: `raw` is a new descriptor nothing else owns; it is closed when `socket` drops.
    let socket = unsafe { OwnedFd::from_raw_fd(raw) };
    let set = |level, name, value: libc::c_int| {
        // SAFETY: the option's value is a live c_int of the length passed.
        check(unsafe {
            libc::setsockopt(
                raw,
                level,
                name,
                std::ptr::from_ref(&value).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        })
    };
    // As `TcpListener::bind` does: a port a previous run's connections linger on is taken.
    set(libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    set(libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 0)?;
    // SAFETY: all zeros is a valid sockaddr_in6 (the unspecified address).
    let mut address: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    address.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    address.sin6_port = port.to_be();
    // SAFETY: the address is a live sockaddr_in6 of the length passed.
    check(unsafe {
        libc::bind(
            raw,
            std::ptr::from_ref(&address).cast(),
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
        )
    })?;
    // SAFETY: listen(2) takes no pointers.
    check(unsafe { libc::listen(raw, libc::SOMAXCONN) })?;
    Ok(TcpListener::from(socket))
}

/// Every address `host:port` names, looked up again until `deadline` while the lookup fails:
/// rank 0's name may not be published yet (a service that starts with its pod, say). Each
/// lookup is the system's, which may itself block for the resolver's own timeout.
fn resolve_by(host: &str, port: u16, deadline: Instant) -> Result<Vec<SocketAddr>> {
    let started = Instant::now();
    loop {
        match resolve(host, port) {
            Ok(addrs) => return Ok(addrs),
            Err(e) if Instant::now() >= deadline => {
                return Err(Error::Timeout {
                    op: format!("looking up MASTER_ADDR {host} ({e})"),
                    waited: started.elapsed(),
                });
            }
            Err(_) => {
                std::thread::sleep(RETRY.min(deadline.saturating_duration_since(Instant::now())))
            }
        }
    }
}

/// Every address `host:port` names.
fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>> {
    let unreachable = |reason: String| Error::Rendezvous {
        peer: format!("{host}:{port}"),
        reason,
    };
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| unreachable(format!("MASTER_ADDR does not resolve: {e}")))?
        .collect();
    if addrs.is_empty() {
        return Err(unreachable("MASTER_ADDR names no address".into()));
    }
    Ok(addrs)
}

/// Serves `id` on `listener` to ranks 1 to `world - 1`, each once, until all were served or
/// `deadline` passed.
pub fn serve_id(
    listener: &TcpListener,
    world: usize,
    id: &[u8; ID_BYTES],
    deadline: Instant,
) -> Result<()> {
    let started = Instant::now();
    if world == 0 {
        return Err(Error::ZeroWorldSize);
    }
    let mut served = crate::fallible::filled(world, false, "the ranks served the id")?;
    served[0] = true;
    listener
        .set_nonblocking(true)
        .map_err(|e| serving(e.to_string()))?;
    // Why the last exchange or connection failed, for the timeout's message.
    let mut last_failure = None;
    while served.iter().any(|s| !s) {
        if Instant::now() >= deadline {
            let missing: Vec<String> = (0..world)
                .filter(|&r| !served[r])
                .map(|r| r.to_string())
                .collect();
            let failure =
                last_failure.map_or_else(String::new, |f| format!("; the last refused: {f}"));
            return Err(Error::Timeout {
                op: format!(
                    "rank 0 serving the NCCL unique id (ranks {} never came{failure})",
                    missing.join(", ")
                ),
                waited: started.elapsed(),
            });
        }
        match listener.accept() {
            Ok((stream, _)) => {
                // A refused or broken exchange is the peer's to report (it may try again);
                // rank 0 goes on serving.
                match answer(stream, world, &served, id, deadline) {
                    Ok(rank) => served[rank] = true,
                    Err(e) => last_failure = Some(e.to_string()),
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || is_transient_accept(&e) => {
                if e.kind() != ErrorKind::WouldBlock {
                    last_failure = Some(format!("accepting a connection: {e}"));
                }
                std::thread::sleep(RETRY.min(deadline.saturating_duration_since(Instant::now())));
            }
            Err(e) => return Err(serving(e.to_string())),
        }
    }
    Ok(())
}

/// Whether `accept` failing with `e` is the one connection's or the moment's, not the
/// listener's: a connection that broke before it was taken, a host short of descriptors or
/// buffers for now, or the network errors Linux's accept(2) says to take as EAGAIN.
fn is_transient_accept(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::ECONNABORTED
                | libc::EINTR
                | libc::EMFILE
                | libc::ENFILE
                | libc::ENOBUFS
                | libc::ENOMEM
                | libc::EPROTO
                | libc::ENETDOWN
                | libc::ENOPROTOOPT
                | libc::EHOSTDOWN
                | libc::ENONET
                | libc::EHOSTUNREACH
                | libc::EOPNOTSUPP
                | libc::ENETUNREACH
        )
    )
}

/// `stream`'s next bytes into `buf` (how many; 0 at its end), waiting no later than `until`.
fn read_by(stream: &mut TcpStream, buf: &mut [u8], until: Instant) -> std::io::Result<usize> {
    loop {
        stream.set_read_timeout(Some(time_left(until, "the peer's bytes came too late")?))?;
        match stream.read(buf) {
            // Interrupted, or the timeout passed: the deadline decides.
            Err(e) if is_retry(&e) => {}
            read => return read,
        }
    }
}

/// The time left until `until`, or `TimedOut` saying what came `late`.
fn time_left(until: Instant, late: &'static str) -> std::io::Result<Duration> {
    match until.saturating_duration_since(Instant::now()) {
        left if left.is_zero() => Err(std::io::Error::new(ErrorKind::TimedOut, late)),
        left => Ok(left),
    }
}

/// Whether a socket call that failed with `e` may be made again: it was interrupted, or its
/// timeout passed (EAGAIN; ETIMEDOUT is the connection's death, and final).
fn is_retry(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock)
}

/// Exactly `buf.len()` bytes of `stream`, by `until`.
fn read_exact_by(stream: &mut TcpStream, buf: &mut [u8], until: Instant) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        match read_by(stream, &mut buf[at..], until)? {
            0 => return Err(ErrorKind::UnexpectedEof.into()),
            n => at += n,
        }
    }
    Ok(())
}

/// `stream`'s bytes until its end, at most `limit` of them, by `until`.
fn read_to_end_by(
    stream: &mut TcpStream,
    limit: usize,
    until: Instant,
) -> std::io::Result<Vec<u8>> {
    let mut out = vec![0u8; limit];
    let mut at = 0;
    while at < limit {
        match read_by(stream, &mut out[at..], until)? {
            0 => break,
            n => at += n,
        }
    }
    out.truncate(at);
    Ok(out)
}

/// All of `bytes` onto `stream`, by `until`.
fn write_all_by(stream: &mut TcpStream, mut bytes: &[u8], until: Instant) -> std::io::Result<()> {
    while !bytes.is_empty() {
        stream.set_write_timeout(Some(time_left(until, "the peer took the bytes too late")?))?;
        match stream.write(bytes) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if is_retry(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn serving(reason: String) -> Error {
    Error::Rendezvous {
        peer: "rank 0 serving the id".into(),
        reason,
    }
}

/// Reads one hello on `stream` and answers it; the rank served, or why not.
fn answer(
    mut stream: TcpStream,
    world: usize,
    served: &[bool],
    id: &[u8; ID_BYTES],
    deadline: Instant,
) -> Result<usize> {
    let io = |e: std::io::Error| serving(e.to_string());
    stream.set_nonblocking(false).map_err(io)?;
    let until = deadline.min(deadline_after(HELLO_TIMEOUT));
    let mut hello = [0u8; HELLO_BYTES];
    read_exact_by(&mut stream, &mut hello, until).map_err(io)?;
    let word = |i: usize| u32::from_le_bytes([hello[i], hello[i + 1], hello[i + 2], hello[i + 3]]);
    let (their_world, rank) = (word(8) as usize, word(12) as usize);
    let refusal = if hello[..8] != HELLO_MAGIC {
        Some("the hello is not this protocol's".to_string())
    } else if their_world != world {
        Some(format!(
            "rank {rank} has WORLD_SIZE {their_world}, rank 0 has {world}"
        ))
    } else if rank == 0 || rank >= world {
        Some(format!(
            "rank {rank} is not a rank 1 to {} may serve",
            world - 1
        ))
    } else if served[rank] {
        Some(format!(
            "rank {rank} already took the id: two ranks have RANK {rank}"
        ))
    } else {
        None
    };
    match refusal {
        None => {
            let mut reply = [0u8; 1 + ID_BYTES];
            reply[1..].copy_from_slice(id);
            write_all_by(&mut stream, &reply, until).map_err(io)?;
            Ok(rank)
        }
        Some(reason) => {
            let mut reply = vec![1u8];
            reply.extend_from_slice(reason.as_bytes());
            // Best effort: the refusal is rank 0's to report too.
            let _ = write_all_by(&mut stream, &reply, until);
            Err(serving(reason))
        }
    }
}

/// Fetches the id from rank 0 at one of `addrs` (each tried in turn) as `rank` of `world`,
/// trying until `deadline`.
pub fn fetch_id(
    addrs: &[SocketAddr],
    rank: usize,
    world: usize,
    deadline: Instant,
) -> Result<[u8; ID_BYTES]> {
    let started = Instant::now();
    let named: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
    let at = named.join(" or ");
    let failed = |reason: String| Error::Rendezvous {
        peer: format!("rank 0 at {at}"),
        reason,
    };
    let (world32, rank32) = match (u32::try_from(world), u32::try_from(rank)) {
        (Ok(w), Ok(r)) => (w, r),
        _ => {
            return Err(failed(format!(
                "rank {rank} of {world} does not fit the hello"
            )));
        }
    };
    let mut hello = [0u8; HELLO_BYTES];
    hello[..8].copy_from_slice(&HELLO_MAGIC);
    hello[8..12].copy_from_slice(&world32.to_le_bytes());
    hello[12..].copy_from_slice(&rank32.to_le_bytes());
    let mut last = String::from("no attempt");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout {
                op: format!("rank {rank} fetching the NCCL unique id from rank 0 at {at} ({last})"),
                waited: started.elapsed(),
            });
        }
        let connected = addrs.iter().find_map(|addr| {
            TcpStream::connect_timeout(addr, left.min(Duration::from_secs(5)))
                .map_err(|e| last = format!("{addr}: {e}"))
                .ok()
                // A connect to a local port no one listens on yet may pick that port as its
                // own and meet itself (a simultaneous open): no rank 0 there, try again.
                .filter(|s| match (s.local_addr(), s.peer_addr()) {
                    (Ok(local), Ok(peer)) if local != peer => true,
                    _ => {
                        last = format!("{addr}: the connection met itself");
                        false
                    }
                })
        });
        // Rank 0 may not listen yet: then try again.
        if let Some(mut stream) = connected {
            let io = |e: std::io::Error| failed(e.to_string());
            write_all_by(&mut stream, &hello, deadline).map_err(io)?;
            let reply =
                read_to_end_by(&mut stream, 1 + ID_BYTES.max(MAX_REASON), deadline).map_err(io)?;
            return match reply.split_first() {
                Some((0, id)) if id.len() == ID_BYTES => {
                    let mut out = [0u8; ID_BYTES];
                    out.copy_from_slice(id);
                    Ok(out)
                }
                Some((1, reason)) => Err(failed(format!(
                    "rank 0 refused: {}",
                    String::from_utf8_lossy(reason)
                ))),
                _ => Err(failed(format!(
                    "rank 0 answered {} bytes, not an id",
                    reply.len()
                ))),
            };
        }
        std::thread::sleep(RETRY.min(deadline.saturating_duration_since(Instant::now())));
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    const TORCHRUN: [(&str, &str); 5] = [
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "node-0"),
        ("MASTER_PORT", "29500"),
    ];

    fn with(changes: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
        let mut all: Vec<_> = TORCHRUN
            .iter()
            .filter(|(k, _)| !changes.iter().any(|(c, _)| c == k))
            .copied()
            .collect();
        all.extend(changes.iter().filter(|(_, v)| !v.is_empty()));
        all
    }

    fn refused(changes: &[(&'static str, &'static str)]) -> (&'static str, String) {
        match LaunchEnv::from_vars(vars(&with(changes))) {
            Err(Error::LaunchEnv { variable, reason }) => (variable, reason),
            other => panic!("{changes:?}: {other:?}"),
        }
    }

    #[test]
    fn torchruns_variables_give_the_ranks_place() {
        let env = LaunchEnv::from_vars(vars(&TORCHRUN)).unwrap();
        assert_eq!(
            env,
            LaunchEnv {
                rank: 3,
                world_size: 8,
                local_rank: 1,
                master_addr: "node-0".into(),
                master_port: 29500,
                agent_store: false,
            }
        );
        assert_eq!(env.id_port(), 29500);
        let agent =
            LaunchEnv::from_vars(vars(&with(&[("TORCHELASTIC_USE_AGENT_STORE", "True")]))).unwrap();
        assert_eq!(agent.id_port(), 29501, "torchrun's store holds MASTER_PORT");
    }

    #[test]
    fn each_missing_or_malformed_variable_is_named() {
        for name in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ] {
            let mut all: Vec<_> = TORCHRUN.to_vec();
            all.retain(|(k, _)| *k != name);
            match LaunchEnv::from_vars(vars(&all)) {
                Err(Error::LaunchEnv { variable, reason }) => {
                    assert_eq!(variable, name);
                    assert!(reason.contains("not set"), "{reason}");
                }
                other => panic!("{name}: {other:?}"),
            }
        }
        assert_eq!(refused(&[("RANK", "three")]).0, "RANK");
        assert_eq!(refused(&[("RANK", "8")]).0, "RANK");
        assert_eq!(refused(&[("WORLD_SIZE", "0")]).0, "WORLD_SIZE");
        // The ranks' hello carries 32 bits.
        assert_eq!(refused(&[("WORLD_SIZE", "4294967296")]).0, "WORLD_SIZE");
        assert_eq!(refused(&[("MASTER_PORT", "70000")]).0, "MASTER_PORT");
        assert_eq!(refused(&[("MASTER_PORT", "0")]).0, "MASTER_PORT");
        assert_eq!(refused(&[("MASTER_ADDR", " ")]).0, "MASTER_ADDR");
        assert_eq!(
            refused(&[
                ("MASTER_PORT", "65535"),
                ("TORCHELASTIC_USE_AGENT_STORE", "True")
            ])
            .0,
            "MASTER_PORT"
        );
    }

    #[test]
    fn rank_0_s_listener_takes_ipv4_peers_whatever_the_host_s_ipv6_default() {
        use std::os::fd::AsRawFd;
        // A port free now, in both bytes (so that a port in the wrong byte order shows).
        let port = (0x9A00..0x9AFF)
            .find(|p: &u16| p.to_be_bytes()[0] != p.to_be_bytes()[1] && free_port(*p))
            .expect("a free port");
        let listener = match dual_stack_listener(port) {
            Ok(listener) => listener,
            // A host without IPv6: `listen` falls back to IPv4 alone.
            Err(e) if no_ipv6(&e) => return,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(listener.local_addr().unwrap().port(), port);
        let mut v6only: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: the value and its length are live locals of the sizes passed.
        let got = unsafe {
            libc::getsockopt(
                listener.as_raw_fd(),
                libc::IPPROTO_IPV6,
                libc::IPV6_V6ONLY,
                std::ptr::from_mut(&mut v6only).cast(),
                &mut len,
            )
        };
        // Holds where the host's default is IPv6 alone (net.ipv6.bindv6only = 1).
        assert_eq!((got, v6only), (0, 0), "IPV6_V6ONLY is set");
        let id = [5u8; ID_BYTES];
        let deadline = Instant::now() + Duration::from_secs(30);
        let fetched = std::thread::scope(|s| {
            let server = s.spawn(|| serve_id(&listener, 2, &id, deadline));
            let v4 = SocketAddr::from(([127, 0, 0, 1], port));
            let fetched = fetch_id(&[v4], 1, 2, deadline);
            server.join().unwrap().unwrap();
            fetched
        });
        assert_eq!(fetched.unwrap(), id);
    }

    /// Whether `port` is free on IPv6 and on IPv4 (each listener gone before the next).
    fn free_port(port: u16) -> bool {
        let v6 = TcpListener::bind(SocketAddr::from(([0u16; 8], port))).is_ok();
        let v4 = TcpListener::bind(SocketAddr::from(([0u8; 4], port))).is_ok();
        v6 && v4
    }

    fn local_listener() -> (TcpListener, SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        (listener, addr)
    }

    #[test]
    fn rank_0_hands_the_id_to_every_rank_once() {
        let (listener, addr) = local_listener();
        let id: [u8; ID_BYTES] = std::array::from_fn(|i| (i * 7 + 3) as u8);
        let deadline = Instant::now() + Duration::from_secs(30);
        let fetched = std::thread::scope(|s| {
            let server = s.spawn(|| serve_id(&listener, 4, &id, deadline));
            let clients: Vec<_> = (1..4)
                .map(|rank| s.spawn(move || fetch_id(&[addr], rank, 4, deadline)))
                .collect();
            let fetched: Vec<_> = clients.into_iter().map(|c| c.join().unwrap()).collect();
            server.join().unwrap().unwrap();
            fetched
        });
        for f in fetched {
            assert_eq!(f.unwrap(), id);
        }
    }

    #[test]
    fn a_rank_that_disagrees_is_refused_with_the_reason_on_both_sides() {
        let (listener, addr) = local_listener();
        let id = [9u8; ID_BYTES];
        let deadline = Instant::now() + Duration::from_millis(1500);
        let (server, wrong, twice) = std::thread::scope(|s| {
            let server = s.spawn(|| serve_id(&listener, 3, &id, deadline));
            let wrong = fetch_id(&[addr], 1, 4, deadline);
            let first = fetch_id(&[addr], 1, 3, deadline).unwrap();
            assert_eq!(first, id);
            let twice = fetch_id(&[addr], 1, 3, deadline);
            (server.join().unwrap(), wrong, twice)
        });
        let reason = |r: Result<[u8; ID_BYTES]>| match r {
            Err(Error::Rendezvous { reason, .. }) => reason,
            other => panic!("{other:?}"),
        };
        assert!(
            reason(wrong).contains("rank 1 has WORLD_SIZE 4, rank 0 has 3"),
            "the world sizes named"
        );
        assert!(reason(twice).contains("two ranks have RANK 1"));
        // Rank 2 never came: rank 0 names it at its deadline, and the last refusal.
        match server {
            Err(Error::Timeout { op, .. }) => {
                assert!(op.contains("ranks 2 never came"), "{op}");
                assert!(op.contains("two ranks have RANK 1"), "{op}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// A peer that sends (or, as rank 0, answers) a byte every 300 ms holds neither side past
    /// its deadline of 1 s: each exchange ends by it, not by a timeout that restarts at every
    /// byte (which took 4.8 s for rank 0's hello and 39 s for the answer).
    #[test]
    fn a_peer_sending_a_byte_at_a_time_holds_no_side_past_its_deadline() {
        let drip = |mut peer: TcpStream, bytes: usize| {
            for _ in 0..bytes {
                if peer.write_all(&[1]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        };
        let within = Duration::from_secs(1);
        let (listener, addr) = local_listener();
        let (served, fetched) = std::thread::scope(|s| {
            let peer = TcpStream::connect(addr).unwrap();
            s.spawn(move || drip(peer, HELLO_BYTES));
            let started = Instant::now();
            let served = serve_id(&listener, 2, &[5u8; ID_BYTES], started + within);
            let served = (served, started.elapsed());
            s.spawn(|| {
                listener.set_nonblocking(false).unwrap();
                let (peer, _) = listener.accept().unwrap();
                drip(peer, 1 + ID_BYTES);
            });
            let started = Instant::now();
            let fetched = fetch_id(&[addr], 1, 2, started + within);
            (served, (fetched, started.elapsed()))
        });
        match served {
            (Err(Error::Timeout { op, .. }), took) => {
                assert!(op.contains("too late"), "{op}");
                assert!(took < Duration::from_secs(3), "{took:?}");
            }
            other => panic!("{other:?}"),
        }
        match fetched {
            (Err(Error::Rendezvous { reason, .. }), took) => {
                assert!(reason.contains("too late"), "{reason}");
                assert!(took < Duration::from_secs(3), "{took:?}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_peer_that_connects_and_says_nothing_holds_rank_0_up_only_briefly() {
        let (listener, addr) = local_listener();
        let id = [3u8; ID_BYTES];
        let deadline = Instant::now() + Duration::from_secs(60);
        let started = Instant::now();
        let fetched = std::thread::scope(|s| {
            let server = s.spawn(|| serve_id(&listener, 2, &id, deadline));
            let _silent = TcpStream::connect(addr).unwrap();
            let fetched = fetch_id(&[addr], 1, 2, deadline);
            server.join().unwrap().unwrap();
            fetched
        });
        assert_eq!(fetched.unwrap(), id);
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn a_deadline_past_what_the_clock_counts_is_far_away_not_a_panic() {
        assert!(deadline_after(Duration::MAX) > Instant::now() + Duration::from_secs(3600));
    }

    #[test]
    fn a_rank_with_no_rank_0_times_out_naming_the_address() {
        let (listener, addr) = local_listener();
        drop(listener);
        let started = Instant::now();
        match fetch_id(&[addr], 1, 2, Instant::now() + Duration::from_millis(300)) {
            Err(Error::Timeout { op, .. }) => assert!(op.contains(&addr.to_string()), "{op}"),
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn a_master_addr_that_does_not_resolve_is_looked_up_again_until_the_deadline() {
        // `.invalid` never resolves (RFC 2606).
        let env = LaunchEnv::from_vars(vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "rank0.invalid"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        let timeout = Duration::from_millis(300);
        let started = Instant::now();
        match env.share_id(|| panic!("only rank 0 makes the id"), timeout) {
            Err(Error::Timeout { op, .. }) => {
                assert!(op.contains("MASTER_ADDR rank0.invalid"), "{op}")
            }
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() >= timeout);
    }

    #[test]
    fn share_id_connects_rank_0_and_the_others_through_the_environment() {
        let port = {
            let (listener, addr) = local_listener();
            drop(listener);
            addr.port().to_string()
        };
        let env = |rank: &'static str| {
            let port = port.clone();
            LaunchEnv::from_vars(move |name| match name {
                "RANK" => Some(rank.into()),
                "WORLD_SIZE" => Some("2".into()),
                "LOCAL_RANK" => Some("0".into()),
                "MASTER_ADDR" => Some("127.0.0.1".into()),
                "MASTER_PORT" => Some(port.clone()),
                _ => None,
            })
            .unwrap()
        };
        let (zero, one) = (env("0"), env("1"));
        let timeout = Duration::from_secs(30);
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| zero.share_id(|| Ok([5u8; ID_BYTES]), timeout));
            let b = s.spawn(|| one.share_id(|| panic!("only rank 0 makes the id"), timeout));
            (a.join().unwrap(), b.join().unwrap())
        });
        assert_eq!(a.unwrap(), [5u8; ID_BYTES]);
        assert_eq!(b.unwrap(), [5u8; ID_BYTES]);
    }
}
