//! A minimal HTTP/1.1 client over `std::net` for the server tests: whole requests, chunked
//! bodies, server-sent events, and sockets a test can drop mid-response.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::Value;

/// A response: status, lower-cased headers, body (de-chunked).
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl Reply {
    /// The body as JSON (panics with the body when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter_map(|event| {
                event
                    .lines()
                    .find_map(|l| l.strip_prefix("data: ").or(l.strip_prefix("data:")))
                    .map(str::to_string)
            })
            .collect()
    }
}

/// Sends one request (`Connection: close`) and reads the whole response.
pub fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Reply {
    try_request(addr, method, path, body).expect("HTTP request")
}

/// [`request`], with connection errors returned (for clients of a server that may be gone).
pub fn try_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> std::io::Result<Reply> {
    try_request_with(addr, method, path, body, &[])
}

/// [`request`] with extra header lines (`("Authorization", "Bearer k")`).
pub fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> Reply {
    try_request_with(addr, method, path, body, headers).expect("HTTP request")
}

fn try_request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> std::io::Result<Reply> {
    let mut stream = try_open(addr, method, path, body, headers)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    Ok(parse(&raw))
}

/// `POST path` with a JSON body.
pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    request(addr, "POST", path, Some(&body.to_string()))
}

/// Sends a request and returns the socket, response unread.
pub fn open(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> TcpStream {
    try_open(addr, method, path, body, &[]).expect("send request")
}

fn try_open(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> std::io::Result<TcpStream> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(120)))?;
    let body = body.unwrap_or("");
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    Ok(stream)
}

/// Reads from `stream` until `needle` has arrived; returns what was read.
pub fn read_until(stream: &mut TcpStream, needle: &str) -> String {
    let mut reader = BufReader::new(stream);
    let mut seen = String::new();
    while !seen.contains(needle) {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap() == 0 {
            panic!("connection closed before {needle:?}: {seen}");
        }
        seen.push_str(&line);
    }
    seen
}

fn parse(raw: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .expect("a complete response head");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status code");
    let headers = head.to_ascii_lowercase();
    let body = if headers.contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_string()
    };
    Reply {
        status,
        headers,
        body,
    }
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if size == 0 {
            break;
        }
        out.push_str(&rest[..size]);
        body = &rest[size + 2..];
    }
    out
}
