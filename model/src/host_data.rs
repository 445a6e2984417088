//! Reading a tensor's f32 elements on the host without a copy where the storage allows it.

use candle_core::{CpuStorage, Result, Storage, Tensor};

/// `f` of the f32 elements of `t` in order: borrowed from the storage of a contiguous f32
/// CPU tensor (projection outputs, logits), copied otherwise.
pub fn with_f32<T>(t: &Tensor, f: impl FnOnce(&[f32]) -> T) -> Result<T> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(data)), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(f(&data[start..end]));
        }
    }
    Ok(f(&t.flatten_all()?.to_vec1::<f32>()?))
}
