//! The engine's CUDA kernel sources, compiled at run time by NVRTC for the GPU at hand (so
//! they always match its driver), once per GPU each, and loaded into candle's device as
//! modules of their own.

use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
use candle_core::cuda_backend::cudarc::driver::CudaFunction;
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::{CudaDevice, Result};

/// A kernel source and the module it loads as.
pub(crate) struct Module {
    /// The module's name in candle's device.
    name: &'static str,
    /// Where the source lives, for messages.
    file: &'static str,
    source: &'static str,
    /// Per GPU of the process: its architecture and, once compiled, the PTX.
    compiled: Mutex<Vec<Compiled>>,
}

/// The module for one GPU.
struct Compiled {
    ordinal: usize,
    /// `compute_XY`, as NVRTC's options take it: one short string per GPU.
    arch: &'static str,
    /// Only a successful compile is kept: an error (a stale one cudarc reports from an
    /// earlier call, say) is tried again at the next launch.
    ptx: Option<Arc<str>>,
}

impl Module {
    pub(crate) const fn new(name: &'static str, file: &'static str, source: &'static str) -> Self {
        Self {
            name,
            file,
            source,
            compiled: Mutex::new(Vec::new()),
        }
    }

    /// Kernel `function` of this module on `device`, compiling the module on first use.
    pub(crate) fn function(&self, device: &CudaDevice, function: &str) -> Result<CudaFunction> {
        let func = device.get_or_load_custom_func(function, self.name, &self.ptx(device)?)?;
        Ok(func.into_cuda_function())
    }

    /// The module's PTX for `device`'s compute capability, compiled once per GPU.
    fn ptx(&self, device: &CudaDevice) -> Result<Arc<str>> {
        let context = device.cuda_stream().context().clone();
        let ordinal = context.ordinal();
        let mut compiled = self.compiled.lock().unwrap_or_else(|e| e.into_inner());
        let at = match compiled.iter().position(|c| c.ordinal == ordinal) {
            Some(at) => at,
            None => {
                let cap = |a| context.attribute(a).map_err(candle_core::Error::wrap);
                let major = cap(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
                let minor = cap(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
                let arch = format!("compute_{major}{minor}").into_boxed_str();
                compiled.push(Compiled {
                    ordinal,
                    arch: Box::leak(arch),
                    ptx: None,
                });
                compiled.len() - 1
            }
        };
        let entry = &mut compiled[at];
        if let Some(ptx) = &entry.ptx {
            return Ok(ptx.clone());
        }
        let opts = CompileOptions {
            arch: Some(entry.arch),
            ..CompileOptions::default()
        };
        let ptx: Arc<str> = compile_ptx_with_opts(self.source, opts)
            .map_err(|e| {
                candle_core::Error::msg(format!("compiling {} with NVRTC: {e}", self.file))
            })?
            .to_src()
            .into();
        entry.ptx = Some(ptx.clone());
        Ok(ptx)
    }
}
