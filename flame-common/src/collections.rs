//! Hash maps and sets with Flame's hasher: keyed SipHash as in `std` (a peer
//! cannot choose keys that collide), but keyed once per thread from
//! [`crate::entropy`], so on a thread of the deterministic simulator the keys —
//! and with them every map's iteration order — follow the seed. With `std`'s
//! `RandomState` two runs of one seed iterated their maps in different orders and
//! took different paths (recovery walked its objects in another order).
//!
//! Use these instead of `std::collections::{HashMap, HashSet}` everywhere the
//! simulator runs (`HashMap::default()`, not `HashMap::new()`).

use std::hash::{BuildHasher, DefaultHasher, Hasher};

/// `std::collections::HashMap` with [`HashState`].
pub type HashMap<K, V> = std::collections::HashMap<K, V, HashState>;
/// `std::collections::HashSet` with [`HashState`].
pub type HashSet<T> = std::collections::HashSet<T, HashState>;

thread_local! {
    /// This thread's key, drawn on first use.
    static KEY: (u64, u64) = (crate::entropy::u64(), crate::entropy::u64());
}

/// The hasher builder: SipHash-1-3 (`std`'s) started with this thread's secret
/// key, which it absorbs before the value.
#[derive(Clone, Copy, Debug)]
pub struct HashState {
    key: (u64, u64),
}

impl Default for HashState {
    fn default() -> Self {
        HashState {
            key: KEY
                .try_with(|k| *k)
                .unwrap_or_else(|_| (rand::random(), rand::random())),
        }
    }
}

impl BuildHasher for HashState {
    type Hasher = DefaultHasher;

    fn build_hasher(&self) -> DefaultHasher {
        let mut h = DefaultHasher::new();
        h.write_u64(self.key.0);
        h.write_u64(self.key.1);
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(seed: u64) -> Vec<u64> {
        std::thread::spawn(move || {
            crate::entropy::seed_thread(Some(seed));
            let m: HashMap<u64, ()> = (0..64).map(|i| (i, ())).collect();
            m.keys().copied().collect()
        })
        .join()
        .unwrap()
    }

    #[test]
    fn iteration_order_follows_the_seed() {
        assert_eq!(order(1), order(1));
        assert_ne!(order(1), order(2), "the key depends on the seed");
    }
}
