//! `dppo bench attention`: the paged attention kernels alone on a GPU, one variant after
//! another on the same decode batch of a model shape's heads (docs/gpu.md): a call's time,
//! the KV read rate it implies and that rate's share of the card's copy bandwidth, so that
//! the variants race in seconds of device time.

use dppo_engine::cuda_attn::bench::DecodeBatch;
use dppo_engine::cuda_attn::Heads;
use dppo_engine::AttentionKernel;
use dppo_model::shapes::Shape;
use dppo_model::DeviceSpec;
use serde_json::json;

use super::bandwidth::memory_bandwidth;

/// Arguments of `dppo bench attention`.
#[derive(Debug, clap::Args)]
pub struct AttentionArgs {
    /// The model shape whose heads are attended: smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b or
    /// qwen3-1.7b.
    #[arg(long, default_value = "qwen2.5-0.5b")]
    shape: Shape,
    /// The GPU: cuda or cuda:N (a build with `--features cuda`).
    #[arg(long, default_value = "cuda")]
    device: DeviceSpec,
    /// Sequences decoding at once, one new token each.
    #[arg(long, default_value_t = 1024)]
    batch: usize,
    /// Keys each sequence attends (its new token's included).
    #[arg(long, default_value_t = 330)]
    context: usize,
    /// Timed calls of each variant (after three untimed ones).
    #[arg(long, default_value_t = 50)]
    iters: usize,
    /// The variants, by name, comma-separated; `all` for every one.
    #[arg(long, default_value = "all", value_delimiter = ',')]
    attention_kernel: Vec<String>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Runs the benchmark and prints its report: a row a variant, an error in place of the
/// numbers where it does not serve the shape.
pub(super) fn run(args: AttentionArgs) -> anyhow::Result<()> {
    let variants: Vec<AttentionKernel> = match args.attention_kernel.as_slice() {
        [all] if all == "all" => AttentionKernel::VARIANTS.to_vec(),
        names => names.iter().map(|n| n.parse()).collect::<Result<_, _>>()?,
    };
    anyhow::ensure!(
        args.batch > 0 && args.context > 0 && args.iters > 0,
        "--batch, --context and --iters must be at least 1"
    );
    let heads = Heads::of(&args.shape.config()?);
    heads.check()?;
    let batch = DecodeBatch::new(heads, args.batch, args.context, 0);
    let device = args.device.open()?;
    let mut rows = time_each(&device, heads, &batch, &variants, args.iters)?;
    // Each read rate against what the card copies: the share of the floor reached.
    let bandwidth = memory_bandwidth(&device)?;
    for row in &mut rows {
        if let Some(rate) = row["kv_gb_per_s"].as_f64() {
            row["fraction_of_bandwidth"] = json!(rate * 1e9 / bandwidth);
        }
    }
    let report = json!({
        "shape": args.shape.name(),
        "batch": args.batch,
        "context": args.context,
        "dtype": "bf16",
        "kv_mib": batch.kv_bytes(2) as f64 / (1 << 20) as f64,
        "bandwidth_gb_per_s": bandwidth / 1e9,
        "rows": rows,
    });
    if args.json {
        println!("{report}");
        return Ok(());
    }
    println!(
        "{} heads, batch {} x {} keys, bf16 ({:.0} MiB of KV a call)",
        args.shape.name(),
        args.batch,
        args.context,
        batch.kv_bytes(2) as f64 / (1 << 20) as f64
    );
    println!("the card copies at {:.0} GB/s", bandwidth / 1e9);
    for row in report["rows"].as_array().into_iter().flatten() {
        match row.get("error") {
            Some(e) => println!(
                "{:<12} {}",
                row["attention_kernel"].as_str().unwrap_or(""),
                e
            ),
            None => println!(
                "{:<12} {:>9.1} us a call  {:>7.0} GB/s of KV ({:.0}%)  {} split(s)",
                row["attention_kernel"].as_str().unwrap_or(""),
                row["us_per_call"].as_f64().unwrap_or(f64::NAN),
                row["kv_gb_per_s"].as_f64().unwrap_or(f64::NAN),
                100.0 * row["fraction_of_bandwidth"].as_f64().unwrap_or(f64::NAN),
                row["splits"]
            ),
        }
    }
    Ok(())
}

/// Each variant's row, in bf16 on `device`.
#[cfg(feature = "cuda")]
fn time_each(
    device: &candle_core::Device,
    heads: Heads,
    batch: &DecodeBatch,
    variants: &[AttentionKernel],
    iters: usize,
) -> anyhow::Result<Vec<serde_json::Value>> {
    use candle_core::DType;
    use dppo_engine::cuda_attn::bench::time;
    anyhow::ensure!(
        device.is_cuda(),
        "bench attention times the CUDA kernels: --device cuda"
    );
    Ok(variants
        .iter()
        .map(
            |&v| match time(device, (heads, DType::BF16), batch, v, iters) {
                Ok(t) => json!({
                    "attention_kernel": v.to_string(),
                    "us_per_call": t.us_per_call,
                    "kv_gb_per_s": t.kv_gb_per_s,
                    "splits": t.splits,
                }),
                Err(e) => json!({"attention_kernel": v.to_string(), "error": e.to_string()}),
            },
        )
        .collect())
}

#[cfg(not(feature = "cuda"))]
fn time_each(
    _: &candle_core::Device,
    _: Heads,
    _: &DecodeBatch,
    _: &[AttentionKernel],
    _: usize,
) -> anyhow::Result<Vec<serde_json::Value>> {
    anyhow::bail!("bench attention times the CUDA kernels: it needs a build with --features cuda")
}
