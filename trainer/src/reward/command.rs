//! A local reward process (`reward.command`): one long-lived child speaking JSON lines, one
//! request body per line on its stdin and one answer per line on its stdout; its stderr is
//! the run's. A child that exits or stops answering ends the run: the request it held is
//! lost and the next answers could no longer be matched to their requests.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Mutex;
use std::time::Duration;

use super::{Failure, StartError};

/// The child and its pipes; requests take turns.
pub struct CommandReward {
    argv: Vec<String>,
    timeout: Duration,
    io: Mutex<Io>,
}

struct Io {
    child: Child,
    /// `None` once the child is known dead.
    stdin: Option<ChildStdin>,
    /// Lines the reader thread read from the child's stdout (closed at its EOF).
    lines: Receiver<std::io::Result<String>>,
}

impl CommandReward {
    /// Starts `argv` (program and arguments).
    pub fn start(argv: &[String], timeout: Duration) -> Result<Self, StartError> {
        let (program, args) = argv.split_first().ok_or(StartError::EmptyCommand)?;
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|source| StartError::Spawn {
                command: shown(argv),
                source,
            })?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let (send, lines) = mpsc::channel();
        std::thread::Builder::new()
            .name("reward-command".into())
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    if send.send(line).is_err() {
                        break;
                    }
                }
            })
            .map_err(|source| StartError::Reader {
                command: shown(argv),
                source,
            })?;
        Ok(Self {
            argv: argv.to_vec(),
            timeout,
            io: Mutex::new(Io {
                stdin: child.stdin.take(),
                child,
                lines,
            }),
        })
    }

    /// The command line (for errors and logs).
    pub fn describe(&self) -> String {
        shown(&self.argv)
    }

    /// Writes `body` as one line and reads one answer line.
    pub fn exchange(&self, body: &str) -> Result<String, Failure> {
        let mut io = self.io.lock().unwrap_or_else(|e| e.into_inner());
        let Some(stdin) = io.stdin.as_mut() else {
            return Err(Failure::Fatal("it is no longer running".into()));
        };
        let written = stdin
            .write_all(body.as_bytes())
            .and_then(|()| stdin.write_all(b"\n"))
            .and_then(|()| stdin.flush());
        if let Err(e) = written {
            return Err(Failure::Fatal(
                io.dead(&format!("writing the request: {e}")),
            ));
        }
        match io.lines.recv_timeout(self.timeout) {
            Ok(Ok(line)) => Ok(line),
            Ok(Err(e)) => Err(Failure::Fatal(io.dead(&format!("reading its answer: {e}")))),
            Err(RecvTimeoutError::Disconnected) => {
                Err(Failure::Fatal(io.dead("it closed its stdout")))
            }
            Err(RecvTimeoutError::Timeout) => {
                let _ = io.child.kill();
                Err(Failure::Fatal(io.dead(&format!(
                    "no answer within {:?}; stopped it",
                    self.timeout
                ))))
            }
        }
    }
}

impl Io {
    /// Marks the child dead and says how it ended.
    fn dead(&mut self, what: &str) -> String {
        self.stdin = None;
        // A child that closed its pipes is exiting: give it a moment to be reaped.
        for _ in 0..50 {
            if let Ok(Some(status)) = self.child.try_wait() {
                return format!("{what} ({status})");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        format!("{what} (still running)")
    }
}

impl Drop for CommandReward {
    fn drop(&mut self) {
        let io = self.io.get_mut().unwrap_or_else(|e| e.into_inner());
        // End of input asks a well-behaved child to exit; a stuck one is stopped.
        io.stdin = None;
        for _ in 0..25 {
            if let Ok(Some(_)) = io.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = io.child.kill();
        let _ = io.child.wait();
    }
}

/// `argv` as one would type it (for messages).
fn shown(argv: &[String]) -> String {
    format!("`{}`", argv.join(" "))
}
