//! Getting NCCL's unique id from rank 0 to the other ranks at start-up (the NCCL backend's only
//! traffic outside NCCL), by the first of these that applies:
//!
//! 1. `TALLOW_NCCL_ID`: `tallow train --nproc` makes the id once and hands it to its children as
//!    256 hex digits ([`id_to_hex`], [`id_from_hex`]);
//! 2. under `mpirun`, with the `mpi` feature: an MPI broadcast from rank 0 (`crate::nccl`);
//! 3. otherwise (torchrun, Slurm): TCP to `MASTER_ADDR`:`MASTER_PORT` ([`share_id`]), as
//!    torch's TCPStore serves its NCCL id: rank 0 listens there and sends the id to each of the
//!    other `world - 1` ranks, which connect with retries until the timeout.
//!
//! The TCP exchange is a request and a reply per rank, each with a magic prefix so that a stray
//! connection (or a port that another program owns) is refused rather than misread:
//!
//! ```text
//! rank r -> rank 0:  "tallow-nccl-id\0\0" (16 bytes), r (u32 LE), world (u32 LE)
//! rank 0 -> rank r:  "tallow-nccl-id\0\0" (16 bytes), 0, the id (128 bytes)
//!               or:  "tallow-nccl-id\0\0" (16 bytes), 1, why (u16 LE length, UTF-8)
//! ```
//!
//! A refused rank (another job's world size, a rank number served already) stops at once with
//! rank 0's reason; a connection that does not start with the magic is closed unanswered.
//!
//! Only the 128-byte id travels here; the collectives are NCCL's own connections.

use std::collections::BTreeSet;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::{DistError, Result};

/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const ID_BYTES: usize = 128;

/// The environment variable `tallow train --nproc` passes the id in, as hex.
pub const ID_ENV: &str = "TALLOW_NCCL_ID";

/// Prefix of both messages of the TCP exchange.
const MAGIC: &[u8; 16] = b"tallow-nccl-id\0\0";

/// How long one connection attempt, or one read of a connected peer, may take before retrying
/// (connect) or giving up on that peer (rank 0), within the overall timeout.
const STEP: Duration = Duration::from_secs(2);

fn launch_err(what: String) -> DistError {
    DistError::Launch(what)
}

/// The id as 256 lowercase hex digits.
pub fn id_to_hex(id: &[u8; ID_BYTES]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// The id from [`ID_ENV`]'s hex; the error names the variable and what it holds.
pub fn id_from_hex(hex: &str) -> Result<[u8; ID_BYTES]> {
    let hex = hex.trim();
    if hex.len() != 2 * ID_BYTES {
        return Err(launch_err(format!(
            "{ID_ENV} must be the {}-digit hex of the {ID_BYTES}-byte NCCL id that `tallow \
             train --nproc` sets for its ranks; it holds {} characters (unset it to exchange the \
             id over MASTER_ADDR:MASTER_PORT instead)",
            2 * ID_BYTES,
            hex.len()
        )));
    }
    let mut id = [0u8; ID_BYTES];
    for (i, byte) in id.iter_mut().enumerate() {
        let pair = &hex[2 * i..2 * i + 2];
        *byte = u8::from_str_radix(pair, 16).map_err(|_| {
            launch_err(format!(
                "{ID_ENV}: `{pair}` at character {} is not hex (the variable must be the \
                 {}-digit hex of an NCCL id, as `tallow train --nproc` sets it)",
                2 * i,
                2 * ID_BYTES
            ))
        })?;
    }
    Ok(id)
}

/// Where rank 0 serves the id over TCP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Master {
    pub addr: String,
    pub port: u16,
    /// How the variables give it, for messages: `MASTER_ADDR:MASTER_PORT`, or
    /// `MASTER_ADDR:MASTER_PORT+1` under torchrun, whose agent holds MASTER_PORT itself.
    pub named: &'static str,
}

impl Master {
    /// `addr:port` as `MASTER_ADDR:MASTER_PORT` give it.
    pub fn new(addr: &str, port: u16) -> Master {
        Master {
            addr: addr.to_string(),
            port,
            named: "MASTER_ADDR:MASTER_PORT",
        }
    }

    fn describe(&self) -> String {
        format!("{} = {}:{}", self.named, self.addr, self.port)
    }
}

