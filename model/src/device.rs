//! Where tensors live: `cpu` (default), `cuda` or `cuda:N`, as the `device` config key and
//! every command's `--device` spell it. Parsed here once; [`DeviceSpec::open`] makes the
//! candle [`Device`] a process starts from: on a GPU, one with a stream of its own (the
//! other roles take theirs with [`crate::streams::own_stream`]).

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use candle_core::Device;
use serde::{Deserialize, Serialize};

/// A device as configured, before it is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceSpec {
    /// The CPU (the only device of a build without the `cuda` feature).
    #[default]
    Cpu,
    /// The CUDA GPU of this index (`cuda` is `cuda:0`).
    Cuda(usize),
}

/// A device that cannot be named or opened.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// Text that is no device name.
    #[error("device {0:?}: expected cpu, cuda or cuda:N (N the GPU's index)")]
    Parse(String),
    /// A CUDA device asked of a binary built without CUDA support.
    #[cfg(not(feature = "cuda"))]
    #[error(
        "device {0}: this dppo was built without the `cuda` cargo feature (CPU only); \
         build it with `cargo build --release --features cuda` (needs the CUDA toolkit's nvcc)"
    )]
    NotCompiled(DeviceSpec),
    /// A CUDA build on a machine where the GPU does not open (no GPU, no driver, bad index).
    #[cfg(feature = "cuda")]
    #[error("device {spec}: no usable CUDA GPU: {reason}")]
    Unavailable {
        /// The device asked for.
        spec: DeviceSpec,
        /// candle's error opening it.
        reason: String,
    },
    /// The driver would not say how much memory the GPU has.
    #[cfg(feature = "cuda")]
    #[error("querying the GPU's memory: {0}")]
    MemoryInfo(String),
}

impl FromStr for DeviceSpec {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, DeviceError> {
        let bad = || DeviceError::Parse(s.to_string());
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => {
                let index = s.strip_prefix("cuda:").ok_or_else(bad)?;
                // Digits only: `usize::from_str` would also take a leading `+`.
                if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                index.parse().map(Self::Cuda).map_err(|_| bad())
            }
        }
    }
}

impl TryFrom<String> for DeviceSpec {
    type Error = DeviceError;

    fn try_from(s: String) -> Result<Self, DeviceError> {
        s.parse()
    }
}

impl From<DeviceSpec> for String {
    fn from(spec: DeviceSpec) -> String {
        spec.to_string()
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(0) => f.write_str("cuda"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSpec {
    /// Opens the device. A CUDA device gets a stream of its own, not candle's default
    /// per-thread stream, on which work queued by two threads would be unordered. It fails
    /// at once on a build without the `cuda` feature, and on a CUDA build when the GPU does
    /// not open (candle's `cuda_is_available` only says how the binary was built).
    pub fn open(self) -> Result<Device, DeviceError> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(index) => open_cuda(self, index),
        }
    }
}

/// Free and total bytes of `device`'s memory when it is a CUDA GPU; `None` on the CPU,
/// whose KV cache is sized by configuration instead.
#[cfg(feature = "cuda")]
pub fn memory_info(device: &Device) -> Result<Option<(u64, u64)>, DeviceError> {
    match device {
        Device::Cuda(cuda) => {
            let (free, total) = cuda
                .cuda_stream()
                .context()
                .mem_get_info()
                .map_err(|e| DeviceError::MemoryInfo(e.to_string()))?;
            Ok(Some((free as u64, total as u64)))
        }
        _ => Ok(None),
    }
}

/// Free and total bytes of `device`'s memory when it is a CUDA GPU; `None` on the CPU,
/// whose KV cache is sized by configuration instead (always, in a build without CUDA).
#[cfg(not(feature = "cuda"))]
pub fn memory_info(_device: &Device) -> Result<Option<(u64, u64)>, DeviceError> {
    Ok(None)
}

/// Runs `f` between two synchronisations of `device` and returns its value with the time it
/// took: a GPU queues work asynchronously, so an unsynchronised clock would time the queueing.
pub fn timed<T, E: From<candle_core::Error>>(
    device: &Device,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<(T, Duration), E> {
    device.synchronize()?;
    let start = Instant::now();
    let value = f()?;
    device.synchronize()?;
    Ok((value, start.elapsed()))
}

#[cfg(feature = "cuda")]
fn open_cuda(spec: DeviceSpec, index: usize) -> Result<Device, DeviceError> {
    Device::new_cuda_with_stream(index).map_err(|e| DeviceError::Unavailable {
        spec,
        reason: e.to_string(),
    })
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(spec: DeviceSpec, _index: usize) -> Result<Device, DeviceError> {
    Err(DeviceError::NotCompiled(spec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_to_devices_and_print_back() {
        for (text, spec) in [
            ("cpu", DeviceSpec::Cpu),
            ("cuda", DeviceSpec::Cuda(0)),
            ("cuda:0", DeviceSpec::Cuda(0)),
            ("cuda:3", DeviceSpec::Cuda(3)),
        ] {
            assert_eq!(text.parse::<DeviceSpec>().unwrap(), spec, "{text}");
            assert_eq!(spec.to_string().parse::<DeviceSpec>().unwrap(), spec);
        }
        assert_eq!(DeviceSpec::Cuda(0).to_string(), "cuda");
        assert_eq!(DeviceSpec::Cuda(7).to_string(), "cuda:7");
        assert_eq!(DeviceSpec::default(), DeviceSpec::Cpu);
    }

    #[test]
    fn anything_else_is_rejected_naming_the_forms() {
        for text in [
            "", "CPU", "gpu", "cuda:", "cuda:-1", "cuda:+1", "cuda:x", "cuda:1:2", " cuda", "metal",
        ] {
            let err = text.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(
                err.contains("expected cpu, cuda or cuda:N"),
                "{text}: {err}"
            );
        }
    }

    #[test]
    fn serde_uses_the_same_names() {
        #[derive(Deserialize, Serialize)]
        struct Doc {
            device: DeviceSpec,
        }
        let doc: Doc = serde_json::from_str(r#"{"device":"cuda:2"}"#).unwrap();
        assert_eq!(doc.device, DeviceSpec::Cuda(2));
        assert_eq!(
            serde_json::to_string(&doc).unwrap(),
            r#"{"device":"cuda:2"}"#
        );
        let err = serde_json::from_str::<Doc>(r#"{"device":"tpu"}"#)
            .err()
            .unwrap();
        assert!(err.to_string().contains("expected cpu"), "{err}");
    }

    #[test]
    fn cpu_opens_everywhere_and_has_no_gpu_memory() {
        let cpu = DeviceSpec::Cpu.open().unwrap();
        assert!(cpu.is_cpu());
        assert_eq!(memory_info(&cpu).unwrap(), None);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_cpu_build_refuses_cuda_naming_the_feature_and_the_build_command() {
        let err = DeviceSpec::Cuda(1).open().unwrap_err().to_string();
        assert!(err.contains("device cuda:1"), "{err}");
        assert!(err.contains("`cuda` cargo feature"), "{err}");
        assert!(
            err.contains("cargo build --release --features cuda"),
            "{err}"
        );
    }
}
