//! Which volumes an entity may read and write: a list of volume-name patterns
//! (an exact name, or a prefix ending in `*`), empty meaning every volume —
//! cephx's `osd 'allow rwx pool=…'`, at volume granularity. The manager keeps
//! them in the entity table and puts them in the entity's tickets; every OSD
//! enforces them on each client request (`flame-osd/src/connection.rs`).

use serde::{Deserialize, Serialize};

/// Most patterns one entity may have (they travel in every ticket).
pub const VOLUME_PATTERNS_MAX: usize = 16;
/// Longest pattern (a volume name's bound, plus the `*`).
pub const VOLUME_PATTERN_BYTES_MAX: usize = crate::map::VOLUME_NAME_BYTES_MAX + 1;

/// An entity's volume patterns; empty: every volume.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<String>", into = "Vec<String>")]
pub struct VolumePatterns(Vec<String>);

impl VolumePatterns {
    /// Every volume.
    pub fn all() -> VolumePatterns {
        VolumePatterns(Vec::new())
    }

    /// Checks `patterns`: at most [`VOLUME_PATTERNS_MAX`], each a valid volume
    /// name, optionally followed by one `*` (a prefix; a lone `*` is every
    /// volume, the same as none).
    pub fn new(patterns: Vec<String>) -> Result<VolumePatterns, String> {
        if patterns.len() > VOLUME_PATTERNS_MAX {
            return Err(format!(
                "at most {VOLUME_PATTERNS_MAX} volume patterns, got {}",
                patterns.len()
            ));
        }
        for p in &patterns {
            let name = p.strip_suffix('*').unwrap_or(p);
            if name.is_empty() && p == "*" {
                continue;
            }
            crate::map::validate_volume_name(name)
                .map_err(|e| format!("volume pattern `{p}`: {e} (a name, or a prefix and `*`)"))?;
        }
        if patterns.iter().any(|p| p == "*") {
            return Ok(VolumePatterns::all());
        }
        Ok(VolumePatterns(patterns))
    }

    /// Parses a comma-separated list (`vm1-*,shared`); empty: every volume.
    pub fn parse_list(text: &str) -> Result<VolumePatterns, String> {
        let list: Vec<String> = text
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        VolumePatterns::new(list)
    }

    /// Whether every volume is allowed.
    pub fn is_all(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the volume named `name` is allowed.
    pub fn allows(&self, name: &str) -> bool {
        self.is_all()
            || self.0.iter().any(|p| match p.strip_suffix('*') {
                Some(prefix) => name.starts_with(prefix),
                None => name == p,
            })
    }

    /// The patterns.
    pub fn as_slice(&self) -> &[String] {
        &self.0
    }
}

impl TryFrom<Vec<String>> for VolumePatterns {
    type Error = String;
    fn try_from(v: Vec<String>) -> Result<VolumePatterns, String> {
        VolumePatterns::new(v)
    }
}

impl From<VolumePatterns> for Vec<String> {
    fn from(p: VolumePatterns) -> Vec<String> {
        p.0
    }
}

impl std::fmt::Display for VolumePatterns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_all() {
            f.write_str("*")
        } else {
            f.write_str(&self.0.join(","))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_names_and_prefixes() {
        let p = VolumePatterns::parse_list("vm1-*, shared").unwrap();
        assert!(p.allows("vm1-root") && p.allows("vm1-") && p.allows("shared"));
        assert!(!p.allows("vm2-root") && !p.allows("shared2") && !p.allows("vm1"));
        assert_eq!(p.to_string(), "vm1-*,shared");
        assert!(VolumePatterns::parse_list("").unwrap().is_all());
        assert!(VolumePatterns::parse_list("a,*").unwrap().is_all());
        assert!(VolumePatterns::all().allows("anything"));
        assert_eq!(VolumePatterns::all().to_string(), "*");
    }

    #[test]
    fn bad_patterns_are_refused() {
        for bad in ["a b", "x*y", "**", "a/b*", &"v".repeat(200)] {
            assert!(VolumePatterns::parse_list(bad).is_err(), "{bad}");
        }
        let many = (0..=VOLUME_PATTERNS_MAX)
            .map(|i| format!("v{i}"))
            .collect::<Vec<_>>();
        assert!(VolumePatterns::new(many).unwrap_err().contains("at most"));
        assert!(serde_json::from_str::<VolumePatterns>("[\"ok\",\"not ok\"]").is_err());
        let p: VolumePatterns = serde_json::from_str("[\"a-*\"]").unwrap();
        assert_eq!(serde_json::to_string(&p).unwrap(), "[\"a-*\"]");
    }
}
