//! The process's RDMA device: opened once, with one protection domain, for every
//! connection, memory registration and completion queue of the process.
//!
//! Which device, port and GID index come from the environment
//! ([`DEVICE_ENV`], [`PORT_ENV`], [`GID_INDEX_ENV`]); without them the first device,
//! port 1 and GID index 0 are used. Opening fails with a message that names what is
//! missing (no verbs library, no device at all, the named device absent, the port
//! down), and the daemons refuse to start with it when `transport: rdma` is
//! configured.
//!
//! The context and protection domain are never closed: every verbs object Flame
//! creates borrows them, and one context per process for the life of the process is
//! what verbs applications do. They are leaked once, which gives the `'static`
//! borrows `sideway`'s lifetimes ask for.

use rdma_mummy_sys::{ibv_port_attr, ibv_query_port};
use sideway::ibverbs::address::Gid;
use sideway::ibverbs::completion::CompletionQueue;
use sideway::ibverbs::device::{DeviceInfo, DeviceList, GetDeviceListErrorKind};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use std::sync::OnceLock;

/// Environment variable naming the RDMA device to use (e.g. `mlx5_0`, `rxe0`).
pub const DEVICE_ENV: &str = "FLAME_RDMA_DEVICE";
/// Environment variable with the device port to use (default 1).
pub const PORT_ENV: &str = "FLAME_RDMA_PORT";
/// Environment variable with the GID index to use (default 0; RoCE v2 often needs
/// the index of the port's IPv4-mapped RoCE v2 GID, see `show_gids`).
pub const GID_INDEX_ENV: &str = "FLAME_RDMA_GID_INDEX";

/// One RDMA device as the verbs library reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaDevice {
    /// Kernel name, e.g. `mlx5_0`.
    pub name: String,
    /// Node GUID, hex.
    pub guid: String,
}

/// Lists RDMA devices. Without libibverbs or without devices this returns an error
/// or an empty list — never a panic — so callers can fall back to TCP.
pub fn devices() -> Result<Vec<RdmaDevice>, String> {
    let list = DeviceList::new().map_err(|e| format!("no RDMA support: {e}"))?;
    Ok(list
        .iter()
        .map(|d| RdmaDevice {
            name: d.name(),
            guid: format!("{:?}", d.guid()),
        })
        .collect())
}

/// Which device and port to open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaSettings {
    /// Device name; `None` = the first device.
    pub device: Option<String>,
    /// Port number (1-based).
    pub port: u8,
    /// GID table index of the port's address.
    pub gid_index: u8,
}

impl RdmaSettings {
    /// Reads [`DEVICE_ENV`], [`PORT_ENV`] and [`GID_INDEX_ENV`].
    pub fn from_env() -> Result<RdmaSettings, String> {
        let num = |var: &str, default: u8, min: u8| -> Result<u8, String> {
            match std::env::var(var) {
                Err(_) => Ok(default),
                Ok(v) => match v.trim().parse::<u8>() {
                    Ok(n) if n >= min => Ok(n),
                    _ => Err(format!("{var}={v:?}: must be a number {min}..=255")),
                },
            }
        };
        Ok(RdmaSettings {
            device: std::env::var(DEVICE_ENV)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty()),
            port: num(PORT_ENV, 1, 1)?,
            gid_index: num(GID_INDEX_ENV, 0, 0)?,
        })
    }
}

/// The opened device: context, protection domain and the port's addressing.
pub struct Device {
    /// Device context (leaked: lives as long as the process).
    pub ctx: &'static DeviceContext,
    /// The process's protection domain (leaked likewise).
    pub pd: &'static ProtectionDomain<'static>,
    /// Device name, for messages.
    pub name: String,
    /// Port used.
    pub port: u8,
    /// GID index used.
    pub gid_index: u8,
    /// The port's GID at that index.
    pub gid: Gid,
    /// The port's LID (0 on RoCE).
    pub lid: u16,
    /// The port's active MTU.
    pub mtu: Mtu,
    /// Outstanding RDMA READs a queue pair may have as initiator and as target
    /// (the device's limits, capped at [`READS_IN_FLIGHT_MAX`]).
    pub reads_in_flight: u8,
    /// The device's largest completion queue.
    pub cqe_max: u32,
    /// The device's largest queue pair work-request count.
    pub qp_wr_max: u32,
}

