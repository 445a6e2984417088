//! Weight files: HF directories and GGUF in, HF directories out; broken inputs rejected
//! with errors that name the file and the problem.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use dppo_model::{Arch, ModelConfig, Policy};

use crate::util::{flat, logits, random_policy, small_config};

fn load_err(path: &Path) -> String {
    format!(
        "{}",
        Policy::load(path.to_str().unwrap(), &Device::Cpu).unwrap_err()
    )
}

fn assert_same_tensors(a: &Policy, b: &Policy) {
    assert_eq!(a.weights.tensors().len(), b.weights.tensors().len());
    for (name, t) in a.weights.tensors() {
        let u = &b.weights.tensors()[name];
        let (x, y) = (flat(t), flat(u));
        let same = x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(
            same && t.dims() == u.dims(),
            "{name} differs after the round trip"
        );
    }
}

#[test]
fn save_load_round_trip_is_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
        let policy = random_policy(&small_config(arch), 7);
        let out = dir.path().join(format!("{arch:?}"));
        policy.save_hf(&out).unwrap();
        let back = Policy::load(out.to_str().unwrap(), &Device::Cpu).unwrap();
        assert_eq!(back.config, policy.config);
        assert_same_tensors(&policy, &back);
        let text = "What is 3+4? Answer: 7";
        assert_eq!(
            back.tokenizer.encode(text, false).unwrap(),
            policy.tokenizer.encode(text, false).unwrap()
        );
        assert_eq!(
            back.tokenizer.chat_template().unwrap().source(),
            policy.tokenizer.chat_template().unwrap().source()
        );
    }
}

#[test]
fn saving_over_an_existing_directory_replaces_it_whole() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    random_policy(&small_config(Arch::Llama), 1)
        .save_hf(&out)
        .unwrap();
    let second = random_policy(&small_config(Arch::Qwen3), 2);
    second.save_hf(&out).unwrap();
    let back = Policy::load(out.to_str().unwrap(), &Device::Cpu).unwrap();
    assert_same_tensors(&second, &back);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        leftovers,
        vec![std::ffi::OsString::from("ckpt")],
        "temporary files left behind"
    );
}

#[test]
fn builtin_tiny_needs_no_file_and_round_trips() {
    let tiny = Policy::load("builtin:tiny", &Device::Cpu).unwrap();
    assert_eq!(tiny.config.arch, Arch::Qwen3);
    assert!(tiny.config.qk_norm && tiny.config.tie_word_embeddings);
    let again = Policy::load("builtin:tiny", &Device::Cpu).unwrap();
    assert_same_tensors(&tiny, &again);
    let dir = tempfile::tempdir().unwrap();
    tiny.save_hf(&dir.path().join("tiny")).unwrap();
    let back = Policy::load(dir.path().join("tiny").to_str().unwrap(), &Device::Cpu).unwrap();
    assert_same_tensors(&tiny, &back);
    assert_eq!(back.eos_token_ids(), tiny.eos_token_ids());
    let err = format!(
        "{}",
        Policy::load("builtin:huge", &Device::Cpu).unwrap_err()
    );
    assert!(
        err.contains("builtin:huge") && err.contains("tiny"),
        "{err}"
    );
}

fn saved(arch: Arch) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m");
    random_policy(&small_config(arch), 3).save_hf(&out).unwrap();
    (dir, out)
}

