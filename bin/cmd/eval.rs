//! `dppo eval`: a model's score on a held-out set: avg@n and unbiased pass@k, greedy or
//! sampled, through the paged engine, scored by the verifier or by a run config's reward.

use anyhow::Context;
use dppo_engine::{Engine, EngineConfig, SamplingParams};
use dppo_model::weights::write_atomic;
use dppo_rewards::rule_name;
use dppo_trainer::config::RunConfig;
use dppo_trainer::data::{default_extract_mode, held_out, Fields, Problem};
use dppo_trainer::eval::{evaluate, EvalSet, EvalSpec, Graded};
use serde_json::json;

use super::load_args::LoadArgs;
use super::reward_args::RewardArgs;
use std::path::{Path, PathBuf};

/// Arguments of `dppo eval`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// `builtin:tiny`, `random:SHAPE[@seed=N]`, an HF directory (a checkpoint's `model/`), a
    /// `.gguf` file, or a Hugging Face id (`Org/Name`) in the local hub cache.
    #[arg(long)]
    model: String,
    #[command(flatten)]
    load: LoadArgs,
    /// A JSONL file, or `builtin:arithmetic`: the held-out split of a run with this `--seed`
    /// (the built-in default's 1000 problems; a run with `data.num_eval = n` used the first n).
    #[arg(long)]
    data: String,
    #[arg(long, default_value = "question")]
    question_field: String,
    #[arg(long, default_value = "answer")]
    answer_field: String,
    /// Samples per problem (avg@n).
    #[arg(long, default_value_t = 1)]
    n: usize,
    /// pass@k (at most n).
    #[arg(long, default_value_t = 1)]
    k: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Evaluate only the first N problems.
    #[arg(long)]
    limit: Option<usize>,
    /// Seed of a built-in task (must match the run's `seed` for its held-out split).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write every problem's samples, decoded and scored, to this JSONL file.
    #[arg(long)]
    samples: Option<PathBuf>,
    #[command(flatten)]
    reward: RewardArgs,
}

/// Evaluates and prints one JSON object.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (device, policy) = args.load.load(&args.model)?;
    let (cfg, reward_spec, scorer) = args.reward.scorer(default_extract_mode(&args.data))?;
    let fields = Fields {
        question: args.question_field.clone(),
        answer: args.answer_field.clone(),
        verify: !scorer.is_external(),
    };
    // A built-in task's held-out split is as large as the built-in default's.
    let num_eval = RunConfig::default_with(&[])?.data.num_eval;
    let mut problems = held_out(&args.data, &fields, num_eval, args.seed)?;
    if let Some(limit) = args.limit {
        problems.truncate(limit);
    }
    if let Some(system) = &cfg.data.system_prompt {
        problems
            .iter_mut()
            .for_each(|p| p.add_system_prompt(system));
    }
    anyhow::ensure!(
        args.n >= 1 && args.k >= 1 && args.k <= args.n,
        "need 1 <= --k <= --n"
    );
    let engine = Engine::new(&policy, EngineConfig::default(), device)?;
    let spec = EvalSpec {
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            seed: Some(args.seed),
            ..SamplingParams::default()
        },
        n: args.n,
        k: args.k,
        max_tokens: args.max_tokens,
    };
    let set = EvalSet::new(&policy.tokenizer, problems, cfg.data.max_prompt_length)?;
    let (r, samples) = evaluate(&engine, &policy.tokenizer, &set, &spec, &scorer)?;
    if let Some(path) = &args.samples {
        write_samples(path, set.problems(), &samples)
            .with_context(|| format!("writing --samples {}", path.display()))?;
    }
    let mut extracted_by = std::collections::BTreeMap::<&str, usize>::new();
    for g in samples.iter().flatten() {
        *extracted_by.entry(rule_name(g.extracted_by)).or_default() += 1;
    }
    let report = json!({
        "model": args.model,
        "data": args.data,
        "reward": match (&cfg.reward.url, &cfg.reward.command) {
            (Some(url), _) => url.clone(),
            (None, Some(argv)) => argv.join(" "),
            (None, None) => "verifier".into(),
        },
        "extract": reward_spec.mode.to_string(),
        "problems": set.problems().len(),
        "extracted_by": extracted_by,
        format!("avg@{}", r.n): r.avg,
        format!("pass@{}", r.k): r.pass_at_k,
    });
    println!("{report}");
    Ok(())
}

/// One JSON line per problem: its question, gold answer and scored samples (atomic write).
fn write_samples(path: &Path, problems: &[Problem], samples: &[Vec<Graded>]) -> anyhow::Result<()> {
    let mut out = String::new();
    for (p, graded) in problems.iter().zip(samples) {
        let line = json!({
            "prompt_id": p.prompt_id,
            "question": p.question,
            "data_source": p.data_source,
            // The parsed gold answer the verifier checks (`dppo score` reads it), else the
            // label as the data holds it.
            "answer": p.answer.as_ref().map_or_else(|| p.label.clone(), |a| json!(a.to_string())),
            // As the data holds it: what an external reward is sent.
            "label": p.label,
            "samples": graded
                .iter()
                .map(|g| {
                    json!({
                        "text": g.text,
                        "reward": g.reward,
                        "extracted_by": rule_name(g.extracted_by),
                        "truncated": g.is_truncated,
                        "num_tokens": g.num_tokens,
                    })
                })
                .collect::<Vec<_>>(),
        });
        out.push_str(&line.to_string());
        out.push('\n');
    }
    write_atomic(path, out.as_bytes())?;
    Ok(())
}
