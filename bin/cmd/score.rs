//! `dppo score`: re-scores the samples that `dppo eval --samples` wrote, so that a change
//! to the verifier can be audited offline against the rewards saved with them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use dppo_model::weights::write_atomic;
use dppo_rewards::{parse_gold, rule_name, verify, Answer, ExtractMode};
use serde_json::{json, Value};

/// Arguments of `dppo score`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A samples file written by `dppo eval --samples`.
    #[arg(long)]
    data: PathBuf,
    /// How final answers are extracted: boxed, strict, flexible or answer.
    #[arg(long, default_value = "strict")]
    extract: ExtractMode,
    /// Also print each sample whose verdict differs from its saved reward, one JSON line
    /// each, before the summary.
    #[arg(long)]
    show_disagreements: bool,
    /// Also write the samples file again with this verifier's `reward` and `extracted_by`
    /// (the input to `benches/audit_math_verify.py` for a mode other than the saved one).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One saved sample.
struct Saved {
    text: String,
    reward: f64,
    is_truncated: bool,
}

/// One problem of a samples file: its line, gold answer and samples, and the line as read.
struct Row {
    line: usize,
    gold: Answer,
    samples: Vec<Saved>,
    json: Value,
}

/// Re-scores every sample and prints one JSON summary (agreement with the saved rewards,
/// accuracy before and after, which rules extracted the answers).
pub fn run(args: Args) -> anyhow::Result<()> {
    let mut rows = read_samples(&args.data)?;
    let (mut total, mut agree, mut correct, mut saved_correct) = (0usize, 0usize, 0usize, 0usize);
    let mut extracted_by = BTreeMap::<&str, usize>::new();
    for row in &mut rows {
        for (index, sample) in row.samples.iter().enumerate() {
            let verdict = verify(&sample.text, sample.is_truncated, &row.gold, args.extract);
            let rescored = &mut row.json["samples"][index];
            rescored["reward"] = json!(f64::from(u8::from(verdict.is_correct)));
            rescored["extracted_by"] = json!(rule_name(verdict.extracted_by));
            let was_correct = sample.reward >= 1.0;
            total += 1;
            correct += usize::from(verdict.is_correct);
            saved_correct += usize::from(was_correct);
            *extracted_by
                .entry(rule_name(verdict.extracted_by))
                .or_default() += 1;
            if verdict.is_correct == was_correct {
                agree += 1;
            } else if args.show_disagreements {
                let line = json!({
                    "line": row.line,
                    "sample": index,
                    "answer": row.gold.to_string(),
                    "saved_reward": sample.reward,
                    "correct": verdict.is_correct,
                    "extracted_by": rule_name(verdict.extracted_by),
                });
                println!("{line}");
            }
        }
    }
    if let Some(out) = &args.out {
        let text: String = rows.iter().map(|r| format!("{}\n", r.json)).collect();
        write_atomic(out, text.as_bytes())
            .with_context(|| format!("writing --out {}", out.display()))?;
    }
    let frac = |k: usize| k as f64 / total.max(1) as f64;
    let summary = json!({
        "data": args.data.display().to_string(),
        "extract": args.extract.to_string(),
        "problems": rows.len(),
        "samples": total,
        "agreement": frac(agree),
        "disagreements": total - agree,
        "accuracy": frac(correct),
        "saved_accuracy": frac(saved_correct),
        "extracted_by": extracted_by,
    });
    println!("{summary}");
    Ok(())
}

/// Reads a samples file; every line must carry a parseable `answer` and samples with
/// `text`, `reward` and `truncated`.
fn read_samples(path: &Path) -> anyhow::Result<Vec<Row>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --data {}", path.display()))?;
    let mut rows = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        let at = format!("{}:{}", path.display(), i + 1);
        let row: Value = serde_json::from_str(raw).with_context(|| format!("{at}: not JSON"))?;
        let Some(answer) = row["answer"].as_str() else {
            bail!("{at}: no string field \"answer\" (is this a `dppo eval --samples` file?)");
        };
        let gold = parse_gold(answer).with_context(|| at.clone())?;
        let Some(samples) = row["samples"].as_array() else {
            bail!("{at}: no array field \"samples\"");
        };
        let samples = samples
            .iter()
            .enumerate()
            .map(|(j, s)| {
                let (Some(text), Some(reward)) = (s["text"].as_str(), s["reward"].as_f64()) else {
                    bail!("{at}: sample {j} lacks \"text\" or \"reward\"");
                };
                let Some(is_truncated) = s["truncated"].as_bool() else {
                    bail!(
                        "{at}: sample {j} lacks \"truncated\" (written before dppo eval \
                         recorded it: re-run dppo eval --samples)"
                    );
                };
                Ok(Saved {
                    text: text.to_string(),
                    reward,
                    is_truncated,
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        rows.push(Row {
            line: i + 1,
            gold,
            samples,
            json: row,
        });
    }
    Ok(rows)
}
