//! Property test of flame-nbd's negotiation state machine (`src/nbd/handshake.rs`)
//! and of the transmission phase it hands over to, over a real socket: a client
//! byte stream built from valid options (`EXPORT_NAME`, `ABORT`, `LIST`, `INFO`,
//! `GO`, `STRUCTURED_REPLY`, `STARTTLS`, unknown ones) and requests, then mutated
//! (bits flipped, bytes inserted, deleted, the stream cut short), or arbitrary
//! bytes after the client flags. For every stream the server must answer with its
//! greeting, then close the connection once the client has sent everything and
//! shut its side (no hang: bounded by a read timeout), never panic (its thread must
//! still be running), and still negotiate normally with the next client.
//!
//! Seeded and bounded (200 streams, about a second in the debug profile);
//! `PROPTEST_CASES` / `PROPTEST_RNG_SEED` override for a longer run. The byte
//! decoders themselves are property-tested in `src/nbd/proto.rs`; the cargo-fuzz
//! target is `fuzz/fuzz_targets/nbd.rs`.

use flame_client::nbd::proto::*;
use flame_client::nbd::{MemoryExports, NbdConfig, Server};
use flame_common::fuzzing::props::config;
use flame_common::fuzzing::{Mutation, mutate};
use proptest::prelude::*;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::OnceLock;
use std::thread::JoinHandle;
use std::time::Duration;

/// Longer than any answer takes; reaching it means the server hangs on a stream
/// the client has finished.
const CLOSE_WITHIN: Duration = Duration::from_secs(10);

struct Running {
    port: u16,
    thread: JoinHandle<std::io::Result<()>>,
}

/// One in-process server (one reactor thread) for every case.
fn server() -> &'static Running {
    static SERVER: OnceLock<Running> = OnceLock::new();
    SERVER.get_or_init(|| {
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
        let thread = std::thread::spawn(move || server.run(move |_| exports.clone()));
        Running { port, thread }
    })
}

/// Sends `stream`, shuts the write side and reads until the server closes.
fn exchange(stream: &[u8]) -> Vec<u8> {
    let s = server();
    let mut c = TcpStream::connect(("127.0.0.1", s.port)).expect("connect");
    c.set_read_timeout(Some(CLOSE_WITHIN)).expect("timeout");
    // The server may close before reading everything (a protocol violation): a
    // failed write is an answer too.
    let _ = c.write_all(stream);
    let _ = c.shutdown(Shutdown::Write);
    let mut out = Vec::new();
    let mut buf = [0u8; 64 << 10];
    loop {
        match c.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("server did not close within {CLOSE_WITHIN:?}: {e}"),
        }
    }
    assert!(
        !s.thread.is_finished(),
        "the server thread ended (a panic?)"
    );
    out
}

fn option(opt: u32, data: &[u8]) -> Vec<u8> {
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

fn info_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

/// One step of a client: an option of the negotiation or a request after it.
fn step() -> impl Strategy<Value = Vec<u8>> {
    let name = prop_oneof![Just("disk"), Just("ro"), Just(""), Just("nope")];
    let infos = proptest::collection::vec(prop_oneof![0u16..4, any::<u16>()], 0..4);
    prop_oneof![
        name.clone()
            .prop_map(|n| option(OPT_EXPORT_NAME, n.as_bytes())),
        Just(option(OPT_ABORT, &[])),
        Just(option(OPT_LIST, &[])),
        Just(option(OPT_STRUCTURED_REPLY, &[])),
        Just(option(OPT_STARTTLS, &[])),
        (name.clone(), infos.clone()).prop_map(|(n, i)| option(OPT_INFO, &info_data(n, &i))),
        (name, infos).prop_map(|(n, i)| option(OPT_GO, &info_data(n, &i))),
        (any::<u32>(), proptest::collection::vec(any::<u8>(), 0..16))
            .prop_map(|(o, d)| option(o, &d)),
        (0u16..8, any::<u16>(), 0u64..(1 << 20), 0u32..8192).prop_map(
            |(cmd, flags, offset, len)| {
                let mut b = encode_request(&Request {
                    flags: flags & 0x1f,
                    cmd,
                    cookie: 7,
                    offset,
                    len,
                })
                .to_vec();
                if cmd == CMD_WRITE {
                    b.resize(b.len() + len as usize, 0xab);
                }
                b
            }
        ),
    ]
}

fn client_stream() -> impl Strategy<Value = Vec<u8>> {
    let flags = prop_oneof![Just(3u32), Just(1), Just(0), any::<u32>()];
    let built = (
        flags.clone(),
        proptest::collection::vec(step(), 0..8),
        proptest::collection::vec(any::<(u8, u32, u8)>(), 0..4),
    )
        .prop_map(|(f, steps, m): (u32, Vec<Vec<u8>>, Vec<Mutation>)| {
            let mut b = f.to_be_bytes().to_vec();
            for s in steps {
                b.extend_from_slice(&s);
            }
            mutate(&mut b, &m);
            b
        });
    let arbitrary =
        (flags, proptest::collection::vec(any::<u8>(), 0..200)).prop_map(|(f, rest)| {
            let mut b = f.to_be_bytes().to_vec();
            b.extend_from_slice(&rest);
            b
        });
    prop_oneof![4 => built, 1 => arbitrary]
}

/// This file's proptest seed (`config`).
const SEED: u64 = 0xf1a3_0003;

proptest! {
    #![proptest_config(config(200, SEED))]

    #[test]
    fn negotiation_answers_or_closes_on_any_client_stream(stream in client_stream()) {
        let out = exchange(&stream);
        prop_assert_eq!(&out[..GREETING_LEN.min(out.len())], &encode_greeting()[..]);
    }
}

/// After everything above (in any order), a well-behaved client still gets its
/// export: nothing a broken client sent leaked into another connection.
#[test]
fn a_normal_client_negotiates_after_hostile_ones() {
    for stream in [vec![0u8; 3], vec![0xff; 40], option(OPT_GO, &[0, 0, 0, 9])] {
        exchange(&stream);
    }
    let mut b = 3u32.to_be_bytes().to_vec();
    b.extend_from_slice(&option(OPT_GO, &info_data("disk", &[])));
    let out = exchange(&b);
    // Greeting, then INFO_EXPORT (size 1 MiB), block size, ACK.
    let first = &out[GREETING_LEN..];
    assert_eq!(&first[0..8], &OPT_REPLY_MAGIC.to_be_bytes());
    assert_eq!(&first[12..16], &REP_INFO.to_be_bytes());
    assert_eq!(&first[22..30], &(1u64 << 20).to_be_bytes());
}
