//! What the paged kernels read on the device besides the pool, kept between launches: an
//! iteration's plan, tiles and slots and the attention's partial outputs ([`CudaIndex`],
//! uploaded once an iteration and shared by every layer), and the block tables
//! ([`DeviceTables`]), which stay there and change entry by entry.

use std::cell::RefCell;

use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, Device, Result};

use super::gpu::{config, function};
use super::params;
use super::tables::TableCopy;
use super::{table_write_geometry, KernelPlan};

/// A plan and its tiles and slots on the device, for one iteration, and the attention's
/// partial outputs, which every layer's attention and merge reuse in stream order.
pub struct CudaIndex {
    pub(super) plan: KernelPlan,
    pub(super) tiles: CudaSlice<u32>,
    pub(super) slots: CudaSlice<u32>,
    pub(super) partials: RefCell<Partials>,
}

/// Each (row, head, split)'s partial output, maximum and sum; a float each where the plan has
/// one split and the kernel writes the output itself.
pub(super) struct Partials {
    pub(super) acc: CudaSlice<f32>,
    pub(super) max: CudaSlice<f32>,
    pub(super) sum: CudaSlice<f32>,
}

impl CudaIndex {
    /// Uploads `plan`'s tiles and slots to `device` and allocates its partials.
    pub fn new(plan: KernelPlan, device: &Device) -> Result<Self> {
        let device = cuda(device)?;
        let stream = device.cuda_stream();
        let split = plan.splits > 1;
        let pairs = if split {
            plan.partial_len() / plan.heads.head_dim
        } else {
            1
        };
        let acc_len = if split { plan.partial_len() } else { 1 };
        // SAFETY (all three): the attention kernel writes each (row, head, split) before the
        // merge reads it.
        let partials = unsafe {
            Partials {
                acc: device.alloc::<f32>(acc_len)?,
                max: device.alloc::<f32>(pairs)?,
                sum: device.alloc::<f32>(pairs)?,
            }
        };
        Ok(Self {
            tiles: stream.clone_htod(&plan.tile_words()).w()?,
            slots: stream.clone_htod(&plan.slots).w()?,
            plan,
            partials: RefCell::new(partials),
        })
    }
}

impl CudaIndex {
    /// Writes `plan`'s tiles and slots over these, in place, for a plan of the same shape: a
    /// captured step's graph reads these buffers.
    pub fn rewrite(&mut self, plan: KernelPlan) -> Result<()> {
        if 4 * plan.tiles.len() != self.tiles.len() || plan.slots.len() != self.slots.len() {
            bail!(
                "cuda graphs: a plan of {} tiles and {} slots over an index of {} and {}",
                plan.tiles.len(),
                plan.slots.len(),
                self.tiles.len() / 4,
                self.slots.len()
            );
        }
        let stream = self.tiles.stream().clone();
        stream
            .memcpy_htod(&plan.tile_words(), &mut self.tiles)
            .w()?;
        stream.memcpy_htod(&plan.slots, &mut self.slots).w()?;
        self.plan = plan;
        Ok(())
    }
}

/// The block tables on the device (the layout of [`super::tables::TableMirror::host`]).
pub struct DeviceTables {
    pub(super) table: CudaSlice<u32>,
    device: CudaDevice,
}

impl TableCopy for DeviceTables {
    /// The whole table, uploaded.
    fn copy_of(host: &[u32], device: &Device) -> Result<Self> {
        let device = cuda(device)?.clone();
        Ok(Self {
            table: device.cuda_stream().clone_htod(host).w()?,
            device,
        })
    }

    /// One upload and one launch, none without changes.
    fn write_entries(&mut self, pairs: &[u32]) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        let stream = self.device.cuda_stream();
        let src = stream.clone_htod(pairs).w()?;
        let n = (pairs.len() / 2) as u32;
        let func = function(&self.device, "write_table_entries", None)?;
        let cfg = config(table_write_geometry(n as usize));
        let mut launch = stream.launch_builder(&func);
        params::TableEntries {
            table: &mut self.table,
            pairs: &src,
            n: &n,
        }
        .push_to(&mut launch);
        // SAFETY: the arguments are `write_table_entries`'s list; every index was taken from
        // the mirror of this table, so it lies inside it.
        unsafe { launch.launch(cfg) }.w()?;
        Ok(())
    }
}

/// The CUDA device behind `device`.
pub(super) fn cuda(device: &Device) -> Result<&CudaDevice> {
    match device {
        Device::Cuda(d) => Ok(d),
        _ => bail!("cuda attention on {:?}", device.location()),
    }
}

/// Multiprocessors of `device`: the plan splits contexts until the grid fills them twice.
pub fn multiprocessors(device: &CudaDevice) -> Result<usize> {
    let context = device.cuda_stream().context().clone();
    let n = context
        .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .w()?;
    Ok(n as usize)
}

/// Whether `device` runs the tensor-core kernels, which the module holds from sm_80 on.
pub fn tensor_cores(device: &CudaDevice) -> Result<bool> {
    let (major, _) = device.cuda_stream().context().compute_capability().w()?;
    Ok(major >= 8)
}
