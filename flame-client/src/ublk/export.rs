//! The control plane of flame-ublk: add or recover the device, run its queues,
//! stop it.
//!
//! Start-up (a new device): `ADD_DEV` with `UBLK_F_USER_RECOVERY |
//! UBLK_F_USER_RECOVERY_REISSUE`, the parameters (size, 512 B logical and 4 KiB
//! physical blocks, a volatile cache with FUA so the kernel sends FLUSH and FUA,
//! discard and write-zeroes), one thread per queue that maps the queue's
//! descriptors and fetches every tag, then `START_DEV`, which returns once every
//! tag of every queue is fetched.
//!
//! Recovery (`--recover N`): the old process is gone and the kernel has quiesced
//! device N (it does so within its monitor period, about 5 s, of the death).
//! `START_USER_RECOVERY` (retried while the kernel still answers EBUSY: the old
//! process's descriptors not yet released, or the device not yet quiesced), the
//! same queue threads with the device's own queue count and depth, then
//! `END_USER_RECOVERY` with our pid: the device is live again and the requests
//! the old process had fetched but not committed are issued again.
//!
//! Stop (SIGTERM/SIGINT): `STOP_DEV` (the kernel drains the requests in flight,
//! which the queue threads keep serving, then aborts every fetch), the threads
//! end, `DEL_DEV`. A queue thread that fails exits the process without deleting
//! the device, so that it can be recovered.

use super::config::UblkConfig;
use super::queue::{Descriptors, Queue, serve_tag};
use super::sys;
use crate::nbd::metrics::{Bridge, OpMetrics};
use crate::{ClientError, Cluster};
use flame_common::reactor::{self, Reactor, ReactorConfig};
use libublk::UblkFlags;
use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::UblkDev;
use std::io;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

/// Add a new device, or take over an existing one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Add a device (`dev_id` from the configuration, -1 = the kernel picks).
    Add,
    /// Reattach to device N, left by a process that died.
    Recover(u32),
}

/// What the kernel holds as ublk device N ([`probe_device`], `GET_DEV_INFO`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceFound {
    /// No such device.
    Absent,
    /// A device: started (`LIVE`) or not (quiesced after its server died,
    /// or never started), and whether the process recorded as serving it
    /// still exists.
    Present {
        /// State `UBLK_S_DEV_LIVE`.
        live: bool,
        /// The serving process the kernel recorded (`ublksrv_pid`).
        server: i32,
        /// Whether that process exists.
        server_alive: bool,
    },
}

impl Mode {
    /// How to attach device `id` whichever way it is (`flame-ublk --device`,
    /// what a service manager restarting it runs): add it when the kernel has
    /// no such device (with `dev_id` = `id`); refuse when it is live and its
    /// server is alive (another flame-ublk serves it: taking it over would
    /// wait 30 s for nothing, then fail, in a restart loop); otherwise take it
    /// over (quiesced after its server died, or live with a dead server, which
    /// the kernel quiesces shortly).
    pub fn for_device(id: u32, found: DeviceFound) -> Result<Mode, String> {
        match found {
            DeviceFound::Absent => Ok(Mode::Add),
            DeviceFound::Present {
                live: true,
                server,
                server_alive: true,
            } => Err(format!(
                "ublk device {id} is live and served by process {server}: stop that one first"
            )),
            DeviceFound::Present { .. } => Ok(Mode::Recover(id)),
        }
    }
}

/// Asks the kernel about ublk device `id` (`GET_DEV_INFO`): absent when it
/// answers ENODEV.
pub fn probe_device(id: u32) -> Result<DeviceFound, UblkError> {
    let Ok(n) = i32::try_from(id) else {
        return Err(UblkError::Recover(id, "is not a ublk device number".into()));
    };
    match UblkCtrl::new_simple(n) {
        Ok(c) => {
            let info = c.dev_info();
            let server = info.ublksrv_pid;
            Ok(DeviceFound::Present {
                live: u32::from(info.state) == sys::UBLK_S_DEV_LIVE,
                server,
                server_alive: server > 0
                    && std::path::Path::new(&format!("/proc/{server}")).exists(),
            })
        }
        Err(libublk::UblkError::UringIOError(e) | libublk::UblkError::OtherError(e))
            if e.abs() == libc::ENODEV =>
        {
            Ok(DeviceFound::Absent)
        }
        Err(e) => Err(ctrl_err(format!(
            "asking the kernel about ublk device {id}"
        ))(e)),
    }
}

