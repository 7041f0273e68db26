//! One client connection's socket, as hyper sees it. hyper answers what it cannot parse (a bad
//! request line, headers beyond the limit) with its own bodiless 400 / 431 / 414, and closes a
//! connection whose head does not arrive in time without a word. [`GuardedIo`] notices the
//! first (a response head without the `x-request-id` every response of ours carries) and
//! swallows it, and remembers whether part of a request head had arrived; the connection's task
//! then writes the same status in the API's error shape ([`Probe::reply`]), or a 408 after a
//! half-sent head.

use crate::errors::ApiError;
use serde_json::json;
use std::io;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// How much of a request head is kept to tell which API it was for.
const HEAD_KEPT: usize = 64;

#[derive(Default)]
struct Seen {
    /// Bytes of a request arrived since the last response of ours went out.
    partial: bool,
    /// The first bytes of that request ("POST /v1/messages HTTP/1.1…").
    head: Vec<u8>,
    /// hyper's own error status, swallowed: to be answered in the API's shape.
    hyper_error: Option<u16>,
}

/// What the connection's task reads once hyper is done with the socket.
#[derive(Clone, Default)]
pub struct Probe(Arc<Mutex<Seen>>);

impl Probe {
    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The response owed to the client after hyper ended the connection: hyper's error in the
    /// API's shape, or 408 if it timed out in the middle of a request head.
    pub fn reply(&self, timed_out: bool, header_timeout_s: u64) -> Option<(u16, Option<String>, Vec<u8>)> {
        let seen = self.seen();
        let anthropic = head_path(&seen.head).is_some_and(crate::http::anthropic_path);
        let error = match (seen.hyper_error, timed_out && seen.partial) {
            (Some(400), _) => ApiError::bad_request_line(),
            (Some(status @ (414 | 431)), _) => ApiError::head_too_large(status),
            (Some(status), _) => ApiError::http_status(status, "The request could not be read"),
            (None, true) => ApiError::timeout(format!("The request head did not arrive within {header_timeout_s} s")),
            (None, false) => return None,
        };
        let path = head_path(&seen.head).map(|p| p.chars().take(200).collect());
        Some((error.status.as_u16(), path, raw_response(&error, anthropic)))
    }
}

/// The path of a request line, if it has one.
fn head_path(head: &[u8]) -> Option<&str> {
    let line = std::str::from_utf8(head.split(|&b| b == b'\r').next()?).ok()?;
    line.split(' ').nth(1)
}

