//! Random identifiers that are not secrets — session ids, nonces of hellos —
//! drawn from the OS-seeded generator, or, on a thread of the deterministic
//! simulator, from the seed's generator, so that a seed replays byte for byte.
//!
//! Keys that guard access (grant keys, future authentication) never come from
//! here: they stay unpredictable even in a simulation.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cell::RefCell;

thread_local! {
    /// `Some` on a simulated thread.
    static SEEDED: RefCell<Option<StdRng>> = const { RefCell::new(None) };
}

/// A random `u64`: the seed's next on a simulated thread, the OS-seeded
/// generator's otherwise.
pub fn u64() -> u64 {
    SEEDED
        .try_with(|s| s.borrow_mut().as_mut().map(|r| r.random()))
        .ok()
        .flatten()
        .unwrap_or_else(rand::random)
}

/// Makes this thread's random identifiers follow `seed` (the simulator), or
/// with `None` the OS-seeded generator again.
pub fn seed_thread(seed: Option<u64>) {
    SEEDED.with(|s| *s.borrow_mut() = seed.map(StdRng::seed_from_u64));
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_seeded_thread_repeats_and_others_do_not() {
        std::thread::spawn(|| {
            super::seed_thread(Some(5));
            let a = [super::u64(), super::u64()];
            super::seed_thread(Some(5));
            assert_eq!(a, [super::u64(), super::u64()]);
            super::seed_thread(None);
            assert_ne!(super::u64(), super::u64());
        })
        .join()
        .unwrap();
    }
}
