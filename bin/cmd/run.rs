//! `dppo run`: supervised warm-up, then RL steps with the configured algorithm, held-out
//! evaluation before and after; `metrics.jsonl`, `config.toml` and `summary.json` in the
//! run directory.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use dppo_model::weights::write_atomic;
use dppo_model::DeviceSpec;
use dppo_trainer::checkpoint;
use dppo_trainer::config::{ResumeMode, RunConfig};
use dppo_trainer::data::{builtin_task, load_jsonl, Fields};
use dppo_trainer::metrics_log::{MetricsLog, METRICS_JSONL};
use dppo_trainer::step::Trainer;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

/// Arguments of `dppo run`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    given: super::config::ConfigArgs,
    /// Run directory.
    #[arg(long, default_value = "runs/default")]
    out: PathBuf,
    /// Continue from a checkpoint (`<run>/checkpoints/step-NNNNNN`), or `latest`: the
    /// newest complete one under `--out` (starting from the beginning when there is none,
    /// so that the same command starts and resumes a run). The checkpoint's config is used,
    /// with `--set` overrides (e.g. more `steps`).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Hub revision (branch, tag or commit) of the config's `model` when it is a Hugging
    /// Face id; default main.
    #[arg(long)]
    revision: Option<String>,
    /// Where the engine and the learner run: cpu, cuda or cuda:N (overrides the config's
    /// `device`; cuda needs a build with `--features cuda`).
    #[arg(long)]
    device: Option<DeviceSpec>,
    /// Serve the policy being trained over the OpenAI API at this address
    /// (e.g. 127.0.0.1:8000); rollouts keep priority. Ctrl-C stops after the current step.
    #[arg(long)]
    serve: Option<String>,
    #[command(flatten)]
    serve_args: super::serve::ServeArgs,
}

/// Trains and writes the run directory.
pub fn run(args: Args) -> anyhow::Result<()> {
    let checkpoints = args.out.join("checkpoints");
    let (mut cfg, resume) = match &args.resume {
        Some(latest) if latest.as_os_str() == "latest" => match checkpoint::latest(&checkpoints) {
            Some(ckpt) => (
                read_config(&ckpt.join(checkpoint::CONFIG), &args.given.sets)?,
                Some(ckpt),
            ),
            None => (args.given.load()?, None),
        },
        Some(ckpt) => {
            checkpoint::verify(ckpt)?;
            (
                read_config(&ckpt.join(checkpoint::CONFIG), &args.given.sets)?,
                Some(ckpt.clone()),
            )
        }
        None => {
            let cfg = args.given.load()?;
            let ckpt = match cfg.resume {
                ResumeMode::Auto => checkpoint::latest(&checkpoints),
                ResumeMode::Disable => None,
            };
            (cfg, ckpt)
        }
    };
    if let Some(device) = args.device {
        cfg.device = device;
    }
    // Before anything is written or loaded: a device that cannot open fails the run at once.
    let device = cfg.device.open()?;
    match &resume {
        Some(ckpt) => tracing::info!("resuming from {}", ckpt.display()),
        None if args.resume.is_some() => {
            tracing::info!(
                "no checkpoint in {}: starting from the beginning",
                checkpoints.display()
            )
        }
        None => {}
    }
    if cfg.threads > 0 {
        // Read once, when rayon's and candle's CPU thread pools start: later than this.
        std::env::set_var("RAYON_NUM_THREADS", cfg.threads.to_string());
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating the run directory {}", args.out.display()))?;
    write_atomic(&args.out.join("config.toml"), cfg.to_toml().as_bytes())?;
    let model = match &resume {
        Some(ckpt) => ckpt.join(checkpoint::MODEL_DIR).display().to_string(),
        None => cfg.model.clone(),
    };
    let policy = super::load_policy(&model, args.revision.as_deref(), &device)?;
    let (train, eval) = load_data(&cfg)?;
    let started = Instant::now();
    let mut trainer = Trainer::new(cfg.clone(), &policy, &device, train, eval)?;
    let server = match &args.serve {
        Some(addr) => Some(super::serve::start(
            trainer.engine(),
            &policy,
            &model,
            addr,
            &args.serve_args,
        )?),
        None => None,
    };
    let eval_before = match &resume {
        Some(ckpt) => match trainer.restore(ckpt)?.eval_before {
            Some(acc) => acc,
            None => trainer.evaluate()?,
        },
        None => {
            let interrupted = || server.as_ref().is_some_and(|s| s.interrupted());
            warm_up(&mut trainer, &cfg, &checkpoints, &interrupted)?;
            trainer.finish_warmup()?;
            trainer.evaluate()?
        }
    };
    tracing::info!(eval_before, "held-out accuracy before RL");

    let resumed_at = resume.as_ref().map(|_| trainer.step);
    let mut metrics = MetricsLog::open(&args.out, &cfg.logger, resumed_at)?;
    let pb = bar(cfg.steps, &format!("{:?}", cfg.algorithm).to_lowercase());
    pb.set_position(trainer.step);
    while trainer.step < cfg.steps {
        if server.as_ref().is_some_and(|s| s.interrupted()) {
            pb.println(format!("Ctrl-C: stopping after step {}", trainer.step));
            trainer
                .save_checkpoint(&checkpoints, cfg.checkpoint.keep, Some(eval_before))
                .with_context(|| format!("checkpointing step {}", trainer.step))?;
            break;
        }
        let mut line = trainer.step()?;
        if cfg.eval.due(trainer.step) {
            line.insert("eval/acc".into(), json!(trainer.evaluate()?));
        }
        metrics.write(&line)?;
        if let Some(e) = trainer.nonfinite_limit() {
            stop_nonfinite(&mut trainer, &checkpoints, &cfg, Some(eval_before), e)?;
        }
        let get = |k: &str| line.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
        pb.set_message(format!(
            "reward {:.2} kept {:.2}/{:.2} step {:.1}s",
            get("reward/mean"),
            get("prune/prompts_kept"),
            get("prune/completions_kept"),
            get("timing_s/step")
        ));
        pb.inc(1);
        let every = cfg.checkpoint.every;
        if (every > 0 && trainer.step % every == 0) || trainer.step == cfg.steps {
            trainer
                .save_checkpoint(&checkpoints, cfg.checkpoint.keep, Some(eval_before))
                .with_context(|| format!("checkpointing step {}", trainer.step))?;
        }
    }
    pb.finish();
    let eval_after = trainer.evaluate()?;
    let metrics_path = args.out.join(METRICS_JSONL);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics_path)?
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    write_atomic(
        &args.out.join("metrics.svg"),
        dppo_trainer::plot::render(&lines).as_bytes(),
    )?;
    let summary = json!({
        "algorithm": cfg.algorithm,
        "steps": trainer.step,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "wall_s": started.elapsed().as_secs_f64(),
        "policy_version": trainer.policy_version,
    });
    write_atomic(
        &args.out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?.as_bytes(),
    )?;
    println!("\n| held-out accuracy | before RL | after RL |\n|---|---|---|");
    println!(
        "| {} | {:.1}% | {:.1}% |",
        cfg.model,
        100.0 * eval_before,
        100.0 * eval_after
    );
    println!("run directory: {}", args.out.display());
    if let Some(server) = server {
        server.shutdown()?;
    }
    Ok(())
}

