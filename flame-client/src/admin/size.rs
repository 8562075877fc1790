//! Sizes on flame-admin's command line: `10G`, `1.5GiB`, `512M`, `4096`.
//!
//! Units are binary and only binary: `K`/`KiB` = 2^10, `M`/`MiB` = 2^20, `G`/`GiB`
//! = 2^30, `T`/`TiB` = 2^40, `P`/`PiB` = 2^50, `E`/`EiB` = 2^60 (case-insensitive,
//! `B` or nothing = bytes). Decimal units (`KB`, `MB`, `GB`, ...) are refused with a
//! message rather than guessed: `10GB` meant GiB here before, which silently gave
//! 7 % more than a reader of "GB" expects, and taking it as 10^9 would surprise
//! whoever typed it after `10G`. Fractions (`1.5G`) are exact, computed in integers,
//! and accepted only when they come to a whole number of bytes; nothing is rounded.
//! Alignment (volumes are whole 512-byte sectors) is checked by the caller with
//! [`check_multiple`], which names the nearest valid sizes.

use flame_common::mgr_api::format_size;

/// Digits accepted after the decimal point (2^60 × 10^-18 is already below a byte).
const FRACTION_DIGITS_MAX: usize = 18;

/// Units of the parser, lower-case, with their shift.
const UNITS: [(&str, &str, u32); 7] = [
    ("", "b", 0),
    ("k", "kib", 10),
    ("m", "mib", 20),
    ("g", "gib", 30),
    ("t", "tib", 40),
    ("p", "pib", 50),
    ("e", "eib", 60),
];

/// What `--help` says about sizes.
pub const SIZE_HELP: &str = "binary units: K/KiB = 1024, M/MiB, G/GiB, T/TiB, P/PiB; \
     fractions like 1.5G if they come to whole bytes; decimal units (KB, MB, GB) are refused";

/// Parses a size with a binary unit; see the module documentation.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let unit_at = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(unit_at);
    let unit = unit.trim().to_ascii_lowercase();
    let Some(shift) = UNITS
        .iter()
        .find(|(short, long, _)| unit == *short || unit == *long)
        .map(|(_, _, s)| *s)
    else {
        if let Some(binary) = decimal_unit_twin(&unit) {
            return Err(format!(
                "`{text}`: decimal units are not accepted, sizes are binary: use {number}{binary} \
                 (= {number} × 2^{} bytes), or give the exact number of bytes",
                shift_of(binary)
            ));
        }
        return Err(format!("`{text}`: unknown unit `{unit}` ({SIZE_HELP})"));
    };
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    let not_a_size = || format!("`{text}` is not a size (e.g. 10G, 1.5G, 512M, 4096)");
    if whole.is_empty() && fraction.is_empty() {
        return Err(not_a_size());
    }
    if !whole.chars().all(|c| c.is_ascii_digit()) || !fraction.chars().all(|c| c.is_ascii_digit()) {
        return Err(not_a_size());
    }
    let too_large = || {
        format!(
            "`{text}` is too large (more than {})",
            format_size(u64::MAX)
        )
    };
    let whole_n: u128 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| too_large())?
    };
    let fraction = fraction.trim_end_matches('0');
    if fraction.len() > FRACTION_DIGITS_MAX {
        return Err(format!(
            "`{text}`: at most {FRACTION_DIGITS_MAX} digits after the decimal point"
        ));
    }
    let unit_bytes = 1u128 << shift;
    let mut bytes = whole_n.checked_mul(unit_bytes).ok_or_else(too_large)?;
    if !fraction.is_empty() {
        // fraction / 10^digits × unit, exactly: the numerator is < 10^18 × 2^60 < 2^128.
        let digits: u128 = fraction.parse().map_err(|_| not_a_size())?;
        let scale = 10u128.pow(fraction.len() as u32);
        let numerator = digits * unit_bytes;
        if !numerator.is_multiple_of(scale) {
            return Err(format!(
                "`{text}` is not a whole number of bytes ({} + {}/{} bytes); \
                 fractions must come to whole bytes, nothing is rounded",
                bytes,
                numerator % scale,
                scale
            ));
        }
        bytes = bytes.checked_add(numerator / scale).ok_or_else(too_large)?;
    }
    u64::try_from(bytes).map_err(|_| too_large())
}

/// The binary unit a decimal unit spelling looks like (`gb` → `G`).
fn decimal_unit_twin(unit: &str) -> Option<&'static str> {
    Some(match unit {
        "kb" => "K",
        "mb" => "M",
        "gb" => "G",
        "tb" => "T",
        "pb" => "P",
        "eb" => "E",
        _ => return None,
    })
}

fn shift_of(binary_unit: &str) -> u32 {
    let u = binary_unit.to_ascii_lowercase();
    UNITS
        .iter()
        .find(|(short, _, _)| *short == u)
        .map_or(0, |(_, _, s)| *s)
}

