//! Failpoints: injected disk and network faults, for tests of what the OSD does
//! when its storage or a peer fails (docs/testing.md, "Failpoints").
//!
//! Compiled in only with the `failpoints` feature (`cargo build --features
//! flame-osd/failpoints`; scripts/test.sh builds the test daemons so). Without it
//! [`check`] is an empty inline function and the control routes do not exist.
//!
//! Points ([`POINTS`]): `store_read` (an object read), `store_write` (an object's
//! data write, zeroing and discard included), `store_sync` (an `fdatasync` of an
//! object or a directory `fsync`), `store_meta_write` (an object's header and
//! checksums, written at FLUSH), `journal_write` (an intent-journal write),
//! `peer_send` (a write the primary forwards or recovery copies, before it is sent),
//! `disk_usage`, whose `return(F)` makes the heartbeat report the fraction `F`
//! (0..=1) of the file system used ([`forced_usage`]: tests of nearfull/full),
//! `reply_drop` (a client's write, zeroing or discard is executed — applied on
//! every copy — but its reply is dropped and the connection closed, so the client
//! resends it: tests of retry de-duplication), and `write_hold`, whose
//! `return(MS)` holds a client's write for `MS` milliseconds before it is executed,
//! as if it sat in the network ([`hold_ms`]: tests of writes a client gave up
//! on), `forward_hold`, the same for a write a primary forwarded to this OSD
//! (tests of the peers' byte bound), and `map_fetch` (the control thread's fetch of a newer map: an OSD
//! that cannot learn new maps, for tests of a primary replaced while it still
//! runs).
//!
//! Actions are the `fail` crate's strings (<https://docs.rs/fail>): `return(EIO)`,
//! `1*return(ENOSPC)`, `10%return(EIO)`, `off`. The convention for errors: the
//! argument of `return` is an errno name (`EIO`, `ENOSPC`, `EROFS`, ...) or number,
//! and the point fails as the system call would, with that `io::Error`; `return`
//! without an argument means `EIO`. Do not use `sleep`, `pause` or `yield`: the
//! points run on the shard threads' event loops, which they would block;
//! `panic` aborts the process.
//!
//! Control at run time through the OSD's metrics server: `PUT /failpoints/{name}`
//! with the action as body, `DELETE /failpoints/{name}`, `GET /failpoints` (one
//! `name=action` a line). At start, the `FAILPOINTS` environment variable
//! (`name=action;name=action`) configures them.

use std::io;

/// Every failpoint the OSD has.
pub const POINTS: [&str; 11] = [
    "store_read",
    "store_write",
    "store_sync",
    "store_meta_write",
    "journal_write",
    "peer_send",
    "disk_usage",
    "reply_drop",
    "write_hold",
    "forward_hold",
    "map_fetch",
];

/// The error an action's `return(ARG)` stands for: an errno name or number; none
/// (or one not understood) is EIO.
pub fn error_for(name: &str, arg: Option<&str>) -> io::Error {
    let code = match arg.map(str::trim) {
        None | Some("") => libc::EIO,
        Some(a) => match a.parse::<i32>() {
            Ok(n) if n > 0 && n < 4096 => n,
            _ => errno_by_name(a).unwrap_or(libc::EIO),
        },
    };
    tracing::warn!(failpoint = name, errno = code, "failpoint fired");
    io::Error::from_raw_os_error(code)
}

fn errno_by_name(name: &str) -> Option<i32> {
    Some(match name {
        "EIO" => libc::EIO,
        "ENOSPC" => libc::ENOSPC,
        "EROFS" => libc::EROFS,
        "EDQUOT" => libc::EDQUOT,
        "ENOMEM" => libc::ENOMEM,
        "EAGAIN" => libc::EAGAIN,
        "EPIPE" => libc::EPIPE,
        "ECONNRESET" => libc::ECONNRESET,
        "ETIMEDOUT" => libc::ETIMEDOUT,
        "EINVAL" => libc::EINVAL,
        "EBADF" => libc::EBADF,
        _ => return None,
    })
}

/// Evaluates failpoint `name`: `Err` when it is configured to fail now.
#[cfg(feature = "failpoints")]
#[inline]
pub fn check(name: &'static str) -> io::Result<()> {
    fail::fail_point!(name, |arg: Option<String>| Err(error_for(
        name,
        arg.as_deref()
    )));
    Ok(())
}

/// The used fraction the `disk_usage` failpoint forces (`return(0.97)`), if set.
#[cfg(feature = "failpoints")]
pub fn forced_usage() -> Option<f64> {
    fail::fail_point!("disk_usage", |arg: Option<String>| arg
        .and_then(|a| a.trim().parse::<f64>().ok())
        .filter(|f| (0.0..=1.0).contains(f)));
    None
}

/// How long a hold failpoint holds a request before it runs (`return(MS)`), if
/// set and firing now: `write_hold` a client's write, `forward_hold` a write a
/// primary forwarded. Bounded to a minute.
#[cfg(feature = "failpoints")]
pub fn hold_ms(point: &'static str) -> Option<u64> {
    fail::fail_point!(point, |arg: Option<String>| arg
        .and_then(|a| a.trim().parse::<u64>().ok())
        .map(|ms| ms.min(60_000)));
    None
}