/// Reads a TOML config file and applies `sets`, naming the file in every error.
pub(crate) fn read_config(path: &std::path::Path, sets: &[String]) -> anyhow::Result<RunConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading config {}", path.display()))?;
    Ok(RunConfig::from_toml(
        &text,
        &path.display().to_string(),
        sets,
    )?)
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(&format!("{what} {{bar:30}} {{pos}}/{{len}} {{msg}}"))
            .expect("valid template"),
    );
    pb
}

/// Supervised warm-up on demonstrations (cut short by `interrupted`).
fn warm_up(
    trainer: &mut Trainer,
    cfg: &RunConfig,
    checkpoints: &Path,
    interrupted: &dyn Fn() -> bool,
) -> anyhow::Result<()> {
    let warm = bar(cfg.warmup.steps, "warm-up");
    for _ in 0..cfg.warmup.steps {
        if interrupted() {
            break;
        }
        let loss = trainer.warmup_step()?;
        if let Some(e) = trainer.nonfinite_limit() {
            stop_nonfinite(trainer, checkpoints, cfg, None, e)?;
        }
        warm.set_message(format!("nll {loss:.3}"));
        warm.inc(1);
    }
    warm.finish();
    Ok(())
}

/// Ends the run after too many non-finite steps in a row: checkpoints the last good
/// weights and optimizer (untouched by the skipped steps), then fails with `error`.
fn stop_nonfinite(
    trainer: &mut Trainer,
    checkpoints: &Path,
    cfg: &RunConfig,
    eval_before: Option<f64>,
    error: dppo_trainer::TrainError,
) -> anyhow::Result<()> {
    let dir = trainer.save_checkpoint(checkpoints, cfg.checkpoint.keep, eval_before)?;
    Err(error).with_context(|| {
        format!(
            "stopping: the last good state is checkpointed in {}",
            dir.display()
        )
    })
}

fn load_data(
    cfg: &RunConfig,
) -> anyhow::Result<(
    Vec<dppo_trainer::data::Problem>,
    Vec<dppo_trainer::data::Problem>,
)> {
    if let Some(task) = cfg.data.train.strip_prefix("builtin:") {
        return Ok(builtin_task(
            task,
            cfg.data.num_train,
            cfg.data.num_eval,
            cfg.seed,
        )?);
    }
    let fields = Fields {
        question: cfg.data.question_field.clone(),
        answer: cfg.data.answer_field.clone(),
    };
    let train = load_jsonl(std::path::Path::new(&cfg.data.train), &fields)?;
    let eval_path = cfg
        .data
        .eval
        .as_ref()
        .context("data.eval: a held-out JSONL file is required with a JSONL train set")?;
    let mut eval = load_jsonl(std::path::Path::new(eval_path), &fields)?;
    eval.truncate(cfg.data.num_eval);
    Ok((train, eval))
}
