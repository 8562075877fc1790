//! flame-nbd spoken to in raw bytes: every option and command, and the malformed
//! inputs real clients never send.

mod nbd_common;

use flame_client::nbd::proto::*;
use nbd_common::*;
use std::io::Write;
use std::time::Duration;

#[test]
fn options_every_kind_and_errors() {
    let mut srv = NbdServer::start(&["disk=1M", "ro=64K:ro"], "");
    let mut r = Raw::connect(srv.port);
    r.start(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    // Unknown options: ERR_UNSUP, and negotiation goes on.
    for opt in [
        0u32,
        4,
        99,
        0xffff_ffff,
        OPT_LIST_META_CONTEXT,
        OPT_SET_META_CONTEXT,
        OPT_EXTENDED_HEADERS,
    ] {
        r.send_option(opt, b"abc");
        let (o, ty, _) = r.opt_reply();
        assert_eq!((o, ty), (opt, REP_ERR_UNSUP));
    }
    // STARTTLS: policy refusal.
    r.send_option(OPT_STARTTLS, &[]);
    assert_eq!(r.opt_reply().1, REP_ERR_POLICY);
    // LIST with data is invalid; without, one SERVER per export then ACK.
    r.send_option(OPT_LIST, b"x");
    assert_eq!(r.opt_reply().1, REP_ERR_INVALID);
    r.send_option(OPT_LIST, &[]);
    let mut names = Vec::new();
    loop {
        let (o, ty, d) = r.opt_reply();
        assert_eq!(o, OPT_LIST);
        if ty == REP_ACK {
            break;
        }
        assert_eq!(ty, REP_SERVER);
        let n = u32::from_be_bytes(d[0..4].try_into().unwrap()) as usize;
        names.push(String::from_utf8(d[4..4 + n].to_vec()).unwrap());
    }
    assert_eq!(names, ["disk", "ro"]);
    // Over-long option data: read and dropped, ERR_TOO_BIG, and the session goes on.
    r.send_option(77, &vec![0u8; 200 << 10]);
    assert_eq!(r.opt_reply().1, REP_ERR_TOO_BIG);
    // INFO: malformed, unknown export, then a full answer.
    r.send_option(OPT_INFO, &[0, 0, 0, 9, b'd']);
    assert_eq!(r.opt_reply().1, REP_ERR_INVALID);
    r.send_option(OPT_INFO, &Raw::info_data("nope", &[]));
    let (_, ty, msg) = r.opt_reply();
    assert_eq!(ty, REP_ERR_UNKNOWN);
    assert!(String::from_utf8_lossy(&msg).contains("nope"));
    r.send_option(
        OPT_INFO,
        &Raw::info_data("ro", &[INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE, 1234]),
    );
    let mut got = Vec::new();
    loop {
        let (o, ty, d) = r.opt_reply();
        assert_eq!(o, OPT_INFO);
        if ty == REP_ACK {
            break;
        }
        assert_eq!(ty, REP_INFO);
        got.push(d);
    }
    let export = got
        .iter()
        .find(|d| d[0..2] == INFO_EXPORT.to_be_bytes())
        .unwrap();
    assert_eq!(export.len(), 12);
    assert_eq!(
        u64::from_be_bytes(export[2..10].try_into().unwrap()),
        64 << 10
    );
    let flags = u16::from_be_bytes(export[10..12].try_into().unwrap());
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    assert_ne!(flags & TFLAG_HAS_FLAGS, 0);
    assert_eq!(flags & TFLAG_SEND_DF, 0, "DF without structured replies");
    let name = got
        .iter()
        .find(|d| d[0..2] == INFO_NAME.to_be_bytes())
        .unwrap();
    assert_eq!(&name[2..], b"ro");
    assert!(
        got.iter()
            .any(|d| d[0..2] == INFO_DESCRIPTION.to_be_bytes())
    );
    let bs = got
        .iter()
        .find(|d| d[0..2] == INFO_BLOCK_SIZE.to_be_bytes())
        .unwrap();
    assert_eq!(bs.len(), 14);
    // STRUCTURED_REPLY with data is invalid; without, ACK.
    r.send_option(OPT_STRUCTURED_REPLY, b"x");
    assert_eq!(r.opt_reply().1, REP_ERR_INVALID);
    r.send_option(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(r.opt_reply().1, REP_ACK);
    // GO on an unknown export fails softly; GO on a real one enters transmission.
    r.send_option(OPT_GO, &Raw::info_data("nope", &[]));
    assert_eq!(r.opt_reply().1, REP_ERR_UNKNOWN);
    r.send_option(OPT_GO, &Raw::info_data("disk", &[]));
    let mut flags = 0;
    loop {
        let (_, ty, d) = r.opt_reply();
        if ty == REP_ACK {
            break;
        }
        if d[0..2] == INFO_EXPORT.to_be_bytes() {
            flags = u16::from_be_bytes(d[10..12].try_into().unwrap());
        }
    }
    assert_ne!(flags & TFLAG_SEND_DF, 0);
    assert_ne!(flags & TFLAG_CAN_MULTI_CONN, 0);
    // A structured read works.
    r.request(CMD_READ, CMD_FLAG_DF, 5, 0, 16, &[]);
    let (magic, f, ty, cookie, p) = r.any_reply();
    assert_eq!(magic, STRUCTURED_REPLY_MAGIC);
    assert_eq!(
        (f, ty, cookie),
        (REPLY_FLAG_DONE, u32::from(REPLY_TYPE_OFFSET_DATA), 5)
    );
    assert_eq!(p.len(), 8 + 16);
    r.request(CMD_DISC, 0, 6, 0, 0, &[]);
    r.expect_closed(Duration::from_secs(3));
    srv.assert_alive();
}

#[test]
fn abort_and_bad_handshakes() {
    let mut srv = NbdServer::start(&["disk=1M"], "");
    // ABORT: ACK then close.
    let mut r = Raw::connect(srv.port);
    r.start(FLAG_C_FIXED_NEWSTYLE);
    r.send_option(OPT_ABORT, &[]);
    assert_eq!(r.opt_reply().1, REP_ACK);
    r.expect_closed(Duration::from_secs(3));
    // Unknown client flag: dropped.
    let mut r = Raw::connect(srv.port);
    r.start(1 << 5);
    r.expect_closed(Duration::from_secs(3));
    // Bad option magic: dropped.
    let mut r = Raw::connect(srv.port);
    r.start(FLAG_C_FIXED_NEWSTYLE);
    r.s.write_all(&[0u8; 16]).unwrap();
    r.expect_closed(Duration::from_secs(3));
    // EXPORT_NAME of an unknown export: hard disconnect (no way to reply).
    let mut r = Raw::connect(srv.port);
    r.start(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    r.send_option(OPT_EXPORT_NAME, b"nope");
    r.expect_closed(Duration::from_secs(3));
    // Hostile option length: dropped without reading 4 GiB.
    let mut r = Raw::connect(srv.port);
    r.start(FLAG_C_FIXED_NEWSTYLE);
    let mut h = IHAVEOPT.to_be_bytes().to_vec();
    h.extend_from_slice(&OPT_INFO.to_be_bytes());
    h.extend_from_slice(&u32::MAX.to_be_bytes());
    r.s.write_all(&h).unwrap();
    r.expect_closed(Duration::from_secs(3));
    // EXPORT_NAME of a known export, with and without the 124 zero bytes.
    for no_zeroes in [true, false] {
        let mut r = Raw::connect(srv.port);
        r.start(if no_zeroes { 3 } else { 1 });
        r.send_option(OPT_EXPORT_NAME, b"disk");
        let d = r.read_n(10);
        assert_eq!(u64::from_be_bytes(d[0..8].try_into().unwrap()), 1 << 20);
        if !no_zeroes {
            assert_eq!(r.read_n(124), vec![0u8; 124]);
        }
        r.request(CMD_WRITE, 0, 1, 0, 3, b"abc");
        assert_eq!(r.simple_reply(), (0, 1));
        r.request(CMD_READ, 0, 2, 0, 3, &[]);
        assert_eq!(r.simple_reply(), (0, 2));
        assert_eq!(r.read_n(3), b"abc");
    }
    srv.assert_alive();
}

#[test]
fn transmission_errors_simple_replies() {
    let mut srv = NbdServer::start(&["disk=1M", "ro=64K:ro"], "");
    let mut r = Raw::connect(srv.port);
    let (size, _) = r.go("disk", false);
    assert_eq!(size, 1 << 20);
    let cases: &[(u16, u16, u64, u32, u32)] = &[
        // (cmd, flags, offset, len, errno)
        (CMD_READ, 0, (1 << 20) - 1, 2, errno::EINVAL),
        (CMD_READ, 0, u64::MAX - 1, 4, errno::EINVAL),
        (CMD_READ, CMD_FLAG_DF, 0, 1, errno::EINVAL), // DF needs structured replies
        (CMD_READ, 1 << 12, 0, 1, errno::EINVAL),     // unknown flag
        (CMD_TRIM, 0, 1 << 20, 1, errno::EINVAL),
        (CMD_WRITE_ZEROES, 0, 1 << 20, 1, errno::ENOSPC),
        (CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 1, errno::EINVAL),
        (CMD_FLUSH, 0, 1, 0, errno::EINVAL),
        (CMD_BLOCK_STATUS, 0, 0, 1, errno::EINVAL),
        (200, 0, 0, 1, errno::EINVAL),
        (CMD_READ, 0, 0, PAYLOAD_BYTES_MAX + 1, errno::EOVERFLOW),
    ];
    for (i, &(cmd, flags, off, len, want)) in cases.iter().enumerate() {
        r.request(cmd, flags, 100 + i as u64, off, len, &[]);
        assert_eq!(
            r.simple_reply(),
            (want, 100 + i as u64),
            "cmd {cmd} flags {flags:#x} offset {off} len {len}"
        );
    }
    // A write past the end: its payload is consumed, ENOSPC, stream stays in sync.
    r.request(CMD_WRITE, 0, 7, (1 << 20) - 2, 4, b"wxyz");
    assert_eq!(r.simple_reply(), (errno::ENOSPC, 7));
    // A write with an unknown flag: same.
    r.request(CMD_WRITE, 1 << 7, 8, 0, 4, b"wxyz");
    assert_eq!(r.simple_reply(), (errno::EINVAL, 8));
    // FUA is accepted on every command.
    r.request(CMD_WRITE, CMD_FLAG_FUA, 9, 10, 4, b"abcd");
    assert_eq!(r.simple_reply(), (0, 9));
    r.request(CMD_FLUSH, CMD_FLAG_FUA, 10, 0, 0, &[]);
    assert_eq!(r.simple_reply(), (0, 10));
    r.request(CMD_CACHE, CMD_FLAG_FUA, 11, 0, 4096, &[]);
    assert_eq!(r.simple_reply(), (0, 11));
    r.request(CMD_READ, CMD_FLAG_FUA, 12, 10, 4, &[]);
    assert_eq!(r.simple_reply(), (0, 12));
    assert_eq!(r.read_n(4), b"abcd");
    // WRITE_ZEROES with NO_HOLE and TRIM read back as zeroes.
    r.request(
        CMD_WRITE_ZEROES,
        CMD_FLAG_NO_HOLE | CMD_FLAG_FUA,
        13,
        11,
        2,
        &[],
    );
    assert_eq!(r.simple_reply(), (0, 13));
    r.request(CMD_READ, 0, 14, 10, 4, &[]);
    assert_eq!(r.simple_reply(), (0, 14));
    assert_eq!(r.read_n(4), b"a\0\0d");
    // Zero-length requests are harmless.
    r.request(CMD_READ, 0, 15, 0, 0, &[]);
    assert_eq!(r.simple_reply(), (0, 15));
    // An over-long write payload cannot be skipped safely: disconnect.
    r.request(CMD_WRITE, 0, 16, 0, PAYLOAD_BYTES_MAX + 1, &[]);
    r.expect_closed(Duration::from_secs(3));
    // Read-only export: writes refused with EPERM.
    let mut r = Raw::connect(srv.port);
    let (_, flags) = r.go("ro", false);
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    r.request(CMD_WRITE, 0, 1, 0, 2, b"no");
    assert_eq!(r.simple_reply(), (errno::EPERM, 1));
    r.request(CMD_TRIM, 0, 2, 0, 2, &[]);
    assert_eq!(r.simple_reply(), (errno::EPERM, 2));
    r.request(CMD_WRITE_ZEROES, 0, 3, 0, 2, &[]);
    assert_eq!(r.simple_reply(), (errno::EPERM, 3));
    r.request(CMD_READ, 0, 4, 0, 2, &[]);
    assert_eq!(r.simple_reply(), (0, 4));
    assert_eq!(r.read_n(2), [0, 0]);
    srv.assert_alive();
}

#[test]
fn structured_replies_errors_and_pipelining() {
    let mut srv = NbdServer::start(&["disk=64M"], "");
    let mut r = Raw::connect(srv.port);
    r.go("disk", true);
    // Read errors come as ERROR chunks (never a simple reply for READ).
    r.request(CMD_READ, 0, 1, 64 << 20, 1, &[]);
    let (magic, f, ty, cookie, p) = r.any_reply();
    assert_eq!(magic, STRUCTURED_REPLY_MAGIC);
    assert_eq!(
        (f, ty, cookie),
        (REPLY_FLAG_DONE, u32::from(REPLY_TYPE_ERROR), 1)
    );
    assert_eq!(
        u32::from_be_bytes(p[0..4].try_into().unwrap()),
        errno::EINVAL
    );
    let mlen = u16::from_be_bytes(p[4..6].try_into().unwrap()) as usize;
    assert_eq!(p.len(), 6 + mlen);
    // Pipelined: 64 writes of distinct 64 KiB patterns, then 64 reads; every reply
    // matched by cookie, every read returns its pattern.
    let n = 64u64;
    let mut batch = Vec::new();
    for i in 0..n {
        let data = vec![i as u8 + 1; 64 << 10];
        batch.extend_from_slice(&encode_request(&Request {
            flags: if i % 3 == 0 { CMD_FLAG_FUA } else { 0 },
            cmd: CMD_WRITE,
            cookie: 1000 + i,
            offset: i * (64 << 10),
            len: 64 << 10,
        }));
        batch.extend_from_slice(&data);
    }
    r.s.write_all(&batch).unwrap();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..n {
        let (_, _, err, cookie, _) = r.any_reply();
        assert_eq!(err, 0);
        assert!((1000..1000 + n).contains(&cookie));
        assert!(seen.insert(cookie), "duplicate reply {cookie}");
    }
    for i in 0..n {
        r.request(CMD_READ, 0, 5000 + i, i * (64 << 10), 64 << 10, &[]);
    }
    let mut seen = std::collections::HashSet::new();
    for _ in 0..n {
        let (magic, f, ty, cookie, p) = r.any_reply();
        assert_eq!(magic, STRUCTURED_REPLY_MAGIC);
        assert_eq!(
            (f, ty),
            (REPLY_FLAG_DONE, u32::from(REPLY_TYPE_OFFSET_DATA))
        );
        let i = cookie - 5000;
        assert!(i < n && seen.insert(cookie));
        assert_eq!(
            u64::from_be_bytes(p[0..8].try_into().unwrap()),
            i * (64 << 10)
        );
        assert!(
            p[8..].iter().all(|&b| b == i as u8 + 1),
            "read {i} wrong data"
        );
        assert_eq!(p.len(), 8 + (64 << 10));
    }
    // A 32 MiB request (the advertised maximum) works.
    let big = vec![0x77u8; PAYLOAD_BYTES_MAX as usize];
    r.request(CMD_WRITE, 0, 9, 0, PAYLOAD_BYTES_MAX, &big);
    assert_eq!(r.any_reply().3, 9);
    r.request(CMD_READ, 0, 10, 0, PAYLOAD_BYTES_MAX, &[]);
    let (_, _, _, cookie, p) = r.any_reply();
    assert_eq!(cookie, 10);
    assert!(p.len() == 8 + big.len() && p[8..] == big[..]);
    // A zero-length structured read is a single NONE chunk.
    r.request(CMD_READ, 0, 11, 0, 0, &[]);
    let (_, f, ty, cookie, p) = r.any_reply();
    assert_eq!(
        (f, ty, cookie),
        (REPLY_FLAG_DONE, u32::from(REPLY_TYPE_NONE), 11)
    );
    assert!(p.is_empty());
    // DISC after pipelined writes: they are answered before the close.
    r.request(CMD_WRITE, 0, 20, 0, 4, b"last");
    r.request(CMD_DISC, 0, 21, 0, 0, &[]);
    assert_eq!(r.any_reply().3, 20);
    r.expect_closed(Duration::from_secs(3));
    let mut r2 = Raw::connect(srv.port);
    r2.go("disk", false);
    r2.request(CMD_READ, 0, 1, 0, 4, &[]);
    assert_eq!(r2.simple_reply(), (0, 1));
    assert_eq!(r2.read_n(4), b"last");
    srv.assert_alive();
}
