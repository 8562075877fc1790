//! Loopback addresses and network partitions for test clusters.
//!
//! Every cluster started with [`crate::ClusterOptions::per_daemon_addrs`] gets a
//! /24 of its own inside 127.0.0.0/8 (`127.A.B.0/24`, A in 100..=115), leased with
//! an exclusive `flock` on a lock file in the temporary directory for the life of
//! the cluster. Two clusters — in one test binary or in two binaries running at the
//! same time, e.g. two worktrees' test suites on one machine — therefore never share
//! an address, and an iptables rule naming one cluster's addresses cannot cut
//! another run's traffic. The kernel drops the lock when the process dies, so a
//! killed run frees its subnet.
//!
//! A [`Partition`] drops loopback traffic of one address with iptables rules that
//! carry a comment unique to the partition (`flame-test:127.A.B:<pid>:<n>`), and
//! deletes exactly those rules when dropped (also while a test panics). A run
//! killed before its drop leaves a marker file next to the subnet's lock file; the
//! next run that leases the subnet deletes every rule tagged with that subnet
//! before it uses it.

use crate::{output_text, require_tool};
use flame_common::placement::mix64;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

/// Lowest second byte of a leased subnet: 127.0.x.x and the low ranges stay free
/// for tests on fixed addresses (127.0.0.1) and for the host (127.0.0.53 ...).
const NET_A_MIN: u64 = 100;
/// Number of /24 subnets to choose from (127.100.0.0 .. 127.115.255.0): plenty
/// for the clusters of every test run on one machine, and a bound on the lock
/// files left in the temporary directory (one empty file per subnet ever used; a
/// lock file is never deleted, as deleting it would let two processes lock two
/// different files of the same name).
const NETS: u64 = 16 * 256;
/// Subnets tried before giving up (each try is one open + one non-blocking lock).
const LEASE_TRIES_MAX: u64 = NETS;

/// Makes every lease attempt and every partition of this process distinct.
static COUNTER: AtomicU64 = AtomicU64::new(0);

fn lock_dir() -> PathBuf {
    std::env::temp_dir().join("flame-test-nets")
}

/// A /24 of loopback addresses held by this process until dropped.
#[derive(Debug)]
pub struct NetLease {
    a: u8,
    b: u8,
    /// Holds the flock; closing the file releases the subnet.
    _lock: File,
}

impl NetLease {
    /// Leases a free subnet: candidates are drawn from the process id, a counter
    /// and the clock, and the first whose lock file can be locked wins. Rules a
    /// killed earlier holder left behind are deleted first.
    pub fn acquire() -> NetLease {
        let dir = lock_dir();
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        // Linear probing from a start drawn from the process id and a counter:
        // every free subnet is found, and concurrent runs start far apart.
        let start =
            mix64(u64::from(std::process::id()) << 32 ^ COUNTER.fetch_add(1, Ordering::Relaxed));
        for attempt in 0..LEASE_TRIES_MAX {
            let n = start.wrapping_add(attempt) % NETS;
            let (a, b) = ((NET_A_MIN + n / 256) as u8, (n % 256) as u8);
            if let Some(lease) = NetLease::try_lease(a, b) {
                return lease;
            }
        }
        panic!("no free loopback subnet among the {NETS} /24s from 127.{NET_A_MIN}.0.0");
    }

    /// Leases `127.a.b.0/24` if no one holds it (sweeping rules a killed earlier
    /// holder left), `None` if it is held.
    fn try_lease(a: u8, b: u8) -> Option<NetLease> {
        let path = lock_dir().join(format!("127.{a}.{b}.lock"));
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(false)
            .open(&path)
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
        match file.try_lock() {
            Ok(()) => {
                let lease = NetLease { a, b, _lock: file };
                lease.sweep_stale_rules();
                Some(lease)
            }
            Err(TryLockError::WouldBlock) => None,
            Err(TryLockError::Error(e)) => panic!("cannot lock {}: {e}", path.display()),
        }
    }

    /// `127.A.B.host`.
    pub fn ip(&self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(127, self.a, self.b, host)
    }

