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
    /// NVRTC's options besides the architecture (`-D` defines).
    options: &'static [&'static str],
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
    /// The functions looked up so far, by name.
    functions: Vec<(String, CudaFunction)>,
}

/// The entry of `device`'s GPU in `compiled`, added (with its architecture) on first use.
fn entry_for<'a>(compiled: &'a mut Vec<Compiled>, device: &CudaDevice) -> Result<&'a mut Compiled> {
    let context = device.cuda_stream().context().clone();
    let ordinal = context.ordinal();
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
                functions: Vec::new(),
            });
            compiled.len() - 1
        }
    };
    Ok(&mut compiled[at])
}

impl Module {
    pub(crate) const fn new(name: &'static str, file: &'static str, source: &'static str) -> Self {
        Self::with_options(name, file, source, &[])
    }

    /// The module of `source` compiled with `options` (defines that select what it holds).
    pub(crate) const fn with_options(
        name: &'static str,
        file: &'static str,
        source: &'static str,
        options: &'static [&'static str],
    ) -> Self {
        Self {
            name,
            file,
            source,
            options,
            compiled: Mutex::new(Vec::new()),
        }
    }

    /// Kernel `function` of this module on `device`, compiling the module on first use and
    /// looking the function up once (a launch then costs no driver call to find it).
    pub(crate) fn function(&self, device: &CudaDevice, function: &str) -> Result<CudaFunction> {
        let mut compiled = self.compiled.lock().unwrap_or_else(|e| e.into_inner());
        let entry = entry_for(&mut compiled, device)?;
        if let Some((_, func)) = entry.functions.iter().find(|(name, _)| name == function) {
            return Ok(func.clone());
        }
        let ptx = self.ptx(entry)?;
        let func = device
            .get_or_load_custom_func(function, self.name, &ptx)?
            .into_cuda_function();
        entry.functions.push((function.to_string(), func.clone()));
        Ok(func)
    }

    /// The module's PTX for `entry`'s GPU, compiled once.
    fn ptx(&self, entry: &mut Compiled) -> Result<Arc<str>> {
        if let Some(ptx) = &entry.ptx {
            return Ok(ptx.clone());
        }
        let opts = CompileOptions {
            arch: Some(entry.arch),
            options: self.options.iter().map(|o| o.to_string()).collect(),
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
