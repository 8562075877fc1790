//! Fuzzes flame-nbd (`flame-client/src/nbd/`): the byte decoders of `proto.rs`
//! (client flags, option headers, INFO/GO data, requests, and `validate` on what
//! they decode), and the whole negotiation state machine and transmission phase of
//! an in-process server: the input, after its first byte, is what a client sends
//! (then it shuts its side). The server must close the connection, never panic
//! (libFuzzer aborts on a panic in any thread) and never hang (a read timeout).
//! Input byte 0 picks the client flags sent first (or none: raw bytes).
//! Property tests: `proto.rs` (`props`) and `flame-client/tests/nbd_handshake_props.rs`.
#![no_main]

use flame_client::nbd::proto::*;
use flame_client::nbd::{MemoryExports, NbdConfig, Server};
use libfuzzer_sys::fuzz_target;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

fn port() -> u16 {
    static PORT: OnceLock<u16> = OnceLock::new();
    *PORT.get_or_init(|| {
        let server = Server::bind(NbdConfig {
            listen: Some("127.0.0.1:0".parse().expect("address")),
            tcp_without_tls: true,
            unix: None,
            threads: 1,
            ..NbdConfig::default()
        })
        .expect("bind");
        let port = server.local_addr().expect("tcp").port();
        let exports = MemoryExports::new(vec![
            ("disk".into(), 1 << 20, false),
            ("ro".into(), 64 << 10, true),
        ]);
        std::thread::spawn(move || server.run(move |_| exports.clone()));
        port
    })
}

fn decoders(data: &[u8]) {
    if let Some(b) = data.get(..4) {
        let _ = decode_client_flags(&[b[0], b[1], b[2], b[3]]);
    }
    if let Some(b) = data.get(..OPTION_HEADER_LEN) {
        let mut a = [0u8; OPTION_HEADER_LEN];
        a.copy_from_slice(b);
        let _ = decode_option_header(&a);
    }
    if let Ok(r) = decode_info_request(data) {
        assert!(r.name.len() <= STRING_BYTES_MAX);
    }
    if let Some(b) = data.get(..REQUEST_LEN) {
        let mut a = [0u8; REQUEST_LEN];
        a.copy_from_slice(b);
        a[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        if let Ok(r) = decode_request(&a) {
            for size in [0, 1 << 20, u64::MAX] {
                let s = SessionInfo {
                    size,
                    read_only: r.cookie & 1 == 1,
                    structured: r.cookie & 2 == 2,
                };
                let _ = validate(&r, &s);
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    decoders(rest);
    let mut stream = match mode % 4 {
        0 => Vec::new(),
        m => u32::from(m - 1).to_be_bytes().to_vec(),
    };
    stream.extend_from_slice(rest);
    let mut c = TcpStream::connect(("127.0.0.1", port())).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let _ = c.write_all(&stream);
    let _ = c.shutdown(Shutdown::Write);
    let mut buf = [0u8; 64 << 10];
    let mut got = 0usize;
    loop {
        match c.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the server did not close the connection: {e}"),
        }
    }
    assert!(got >= GREETING_LEN, "no greeting");
});