    /// The tag every iptables rule on this subnet's addresses carries.
    fn tag(&self) -> String {
        format!("flame-test:127.{}.{}:", self.a, self.b)
    }

    /// Marker files of partitions on this subnet: present while (or because) their
    /// rules may be installed.
    fn markers(&self) -> Vec<PathBuf> {
        let prefix = format!("127.{}.{}.", self.a, self.b);
        fs::read_dir(lock_dir())
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| {
                        let name = e.file_name().to_string_lossy().into_owned();
                        name.starts_with(&prefix) && name.ends_with(".iptables")
                    })
                    .map(|e| e.path())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Deletes the rules a killed earlier holder of this subnet left: we hold the
    /// lock, so no live partition can be using them.
    fn sweep_stale_rules(&self) {
        let markers = self.markers();
        if markers.is_empty() {
            return;
        }
        let tag = self.tag();
        let listed = Command::new("iptables").args(["-S", "INPUT"]).output();
        if let Ok(out) = listed {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if !line.contains(&tag) {
                    continue;
                }
                let mut args: Vec<String> = line
                    .split_whitespace()
                    .map(|t| t.trim_matches('"').to_string())
                    .collect();
                if args.first().map(String::as_str) != Some("-A") {
                    continue;
                }
                args[0] = "-D".into();
                let _ = Command::new("iptables").args(&args).output();
                eprintln!("removed a stale test iptables rule: {line}");
            }
        }
        for m in markers {
            let _ = fs::remove_file(m);
        }
    }
}

/// Loopback traffic of one address dropped with iptables (root needed) until this
/// value is dropped. Build one with [`crate::TestCluster::isolate_osd`] or
/// [`crate::TestCluster::partition`].
#[derive(Debug)]
pub struct Partition {
    rules: Vec<Vec<String>>,
    marker: PathBuf,
}

impl Partition {
    /// Installs `rules` (each an iptables rule spec for the INPUT chain, without
    /// the comment) tagged for `lease`.
    pub(crate) fn install(lease: &NetLease, specs: Vec<Vec<String>>) -> Partition {
        let iptables = require_tool("iptables");
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let comment = format!("{}{pid}:{n}", lease.tag());
        let marker = lock_dir().join(format!("127.{}.{}.{pid}.{n}.iptables", lease.a, lease.b));
        // The marker goes first: a run killed between the insert and the drop
        // leaves it, and the next lease of this subnet sweeps the rules.
        fs::write(&marker, comment.as_bytes())
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", marker.display()));
        let mut p = Partition {
            rules: Vec::new(),
            marker,
        };
        for spec in specs {
            let mut rule = vec!["INPUT".to_string()];
            rule.extend(spec);
            rule.extend(
                ["-m", "comment", "--comment", &comment, "-j", "DROP"]
                    .iter()
                    .map(|s| s.to_string()),
            );
            let out = Command::new(&iptables)
                .arg("-I")
                .args(&rule)
                .output()
                .unwrap_or_else(|e| panic!("cannot run iptables: {e}"));
            assert!(
                out.status.success(),
                "iptables -I {rule:?} failed (root needed): {}",
                output_text(&out)
            );
            p.rules.push(rule);
        }
        p
    }

    /// Drops traffic between `ip` and each of `others`, both ways.
    pub(crate) fn between(lease: &NetLease, ip: Ipv4Addr, others: &[Ipv4Addr]) -> Partition {
        let specs = others
            .iter()
            .flat_map(|o| [(ip, *o), (*o, ip)])
            .map(|(s, d)| {
                ["-i", "lo", "-s", &s.to_string(), "-d", &d.to_string()]
                    .iter()
                    .map(|x| x.to_string())
                    .collect()
            })
            .collect();
        Partition::install(lease, specs)
    }

    /// Drops every loopback packet from or to `ip` except its traffic with itself:
    /// the host behind `ip` is cut off from everything, whatever address the other
    /// side uses (also clients left on 127.0.0.1).
    pub(crate) fn isolate(lease: &NetLease, ip: Ipv4Addr) -> Partition {
        let ip = ip.to_string();
        let spec = |a: &str, b: &str| -> Vec<String> {
            ["-i", "lo", a, &ip, "!", b, &ip]
                .iter()
                .map(|x| x.to_string())
                .collect()
        };
        Partition::install(lease, vec![spec("-s", "-d"), spec("-d", "-s")])
    }

