//! `dppo run`: supervised warm-up, then RL steps with the configured algorithm, held-out
//! evaluation before and after; `metrics.jsonl`, `config.toml` and `summary.json` in the
//! run directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use dppo_model::weights::write_atomic;
use dppo_model::DeviceSpec;
use dppo_trainer::checkpoint;
use dppo_trainer::config::{ResumeMode, RunConfig};
use dppo_trainer::data::{builtin_task, load_jsonl, Fields};
use dppo_trainer::dist::{Collective, Single, TcpCollective};
use dppo_trainer::report::metrics_log::{MetricsLog, METRICS_JSONL};
use dppo_trainer::step::Trainer;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use super::ranks::{self, Launcher, Role};

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
    #[arg(long, conflicts_with = "devices")]
    device: Option<DeviceSpec>,
    /// Data-parallel ranks, one process per device: cpu,cpu or cuda:0,cuda:1,... (overrides
    /// the config's `devices`). This process becomes rank 0 and starts the others; processes
    /// started with torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT are
    /// those ranks directly.
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<DeviceSpec>>,
    /// Serve the policy being trained over the OpenAI API at this address
    /// (e.g. 127.0.0.1:8000); rollouts keep priority. Ctrl-C stops after the current step.
    /// With several ranks, rank 0 serves from its engine.
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
    if let Some(devices) = &args.devices {
        cfg.devices = devices.clone();
    }
    let timeout = Duration::from_secs(cfg.rank_timeout_s);
    match ranks::role(&cfg)? {
        Role::Single => {
            if let Some(&device) = cfg.devices.first() {
                cfg.device = device;
            }
            train(&args, cfg, resume, Arc::new(Single), 1)
        }
        Role::Member(rdv) => {
            cfg.device = ranks::device_of(&cfg, rdv.local_rank)?;
            let collective = ranks::connect(&rdv, timeout)?;
            train(&args, cfg, resume, collective, rdv.local_world_size)
        }
        Role::Launcher => {
            let world = cfg.devices.len();
            cfg.device = cfg.devices[0];
            let (launcher, listener) = Launcher::start(world, args.serve.is_none())?;
            tracing::info!("started ranks 1..{world}: {:?}", &cfg.devices[1..]);
            let collective: Arc<dyn Collective> =
                match TcpCollective::root(listener, world, timeout) {
                    Ok(tcp) => Arc::new(tcp),
                    Err(e) => return Err(launcher.fail(e.into())),
                };
            // Rank 0 keeps the connections open until it knows why the run failed, so that
            // the other ranks do not fail first for want of it.
            match train(&args, cfg, resume, collective.clone(), world) {
                Ok(()) => {
                    launcher.finish();
                    Ok(())
                }
                Err(e) => Err(launcher.fail(e)),
            }
        }
    }
}

