//! GPU ranks: NCCL (through candle's re-export of cudarc) reduces and broadcasts device
//! tensors where they live; the small host-side exchanges (metrics, rollout summaries,
//! barriers) and the rendezvous go through the host collective the ranks met over (TCP).
//! Rank 0 creates NCCL's unique id and sends it to the others over that collective.

use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::nccl::result::NcclError;
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, ReduceOp};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};

use super::{Collective, DistError};

/// An NCCL communicator, used by one thread at a time.
struct SharedComm(Comm);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap; every use goes through the mutex in `NcclCollective`.
unsafe impl Send for SharedComm {}
// SAFETY: as above: `&SharedComm` is only reachable through the mutex.
unsafe impl Sync for SharedComm {}

/// A rank of GPU ranks: NCCL for device tensors, `host` for everything else.
pub struct NcclCollective {
    host: Arc<dyn Collective>,
    comm: Arc<Mutex<SharedComm>>,
}

impl std::fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCollective")
            .field("rank", &self.host.rank())
            .field("world", &self.host.world_size())
            .finish()
    }
}

fn nccl_err(what: &str) -> impl Fn(NcclError) -> DistError + '_ {
    move |e| DistError::Nccl(format!("{what}: {e:?}"))
}

impl NcclCollective {
    /// Joins the NCCL communicator of `host`'s ranks on `device` (this rank's GPU): rank 0
    /// makes the unique id and all-gathers it over `host`.
    pub fn new(host: Arc<dyn Collective>, device: &Device) -> Result<Self, DistError> {
        let Device::Cuda(cuda) = device else {
            return Err(DistError::Nccl(format!(
                "NCCL needs a CUDA device, this rank has {device:?}"
            )));
        };
        let id = match host.rank() {
            0 => Some(Id::new().map_err(nccl_err("creating the unique id"))?),
            _ => None,
        };
        let bytes: Vec<u8> = id
            .map(|id| id.internal().iter().map(|&c| c as u8).collect())
            .unwrap_or_default();
        let all = host.all_gather_bytes(&bytes)?;
        let internal: [std::ffi::c_char; 128] = all[0]
            .iter()
            .map(|&b| b as std::ffi::c_char)
            .collect::<Vec<_>>()
            .try_into()
            .map_err(|_| DistError::Nccl("rank 0 sent an id that is not 128 bytes".into()))?;
        let comm = Comm::from_rank(
            cuda.cuda_stream(),
            host.rank(),
            host.world_size(),
            Id::uninit(internal),
        )
        .map_err(nccl_err("joining the communicator"))?;
        Ok(Self {
            host,
            comm: Arc::new(Mutex::new(SharedComm(comm))),
        })
    }
}

/// What a custom op does with its input on every rank.
#[derive(Clone, Copy)]
enum Kind {
    Sum,
    Broadcast { root: usize },
}

/// A collective as a candle op: the output is the reduced (or broadcast) tensor, in new
/// device memory.
struct NcclOp {
    comm: Arc<Mutex<SharedComm>>,
    kind: Kind,
}

impl CustomOp1 for NcclOp {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Sum => "nccl-all-reduce",
            Kind::Broadcast { .. } => "nccl-broadcast",
        }
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("{} needs a CUDA tensor", self.name())
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let elems = l.shape().elem_count();
        let dev = s.device.clone();
        let src = s.as_cuda_slice::<f32>()?;
        let src = match l.contiguous_offsets() {
            Some((start, end)) => src.slice(start..end),
            None => candle_core::bail!("{}: the tensor must be contiguous", self.name()),
        };
        // SAFETY: NCCL writes every element before anything reads the buffer.
        let mut dst = unsafe { dev.alloc::<f32>(elems) }?;
        let comm = self.comm.lock().expect("nccl lock");
        match self.kind {
            Kind::Sum => comm.0.all_reduce(&src, &mut dst, &ReduceOp::Sum),
            Kind::Broadcast { root } => comm.0.broadcast(Some(&src), &mut dst, root as i32),
        }
        .map_err(|e| candle_core::Error::Msg(format!("{}: {e:?}", self.name())))?;
        Ok((CudaStorage::wrap_cuda_slice(dst, dev), l.shape().clone()))
    }
}

impl NcclCollective {
    fn apply(&self, t: &Tensor, kind: Kind) -> Result<Tensor, DistError> {
        if !t.device().is_cuda() {
            return match kind {
                Kind::Sum => self.host.all_reduce_sum_tensor(t),
                Kind::Broadcast { root } => self.host.broadcast_tensor(t, root),
            };
        }
        let op = NcclOp {
            comm: self.comm.clone(),
            kind,
        };
        let out = t
            .to_dtype(DType::F32)?
            .contiguous()?
            .apply_op1_no_bwd(&op)?;
        Ok(out.to_dtype(t.dtype())?)
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn world_size(&self) -> usize {
        self.host.world_size()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), DistError> {
        self.host.all_reduce_sum(buf)
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), DistError> {
        self.host.broadcast(buf, root)
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        self.host.all_gather_bytes(bytes)
    }

    fn barrier(&self) -> Result<(), DistError> {
        self.host.barrier()
    }

    fn all_reduce_sum_tensor(&self, t: &Tensor) -> Result<Tensor, DistError> {
        self.apply(t, Kind::Sum)
    }

    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor, DistError> {
        self.apply(t, Kind::Broadcast { root })
    }
}
