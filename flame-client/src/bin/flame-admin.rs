//! `flame-admin`: administer a Flame cluster (see `flame_client::admin`).
//!
//! ```text
//! flame-admin status
//! flame-admin volume create demo --size 10G
//! flame-admin --json osd ls
//! flame-admin bench demo --rw randwrite --bs 4k --iodepth 32 --runtime 10s
//! ```

fn main() -> std::process::ExitCode {
    flame_common::logging::init();
    flame_client::admin::main()
}
