//! flame-nbd's NBD server hands a WRITE's payload to its backend in the aligned
//! payload buffer it received it into — one buffer of exactly the payload's size from
//! the thread's buffer pool, per WRITE — and sends a read's buffers to the client as
//! the backend returned them (several buffers make one reply).
//!
//! The server runs in this process with a recording backend and a counting buffer
//! pool installed on its reactor thread; a raw NBD client drives it over loopback.

mod nbd_common;

use flame_client::nbd::backend::{Backend, Errno, Exports, OpenError};
use flame_client::nbd::config::NbdConfig;
use flame_client::nbd::proto::*;
use flame_client::nbd::server::Server;
use flame_common::buffer::{BufferPool, HeapPool, PayloadBuf, RawBuf, set_thread_pool};
use flame_common::reactor::DIRECT_IO_ALIGN;
use nbd_common::Raw;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

/// Counts what the server thread allocates; memory from the heap pool.
#[derive(Default)]
struct CountingPool {
    allocs: AtomicUsize,
    bytes: AtomicUsize,
}

// SAFETY: delegates to the heap pool, which upholds the contract.
unsafe impl BufferPool for CountingPool {
    fn name(&self) -> &'static str {
        "counting"
    }
    fn allocate(&self, len: usize) -> Option<RawBuf> {
        self.allocs.fetch_add(1, Ordering::SeqCst);
        self.bytes.fetch_add(len, Ordering::SeqCst);
        HeapPool.allocate(len)
    }
    unsafe fn release(&self, raw: RawBuf, home: ThreadId) {
        // SAFETY: came from HeapPool::allocate (the caller's contract).
        unsafe { HeapPool.release(raw, home) }
    }
}

const SIZE: u64 = 64 << 20;

/// What the backend saw.
#[derive(Default)]
struct Seen {
    writes: Vec<(u64, PayloadBuf)>,
}

#[derive(Clone)]
struct Recording {
    seen: Arc<Mutex<Seen>>,
    /// What reads return: two buffers per read, the first `split` bytes and the rest.
    split: usize,
}

impl Backend for Recording {
    fn size(&self) -> u64 {
        SIZE
    }
    async fn read(&self, offset: u64, len: u32) -> Result<Vec<PayloadBuf>, Errno> {
        let bytes: Vec<u8> = (0..u64::from(len)).map(|i| pattern(offset + i)).collect();
        let whole = PayloadBuf::copy_from(&bytes);
        let cut = self.split.min(whole.len());
        Ok(vec![whole.slice(0..cut), whole.slice(cut..whole.len())])
    }
    async fn write(&self, offset: u64, data: PayloadBuf, _fua: bool) -> Result<(), Errno> {
        self.seen.lock().unwrap().writes.push((offset, data));
        Ok(())
    }
    async fn flush(&self) -> Result<(), Errno> {
        Ok(())
    }
    async fn trim(&self, _offset: u64, _len: u32, _fua: bool) -> Result<(), Errno> {
        Ok(())
    }
    async fn write_zeroes(&self, _offset: u64, _len: u32, _fua: bool) -> Result<(), Errno> {
        Ok(())
    }
}

impl Exports for Recording {
    type B = Recording;
    async fn list(&self) -> Result<Vec<String>, OpenError> {
        Ok(vec!["disk".into()])
    }
    async fn open(&self, _name: &str) -> Result<Recording, OpenError> {
        Ok(self.clone())
    }
}

fn pattern(at: u64) -> u8 {
    (at.wrapping_mul(31) >> 3) as u8
}

#[test]
fn write_payloads_arrive_in_their_own_aligned_pool_buffer_and_reads_leave_as_returned() {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let pool = Arc::new(CountingPool::default());
    let server = Server::bind(NbdConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        tcp_without_tls: true,
        unix: None,
        threads: 1,
        ..NbdConfig::default()
    })
    .unwrap();
    let port = server.local_addr().expect("tcp").port();
    let (exports, p) = (
        Recording {
            seen: seen.clone(),
            split: 4096,
        },
        pool.clone(),
    );
    std::thread::spawn(move || {
        server.run(move |_| {
            // Runs on the server's reactor thread: every payload buffer it allocates
            // comes from the counting pool.
            set_thread_pool(p.clone());
            exports.clone()
        })
    });

    let mut c = Raw::connect(port);
    c.go("disk", false);
    let handshake_allocs = pool.allocs.load(Ordering::SeqCst);
    // Small, large (a stream of large ones: the second's header is received alone),
    // odd-sized, and a large one after a small one.
    let writes: [(u64, usize); 6] = [
        (0, 4096),
        (1 << 20, 1 << 20),
        (2 << 20, 1 << 20),
        (7, 100),
        (8 << 20, 3 << 20),
        (40 << 20, 65536),
    ];
    // Pipelined: all requests first, then the replies.
    for (i, &(off, len)) in writes.iter().enumerate() {
        let data: Vec<u8> = (0..len as u64).map(|j| pattern(off + j)).collect();
        c.request(CMD_WRITE, 0, i as u64, off, len as u32, &data);
    }
    for _ in 0..writes.len() {
        assert_eq!(c.simple_reply().0, 0);
    }
    let seen_writes = std::mem::take(&mut seen.lock().unwrap().writes);
    assert_eq!(seen_writes.len(), writes.len());
    for (off, data) in &seen_writes {
        let &(_, len) = writes.iter().find(|w| w.0 == *off).unwrap();
        assert_eq!(data.len(), len);
        assert!(
            data.iter()
                .enumerate()
                .all(|(j, &b)| b == pattern(off + j as u64)),
            "payload at {off} differs"
        );
        assert_eq!(data.as_ptr() as usize % DIRECT_IO_ALIGN, 0, "unaligned");
        assert_eq!(data.pool_name(), Some("counting"), "not the pool's buffer");
        // Nobody else holds it: the server kept no copy or reference.
        assert_eq!(data.ref_count(), 1);
    }
    // One buffer per WRITE, of exactly its payload's size: no staging buffer.
    assert_eq!(
        pool.allocs.load(Ordering::SeqCst) - handshake_allocs,
        writes.len()
    );
    assert_eq!(
        pool.bytes.load(Ordering::SeqCst),
        writes.iter().map(|w| w.1).sum::<usize>()
    );

    // A read answered with two buffers arrives as one reply, in order.
    c.request(CMD_READ, 0, 99, 12_345, 10_000, &[]);
    assert_eq!(c.simple_reply(), (0, 99));
    let got = c.read_n(10_000);
    assert!(
        got.iter()
            .enumerate()
            .all(|(j, &b)| b == pattern(12_345 + j as u64))
    );
    c.request(CMD_DISC, 0, 100, 0, 0, &[]);
}
