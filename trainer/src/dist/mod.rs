//! Data parallelism: ranks, each a process with a full replica of the policy and its own
//! engine, talking through a [`Collective`]. The step loop shards a step's rollout groups
//! over the ranks and all-reduces what the single-rank loop computes over the whole batch
//! (gradients, loss normalisers, metrics), so that W ranks with a global batch of B prompts
//! train as one rank with B prompts.
//!
//! Three implementations: [`Single`] (world size 1: identities, no sockets), [`TcpCollective`]
//! (the host collective of any rank, CPU or GPU without NCCL, over loopback or any TCP
//! network, with a fixed reduction order so that runs are deterministic), and,
//! with the `nccl` cargo feature, [`NcclCollective`] (GPU ranks; NCCL for device tensors,
//! its TCP rendezvous for the small host-side exchanges).

mod tcp;

#[cfg(feature = "nccl")]
mod nccl;

use std::ops::Range;
use std::time::Duration;

use candle_core::{DType, Tensor};
use dppo_model::{ModelConfig, Weights};

#[cfg(feature = "nccl")]
pub use nccl::NcclCollective;
pub use tcp::TcpCollective;

/// Seconds a rank waits for the others at a collective by default (`rank_timeout_s`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// A collective that failed: a rank that exited, stopped answering, or is out of step.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    #[error(
        "rank {peer} closed its connection to rank {rank} (it exited or crashed; its own \
         output says why)"
    )]
    Closed { rank: usize, peer: usize },
    #[error(
        "rank {peer} did not answer rank {rank} within {secs} s (stopped or hung; \
         rank_timeout_s sets the limit)"
    )]
    Timeout { rank: usize, peer: usize, secs: u64 },
    #[error("rank {peer} -> rank {rank}: {source}")]
    Io {
        rank: usize,
        peer: usize,
        source: std::io::Error,
    },
    #[error(
        "rank {peer} is at collective #{got} ({got_op}), rank {rank} at #{want} ({want_op}): \
         the ranks are out of step"
    )]
    OutOfStep {
        rank: usize,
        peer: usize,
        want: u64,
        got: u64,
        want_op: &'static str,
        got_op: &'static str,
    },
    #[error("rank {peer} sent {got} values where rank {rank} has {want}")]
    Length {
        rank: usize,
        peer: usize,
        want: usize,
        got: usize,
    },
    #[error("collective on a tensor: {0}")]
    Tensor(#[from] candle_core::Error),
    #[error("nccl: {0}")]
    Nccl(String),
}

/// The communication between ranks. Every rank calls the same collectives in the same
/// order; each returns once every rank has contributed. Results are the same bits on every
/// rank.
pub trait Collective: Send + Sync {
    /// This process's rank, 0..world_size.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world_size(&self) -> usize;

    /// Sums `buf` over the ranks, in place.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), DistError>;

    /// Overwrites `buf` on every rank with rank `root`'s.
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), DistError>;

    /// Every rank's `bytes`, in rank order, on every rank (small metadata and metrics).
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), DistError> {
        self.all_gather_bytes(&[]).map(drop)
    }

    /// Every rank's `values`, in rank order, on every rank (small metric vectors).
    fn all_gather_f64(&self, values: &[f64]) -> Result<Vec<Vec<f64>>, DistError> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Ok(self
            .all_gather_bytes(&bytes)?
            .into_iter()
            .map(|b| {
                b.chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect()
            })
            .collect())
    }

    /// The sum over ranks of a tensor (any device; f32 on the wire). NCCL reduces device
    /// memory directly; the default goes through host memory.
    fn all_reduce_sum_tensor(&self, t: &Tensor) -> Result<Tensor, DistError> {
        let mut host: Vec<f32> = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        self.all_reduce_sum(&mut host)?;
        Ok(Tensor::from_vec(host, t.shape(), t.device())?.to_dtype(t.dtype())?)
    }

    /// Rank `root`'s tensor on every rank (same shape everywhere).
    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor, DistError> {
        let mut host: Vec<f32> = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        self.broadcast(&mut host, root)?;
        Ok(Tensor::from_vec(host, t.shape(), t.device())?.to_dtype(t.dtype())?)
    }
}

/// World size 1: every collective is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _buf: &mut [f32]) -> Result<(), DistError> {
        Ok(())
    }
    fn broadcast(&self, _buf: &mut [f32], _root: usize) -> Result<(), DistError> {
        Ok(())
    }
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        Ok(vec![bytes.to_vec()])
    }
    fn all_reduce_sum_tensor(&self, t: &Tensor) -> Result<Tensor, DistError> {
        Ok(t.clone())
    }
    fn broadcast_tensor(&self, t: &Tensor, _root: usize) -> Result<Tensor, DistError> {
        Ok(t.clone())
    }
}

/// Rank `rank`'s contiguous share of `n` items split over `world` ranks: shares differ in
/// size by at most one, lower ranks first.
pub fn shard_range(n: usize, rank: usize, world: usize) -> Range<usize> {
    (n * rank / world)..(n * (rank + 1) / world)
}

