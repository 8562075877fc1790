//! HTTP agents (ureq) whose connections leave from a chosen local address.
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
    Buffers, ConnectionDetails, Connector, LazyBuffers, NextTimeout, ShutdownHandle, Transport,
};

/// An agent with `config` whose connections are bound to `source` when given
/// (plain ureq otherwise). Plain `http://` only: the manager API has no TLS.
pub fn agent(config: ureq::config::Config, source: Option<IpAddr>) -> ureq::Agent {
    match source {
        None => ureq::Agent::new_with_config(config),
        Some(ip) => {
            ureq::Agent::with_parts(config, BoundConnector { ip }, DefaultResolver::default())
        }
    }
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
        let agent = agent(ureq::Agent::config_builder().build(), Some(source));
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
