//! Data directories only their owner can reach: the OSDs' objects and the
//! manager's state are the volumes' bytes and the cluster's map, so no other
//! local user may read them, whoever starts the daemon and whatever its umask.
//!
//! A daemon calls [`restrict_umask`] first (every file and directory it creates
//! is then 0600 / 0700 at most, however the code that creates it asks), then
//! [`open`] on its data directory: it is created 0700, a directory others can
//! enter is repaired to 0700 with a warning naming the old mode (with the
//! directory closed, files an older version created 0644 inside it are
//! unreachable too), and one owned by another user is refused.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::Path;

/// Makes the process's umask 077: whatever mode a later `open` or `mkdir`
/// asks for, group and others get nothing. Call before the daemon creates
/// anything (it is process-wide).
pub fn restrict_umask() {
    // SAFETY: plain syscall, no memory involved.
    unsafe {
        libc::umask(0o077);
    }
}

/// What [`open`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opened {
    /// Already private (or just created).
    Private,
    /// Group or others could reach it: its mode was this, and is now `& 0o700`.
    Repaired {
        /// The mode it had (permission bits).
        mode_before: u32,
    },
}

/// Creates `dir` (and its missing parents) with mode 0700, or checks the
/// existing one: it must be a directory owned by this process's user; a mode
/// that lets group or others in is cut to the owner's bits and reported
/// ([`Opened::Repaired`], which the caller logs). `what` names it in errors
/// ("data_dir").
pub fn open(dir: &Path, what: &str) -> Result<Opened, String> {
    let shown = dir.display();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("cannot create {what} {shown}: {e}"))?;
    // Followed if it is a symbolic link: a data directory on a mount point
    // reached through a link is the operator's choice; what matters is the
    // directory itself.
    let md = std::fs::metadata(dir).map_err(|e| format!("{what} {shown}: {e}"))?;
    if !md.is_dir() {
        return Err(format!("{what} {shown} is not a directory"));
    }
    // SAFETY: plain syscall.
    let me = unsafe { libc::geteuid() };
    if md.uid() != me {
        return Err(format!(
            "{what} {shown} is owned by uid {}, not by this daemon's uid {me}: \
             run the daemon as its owner, or `chown -R {me} {shown}`",
            md.uid()
        ));
    }
    let mode = md.mode() & 0o7777;
    if mode & 0o077 == 0 {
        return Ok(Opened::Private);
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & 0o700)).map_err(|e| {
        format!(
            "{what} {shown} is open to other users (mode {mode:04o}) and cannot be \
                 made private: {e}; run `chmod 700 {shown}`"
        )
    })?;
    Ok(Opened::Repaired { mode_before: mode })
}

/// [`open`], logging a repair as a warning (what every daemon does with it).
pub fn open_logged(dir: &Path, what: &str) -> Result<(), String> {
    if let Opened::Repaired { mode_before } = open(dir, what)? {
        tracing::warn!(
            "{what} {} was open to other users (mode {mode_before:04o}): made it 0700, \
             so only this daemon's user can read the data in it",
            dir.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().mode() & 0o7777
    }

    #[test]
    fn a_new_directory_is_private_and_parents_are_made() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("a/b");
        assert_eq!(open(&d, "data_dir").unwrap(), Opened::Private);
        assert_eq!(mode(&d), 0o700);
        assert_eq!(open(&d, "data_dir").unwrap(), Opened::Private);
    }

    #[test]
    fn a_directory_others_can_enter_is_repaired_and_reported() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("d");
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(
            open(&d, "data_dir").unwrap(),
            Opened::Repaired { mode_before: 0o755 }
        );
        assert_eq!(mode(&d), 0o700);
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o710)).unwrap();
        assert_eq!(
            open(&d, "data_dir").unwrap(),
            Opened::Repaired { mode_before: 0o710 }
        );
        assert_eq!(mode(&d), 0o700);
    }

    #[test]
    fn a_file_or_a_directory_of_another_user_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        let e = open(&f, "data_dir").unwrap_err();
        assert!(e.contains("data_dir"), "{e}");
        // SAFETY: plain syscall.
        if unsafe { libc::geteuid() } == 0 {
            // Root can give a directory away (CI and this machine run as root).
            let d = tmp.path().join("theirs");
            std::fs::create_dir(&d).unwrap();
            std::os::unix::fs::chown(&d, Some(65534), Some(65534)).unwrap();
            let e = open(&d, "data_dir").unwrap_err();
            assert!(e.contains("owned by uid 65534"), "{e}");
        }
    }
}