/// A size for messages: exact when it is a whole number of a unit (`1 PiB`),
/// otherwise rounded with the byte count beside it (`1.5 GiB (1610612737 bytes)`).
pub fn describe_size(bytes: u64) -> String {
    for (name, shift) in [
        ("EiB", 60),
        ("PiB", 50),
        ("TiB", 40),
        ("GiB", 30),
        ("MiB", 20),
        ("KiB", 10),
    ] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{} {name}", bytes >> shift);
        }
    }
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    format!("{} ({bytes} bytes)", format_size(bytes))
}

/// Checks that `bytes` is a positive multiple of `multiple`; the error names the
/// two nearest sizes that are.
pub fn check_multiple(what: &str, bytes: u64, multiple: u64) -> Result<(), String> {
    assert!(multiple > 0, "alignment must be positive");
    if bytes > 0 && bytes.is_multiple_of(multiple) {
        return Ok(());
    }
    let below = bytes - bytes % multiple;
    let above = below.saturating_add(multiple);
    let mut m = format!(
        "{what} must be a positive multiple of {multiple} bytes; {bytes} bytes is not (nothing is rounded): use "
    );
    if below > 0 {
        m.push_str(&format!("{below} ({}) or ", describe_size(below)));
    }
    m.push_str(&format!("{above} ({})", describe_size(above)));
    Err(m)
}

/// Checks `bytes` against an upper bound, naming both in units.
pub fn check_max(what: &str, bytes: u64, max: u64) -> Result<(), String> {
    if bytes <= max {
        return Ok(());
    }
    Err(format!(
        "{what} is {}, more than the largest allowed, {}",
        describe_size(bytes),
        describe_size(max)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_units_short_and_long_any_case() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4096B").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("4KiB").unwrap(), 4096);
        assert_eq!(parse_size("10G").unwrap(), 10 << 30);
        assert_eq!(parse_size("10GiB").unwrap(), 10 << 30);
        assert_eq!(parse_size("10gib").unwrap(), 10 << 30);
        assert_eq!(parse_size(" 10 G ").unwrap(), 10 << 30);
        assert_eq!(parse_size("1T").unwrap(), 1 << 40);
        assert_eq!(parse_size("1P").unwrap(), 1 << 50);
        assert_eq!(parse_size("15E").unwrap(), 15 << 60);
    }

    #[test]
    fn fractions_are_exact_or_refused() {
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("1.50G").unwrap(), 3 << 29);
        assert_eq!(parse_size("0.5K").unwrap(), 512);
        assert_eq!(parse_size(".5K").unwrap(), 512);
        assert_eq!(parse_size("2.").unwrap(), 2);
        assert_eq!(parse_size("0.25M").unwrap(), 256 << 10);
        // 0.1 GiB is 107374182.4 bytes: refused, not rounded.
        let e = parse_size("0.1G").unwrap_err();
        assert!(e.contains("whole number of bytes"), "{e}");
        assert!(parse_size("1.5").is_err()); // 1.5 bytes
        assert!(parse_size("1.2.3G").is_err());
        assert!(parse_size(".G").is_err());
        assert!(parse_size("0.0000000000000000001G").is_err());
    }

    #[test]
    fn decimal_units_are_refused_with_the_binary_spelling() {
        let e = parse_size("10GB").unwrap_err();
        assert!(e.contains("decimal units are not accepted"), "{e}");
        assert!(e.contains("10G"), "{e}");
        assert!(parse_size("500mb").is_err());
        assert!(parse_size("1KB").is_err());
    }

    #[test]
    fn garbage_and_overflow() {
        assert!(parse_size("").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("ten").is_err());
        assert!(parse_size("4X").unwrap_err().contains("unknown unit"));
        assert!(parse_size("-1G").is_err());
        assert!(parse_size("16E").unwrap_err().contains("too large"));
        assert!(parse_size("99999999999999999999999999999999999999999").is_err());
        assert_eq!(parse_size("18446744073709551615").unwrap(), u64::MAX);
        assert!(parse_size("18446744073709551616").is_err());
    }

    #[test]
    fn descriptions_and_checks() {
        assert_eq!(describe_size(1 << 50), "1 PiB");
        assert_eq!(describe_size(3 << 29), "1536 MiB");
        assert_eq!(describe_size(100), "100 B");
        assert_eq!(describe_size(1025), "1.0 KiB (1025 bytes)");
        assert!(check_multiple("size", 4096, 512).is_ok());
        let e = check_multiple("size", 1000, 512).unwrap_err();
        assert!(e.contains("512 (512 B) or 1024 (1 KiB)"), "{e}");
        let e = check_multiple("size", 0, 512).unwrap_err();
        assert!(e.contains("use 512"), "{e}");
        let e = check_max("size", 100 << 50, 1 << 50).unwrap_err();
        assert_eq!(e, "size is 100 PiB, more than the largest allowed, 1 PiB");
        assert!(check_max("size", 1 << 50, 1 << 50).is_ok());
    }
}