/// Rank 0's host and port for the TCP exchange, from `MASTER_ADDR` and `MASTER_PORT` as `get`
/// returns them (torchrun sets both; under srun the job script exports them). torchrun's agent
/// serves its own TCPStore on MASTER_PORT and tells its workers so
/// (`TORCHELASTIC_USE_AGENT_STORE=True`): then the id goes through the next port.
pub fn master_from(get: &dyn Fn(&str) -> Option<String>, launcher: &str) -> Result<Master> {
    let addr = get("MASTER_ADDR").filter(|a| !a.trim().is_empty());
    let port = get("MASTER_PORT").filter(|p| !p.trim().is_empty());
    let (addr, port) = match (addr, port) {
        (Some(a), Some(p)) => (a, p),
        (a, p) => {
            let missing: Vec<&str> = [("MASTER_ADDR", a.is_none()), ("MASTER_PORT", p.is_none())]
                .iter()
                .filter(|(_, m)| *m)
                .map(|(n, _)| *n)
                .collect();
            return Err(launch_err(format!(
                "NCCL start-up under {launcher}: {} not set. Ranks exchange NCCL's id through \
                 rank 0 at MASTER_ADDR:MASTER_PORT: set MASTER_ADDR to rank 0's host name or \
                 address and MASTER_PORT to a free TCP port there, the same on every rank \
                 (torchrun sets both; in a Slurm script e.g. `export MASTER_ADDR=$(scontrol show \
                 hostnames \"$SLURM_JOB_NODELIST\" | head -n1) MASTER_PORT=29500`), or start the \
                 ranks with `tallow train --nproc N` on one machine",
                missing.join(" and ")
            )));
        }
    };
    let port = port
        .trim()
        .parse::<u16>()
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| {
            launch_err(format!(
                "MASTER_PORT={port:?} is not a TCP port number (1-65535)"
            ))
        })?;
    let agent_store =
        get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    let mut master = Master::new(addr.trim(), port);
    if agent_store {
        master.port = port.checked_add(1).ok_or_else(|| {
            launch_err(
                "MASTER_PORT=65535: under torchrun the NCCL id goes through MASTER_PORT+1; \
                 pick a lower --master-port"
                    .into(),
            )
        })?;
        master.named = "MASTER_ADDR:MASTER_PORT+1 (torchrun's agent holds MASTER_PORT)";
    }
    Ok(master)
}

/// NCCL's id on every rank: rank 0 makes it (`make_id`, called on rank 0 only) and serves it on
/// `master.port` until each of the other `world - 1` ranks has fetched it; the others connect
/// to `master`, retrying until `timeout` (rank 0 may start later than they do). Errors name
/// `MASTER_ADDR:MASTER_PORT`, the address, the ranks missing and the timeout.
pub fn share_id(
    master: &Master,
    rank: usize,
    world: usize,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<[u8; ID_BYTES]>,
) -> Result<[u8; ID_BYTES]> {
    let deadline = Instant::now() + timeout;
    if rank == 0 {
        let id = make_id()?;
        serve(master, world, &id, deadline, timeout)?;
        Ok(id)
    } else {
        fetch(master, rank, world, deadline, timeout)
    }
}

