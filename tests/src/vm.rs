//! Commands inside the test VM (`scripts/vm.sh`): a QEMU guest with Debian's 6.12
//! kernel, for what this machine's kernel cannot do (no nbd, ublk or rdma
//! modules, no module loading). The guest sees the host's file system read-only
//! over virtio-9p and runs the command in a chroot of it, so the binaries this
//! build made run there unchanged; it has no network device, only its own
//! loopback. See docs/testing.md ("The test VM").
//!
//! Everything is bounded: the script kills QEMU after the guest timeout, and
//! [`run`] kills the script's whole process group (QEMU included) if it outlives
//! that by [`HOST_MARGIN`]. A missing tool or package is installed by the script
//! or fails the run; nothing is skipped.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How much longer than the guest's own timeout the host waits for the script
/// (building the initramfs, QEMU's exit) before it kills everything.
pub const HOST_MARGIN: Duration = Duration::from_secs(60);
/// Bound of [`prepare`]: a first run downloads the kernel package (about 100 MB)
/// and may install QEMU.
pub const PREPARE_TIMEOUT: Duration = Duration::from_secs(900);

/// The repository's root (the guest sees the same path).
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The harness script.
pub fn script() -> PathBuf {
    repo_root().join("scripts/vm.sh")
}

/// One command to run in the guest.
#[derive(Clone, Debug)]
pub struct VmCommand {
    /// The program and its arguments, run in the guest's chroot of the host's root.
    pub argv: Vec<String>,
    /// Variables set for it (the guest starts from an empty environment).
    pub env: Vec<(String, String)>,
    /// Its working directory (default: the repository root).
    pub cwd: PathBuf,
    /// The guest's timeout: QEMU is killed after it.
    pub timeout: Duration,
    /// Guest memory in MiB.
    pub mem_mib: u32,
    /// Extra kernel modules to load (the script always loads 9p, nbd and ext4).
    pub modules: Vec<String>,
}

impl VmCommand {
    /// `argv` in the repository root, 2 GiB of memory, a 5 minute timeout.
    pub fn new<I, S>(argv: I) -> VmCommand
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        VmCommand {
            argv: argv.into_iter().map(Into::into).collect(),
            env: Vec::new(),
            cwd: repo_root(),
            timeout: Duration::from_secs(300),
            mem_mib: 2048,
            modules: Vec::new(),
        }
    }

    /// Sets a variable for the command.
    pub fn env(mut self, name: &str, value: impl Into<String>) -> VmCommand {
        self.env.push((name.to_string(), value.into()));
        self
    }

    /// Sets the guest's timeout.
    pub fn timeout(mut self, timeout: Duration) -> VmCommand {
        self.timeout = timeout;
        self
    }
}

/// What a run gave.
#[derive(Debug)]
pub struct VmOutput {
    /// The script's exit status: the command's, 124 when the guest timed out,
    /// 125 when the harness failed.
    pub status: ExitStatus,
    /// The guest's console (the command's output and the kernel's), then the
    /// script's own messages (stderr).
    pub output: String,
    /// Wall time of the whole run, boot included.
    pub wall: Duration,
}

impl VmOutput {
    /// The exit code, if the script exited (rather than being killed).
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
}

/// Fetches and builds what the VM needs (cached; quick when it is there), so the
/// first run's download is not counted against a test's timeout.
pub fn prepare() -> Result<VmOutput, String> {
    let mut cmd = Command::new(script());
    cmd.arg("--prepare");
    let out = run_bounded_group(cmd, PREPARE_TIMEOUT)?;
    if out.code() != Some(0) {
        return Err(format!(
            "scripts/vm.sh --prepare failed ({}):\n{}",
            out.status, out.output
        ));
    }
    Ok(out)
}

/// Whether the guest died before it started the command: status 125 with the
/// harness's "no exit marker" and no "guest up" line (seen once under load:
/// QEMU exited 0 after 7.7 s). Nothing of the command ran, so running it again
/// in a fresh guest hides nothing about the code under test; the harness's
/// other failures (a missing package, an init that failed) are not retried.
fn failed_before_the_command(out: &VmOutput) -> bool {
    out.code() == Some(125)
        && out.output.contains("no exit marker from the guest")
        && !out.output.contains("flame-vm: guest up after")
}

