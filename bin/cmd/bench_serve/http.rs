//! A minimal blocking HTTP/1.1 client for the load generator: one request per connection,
//! the response head, then the body as it arrives (sized or chunked), read whole or as
//! server-sent events, so a client can time its first token and hang up mid-stream.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Connects to `addr` and sends one request (`Connection: close`); the response is unread.
pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    api_key: Option<&str>,
    read_timeout: Duration,
) -> io::Result<TcpStream> {
    let mut stream = TcpStream::connect_timeout(&addr, read_timeout)?;
    stream.set_read_timeout(Some(read_timeout))?;
    stream.set_nodelay(true)?;
    let auth = api_key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{auth}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    Ok(stream)
}

/// A response whose head has been read.
pub struct Response {
    /// The status code.
    pub status: u16,
    /// Whether the body is `text/event-stream`.
    pub event_stream: bool,
    body: BufReader<Body>,
}

impl Response {
    /// Reads the status line and headers from `stream`.
    pub fn read_head(stream: TcpStream) -> io::Result<Response> {
        let mut reader = BufReader::new(stream);
        let mut status_line = String::new();
        reader.read_line(&mut status_line)?;
        let status = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| invalid(format!("bad status line {status_line:?}")))?;
        let (mut length, mut chunked, mut event_stream) = (None, false, false);
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let line = line.trim_end().to_ascii_lowercase();
            if line.is_empty() {
                break;
            }
            let Some((name, value)) = line.split_once(':') else {
                return Err(invalid(format!("bad header {line:?}")));
            };
            let value = value.trim();
            match name {
                "content-length" => length = value.parse().ok(),
                "transfer-encoding" => chunked = value.contains("chunked"),
                "content-type" => event_stream = value.starts_with("text/event-stream"),
                _ => {}
            }
        }
        let mode = match (chunked, length) {
            (true, _) => Mode::Chunked {
                left: 0,
                done: false,
            },
            (false, Some(n)) => Mode::Sized(n),
            (false, None) => Mode::UntilClose,
        };
        Ok(Response {
            status,
            event_stream,
            body: BufReader::new(Body {
                inner: reader,
                mode,
            }),
        })
    }

    /// The whole body.
    pub fn text(mut self) -> io::Result<String> {
        let mut text = String::new();
        self.body.read_to_string(&mut text)?;
        Ok(text)
    }

    /// The `data` of the next server-sent event (comments and keep-alives skipped), or
    /// `None` when the body ended.
    pub fn next_event(&mut self) -> io::Result<Option<String>> {
        let mut data: Option<String> = None;
        loop {
            let mut line = String::new();
            if self.body.read_line(&mut line)? == 0 {
                return Ok(data);
            }
            let line = line.trim_end_matches(['\r', '\n']);
            if line.is_empty() {
                if data.is_some() {
                    return Ok(data);
                }
            } else if let Some(piece) = line.strip_prefix("data:") {
                let piece = piece.strip_prefix(' ').unwrap_or(piece);
                match &mut data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(piece);
                    }
                    None => data = Some(piece.to_string()),
                }
            }
        }
    }
}

/// How the body's end is known.
enum Mode {
    Sized(usize),
    Chunked { left: usize, done: bool },
    UntilClose,
}

/// The body bytes of a response, de-chunked.
struct Body {
    inner: BufReader<TcpStream>,
    mode: Mode,
}

impl Read for Body {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &mut self.mode {
            Mode::UntilClose => self.inner.read(buf),
            Mode::Sized(0) => Ok(0),
            Mode::Sized(left) => read_at_most(&mut self.inner, buf, left),
            Mode::Chunked { left, done } => {
                if *done {
                    return Ok(0);
                }
                if *left == 0 {
                    let mut size = String::new();
                    if self.inner.read_line(&mut size)? == 0 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    let size = size.trim();
                    let size = size.split(';').next().unwrap_or(size);
                    *left = usize::from_str_radix(size, 16)
                        .map_err(|_| invalid(format!("bad chunk size {size:?}")))?;
                    if *left == 0 {
                        *done = true;
                        return Ok(0);
                    }
                }
                let n = read_at_most(&mut self.inner, buf, left)?;
                if *left == 0 {
                    let mut crlf = String::new();
                    self.inner.read_line(&mut crlf)?;
                }
                Ok(n)
            }
        }
    }
}

/// Reads at most `*left` bytes into `buf` and counts them off; the body must not end early.
fn read_at_most(inner: &mut impl Read, buf: &mut [u8], left: &mut usize) -> io::Result<usize> {
    let end = buf.len().min(*left);
    let n = inner.read(&mut buf[..end])?;
    if n == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    *left -= n;
    Ok(n)
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}
