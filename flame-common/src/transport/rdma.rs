//! RDMA (feature `rdma`, crate `sideway`): device discovery.
//!
//! This is the foundation the RDMA transport builds on in the transports issue:
//! `sideway` loads libibverbs at run time, so a build with this feature runs on
//! machines without RDMA hardware and simply finds no device. The verbs-shaped
//! [`super::Conn`] interface is what the RDMA queue pairs will implement.

use sideway::ibverbs::device::{DeviceInfo, DeviceList};

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

#[cfg(test)]
mod tests {
    #[test]
    fn discovery_reports_devices_or_a_clear_reason() {
        // Without hardware (CI) this is an empty list or a "no RDMA support" error;
        // with hardware, every device must have a name.
        match super::devices() {
            Ok(list) => assert!(list.iter().all(|d| !d.name.is_empty()), "{list:?}"),
            Err(e) => assert!(e.starts_with("no RDMA support: "), "{e}"),
        }
    }
}
