//! Loading a GGUF file (llama.cpp's format): config from metadata, tensors dequantised to
//! f32 under HF names, tokenizer and chat template from `tokenizer.ggml.*`.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{Device, Tensor};

use crate::config::{Arch, ModelConfig};
use crate::tokenizer::TextTokenizer;
use crate::{ModelError, Result};

/// What a GGUF file holds, converted to our types.
#[derive(Debug)]
pub struct GgufModel {
    pub config: ModelConfig,
    pub tensors: BTreeMap<String, Tensor>,
    pub tokenizer: TextTokenizer,
}

/// Reads a GGUF file: metadata, every tensor (dequantised to f32) and the tokenizer.
pub fn load_gguf(path: &Path, device: &Device) -> Result<GgufModel> {
    let origin = path.display().to_string();
    let bad = |reason: String| ModelError::weights(&origin, reason);
    let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
    let mut reader = BufReader::new(file);
    if header_alignment(&mut reader).ok().flatten() == Some(0) {
        return Err(bad(
            "metadata general.alignment: must be positive, got 0".into()
        ));
    }
    reader.rewind().map_err(|e| ModelError::io(path, e))?;
    let content = Content::read(&mut reader).map_err(|e| {
        bad(format!(
            "not a readable GGUF file (truncated or corrupt?): {e}"
        ))
    })?;
    let meta = Meta {
        md: &content.metadata,
        origin: &origin,
    };
    let config = config_from_meta(&meta, &content)?;
    let mut tensors = BTreeMap::new();
    for (hf_name, shape) in crate::weights::param_specs(&config) {
        let gguf_name = gguf_name(&hf_name);
        let Some(info) = content.tensor_infos.get(&gguf_name) else {
            return Err(bad(format!("missing tensor {gguf_name} (for {hf_name})")));
        };
        // Checked before reading, so that a lying shape never sizes an allocation.
        if info.shape.dims() != shape.as_slice() {
            return Err(bad(format!(
                "tensor {gguf_name} has shape {:?}, expected {shape:?}",
                info.shape.dims()
            )));
        }
        let q = content
            .tensor(&mut reader, &gguf_name, device)
            .map_err(|e| bad(format!("tensor {gguf_name}: {e}")))?;
        let t = q.dequantize(device)?;
        let t = match (config.arch, hf_name.rsplit('.').nth(1)) {
            (Arch::Llama, Some("q_proj")) => unpermute_rope(&t, config.num_attention_heads)?,
            (Arch::Llama, Some("k_proj")) => unpermute_rope(&t, config.num_key_value_heads)?,
            _ => t,
        };
        tensors.insert(hf_name, t);
    }
    let tokenizer = crate::tokenizer::from_gguf_metadata(&content.metadata, &origin)?;
    Ok(GgufModel {
        config,
        tensors,
        tokenizer,
    })
}

/// The integer value of `general.alignment` in a GGUF header, found by walking the
/// metadata: candle's reader divides by it unchecked. `None` when absent or not an integer;
/// an error when the header cannot be walked (candle's reader then says what is wrong).
fn header_alignment(r: &mut BufReader<File>) -> std::io::Result<Option<u64>> {
    const KEY: &[u8; 17] = b"general.alignment";
    let end = r.get_ref().metadata()?.len();
    let mut w = Walker {
        r,
        pos: 0,
        end,
        wide: false,
    };
    let magic = w.u32()?;
    if magic != 0x4655_4747 && magic != 0x4747_5546 {
        return Ok(None);
    }
    w.wide = w.u32()? >= 2;
    let _num_tensors = w.len()?;
    let num_kv = w.len()?;
    let mut alignment = None;
    for _ in 0..num_kv {
        let key_len = w.len()?;
        let is_alignment = if key_len == KEY.len() as u64 {
            w.bytes::<17>()? == *KEY
        } else {
            w.skip(key_len)?;
            false
        };
        let kind = w.u32()?;
        match (is_alignment, kind) {
            (true, 0 | 1) => alignment = Some(u64::from(w.bytes::<1>()?[0])),
            (true, 2 | 3) => alignment = Some(u64::from(u16::from_le_bytes(w.bytes()?))),
            (true, 4 | 5) => alignment = Some(u64::from(w.u32()?)),
            _ => w.skip_value(kind, 0)?,
        }
    }
    Ok(alignment)
}