/// Runs `command` in a fresh guest and returns its output and exit status. Err
/// only when the run could not be made or outlived its bound (the process group
/// is then killed); a command that fails is an Ok with its status. A guest that
/// died before it started the command is booted once more (said on stderr, with
/// the first console).
pub fn run(command: &VmCommand) -> Result<VmOutput, String> {
    let first = run_once(command)?;
    if !failed_before_the_command(&first) {
        return Ok(first);
    }
    eprintln!(
        "vm: the guest died before it ran the command; booting a fresh one once more. The first console:\n{}",
        first.output
    );
    run_once(command)
}

fn run_once(command: &VmCommand) -> Result<VmOutput, String> {
    let secs = command.timeout.as_secs().max(1);
    let mut cmd = Command::new(script());
    cmd.arg("--timeout")
        .arg(secs.to_string())
        .arg("--mem")
        .arg(command.mem_mib.to_string())
        .arg("--cwd")
        .arg(&command.cwd);
    for (name, value) in &command.env {
        cmd.arg("--env").arg(format!("{name}={value}"));
    }
    if !command.modules.is_empty() {
        cmd.arg("--modules").arg(command.modules.join(","));
    }
    cmd.arg("--").args(&command.argv);
    run_bounded_group(cmd, Duration::from_secs(secs) + HOST_MARGIN)
}

/// Runs `cmd` in its own process group, capturing stdout and stderr; kills the
/// whole group (the script and the QEMU it started) once `bound` has passed.
fn run_bounded_group(mut cmd: Command, bound: Duration) -> Result<VmOutput, String> {
    let desc = format!("{cmd:?}");
    let started = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("cannot run {desc}: {e}"))?;
    let pgid = child.id() as libc::pid_t;
    let readers = [
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    ]
    .map(|pipe| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut v);
            }
            v
        })
    });
    let deadline = started + bound;
    let (status, timed_out) = loop {
        match child.try_wait() {
            Ok(Some(status)) => break (status, false),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => {
                // SAFETY: killpg only sends a signal to the group this call made.
                unsafe { libc::killpg(pgid, libc::SIGKILL) };
                match child.wait() {
                    Ok(status) => break (status, true),
                    Err(e) => return Err(format!("cannot reap {desc}: {e}")),
                }
            }
            Err(e) => {
                // SAFETY: as above.
                unsafe { libc::killpg(pgid, libc::SIGKILL) };
                return Err(format!("cannot wait for {desc}: {e}"));
            }
        }
    };
    let mut output = String::new();
    for reader in readers {
        let bytes = reader.join().unwrap_or_default();
        output.push_str(&String::from_utf8_lossy(&bytes));
    }
    let wall = started.elapsed();
    if timed_out {
        return Err(format!(
            "{desc} did not finish within {bound:?}; its process group was killed. Output:\n{output}"
        ));
    }
    Ok(VmOutput {
        status,
        output,
        wall,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    fn out(code: i32, output: &str) -> VmOutput {
        VmOutput {
            status: ExitStatus::from_raw(code << 8),
            output: output.into(),
            wall: Duration::ZERO,
        }
    }

    #[test]
    fn only_a_guest_that_died_before_the_command_is_booted_again() {
        assert!(failed_before_the_command(&out(
            125,
            "SeaBIOS\nBooting from ROM...\nvm.sh: FAILED: no exit marker from the guest (QEMU exit status 0)"
        )));
        // The command ran: its failure is the test's, never retried.
        assert!(!failed_before_the_command(&out(
            125,
            "flame-vm: guest up after 4.2 s (kernel uptime), running the command\nvm.sh: FAILED: no exit marker from the guest (QEMU exit status 0)"
        )));
        assert!(!failed_before_the_command(&out(
            125,
            "vm.sh: FAILED: qemu-system-x86_64 is missing"
        )));
        assert!(!failed_before_the_command(&out(1, "")));
        assert!(!failed_before_the_command(&out(124, "")));
        assert!(!failed_before_the_command(&out(0, "")));
    }
}
