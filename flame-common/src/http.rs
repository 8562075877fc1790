//! HTTP agents (ureq) whose connections leave from a chosen local address, and the
//! one function every caller of the manager's API sends a request through
//! ([`call`]: signed with the caller's key, the answer's signature checked).
//!
//! A daemon's calls to the manager must come from the daemon's own address, as its
//! data connections do: on a multi-homed host so they use the network the daemon
//! is published on, and so a firewall rule naming the daemon's address (the
//! partition tests drop traffic between two loopback addresses) covers them.
//! ureq opens unbound sockets; [`agent`] plugs in a connector that binds first.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Arc;
use ureq::Error;
use ureq::unversioned::resolver::DefaultResolver;
use ureq::unversioned::transport::{
    Buffers, ConnectionDetails, Connector, LazyBuffers, NextTimeout, RustlsConnector,
    ShutdownHandle, Transport,
};

/// An agent with `config` whose connections are bound to `source` when given
/// (plain ureq otherwise). `https://` URLs are verified against `trust` (the
/// cluster CA, [`crate::tls`]) only; without it they fail.
pub fn agent(
    config: ureq::config::ConfigBuilder<ureq::typestate::AgentScope>,
    source: Option<IpAddr>,
    trust: Option<&crate::tls::MgrTrust>,
) -> ureq::Agent {
    // No redirects: the manager never sends one, a signed request must not be
    // replayed elsewhere, and a redirect to https:// would reach a TLS setup
    // nobody asked for.
    let config = config
        .tls_config(crate::tls::agent_tls_config(trust))
        .max_redirects(0)
        .build();
    match source {
        None => ureq::Agent::new_with_config(config),
        Some(ip) => ureq::Agent::with_parts(
            config,
            BoundConnector { ip }.chain(RustlsConnector::default()),
            DefaultResolver::default(),
        ),
    }
}

/// The base URL of the manager at `addr` (`HOST:PORT`, `http://HOST:PORT` or
/// `https://HOST:PORT`): `https://` when the caller trusts a CA for it, which
/// it must for an `https://` address; `http://` otherwise.
pub fn mgr_base_url(addr: &str, tls: bool) -> Result<String, String> {
    let a = addr.trim().trim_end_matches('/');
    if a.is_empty() {
        return Err("manager address is empty".into());
    }
    let (scheme, rest) = match a.split_once("://") {
        Some((s @ ("http" | "https"), rest)) => (Some(s), rest),
        Some(_) => {
            return Err(format!(
                "manager address `{addr}`: expected HOST:PORT, http://HOST:PORT or https://HOST:PORT"
            ));
        }
        None => (None, a),
    };
    if rest.is_empty() || rest.contains('/') {
        return Err(format!("manager address `{addr}`: expected HOST:PORT"));
    }
    match (scheme, tls) {
        (Some("https"), false) => Err(format!(
            "manager address `{addr}`: https needs the cluster CA (`mgr_tls_ca` in the \
             config, --mgr-ca or FLAME_MGR_CA for flame-admin)"
        )),
        (Some("http"), true) => Err(format!(
            "manager address `{addr}`: http:// while a manager CA is set; the manager \
             serves TLS: use HOST:PORT or https://"
        )),
        (_, true) => Ok(format!("https://{rest}")),
        (_, false) => Ok(format!("http://{rest}")),
    }
}

/// A manager API answer: status and (bounded) body.
#[derive(Debug)]
pub struct Answer {
    /// HTTP status.
    pub status: u16,
    /// The body, at most the caller's limit.
    pub body: Vec<u8>,
    /// Whether the manager's signature over this request's nonce, the status
    /// and the body checked (always for a success; for an error only when the
    /// manager knew the caller: an authentication refusal cannot be signed).
    /// A caller acts for good on an error only when it is signed: anyone on
    /// the path can forge an unsigned one.
    pub signed: bool,
}

