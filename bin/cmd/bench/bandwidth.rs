//! The device's memory bandwidth, the floor's denominator: `bench rollout` reads a decode
//! step against it and `bench attention` the kernels' KV read rate.

use std::time::Instant;

use candle_core::Device;

/// The device's memory bandwidth in bytes/s (bytes read plus bytes written), through buffers
/// larger than the caches: on a GPU [`gpu_bandwidth`], on the CPU 256 MiB copied between
/// buffers already touched, split over the cores.
pub(super) fn memory_bandwidth(device: &Device) -> anyhow::Result<f64> {
    if device.is_cuda() {
        gpu_bandwidth(device)
    } else {
        Ok(host_bandwidth(1 << 28))
    }
}

/// Ten device-to-device copies of 512 MiB of random floats between two buffers allocated
/// once, timed together; the best of five rounds after one untimed. A candle `copy` per
/// timing would time its strided copy kernel and a 1 GiB allocation as well (it gave 1.3 TB/s
/// on an H200 that copies at 4.3).
#[cfg(feature = "cuda")]
fn gpu_bandwidth(device: &Device) -> anyhow::Result<f64> {
    const COPIES: usize = 10;
    let floats = (512 << 20) / 4;
    let stream = device.as_cuda_device()?.cuda_stream();
    let random = candle_core::Tensor::rand(-1f32, 1f32, floats, device)?;
    let (storage, _) = random.storage_and_layout();
    let candle_core::Storage::Cuda(storage) = &*storage else {
        anyhow::bail!("the bandwidth probe's buffer is not on the GPU");
    };
    let src = storage.as_cuda_slice::<f32>()?;
    let mut dst = stream.alloc_zeros::<f32>(floats)?;
    let mut best = 0f64;
    for round in 0..6 {
        stream.synchronize()?;
        let start = Instant::now();
        for _ in 0..COPIES {
            stream.memcpy_dtod(src, &mut dst)?;
        }
        stream.synchronize()?;
        let moved = 2.0 * (COPIES * floats * 4) as f64;
        if round > 0 {
            best = best.max(moved / start.elapsed().as_secs_f64());
        }
    }
    Ok(best)
}

#[cfg(not(feature = "cuda"))]
fn gpu_bandwidth(device: &Device) -> anyhow::Result<f64> {
    anyhow::bail!("no CUDA in this build for {:?}", device.location())
}

/// The host's copy bandwidth over `bytes`, one chunk per core; the first copy faults the
/// destination's pages in and is not timed.
fn host_bandwidth(bytes: usize) -> f64 {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = bytes.div_ceil(threads);
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut copy = || {
        let start = Instant::now();
        std::thread::scope(|scope| {
            for (d, s) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                scope.spawn(move || d.copy_from_slice(s));
            }
        });
        start.elapsed()
    };
    copy();
    (0..5)
        .map(|_| 2.0 * bytes as f64 / copy().as_secs_f64())
        .fold(0.0, f64::max)
}