/// One rank's run (the only one's, on one rank): rank 0 writes the run directory, serves,
/// and prints; every rank trains its share.
fn train(
    args: &Args,
    cfg: RunConfig,
    resume: Option<PathBuf>,
    collective: Arc<dyn Collective>,
    local_world: usize,
) -> anyhow::Result<()> {
    let (rank, world) = (collective.rank(), collective.world_size());
    let lead = rank == 0;
    if world > 1 {
        agree(collective.as_ref(), &cfg, resume.as_deref())?;
    }
    let checkpoints = args.out.join("checkpoints");
    // Before anything is written or loaded: a device that cannot open fails the run at once.
    let device = cfg.device.open()?;
    let collective = device_collective(collective, &device)?;
    match &resume {
        _ if !lead => {}
        Some(ckpt) => tracing::info!("resuming from {}", ckpt.display()),
        None if args.resume.is_some() => {
            tracing::info!(
                "no checkpoint in {}: starting from the beginning",
                checkpoints.display()
            )
        }
        None => {}
    }
    let threads = match world {
        1 => cfg.threads,
        // Ranks on one node share its cores, unless told otherwise.
        _ if std::env::var_os("RAYON_NUM_THREADS").is_some() && cfg.threads == 0 => 0,
        _ => ranks::threads_per_rank(cfg.threads, local_world),
    };
    if threads > 0 {
        // Read once, when rayon's and candle's CPU thread pools start: later than this.
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
    if lead {
        std::fs::create_dir_all(&args.out)
            .with_context(|| format!("creating the run directory {}", args.out.display()))?;
        write_atomic(&args.out.join("config.toml"), cfg.to_toml().as_bytes())?;
    }
    let model = match &resume {
        Some(ckpt) => ckpt.join(checkpoint::MODEL_DIR).display().to_string(),
        None => cfg.model.clone(),
    };
    let policy = super::load_policy(&model, args.revision.as_deref(), &device)?;
    let (train, eval) = load_data(&cfg)?;
    let started = Instant::now();
    let mut trainer =
        Trainer::with_collective(cfg.clone(), &policy, &device, train, eval, collective)?;
    let server = match &args.serve {
        Some(addr) if lead => Some(super::serve::start(
            trainer.engine(),
            &policy,
            &model,
            addr,
            &args.serve_args,
        )?),
        _ => None,
    };
    // Ctrl-C with --serve (rank 0's): every rank stops after the same step.
    let interrupted = || server.as_ref().is_some_and(|s| s.interrupted());
    let eval_before = match &resume {
        Some(ckpt) => match trainer.restore(ckpt)?.eval_before {
            Some(acc) => acc,
            None => trainer.evaluate()?,
        },
        None => {
            warm_up(&mut trainer, &cfg, &checkpoints, &interrupted, lead)?;
            trainer.finish_warmup()?;
            trainer.evaluate()?
        }
    };
    tracing::info!(eval_before, "held-out accuracy before RL");

    let resumed_at = resume.as_ref().map(|_| trainer.step);
    let mut metrics = match lead {
        true => Some(MetricsLog::open(&args.out, &cfg.logger, resumed_at)?),
        false => None,
    };
    let pb = bar(
        cfg.steps,
        &format!("{:?}", cfg.algorithm).to_lowercase(),
        lead,
    );
    pb.set_position(trainer.step);
    while trainer.step < cfg.steps {
        if trainer.any_rank(interrupted())? {
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
        if let Some(metrics) = &mut metrics {
            metrics.write(&line)?;
        }
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
    if !lead {
        return Ok(());
    }
    let metrics_path = args.out.join(METRICS_JSONL);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics_path)?
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    write_atomic(
        &args.out.join("metrics.svg"),
        dppo_trainer::report::plot::render(&lines).as_bytes(),
    )?;
    let summary = json!({
        "algorithm": cfg.algorithm,
        "steps": trainer.step,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "wall_s": started.elapsed().as_secs_f64(),
        "policy_version": trainer.policy_version,
        "ranks": world,
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

/// Fails unless every rank runs the same configuration (its device aside) from the same
/// checkpoint: ranks started by hand or by an external launcher with different arguments.
fn agree(
    collective: &dyn Collective,
    cfg: &RunConfig,
    resume: Option<&Path>,
) -> anyhow::Result<()> {
    let mut shared = cfg.clone();
    shared.device = DeviceSpec::Cpu;
    let mine = format!(
        "{}\n# resume: {}",
        shared.to_toml(),
        resume.map_or("none".into(), |p| p.display().to_string())
    );
    let all = collective.all_gather_bytes(mine.as_bytes())?;
    for (rank, theirs) in all.iter().enumerate().skip(1) {
        if *theirs != all[0] {
            let theirs = String::from_utf8_lossy(theirs);
            let first = String::from_utf8_lossy(&all[0]);
            let differs = first
                .lines()
                .zip(theirs.lines())
                .find(|(a, b)| a != b)
                .map_or("(one is longer)".to_string(), |(a, b)| {
                    format!("rank 0 has `{a}`, rank {rank} `{b}`")
                });
            anyhow::bail!(
                "rank {rank} runs another configuration than rank 0: {differs}; start every \
                 rank with the same arguments"
            );
        }
    }
    Ok(())
}

/// The collective the ranks' tensors travel by: NCCL between GPUs in a build with the
/// `nccl` feature, else `host` (through host memory).
fn device_collective(
    host: Arc<dyn Collective>,
    device: &candle_core::Device,
) -> anyhow::Result<Arc<dyn Collective>> {
    if host.world_size() == 1 || !device.is_cuda() {
        return Ok(host);
    }
    #[cfg(feature = "nccl")]
    {
        let nccl = dppo_trainer::dist::NcclCollective::new(host, device)?;
        Ok(Arc::new(nccl))
    }
    #[cfg(not(feature = "nccl"))]
    {
        tracing::warn!(
            "GPU ranks without the `nccl` feature: gradients are all-reduced through host \
             memory over TCP (build with --features nccl)"
        );
        Ok(host)
    }
}

fn bar(len: u64, what: &str, visible: bool) -> ProgressBar {
    if !visible {
        return ProgressBar::hidden();
    }
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
    lead: bool,
) -> anyhow::Result<()> {
    let warm = bar(cfg.warmup.steps, "warm-up", lead);
    for _ in 0..cfg.warmup.steps {
        if trainer.any_rank(interrupted())? {
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
