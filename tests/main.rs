//! Integration tests, built into one binary (one link step).

#[macro_use]
mod util;

// Model numerics against HF transformers fixtures and SmolLM2 (GGUF).
mod model_parity;
// Packed rows, gradients, finite differences.
mod model_train;
// Weight files: save/load round trips, GGUF, and the errors of broken inputs.
mod model_files;
// Truncated, bit-flipped and lying model files: errors, never crashes.
mod hostile_files;
// The generation engine against the contiguous-cache reference.
mod engine;
// The CPU engine's logprobs: the same bits whatever the batch, chunking and blocks.
mod batch_invariance;
// engine.sampling = "device" through the engine, the kernel's host reference drawing.
mod device_sampling;
// engine.fused_kernels: candle-nn's fused kernels in the engine.
mod fused_kernels;
// bf16 engine and learner on the CPU: a short run learns.
mod bf16;
// The GPU path on a GPU against the CPU (skipped, saying so, without one).
mod gpu;
// The kernel-dependent suites under every CPU kernel this machine has.
mod kernels;
// A minimal HTTP client for the server tests.
mod http;
// The OpenAI-compatible server over loopback HTTP.
mod server;
// Mixed concurrent load on `dppo serve` for 30 s: no error, block or leak left.
mod soak;
// The binary: JSON outputs and error messages.
mod cli;
// dppo doctor on the CPU build; bench train's compute dtype.
mod doctor;
// --device and the device key: CUDA asked of a CPU build or a machine without a GPU.
mod device;
// Whole runs in process: run directory files, resume, interruptions, non-finite stop.
mod run;
// dppo memory: GPU memory budgets without a GPU.
mod memory;
// The learner: GRPO equivalence, unbiasedness, packing, progress.
mod trainer;
// The learner against the rollout: temperature and the mismatch metrics.
mod mismatch;
// On the CPU in f32 the learner's logprobs are the engine's bit for bit.
mod exact_learner;
// Checkpoints of earlier versions resume bit for bit.
mod resume;
// Data parallelism on CPU ranks: W ranks train as one; the --devices launcher.
mod ranks;
// The shipped configs.
mod configs;
// Datasets in the formats people have: verl's schema.
mod datasets;
// The verifier on every gold answer of the shipped data sets.
mod verifier;
// External rewards: the example server and script, failures, concurrency, a dying process.
mod rewards;
// Models named by Hugging Face id, from a local hub cache.
mod hub;
// The repository itself: self-contained, nothing outside the checkout.
mod repo;
// The GPU kit: packing, and gpu-check --dry-run on the CPU.
mod gpu_kit;
