//! What this build is and what it finds on the machine: features, CPU kernel, CUDA driver,
//! the CUDA libraries the process loaded and from where, embedded PTX, the GPU and NCCL.

use candle_core::Device;

use super::{Check, Options};

/// The CUDA libraries a CUDA build links, by file-name prefix (libcudart is the runtime,
/// NVRTC compiles the engine's paged attention and sampling kernels at run time); each must
/// be mapped into the process, NCCL only in a build with the `nccl` feature.
pub const CUDA_LIBRARIES: [&str; 7] = [
    "libcuda.so",
    "libcudart.so",
    "libcublas.so",
    "libcublasLt.so",
    "libcurand.so",
    "libnvrtc.so",
    "libnccl.so",
];

/// The build section: version and commit, cargo features, the CPU kernel, threads.
pub fn build_checks(opts: &Options) -> Vec<Check> {
    let features: Vec<&str> = [
        ("cuda", cfg!(feature = "cuda")),
        ("nccl", cfg!(feature = "nccl")),
    ]
    .into_iter()
    .filter_map(|(name, on)| on.then_some(name))
    .collect();
    let features = if features.is_empty() {
        "none (CPU only)".to_string()
    } else {
        features.join(", ")
    };
    let commit = opts.commit.as_deref().unwrap_or("unknown");
    let kernel = match dppo_model::cpu_kernel() {
        Ok(kernel) => Check::ok("cpu kernel", kernel.name()),
        Err(e) => Check::fail(
            "cpu kernel",
            e.to_string(),
            format!("unset {}", dppo_model::cpu_kernel::KERNEL_ENV),
        ),
    };
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    vec![
        Check::ok("dppo", format!("version {}, commit {commit}", opts.version)),
        Check::ok("features", features),
        kernel,
        Check::ok(
            "threads",
            format!(
                "{} compute threads, {cores} cores",
                rayon::current_num_threads()
            ),
        ),
    ]
}

/// The first `.version X.Y` directive of PTX text embedded in `bytes` (a binary).
pub fn ptx_version(bytes: &[u8]) -> Option<(u32, u32)> {
    const DIRECTIVE: &[u8] = b"\n.version ";
    let at = bytes
        .windows(DIRECTIVE.len())
        .position(|w| w == DIRECTIVE)?;
    let rest = &bytes[at + DIRECTIVE.len()..];
    let end = rest
        .iter()
        .position(|b| !(b.is_ascii_digit() || *b == b'.'))
        .unwrap_or(rest.len());
    let (major, minor) = std::str::from_utf8(&rest[..end]).ok()?.split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// The newest PTX ISA a driver loads, from its CUDA version as `cuDriverGetVersion` gives
/// it (`1000 * major + 10 * minor`): CUDA 11.x -> 7.x, 12.x -> 8.x (12.6 -> 8.5, 12.7 ->
/// 8.6, 12.8 -> 8.7, 12.9 -> 8.8), 13.x -> 9.x. `None` for versions outside these.
pub fn max_ptx_isa(driver_version: i32) -> Option<(u32, u32)> {
    const CUDA_12: [u32; 10] = [0, 1, 2, 3, 4, 5, 5, 6, 7, 8];
    let (major, minor) = (driver_version / 1000, (driver_version % 1000) / 10);
    let minor = u32::try_from(minor).ok()?;
    match major {
        11 => Some((7, minor)),
        12 => Some((8, *CUDA_12.get(minor as usize)?)),
        13 => Some((9, minor)),
        _ => None,
    }
}

/// For each of `names` (file-name prefixes), the path of the first mapping in `maps` (the
/// text of `/proc/self/maps`) whose file name starts with it.
pub fn mapped_libraries<'a>(maps: &str, names: &[&'a str]) -> Vec<(&'a str, Option<String>)> {
    let paths: Vec<&str> = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| path.starts_with('/'))
        .collect();
    names
        .iter()
        .map(|&name| {
            let path = paths.iter().find(|p| {
                p.rsplit('/')
                    .next()
                    .is_some_and(|file| file.starts_with(name))
            });
            (name, path.map(|p| p.to_string()))
        })
        .collect()
}