#[test]
fn truncated_safetensors_is_a_clear_error() {
    let (_d, out) = saved(Arch::Llama);
    let file = out.join("model.safetensors");
    let len = std::fs::metadata(&file).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.set_len(len / 2).unwrap();
    let err = load_err(&out);
    assert!(
        err.contains("model.safetensors") && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn missing_tensor_is_a_clear_error() {
    let (_d, out) = saved(Arch::Qwen2);
    let file = out.join("model.safetensors");
    let mut tensors: BTreeMap<String, Tensor> = candle_core::safetensors::load(&file, &Device::Cpu)
        .unwrap()
        .into_iter()
        .collect();
    tensors.remove("model.layers.1.self_attn.k_proj.bias");
    dppo_model::weights::save_safetensors_atomic(&tensors, &file).unwrap();
    let err = load_err(&out);
    assert!(
        err.contains("missing tensor model.layers.1.self_attn.k_proj.bias"),
        "{err}"
    );
}

#[test]
fn shape_mismatch_is_a_clear_error() {
    let (_d, out) = saved(Arch::Llama);
    let cfg_path = out.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).unwrap();
    std::fs::write(
        &cfg_path,
        text.replace("\"intermediate_size\": 48", "\"intermediate_size\": 50"),
    )
    .unwrap();
    let err = load_err(&out);
    assert!(
        err.contains("has shape [48, 32], expected [50, 32]"),
        "{err}"
    );
}

#[test]
fn unknown_architecture_is_a_clear_error() {
    let (_d, out) = saved(Arch::Llama);
    let cfg_path = out.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).unwrap();
    std::fs::write(&cfg_path, text.replace("\"llama\"", "\"mistral\"")).unwrap();
    let err = load_err(&out);
    assert!(
        err.contains("config.json") && err.contains("unsupported model_type \"mistral\""),
        "{err}"
    );
}

#[test]
fn missing_path_and_non_model_file_are_clear_errors() {
    let err = load_err(Path::new("/nonexistent/model"));
    assert!(err.contains("no such file or directory"), "{err}");
    let f = tempfile::NamedTempFile::new().unwrap();
    let err = load_err(f.path());
    assert!(
        err.contains("expected an HF model directory or a .gguf file"),
        "{err}"
    );
}

/// Byte-level BPE vocabulary for a test GGUF: printable ASCII, space (`Ġ`), one merge,
/// and ChatML specials.
fn gguf_vocab() -> (Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = ('!'..='~').map(String::from).collect();
    tokens.push("Ġ".into());
    tokens.push("hi".into());
    let mut types = vec![1; tokens.len()];
    for special in ["<|im_start|>", "<|im_end|>"] {
        tokens.push(special.into());
        types.push(3);
    }
    (tokens, types)
}

/// llama.cpp's q/k row permutation (what its converter applies to Llama checkpoints).
fn permute_rope(w: &Tensor, heads: usize) -> Tensor {
    let (rows, cols) = w.dims2().unwrap();
    w.reshape((heads, 2, rows / heads / 2, cols))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((rows, cols))
        .unwrap()
}

fn gguf_name(hf: &str) -> String {
    hf.replace("model.layers.", "blk.")
        .replace("self_attn.q_proj", "attn_q")
        .replace("self_attn.k_proj", "attn_k")
        .replace("self_attn.v_proj", "attn_v")
        .replace("self_attn.o_proj", "attn_output")
        .replace("mlp.gate_proj", "ffn_gate")
        .replace("mlp.up_proj", "ffn_up")
        .replace("mlp.down_proj", "ffn_down")
        .replace("post_attention_layernorm", "ffn_norm")
        .replace("input_layernorm", "attn_norm")
        .replace("model.embed_tokens", "token_embd")
        .replace("model.norm", "output_norm")
        .replace("lm_head", "output")
}

