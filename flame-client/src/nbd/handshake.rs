//! Fixed-newstyle negotiation: greeting, client flags, and the option loop.
//!
//! Options handled: `EXPORT_NAME`, `ABORT`, `LIST`, `INFO`, `GO`,
//! `STRUCTURED_REPLY`, `STARTTLS` (on a TCP export with `tls:`; the TLS
//! session then carries the rest, and the client certificate's capabilities
//! decide what it may open); anything else gets `ERR_UNSUP` and negotiation
//! goes on, as the spec requires. Every option is first checked against the
//! connection's [`Admission`] ([`super::access`]): before TLS on an export
//! that requires it, everything but `STARTTLS` and `ABORT` gets
//! `ERR_TLS_REQD` (and `EXPORT_NAME`, which cannot be refused, a disconnect).
//! Every length read from the client is bounded before use. The caller bounds the
//! whole negotiation in time (`handshake_timeout_ms`).

use super::access::{Admission, OptionVerdict, check_option};
use super::backend::{Backend, Exports, OpenError};
use super::client_cert::ClientClaims;
use super::conn::{Conn, Reader};
use super::proto::{self, *};
use std::io;
use std::sync::Arc;

/// Option data accepted and parsed (names and info lists are far smaller).
pub const OPTION_DATA_BYTES_MAX: u32 = 64 << 10;
/// Longer option data up to this is read and dropped, answered with `ERR_TOO_BIG`;
/// beyond it the client is treated as hostile and disconnected.
pub const OPTION_DISCARD_BYTES_MAX: u32 = 16 << 20;

/// How negotiation ended without an error.
pub(crate) enum Outcome<B> {
    /// Enter transmission on `backend`.
    Transmission {
        /// The opened export.
        backend: B,
        /// Structured replies were negotiated.
        structured: bool,
        /// Export name, for logs.
        name: String,
        /// Served read-only (the backend's, or the client's grant's).
        read_only: bool,
        /// Who the client is, for logs.
        who: String,
    },
    /// The client sent `ABORT` (already acknowledged).
    Aborted,
}

/// Why negotiation ended the connection.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HandshakeError {
    /// Socket error or the client left.
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
    /// The client broke the protocol (bad magic, flags, over-long data).
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// `EXPORT_NAME` named an export we cannot open (only a disconnect can say so).
    #[error("export {0:?} refused after EXPORT_NAME: {1}")]
    ExportNameRefused(String, OpenError),
    /// The client did not finish in time.
    #[error("handshake timed out")]
    Timeout,
    /// `EXPORT_NAME` without the access it needs (TLS first, or a grant):
    /// the option has no error reply, so the connection is closed.
    #[error("EXPORT_NAME {0:?} refused: {1}")]
    Refused(String, String),
    /// The TLS handshake after `STARTTLS` failed (no or a bad client
    /// certificate, a protocol error).
    #[error("TLS: {0}")]
    Tls(io::Error),
}

fn reply(conn: &Conn, option: u32, reply_type: u32, data: &[u8]) {
    conn.send(&[&encode_option_reply(option, reply_type, data)]);
}

fn reply_err(conn: &Conn, option: u32, reply_type: u32, message: &str) {
    reply(conn, option, reply_type, message.as_bytes());
}

