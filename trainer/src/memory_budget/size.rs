//! Memory sizes as people write them: `80GiB`, `24GB`, `1e9`, `512 MiB`.

/// A size that does not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "size {0:?}: expected a positive number of bytes with an optional unit B, KB, MB, GB, TB \
     (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 80GiB, 24GB, 1e9"
)]
pub struct SizeError(pub String);

/// Bytes in `text`: a number (`80`, `1.5`, `1e9`) and an optional unit, case-insensitive.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let bad = || SizeError(text.to_string());
    let t = text.trim();
    let split = t
        .find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E')
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        _ => return Err(bad()),
    };
    let value: f64 = number.trim().parse().map_err(|_| bad())?;
    let bytes = value * scale;
    if !(bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(bad());
    }
    Ok(bytes as u64)
}

/// `bytes` in the largest binary unit that keeps it at least 1, two decimals (`1.50 GiB`).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_decimal_and_binary_units() {
        for (text, bytes) in [
            ("80GiB", 80 << 30),
            ("24GB", 24_000_000_000),
            ("1e9", 1_000_000_000),
            ("1E9", 1_000_000_000),
            ("1.5e3kb", 1_500_000),
            ("512 MiB", 512 << 20),
            ("4096", 4096),
            ("4096B", 4096),
            ("0.5TiB", 1 << 39),
            (" 2gib ", 2 << 30),
            ("1KiB", 1024),
        ] {
            assert_eq!(parse_size(text), Ok(bytes), "{text}");
        }
    }

    #[test]
    fn what_is_no_size_is_rejected_with_examples() {
        for text in [
            "", "GiB", "80GiBs", "80 G", "-1GB", "0", "0.1", "nan", "inf", "1e400", "eGB",
        ] {
            let err = parse_size(text).unwrap_err().to_string();
            assert!(err.contains("e.g. 80GiB, 24GB, 1e9"), "{text}: {err}");
        }
    }

    #[test]
    fn sizes_print_in_binary_units() {
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(1536), "1.50 KiB");
        assert_eq!(format_size(80 << 30), "80.00 GiB");
        assert_eq!(format_size(3 << 40), "3.00 TiB");
    }
}
