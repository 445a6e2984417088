//! `dppo run`: resolves where the run starts and this process's rank, serves the policy
//! being trained with `--serve`, runs [`dppo_trainer::run::Run`] with progress bars, and
//! prints the accuracy table.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dppo_model::DeviceSpec;
use dppo_server::ServerHandle;
use dppo_trainer::dist::{Collective, Single, TcpCollective};
use dppo_trainer::run::{Resume, Run, RunHooks, Start};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{Map, Value};

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
    let resume = match &args.resume {
        Some(latest) if latest.as_os_str() == "latest" => Resume::Latest,
        Some(ckpt) => Resume::From(ckpt.clone()),
        None => Resume::ByConfig,
    };
    let mut start = resume.resolve(&args.out, args.given.config.as_deref(), &args.given.sets)?;
    let cfg = &mut start.cfg;
    if let Some(device) = args.device {
        cfg.device = device;
    }
    if let Some(devices) = &args.devices {
        cfg.devices = devices.clone();
    }
    let timeout = Duration::from_secs(cfg.rank_timeout_s);
    match ranks::role(cfg)? {
        Role::Single => {
            if let Some(&device) = cfg.devices.first() {
                cfg.device = device;
            }
            train(&args, start, Arc::new(Single), 1)
        }
        Role::Member(rdv) => {
            cfg.device = ranks::device_of(cfg, rdv.local_rank)?;
            let collective = ranks::connect(&rdv, timeout)?;
            train(&args, start, collective, rdv.local_world_size)
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
            match train(&args, start, collective.clone(), world) {
                Ok(()) => {
                    launcher.finish();
                    Ok(())
                }
                Err(e) => Err(launcher.fail(e)),
            }
        }
    }
}

/// One rank's run (the only one's, on one rank): rank 0 serves and prints; every rank
/// trains its share.
fn train(
    args: &Args,
    start: Start,
    collective: Arc<dyn Collective>,
    local_world: usize,
) -> anyhow::Result<()> {
    set_threads(start.cfg.threads, collective.world_size(), local_world);
    let mut run = Run::new(start, &args.out, args.revision.as_deref(), collective)?;
    let lead = run.is_lead();
    let server = match &args.serve {
        Some(addr) if lead => Some(super::serve::start(
            run.engine(),
            run.policy(),
            run.model(),
            addr,
            &args.serve_args,
        )?),
        _ => None,
    };
    let algorithm = format!("{:?}", run.config().algorithm).to_lowercase();
    let mut progress = Progress {
        lead,
        algorithm,
        server: server.as_ref(),
        warm_up: ProgressBar::hidden(),
        rl: ProgressBar::hidden(),
        lines: lead && !std::io::stderr().is_terminal(),
    };
    let summary = run.run_to_end(&mut progress)?;
    if !lead {
        return Ok(());
    }
    let measure = run.config().reward.held_out_measure();
    println!("\n| {measure} | before RL | after RL |\n|---|---|---|");
    println!(
        "| {} | {:.1}% | {:.1}% |",
        run.config().model,
        100.0 * summary.eval_before,
        100.0 * summary.eval_after
    );
    println!("run directory: {}", args.out.display());
    if let Some(server) = server {
        server.shutdown()?;
    }
    Ok(())
}

/// Sets this process's CPU threads for tensor work: the config's `threads`, and with
/// several ranks the node's cores shared among its `local_world` ranks unless
/// `RAYON_NUM_THREADS` says otherwise.
fn set_threads(configured: usize, world: usize, local_world: usize) {
    let threads = match world {
        1 => configured,
        _ if std::env::var_os("RAYON_NUM_THREADS").is_some() && configured == 0 => 0,
        _ => ranks::threads_per_rank(configured, local_world),
    };
    if threads > 0 {
        // Read once, when rayon's and candle's CPU thread pools start: later than this.
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
}

/// Rank 0's progress bars (hidden on the other ranks), and Ctrl-C of a serving run.
struct Progress<'a> {
    lead: bool,
    /// The RL bar's label: the algorithm.
    algorithm: String,
    server: Option<&'a ServerHandle>,
    warm_up: ProgressBar,
    rl: ProgressBar,
    /// Log progress lines, where the bars do not show (stderr is not a terminal): about
    /// every tenth of the warm-up and every twentieth of RL.
    lines: bool,
}

impl Progress<'_> {
    /// `bar`'s position and length where lines are logged and `bar`, just advanced, reached
    /// a `1/parts` mark of its length (or its end).
    fn mark(&self, bar: &ProgressBar, parts: u64) -> Option<(u64, u64)> {
        let (pos, len) = (bar.position(), bar.length().unwrap_or(0));
        (self.lines && (pos == len || pos % (len / parts).max(1) == 0)).then_some((pos, len))
    }
}

impl RunHooks for Progress<'_> {
    /// Ctrl-C with --serve (rank 0's): every rank stops after the same step.
    fn interrupted(&self) -> bool {
        self.server.is_some_and(|s| s.interrupted())
    }

    fn on_warmup_start(&mut self, steps: u64) {
        self.warm_up = bar(steps, "warm-up", self.lead);
    }

    fn on_warmup_step(&mut self, nll: f64) {
        self.warm_up.set_message(format!("nll {nll:.3}"));
        self.warm_up.inc(1);
        if let Some((pos, len)) = self.mark(&self.warm_up, 10) {
            tracing::info!("warm-up {pos}/{len}: nll {nll:.3}");
        }
    }

    fn on_warmup_end(&mut self) {
        self.warm_up.finish();
    }

    fn on_rl_start(&mut self, steps: u64, done: u64) {
        self.rl = bar(steps, &self.algorithm, self.lead);
        self.rl.set_position(done);
    }

    fn on_step(&mut self, _step: u64, line: &Map<String, Value>) {
        let get = |k: &str| line.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
        let message = format!(
            "reward {:.2} kept {:.2}/{:.2} step {:.1}s",
            get("reward/mean"),
            get("prune/prompts_kept"),
            get("prune/completions_kept"),
            get("timing_s/step")
        );
        self.rl.inc(1);
        if let Some((pos, len)) = self.mark(&self.rl, 20) {
            tracing::info!("{} step {pos}/{len}: {message}", self.algorithm);
        }
        self.rl.set_message(message);
    }

    fn on_interrupted(&mut self, step: u64) {
        self.rl
            .println(format!("Ctrl-C: stopping after step {step}"));
    }

    fn on_rl_end(&mut self) {
        self.rl.finish();
    }
}

/// A bar of `len` steps, drawn on stderr where it is a terminal and `visible`; its position
/// is kept either way.
fn bar(len: u64, what: &str, visible: bool) -> ProgressBar {
    if !visible {
        return ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::hidden());
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(&format!("{what} {{bar:30}} {{pos}}/{{len}} {{msg}}"))
            .expect("valid template"),
    );
    pb
}