    /// The iptables comment of this partition's rules.
    pub fn comment(&self) -> Option<&str> {
        let rule = self.rules.first()?;
        let i = rule.iter().position(|x| x == "--comment")?;
        rule.get(i + 1).map(String::as_str)
    }

    /// Removes the rules now (the same as dropping the value).
    pub fn heal(self) {}
}

impl Drop for Partition {
    fn drop(&mut self) {
        let mut all_gone = true;
        for rule in self.rules.drain(..) {
            let ok = Command::new("iptables")
                .arg("-D")
                .args(&rule)
                .output()
                .is_ok_and(|o| o.status.success());
            if !ok {
                all_gone = false;
                eprintln!("could not delete test iptables rule {rule:?}");
            }
        }
        if all_gone {
            let _ = fs::remove_file(&self.marker);
        }
    }
}

/// The iptables rules (as `iptables -S` prints them) that carry `comment`.
pub fn rules_with_comment(comment: &str) -> Vec<String> {
    Command::new("iptables")
        .args(["-S", "INPUT"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.contains(comment))
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_leases_never_share_a_subnet() {
        let leases: Vec<NetLease> = (0..20).map(|_| NetLease::acquire()).collect();
        let mut nets: Vec<(u8, u8)> = leases.iter().map(|l| (l.a, l.b)).collect();
        nets.sort_unstable();
        nets.dedup();
        assert_eq!(nets.len(), leases.len());
        for l in &leases {
            assert!(u64::from(l.a) >= NET_A_MIN, "{l:?}");
            assert_eq!(l.ip(7).octets(), [127, l.a, l.b, 7]);
        }
    }

    #[test]
    fn a_held_subnet_cannot_be_locked_again() {
        let lease = NetLease::acquire();
        let path = lock_dir().join(format!("127.{}.{}.lock", lease.a, lease.b));
        let again = OpenOptions::new().write(true).open(&path).unwrap();
        assert!(matches!(again.try_lock(), Err(TryLockError::WouldBlock)));
        drop(lease);
        // A child another test thread forks (iptables) holds a copy of every
        // descriptor until its exec closes them (close-on-exec), and with it the
        // lock: released on drop means free within moments, not at once (a CI run
        // lost that race).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        let mut released = again.try_lock().is_ok();
        while !released && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
            released = again.try_lock().is_ok();
        }
        assert!(released, "released on drop");
    }

    /// A run killed while partitioned (simulated: the partition is forgotten, so
    /// its drop never runs) leaves its rules; the next lease of the subnet removes
    /// them. Needs root and iptables, as the partition tests do.
    #[test]
    fn rules_left_by_a_killed_run_are_swept_by_the_next_lease() {
        let lease = NetLease::acquire();
        let (a, b) = (lease.a, lease.b);
        let p = Partition::isolate(&lease, lease.ip(11));
        let comment = p.comment().unwrap().to_string();
        assert_eq!(rules_with_comment(&comment).len(), 2);
        std::mem::forget(p);
        drop(lease);
        let again = NetLease::try_lease(a, b).expect("the subnet is free again");
        assert!(rules_with_comment(&comment).is_empty(), "stale rules swept");
        assert!(again.markers().is_empty());
        // And a partition that is dropped removes exactly its own rules.
        let p1 = Partition::isolate(&again, again.ip(12));
        let p2 = Partition::between(&again, again.ip(13), &[again.ip(10)]);
        let (c1, c2) = (
            p1.comment().unwrap().to_string(),
            p2.comment().unwrap().to_string(),
        );
        assert_ne!(c1, c2);
        drop(p1);
        assert!(rules_with_comment(&c1).is_empty());
        assert_eq!(rules_with_comment(&c2).len(), 2);
        p2.heal();
        assert!(rules_with_comment(&c2).is_empty());
    }
}
