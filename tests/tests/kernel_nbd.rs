//! The Linux kernel's NBD client against a real Flame cluster, in the test VM
//! (`scripts/vm.sh`: this machine's kernel has no nbd module). Everything runs
//! inside the guest, on its own loopback: flame-mgr, three flame-osd and
//! flame-nbd from this build, `nbd-client` and `qemu-nbd -c` on /dev/nbd0, ext4 on
//! top, a kill -9 and restart of flame-nbd under the mounted file system. The
//! guest's script is `tests/vm/kernel_nbd.sh`, which says what it checks.

use flame_tests::bin_dir;
use flame_tests::vm::{self, VmCommand};
use std::time::Duration;

/// The guest's bound: the run takes about 95 s on two emulated cores.
const GUEST_TIMEOUT: Duration = Duration::from_secs(300);

#[test]
fn kernel_nbd_client_mkfs_mount_and_a_flame_nbd_restart_under_a_mounted_ext4() {
    for b in ["flame-mgr", "flame-osd", "flame-nbd", "flame-admin"] {
        assert!(
            bin_dir().join(b).is_file(),
            "{} missing: cargo build --workspace --bins first",
            bin_dir().join(b).display()
        );
    }
    let prep = vm::prepare().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{}", prep.output.trim_end());

    let bin = bin_dir().to_string_lossy().into_owned();
    let cmd = VmCommand::new(["bash", "tests/vm/kernel_nbd.sh"])
        .env("FLAME_BIN", bin)
        .env("RUST_BACKTRACE", "1")
        .timeout(GUEST_TIMEOUT);
    let out = vm::run(&cmd).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{}", out.output);
    eprintln!(
        "kernel_nbd: the VM run took {:.1} s wall",
        out.wall.as_secs_f64()
    );
    assert_eq!(
        out.code(),
        Some(0),
        "tests/vm/kernel_nbd.sh failed in the VM ({}); its output is above",
        out.status
    );
    assert!(
        out.output.contains("\nkernel_nbd: OK\n"),
        "the guest script exited 0 without its OK line; output above"
    );
}
