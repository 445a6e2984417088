//! Data-parallel ranks of `dppo run`: which rank this process is, on which device, and,
//! for `--devices a,b,...` started by hand, the launcher: rank 0 re-executes this binary
//! once per other device with torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`), forwards their output prefixed with their rank, forwards
//! Ctrl-C, and fails the run with a rank's own message when it dies.
//!
//! A process started with those variables already set (by torchrun, Slurm or the launcher)
//! is that rank and launches nothing.

use std::io::BufRead;
use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use dppo_model::DeviceSpec;
use dppo_trainer::config::RunConfig;
use dppo_trainer::dist::{Collective, DistError, Rendezvous, Single, TcpCollective};
use dppo_trainer::TrainError;

/// Lines of a failed rank's output quoted in the run's error.
const TAIL_LINES: usize = 12;

/// How this process takes part in the run.
pub enum Role {
    /// The only rank.
    Single,
    /// Rank 0 of `devices`, starting the other ranks itself.
    Launcher,
    /// A rank started with torchrun's variables (by the launcher or an external one).
    Member(Rendezvous),
}

/// This process's role, from the environment and the configuration's `devices`.
pub fn role(cfg: &RunConfig) -> anyhow::Result<Role> {
    if let Some(rdv) = Rendezvous::from_env()? {
        return Ok(Role::Member(rdv));
    }
    Ok(match cfg.devices.len() {
        0 | 1 => Role::Single,
        _ => Role::Launcher,
    })
}

/// The device of rank `local_rank` on its node: `devices[local_rank]` when `devices` lists
/// them, else `device` (a GPU becomes `cuda:LOCAL_RANK`, torchrun's convention).
pub fn device_of(cfg: &RunConfig, local_rank: usize) -> anyhow::Result<DeviceSpec> {
    if cfg.devices.is_empty() {
        return Ok(match cfg.device {
            DeviceSpec::Cpu => DeviceSpec::Cpu,
            DeviceSpec::Cuda(_) => DeviceSpec::Cuda(local_rank),
        });
    }
    cfg.devices.get(local_rank).copied().with_context(|| {
        format!(
            "LOCAL_RANK={local_rank}, but devices lists {} device(s): list one per rank of \
             this node",
            cfg.devices.len()
        )
    })
}

/// The threads of each rank's CPU work: `threads`, or the cores shared among the node's
/// `local_world` ranks (so that ranks do not fight over cores).
pub fn threads_per_rank(threads: usize, local_world: usize) -> usize {
    if threads > 0 {
        return threads;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / local_world.max(1)).max(1)
}

/// Whether `err` is a collective that failed (a rank that exited or stopped answering)
/// rather than a failure of this rank's own.
pub fn is_collective_failure(err: &anyhow::Error) -> bool {
    err.chain().any(|e| {
        e.downcast_ref::<DistError>().is_some()
            || e.downcast_ref::<TrainError>()
                .is_some_and(TrainError::is_collective_failure)
    })
}

/// The collective of a member rank (rank 0 listens on `MASTER_ADDR:MASTER_PORT`).
pub fn connect(rdv: &Rendezvous, timeout: Duration) -> anyhow::Result<Arc<dyn Collective>> {
    if rdv.world_size == 1 {
        return Ok(Arc::new(Single));
    }
    let tcp = TcpCollective::connect(rdv, timeout)
        .with_context(|| format!("rank {} of {}: joining the run", rdv.rank, rdv.world_size))?;
    Ok(Arc::new(tcp))
}

/// The signal that asked the launcher to stop (0: none).
static SIGNALLED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNALLED.store(sig, Ordering::SeqCst);
}

/// A started rank: its process id, and the thread that forwards its output and waits for
/// it.
struct Started {
    pid: u32,
    watcher: JoinHandle<()>,
}

/// Rank 0 of a run it launched: the other ranks' processes.
pub struct Launcher {
    ranks: Vec<Started>,
    /// Set once the run is failing or stopping: a rank that dies after this is a
    /// consequence, not the cause, and is not reported.
    settled: Arc<AtomicBool>,
}

impl Launcher {
    /// Listens on a free loopback port and starts ranks 1..`devices` as this binary with
    /// this process's arguments and torchrun's variables. With `forward_signals`, Ctrl-C and
    /// SIGTERM are forwarded to them and end the run (a serving run handles Ctrl-C itself:
    /// the ranks stop together after the current step).
    pub fn start(world: usize, forward_signals: bool) -> anyhow::Result<(Self, TcpListener)> {
        let listener = TcpListener::bind("127.0.0.1:0").context("rank 0: listening for ranks")?;
        let port = listener.local_addr()?.port();
        let exe = std::env::current_exe().context("finding this binary to start the ranks")?;
        let settled = Arc::new(AtomicBool::new(false));
        let pids = Arc::new(Mutex::new(Vec::new()));
        let mut ranks = Vec::new();
        for rank in 1..world {
            let mut cmd = Command::new(&exe);
            cmd.args(std::env::args_os().skip(1))
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env_remove("TORCHELASTIC_USE_AGENT_STORE")
                .env_remove("DPPO_MASTER_PORT")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            own_process_group(&mut cmd);
            let child = cmd
                .spawn()
                .with_context(|| format!("starting rank {rank} ({})", exe.display()))?;
            let pid = child.id();
            pids.lock().expect("pids").push(pid);
            let watcher = watch(rank, child, &settled, &pids);
            ranks.push(Started { pid, watcher });
        }
        if forward_signals {
            forward_signals_to(pids.clone(), settled.clone());
        }
        Ok((Self { ranks, settled }, listener))
    }

