//! Misbehaving clients' tools: NBD by hand and a verifying fio run through
//! flame-nbd, shared by the tests that play them.

use crate::{output_text, require_tool, run_bounded};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

/// An NBD client negotiated by hand (fixed newstyle, `NBD_OPT_EXPORT_NAME`, no
/// zeroes), ready for transmission: what a misbehaving client needs.
pub fn nbd_raw_client(addr: std::net::SocketAddr, export: &str) -> TcpStream {
    use flame_client::nbd::proto;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).unwrap();
    assert_eq!(greeting[..8], proto::NBDMAGIC.to_be_bytes());
    assert_eq!(greeting[8..16], proto::IHAVEOPT.to_be_bytes());
    let mut hello = Vec::new();
    hello
        .extend_from_slice(&(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES).to_be_bytes());
    hello.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&proto::OPT_EXPORT_NAME.to_be_bytes());
    hello.extend_from_slice(&(export.len() as u32).to_be_bytes());
    hello.extend_from_slice(export.as_bytes());
    s.write_all(&hello).unwrap();
    let mut export_info = [0u8; 10];
    s.read_exact(&mut export_info).unwrap();
    s
}

/// An NBD request header.
pub fn nbd_request(cmd: u16, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
    let mut r = Vec::with_capacity(28);
    r.extend_from_slice(&flame_client::nbd::proto::REQUEST_MAGIC.to_be_bytes());
    r.extend_from_slice(&0u16.to_be_bytes());
    r.extend_from_slice(&cmd.to_be_bytes());
    r.extend_from_slice(&cookie.to_be_bytes());
    r.extend_from_slice(&offset.to_be_bytes());
    r.extend_from_slice(&len.to_be_bytes());
    r
}

/// fio's nbd engine against `uri`: random reads and writes of 16 KiB at queue
/// depth 16 over `size` bytes from `offset`, every block verified (crc32c,
/// fatal), within 120 s of I/O; panics with fio's output unless it succeeded
/// with no job error.
pub fn fio_randrw_verify(uri: &str, offset: &str, size: &str) {
    let out = run_bounded(
        Command::new(require_tool("fio")).args([
            "--name=flame-verify",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randrw",
            "--rwmixread=50",
            "--bs=16k",
            &format!("--offset={offset}"),
            &format!("--size={size}"),
            "--iodepth=16",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            // No verify state file in the working directory.
            "--verify_state_save=0",
            "--randrepeat=0",
            "--runtime=120",
        ]),
        Duration::from_secs(240),
    );
    let text = output_text(&out);
    assert!(out.status.success(), "fio failed:\n{text}");
    assert!(text.contains("err= 0"), "fio job errors:\n{text}");
}
