//! Files that hold keys and trust (keyrings, TLS keys and certificates): read
//! with a size bound, a secret refused when group or others may access it (a
//! key others can read is no longer a secret), and written as new files only
//! (a lost key cannot be recovered, so none is ever replaced) with their exact
//! mode from creation on, durably. One place for what keyrings and TLS files
//! both need.

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Reads `path` (`what` names it in errors: "keyring", "manager private key"),
/// at most `bytes_max` bytes; a larger file is an error (a wrong path, not a
/// read of all of it). With `secret`, refuses a file group or others may
/// access, naming the `chmod` that fixes it, one owned by another user than
/// this process's (or root), and a symbolic link (whoever may change the link
/// chooses the key; the file itself: the directories above it are followed,
/// and must be the operator's to keep).
pub fn read(path: &Path, what: &str, bytes_max: u64, secret: bool) -> Result<Vec<u8>, String> {
    let shown = path.display();
    // Non-blocking, so a FIFO named by mistake is refused below instead of
    // blocking the open until someone writes to it (no effect on a file).
    let flags = libc::O_NONBLOCK | if secret { libc::O_NOFOLLOW } else { 0 };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) if secret => format!(
                "{what} {shown} is a symbolic link; a secret is read from a regular file \
                 only (whoever may change the link would choose the key): name the file itself"
            ),
            _ => format!("{what} {shown}: {e}"),
        })?;
    let meta = file
        .metadata()
        .map_err(|e| format!("{what} {shown}: {e}"))?;
    if !meta.is_file() {
        return Err(format!("{what} {shown} is not a regular file"));
    }
    // SAFETY: plain syscall.
    let me = unsafe { libc::geteuid() };
    if secret && meta.uid() != me && meta.uid() != 0 {
        return Err(format!(
            "{what} {shown} is owned by uid {}, not by this process's uid {me} (or root): \
             a key another user can replace is not this daemon's; run `chown {me} {shown}`",
            meta.uid()
        ));
    }
    let mode = meta.mode() & 0o777;
    if secret && mode & 0o077 != 0 {
        return Err(format!(
            "{what} {shown} is accessible by group or others (mode {mode:04o}); \
             a key others can read is not a secret: run `chmod 600 {shown}`"
        ));
    }
    let mut bytes = Vec::new();
    file.take(bytes_max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{what} {shown}: {e}"))?;
    if bytes.len() as u64 > bytes_max {
        return Err(format!(
            "{what} {shown} is larger than {bytes_max} bytes: not a {what}"
        ));
    }
    Ok(bytes)
}

/// Writes `bytes` to the new file `path` with exactly `mode` (not masked by
/// the umask), durably. Never replaces an existing file: that is an error
/// ending in "already exists" (`what` names the file in it).
pub fn write_new(path: &Path, what: &str, bytes: &[u8], mode: u32) -> Result<(), String> {
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(path)?;
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    write().map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => format!(
            "{what} {} already exists; not overwriting it (move it away first)",
            path.display()
        ),
        _ => format!("cannot write {what} {}: {e}", path.display()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_private_bounded_and_never_overwritten() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("k");
        write_new(&p, "keyring", b"abc", 0o600).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o600);
        assert_eq!(read(&p, "keyring", 3, true).unwrap(), b"abc");
        let e = read(&p, "keyring", 2, true).unwrap_err();
        assert!(e.contains("larger than 2 bytes"), "{e}");
        let e = write_new(&p, "keyring", b"x", 0o600).unwrap_err();
        assert!(
            e.ends_with("(move it away first)") && e.contains("already exists"),
            "{e}"
        );
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = read(&p, "keyring", 3, true).unwrap_err();
        assert!(e.contains("chmod 600"), "{e}");
        // Not a secret: any mode.
        assert!(read(&p, "certificate", 3, false).is_ok());
        let e = read(tmp.path(), "keyring", 3, true).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
        // A FIFO is refused at once, not waited on.
        let fifo = tmp.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: plain syscall on a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read(&fifo, "keyring", 3, true).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
        // A symbolic link to a good secret: refused as a secret, followed
        // otherwise.
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        let e = read(&link, "keyring", 3, true).unwrap_err();
        assert!(e.contains("symbolic link"), "{e}");
        assert!(read(&link, "certificate", 3, false).is_ok());
        // SAFETY: plain syscall.
        if unsafe { libc::geteuid() } == 0 {
            // Another user's key (root can give it away; CI runs as root).
            std::os::unix::fs::chown(&p, Some(65534), None).unwrap();
            let e = read(&p, "keyring", 3, true).unwrap_err();
            assert!(e.contains("owned by uid 65534"), "{e}");
        }
    }
}
