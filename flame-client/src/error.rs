//! The one error type of the client library.
//!
//! Every variant is a *final* answer: transient conditions (a stale map, an
//! unreachable replica, a dropped connection, an OSD marked down) are retried inside
//! the library until `io_timeout_ms` runs out, and only then surface as
//! [`ClientError::Timeout`]. So a caller (flame-nbd, flame-admin) never needs its own
//! retry loop; it maps the variant to its own error space with [`ClientError::errno`].

use flame_common::ids::OsdId;

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The manager could not be reached, or its answer could not be understood.
    #[error("manager {url}: {message}")]
    Mgr {
        /// The manager URL that was called.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// The manager answered with an error (its `ApiError` text, shown to the user as is).
    #[error("{message} (manager answered HTTP {status})")]
    Api {
        /// HTTP status code.
        status: u16,
        /// The manager's explanation.
        message: String,
    },
    /// No volume of that name exists in the cluster map.
    #[error("no such volume `{0}`")]
    NoSuchVolume(String),
    /// A byte range that does not lie within the volume.
    #[error("byte range {offset}+{length} is outside the volume (size {size} bytes)")]
    OutOfRange {
        /// First byte asked for.
        offset: u64,
        /// Bytes asked for.
        length: u64,
        /// The volume's size when the request was checked.
        size: u64,
    },
    /// The request did not complete within `io_timeout_ms` (retries included). The
    /// last transient reason is kept so an operator can see *why* it kept retrying.
    #[error("{op} timed out after {timeout_ms} ms (last problem: {last})")]
    Timeout {
        /// Operation name.
        op: &'static str,
        /// The configured bound.
        timeout_ms: u64,
        /// The last transient failure seen before giving up.
        last: String,
    },
    /// An OSD answered with a final error status (EIO, EINVAL, ENOSPC, ...).
    #[error("{osd} failed the {op}: {}", errno_name(*.status))]
    Osd {
        /// The OSD that answered.
        osd: OsdId,
        /// Operation name.
        op: &'static str,
        /// Its status: a negative errno.
        status: i32,
    },
    /// An operation that must reach every OSD found one down (e.g. deleting a volume's
    /// objects, which must not silently leave objects behind).
    #[error("{0} is down; refusing to continue (objects there would be left behind)")]
    OsdDown(OsdId),
    /// An OSD sent something the protocol does not allow (wrong reply length, ...).
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// A bad argument or configuration value.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A local system error (creating a reactor, spawning a thread, ...).
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        source: std::io::Error,
    },
}

impl ClientError {
    /// The positive Linux errno closest to this error, for block-device front ends
    /// (NBD maps these onto its own small error set).
    pub fn errno(&self) -> i32 {
        match self {
            ClientError::OutOfRange { .. } => libc::EINVAL,
            ClientError::InvalidArgument(_) => libc::EINVAL,
            ClientError::NoSuchVolume(_) => libc::ENOENT,
            ClientError::Osd { status, .. } if *status < 0 => -status,
            ClientError::Timeout { .. } => libc::ETIMEDOUT,
            ClientError::OsdDown(_) => libc::EHOSTDOWN,
            _ => libc::EIO,
        }
    }
}

/// A short name for a negative errno status, for messages.
pub(crate) fn errno_name(status: i32) -> String {
    match -status {
        libc::EIO => "EIO (storage error)".into(),
        libc::EINVAL => "EINVAL (invalid request)".into(),
        libc::ENOSPC => "ENOSPC (no space left)".into(),
        libc::ESTALE => "ESTALE (stale map)".into(),
        libc::EAGAIN => "EAGAIN (replica unreachable)".into(),
        libc::ECANCELED => "ECANCELED (superseded by a newer write of this client)".into(),
        e => format!("errno {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_mapping_and_messages() {
        let e = ClientError::Osd {
            osd: OsdId(3),
            op: "write",
            status: -libc::ENOSPC,
        };
        assert_eq!(e.errno(), libc::ENOSPC);
        assert!(e.to_string().contains("osd.3"), "{e}");
        assert!(e.to_string().contains("ENOSPC"), "{e}");
        let e = ClientError::OutOfRange {
            offset: 10,
            length: 5,
            size: 12,
        };
        assert_eq!(e.errno(), libc::EINVAL);
        assert!(e.to_string().contains("size 12"));
    }
}
