//! flame-ublk in the test VM (`scripts/vm.sh --modules ublk_drv`: this machine's
//! kernel has no ublk driver). Everything runs inside the guest, on its own
//! loopback: flame-mgr, three flame-osd and flame-ublk from this build, the volume
//! as /dev/ublkb0, raw reads, writes, discard and write-zeroes, ext4 on top, and a
//! kill -9 of flame-ublk under the mounted file system with fio verifying, then
//! `flame-ublk --recover 0`. The guest's script is `tests/vm/ublk.sh`, which says
//! what it checks.

use flame_tests::bin_dir;
use flame_tests::vm::{self, VmCommand};
use std::time::Duration;

/// The guest's bound: the run takes about 90 s on two emulated cores.
const GUEST_TIMEOUT: Duration = Duration::from_secs(300);

#[test]
fn flame_ublk_raw_io_ext4_and_a_kill_9_recovered_under_a_mounted_fs_with_fio_verify() {
    for b in ["flame-mgr", "flame-osd", "flame-ublk", "flame-admin"] {
        assert!(
            bin_dir().join(b).is_file(),
            "{} missing: cargo build --workspace --bins --features flame-client/ublk first",
            bin_dir().join(b).display()
        );
    }
    let prep = vm::prepare().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{}", prep.output.trim_end());

    let bin = bin_dir().to_string_lossy().into_owned();
    let mut cmd = VmCommand::new(["bash", "tests/vm/ublk.sh"])
        .env("FLAME_BIN", bin)
        .env("RUST_BACKTRACE", "1")
        .timeout(GUEST_TIMEOUT);
    cmd.modules.push("ublk_drv".into());
    let out = vm::run(&cmd).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{}", out.output);
    eprintln!(
        "ublk_vm: the VM run took {:.1} s wall",
        out.wall.as_secs_f64()
    );
    assert_eq!(
        out.code(),
        Some(0),
        "tests/vm/ublk.sh failed in the VM ({}); its output is above",
        out.status
    );
    assert!(
        out.output.contains("\nublk: OK\n"),
        "the guest script exited 0 without its OK line; output above"
    );
}
