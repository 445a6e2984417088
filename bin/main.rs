//! `dppo`: the command. Parses arguments, runs one subcommand, prints any error chain once.

mod cmd;

use std::io::IsTerminal;

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
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
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
        eprintln!("error: {}", error_text(&err));
        std::process::exit(2);
    }
}

/// `err` and its causes joined by `: `, leaving out a cause whose text the message already
/// holds (errors that name their source in their own message would print it twice).
fn error_text(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let cause = cause.to_string();
        if text.contains(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::error_text;

    #[derive(Debug, thiserror::Error)]
    #[error("reading {path}: {source}")]
    struct Reading {
        path: String,
        source: std::io::Error,
    }

    #[test]
    fn an_error_prints_each_cause_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        let err = anyhow::Error::new(Reading {
            path: "a.jsonl".into(),
            source: io(),
        })
        .context("loading data.train");
        assert_eq!(
            error_text(&err),
            "loading data.train: reading a.jsonl: No such file"
        );
        let plain = anyhow::Error::new(io()).context("opening the port");
        assert_eq!(error_text(&plain), "opening the port: No such file");
    }
}
