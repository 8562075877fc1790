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
    fn discovery_matches_the_kernels_device_list() {
        // The kernel lists RDMA devices in /sys/class/infiniband (absent or empty on
        // a machine without RDMA, as in CI). Discovery must report exactly those
        // names, or fail with a clear reason only when there are none to find.
        let mut expected: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        expected.sort();
        match super::devices() {
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
}