/// Sums `values` over the ranks in rank order (the same bits on every rank).
pub fn sum_f64(coll: &dyn Collective, values: &[f64]) -> Result<Vec<f64>, DistError> {
    if coll.world_size() == 1 {
        return Ok(values.to_vec());
    }
    let all = coll.all_gather_f64(values)?;
    let mut out = vec![0.0; values.len()];
    for (rank, v) in all.iter().enumerate() {
        if v.len() != values.len() {
            return Err(DistError::Length {
                rank: coll.rank(),
                peer: rank,
                want: values.len(),
                got: v.len(),
            });
        }
        for (o, x) in out.iter_mut().zip(v) {
            *o += x;
        }
    }
    Ok(out)
}

/// Rank 0's weights on every rank (in their own dtype), so that every replica starts from
/// the same bits however it loaded them.
pub fn broadcast_weights(
    coll: &dyn Collective,
    config: &ModelConfig,
    weights: &Weights,
) -> Result<Weights, crate::TrainError> {
    if coll.world_size() == 1 {
        return Ok(weights.clone());
    }
    let mut tensors = std::collections::BTreeMap::new();
    for (name, t) in weights.tensors() {
        tensors.insert(name.clone(), coll.broadcast_tensor(t, 0)?);
    }
    Ok(Weights::from_tensors(
        config,
        tensors,
        "broadcast from rank 0",
    )?)
}

/// Where a rank finds the others: torchrun's environment convention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    /// `MASTER_ADDR`: rank 0's host.
    pub addr: String,
    /// The port rank 0 listens on: `DPPO_MASTER_PORT` when set, else `MASTER_PORT`, or
    /// `MASTER_PORT + 1` under torchrun when its agent already listens on `MASTER_PORT`
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`).
    pub port: u16,
    /// `RANK`.
    pub rank: usize,
    /// `WORLD_SIZE`.
    pub world_size: usize,
    /// `LOCAL_RANK`: the rank among this node's (picks the device); `RANK` when unset.
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE`: ranks on this node (shares its cores); `WORLD_SIZE` when unset.
    pub local_world_size: usize,
}

impl Rendezvous {
    /// The environment variables a rank is started with.
    pub const VARS: [&'static str; 5] = [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ];

    /// The rendezvous in the environment (`get` reads a variable), or `None` when neither
    /// `RANK` nor `WORLD_SIZE` is set (not started as a rank).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, DistError> {
        if get("RANK").is_none() && get("WORLD_SIZE").is_none() {
            return Ok(None);
        }
        let need = |name: &str| {
            get(name).ok_or_else(|| {
                DistError::Rendezvous(format!(
                    "{name} is not set: a rank needs RANK, WORLD_SIZE, MASTER_ADDR and \
                     MASTER_PORT (torchrun's convention; LOCAL_RANK optional)"
                ))
            })
        };
        let number = |name: &str, text: String| {
            text.trim().parse::<usize>().map_err(|_| {
                DistError::Rendezvous(format!("{name}={text:?} is not a non-negative integer"))
            })
        };
        let rank = number("RANK", need("RANK")?)?;
        let world_size = number("WORLD_SIZE", need("WORLD_SIZE")?)?;
        if world_size == 0 || rank >= world_size {
            return Err(DistError::Rendezvous(format!(
                "RANK={rank} must be below WORLD_SIZE={world_size}"
            )));
        }
        let addr = need("MASTER_ADDR")?;
        let port_of = |name: &str, text: String| {
            text.trim()
                .parse::<u16>()
                .map_err(|_| DistError::Rendezvous(format!("{name}={text:?} is not a port number")))
        };
        let master_port = port_of("MASTER_PORT", need("MASTER_PORT")?)?;
        // torchrun's agent may already listen on MASTER_PORT (its own store, shared with
        // PyTorch workers): rank 0 then listens on the next port.
        let agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| matches!(v.trim(), "True" | "true" | "1"));
        let port = match get("DPPO_MASTER_PORT") {
            Some(text) => port_of("DPPO_MASTER_PORT", text)?,
            None if agent_store => master_port.checked_add(1).ok_or_else(|| {
                DistError::Rendezvous(
                    "MASTER_PORT=65535 leaves no port after torchrun's store: set \
                     DPPO_MASTER_PORT"
                        .into(),
                )
            })?,
            None => master_port,
        };
        let local_rank = match get("LOCAL_RANK") {
            Some(text) => number("LOCAL_RANK", text)?,
            None => rank,
        };
        let local_world_size = match get("LOCAL_WORLD_SIZE") {
            Some(text) => number("LOCAL_WORLD_SIZE", text)?.max(1),
            None => world_size,
        };
        Ok(Some(Self {
            addr,
            port,
            rank,
            world_size,
            local_rank,
            local_world_size,
        }))
    }

    /// The rendezvous in this process's environment.
    pub fn from_env() -> Result<Option<Self>, DistError> {
        Self::from_vars(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
    }
}

/// A checksum of every bit of `weights` (CRC-32 over the f32 values in name order): equal
/// on every rank while the replicas agree.
pub fn weights_checksum(
    tensors: &std::collections::BTreeMap<String, Tensor>,
) -> Result<u32, DistError> {
    let mut hasher = crc32fast::Hasher::new();
    for (name, t) in tensors {
        hasher.update(name.as_bytes());
        let values: Vec<f32> = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        for chunk in values.chunks(1 << 14) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
            hasher.update(&bytes);
        }
    }
    Ok(hasher.finalize())
}

#[cfg(test)]
mod tests;
