//! YAML configuration loading.
//!
//! Every daemon reads one YAML file. Each configuration struct derives `Deserialize`
//! with `#[serde(default, deny_unknown_fields)]`, so every key has a default and a
//! typo is an error rather than a silently ignored setting. Errors name the offending
//! key path (`osd.shards: invalid type ...`) through `serde_path_to_error`.
//!
//! The YAML crate is `serde_norway`, the maintained continuation of the deprecated
//! `serde_yaml` (same API, same YAML 1.1/1.2 behaviour).

use serde::de::DeserializeOwned;
use std::path::Path;

/// Why a configuration could not be loaded. The message always names the file and,
/// where known, the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// File that failed.
        path: String,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The YAML was malformed, had an unknown key or a value of the wrong type.
    #[error("invalid config {path}: key `{key}`: {message}")]
    Parse {
        /// File that failed.
        path: String,
        /// Dotted path of the offending key (`.` for the document root).
        key: String,
        /// What was wrong.
        message: String,
    },
    /// The YAML parsed, but a value is out of range or inconsistent.
    #[error("invalid config {path}: key `{key}`: {message}")]
    Invalid {
        /// File that failed.
        path: String,
        /// The key with the bad value.
        key: String,
        /// What was wrong.
        message: String,
    },
}

/// A configuration that can check its own values after parsing.
pub trait Validate {
    /// Returns `(key, message)` for the first bad value.
    fn validate(&self) -> Result<(), (String, String)>;
}

/// Largest configuration file accepted; a config is a few hundred bytes, so anything
/// bigger is a mistake (a wrong path to a disk image, say), not a config.
pub const CONFIG_BYTES_MAX: u64 = 1 << 20;

/// Loads `path`, or returns the defaults when `path` is `None`.
pub fn load<T: DeserializeOwned + Default + Validate>(
    path: Option<&Path>,
) -> Result<T, ConfigError> {
    let Some(path) = path else {
        let value = T::default();
        value
            .validate()
            .map_err(|(key, message)| ConfigError::Invalid {
                path: "<defaults>".into(),
                key,
                message,
            })?;
        return Ok(value);
    };
    let shown = path.display().to_string();
    let meta = std::fs::metadata(path).map_err(|source| ConfigError::Read {
        path: shown.clone(),
        source,
    })?;
    if meta.len() > CONFIG_BYTES_MAX {
        return Err(ConfigError::Parse {
            path: shown,
            key: ".".into(),
            message: format!("file is {} bytes, more than {CONFIG_BYTES_MAX}", meta.len()),
        });
    }
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: shown.clone(),
        source,
    })?;
    parse_str(&text, &shown)
}

/// Parses a configuration from YAML text; `origin` names it in errors.
pub fn parse_str<T: DeserializeOwned + Validate>(
    text: &str,
    origin: &str,
) -> Result<T, ConfigError> {
    // An empty document means "all defaults"; serde_norway would call it a unit value.
    let text = if text.trim().is_empty() { "{}" } else { text };
    let de = serde_norway::Deserializer::from_str(text);
    let value: T = serde_path_to_error::deserialize(de).map_err(|e| ConfigError::Parse {
        path: origin.to_string(),
        key: e.path().to_string(),
        message: e.inner().to_string(),
    })?;
    value
        .validate()
        .map_err(|(key, message)| ConfigError::Invalid {
            path: origin.to_string(),
            key,
            message,
        })?;
    Ok(value)
}

/// Number of CPU cores, the default for thread counts.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct Sample {
        listen: String,
        shards: u32,
        nested: Nested,
    }
    #[derive(Debug, Deserialize, PartialEq, Default)]
    #[serde(default, deny_unknown_fields)]
    struct Nested {
        grace_ms: u64,
    }
    impl Default for Sample {
        fn default() -> Self {
            Sample {
                listen: "127.0.0.1:1".into(),
                shards: 2,
                nested: Nested::default(),
            }
        }
    }
    impl Validate for Sample {
        fn validate(&self) -> Result<(), (String, String)> {
            if self.shards == 0 {
                return Err(("shards".into(), "must be at least 1".into()));
            }
            Ok(())
        }
    }

    #[test]
    fn empty_means_defaults() {
        let s: Sample = parse_str("", "t").unwrap();
        assert_eq!(s, Sample::default());
    }

    #[test]
    fn unknown_key_is_named() {
        let e = parse_str::<Sample>("nested:\n  grace_mss: 3\n", "t").unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("grace_mss"), "{msg}");
    }

    #[test]
    fn bad_type_names_key() {
        let e = parse_str::<Sample>("shards: many\n", "t").unwrap_err();
        assert!(e.to_string().contains("shards"), "{e}");
    }

    #[test]
    fn invalid_value_names_key() {
        let e = parse_str::<Sample>("shards: 0\n", "t").unwrap_err();
        assert!(e.to_string().contains("`shards`"), "{e}");
    }

    /// A YAML alias bomb ("billion laughs") and deep nesting end in an error at
    /// once: serde_norway bounds alias expansion and recursion, so a hostile
    /// config file cannot make a daemon hang or exhaust memory at start-up.
    #[test]
    fn alias_bombs_and_deep_nesting_fail_fast() {
        let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 0..12 {
            let prev = if i == 0 {
                "a".to_string()
            } else {
                format!("a{}", i - 1)
            };
            bomb.push_str(&format!(
                "a{i}: &a{i} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"
            ));
        }
        bomb.push_str("listen: *a11\n");
        let t = std::time::Instant::now();
        assert!(parse_str::<Sample>(&bomb, "t").is_err());
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(parse_str::<Sample>(&deep, "t").is_err());
        assert!(
            t.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            t.elapsed()
        );
    }
}