/// Why [`call`] got no answer it can trust.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// No answer: connect, send or receive failed, or timed out.
    #[error("{0}")]
    Transport(ureq::Error),
    /// The answer's body could not be read (or exceeded the limit).
    #[error("reading the answer: {0}")]
    Body(ureq::Error),
    /// A success answer whose signature does not check: not from the manager
    /// holding this cluster's secret, or altered on the way.
    #[error("{0}")]
    Untrusted(String),
    /// The request could not be built or signed (no random source).
    #[error("{0}")]
    Local(String),
}

/// Where and as whom a process calls the manager's API: the one place requests
/// are signed and answers checked.
#[derive(Clone)]
pub struct MgrEndpoint {
    /// The HTTP agent (connection pool, source address).
    pub agent: ureq::Agent,
    /// `http://host:port` or `https://host:port` ([`mgr_base_url`]), no
    /// trailing slash.
    pub base: String,
    /// What requests are signed with; `None` against a manager with `auth: none`.
    pub creds: Option<crate::auth::Credentials>,
}

impl std::fmt::Debug for MgrEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MgrEndpoint")
            .field("base", &self.base)
            .field("entity", &self.creds.as_ref().map(|c| c.entity.clone()))
            .finish()
    }
}

impl MgrEndpoint {
    /// Sends `method path` with `body` (JSON, when given), signed when the
    /// endpoint has credentials, within `timeout`, reading at most `limit_bytes`
    /// of the answer.
    ///
    /// With credentials, a success (2xx) answer must carry the manager's
    /// signature over this request's nonce, status and body
    /// ([`crate::auth::verify_response`]): a map or a reply nobody but the
    /// manager could have produced. An error answer is returned even unsigned
    /// (the manager cannot sign for a key it does not know), since acting on an
    /// error changes nothing.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        timeout: std::time::Duration,
        limit_bytes: u64,
    ) -> Result<Answer, CallError> {
        call(
            &self.agent,
            self.creds.as_ref(),
            method,
            &self.base,
            path,
            body,
            (timeout, limit_bytes),
        )
    }
}