/// Failpoints are not compiled in: requests are never held.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hold_ms(_point: &'static str) -> Option<u64> {
    None
}

/// Failpoints are not compiled in: the real usage.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn forced_usage() -> Option<f64> {
    None
}

/// Failpoints are not compiled in: never fails.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn check(_name: &'static str) -> io::Result<()> {
    Ok(())
}

/// Reads `FAILPOINTS` from the environment (once, at start). Without the feature,
/// a set `FAILPOINTS` is an error: a test that wants faults must not silently run
/// without them.
pub fn setup_from_env() -> Result<(), String> {
    let Ok(spec) = std::env::var("FAILPOINTS") else {
        return Ok(());
    };
    if !cfg!(feature = "failpoints") {
        return Err(
            "FAILPOINTS is set but this flame-osd was built without the failpoints feature \
             (cargo build --features flame-osd/failpoints)"
                .into(),
        );
    }
    for item in spec.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, action) = item
            .split_once('=')
            .ok_or_else(|| format!("FAILPOINTS: '{item}' is not name=action"))?;
        configure(name.trim(), action.trim())?;
    }
    Ok(())
}

/// Sets failpoint `name` to `action`. Only [`POINTS`] are accepted, so a typo
/// fails loudly instead of configuring a point nothing evaluates.
pub fn configure(name: &str, action: &str) -> Result<(), String> {
    if !POINTS.contains(&name) {
        return Err(format!(
            "unknown failpoint '{name}' (known: {})",
            POINTS.join(", ")
        ));
    }
    #[cfg(feature = "failpoints")]
    {
        fail::cfg(name, action).map_err(|e| format!("failpoint {name}: bad action '{action}': {e}"))
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = action;
        Err("failpoints are not compiled in".into())
    }
}

/// The metrics server's routes for failpoints (only with the feature; `None`
/// otherwise, so the routes answer 404 like any unknown path).
pub fn http_routes() -> Option<flame_common::metrics_server::ExtraRoutes> {
    #[cfg(feature = "failpoints")]
    {
        Some(std::sync::Arc::new(route))
    }
    #[cfg(not(feature = "failpoints"))]
    {
        None
    }
}

#[cfg(feature = "failpoints")]
fn route(method: &str, url: &str, body: &str) -> Option<(u16, String)> {
    let path = url.split('?').next().unwrap_or(url);
    if path == "/failpoints" || path == "/failpoints/" {
        if method != "GET" {
            return Some((405, "use GET /failpoints\n".into()));
        }
        let mut out = String::new();
        for (name, action) in fail::list() {
            out.push_str(&format!("{name}={action}\n"));
        }
        return Some((200, out));
    }
    let name = path.strip_prefix("/failpoints/")?;
    match method {
        "PUT" | "POST" => match configure(name, body.trim()) {
            Ok(()) => {
                tracing::warn!(failpoint = name, action = body.trim(), "failpoint set");
                Some((200, format!("{name}={}\n", body.trim())))
            }
            Err(e) => Some((400, format!("{e}\n"))),
        },
        "DELETE" => {
            if !POINTS.contains(&name) {
                return Some((404, format!("unknown failpoint '{name}'\n")));
            }
            fail::remove(name);
            tracing::warn!(failpoint = name, "failpoint removed");
            Some((200, format!("{name} removed\n")))
        }
        _ => Some((405, "use PUT or DELETE /failpoints/{name}\n".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn return_arguments_map_to_errnos() {
        assert_eq!(error_for("x", None).raw_os_error(), Some(libc::EIO));
        assert_eq!(
            error_for("x", Some("ENOSPC")).raw_os_error(),
            Some(libc::ENOSPC)
        );
        assert_eq!(error_for("x", Some("28")).raw_os_error(), Some(28));
        assert_eq!(
            error_for("x", Some("bogus")).raw_os_error(),
            Some(libc::EIO)
        );
    }

    #[test]
    fn unknown_points_are_refused() {
        assert!(configure("store_raed", "return(EIO)").is_err());
    }

    #[cfg(feature = "failpoints")]
    #[test]
    fn http_routes_set_list_and_remove_points() {
        let r = route("PUT", "/failpoints/peer_send", "1*return(EIO)").unwrap();
        assert_eq!(r.0, 200, "{r:?}");
        let l = route("GET", "/failpoints", "").unwrap();
        assert!(l.1.contains("peer_send=1*return(EIO)"), "{l:?}");
        assert!(check("peer_send").is_err());
        assert!(check("peer_send").is_ok(), "1* fires once");
        assert_eq!(
            route("PUT", "/failpoints/peer_send", "nonsense(")
                .unwrap()
                .0,
            400
        );
        assert_eq!(route("DELETE", "/failpoints/peer_send", "").unwrap().0, 200);
        assert_eq!(route("GET", "/other", ""), None);
    }
}