/// Cap on outstanding one-sided READs per queue pair (per direction).
pub const READS_IN_FLIGHT_MAX: u8 = 16;

static DEVICE: OnceLock<Result<Device, String>> = OnceLock::new();

/// The process's device, opened on first use with [`RdmaSettings::from_env`].
/// Every later call returns the same device or the same error.
pub fn device() -> Result<&'static Device, String> {
    DEVICE
        .get_or_init(|| RdmaSettings::from_env().and_then(|s| open(&s)))
        .as_ref()
        .map_err(Clone::clone)
}

/// Maps a verbs MTU code without panicking on values newer devices might report.
pub fn mtu_from_code(code: u32) -> Mtu {
    match code {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

/// The verbs code of an MTU (what [`super::wire::ConnInfo`] carries).
pub fn mtu_code(m: Mtu) -> u8 {
    match m {
        Mtu::Mtu256 => 1,
        Mtu::Mtu512 => 2,
        Mtu::Mtu1024 => 3,
        Mtu::Mtu2048 => 4,
        Mtu::Mtu4096 => 5,
    }
}

/// The RDMA devices the kernel lists (`/sys/class/infiniband`), sorted.
pub fn kernel_devices() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Why no device can be used, as one message naming the device and how to get one.
fn no_device(settings: &RdmaSettings, present: &[String]) -> String {
    let hint = "an RDMA NIC, or Soft-RoCE on an Ethernet interface: \
                `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0`";
    match &settings.device {
        Some(name) if present.is_empty() => format!(
            "transport rdma: RDMA device {name:?} ({DEVICE_ENV}) not found: this machine has \
             no RDMA device (/sys/class/infiniband is empty); needs {hint}"
        ),
        Some(name) => format!(
            "transport rdma: RDMA device {name:?} ({DEVICE_ENV}) not found; devices present: {}",
            present.join(", ")
        ),
        None => format!(
            "transport rdma: no RDMA device found (/sys/class/infiniband is empty); needs {hint}"
        ),
    }
}

/// Opens the device named by `settings` and allocates the protection domain.
pub fn open(settings: &RdmaSettings) -> Result<Device, String> {
    let list = match DeviceList::new() {
        Ok(l) => l,
        Err(e) => {
            let cause = match &e.0 {
                GetDeviceListErrorKind::Ibverbs(io) => io.to_string(),
                _ => e.to_string(),
            };
            // libibverbs answers "no device list" both when it is missing and when
            // the kernel has no RDMA device; the kernel's own list tells which.
            if kernel_devices().is_empty() {
                return Err(format!(
                    "{} (libibverbs: {cause})",
                    no_device(settings, &[])
                ));
            }
            return Err(format!(
                "transport rdma: cannot list RDMA devices ({cause}) although the kernel has \
                 {}: is libibverbs (rdma-core) installed?",
                kernel_devices().join(", ")
            ));
        }
    };
    let names: Vec<String> = list.iter().map(|d| d.name()).collect();
    let dev = match &settings.device {
        Some(want) => list.iter().find(|d| &d.name() == want),
        None => list.iter().next(),
    };
    let Some(dev) = dev else {
        return Err(no_device(settings, &names));
    };
    let name = dev.name();
    let ctx = dev
        .open()
        .map_err(|e| format!("transport rdma: cannot open RDMA device {name}: {e}"))?;
    // Leaked on purpose (see the module documentation): only ever once per process.
    let ctx: &'static DeviceContext = Box::leak(Box::new(ctx));
    // The port's LID is not exposed by sideway's `PortAttr`; the raw context pointer
    // is reachable through a completion queue (`ibv_cq.context`), so a one-entry
    // queue is made for the query and destroyed again.
    let probe =
        ctx.create_cq_builder().setup_cqe(1).build().map_err(|e| {
            format!("transport rdma: cannot create a completion queue on {name}: {e}")
        })?;
    let mut port_attr = std::mem::MaybeUninit::<ibv_port_attr>::zeroed();
    // SAFETY: `probe` is a live CQ whose `context` is the device context; the
    // attribute struct is writable and of the type the call fills.
    let rc = unsafe {
        let raw_ctx = (*probe.cq().as_ptr()).context;
        ibv_query_port(raw_ctx, settings.port, port_attr.as_mut_ptr())
    };
    drop(probe);
    if rc != 0 {
        return Err(format!(
            "transport rdma: RDMA device {name} has no port {} ({PORT_ENV}): {}",
            settings.port,
            std::io::Error::from_raw_os_error(rc)
        ));
    }
    // SAFETY: filled by a successful ibv_query_port (and zeroed before).
    let port_attr = unsafe { port_attr.assume_init() };
    // IBV_PORT_ACTIVE = 4.
    if port_attr.state != 4 {
        return Err(format!(
            "transport rdma: port {} of RDMA device {name} is not active (state {}): is its \
             link up?",
            settings.port, port_attr.state
        ));
    }
    let gid = ctx
        .query_gid(settings.port, u32::from(settings.gid_index))
        .map_err(|e| {
            format!(
                "transport rdma: RDMA device {name} port {} has no GID at index {} \
                 ({GID_INDEX_ENV}): {e}",
                settings.port, settings.gid_index
            )
        })?;
    let dev_attr = ctx
        .query_device()
        .map_err(|e| format!("transport rdma: cannot query RDMA device {name}: {e}"))?
        .attr
        .orig_attr;
    let reads = dev_attr
        .max_qp_rd_atom
        .min(dev_attr.max_qp_init_rd_atom)
        .clamp(1, i32::from(READS_IN_FLIGHT_MAX)) as u8;
    let pd = ctx.alloc_pd().map_err(|e| {
        format!("transport rdma: cannot allocate a protection domain on {name}: {e}")
    })?;
    let pd: &'static ProtectionDomain<'static> = Box::leak(Box::new(pd));
    tracing::info!(
        device = %name,
        port = settings.port,
        gid = %gid,
        lid = port_attr.lid,
        "RDMA device opened"
    );
    Ok(Device {
        ctx,
        pd,
        name,
        port: settings.port,
        gid_index: settings.gid_index,
        gid,
        lid: port_attr.lid,
        mtu: mtu_from_code(port_attr.active_mtu),
        reads_in_flight: reads,
        cqe_max: u32::try_from(dev_attr.max_cqe).unwrap_or(0),
        qp_wr_max: u32::try_from(dev_attr.max_qp_wr).unwrap_or(0),
    })
}

/// A memory region registered once for local access (a registered pool region):
/// one-sided operations on buffers inside it use its key instead of registering
/// the buffer for the operation.
#[derive(Clone, Copy, Debug)]
struct LocalRegion {
    base: usize,
    len: usize,
    lkey: u32,
}

/// Registered local regions, sorted by base. Readers (the data path) load a
/// snapshot without locking; registrations (rare: once per pool region) are
/// serialised by [`LOCAL_REGIONS_WRITE`].
static LOCAL_REGIONS: OnceLock<arc_swap::ArcSwap<Vec<LocalRegion>>> = OnceLock::new();
static LOCAL_REGIONS_WRITE: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

fn local_regions() -> &'static arc_swap::ArcSwap<Vec<LocalRegion>> {
    LOCAL_REGIONS.get_or_init(|| arc_swap::ArcSwap::from_pointee(Vec::new()))
}

/// Registers `len` bytes at `base` (a registered memory pool region, see
/// `crate::buffer`) with the device for local access, once; returns its local
/// key. The registration is never undone: pool regions live as long as the
/// process.
///
/// # Safety
/// `base..base + len` must be mapped memory that stays mapped for the life of the
/// process.
pub unsafe fn register_local_region(base: *const u8, len: usize) -> Result<u32, String> {
    let dev = device()?;
    let _w = LOCAL_REGIONS_WRITE.lock();
    let current = local_regions().load_full();
    if let Some(r) = current
        .iter()
        .find(|r| r.base == base as usize && r.len == len)
    {
        return Ok(r.lkey);
    }
    // SAFETY: the caller guarantees the memory stays mapped; the region is never
    // deregistered (forgotten below), which is sound for such memory.
    let mr = unsafe {
        dev.pd.reg_mr(
            base as usize,
            len,
            sideway::ibverbs::AccessFlags::LocalWrite,
        )
    }
    .map_err(|e| {
        format!(
            "cannot register a {len}-byte pool region with {}: {e}",
            dev.name
        )
    })?;
    let lkey = mr.lkey();
    std::mem::forget(mr);
    let mut next: Vec<LocalRegion> = current.as_ref().clone();
    next.push(LocalRegion {
        base: base as usize,
        len,
        lkey,
    });
    next.sort_by_key(|r| r.base);
    local_regions().store(std::sync::Arc::new(next));
    Ok(lkey)
}

/// The local key of a registered region that wholly contains `len` bytes at
/// `ptr`, if any.
pub fn local_lkey(ptr: *const u8, len: usize) -> Option<u32> {
    lookup(&local_regions().load(), ptr as usize, len)
}

/// The region of `regions` (sorted by base, not overlapping) that wholly contains
/// `p..p + len`.
fn lookup(regions: &[LocalRegion], p: usize, len: usize) -> Option<u32> {
    let i = regions.partition_point(|r| r.base <= p);
    let r = regions.get(i.checked_sub(1)?)?;
    let end = p.checked_add(len)?;
    (end <= r.base + r.len).then_some(r.lkey)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_discovery_matches_the_kernels_device_list() {
        // The kernel lists RDMA devices in /sys/class/infiniband (absent or empty on
        // a machine without RDMA, as in CI). Discovery must report exactly those
        // names, or fail with a clear reason only when there are none to find.
        let expected = kernel_devices();
        match devices() {
            Ok(list) => {
                let mut got: Vec<String> = list.iter().map(|d| d.name.clone()).collect();
                got.sort();
                assert_eq!(got, expected, "discovered {list:?}");
            }
            Err(e) => {
                assert!(e.starts_with("no RDMA support: "), "{e}");
                assert!(
                    expected.is_empty(),
                    "the kernel lists {expected:?} but discovery failed: {e}"
                );
            }
        }
    }

    /// Opening a device that is not there fails with a message naming it (this is
    /// what a daemon configured with `transport: rdma` prints before exiting).
    #[test]
    fn rdma_opening_a_missing_device_names_it() {
        let settings = RdmaSettings {
            device: Some("flame_no_such_dev9".into()),
            port: 1,
            gid_index: 0,
        };
        let e = match open(&settings) {
            Ok(_) => panic!("opened a device that does not exist"),
            Err(e) => e,
        };
        assert!(e.starts_with("transport rdma: "), "{e}");
        assert!(
            e.contains("\"flame_no_such_dev9\""),
            "the device is named: {e}"
        );
        if kernel_devices().is_empty() {
            assert!(e.contains("this machine has no RDMA device"), "{e}");
        } else {
            assert!(e.contains("devices present: "), "{e}");
        }
    }

    #[test]
    fn rdma_without_any_device_the_first_device_is_reported_missing() {
        if !kernel_devices().is_empty() {
            eprintln!("SKIP: this machine has RDMA devices; the no-device message cannot show");
            return;
        }
        let e = match open(&RdmaSettings {
            device: None,
            port: 1,
            gid_index: 0,
        }) {
            Ok(_) => panic!("opened a device on a machine without RDMA devices"),
            Err(e) => e,
        };
        assert!(e.starts_with("transport rdma: no RDMA device found"), "{e}");
    }

    #[test]
    fn rdma_local_region_lookup_needs_the_whole_buffer_inside_one_region() {
        let r = |base, len, lkey| LocalRegion { base, len, lkey };
        let regions = [r(4096, 8192, 1), r(65536, 4096, 2)];
        assert_eq!(lookup(&regions, 4096, 8192), Some(1), "exactly the region");
        assert_eq!(lookup(&regions, 8192, 4096), Some(1), "its tail");
        assert_eq!(lookup(&regions, 8192, 4097), None, "one byte beyond");
        assert_eq!(lookup(&regions, 0, 10), None, "before the first");
        assert_eq!(lookup(&regions, 20_000, 10), None, "between regions");
        assert_eq!(lookup(&regions, 65536 + 100, 100), Some(2));
        assert_eq!(lookup(&regions, 12_000, 60_000), None, "spanning two");
        assert_eq!(lookup(&regions, usize::MAX - 1, 10), None, "overflow");
        assert_eq!(lookup(&[], 4096, 1), None);
    }

    #[test]
    fn rdma_settings_reject_bad_numbers() {
        // Parsing only (the environment is process-wide: no set_var in tests).
        let s = RdmaSettings::from_env().unwrap_or(RdmaSettings {
            device: None,
            port: 1,
            gid_index: 0,
        });
        assert!(s.port >= 1);
        assert_eq!(mtu_code(mtu_from_code(3)), 3);
        assert_eq!(mtu_code(mtu_from_code(99)), 5);
    }
}
