//! `flame-ublk`: a Flame volume as a Linux block device, `/dev/ublkbN`, through
//! ublk, the kernel's user-space block driver (`ublk_drv`, Linux 6.0+).
//!
//! * [`config`] — YAML settings (flame-nbd's cluster and transport keys, plus the
//!   device's: volume, queues, depth, request size).
//! * [`export`] — the control plane: add the device (or take over an existing
//!   one after a crash: user recovery), set its parameters, start the queue
//!   threads, start it, stop and delete it on SIGTERM. Uses libublk's control
//!   commands (`UblkCtrl`, `UblkDev`).
//! * [`queue`] — the data plane, one thread per queue on Flame's reactor: the
//!   ublk fetch/commit commands and the OSD sockets on one io_uring.
//!
//! The device is created with `UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_REISSUE`:
//! when the process dies (kill -9, a crash) the kernel keeps `/dev/ublkbN`,
//! quiesces it and holds new I/O; `flame-ublk --recover N` reattaches a new
//! process, and the requests the dead one had not answered are issued again to
//! it. A mounted file system sees a pause, not an error.

pub mod config;
pub mod export;
pub(crate) mod queue;

/// The kernel's ublk ABI (`include/uapi/linux/ublk_cmd.h`), as libublk binds it.
pub use libublk::sys;

pub use config::UblkConfig;
pub use export::{DeviceFound, Mode, UblkError, probe_device, run};
