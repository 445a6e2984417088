//! `dppo score`: re-scores the samples that `dppo eval --samples` wrote, with the verifier
//! (`--extract`) or a run config's reward (`--config`, `--set`), so that a change to the
//! reward can be audited offline against the rewards saved with them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use dppo_model::weights::write_atomic;
use dppo_rewards::{parse_gold, rule_name, Answer, ExtractMode};
use dppo_trainer::data::default_extract_mode;
use dppo_trainer::reward::RewardItem;
use serde_json::{json, Value};

use super::reward_args::RewardArgs;

/// Arguments of `dppo score`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A samples file written by `dppo eval --samples`.
    #[arg(long)]
    data: PathBuf,
    #[command(flatten)]
    reward: RewardArgs,
    /// Also print each sample whose new reward differs from its saved one, one JSON line
    /// each, before the summary.
    #[arg(long)]
    show_disagreements: bool,
    /// Also write the samples file again with the new `reward` and `extracted_by` (the
    /// input to `benches/audit_math_verify.py` for a mode other than the saved one).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One saved sample.
struct Saved {
    text: String,
    reward: f64,
    is_truncated: bool,
    num_tokens: usize,
}

/// One problem of a samples file: its line, ground truth (parsed for the verifier), data
/// source, question and samples, and the line as read.
struct Row {
    line: usize,
    gold: Option<Answer>,
    label: Value,
    data_source: String,
    question: String,
    samples: Vec<Saved>,
    json: Value,
}

/// Re-scores every sample and prints one JSON summary (agreement with the saved rewards,
/// accuracy and mean reward before and after, which rules extracted the answers).
pub fn run(args: Args) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.data)
        .with_context(|| format!("reading --data {}", args.data.display()))?;
    let (_, spec, scorer) = args.reward.scorer(saved_extract_mode(&text))?;
    let mut rows = read_samples(&args.data, &text, !scorer.is_external())?;
    let (mut total, mut agree, mut correct, mut saved_correct) = (0usize, 0usize, 0usize, 0usize);
    let (mut sum, mut saved_sum) = (0.0, 0.0);
    let mut extracted_by = BTreeMap::<&str, usize>::new();
    for row in &mut rows {
        let items: Vec<RewardItem> = row
            .samples
            .iter()
            .map(|s| RewardItem {
                prompt: row.question.clone(),
                completion: s.text.clone(),
                label: row.label.clone(),
                data_source: row.data_source.clone(),
                extra_info: Value::Null,
                num_tokens: s.num_tokens,
                is_truncated: s.is_truncated,
            })
            .collect();
        let what = format!("{}:{}", args.data.display(), row.line);
        let scored = scorer.score(&items, row.gold.as_ref(), &what, false)?;
        for (index, sample) in row.samples.iter().enumerate() {
            let (reward, rule) = (scored.rewards[index], scored.extracted_by[index]);
            let rescored = &mut row.json["samples"][index];
            rescored["reward"] = json!(reward);
            rescored["extracted_by"] = json!(rule_name(rule));
            total += 1;
            correct += usize::from(reward >= 1.0);
            saved_correct += usize::from(sample.reward >= 1.0);
            (sum, saved_sum) = (sum + reward, saved_sum + sample.reward);
            *extracted_by.entry(rule_name(rule)).or_default() += 1;
            if (reward - sample.reward).abs() <= 1e-9 {
                agree += 1;
            } else if args.show_disagreements {
                let line = json!({
                    "line": row.line,
                    "sample": index,
                    "answer": row.label,
                    "saved_reward": sample.reward,
                    "reward": reward,
                    "correct": reward >= 1.0,
                    "extracted_by": rule_name(rule),
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
        "extract": spec.mode.to_string(),
        "problems": rows.len(),
        "samples": total,
        "agreement": frac(agree),
        "disagreements": total - agree,
        "accuracy": frac(correct),
        "saved_accuracy": frac(saved_correct),
        "mean_reward": sum / total.max(1) as f64,
        "saved_mean_reward": saved_sum / total.max(1) as f64,
        "extracted_by": extracted_by,
    });
    println!("{summary}");
    Ok(())
}

/// The extraction mode for a samples file (its `text`) when neither `--extract` nor a
/// config's `reward.extract` gives one: that of the data set its rows name (`data_source`,
/// which `dppo eval` writes), as `dppo eval` chose it; strict where no row names one.
fn saved_extract_mode(text: &str) -> ExtractMode {
    text.lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find_map(|row| row["data_source"].as_str().map(default_extract_mode))
        .unwrap_or(ExtractMode::Strict)
}

/// Parses the samples file at `path` (its `text`); every line must carry an `answer` (a
/// parseable one when `verify`) and samples with `text`, `reward` and `truncated`.
fn read_samples(path: &Path, text: &str, verify: bool) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        let at = format!("{}:{}", path.display(), i + 1);
        let row: Value = serde_json::from_str(raw).with_context(|| format!("{at}: not JSON"))?;
        let gold = match (row["answer"].as_str(), verify) {
            (Some(answer), true) => Some(parse_gold(answer).with_context(|| at.clone())?),
            (None, true) => {
                bail!("{at}: no string field \"answer\" (is this a `dppo eval --samples` file?)")
            }
            (answer, false) => answer.and_then(|a| parse_gold(a).ok()),
        };
        if row.get("answer").is_none() {
            bail!("{at}: no field \"answer\" (is this a `dppo eval --samples` file?)");
        }
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
                    num_tokens: s["num_tokens"].as_u64().unwrap_or(0) as usize,
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        rows.push(Row {
            line: i + 1,
            gold,
            label: row.get("label").unwrap_or(&row["answer"]).clone(),
            data_source: row["data_source"].as_str().unwrap_or_default().to_string(),
            question: row["question"].as_str().unwrap_or_default().to_string(),
            samples,
            json: row,
        });
    }
    Ok(rows)
}
