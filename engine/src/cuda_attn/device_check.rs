//! The kernels on a GPU against the generic path and the f64 reference, on random batches
//! (GQA ratios 1, 3, 4 and 8; head_dim 64 and 128; pools with holes; forked sequences;
//! decoding, prefill and chunked prefill; contexts split several ways), for `dppo doctor`.
//! The block tables reach the device entry by entry, through the scatter kernel the engine
//! uses for an iteration's changes.

use candle_core::{DType, Device, Result, Tensor};

use super::case::{checked_cases, table_entries, tolerance, Case};
use super::tables::TableCopy;
use super::{
    multiprocessors, AttentionKernel, CudaIndex, CudaPagedAttention, DeviceTables, Extras,
};
use crate::diff::worst;
use crate::generic_attn::{BatchIndex, GenericPagedAttention, TensorKvCache};
use dppo_model::AttentionBackend;

/// What the check found for one dtype.
#[derive(Debug, Clone, PartialEq)]
pub struct DtypeReport {
    pub dtype: DType,
    pub cases: usize,
    /// Largest |kernel - f64 reference| and |kernel - generic path| over every output.
    pub vs_reference: f64,
    pub vs_generic: f64,
    /// Pools after the writes that differ from the generic path's, bit for bit.
    pub pools_differing: usize,
    /// The bound both differences must stay under.
    pub tolerance: f64,
    /// The first case that failed, what it holds and where its output is furthest off:
    /// the place to start when the check fails.
    pub first_failure: Option<String>,
}

impl DtypeReport {
    pub fn passed(&self) -> bool {
        self.vs_reference <= self.tolerance
            && self.vs_generic <= self.tolerance
            && self.pools_differing == 0
    }
}

/// What one case of the check found.
struct CaseResult {
    vs_reference: f64,
    vs_generic: f64,
    pools_differing: usize,
    /// The sequence furthest from the reference, and its distance.
    worst_sequence: (usize, f64),
    splits: usize,
}

/// Runs every case in f32, bf16 and f16 on `device`, the attention by its `variant`: a
/// report for each dtype of which the variant serves any case (`mma`: bf16 and f16).
pub fn run(device: &Device, variant: AttentionKernel) -> Result<Vec<DtypeReport>> {
    let Device::Cuda(cuda) = device else {
        candle_core::bail!("the paged kernels' check needs a GPU");
    };
    let min_blocks = 2 * multiprocessors(cuda)?;
    let mut reports = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let mut report = DtypeReport {
            dtype,
            cases: 0,
            vs_reference: 0.0,
            vs_generic: 0.0,
            pools_differing: 0,
            tolerance: tolerance(dtype),
            first_failure: None,
        };
        let cases = checked_cases(dtype);
        let served = cases
            .iter()
            .enumerate()
            .filter(|(_, case)| variant.serves(case.heads, dtype));
        for (c, case) in served {
            // Split as the engine would, and into as many splits as there are chunks.
            for blocks in [min_blocks, usize::MAX / 2] {
                let what = || format!("{dtype:?} case {c} ({})", case.describe());
                let r = one_case(case, (dtype, variant), device, blocks)
                    .map_err(|e| e.context(what()))?;
                report.vs_reference = report.vs_reference.max(r.vs_reference);
                report.vs_generic = report.vs_generic.max(r.vs_generic);
                report.pools_differing += r.pools_differing;
                report.cases += 1;
                let failed = r.vs_reference > report.tolerance
                    || r.vs_generic > report.tolerance
                    || r.pools_differing > 0;
                if failed && report.first_failure.is_none() {
                    let (seq, err) = r.worst_sequence;
                    report.first_failure = Some(format!(
                        "{}, {} splits: {:.1e} from f64 (furthest: sequence {seq}, {err:.1e}), \
                         {:.1e} from generic, {} pools differ",
                        what(),
                        r.splits,
                        r.vs_reference,
                        r.vs_generic,
                        r.pools_differing
                    ));
                }
            }
        }
        if report.cases > 0 {
            reports.push(report);
        }
    }
    Ok(reports)
}

fn one_case(
    case: &Case,
    (dtype, variant): (DType, AttentionKernel),
    device: &Device,
    min_blocks: usize,
) -> Result<CaseResult> {
    let heads = case.heads;
    let rows = case.metas.iter().map(|m| m.num_new_tokens).sum::<usize>();
    let upload = |x: &[f32], dims: (usize, usize, usize)| {
        Tensor::from_slice(x, dims, device)?.to_dtype(dtype)
    };
    let q = upload(&case.q, (rows, heads.num_heads, heads.head_dim))?;
    let (new_k, new_v) = case.new_kv();
    let kv_dims = (rows, heads.num_kv_heads, heads.head_dim);
    let (k, v) = (upload(&new_k, kv_dims)?, upload(&new_v, kv_dims)?);
    let (pool_k, pool_v) = case.cached_pool();
    let pool = (&pool_k[..], &pool_v[..]);

    let mut cuda_cache = TensorKvCache::from_host(case.shape, pool, dtype, device)?;
    let (plan, host_tables) = case.plan(min_blocks).map_err(candle_core::Error::wrap)?;
    let mut tables = DeviceTables::copy_of(&vec![0; host_tables.len()], device)?;
    tables.write_entries(&table_entries(&host_tables))?;
    let splits = plan.splits;
    let index = CudaIndex::new(plan, device)?;
    let got = CudaPagedAttention {
        cache: &mut cuda_cache,
        index: &index,
        tables: &tables,
        extras: Extras::default(),
        variant,
    }
    .attend(0, &q, &k, &v)?;

    let mut generic_cache = TensorKvCache::from_host(case.shape, pool, dtype, device)?;
    let generic_index = BatchIndex::new(&case.metas, &case.slots, case.shape, device)?;
    let want = GenericPagedAttention {
        cache: &mut generic_cache,
        index: &generic_index,
        ops: 0,
    }
    .attend(0, &q, &k, &v)?;

    let host = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
    let (got, want) = (host(&got)?, host(&want)?);
    let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
    let reference = case.reference();
    let bits =
        |t: &Tensor| -> Result<Vec<u32>> { Ok(host(t)?.iter().map(|x| x.to_bits()).collect()) };
    let (ck, cv) = cuda_cache.layer(0);
    let (gk, gv) = generic_cache.layer(0);
    Ok(CaseResult {
        vs_reference: worst(&got, &reference),
        vs_generic: worst(&got, &want),
        pools_differing: (bits(ck)? != bits(gk)?) as usize + (bits(cv)? != bits(gv)?) as usize,
        worst_sequence: case.worst_sequence(&got, &reference),
        splits,
    })
}
