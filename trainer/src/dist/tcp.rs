//! Ranks over TCP (loopback on one machine): a star around rank 0. Every collective
//! sends each rank's contribution to rank 0, which combines them in rank order 0, 1, ..., W-1
//! and sends the result back, so every rank gets the same bits and a run is deterministic.
//! Every frame names its collective's sequence number and kind, so ranks that fall out of
//! step fail at once; a closed connection or a rank silent past the timeout fails the
//! collective with an error naming that rank.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{Collective, DistError, Rendezvous};

/// First bytes of a rank's hello and of rank 0's answer.
const MAGIC: &[u8; 8] = b"DPPOrank";
/// Bumped when the frames change.
const VERSION: u32 = 1;

/// The kinds of collective, as frames carry them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    AllReduce = 1,
    Broadcast = 2,
    AllGather = 3,
}

impl Op {
    fn name(code: u8) -> &'static str {
        match code {
            1 => "all-reduce",
            2 => "broadcast",
            3 => "all-gather",
            _ => "unknown",
        }
    }
}

/// One rank's end of the star: rank 0 holds a stream per other rank, the others one
/// stream to rank 0.
pub struct TcpCollective {
    rank: usize,
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
}

struct State {
    /// Collectives done so far: the next one's sequence number.
    seq: u64,
    /// Rank 0: `peers[r]` for r in 1..W (`peers[0]` unused). Others: `peers[0]`.
    peers: Vec<Option<TcpStream>>,
}

impl std::fmt::Debug for TcpCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpCollective")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

