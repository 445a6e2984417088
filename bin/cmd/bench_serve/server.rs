//! The `dppo serve` child process under load: started on a free loopback port, stopped
//! with Ctrl-C (SIGINT) at the end, killed if the load generator stops early.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// How long the server gets to exit after SIGINT.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// A running `dppo serve`.
pub struct Child {
    process: std::process::Child,
    addr: SocketAddr,
}

impl Child {
    /// Starts `dppo serve --model model` on `127.0.0.1:0` and waits for its address.
    pub fn start(model: &str, served_name: &str, max_pending: usize) -> anyhow::Result<Child> {
        let exe = std::env::current_exe().context("finding the dppo binary")?;
        let mut process = Command::new(exe)
            .args(["serve", "--model", model, "--addr", "127.0.0.1:0"])
            .args(["--served-model-name", served_name])
            .args(["--max-pending", &max_pending.to_string()])
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::piped())
            .spawn()
            .context("starting dppo serve")?;
        let stdout = process.stdout.take().context("the server's stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let addr = loop {
            let Some(line) = lines.next() else {
                let status = process.wait()?;
                bail!("dppo serve exited ({status}) before listening");
            };
            if let Some(rest) = line?.strip_prefix("listening on http://") {
                break rest.trim().parse().context("the server's address")?;
            }
        };
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Ok(Child { process, addr })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends SIGINT and expects a clean exit within [`STOP_TIMEOUT`].
    pub fn stop(mut self) -> anyhow::Result<()> {
        let pid = libc::pid_t::try_from(self.process.id()).context("the server's pid")?;
        // SAFETY: kill only sends a signal to our own child process.
        if unsafe { libc::kill(pid, libc::SIGINT) } != 0 {
            bail!(
                "cannot signal the server: {}",
                std::io::Error::last_os_error()
            );
        }
        let start = Instant::now();
        loop {
            if let Some(status) = self.process.try_wait()? {
                if !status.success() {
                    bail!("dppo serve exited with {status} after Ctrl-C");
                }
                return Ok(());
            }
            if start.elapsed() > STOP_TIMEOUT {
                bail!("dppo serve did not exit within {STOP_TIMEOUT:?} of Ctrl-C");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if self.process.try_wait().ok().flatten().is_none() {
            let _ = self.process.kill();
            let _ = self.process.wait();
        }
    }
}