/// A bounds-checked walk over a GGUF header.
struct Walker<'a> {
    r: &'a mut BufReader<File>,
    pos: u64,
    end: u64,
    /// Lengths are u64 from GGUF v2 on, u32 in v1.
    wide: bool,
}

impl Walker<'_> {
    fn bytes<const N: usize>(&mut self) -> std::io::Result<[u8; N]> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b)?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self) -> std::io::Result<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn len(&mut self) -> std::io::Result<u64> {
        if self.wide {
            Ok(u64::from_le_bytes(self.bytes()?))
        } else {
            self.u32().map(u64::from)
        }
    }

    /// Skips `n` bytes, failing past the end of the file.
    fn skip(&mut self, n: u64) -> std::io::Result<()> {
        let to = self
            .pos
            .checked_add(n)
            .filter(|&to| to <= self.end)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
        self.r.seek_relative((to - self.pos) as i64)?;
        self.pos = to;
        Ok(())
    }

    /// Skips one metadata value of GGUF type `kind`.
    fn skip_value(&mut self, kind: u32, depth: usize) -> std::io::Result<()> {
        let eof = || std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
        match (kind, fixed_size(kind)) {
            (_, Some(size)) => self.skip(size),
            (8, None) => {
                let len = self.len()?;
                self.skip(len)
            }
            (9, None) if depth < 64 => {
                let item = self.u32()?;
                let len = self.len()?;
                match fixed_size(item) {
                    Some(size) => self.skip(len.checked_mul(size).ok_or_else(eof)?),
                    None => (0..len).try_for_each(|_| self.skip_value(item, depth + 1)),
                }
            }
            _ => Err(std::io::Error::from(std::io::ErrorKind::InvalidData)),
        }
    }
}

/// Bytes of a fixed-size GGUF metadata type (not strings and arrays).
fn fixed_size(kind: u32) -> Option<u64> {
    match kind {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

/// HF tensor name -> llama.cpp tensor name.
fn gguf_name(hf: &str) -> String {
    if let Some(rest) = hf.strip_prefix("model.layers.") {
        let (layer, name) = rest.split_once('.').unwrap_or((rest, ""));
        let mapped = name
            .replace("self_attn.q_proj", "attn_q")
            .replace("self_attn.k_proj", "attn_k")
            .replace("self_attn.v_proj", "attn_v")
            .replace("self_attn.o_proj", "attn_output")
            .replace("self_attn.q_norm", "attn_q_norm")
            .replace("self_attn.k_norm", "attn_k_norm")
            .replace("mlp.gate_proj", "ffn_gate")
            .replace("mlp.up_proj", "ffn_up")
            .replace("mlp.down_proj", "ffn_down")
            .replace("post_attention_layernorm", "ffn_norm")
            .replace("input_layernorm", "attn_norm");
        return format!("blk.{layer}.{mapped}");
    }
    match hf {
        "model.embed_tokens.weight" => "token_embd.weight".into(),
        "model.norm.weight" => "output_norm.weight".into(),
        "lm_head.weight" => "output.weight".into(),
        other => other.into(),
    }
}

/// llama.cpp's converter permutes Llama's q/k rows so rope rotates adjacent pairs;
/// this undoes it: rows (heads, head_dim/2, 2) -> (heads, 2, head_dim/2).
fn unpermute_rope(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    w.reshape((heads, rows / heads / 2, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))
}

/// Typed access to GGUF metadata with errors that name the key.
struct Meta<'a> {
    md: &'a std::collections::HashMap<String, Value>,
    origin: &'a str,
}

impl Meta<'_> {
    fn err(&self, key: &str, reason: &str) -> ModelError {
        ModelError::weights(self.origin, format!("metadata {key}: {reason}"))
    }

    fn usize(&self, key: &str) -> Result<Option<usize>> {
        self.md
            .get(key)
            .map(|v| {
                v.to_u64()
                    .or_else(|_| v.to_u32().map(u64::from))
                    .or_else(|_| v.to_i32().map(|x| x.max(0) as u64))
                    .map(|x| x as usize)
                    .map_err(|_| self.err(key, "expected an integer"))
            })
            .transpose()
    }

    fn required(&self, key: &str) -> Result<usize> {
        self.usize(key)?.ok_or_else(|| self.err(key, "missing"))
    }

    fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.md
            .get(key)
            .map(|v| {
                // f32 values are read at their shortest decimal form: 1e-6, not 9.99999997e-7.
                v.to_f32()
                    .map(|x| x.to_string().parse::<f64>().unwrap_or(f64::from(x)))
                    .or_else(|_| v.to_f64())
                    .map_err(|_| self.err(key, "expected a float"))
            })
            .transpose()
    }

    fn str(&self, key: &str) -> Option<&str> {
        self.md
            .get(key)
            .and_then(|v| v.to_string().ok())
            .map(|s| s.as_str())
    }
}

