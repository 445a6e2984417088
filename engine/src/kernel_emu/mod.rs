//! The engine's CUDA kernel sources run on the CPU (tests only): each source is compiled with
//! `cuda_on_cpu.h` by the host's C++ compiler (`$CXX`, else `c++`; GCC 12 or clang 15 at
//! least, for `_Float16`) into a shared library, and launched over grids, arguments and shared
//! memory as on a GPU. What runs is the kernel text itself, so the emulated kernels are held
//! bit for bit to their CPU twins. What the header's comment lists as not emulated (races
//! between blocks, `__launch_bounds__`, CUDA's own arithmetic and memory model), and speed,
//! still need a GPU.

use std::ffi::{c_char, c_void, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use crate::kernel_args::ArgList;

/// The library's entry point: kernel name, grid, block, dynamic shared bytes, pointers to the
/// arguments, their sizes and number, and a buffer for the error.
type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    *const u32,
    *const u32,
    usize,
    *mut *mut c_void,
    *const u32,
    u32,
    *mut c_char,
    usize,
) -> i32;

/// A kernel source compiled for the CPU. The emulation's scheduler and shared memory are
/// one per library, so its launches take turns.
pub struct Emulator {
    launch: Mutex<LaunchFn>,
}

/// Grid or block dimensions, as CUDA's launch configuration gives them.
pub type Dims = (u32, u32, u32);

/// What a kernel takes: scalars of 4 or 8 bytes and device pointers.
pub trait KernelArg: Copy + private::Sealed {}

mod private {
    pub trait Sealed {}
}

macro_rules! kernel_arg {
    ($($t:ty),*) => {$(
        impl private::Sealed for $t {}
        impl KernelArg for $t {}
    )*};
}
kernel_arg!(u32, i32, f32, u64, i64, f64);
impl<T> private::Sealed for *const T {}
impl<T> KernelArg for *const T {}
impl<T> private::Sealed for *mut T {}
impl<T> KernelArg for *mut T {}

/// One launch's arguments, each in its own 8 bytes, whose addresses are passed as
/// cuLaunchKernel's kernel parameters are, and their sizes, which the launch checks against
/// the kernel's parameters.
#[derive(Default)]
pub struct Args {
    slots: Vec<u64>,
    sizes: Vec<u32>,
}

impl Args {
    /// Appends `value`.
    pub fn arg<T: KernelArg>(mut self, value: T) -> Self {
        self.add(value);
        self
    }

    /// The list a shared parameter list's `push_to` fills ([`crate::kernel_args`]).
    pub fn filled(push_to: impl FnOnce(&mut Self)) -> Self {
        let mut args = Self::default();
        push_to(&mut args);
        args
    }

    fn add<T: KernelArg>(&mut self, value: T) {
        let mut slot = 0u64;
        // SAFETY: every `KernelArg` is `Copy` and at most 8 bytes; the slot is 8 bytes and
        // 8-aligned.
        unsafe { std::ptr::write((&mut slot as *mut u64).cast::<T>(), value) };
        self.slots.push(slot);
        self.sizes.push(size_of::<T>() as u32);
    }
}

/// The kernels' shared parameter lists take device pointers by value and scalars by
/// reference (cudarc's builder keeps a pointer to each); the emulation copies both.
impl<T> ArgList<*const T> for Args {
    fn push(&mut self, arg: *const T) {
        self.add(arg);
    }
}

impl<T> ArgList<*mut T> for Args {
    fn push(&mut self, arg: *mut T) {
        self.add(arg);
    }
}

/// A host vector stands for a device buffer: its data pointer is passed.
impl<T> ArgList<&Vec<T>> for Args {
    fn push(&mut self, arg: &Vec<T>) {
        self.add(arg.as_ptr());
    }
}

impl<T> ArgList<&mut Vec<T>> for Args {
    fn push(&mut self, arg: &mut Vec<T>) {
        self.add(arg.as_mut_ptr());
    }
}

impl ArgList<&u32> for Args {
    fn push(&mut self, arg: &u32) {
        self.add(*arg);
    }
}

impl ArgList<&f32> for Args {
    fn push(&mut self, arg: &f32) {
        self.add(*arg);
    }
}