/// Rank 0: listens on `port` (all addresses of `addr`'s family) and answers each other rank
/// once.
fn serve(
    master: &Master,
    world: usize,
    id: &[u8; ID_BYTES],
    deadline: Instant,
    timeout: Duration,
) -> Result<()> {
    let (addr, port) = (master.addr.as_str(), master.port);
    let at = master.describe();
    // Every interface, as torch's TCPStore does: MASTER_ADDR is how the others reach this host,
    // which may be a name this host does not resolve to itself.
    let v6 = resolve(addr, port)
        .ok()
        .is_some_and(|a| a.first().is_some_and(|a| a.is_ipv6()));
    let any: SocketAddr = if v6 {
        (Ipv6Addr::UNSPECIFIED, port).into()
    } else {
        (Ipv4Addr::UNSPECIFIED, port).into()
    };
    let listener = TcpListener::bind(any).map_err(|e| {
        launch_err(format!(
            "rank 0: cannot listen on port {port} ({at}) for the NCCL id exchange: {e}; pick a \
             free MASTER_PORT"
        ))
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| launch_err(format!("rank 0: {at}: {e}")))?;
    let mut served = BTreeSet::new();
    while served.len() + 1 < world {
        match listener.accept() {
            Ok((stream, peer)) => {
                // A peer that is not one of ours, or a rank of another job, is noted and skipped:
                // one bad connection must not stop the job's own ranks.
                match answer(stream, world, id, &served) {
                    Ok(r) => {
                        served.insert(r);
                    }
                    Err(why) => eprintln!("tallow: rank 0: refused {peer} on {at}: {why}"),
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> = (1..world)
                        .filter(|r| !served.contains(r))
                        .map(|r| r.to_string())
                        .collect();
                    return Err(launch_err(format!(
                        "rank 0: {} of the other {} ranks fetched the NCCL id from {at} within \
                         {:.0} s; rank(s) {} never connected: did they start, with the same \
                         MASTER_ADDR and MASTER_PORT, and can they reach this host on that port? \
                         (train.dist_timeout_s)",
                        served.len(),
                        world - 1,
                        timeout.as_secs_f64(),
                        missing.join(", ")
                    )));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(launch_err(format!("rank 0: accepting on {at}: {e}"))),
        }
    }
    Ok(())
}

/// Rank 0's half of one exchange: reads the request, sends the id (or the reason it refuses
/// the peer); Ok(the peer's rank).
fn answer(
    mut stream: TcpStream,
    world: usize,
    id: &[u8; ID_BYTES],
    served: &BTreeSet<usize>,
) -> std::result::Result<usize, String> {
    stream.set_nonblocking(false).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(STEP))
        .and_then(|()| stream.set_write_timeout(Some(STEP)))
        .map_err(|e| e.to_string())?;
    let mut request = [0u8; 24];
    stream
        .read_exact(&mut request)
        .map_err(|e| format!("no request ({e})"))?;
    if &request[..16] != MAGIC {
        return Err("not a tallow rank (bad greeting)".into());
    }
    let rank = u32::from_le_bytes(request[16..20].try_into().unwrap()) as usize;
    let their_world = u32::from_le_bytes(request[20..24].try_into().unwrap()) as usize;
    let refusal = if their_world != world {
        Some(format!(
            "rank {rank} says the job has {their_world} ranks, rank 0 says {world} (another \
             job on the same MASTER_PORT?)"
        ))
    } else if rank == 0 || rank >= world {
        Some(format!("rank {rank} is not a rank of a job of {world}"))
    } else if served.contains(&rank) {
        Some(format!(
            "rank {rank} has fetched the id already (two processes with one RANK?)"
        ))
    } else {
        None
    };
    let mut reply = MAGIC.to_vec();
    match &refusal {
        None => {
            reply.push(0);
            reply.extend_from_slice(id);
        }
        Some(why) => {
            reply.push(1);
            reply.extend_from_slice(&(why.len() as u16).to_le_bytes());
            reply.extend_from_slice(why.as_bytes());
        }
    }
    stream
        .write_all(&reply)
        .map_err(|e| format!("sending the reply to rank {rank}: {e}"))?;
    match refusal {
        None => Ok(rank),
        Some(why) => Err(why),
    }
}

/// Why one attempt to fetch the id failed.
enum Attempt {
    /// Rank 0 is not there (yet), or the connection broke: try again.
    Retry(String),
    /// Rank 0 answered and refused this rank: stop.
    Refused(String),
}

/// A rank other than 0: connects to rank 0 (retrying until the deadline) and reads the id.
fn fetch(
    master: &Master,
    rank: usize,
    world: usize,
    deadline: Instant,
    timeout: Duration,
) -> Result<[u8; ID_BYTES]> {
    let (addr, port) = (master.addr.as_str(), master.port);
    let at = master.describe();
    let mut last = String::from("no attempt");
    let mut pause = Duration::from_millis(20);
    loop {
        match resolve(addr, port) {
            Ok(addrs) => {
                for a in addrs {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    match TcpStream::connect_timeout(&a, left.min(STEP)) {
                        Ok(stream) => match request(stream, rank, world, left.min(STEP)) {
                            Ok(id) => return Ok(id),
                            Err(Attempt::Retry(why)) => last = format!("{a}: {why}"),
                            Err(Attempt::Refused(why)) => {
                                return Err(launch_err(format!(
                                    "rank {rank}: rank 0 at {at} refused this rank: {why}"
                                )))
                            }
                        },
                        Err(e) => last = format!("{a}: {e}"),
                    }
                }
            }
            Err(why) => last = why,
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(launch_err(format!(
                "rank {rank}: could not get the NCCL id from rank 0 at {at} within {:.0} s \
                 (last attempt: {last}); is rank 0 running, with the same MASTER_ADDR and \
                 MASTER_PORT, and is that address reachable from this host? \
                 (train.dist_timeout_s)",
                timeout.as_secs_f64()
            )));
        }
        // Rank 0 may not listen yet: retry, backing off to a second between attempts.
        std::thread::sleep(pause.min(left));
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// A connected rank's half of one exchange.
fn request(
    mut stream: TcpStream,
    rank: usize,
    world: usize,
    wait: Duration,
) -> std::result::Result<[u8; ID_BYTES], Attempt> {
    let retry = |e: std::io::Error| Attempt::Retry(e.to_string());
    stream
        .set_read_timeout(Some(wait))
        .and_then(|()| stream.set_write_timeout(Some(wait)))
        .map_err(retry)?;
    let mut req = [0u8; 24];
    req[..16].copy_from_slice(MAGIC);
    req[16..20].copy_from_slice(&(rank as u32).to_le_bytes());
    req[20..24].copy_from_slice(&(world as u32).to_le_bytes());
    stream.write_all(&req).map_err(retry)?;
    let mut head = [0u8; 17];
    stream
        .read_exact(&mut head)
        .map_err(|e| Attempt::Retry(format!("no reply ({e})")))?;
    if &head[..16] != MAGIC {
        return Err(Attempt::Refused(
            "the program on that port is not tallow's rank 0".into(),
        ));
    }
    if head[16] == 0 {
        let mut id = [0u8; ID_BYTES];
        stream
            .read_exact(&mut id)
            .map_err(|e| Attempt::Retry(format!("a cut reply ({e})")))?;
        return Ok(id);
    }
    let mut len = [0u8; 2];
    let mut why = Vec::new();
    stream
        .read_exact(&mut len)
        .and_then(|()| {
            why.resize(u16::from_le_bytes(len) as usize, 0);
            stream.read_exact(&mut why)
        })
        .map_err(|e| Attempt::Retry(format!("a cut reply ({e})")))?;
    Err(Attempt::Refused(String::from_utf8_lossy(&why).into_owned()))
}

fn resolve(addr: &str, port: u16) -> std::result::Result<Vec<SocketAddr>, String> {
    (addr, port)
        .to_socket_addrs()
        .map(|a| a.collect())
        .map_err(|e| format!("cannot resolve MASTER_ADDR={addr}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A port nothing listens on right now (the OS's pick, released).
    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// A 128-byte id with every byte different from its neighbours.
    fn blob() -> [u8; ID_BYTES] {
        std::array::from_fn(|i| (i * 37 + 11) as u8)
    }

    #[test]
    fn three_ranks_share_rank_zeros_id_over_loopback() {
        let port = free_port();
        let timeout = Duration::from_secs(20);
        // Ranks 1 and 2 start first and must retry until rank 0 listens.
        let others: Vec<_> = (1..3)
            .map(|r| {
                std::thread::spawn(move || {
                    share_id(&Master::new("127.0.0.1", port), r, 3, timeout, || {
                        panic!("only rank 0 makes the id")
                    })
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let zero = share_id(
            &Master::new("127.0.0.1", port),
            0,
            3,
            timeout,
            || Ok(blob()),
        )
        .unwrap();
        assert_eq!(zero, blob());
        for (r, t) in others.into_iter().enumerate() {
            assert_eq!(t.join().unwrap().unwrap(), blob(), "rank {}", r + 1);
        }
    }

    #[test]
    fn a_rank_without_rank_zero_gives_up_within_the_timeout_naming_the_address() {
        let port = free_port();
        let timeout = Duration::from_millis(600);
        let start = Instant::now();
        let e = share_id(
            &Master::new("127.0.0.1", port),
            1,
            2,
            timeout,
            || unreachable!(),
        )
        .unwrap_err()
        .to_string();
        let took = start.elapsed();
        assert!(
            // The last attempt is cut to the time left: the overshoot is scheduling only.
            took >= timeout && took < timeout + Duration::from_millis(500),
            "{took:?}"
        );
        assert!(
            e.contains(&format!("MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port}")),
            "{e}"
        );
        assert!(e.contains("rank 1: could not get the NCCL id"), "{e}");
    }

    #[test]
    fn rank_zero_names_the_ranks_that_never_came_and_refuses_strangers() {
        let port = free_port();
        let timeout = Duration::from_millis(1500);
        let zero = std::thread::spawn(move || {
            share_id(
                &Master::new("127.0.0.1", port),
                0,
                4,
                timeout,
                || Ok(blob()),
            )
        });
        // Rank 2 comes; a rank of a job of 5 and a plain client are refused, not counted.
        let two = share_id(
            &Master::new("127.0.0.1", port),
            2,
            4,
            timeout,
            || unreachable!(),
        )
        .unwrap();
        assert_eq!(two, blob());
        let start = Instant::now();
        let stranger = share_id(
            &Master::new("127.0.0.1", port),
            1,
            5,
            timeout,
            || unreachable!(),
        )
        .unwrap_err()
        .to_string();
        assert!(start.elapsed() < timeout, "a refusal is final, not retried");
        assert!(
            stranger.contains("refused this rank: rank 1 says the job has 5 ranks, rank 0 says 4"),
            "{stranger}"
        );
        let mut plain = TcpStream::connect(("127.0.0.1", port)).unwrap();
        plain.write_all(b"GET / HTTP/1.0\r\nHost: a\r").unwrap();
        let mut answer = Vec::new();
        plain.read_to_end(&mut answer).unwrap();
        assert!(answer.is_empty(), "a stranger gets no reply");
        let e = zero.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("1 of the other 3 ranks fetched"), "{e}");
        assert!(e.contains("rank(s) 1, 3 never connected"), "{e}");
        assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
    }

    #[test]
    fn hex_round_trip_and_bad_hex() {
        let id = blob();
        let hex = id_to_hex(&id);
        assert_eq!(hex.len(), 256);
        assert_eq!(&hex[..6], "0b3055");
        assert_eq!(id_from_hex(&hex).unwrap(), id);
        assert_eq!(
            id_from_hex(&format!("{hex}\n")).unwrap(),
            id,
            "trailing newline"
        );
        let e = id_from_hex(&hex[..254]).unwrap_err().to_string();
        assert!(
            e.contains("TALLOW_NCCL_ID must be the 256-digit hex"),
            "{e}"
        );
        assert!(e.contains("254 characters"), "{e}");
        let bad = format!("{}zz{}", &hex[..10], &hex[12..]);
        let e = id_from_hex(&bad).unwrap_err().to_string();
        assert!(e.contains("`zz` at character 10 is not hex"), "{e}");
    }

    #[test]
    fn missing_master_variables_are_named_with_the_fix() {
        let vars = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let none = vars(&[]);
        let e = master_from(&|k| none.get(k).cloned(), "srun")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("under srun: MASTER_ADDR and MASTER_PORT not set"),
            "{e}"
        );
        assert!(e.contains("export MASTER_ADDR="), "{e}");
        let addr_only = vars(&[("MASTER_ADDR", "node1")]);
        let e = master_from(&|k| addr_only.get(k).cloned(), "srun")
            .unwrap_err()
            .to_string();
        assert!(e.contains(": MASTER_PORT not set"), "{e}");
        let bad_port = vars(&[("MASTER_ADDR", "node1"), ("MASTER_PORT", "70000")]);
        let e = master_from(&|k| bad_port.get(k).cloned(), "srun")
            .unwrap_err()
            .to_string();
        assert!(e.contains("MASTER_PORT=\"70000\" is not a TCP port"), "{e}");
        let both = vars(&[("MASTER_ADDR", "node1"), ("MASTER_PORT", "29500")]);
        assert_eq!(
            master_from(&|k| both.get(k).cloned(), "srun").unwrap(),
            Master::new("node1", 29500)
        );
        // torchrun's agent serves its store on MASTER_PORT: the id takes the next port.
        let torchrun = vars(&[
            ("MASTER_ADDR", "node1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ]);
        let m = master_from(&|k| torchrun.get(k).cloned(), "torchrun").unwrap();
        assert_eq!((m.addr.as_str(), m.port), ("node1", 29501));
        assert!(
            m.describe().starts_with("MASTER_ADDR:MASTER_PORT+1"),
            "{m:?}"
        );
    }
}
