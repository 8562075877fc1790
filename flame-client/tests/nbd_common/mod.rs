//! Shared helpers of the NBD integration tests: start `flame-nbd --memory` on a free
//! loopback port, run external clients with a deadline, and a minimal raw NBD client
//! for what real clients never send (garbage, stalls, bad options).

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]
#![allow(dead_code)]

use flame_client::nbd::proto::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A running `flame-nbd --memory` process; killed on drop.
pub struct NbdServer {
    child: Child,
    pub port: u16,
    pub metrics_port: u16,
    _dir: tempfile::TempDir,
}

/// A free loopback port (bound and released; fine for tests).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl NbdServer {
    /// Starts the server with the given `--memory` specs and extra YAML lines.
    pub fn start(memory: &[&str], extra_yaml: &str) -> NbdServer {
        let dir = tempfile::tempdir().unwrap();
        let metrics_port = free_port();
        let cfg = dir.path().join("nbd.yaml");
        std::fs::write(
            &cfg,
            format!(
                "listen: 127.0.0.1:0\ntcp_without_tls: true\nunix: null\nmetrics_listen: 127.0.0.1:{metrics_port}\nthreads: 2\n{extra_yaml}"
            ),
        )
        .unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_flame-nbd"));
        cmd.arg("--config").arg(&cfg);
        for m in memory {
            cmd.arg("--memory").arg(m);
        }
        let mut child = cmd
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start flame-nbd");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(l) => l,
            Err(_) => {
                let _ = child.kill();
                panic!("flame-nbd did not report its address within 10 s");
            }
        };
        let port: u16 = line
            .trim()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("unexpected flame-nbd output {line:?}"));
        NbdServer {
            child,
            port,
            metrics_port,
            _dir: dir,
        }
    }

    /// `nbd://127.0.0.1:PORT/NAME`.
    pub fn uri(&self, name: &str) -> String {
        format!("nbd://127.0.0.1:{}/{}", self.port, name)
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits (bounded) for the server to exit and returns its status.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let t0 = Instant::now();
        while t0.elapsed() < within {
            if let Some(st) = self.child.try_wait().unwrap() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Panics if the server process has exited.
    pub fn assert_alive(&mut self) {
        assert!(self.child.try_wait().unwrap().is_none(), "flame-nbd exited");
    }

    /// The `/metrics` text.
    pub fn metrics(&self) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", self.metrics_port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Panics (the test fails, it does not skip) if `tool` is not on PATH.
pub fn require(tool: &str) {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "required tool `{tool}` is missing: install qemu-utils, libnbd-bin, fio and python3-libnbd"
    );
}

/// Runs a command with a deadline; kills it and panics on timeout.
pub fn run(program: &str, args: &[&str], timeout: Duration) -> Output {
    require(program);
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    wait_output(child, program, timeout)
}

/// Waits for `child` with a deadline, collecting its output.
pub fn wait_output(child: Child, what: &str, timeout: Duration) -> Output {
    let pid = child.id() as i32;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(timeout) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            // SAFETY: signalling a child we spawned.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("{what} did not finish within {timeout:?}");
        }
    }
}

/// Runs and asserts success; returns stdout.
pub fn run_ok(program: &str, args: &[&str], timeout: Duration) -> String {
    let out = run(program, args, timeout);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{program} {args:?} failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    stdout
}