/// The CUDA section of a build without CUDA.
#[cfg(not(feature = "cuda"))]
pub fn cuda_checks(_device: Option<&Device>) -> Vec<Check> {
    vec![Check::skip(
        "cuda",
        "this build has no CUDA (build with --features cuda)",
    )]
}

/// The CUDA section: driver, libraries, embedded PTX, the GPU of `device` (when it is one)
/// and NCCL.
#[cfg(feature = "cuda")]
pub fn cuda_checks(device: Option<&Device>) -> Vec<Check> {
    use candle_core::cuda_backend::cudarc::driver::sys;

    const LIBRARY_FIX: &str = "put NVIDIA's libraries on LD_LIBRARY_PATH (from Python \
        wheels: the lib folders under site-packages/nvidia/)";
    let mut checks = Vec::new();
    let mut driver: std::ffi::c_int = 0;
    // SAFETY: cuDriverGetVersion writes one int and needs no context.
    let max_isa = match unsafe { sys::cuDriverGetVersion(&mut driver) }.result() {
        Ok(()) => {
            let isa = max_ptx_isa(driver);
            let isa_text = match isa {
                Some((major, minor)) => format!("{major}.{minor}"),
                None => "unknown".to_string(),
            };
            checks.push(Check::ok(
                "driver",
                format!(
                    "CUDA {}.{} (loads PTX ISA up to {isa_text})",
                    driver / 1000,
                    (driver % 1000) / 10
                ),
            ));
            isa
        }
        Err(e) => {
            checks.push(Check::fail(
                "driver",
                format!("cuDriverGetVersion: {e}"),
                "install the NVIDIA driver (libcuda.so.1); check `nvidia-smi`",
            ));
            None
        }
    };
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    for (name, path) in mapped_libraries(&maps, &CUDA_LIBRARIES) {
        let check = match path {
            Some(path) => Check::ok(name, path),
            None if name == "libnccl.so" && !cfg!(feature = "nccl") => {
                Check::skip(name, "not in this build (build with --features nccl)")
            }
            None => Check::fail(name, "not loaded", LIBRARY_FIX),
        };
        checks.push(check);
    }
    checks.push(ptx_check(max_isa));
    checks.push(gpu_check(device));
    checks.push(nccl_check());
    checks
}

#[cfg(feature = "cuda")]
fn ptx_check(max_isa: Option<(u32, u32)>) -> Check {
    let exe = match std::fs::read("/proc/self/exe") {
        Ok(bytes) => bytes,
        Err(e) => return Check::skip("ptx", format!("reading /proc/self/exe: {e}")),
    };
    let Some(ptx) = ptx_version(&exe) else {
        return Check::fail(
            "ptx",
            "no embedded PTX found in the binary",
            "rebuild with `--features cuda` and nvcc on the PATH",
        );
    };
    let text = format!("embedded PTX ISA {}.{}", ptx.0, ptx.1);
    match max_isa {
        Some(max) => Check::expect(
            ptx <= max,
            "ptx",
            format!("{text}, driver loads up to {}.{}", max.0, max.1),
            "rebuild with an nvcc no newer than the driver's CUDA version (nvcc 13.0 for a \
             CUDA 13.0 driver), or upgrade the driver",
        ),
        None => Check::skip("ptx", format!("{text}, driver's maximum unknown")),
    }
}