impl TcpCollective {
    /// Rank 0: accepts ranks 1..`world` on `listener`; fails when they have not all
    /// joined within `timeout`.
    pub fn root(listener: TcpListener, world: usize, timeout: Duration) -> Result<Self, DistError> {
        let rdv = |e: String| DistError::Rendezvous(e);
        let deadline = Instant::now() + timeout;
        let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        listener
            .set_nonblocking(true)
            .map_err(|e| rdv(format!("listener: {e}")))?;
        let mut joined = 1;
        while joined < world {
            match listener.accept() {
                Ok((stream, from)) => match hello_from(stream, world, timeout) {
                    Ok((rank, stream)) if peers[rank].is_none() => {
                        peers[rank] = Some(stream);
                        joined += 1;
                    }
                    Ok((rank, _)) => {
                        return Err(rdv(format!(
                            "two processes joined as rank {rank} (the second from {from})"
                        )))
                    }
                    Err(HelloError::Fatal(e)) => return Err(e),
                    // Not a rank (a stray connection): keep waiting for the ranks.
                    Err(HelloError::Stray(e)) => {
                        tracing::warn!("rendezvous: ignored a connection from {from}: {e}")
                    }
                },
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let missing: Vec<String> = (1..world)
                            .filter(|&r| peers[r].is_none())
                            .map(|r| r.to_string())
                            .collect();
                        return Err(rdv(format!(
                            "rank(s) {} did not join rank 0 within {} s",
                            missing.join(", "),
                            timeout.as_secs()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(rdv(format!("accepting ranks: {e}"))),
            }
        }
        // Everyone is here: tell them (the rendezvous is also the first barrier).
        for (rank, peer) in peers.iter_mut().enumerate().skip(1) {
            let stream = peer.as_mut().expect("joined");
            let mut answer = MAGIC.to_vec();
            answer.extend_from_slice(&VERSION.to_le_bytes());
            stream
                .write_all(&answer)
                .map_err(|e| rdv(format!("answering rank {rank}: {e}")))?;
        }
        Ok(Self {
            rank: 0,
            world,
            timeout,
            state: Mutex::new(State { seq: 0, peers }),
        })
    }

    /// Rank `rank` (> 0) of `world`: connects to rank 0 at `addr:port`, retrying until it
    /// listens, and waits until every rank has joined (both within `timeout`).
    pub fn join(
        addr: &str,
        port: u16,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self, DistError> {
        let rdv = |e: String| DistError::Rendezvous(e);
        assert!(rank > 0 && rank < world, "join is for ranks 1..world");
        let deadline = Instant::now() + timeout;
        let targets: Vec<SocketAddr> = (addr, port)
            .to_socket_addrs()
            .map_err(|e| rdv(format!("MASTER_ADDR {addr}:{port}: {e}")))?
            .collect();
        let mut stream = loop {
            let attempt = targets
                .iter()
                .find_map(|target| TcpStream::connect_timeout(target, Duration::from_secs(1)).ok());
            match attempt {
                Some(stream) => break stream,
                None if Instant::now() > deadline => {
                    return Err(rdv(format!(
                        "rank {rank} could not reach rank 0 at {addr}:{port} within {} s",
                        timeout.as_secs()
                    )))
                }
                None => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        configure(&stream, timeout).map_err(|e| rdv(format!("socket: {e}")))?;
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&VERSION.to_le_bytes());
        hello.extend_from_slice(&(rank as u32).to_le_bytes());
        hello.extend_from_slice(&(world as u32).to_le_bytes());
        stream
            .write_all(&hello)
            .map_err(|e| rdv(format!("rank {rank} greeting rank 0: {e}")))?;
        // Rank 0 answers once all ranks are in: wait as long as the rendezvous may take.
        let left = deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(5);
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| rdv(format!("socket: {e}")))?;
        let mut answer = [0u8; 12];
        stream.read_exact(&mut answer).map_err(|e| {
            rdv(format!(
                "rank {rank} waiting for rank 0 to accept every rank: {e} (rank 0 refused \
                 this rank or gave up; its output says why)"
            ))
        })?;
        if &answer[..8] != MAGIC || answer[8..] != VERSION.to_le_bytes() {
            return Err(rdv(format!(
                "rank {rank}: {addr}:{port} is not a dppo rank 0 of this version"
            )));
        }
        stream
            .set_read_timeout(Some(timeout))
            .map_err(|e| rdv(format!("socket: {e}")))?;
        let mut peers: Vec<Option<TcpStream>> = vec![None];
        peers[0] = Some(stream);
        Ok(Self {
            rank,
            world,
            timeout,
            state: Mutex::new(State { seq: 0, peers }),
        })
    }

    /// Rank `rdv.rank` from a rendezvous: rank 0 listens on `MASTER_ADDR:MASTER_PORT`, the
    /// others connect to it.
    pub fn connect(rdv: &Rendezvous, timeout: Duration) -> Result<Self, DistError> {
        if rdv.rank == 0 {
            let listener = TcpListener::bind((rdv.addr.as_str(), rdv.port)).map_err(|e| {
                DistError::Rendezvous(format!(
                    "rank 0 cannot listen on MASTER_ADDR:MASTER_PORT = {}:{}: {e}",
                    rdv.addr, rdv.port
                ))
            })?;
            Self::root(listener, rdv.world_size, timeout)
        } else {
            Self::join(&rdv.addr, rdv.port, rdv.rank, rdv.world_size, timeout)
        }
    }

    /// Maps a socket error with `peer` to what happened to that rank.
    fn io_error(&self, peer: usize, e: std::io::Error) -> DistError {
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => DistError::Timeout {
                rank: self.rank,
                peer,
                secs: self.timeout.as_secs(),
            },
            ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::BrokenPipe => DistError::Closed {
                rank: self.rank,
                peer,
            },
            _ => DistError::Io {
                rank: self.rank,
                peer,
                source: e,
            },
        }
    }

    fn send(
        &self,
        state: &mut State,
        peer: usize,
        op: Op,
        seq: u64,
        payload: &[u8],
    ) -> Result<(), DistError> {
        let idx = if self.rank == 0 { peer } else { 0 };
        let stream = state.peers[idx].as_mut().expect("a stream per peer");
        let mut header = [0u8; 17];
        header[0] = op as u8;
        header[1..9].copy_from_slice(&seq.to_le_bytes());
        header[9..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        stream
            .write_all(&header)
            .and_then(|()| stream.write_all(payload))
            .map_err(|e| self.io_error(peer, e))
    }

    fn recv(&self, state: &mut State, peer: usize, op: Op, seq: u64) -> Result<Vec<u8>, DistError> {
        let idx = if self.rank == 0 { peer } else { 0 };
        let stream = state.peers[idx].as_mut().expect("a stream per peer");
        let mut header = [0u8; 17];
        stream
            .read_exact(&mut header)
            .map_err(|e| self.io_error(peer, e))?;
        let got_seq = u64::from_le_bytes(header[1..9].try_into().expect("8 bytes"));
        if header[0] != op as u8 || got_seq != seq {
            return Err(DistError::OutOfStep {
                rank: self.rank,
                peer,
                want: seq,
                got: got_seq,
                want_op: Op::name(op as u8),
                got_op: Op::name(header[0]),
            });
        }
        let len = u64::from_le_bytes(header[9..].try_into().expect("8 bytes")) as usize;
        let mut payload = vec![0u8; len];
        stream
            .read_exact(&mut payload)
            .map_err(|e| self.io_error(peer, e))?;
        Ok(payload)
    }

    fn next_seq(state: &mut State) -> u64 {
        state.seq += 1;
        state.seq
    }
}

/// Socket settings of a rank's connection: no Nagle delay, and reads and writes that give
/// up after `timeout`.
fn configure(stream: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))
}

enum HelloError {
    /// A rank of another run or configuration: the run cannot go on.
    Fatal(DistError),
    /// Not a dppo rank at all.
    Stray(String),
}

/// Reads a joining rank's hello on `stream`; returns its rank.
fn hello_from(
    stream: TcpStream,
    world: usize,
    timeout: Duration,
) -> Result<(usize, TcpStream), HelloError> {
    let mut stream = stream;
    stream
        .set_nonblocking(false)
        .and_then(|()| configure(&stream, timeout))
        .map_err(|e| HelloError::Stray(e.to_string()))?;
    // A rank greets at once; do not let a silent stray connection hold the rendezvous.
    stream
        .set_read_timeout(Some(timeout.min(Duration::from_secs(30))))
        .map_err(|e| HelloError::Stray(e.to_string()))?;
    let mut hello = [0u8; 20];
    stream
        .read_exact(&mut hello)
        .map_err(|e| HelloError::Stray(format!("no greeting: {e}")))?;
    if &hello[..8] != MAGIC {
        return Err(HelloError::Stray("not a dppo rank".into()));
    }
    let field = |i: usize| u32::from_le_bytes(hello[i..i + 4].try_into().expect("4 bytes"));
    let (version, rank, their_world) = (field(8), field(12) as usize, field(16) as usize);
    let fatal = |e: String| HelloError::Fatal(DistError::Rendezvous(e));
    if version != VERSION {
        return Err(fatal(format!(
            "rank {rank} speaks frame version {version}, rank 0 {VERSION}: start every rank \
             with the same dppo binary"
        )));
    }
    if their_world != world {
        return Err(fatal(format!(
            "rank {rank} was started with WORLD_SIZE={their_world}, rank 0 with {world}"
        )));
    }
    if rank == 0 || rank >= world {
        return Err(fatal(format!(
            "a process joined as rank {rank}; ranks 1..{world} join rank 0"
        )));
    }
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| HelloError::Stray(e.to_string()))?;
    Ok((rank, stream))
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

fn read_f32s(bytes: &[u8], out: &mut [f32], rank: usize, peer: usize) -> Result<(), DistError> {
    if bytes.len() != out.len() * 4 {
        return Err(DistError::Length {
            rank,
            peer,
            want: out.len(),
            got: bytes.len() / 4,
        });
    }
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes(c.try_into().expect("4 bytes"));
    }
    Ok(())
}

/// Every rank's bytes in one payload: count, lengths, then the bytes in rank order.
fn encode_all(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut out = (parts.len() as u64).to_le_bytes().to_vec();
    for p in parts {
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
    }
    for p in parts {
        out.extend_from_slice(p);
    }
    out
}

fn decode_all(bytes: &[u8]) -> Option<Vec<Vec<u8>>> {
    let word = |i: usize| -> Option<usize> {
        Some(u64::from_le_bytes(bytes.get(i..i + 8)?.try_into().ok()?) as usize)
    };
    let count = word(0)?;
    let mut lens = Vec::with_capacity(count.min(1 << 16));
    for i in 0..count {
        lens.push(word(8 + 8 * i)?);
    }
    let mut at = 8 + 8 * count;
    let mut parts = Vec::with_capacity(count);
    for len in lens {
        parts.push(bytes.get(at..at + len)?.to_vec());
        at += len;
    }
    Some(parts)
}

impl Collective for TcpCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), DistError> {
        let mut state = self.state.lock().expect("collective lock");
        let seq = Self::next_seq(&mut state);
        if self.rank != 0 {
            self.send(&mut state, 0, Op::AllReduce, seq, &f32_bytes(buf))?;
            let sum = self.recv(&mut state, 0, Op::AllReduce, seq)?;
            return read_f32s(&sum, buf, self.rank, 0);
        }
        // Rank 0's values, plus rank 1's, plus rank 2's, ...: one fixed order.
        let mut theirs = vec![0f32; buf.len()];
        for peer in 1..self.world {
            let bytes = self.recv(&mut state, peer, Op::AllReduce, seq)?;
            read_f32s(&bytes, &mut theirs, 0, peer)?;
            for (a, b) in buf.iter_mut().zip(&theirs) {
                *a += b;
            }
        }
        let sum = f32_bytes(buf);
        for peer in 1..self.world {
            self.send(&mut state, peer, Op::AllReduce, seq, &sum)?;
        }
        Ok(())
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), DistError> {
        assert!(root < self.world, "broadcast root {root} of {}", self.world);
        let mut state = self.state.lock().expect("collective lock");
        let seq = Self::next_seq(&mut state);
        if self.rank != 0 {
            if self.rank == root {
                self.send(&mut state, 0, Op::Broadcast, seq, &f32_bytes(buf))?;
            }
            let bytes = self.recv(&mut state, 0, Op::Broadcast, seq)?;
            return read_f32s(&bytes, buf, self.rank, 0);
        }
        if root != 0 {
            let bytes = self.recv(&mut state, root, Op::Broadcast, seq)?;
            read_f32s(&bytes, buf, 0, root)?;
        }
        let bytes = f32_bytes(buf);
        for peer in 1..self.world {
            self.send(&mut state, peer, Op::Broadcast, seq, &bytes)?;
        }
        Ok(())
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        let mut state = self.state.lock().expect("collective lock");
        let seq = Self::next_seq(&mut state);
        if self.rank != 0 {
            self.send(&mut state, 0, Op::AllGather, seq, bytes)?;
            let all = self.recv(&mut state, 0, Op::AllGather, seq)?;
            return decode_all(&all)
                .filter(|parts| parts.len() == self.world)
                .ok_or(DistError::Length {
                    rank: self.rank,
                    peer: 0,
                    want: self.world,
                    got: 0,
                });
        }
        let mut parts = vec![bytes.to_vec()];
        for peer in 1..self.world {
            parts.push(self.recv(&mut state, peer, Op::AllGather, seq)?);
        }
        let all = encode_all(&parts);
        for peer in 1..self.world {
            self.send(&mut state, peer, Op::AllGather, seq, &all)?;
        }
        Ok(parts)
    }
}