/// Runs the negotiation on a fresh connection, admitted as `admission`;
/// `tls` is what `STARTTLS` starts (`None`: not offered on this export).
pub(crate) async fn negotiate<E: Exports>(
    conn: &Conn,
    rd: &mut Reader,
    exports: &E,
    mut admission: Admission,
    tls: Option<&Arc<rustls::ServerConfig>>,
) -> Result<Outcome<E::B>, HandshakeError> {
    conn.send(&[&encode_greeting()]);
    let mut fb = [0u8; 4];
    rd.read_exact(&mut fb).await?;
    let cflags = decode_client_flags(&fb).map_err(|e| HandshakeError::Protocol(e.to_string()))?;
    let mut structured = false;
    loop {
        // The client may not send an option before the final reply to the previous
        // one, so nothing is lost by waiting for our replies to drain — and a client
        // that floods options without reading cannot make us queue replies forever.
        conn.wait_queue_below(0).await;
        if conn.is_closed() {
            return Err(HandshakeError::Io(std::io::ErrorKind::BrokenPipe.into()));
        }
        let mut hb = [0u8; OPTION_HEADER_LEN];
        rd.read_exact(&mut hb).await?;
        let h = decode_option_header(&hb).map_err(|e| HandshakeError::Protocol(e.to_string()))?;
        if h.len > OPTION_DATA_BYTES_MAX {
            if h.option == OPT_EXPORT_NAME || h.len > OPTION_DISCARD_BYTES_MAX {
                return Err(HandshakeError::Protocol(format!(
                    "option {} with {} bytes of data",
                    h.option, h.len
                )));
            }
            rd.skip(u64::from(h.len)).await?;
            reply_err(conn, h.option, REP_ERR_TOO_BIG, "option data too large");
            continue;
        }
        let data = rd.read_vec(h.len as usize).await?;
        let named = matches!(h.option, OPT_EXPORT_NAME | OPT_INFO | OPT_GO);
        if !named
            && let OptionVerdict::Refuse { reply, message } =
                check_option(&admission, h.option, None)
        {
            reply_err(conn, h.option, reply, &message);
            continue;
        }
        match h.option {
            OPT_EXPORT_NAME => {
                let name = String::from_utf8(data)
                    .map_err(|_| HandshakeError::Protocol("export name is not UTF-8".into()))?;
                if let OptionVerdict::Refuse { message, .. } =
                    check_option(&admission, h.option, Some(&name))
                {
                    return Err(HandshakeError::Refused(name, message));
                }
                let read_only = granted_read_only(&admission);
                let backend = exports
                    .open(&name)
                    .await
                    .map_err(|e| HandshakeError::ExportNameRefused(name.clone(), e))?;
                let read_only = read_only || backend.read_only();
                let flags = transmission_flags(read_only, structured);
                conn.send(&[&encode_export_name_reply(
                    backend.size(),
                    flags,
                    cflags.no_zeroes,
                )]);
                return Ok(Outcome::Transmission {
                    backend,
                    structured,
                    name,
                    read_only,
                    who: who(&admission),
                });
            }
            OPT_ABORT => {
                reply(conn, h.option, REP_ACK, &[]);
                conn.wait_queue_below(0).await;
                return Ok(Outcome::Aborted);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    reply_err(conn, h.option, REP_ERR_INVALID, "LIST takes no data");
                    continue;
                }
                match exports.list().await {
                    Ok(names) => {
                        // Only what the grant opens (LIST needs one: checked above).
                        let allowed =
                            |n: &String| matches!(&admission, Admission::Granted(g) if g.allows(n));
                        for n in names.into_iter().filter(allowed) {
                            reply(conn, h.option, REP_SERVER, &encode_rep_server(&n));
                        }
                        reply(conn, h.option, REP_ACK, &[]);
                    }
                    Err(e) => reply_err(conn, h.option, REP_ERR_POLICY, &e.to_string()),
                }
            }
            OPT_STARTTLS => {
                let Some(config) = tls else {
                    reply_err(
                        conn,
                        h.option,
                        REP_ERR_POLICY,
                        "TLS is not offered on this export",
                    );
                    continue;
                };
                if conn.tls_on() {
                    reply_err(conn, h.option, REP_ERR_INVALID, "TLS is already on");
                    continue;
                }
                if !data.is_empty() {
                    reply_err(conn, h.option, REP_ERR_INVALID, "STARTTLS takes no data");
                    continue;
                }
                reply(conn, h.option, REP_ACK, &[]);
                let cert = super::conn::start_tls(conn, rd, config.clone())
                    .await
                    .map_err(HandshakeError::Tls)?;
                // What was negotiated in clear is forgotten (the spec).
                structured = false;
                admission = match ClientClaims::from_der(&cert) {
                    Ok(claims) => Admission::Granted(claims.grant()),
                    Err(e) => Admission::Refused(e),
                };
                tracing::debug!(?admission, "TLS started");
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    reply_err(
                        conn,
                        h.option,
                        REP_ERR_INVALID,
                        "STRUCTURED_REPLY takes no data",
                    );
                    continue;
                }
                structured = true;
                reply(conn, h.option, REP_ACK, &[]);
            }
            OPT_INFO | OPT_GO => {
                let req = match decode_info_request(&data) {
                    Ok(r) => r,
                    Err(e) => {
                        reply_err(conn, h.option, REP_ERR_INVALID, &e.to_string());
                        continue;
                    }
                };
                let Ok(name) = String::from_utf8(req.name) else {
                    reply_err(conn, h.option, REP_ERR_INVALID, "export name is not UTF-8");
                    continue;
                };
                if let OptionVerdict::Refuse { reply, message } =
                    check_option(&admission, h.option, Some(&name))
                {
                    reply_err(conn, h.option, reply, &message);
                    continue;
                }
                let backend = match exports.open(&name).await {
                    Ok(b) => b,
                    Err(OpenError::Unknown) => {
                        reply_err(
                            conn,
                            h.option,
                            REP_ERR_UNKNOWN,
                            &format!("no export named {name:?}"),
                        );
                        continue;
                    }
                    Err(e) => {
                        reply_err(conn, h.option, REP_ERR_POLICY, &e.to_string());
                        continue;
                    }
                };
                let read_only = granted_read_only(&admission) || backend.read_only();
                let flags = transmission_flags(read_only, structured);
                reply(
                    conn,
                    h.option,
                    REP_INFO,
                    &encode_info_export(backend.size(), flags),
                );
                if req.infos.contains(&INFO_NAME) {
                    reply(
                        conn,
                        h.option,
                        REP_INFO,
                        &encode_info_string(INFO_NAME, &name),
                    );
                }
                if req.infos.contains(&INFO_DESCRIPTION) {
                    let d = exports.description(&name);
                    reply(
                        conn,
                        h.option,
                        REP_INFO,
                        &encode_info_string(INFO_DESCRIPTION, &d),
                    );
                }
                // Always sent: min 1 means no alignment is required, so a client that
                // did not ask loses nothing.
                reply(
                    conn,
                    h.option,
                    REP_INFO,
                    &encode_info_block_size(
                        proto::BLOCK_SIZE_MIN,
                        proto::BLOCK_SIZE_PREFERRED,
                        proto::PAYLOAD_BYTES_MAX,
                    ),
                );
                reply(conn, h.option, REP_ACK, &[]);
                if h.option == OPT_GO {
                    return Ok(Outcome::Transmission {
                        backend,
                        structured,
                        name,
                        read_only,
                        who: who(&admission),
                    });
                }
            }
            _ => {
                reply_err(conn, h.option, REP_ERR_UNSUP, "option not supported");
            }
        }
    }
}

/// Whether the connection's grant is read-only (`false` without a grant:
/// nothing is opened then).
fn granted_read_only(a: &Admission) -> bool {
    matches!(a, Admission::Granted(g) if g.read_only)
}

/// Who the client is, for logs.
fn who(a: &Admission) -> String {
    match a {
        Admission::Granted(g) => g.who.clone(),
        _ => "?".into(),
    }
}