fn config_from_meta(meta: &Meta, content: &Content) -> Result<ModelConfig> {
    let arch_name = meta
        .str("general.architecture")
        .ok_or_else(|| meta.err("general.architecture", "missing"))?;
    let arch = match arch_name {
        "llama" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        other => {
            return Err(meta.err(
                "general.architecture",
                &format!("unsupported architecture \"{other}\" (supported: llama, qwen2, qwen3)"),
            ))
        }
    };
    let key = |k: &str| format!("{arch_name}.{k}");
    if let Some(kind) = meta.str(&key("rope.scaling.type")) {
        if kind != "none" {
            return Err(meta.err(
                &key("rope.scaling.type"),
                &format!("unsupported \"{kind}\""),
            ));
        }
    }
    if meta.usize(&key("expert_count"))?.unwrap_or(0) > 0 {
        return Err(meta.err(&key("expert_count"), "mixture-of-experts is unsupported"));
    }
    let hidden_size = meta.required(&key("embedding_length"))?;
    let num_attention_heads = meta.required(&key("attention.head_count"))?;
    let embed = content
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| ModelError::weights(meta.origin, "missing tensor token_embd.weight"))?;
    let vocab_size = match meta.usize(&key("vocab_size"))? {
        Some(v) => v,
        None => embed.shape.dims().first().copied().unwrap_or(0),
    };
    let cfg = ModelConfig {
        arch,
        vocab_size,
        hidden_size,
        intermediate_size: meta.required(&key("feed_forward_length"))?,
        num_hidden_layers: meta.required(&key("block_count"))?,
        num_attention_heads,
        num_key_value_heads: meta
            .usize(&key("attention.head_count_kv"))?
            .unwrap_or(num_attention_heads),
        head_dim: meta
            .usize(&key("attention.key_length"))?
            .unwrap_or(hidden_size / num_attention_heads.max(1)),
        rope_theta: meta.f64(&key("rope.freq_base"))?.unwrap_or(10_000.0),
        rms_norm_eps: meta
            .f64(&key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-6),
        tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
        max_position_embeddings: meta.required(&key("context_length"))?,
        qkv_bias: content.tensor_infos.contains_key("blk.0.attn_q.bias"),
        o_bias: content.tensor_infos.contains_key("blk.0.attn_output.bias"),
        qk_norm: arch == Arch::Qwen3,
        bos_token_id: meta.usize("tokenizer.ggml.bos_token_id")?.map(|v| v as u32),
        eos_token_ids: meta
            .usize("tokenizer.ggml.eos_token_id")?
            .map(|v| vec![v as u32])
            .unwrap_or_default(),
    };
    cfg.validate()
        .map_err(|r| ModelError::weights(meta.origin, r))?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_names() {
        assert_eq!(
            gguf_name("model.layers.3.self_attn.q_proj.weight"),
            "blk.3.attn_q.weight"
        );
        assert_eq!(
            gguf_name("model.layers.0.self_attn.k_norm.weight"),
            "blk.0.attn_k_norm.weight"
        );
        assert_eq!(
            gguf_name("model.layers.1.post_attention_layernorm.weight"),
            "blk.1.ffn_norm.weight"
        );
        assert_eq!(
            gguf_name("model.layers.1.mlp.down_proj.weight"),
            "blk.1.ffn_down.weight"
        );
        assert_eq!(gguf_name("lm_head.weight"), "output.weight");
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(heads, 2, d/2, cols).swapaxes(1, 2).reshape(w.shape)
        let (heads, d, cols) = (2, 4, 3);
        let hf = Tensor::arange(0f32, (heads * d * cols) as f32, &Device::Cpu)
            .unwrap()
            .reshape((heads * d, cols))
            .unwrap();
        let permuted = hf
            .reshape((heads, 2, d / 2, cols))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((heads * d, cols))
            .unwrap();
        let back = unpermute_rope(&permuted, heads).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), hf.to_vec2::<f32>().unwrap());
    }
}