/// Writes `policy` as a llama GGUF with one tensor type per role; returns the policy the
/// file should load as (weights after the quantisation round trip).
pub(crate) fn write_llama_gguf(policy: &Policy, path: &Path) -> Policy {
    let cfg = &policy.config;
    let dtype_of = |name: &str| {
        if name.contains("norm") {
            GgmlDType::F32
        } else if name.contains("mlp") {
            GgmlDType::Q4_1
        } else if name.contains("embed") || name.contains("lm_head") {
            GgmlDType::F16
        } else {
            GgmlDType::Q8_0
        }
    };
    let mut q_tensors = Vec::new();
    let mut expected = BTreeMap::new();
    for (name, t) in policy.weights.tensors() {
        let q = QTensor::quantize(t, dtype_of(name)).unwrap();
        expected.insert(name.clone(), q.dequantize(&Device::Cpu).unwrap());
        let stored = if name.ends_with("q_proj.weight") {
            permute_rope(t, cfg.num_attention_heads)
        } else if name.ends_with("k_proj.weight") {
            permute_rope(t, cfg.num_key_value_heads)
        } else {
            t.clone()
        };
        q_tensors.push((
            gguf_name(name),
            QTensor::quantize(&stored, dtype_of(name)).unwrap(),
        ));
    }
    let (tokens, types) = gguf_vocab();
    let md: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("general.alignment", Value::U32(32)),
        ("llama.embedding_length", Value::U32(cfg.hidden_size as u32)),
        ("llama.feed_forward_length", Value::U32(cfg.intermediate_size as u32)),
        ("llama.block_count", Value::U32(cfg.num_hidden_layers as u32)),
        ("llama.attention.head_count", Value::U32(cfg.num_attention_heads as u32)),
        ("llama.attention.head_count_kv", Value::U32(cfg.num_key_value_heads as u32)),
        ("llama.context_length", Value::U32(cfg.max_position_embeddings as u32)),
        ("llama.rope.freq_base", Value::F32(cfg.rope_theta as f32)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(cfg.rms_norm_eps as f32)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens", Value::Array(tokens.iter().cloned().map(Value::String).collect())),
        ("tokenizer.ggml.token_type", Value::Array(types.iter().map(|t| Value::I32(*t)).collect())),
        ("tokenizer.ggml.merges", Value::Array(vec![Value::String("h i".into())])),
        ("tokenizer.ggml.eos_token_id", Value::U32(tokens.len() as u32 - 1)),
        (
            "tokenizer.chat_template",
            Value::String("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}".into()),
        ),
    ];
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = q_tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
    let weights = dppo_model::Weights::from_tensors(cfg, expected, "expected").unwrap();
    Policy {
        config: cfg.clone(),
        weights,
        tokenizer: policy.tokenizer.clone(),
    }
}

pub(crate) fn gguf_test_config() -> ModelConfig {
    // Quantised blocks span 32 values: every row length must be a multiple of 32.
    let mut cfg = small_config(Arch::Llama);
    cfg.qkv_bias = false;
    cfg.o_bias = false;
    cfg.hidden_size = 64;
    cfg.intermediate_size = 96;
    cfg.head_dim = 16;
    cfg.vocab_size = gguf_vocab().0.len();
    cfg.tie_word_embeddings = false;
    cfg.eos_token_ids = vec![cfg.vocab_size as u32 - 1];
    cfg
}

#[test]
fn gguf_loads_quantised_llama_with_tokenizer() {
    let cfg = gguf_test_config();
    let weights = crate::util::random_weights(&cfg, 11);
    let tokenizer = dppo_model::presets::task_tokenizer().unwrap();
    let source = Policy {
        config: cfg.clone(),
        weights,
        tokenizer,
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let expected = write_llama_gguf(&source, &path);
    let loaded = Policy::load(path.to_str().unwrap(), &Device::Cpu).unwrap();
    assert_eq!(loaded.config, cfg);
    // Same dequantised values, and q/k rows un-permuted: identical logits.
    let ids = [5u32, 17, 42, 8, 60, 3, 91];
    assert_close!(logits(&loaded, &ids), logits(&expected, &ids), 1e-5);
    // Tokenizer rebuilt from metadata: byte-level BPE with the merge and specials.
    let tok = &loaded.tokenizer;
    let ids = tok.encode("hi hi!<|im_end|>", false).unwrap();
    let hi = tok.token_to_id("hi").unwrap();
    let space = tok.token_to_id("Ġ").unwrap();
    let end = tok.token_to_id("<|im_end|>").unwrap();
    assert_eq!(ids, vec![hi, space, hi, tok.token_to_id("!").unwrap(), end]);
    assert_eq!(tok.decode(&ids, true).unwrap(), "hi hi!");
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    let chat = tok
        .apply_chat_template(&[dppo_model::ChatMessage::new("user", "hi")], false)
        .unwrap();
    assert_eq!(chat, "<|im_start|>user\nhi<|im_end|>\n");
}

#[test]
fn truncated_gguf_is_a_clear_error() {
    let cfg = gguf_test_config();
    let source = Policy {
        config: cfg.clone(),
        weights: crate::util::random_weights(&cfg, 12),
        tokenizer: dppo_model::presets::task_tokenizer().unwrap(),
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    write_llama_gguf(&source, &path);
    let len = std::fs::metadata(&path).unwrap().len();
    for cut in [len - 100, 40] {
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(cut).unwrap();
        let err = load_err(&path);
        assert!(err.contains("m.gguf"), "{err}");
        assert!(err.contains("needs") || err.contains("truncated"), "{err}");
    }
}
