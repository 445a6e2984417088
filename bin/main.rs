//! `dppo`: the command. Parses arguments, runs one subcommand, prints any error chain once.

mod cmd;

use clap::{Parser, Subcommand};

/// DPPO reinforcement-learning trainer for LLM reasoning.
#[derive(Debug, Parser)]
#[command(name = "dppo", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train a policy with DPPO (or a baseline) on the built-in default or a config.
    Run(cmd::run::Args),
    /// Print the configuration a run would use, every key documented.
    Config(cmd::config::Args),
    /// Compare run directories: time-to-accuracy table (markdown) and an overlay SVG.
    Compare(cmd::compare::Args),
    /// Evaluate a model on a held-out set (avg@n, pass@k).
    Eval(cmd::eval::Args),
    /// Re-score the samples of `dppo eval --samples` with this verifier (offline audit).
    Score(cmd::score::Args),
    /// Complete a prompt with the paged engine.
    Generate(cmd::generate::Args),
    /// Serve a model over the OpenAI API (completions, chat, streaming).
    Serve(cmd::serve::Args),
    /// How a model and config divide a GPU's memory (weights, optimizer, activations, KV
    /// cache), or why they do not fit; needs no GPU.
    #[command(alias = "plan")]
    Memory(cmd::memory::Args),
    /// Benchmarks: rollout and learner throughput, and a load test of the server.
    #[command(subcommand)]
    Bench(cmd::bench::Bench),
    /// Load a model (builtin preset, HF directory or GGUF) and save it as an HF directory.
    Convert(cmd::convert::Args),
    /// Check this build on this machine: features, CUDA libraries and driver, and the device
    /// against the CPU on a small random model; one verdict line, exit 1 on any failure.
    Doctor(cmd::doctor::Args),
}

/// Keeps freed memory in the process for reuse. A learner step frees and reallocates
/// activations and gradients of hundreds of MB; by default glibc hands large blocks back to
/// the OS (mmap/munmap, heap trimming) and every reuse then faults in freshly zeroed pages,
/// which on SmolLM2-135M cost more time than the arithmetic (`dppo bench train`). One arena
/// for every thread: the learner's backward thread would otherwise get an arena of its own,
/// whose 64 MB heaps glibc creates and unmaps as the activations come and go (on 2 cores,
/// +10% learner tokens/s, docs/results.md).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory() {
    // SAFETY: mallopt only changes allocator thresholds; called before any other thread.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// candle runs its elementwise ops on a pool whose idle workers spin for about a millisecond
/// before they sleep, while dppo's projections and fused ops run on rayon's pool: on a small
/// machine a spinning candle worker takes a core from them after every candle op. Unless
/// `CANDLE_BARRIER_POOL_SPIN_LIMIT` is set, idle candle workers sleep at once (on 2 cores:
/// about +17% learner and +10% rollout tokens/s, docs/results.md).
fn sleep_idle_candle_workers() {
    const VAR: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";
    if std::env::var_os(VAR).is_none() {
        // Called first thing in `main`, before any thread exists.
        std::env::set_var(VAR, "0");
    }
}

fn main() {
    sleep_idle_candle_workers();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    keep_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // A bad DPPO_CPU_KERNEL fails every command at once rather than at its first projection.
    if let Err(err) = dppo_model::cpu_kernel() {
        eprintln!("error: {err}");
        std::process::exit(2);
    }
    let result = match cli.command {
        Command::Run(args) => cmd::run::run(args),
        Command::Config(args) => cmd::config::run(args),
        Command::Compare(args) => cmd::compare::run(args),
        Command::Eval(args) => cmd::eval::run(args),
        Command::Score(args) => cmd::score::run(args),
        Command::Generate(args) => cmd::generate::run(args),
        Command::Serve(args) => cmd::serve::run(args),
        Command::Memory(args) => cmd::memory::run(args),
        Command::Bench(bench) => cmd::bench::run(bench),
        Command::Convert(args) => cmd::convert::run(args),
        Command::Doctor(args) => cmd::doctor::run(args),
    };
    if let Err(err) = result {
        eprintln!("error: {err:#}");
        std::process::exit(2);
    }
}
