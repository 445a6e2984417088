//! The engine's CUDA kernel sources, compiled at run time by NVRTC for the GPU at hand (so
//! they always match its driver), once per process each, and loaded into candle's device as
//! modules of their own.

use std::sync::OnceLock;

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
    ptx: OnceLock<std::result::Result<String, String>>,
}

impl Module {
    pub(crate) const fn new(name: &'static str, file: &'static str, source: &'static str) -> Self {
        Self {
            name,
            file,
            source,
            ptx: OnceLock::new(),
        }
    }

    /// Kernel `function` of this module on `device`, compiling the module on first use.
    pub(crate) fn function(&self, device: &CudaDevice, function: &str) -> Result<CudaFunction> {
        let func = device.get_or_load_custom_func(function, self.name, &self.ptx(device)?)?;
        Ok(func.into_cuda_function())
    }

    /// The module's PTX for `device`'s compute capability, compiled once per process.
    fn ptx(&self, device: &CudaDevice) -> Result<String> {
        let context = device.cuda_stream().context().clone();
        self.ptx
            .get_or_init(|| {
                let cap = |a| context.attribute(a).map_err(|e| e.to_string());
                let major = cap(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
                let minor = cap(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
                let arch: &'static str =
                    Box::leak(format!("compute_{major}{minor}").into_boxed_str());
                let opts = CompileOptions {
                    arch: Some(arch),
                    ..CompileOptions::default()
                };
                compile_ptx_with_opts(self.source, opts)
                    .map(|ptx| ptx.to_src())
                    .map_err(|e| format!("compiling {} with NVRTC: {e}", self.file))
            })
            .clone()
            .map_err(candle_core::Error::msg)
    }
}