/// The Python interpreter that has the libnbd bindings (`python3-libnbd`).
pub fn python_with_nbd() -> String {
    for p in ["/usr/bin/python3", "python3"] {
        let ok = Command::new(p)
            .args(["-c", "import nbd"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if ok {
            return p.to_string();
        }
    }
    panic!("no python3 with the `nbd` module: install python3-libnbd");
}

/// A minimal NBD client speaking raw bytes.
pub struct Raw {
    pub s: TcpStream,
}

impl Raw {
    /// Connects (5 s read timeout so a wrong server hangs no test).
    pub fn connect(port: u16) -> Raw {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_nodelay(true).unwrap();
        Raw { s }
    }

    pub fn read_n(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.s.read_exact(&mut b).unwrap();
        b
    }

    fn u16(b: &[u8], at: usize) -> u16 {
        u16::from_be_bytes([b[at], b[at + 1]])
    }
    fn u32(b: &[u8], at: usize) -> u32 {
        u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
    }
    fn u64(b: &[u8], at: usize) -> u64 {
        u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
    }

    /// Reads the greeting and sends client flags.
    pub fn start(&mut self, client_flags: u32) {
        let g = self.read_n(18);
        assert_eq!(Self::u64(&g, 0), NBDMAGIC);
        assert_eq!(Self::u64(&g, 8), IHAVEOPT);
        assert_eq!(Self::u16(&g, 16), FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        self.s.write_all(&client_flags.to_be_bytes()).unwrap();
    }

    pub fn send_option(&mut self, opt: u32, data: &[u8]) {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&opt.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.s.write_all(&b).unwrap();
    }

    /// One option reply: (option, type, data).
    pub fn opt_reply(&mut self) -> (u32, u32, Vec<u8>) {
        let h = self.read_n(20);
        assert_eq!(Self::u64(&h, 0), OPT_REPLY_MAGIC);
        let len = Self::u32(&h, 16) as usize;
        assert!(len < 1 << 20);
        let d = self.read_n(len);
        (Self::u32(&h, 8), Self::u32(&h, 12), d)
    }

    pub fn info_data(name: &str, infos: &[u16]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        for i in infos {
            d.extend_from_slice(&i.to_be_bytes());
        }
        d
    }

    /// Full handshake ending with GO: returns (size, transmission flags).
    pub fn go(&mut self, name: &str, structured: bool) -> (u64, u16) {
        self.start(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
        if structured {
            self.send_option(OPT_STRUCTURED_REPLY, &[]);
            assert_eq!(self.opt_reply().1, REP_ACK);
        }
        self.send_option(OPT_GO, &Self::info_data(name, &[INFO_BLOCK_SIZE]));
        let mut export = None;
        loop {
            let (opt, ty, d) = self.opt_reply();
            assert_eq!(opt, OPT_GO);
            match ty {
                REP_INFO if Self::u16(&d, 0) == INFO_EXPORT => {
                    export = Some((Self::u64(&d, 2), Self::u16(&d, 10)))
                }
                REP_INFO => {}
                REP_ACK => break,
                other => panic!("GO failed with reply {other:#x}"),
            }
        }
        export.expect("no INFO_EXPORT")
    }

    pub fn request(
        &mut self,
        cmd: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        len: u32,
        data: &[u8],
    ) {
        let mut b = encode_request(&Request {
            flags,
            cmd,
            cookie,
            offset,
            len,
        })
        .to_vec();
        b.extend_from_slice(data);
        self.s.write_all(&b).unwrap();
    }

    /// A simple reply: (error, cookie).
    pub fn simple_reply(&mut self) -> (u32, u64) {
        let h = self.read_n(16);
        assert_eq!(Self::u32(&h, 0), SIMPLE_REPLY_MAGIC, "not a simple reply");
        (Self::u32(&h, 4), Self::u64(&h, 8))
    }

    /// A reply of either kind: (magic, flags, type, cookie, payload or error).
    /// For simple replies, `error` is returned in `ty` and no payload is read.
    pub fn any_reply(&mut self) -> (u32, u16, u32, u64, Vec<u8>) {
        let m = self.read_n(4);
        let magic = Self::u32(&m, 0);
        if magic == SIMPLE_REPLY_MAGIC {
            let r = self.read_n(12);
            (magic, 0, Self::u32(&r, 0), Self::u64(&r, 4), Vec::new())
        } else {
            assert_eq!(magic, STRUCTURED_REPLY_MAGIC, "bad reply magic");
            let r = self.read_n(16);
            let len = Self::u32(&r, 12) as usize;
            let p = self.read_n(len);
            (
                magic,
                Self::u16(&r, 0),
                u32::from(Self::u16(&r, 2)),
                Self::u64(&r, 4),
                p,
            )
        }
    }

    /// Asserts the server closes the connection within `within`.
    pub fn expect_closed(&mut self, within: Duration) {
        self.s.set_read_timeout(Some(within)).unwrap();
        let t0 = Instant::now();
        let mut b = [0u8; 4096];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return,
                Ok(_) => {}
                Err(e)
                    if e.kind() == std::io::ErrorKind::ConnectionReset
                        || e.kind() == std::io::ErrorKind::BrokenPipe =>
                {
                    return;
                }
                Err(e) => panic!("connection not closed after {:?}: {e}", t0.elapsed()),
            }
            assert!(
                t0.elapsed() < within,
                "connection not closed within {within:?}"
            );
        }
    }
}