/// Why the export could not run.
#[derive(Debug, thiserror::Error)]
pub enum UblkError {
    /// The volume does not exist, or the cluster could not be asked.
    #[error("volume {0}: {1}")]
    Volume(String, ClientError),
    /// A ublk control command failed.
    #[error("{what}: {err:?}{hint}")]
    Control {
        /// What was being done.
        what: String,
        /// libublk's error.
        err: libublk::UblkError,
        /// A hint for the operator (may be empty).
        hint: &'static str,
    },
    /// The device to recover does not match (size, flags, state).
    #[error("device {0}: {1}")]
    Recover(u32, String),
    /// Threads, memory or the kernel refused something else.
    #[error("{0}")]
    Io(#[from] io::Error),
}

fn ctrl_err(what: impl Into<String>) -> impl FnOnce(libublk::UblkError) -> UblkError {
    let what = what.into();
    move |err| {
        let hint = match &err {
            libublk::UblkError::IOError(e) if e.kind() == io::ErrorKind::NotFound => {
                " (no /dev/ublk-control: load the ublk_drv module, Linux 6.0+)"
            }
            libublk::UblkError::IOError(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                " (ublk devices need root, or CAP_SYS_ADMIN)"
            }
            _ => "",
        };
        UblkError::Control { what, err, hint }
    }
}

/// Largest discard or write-zeroes request the kernel sends (it splits larger).
const DISCARD_BYTES_MAX: u32 = 64 << 20;
/// How often the control thread checks for a stop signal.
const SIGNAL_POLL: Duration = Duration::from_millis(500);

/// The device parameters of a volume of `size` bytes.
fn params(size: u64, max_io_bytes: u32) -> sys::ublk_params {
    sys::ublk_params {
        types: sys::UBLK_PARAM_TYPE_BASIC | sys::UBLK_PARAM_TYPE_DISCARD,
        basic: sys::ublk_param_basic {
            // FLUSH and FUA reach us: Flame acknowledges a write once every copy
            // applied it, and makes it stable with FLUSH (or FUA), as a disk with
            // a volatile cache does.
            attrs: sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA,
            logical_bs_shift: 9,
            physical_bs_shift: 12,
            io_opt_shift: 12,
            io_min_shift: 12,
            max_sectors: max_io_bytes >> 9,
            dev_sectors: size >> 9,
            ..Default::default()
        },
        discard: sys::ublk_param_discard {
            discard_granularity: 4096,
            max_discard_sectors: DISCARD_BYTES_MAX >> 9,
            max_write_zeroes_sectors: DISCARD_BYTES_MAX >> 9,
            max_discard_segments: 1,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Device flags: user recovery with reissue (see the module's documentation).
const CTRL_FLAGS: u64 = (sys::UBLK_F_USER_RECOVERY
    | sys::UBLK_F_USER_RECOVERY_REISSUE
    | sys::UBLK_F_CMD_IOCTL_ENCODE) as u64;

/// Runs the export of `config.volume` until SIGTERM/SIGINT (`signals`, blocked
/// in every thread) or a failure. `on_started` is called once the device is live,
/// with its block device's path.
pub fn run(
    config: &UblkConfig,
    mode: Mode,
    cluster: Cluster,
    signals: Option<libc::sigset_t>,
    on_started: impl FnOnce(&str, u32),
) -> Result<(), UblkError> {
    let name = config.volume.clone();
    let info = match cluster.volume_info(&name) {
        Some(v) => v,
        None => {
            let map = cluster
                .refresh_map_blocking()
                .map_err(|e| UblkError::Volume(name.clone(), e))?;
            map.volumes.get(&name).cloned().ok_or_else(|| {
                UblkError::Volume(name.clone(), ClientError::NoSuchVolume(name.clone()))
            })?
        }
    };
    let size = info.size;

    let (ctrl, queues, depth, max_io) = match mode {
        Mode::Add => {
            let ctrl = UblkCtrlBuilder::default()
                .name("flame")
                .id(config.dev_id)
                .nr_queues(config.queues)
                .depth(config.queue_depth)
                .io_buf_bytes(config.max_io_bytes)
                .ctrl_flags(CTRL_FLAGS)
                .dev_flags(UblkFlags::UBLK_DEV_F_ADD_DEV)
                .build()
                .map_err(ctrl_err("adding the ublk device"))?;
            (ctrl, config.queues, config.queue_depth, config.max_io_bytes)
        }
        Mode::Recover(id) => recover_ctrl(id, size)?,
    };
    let dev_id = ctrl.dev_info().dev_id;
    let volume_name = name.clone();
    let dev = UblkDev::new(
        "flame".to_string(),
        |d: &mut UblkDev| {
            d.tgt.dev_size = size;
            d.tgt.params = params(size, max_io);
            d.set_target_json(serde_json::json!({ "flame": { "volume": volume_name } }));
            Ok(())
        },
        &ctrl,
    )
    .map_err(ctrl_err(format!("opening /dev/ublkc{dev_id}")))?;
    let cdev = dev.tgt.fds[0];

    let pool = Arc::new(flame_common::buffer::registered::PoolInstaller::new(
        &config.memory_pool,
        usize::from(queues),
    )?);
    std::thread::scope(|s| -> Result<(), UblkError> {
        let mut handles = Vec::new();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<u16>();
        for q_id in 0..queues {
            let pool = pool.clone();
            let cluster = cluster.clone();
            let name = name.clone();
            let ready = ready_tx.clone();
            let poll_mode = config.poll_mode;
            let h = std::thread::Builder::new()
                .name(format!("ublk-q{q_id}"))
                .spawn_scoped(s, move || {
                    let res = queue_thread(
                        q_id, depth, max_io, cdev, pool, cluster, &name, poll_mode, ready,
                    );
                    if let Err(e) = &res {
                        // The device stays for `--recover`: the kernel quiesces it
                        // once this process is gone.
                        eprintln!(
                            "flame-ublk: queue {q_id} failed: {e}; exiting, /dev/ublkb{dev_id} is left for `flame-ublk --recover {dev_id}`"
                        );
                        std::process::exit(1);
                    }
                })?;
            handles.push(h);
        }
        drop(ready_tx);
        // Every queue has its volume open and its fetches queued (a queue that
        // fails first exits the process).
        for _ in 0..queues {
            if ready_rx.recv().is_err() {
                return Err(UblkError::Io(io::Error::other(
                    "a queue thread ended before it was ready",
                )));
            }
            dev.notify_buffer_registration_complete(false);
        }
        // Returns once every tag of every queue is fetched (START_DEV, or
        // END_USER_RECOVERY when recovering).
        let what = match mode {
            Mode::Add => format!("starting /dev/ublkb{dev_id}"),
            Mode::Recover(_) => format!("ending the recovery of /dev/ublkb{dev_id}"),
        };
        if let Err(e) = ctrl.start_dev(&dev) {
            // The queue threads hold fetch commands on the char device, so neither
            // they nor DEL_DEV (which waits for the device to be released) would
            // return: exit, which releases everything, and name what is left.
            eprintln!(
                "flame-ublk: {}; exiting: delete the device if it is still listed (/dev/ublkc{dev_id})",
                ctrl_err(what)(e)
            );
            std::process::exit(1);
        }
        on_started(&ctrl.get_bdev_path(), dev_id);
        // Until asked to stop. Without a signal set (blocking failed) the default
        // dispositions end the process: the device is then left for recovery.
        loop {
            let sig = match &signals {
                Some(set) => crate::bridge::wait_signal(set, SIGNAL_POLL),
                None => {
                    flame_common::clock::sleep_blocking(SIGNAL_POLL);
                    None
                }
            };
            if let Some(sig) = sig {
                tracing::info!(signal = sig, "stopping /dev/ublkb{dev_id}");
                break;
            }
        }
        ctrl.stop_dev()
            .map_err(ctrl_err(format!("stopping /dev/ublkb{dev_id}")))?;
        for h in handles {
            let _ = h.join();
        }
        Ok(())
    })?;
    // DEL_DEV waits until the char device is released: close ours first.
    drop(dev);
    ctrl.del_dev()
        .map_err(ctrl_err(format!("deleting /dev/ublkb{dev_id}")))?;
    tracing::info!("/dev/ublkb{dev_id} deleted");
    Ok(())
}

/// Checks device `id` can be taken over for a volume of `size` bytes, and starts
/// its recovery. Returns its control handle, queue count, depth and request size.
fn recover_ctrl(id: u32, size: u64) -> Result<(UblkCtrl, u16, u16, u32), UblkError> {
    let Ok(n) = i32::try_from(id) else {
        return Err(UblkError::Recover(id, "is not a ublk device number".into()));
    };
    let probe = UblkCtrl::new_simple(n).map_err(ctrl_err(format!("opening ublk device {id}")))?;
    let info = probe.dev_info();
    if info.flags & u64::from(sys::UBLK_F_USER_RECOVERY) == 0 {
        return Err(UblkError::Recover(
            id,
            "was not created with user recovery (UBLK_F_USER_RECOVERY)".into(),
        ));
    }
    if u32::from(info.state) == sys::UBLK_S_DEV_LIVE {
        // START_USER_RECOVERY would answer EBUSY for 30 s, then fail.
        tracing::info!("device {id} is still live: waiting for the kernel to quiesce it");
    }
    let mut p = sys::ublk_params::default();
    probe.get_params(&mut p).map_err(ctrl_err(format!(
        "reading the parameters of ublk device {id}"
    )))?;
    if p.basic.dev_sectors != size >> 9 {
        return Err(UblkError::Recover(
            id,
            format!(
                "has {} bytes, the volume {size}: not this volume's device",
                p.basic.dev_sectors << 9
            ),
        ));
    }
    let (queues, depth, max_io) = (info.nr_hw_queues, info.queue_depth, info.max_io_buf_bytes);
    drop(probe);
    let ctrl = UblkCtrlBuilder::default()
        .name("flame")
        .id(n)
        .nr_queues(queues)
        .depth(depth)
        .io_buf_bytes(max_io)
        .ctrl_flags(CTRL_FLAGS)
        .dev_flags(UblkFlags::UBLK_DEV_F_RECOVER_DEV)
        .build()
        .map_err(ctrl_err(format!("opening ublk device {id} for recovery")))?;
    let started = ctrl
        .start_user_recover()
        .map_err(ctrl_err(format!("START_USER_RECOVERY of ublk device {id}")))?;
    // libublk answers a device that stayed busy for its 30 s as Ok(-EBUSY).
    if started < 0 {
        return Err(UblkError::Recover(
            id,
            format!(
                "START_USER_RECOVERY failed: {} (another process still holds it?)",
                io::Error::from_raw_os_error(-started)
            ),
        ));
    }
    tracing::info!(queues, depth, "recovering /dev/ublkb{id}");
    Ok((ctrl, queues, depth, max_io))
}

/// One queue's thread: its reactor, its volume handle, a task per tag.
#[allow(clippy::too_many_arguments)]
fn queue_thread(
    q_id: u16,
    depth: u16,
    max_io: u32,
    cdev: i32,
    pool: Arc<flame_common::buffer::registered::PoolInstaller>,
    cluster: Cluster,
    volume: &str,
    poll_mode: flame_common::reactor::PollMode,
    ready: std::sync::mpsc::Sender<u16>,
) -> Result<(), UblkError> {
    // Payloads for the OSDs and their read replies come from this thread's pool.
    pool.install()?;
    let mut r = Reactor::new(ReactorConfig {
        poll_mode,
        ..ReactorConfig::default()
    })?;
    let name = volume.to_string();
    r.block_on(async move {
        let volume = cluster
            .open_volume(&name)
            .await
            .map_err(|e| UblkError::Volume(name.clone(), e))?;
        let descs = Descriptors::map(cdev, q_id, depth)?;
        let q = Rc::new(Queue {
            q_id,
            cdev,
            descs,
            volume,
            buf_bytes: max_io as usize,
            metrics: OpMetrics::of(Bridge::Ublk),
        });
        let tasks: Vec<_> = (0..depth)
            .map(|tag| reactor::spawn(serve_tag(q.clone(), tag)))
            .collect();
        // The fetches are queued on this thread's ring and reach the kernel at the
        // reactor's next submission, before START_DEV can complete.
        let _ = ready.send(q_id);
        for t in tasks {
            t.await?;
        }
        tracing::debug!(q_id, "queue stopped");
        Ok::<(), UblkError>(())
    })?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_is_added_taken_over_or_refused_by_what_the_kernel_holds() {
        assert_eq!(Mode::for_device(3, DeviceFound::Absent), Ok(Mode::Add));
        // Its server died: quiesced, or still live until the kernel notices.
        for live in [false, true] {
            let found = DeviceFound::Present {
                live,
                server: 77,
                server_alive: false,
            };
            assert_eq!(Mode::for_device(3, found), Ok(Mode::Recover(3)));
        }
        // Another flame-ublk serves it.
        let served = DeviceFound::Present {
            live: true,
            server: 77,
            server_alive: true,
        };
        let e = Mode::for_device(3, served).unwrap_err();
        assert!(e.contains("served by process 77"), "{e}");
    }
}