fn call(
    agent: &ureq::Agent,
    creds: Option<&crate::auth::Credentials>,
    method: &str,
    base: &str,
    path: &str,
    body: Option<&[u8]>,
    (timeout, limit_bytes): (std::time::Duration, u64),
) -> Result<Answer, CallError> {
    let url = format!("{base}{path}");
    let bytes = body.unwrap_or_default();
    let mut builder = ureq::http::Request::builder().method(method).uri(&url);
    if body.is_some() {
        builder = builder.header("content-type", "application/json");
    }
    let mut nonce = None;
    if let Some(c) = creds {
        let n = crate::auth::Nonce::random().map_err(CallError::Local)?;
        let now_ms = crate::clock::unix_ms();
        let auth = c.sign(method, path, bytes, now_ms, n);
        builder = builder.header("authorization", auth.to_header());
        nonce = Some(n);
    }
    let request = builder
        .body(bytes.to_vec())
        .map_err(|e| CallError::Local(format!("{method} {url}: {e}")))?;
    let request = agent
        .configure_request(request)
        .http_status_as_error(false)
        .timeout_global(Some(timeout))
        .build();
    let mut resp = agent.run(request).map_err(CallError::Transport)?;
    let status = resp.status().as_u16();
    let signature = resp
        .headers()
        .get(crate::auth::SIGNATURE_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = resp
        .body_mut()
        .with_config()
        .limit(limit_bytes)
        .read_to_vec()
        .map_err(CallError::Body)?;
    let mut signed = false;
    if let (Some(c), Some(n)) = (creds, nonce) {
        let verified = crate::auth::verify_response(&c.key, n, status, &body, signature.as_deref());
        signed = verified.is_ok();
        if (200..300).contains(&status) {
            verified.map_err(|e| CallError::Untrusted(format!("{method} {url}: {e}")))?;
        }
    }
    Ok(Answer {
        status,
        body,
        signed,
    })
}

/// Opens TCP connections from a fixed local IP.
#[derive(Debug)]
struct BoundConnector {
    ip: IpAddr,
}

impl Connector<()> for BoundConnector {
    type Out = BoundTransport;

    fn connect(
        &self,
        details: &ConnectionDetails,
        _chained: Option<()>,
    ) -> Result<Option<Self::Out>, Error> {
        let per_try = details.timeout.not_zero().map(|d| *d);
        let mut last: Option<Error> = None;
        // Bounded by the resolver's answer (a handful of addresses).
        for addr in details.addrs.iter() {
            match connect_one(*addr, self.ip, per_try) {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    let stream = Arc::new(stream);
                    (details.register_shutdown)(
                        Arc::downgrade(&stream) as std::sync::Weak<dyn ShutdownHandle>
                    )?;
                    let config = details.config;
                    return Ok(Some(BoundTransport {
                        stream,
                        buffers: LazyBuffers::new(
                            config.input_buffer_size(),
                            config.output_buffer_size(),
                        ),
                    }));
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(Error::HostNotFound))
    }
}

fn connect_one(
    addr: SocketAddr,
    ip: IpAddr,
    timeout: Option<std::time::Duration>,
) -> Result<TcpStream, Error> {
    let fd = crate::transport::tcp::new_socket(addr, Some(ip))?;
    let socket = socket2::Socket::from(fd);
    let res = match timeout {
        Some(t) => socket.connect_timeout(&addr.into(), t),
        None => socket.connect(&addr.into()),
    };
    match res {
        Ok(()) => Ok(socket.into()),
        Err(e) if e.kind() == io::ErrorKind::TimedOut => {
            Err(Error::Timeout(ureq::Timeout::Connect))
        }
        Err(e) => Err(Error::Io(e)),
    }
}

/// A blocking TCP stream with ureq's buffers.
#[derive(Debug)]
struct BoundTransport {
    stream: Arc<TcpStream>,
    buffers: LazyBuffers,
}

/// Maps an I/O timeout to ureq's timeout error.
fn io_err(e: io::Error, timeout: &NextTimeout) -> Error {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Error::Timeout(timeout.reason),
        _ => Error::Io(e),
    }
}

impl Transport for BoundTransport {
    fn buffers(&mut self) -> &mut dyn Buffers {
        &mut self.buffers
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), Error> {
        let timeout = timeout.for_write();
        self.stream
            .set_write_timeout(timeout.not_zero().map(|d| *d))?;
        let output = &self.buffers.output()[..amount];
        (&*self.stream)
            .write_all(output)
            .map_err(|e| io_err(e, &timeout))
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, Error> {
        let timeout = timeout.for_read();
        self.stream
            .set_read_timeout(timeout.not_zero().map(|d| *d))?;
        let input = self.buffers.input_append_buf();
        // Bounded: each round is one read; EINTR is the only reason to go again.
        let mut n = Err(io::Error::from(io::ErrorKind::Interrupted));
        for _ in 0..16 {
            n = (&*self.stream).read(input);
            if !matches!(&n, Err(e) if e.kind() == io::ErrorKind::Interrupted) {
                break;
            }
        }
        let n = n.map_err(|e| io_err(e, &timeout))?;
        self.buffers.input_appended(n);
        Ok(n > 0)
    }

    fn is_open(&mut self) -> bool {
        // Pooled connections: a peer that closed shows as readable with 0 bytes.
        let stream = &*self.stream;
        if stream.set_nonblocking(true).is_err() {
            return false;
        }
        let mut buf = [0u8; 1];
        let open = matches!(stream.peek(&mut buf), Err(e) if e.kind() == io::ErrorKind::WouldBlock);
        stream.set_nonblocking(false).is_ok() && open
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_leave_from_the_bound_address() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, peer) = listener.accept().unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).unwrap();
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                .unwrap();
            peer
        });
        let source: IpAddr = "127.0.0.7".parse().unwrap();
        let agent = agent(ureq::Agent::config_builder(), Some(source), None);
        let body = agent
            .get(&format!("http://{addr}/x"))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap();
        assert_eq!(body, "ok");
        assert_eq!(server.join().unwrap().ip(), source);
    }
}