/// A whole HTTP/1.1 error response, closing the connection.
pub fn raw_response(e: &ApiError, anthropic: bool) -> Vec<u8> {
    let body = if anthropic { e.anthropic_body() } else { e.body() };
    let body = serde_json::to_vec(&body).unwrap_or_else(|_| json!({}).to_string().into_bytes());
    let reason = e.status.canonical_reason().unwrap_or("Error");
    let mut out = format!(
        "HTTP/1.1 {} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        e.status.as_u16(),
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// Writes all of `bytes` to a socket shared with hyper's (now finished) connection.
pub async fn write_all(stream: &TcpStream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        stream.writable().await?;
        match stream.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    shutdown_write(stream);
    Ok(())
}

/// Half-closes the socket for writing (FIN), so a client reads the response to its end.
fn shutdown_write(stream: &TcpStream) {
    // SAFETY: the fd belongs to `stream`, which outlives the call; shutdown takes no pointers.
    unsafe { libc::shutdown(stream.as_raw_fd(), libc::SHUT_WR) };
}

/// The socket given to hyper: reads and writes through a shared `TcpStream`, watching both.
pub struct GuardedIo {
    stream: Arc<TcpStream>,
    probe: Probe,
}

impl GuardedIo {
    pub fn new(stream: Arc<TcpStream>) -> (Self, Probe) {
        let probe = Probe::default();
        (GuardedIo { stream, probe: probe.clone() }, probe)
    }

    fn on_read(&self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let mut seen = self.probe.seen();
        if !seen.partial {
            seen.partial = true;
            seen.head.clear();
        }
        let room = HEAD_KEPT.saturating_sub(seen.head.len());
        seen.head.extend_from_slice(&bytes[..room.min(bytes.len())]);
    }

    /// Whether `first` starts a response head hyper wrote on its own (an error: ours always
    /// carry `x-request-id`); a head of ours ends the current request.
    fn swallow(&self, first: &[u8]) -> bool {
        let Some(status) = response_status(first) else { return false };
        let ours = contains_ignore_case(first, b"\r\nx-request-id:");
        let mut seen = self.probe.seen();
        if ours || status < 400 {
            seen.partial = false;
            return false;
        }
        seen.hyper_error = Some(status);
        true
    }
}

/// The status of a buffer that starts an HTTP/1.x response head.
fn response_status(buf: &[u8]) -> Option<u16> {
    let rest = buf.strip_prefix(b"HTTP/1.1 ").or_else(|| buf.strip_prefix(b"HTTP/1.0 "))?;
    std::str::from_utf8(rest.get(..3)?).ok()?.parse().ok()
}

fn contains_ignore_case(hay: &[u8], needle: &[u8]) -> bool {
    let head_end = hay.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(hay.len());
    hay[..head_end].windows(needle.len()).any(|w| w.eq_ignore_ascii_case(needle))
}

impl AsyncRead for GuardedIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            ready!(self.stream.poll_read_ready(cx))?;
            let before = buf.filled().len();
            let unfilled = buf.initialize_unfilled();
            match self.stream.try_read(unfilled) {
                Ok(n) => {
                    buf.advance(n);
                    self.on_read(&buf.filled()[before..]);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for GuardedIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.swallow(buf) {
            return Poll::Ready(Ok(buf.len()));
        }
        loop {
            ready!(self.stream.poll_write_ready(cx))?;
            match self.stream.try_write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                other => return Poll::Ready(other),
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let first = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| &b[..]);
        if self.swallow(first) {
            return Poll::Ready(Ok(bufs.iter().map(|b| b.len()).sum()));
        }
        loop {
            ready!(self.stream.poll_write_ready(cx))?;
            match self.stream.try_write_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                other => return Poll::Ready(other),
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Owed an answer in our shape: the connection's task writes it, then half-closes.
        if self.probe.seen().hyper_error.is_none() {
            shutdown_write(&self.stream);
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyper_heads_are_told_from_ours() {
        assert_eq!(response_status(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), Some(431));
        assert_eq!(response_status(b"data: x"), None);
        assert!(contains_ignore_case(b"HTTP/1.1 400 Bad Request\r\nX-Request-Id: a\r\n\r\n", b"\r\nx-request-id:"));
        assert!(!contains_ignore_case(b"HTTP/1.1 400 Bad Request\r\n\r\nx-request-id: body", b"\r\nx-request-id:"));
        assert_eq!(head_path(b"POST /v1/messages?beta=true HTTP/1.1\r\nHost"), Some("/v1/messages?beta=true"));
    }

    #[test]
    fn replies_in_the_api_shape() {
        let p = Probe::default();
        assert!(p.reply(true, 10).is_none(), "an idle connection is closed without a word");
        p.seen().partial = true;
        let r = String::from_utf8(p.reply(true, 10).unwrap().2).unwrap();
        assert!(r.starts_with("HTTP/1.1 408 Request Timeout\r\n"), "{r}");
        assert!(r.contains(r#""type":"invalid_request_error""#), "{r}");
        p.seen().head = b"POST /v1/messages HTTP/1.1\r\n".to_vec();
        p.seen().hyper_error = Some(431);
        let r = String::from_utf8(p.reply(false, 10).unwrap().2).unwrap();
        assert!(r.starts_with("HTTP/1.1 431 "), "{r}");
        assert!(r.contains(r#""type":"error""#) && r.contains("headers are too large"), "{r}");
    }
}