    /// The run ended well on rank 0: waits for the other ranks to end too (a rank that
    /// fails meanwhile fails the run).
    pub fn finish(self) {
        for rank in self.ranks {
            let _ = rank.watcher.join();
        }
    }

    /// Rank 0 failed with `err`. When a collective failed, another rank probably died
    /// first: its watcher gets a few seconds to report its own message (and end this
    /// process). Otherwise, or when none does, the other ranks are stopped and `err` is the
    /// run's error.
    pub fn fail(self, err: anyhow::Error) -> anyhow::Error {
        if is_collective_failure(&err) {
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && !self.ranks.iter().all(|r| r.watcher.is_finished()) {
                std::thread::sleep(Duration::from_millis(20));
            }
            // Let a watcher that saw a failure finish reporting it (it exits the process).
            std::thread::sleep(Duration::from_millis(200));
        }
        self.settled.store(true, Ordering::SeqCst);
        for pid in self.ranks.iter().map(|r| r.pid) {
            signal(pid, libc::SIGKILL);
        }
        err
    }
}

/// Puts a started rank in its own process group (a terminal's Ctrl-C reaches rank 0 only,
/// which forwards it), and kills it should rank 0 die without a word (SIGKILL).
#[cfg(target_os = "linux")]
fn own_process_group(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
    // SAFETY: prctl is async-signal-safe and touches only the child's own attributes.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn own_process_group(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill only sends a signal to a process this one started.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// Starts the thread that forwards rank `rank`'s stderr with a `[rank N]` prefix and, when
/// the rank exits with a failure before the run is settled, reports the rank's last lines
/// as the run's error, stops the other ranks and ends this process.
fn watch(
    rank: usize,
    mut child: Child,
    settled: &Arc<AtomicBool>,
    pids: &Arc<Mutex<Vec<u32>>>,
) -> JoinHandle<()> {
    let stderr = child.stderr.take().expect("piped stderr");
    let pid = child.id();
    let settled = settled.clone();
    let pids = pids.clone();
    std::thread::Builder::new()
        .name(format!("dppo-rank-{rank}"))
        .spawn(move || {
            let mut tail: std::collections::VecDeque<String> = Default::default();
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("[rank {rank}] {line}");
                if tail.len() == TAIL_LINES {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
            let status = child.wait();
            let failed = !matches!(&status, Ok(s) if s.success());
            if !failed || settled.swap(true, Ordering::SeqCst) {
                return;
            }
            let how = match status {
                Ok(s) => describe(s),
                Err(e) => format!("could not be waited for: {e}"),
            };
            let said: Vec<&str> = tail
                .iter()
                .map(String::as_str)
                .filter(|l| !l.trim().is_empty())
                .collect();
            let said = match said.iter().rposition(|l| l.starts_with("error:")) {
                Some(i) => said[i..].join("\n"),
                None if said.is_empty() => "(it printed nothing)".to_string(),
                None => said.join("\n"),
            };
            eprintln!(
                "error: rank {rank} (pid {pid}) {how}; the run stops. Its last words:\n{said}"
            );
            for &other in pids.lock().expect("pids").iter().filter(|&&p| p != pid) {
                signal(other, libc::SIGKILL);
            }
            std::process::exit(2);
        })
        .expect("start a rank's watcher thread")
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => format!("ended: {status}"),
    }
}

/// Catches SIGINT and SIGTERM in rank 0 and forwards them to the ranks it started; the
/// run then ends as a signalled single process would (status 128 + signal).
fn forward_signals_to(pids: Arc<Mutex<Vec<u32>>>, settled: Arc<AtomicBool>) {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    std::thread::Builder::new()
        .name("dppo-signals".into())
        .spawn(move || loop {
            let sig = SIGNALLED.load(Ordering::SeqCst);
            if sig == 0 {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            settled.store(true, Ordering::SeqCst);
            let pids = pids.lock().expect("pids").clone();
            eprintln!("signal {sig}: stopping ranks 1..{} and rank 0", pids.len());
            for &pid in &pids {
                signal(pid, sig);
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && pids.iter().any(|&p| alive(p)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            for &pid in &pids {
                signal(pid, libc::SIGKILL);
            }
            std::process::exit(128 + sig);
        })
        .expect("start the signal thread");
}

/// Whether process `pid` (a child not yet waited for counts) still runs.
fn alive(pid: u32) -> bool {
    // /proc/<pid>/stat's third field: Z for a zombie (exited, not yet reaped).
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z')),
        // No /proc (not Linux): ask the kernel whether it can be signalled.
        Err(_) => {
            // SAFETY: signal 0 only checks that the process exists.
            unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
        }
    }
}
