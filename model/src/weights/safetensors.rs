//! Loading tensors from an HF directory: `model.safetensors` or a sharded index.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Tensor};

use crate::{ModelError, Result};

const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

/// Reads every tensor of the checkpoint in `dir` (single file or sharded index).
pub fn load_safetensors_dir(dir: &Path, device: &Device) -> Result<BTreeMap<String, Tensor>> {
    let index = dir.join(INDEX);
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
        let shards = shard_files(&text).map_err(|r| ModelError::weights(index.display(), r))?;
        let mut all = BTreeMap::new();
        for shard in shards {
            all.extend(load_file(&dir.join(shard), device)?);
        }
        return Ok(all);
    }
    let single = dir.join(SINGLE);
    if single.exists() {
        return load_file(&single, device);
    }
    Err(ModelError::weights(
        dir.display(),
        format!("neither {SINGLE} nor {INDEX} found"),
    ))
}

/// The distinct shard file names of a `model.safetensors.index.json`, in first-seen order.
fn shard_files(index_json: &str) -> std::result::Result<Vec<String>, String> {
    let v: serde_json::Value =
        serde_json::from_str(index_json).map_err(|e| format!("not valid JSON: {e}"))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or("no \"weight_map\" object")?;
    let mut files: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| format!("weight_map[{tensor}] is not a file name"))?;
        if file.contains('/') || file.contains("..") {
            return Err(format!(
                "weight_map[{tensor}] = {file:?} leaves the directory"
            ));
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
    }
    Ok(files)
}

fn load_file(path: &Path, device: &Device) -> Result<BTreeMap<String, Tensor>> {
    let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
    let tensors = candle_core::safetensors::load_buffer(&bytes, device).map_err(|e| {
        ModelError::weights(
            path.display(),
            format!("not a valid safetensors file (truncated or corrupt?): {e}"),
        )
    })?;
    Ok(tensors.into_iter().collect())
}
