//! Byte mutations shared by the decoders' property tests and the cargo-fuzz targets
//! (`fuzz/`): a valid encoding, damaged the ways a torn write, a bit flip or a
//! hostile peer damages it. Arbitrary bytes alone rarely get past a magic number or
//! a checksum; a mutated valid encoding reaches the checks behind them.
//!
//! Not used by any daemon. Public (and hidden from the docs) only because the
//! tests of other crates and the fuzz crate share it.

/// One way to damage an encoding, as a generator draws it: `kind` picks the
/// operation, `at` the position (taken modulo the current length), `value` the byte.
pub type Mutation = (u8, u32, u8);

/// Applies `ops` to `bytes` in order: flip one bit, overwrite a byte, insert a
/// byte, delete a byte, truncate, or append a byte (so a length field can be made
/// to disagree with the data in both directions). An empty input only grows.
pub fn mutate(bytes: &mut Vec<u8>, ops: &[Mutation]) {
    for &(kind, at, value) in ops {
        let len = bytes.len();
        let i = if len == 0 { 0 } else { at as usize % len };
        match kind % 6 {
            0 if len > 0 => bytes[i] ^= 1 << (value % 8),
            1 if len > 0 => bytes[i] = value,
            2 => bytes.insert(i.min(len), value),
            3 if len > 0 => {
                bytes.remove(i);
            }
            4 => bytes.truncate(i),
            _ => bytes.push(value),
        }
    }
}

/// Splits fuzz input into mutations (3 bytes each) and returns them with what is
/// left, for targets that mutate a valid encoding chosen by the input.
pub fn mutations_from(data: &[u8], most: usize) -> Vec<Mutation> {
    data.chunks_exact(3)
        .take(most)
        .map(|c| (c[0], u32::from(c[1]) | u32::from(c[2]) << 8, c[2]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mutation_kind_applies_within_bounds() {
        let mut b = vec![0u8; 4];
        mutate(
            &mut b,
            &[
                (0, 1, 3),
                (1, 2, 7),
                (2, 9, 5),
                (3, 0, 0),
                (4, 3, 0),
                (5, 0, 9),
            ],
        );
        assert_eq!(b, vec![5, 8, 7, 9]);
        let mut e = Vec::new();
        mutate(
            &mut e,
            &[(0, 5, 1), (1, 5, 1), (3, 5, 1), (4, 5, 1), (2, 5, 4)],
        );
        assert_eq!(e, vec![4]);
    }
}

/// The property tests' shared setup: one seeded, bounded configuration and one
/// mutation strategy for every decoder's tests (feature `proptest`, enabled by
/// the crates' dev-dependencies; never in a daemon's build).
#[cfg(any(test, feature = "proptest"))]
pub mod props {
    use super::Mutation;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, RngSeed};

    /// `cases` cases from the fixed `seed` (each test its own, so a failure
    /// replays), no failure files; `PROPTEST_CASES` and `PROPTEST_RNG_SEED`
    /// override both for a longer or different local run.
    pub fn config(cases: u32, seed: u64) -> Config {
        let env = Config::default();
        Config {
            cases: if std::env::var_os("PROPTEST_CASES").is_some() {
                env.cases
            } else {
                cases
            },
            rng_seed: if std::env::var_os("PROPTEST_RNG_SEED").is_some() {
                env.rng_seed
            } else {
                RngSeed::Fixed(seed)
            },
            failure_persistence: None,
            ..env
        }
    }

    /// Up to `most - 1` mutations for [`super::mutate`].
    pub fn mutations(most: usize) -> impl Strategy<Value = Vec<Mutation>> {
        proptest::collection::vec(any::<(u8, u32, u8)>(), 0..most)
    }
}
