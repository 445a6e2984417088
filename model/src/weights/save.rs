//! Atomic writes: every file goes to a temporary sibling first and is renamed into place.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;

use candle_core::Tensor;

use crate::{ModelError, Result};

/// Writes `bytes` to `path` atomically (temp file in the same directory, fsync, rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
    let dir = dir.unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        ModelError::io(path, e)
    })
}

/// Saves tensors as one safetensors file (metadata `format = pt`, which transformers wants),
/// atomically.
pub fn save_safetensors_atomic(tensors: &BTreeMap<String, Tensor>, path: &Path) -> Result<()> {
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = ::safetensors::serialize(tensors.iter(), Some(metadata))
        .map_err(|e| ModelError::weights(path.display(), e.to_string()))?;
    write_atomic(path, &bytes)
}