#[cfg(feature = "cuda")]
fn gpu_check(device: Option<&Device>) -> Check {
    let not_a_gpu = || Check::skip("gpu", "the checked device is not a GPU");
    let Some(device) = device else {
        return not_a_gpu();
    };
    let Device::Cuda(cuda) = device else {
        return not_a_gpu();
    };
    let stream = cuda.cuda_stream();
    let context = stream.context();
    let name = context.name().unwrap_or_else(|e| format!("unknown ({e})"));
    let capability = match context.compute_capability() {
        Ok((major, minor)) => format!("{major}.{minor}"),
        Err(e) => format!("unknown ({e})"),
    };
    let memory = match dppo_model::device::memory_info(device) {
        Ok(Some((free, total))) => format!(
            "{:.1} GiB free of {:.1} GiB",
            free as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64
        ),
        Ok(None) => "unknown".into(),
        Err(e) => e.to_string(),
    };
    Check::ok(
        "gpu",
        format!("{name}, compute capability {capability}, {memory}"),
    )
}

#[cfg(feature = "nccl")]
fn nccl_check() -> Check {
    use candle_core::cuda_backend::cudarc::nccl::result::get_nccl_version;
    match get_nccl_version() {
        Ok(v) => Check::ok(
            "nccl",
            format!("NCCL {}.{}.{}", v / 10000, (v % 10000) / 100, v % 100),
        ),
        Err(e) => Check::fail(
            "nccl",
            format!("ncclGetVersion: {e:?}"),
            "put libnccl.so.2 on LD_LIBRARY_PATH (the nvidia-nccl wheel's lib folder)",
        ),
    }
}

#[cfg(all(feature = "cuda", not(feature = "nccl")))]
fn nccl_check() -> Check {
    Check::skip("nccl", "not in this build (build with --features nccl)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_ptx_version_directive_is_found_in_binary_bytes() {
        let mut bytes = b"\x7fELF\0\0junk\n.versionX\n//\n.version 9.4\n.target sm_90\n".to_vec();
        bytes.extend_from_slice(b"\n.version 8.0\n");
        assert_eq!(ptx_version(&bytes), Some((9, 4)));
        assert_eq!(ptx_version(b"\n.version 12.10\r\n"), Some((12, 10)));
        assert_eq!(ptx_version(b"no ptx here"), None);
        assert_eq!(ptx_version(b"\n.version 9"), None);
    }

    #[test]
    fn driver_cuda_versions_map_to_the_ptx_isa_they_load() {
        assert_eq!(max_ptx_isa(13000), Some((9, 0)));
        assert_eq!(max_ptx_isa(13010), Some((9, 1)));
        assert_eq!(max_ptx_isa(12000), Some((8, 0)));
        assert_eq!(max_ptx_isa(12040), Some((8, 4)));
        assert_eq!(max_ptx_isa(12060), Some((8, 5)));
        assert_eq!(max_ptx_isa(12080), Some((8, 7)));
        assert_eq!(max_ptx_isa(12090), Some((8, 8)));
        assert_eq!(max_ptx_isa(11080), Some((7, 8)));
        assert_eq!(max_ptx_isa(10020), None);
        // nvcc 13.4's PTX does not load on a CUDA 13.0 driver.
        assert!((9, 4) > max_ptx_isa(13000).unwrap());
    }

    #[test]
    fn libraries_are_found_by_file_name_in_the_process_maps() {
        let maps = "\
7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06
7f01-7f02 r--p 00000000 08:01 2 /venv/nvidia/cublas/lib/libcublasLt.so.13
7f02-7f03 r--p 00000000 08:01 3 /venv/nvidia/cublas/lib/libcublas.so.13
7f03-7f04 rw-p 00000000 00:00 0 [heap]
7f04-7f05 rw-p 00000000 00:00 0
";
        let found = mapped_libraries(
            maps,
            &["libcuda.so", "libcublas.so", "libcublasLt.so", "libnccl.so"],
        );
        assert_eq!(
            found,
            vec![
                (
                    "libcuda.so",
                    Some("/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06".into())
                ),
                (
                    "libcublas.so",
                    Some("/venv/nvidia/cublas/lib/libcublas.so.13".into())
                ),
                (
                    "libcublasLt.so",
                    Some("/venv/nvidia/cublas/lib/libcublasLt.so.13".into())
                ),
                ("libnccl.so", None),
            ]
        );
    }
}