impl Emulator {
    /// Compiles `source` (`file` names it in messages) with the kernels `kernels`.
    pub fn build(file: &str, source: &str, kernels: &[&str]) -> Result<Self, String> {
        let source = rewrite_dynamic_shared(source)?;
        let table: Vec<String> = kernels
            .iter()
            .map(|k| format!("    EMU_KERNEL({k}),"))
            .collect();
        let unit = format!(
            "{}\n#line 1 \"{file}\"\n{source}\nstatic const emu::Kernel EMU_KERNELS[] = {{\n{}\n}};\nEMU_ENTRY(EMU_KERNELS)\n",
            include_str!("cuda_on_cpu.h"),
            table.join("\n"),
        );
        let dir = TempDir::new(file)?;
        let (cpp, lib) = (dir.0.join("kernels.cpp"), dir.0.join("kernels.so"));
        std::fs::write(&cpp, unit).map_err(|e| format!("writing {}: {e}", cpp.display()))?;
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        // Hidden symbols: each library keeps its own emulation state and static shared
        // memory, which the dynamic loader would otherwise merge between libraries (GCC makes
        // a template's static locals GNU-unique unless hidden). The kernels cast shared memory between float and int (no strict
        // aliasing), `fmaf` is written out where a kernel wants a fused multiply-add (no
        // contraction), and the fibers jump between stacks, which fortified `longjmp` refuses.
        let out = Command::new(&cxx)
            .args([
                "-std=c++20",
                "-O2",
                "-shared",
                "-fPIC",
                "-fvisibility=hidden",
                "-fno-strict-aliasing",
                "-ffp-contract=off",
                "-U_FORTIFY_SOURCE",
                "-o",
            ])
            .arg(&lib)
            .arg(&cpp)
            .output()
            .map_err(|e| {
                format!("running {cxx} (the kernel emulation needs a C++ compiler, g++ or clang++): {e}")
            })?;
        if !out.status.success() {
            return Err(format!(
                "{file} does not compile for the CPU:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let launch = open(&lib)?;
        Ok(Self {
            launch: Mutex::new(launch),
        })
    }

    /// Runs `kernel` over `grid` blocks of `block` threads with `shared` bytes of dynamic
    /// shared memory. `args` must match the kernel's parameters in order and type, and every
    /// buffer they point to must be as large as the kernel reads and writes.
    pub fn launch(
        &self,
        kernel: &str,
        grid: Dims,
        block: Dims,
        shared: usize,
        args: &Args,
    ) -> Result<(), String> {
        let launch = self.launch.lock().unwrap_or_else(|e| e.into_inner());
        let name = CString::new(kernel).expect("a kernel name");
        let mut pointers: Vec<*mut c_void> = args
            .slots
            .iter()
            .map(|slot| (slot as *const u64).cast_mut().cast())
            .collect();
        let mut err = vec![0 as c_char; 1024];
        // SAFETY: the library's entry point has this signature; the entry checks the
        // arguments' number and sizes, and the caller vouches for the buffers' types and sizes.
        let status = unsafe {
            (*launch)(
                name.as_ptr(),
                [grid.0, grid.1, grid.2].as_ptr(),
                [block.0, block.1, block.2].as_ptr(),
                shared,
                pointers.as_mut_ptr(),
                args.sizes.as_ptr(),
                pointers.len() as u32,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if status == 0 {
            return Ok(());
        }
        // SAFETY: the entry wrote a NUL-terminated message into `err`.
        let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) };
        Err(format!("{kernel}: {}", msg.to_string_lossy()))
    }
}

/// Each `extern __shared__ T name[];` as a pointer to the emulation's dynamic shared memory
/// (an `__align__(N)` before `T` dropped: the host's copies need no alignment).
fn rewrite_dynamic_shared(source: &str) -> Result<String, String> {
    const DECL: &str = "extern __shared__ ";
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find(DECL) {
        out.push_str(&rest[..at]);
        let after = &rest[at + DECL.len()..];
        let end = after
            .find("[];")
            .ok_or("an `extern __shared__` declaration without `[];`")?;
        let decl = after[..end].trim();
        let decl = match decl.strip_prefix("__align__(") {
            Some(aligned) => aligned
                .split_once(')')
                .ok_or("an `__align__(` without `)`")?
                .1
                .trim(),
            None => decl,
        };
        let (ty, name) = decl
            .rsplit_once(' ')
            .ok_or("an `extern __shared__` declaration without a type")?;
        out.push_str(&format!("{ty} *{name} = ({ty} *)emu::dynamic_shared();"));
        rest = &after[end + 3..];
    }
    out.push_str(rest);
    Ok(out)
}

/// A fresh directory for one build, removed when dropped (the library stays loaded).
struct TempDir(PathBuf);

impl TempDir {
    fn new(file: &str) -> Result<Self, String> {
        let stem = Path::new(file)
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("kernels");
        let dir = std::env::temp_dir().join(format!(
            "dppo-kernel-emu-{}-{stem}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        Ok(Self(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The library's `emu_launch`.
fn open(lib: &Path) -> Result<LaunchFn, String> {
    let path = CString::new(lib.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: dlopen and dlsym with NUL-terminated strings; the handle is never closed, so
    // the function stays valid for the process.
    unsafe {
        let handle = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if handle.is_null() {
            let why = std::ffi::CStr::from_ptr(libc::dlerror()).to_string_lossy();
            return Err(format!("loading {}: {why}", lib.display()));
        }
        let sym = libc::dlsym(handle, c"emu_launch".as_ptr());
        if sym.is_null() {
            return Err(format!("{} has no emu_launch", lib.display()));
        }
        Ok(std::mem::transmute::<*mut c_void, LaunchFn>(sym))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block-wide sum by shuffles and shared memory, each lane's view of the shuffles, and
    /// the errors a GPU would not report.
    const SOURCE: &str = r#"
extern "C" __global__ void block_sum(const float *x, float *out) {
    extern __shared__ float part[];
    float v = x[blockIdx.x * blockDim.x + threadIdx.x];
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.0f;
        for (unsigned w = 0; w < blockDim.x / 32; ++w) t += part[w];
        out[blockIdx.x] = t;
    }
}
extern "C" __global__ void lanes(unsigned int *xor3, unsigned int *down5, int *low) {
    const unsigned int t = threadIdx.x;
    xor3[t] = __shfl_xor_sync(0xffffffffu, t, 3);
    down5[t] = __shfl_down_sync(0xffffffffu, t, 5);
    low[t] = min(-(int)t, 3u) == 3u ? 1 : min(-(int)t, 3);
}
extern "C" __global__ void divergent_barrier(float *out) {
    if (threadIdx.x < 7) __syncthreads();
    out[threadIdx.x] = 1.0f;
}
extern "C" __global__ void divergent_shuffle(float *out) {
    float v = 1.0f;
    if (threadIdx.x % 32 < 5) v = __shfl_down_sync(0xffffffffu, v, 1);
    __syncthreads();
    out[threadIdx.x] = v;
}
extern "C" __global__ void out_of_step(float *out) {
    float v = 1.0f;
    if (threadIdx.x % 32 == 0) v = __shfl_xor_sync(0xffffffffu, v, 1);
    v = __shfl_xor_sync(0xffffffffu, v, 2);
    out[threadIdx.x] = v;
}
// Each thread copies 16 bytes into shared memory by cp.async and reads its neighbour's:
// after its wait (mode 0), before it (1), or never waiting (2).
extern "C" __global__ void staged_copy(const float *x, float *out, unsigned int mode) {
    extern __shared__ float rows[];
    const unsigned int t = threadIdx.x, n = blockDim.x;
    emu::cp_async16(rows + 4 * t, x + 4 * t, true);
    emu::cp_async_commit();
    if (mode == 0) emu::cp_async_wait_group(0);
    __syncwarp();
    out[blockIdx.x * n + t] = rows[4 * ((t + 1) % n)];
    if (mode == 1) emu::cp_async_wait_group(0);
}
"#;

    fn emulator() -> Emulator {
        Emulator::build(
            "test.cu",
            SOURCE,
            &[
                "block_sum",
                "lanes",
                "divergent_barrier",
                "divergent_shuffle",
                "out_of_step",
                "staged_copy",
            ],
        )
        .unwrap()
    }

    #[test]
    fn shuffles_and_barriers_sum_a_block_as_the_gpu_would() {
        let emu = emulator();
        let x: Vec<f32> = (0..3 * 256).map(|i| (i % 97) as f32).collect();
        let mut out = vec![f32::NAN; 3];
        let args = Args::default().arg(x.as_ptr()).arg(out.as_mut_ptr());
        emu.launch("block_sum", (3, 1, 1), (256, 1, 1), 32, &args)
            .unwrap();
        for (b, got) in out.iter().enumerate() {
            let want: f32 = x[b * 256..][..256].iter().sum();
            assert_eq!(*got, want, "block {b}");
        }
    }

    #[test]
    fn each_lane_reads_the_lane_a_gpu_would_give_it() {
        let emu = emulator();
        let (mut xor3, mut down5, mut low) = (vec![0u32; 64], vec![0u32; 64], vec![0i32; 64]);
        let args = Args::default()
            .arg(xor3.as_mut_ptr())
            .arg(down5.as_mut_ptr())
            .arg(low.as_mut_ptr());
        emu.launch("lanes", (1, 1, 1), (64, 1, 1), 0, &args)
            .unwrap();
        for t in 0..64u32 {
            let lane = t % 32;
            assert_eq!(xor3[t as usize], t - lane + (lane ^ 3), "lane {t}");
            let down = if lane + 5 < 32 { t + 5 } else { t };
            assert_eq!(down5[t as usize], down, "lane {t}");
        }
        // CUDA's min(int, unsigned) compares as unsigned: -t is large unless t is 0.
        assert_eq!(low[0], 0);
        assert!(low[1..].iter().all(|&x| x == 1), "{low:?}");
    }

    /// cp.async copies land when issued in some blocks and at their wait in others: read
    /// after the wait, every block sees them; read before it, the blocks whose copies land
    /// late see shared memory's poison; a thread returning with copies in flight is an error.
    #[test]
    fn async_copies_land_by_their_wait_or_show_that_they_had_not() {
        let emu = emulator();
        let x: Vec<f32> = (0..4 * 32).map(|i| i as f32).collect();
        let (blocks, threads) = (4, 32);
        let run = |mode: u32| {
            let mut out = vec![0f32; blocks * threads];
            let args = Args::default()
                .arg(x.as_ptr())
                .arg(out.as_mut_ptr())
                .arg(mode);
            emu.launch("staged_copy", (blocks as u32, 1, 1), (32, 1, 1), 512, &args)
                .map(|()| out)
        };
        let want = |t: usize| x[4 * ((t + 1) % threads)];
        let waited = run(0).unwrap();
        assert!((0..blocks * threads).all(|i| waited[i] == want(i % threads)));
        let early = run(1).unwrap();
        let late: Vec<bool> = early
            .chunks(threads)
            .map(|b| b.iter().any(|v| v.is_nan()))
            .collect();
        assert!(
            late.iter().any(|&l| l) && !late.iter().all(|&l| l),
            "{late:?}"
        );
        for (b, block) in early.chunks(threads).enumerate() {
            if !late[b] {
                assert!((0..threads).all(|t| block[t] == want(t)), "block {b}");
            }
        }
        let err = run(2).unwrap_err();
        assert!(err.contains("in flight when the thread returned"), "{err}");
    }

    #[test]
    fn what_a_gpu_leaves_undefined_is_an_error() {
        let emu = emulator();
        let mut out = vec![0f32; 64];
        let args = Args::default().arg(out.as_mut_ptr());
        let err = emu
            .launch("divergent_barrier", (1, 1, 1), (64, 1, 1), 0, &args)
            .unwrap_err();
        assert!(err.contains("returned while 7 threads wait"), "{err}");
        let err = emu
            .launch("divergent_shuffle", (1, 1, 1), (64, 1, 1), 0, &args)
            .unwrap_err();
        assert!(err.contains("deadlock"), "{err}");
        let x = vec![0f32; 2048];
        let sum = Args::default().arg(x.as_ptr()).arg(out.as_mut_ptr());
        let err = emu
            .launch("block_sum", (1, 1, 1), (2048, 1, 1), 0, &sum)
            .unwrap_err();
        assert!(err.contains("block size"), "{err}");
        let err = emu
            .launch("block_sum", (1, 1, 1), (64, 1, 1), 64 * 1024, &sum)
            .unwrap_err();
        assert!(err.contains("48 KiB"), "{err}");
        let err = emu
            .launch("out_of_step", (1, 1, 1), (64, 1, 1), 0, &args)
            .unwrap_err();
        assert!(err.contains("lanes out of step"), "{err}");
        let err = emu
            .launch("block_sum", (1, 1, 1), (48, 1, 1), 256, &sum)
            .unwrap_err();
        assert!(err.contains("full warp"), "{err}");
        let err = emu
            .launch("block_sum", (1, 70_000, 1), (64, 1, 1), 256, &sum)
            .unwrap_err();
        assert!(err.contains("grid size"), "{err}");
        let err = emu
            .launch("block_sum", (1, 1, 1), (64, 1, 1), 0, &Args::default())
            .unwrap_err();
        assert!(err.contains("number of arguments"), "{err}");
        let wide = Args::default().arg(x.as_ptr()).arg(7u32);
        let err = emu
            .launch("block_sum", (1, 1, 1), (64, 1, 1), 256, &wide)
            .unwrap_err();
        assert!(
            err.contains("argument 1 is 4 bytes, the kernel takes 8"),
            "{err}"
        );
    }
}
