//! The OSDs' service key as this OSD's shards see it: one shared cell, so a
//! new key (after `flame-admin auth rotate osd`) reaches every shard without a
//! restart. The control thread replaces it when the manager's heartbeat
//! answer names another `osd` key generation than the one held (an OSD with
//! its own `osd.N` key fetches the new one, sealed for it); shards read it once
//! per HELLO they check and per peer connection they open, so the data path
//! never touches it.

use arc_swap::ArcSwap;
use flame_common::auth::{KeyGeneration, ServiceKey};
use std::sync::Arc;

/// The shared, replaceable service key.
#[derive(Clone, Debug)]
pub struct ServiceKeys(Arc<ArcSwap<ServiceKey>>);

impl ServiceKeys {
    /// A cell holding `key`.
    pub fn new(key: ServiceKey) -> ServiceKeys {
        ServiceKeys(Arc::new(ArcSwap::from_pointee(key)))
    }

    /// The key now.
    pub fn current(&self) -> Arc<ServiceKey> {
        self.0.load_full()
    }

    /// The `osd` key generation of the key now.
    pub fn generation(&self) -> KeyGeneration {
        self.0.load().generation()
    }

    /// Replaces the key: HELLOs checked and peer tickets made from now on use
    /// `key`.
    pub fn replace(&self, key: ServiceKey) {
        self.0.store(Arc::new(key));
    }
}
