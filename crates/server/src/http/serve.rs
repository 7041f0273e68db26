//! The accept loop: each connection is served by hyper's HTTP/1 implementation with a timer
//! (header and keep-alive timeout), header size limits and a connection slot; at the limit a
//! new connection is answered 503 and closed at once, so waiting clients are told rather than
//! left in the kernel's backlog. On shutdown, open connections finish their requests.

use super::conn::{raw_response, write_all, GuardedIo};
use crate::errors::ApiError;
use crate::state::SharedState;
use axum::extract::ConnectInfo;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

/// File descriptors kept free beyond the connection slots (model files, the prompt cache's disk
/// tier, logs).
const FD_RESERVE: usize = 64;

/// Connections the kernel may hold completed but not yet accepted. tokio's `bind` asks for 128,
/// and a burst of clients (an agent fanning out, 1,000 connections in the fuzz suite) overflowed
/// it while the one HTTP worker shared two cores with decode: each dropped SYN cost its client
/// a 1 s retransmit (seen as a 1,016 ms /health in CI). The kernel caps it at `somaxconn`.
const LISTEN_BACKLOG: u32 = 4096;

/// Listens on `host:port` with [`LISTEN_BACKLOG`]: the first address it resolves to that binds.
pub async fn bind(host: &str, port: u16) -> std::io::Result<TcpListener> {
    let mut last = std::io::Error::new(std::io::ErrorKind::AddrNotAvailable, "the host resolves to no address");
    for addr in tokio::net::lookup_host((host, port)).await? {
        match listen_on(addr) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn listen_on(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Serves `state` on `listener` until `shutdown` resolves, then lets open connections finish.
pub async fn serve(
    state: SharedState,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = state.config.http.clone();
    let slots = Arc::new(Semaphore::new(connection_slots(limits.max_connections)));
    let app = crate::routes::router(state);
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_header_size(limits.max_header_bytes)
        .max_headers(128);
    let builder = Arc::new(builder);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, addr) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => { accept_failed(e).await; continue; }
            },
            _ = &mut shutdown => break,
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            tokio::spawn(refuse(stream));
            continue;
        };
        let conn = Connection { stream, addr, app: app.clone(), builder: builder.clone(), permit };
        let watcher = graceful.watcher();
        tokio::spawn(conn.run(watcher, limits.header_timeout));
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// One accepted connection with its slot.
struct Connection {
    stream: TcpStream,
    addr: SocketAddr,
    app: axum::Router,
    builder: Arc<http1::Builder>,
    permit: OwnedSemaphorePermit,
}

impl Connection {
    async fn run(self, watcher: hyper_util::server::graceful::Watcher, header_timeout: Duration) {
        let _ = self.stream.set_nodelay(true);
        let stream = Arc::new(self.stream);
        let (io, probe) = GuardedIo::new(stream.clone());
        let addr = self.addr;
        let app = self.app.map_request(move |mut req: axum::extract::Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(ConnectInfo(addr));
            req
        });
        let conn = self.builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(app));
        let result = watcher.watch(conn).await;
        let timed_out = result.as_ref().err().is_some_and(hyper::Error::is_timeout);
        if let Some((status, path, reply)) = probe.reply(timed_out, header_timeout.as_secs()) {
            super::log::refused_at_http(addr, path.as_deref(), status);
            let _ = tokio::time::timeout(Duration::from_secs(5), write_all(&stream, &reply)).await;
        }
        drop(self.permit);
    }
}

/// A connection beyond the limit: 503 in OpenAI's shape (nothing was read to tell the API),
/// written without waiting (a full socket buffer just loses it), then closed.
async fn refuse(stream: TcpStream) {
    tracing::warn!("connection limit reached: a new connection was refused (503)");
    let reply = raw_response(&ApiError::too_many_connections(), false);
    let _ = stream.try_write(&reply);
    let _ = tokio::time::timeout(Duration::from_secs(1), write_all(&stream, &[])).await;
}

/// Out of file descriptors (or another accept error): log it and back off briefly instead of
/// spinning; connections that close free descriptors.
async fn accept_failed(e: std::io::Error) {
    tracing::warn!("accept failed: {e}");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// Raises the soft open-file limit to the hard one and caps the connection slots to what it
/// allows (with a warning when that is fewer than asked).
fn connection_slots(asked: usize) -> usize {
    let available = raise_fd_limit().saturating_sub(FD_RESERVE);
    if available < asked {
        tracing::warn!("--max-connections {asked} lowered to {available}: the open-file limit allows no more");
        return available.max(1);
    }
    asked
}

/// The soft RLIMIT_NOFILE after raising it to the hard limit.
fn raise_fd_limit() -> usize {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit / setrlimit write / read the struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return usize::MAX;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
    }
    usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX)
}
