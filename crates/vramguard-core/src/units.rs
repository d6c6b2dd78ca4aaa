//! Human units for the command line and the config: byte sizes (`20GiB`) and durations (`2h`).

use std::time::Duration;

/// Why a size or duration could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {input:?}: {reason}")]
pub struct UnitError {
    what: &'static str,
    input: String,
    reason: &'static str,
}

const BYTE_UNITS: &[(&str, u64)] = &[
    ("b", 1),
    ("k", 1000),
    ("kb", 1000),
    ("kib", 1 << 10),
    ("m", 1000 * 1000),
    ("mb", 1000 * 1000),
    ("mib", 1 << 20),
    ("g", 1000 * 1000 * 1000),
    ("gb", 1000 * 1000 * 1000),
    ("gib", 1 << 30),
    ("t", 1000 * 1000 * 1000 * 1000),
    ("tb", 1000 * 1000 * 1000 * 1000),
    ("tib", 1 << 40),
];

/// Parses `4GiB`, `512MiB`, `1.5 TiB`, `20G`, or a plain number of bytes.
///
/// Decimal units (`GB`, `G`) are powers of 1000, binary units (`GiB`) powers of 1024, as in
/// IEC 80000-13; nvidia-smi's "MiB" are binary.
pub fn parse_bytes(input: &str) -> Result<u64, UnitError> {
    let err = |reason| UnitError {
        what: "size",
        input: input.to_string(),
        reason,
    };
    let s = input.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    if number.is_empty() {
        return Err(err("expected a number, e.g. 20GiB"));
    }
    let unit = unit.trim().to_ascii_lowercase();
    let multiplier = if unit.is_empty() {
        1
    } else {
        BYTE_UNITS
            .iter()
            .find(|(name, _)| *name == unit)
            .map(|(_, m)| *m)
            .ok_or_else(|| err("unknown unit (use B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB)"))?
    };
    if let Ok(whole) = number.parse::<u64>() {
        return whole
            .checked_mul(multiplier)
            .ok_or_else(|| err("too large"));
    }
    let value: f64 = number.parse().map_err(|_| err("malformed number"))?;
    let bytes = value * multiplier as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(err("too large"));
    }
    Ok(bytes.round() as u64)
}

/// Formats bytes the way nvidia-smi users read them: binary units, one decimal (`8.0 GiB`).
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: &[&str] = &["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// Parses `500ms`, `30s`, `10m`, `2h`, `1d`, combinations such as `1h30m`, or plain seconds.
pub fn parse_duration(input: &str) -> Result<Duration, UnitError> {
    let err = |reason| UnitError {
        what: "duration",
        input: input.to_string(),
        reason,
    };
    let s = input.trim();
    if s.is_empty() {
        return Err(err("empty"));
    }
    if let Ok(seconds) = s.parse::<f64>() {
        if !seconds.is_finite() || !(0.0..=1e12).contains(&seconds) {
            return Err(err("out of range"));
        }
        return Ok(Duration::from_secs_f64(seconds));
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| err("missing unit after the last number (ms, s, m, h, d)"))?;
        if digits == 0 {
            return Err(err("expected a number, e.g. 30s"));
        }
        let value: f64 = rest[..digits]
            .parse()
            .map_err(|_| err("malformed number"))?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds_per_unit = match &rest[..unit_len] {
            "ms" => 0.001,
            "s" | "sec" => 1.0,
            "m" | "min" => 60.0,
            "h" => 3600.0,
            "d" => 86400.0,
            _ => return Err(err("unknown unit (use ms, s, m, h, d)")),
        };
        rest = &rest[unit_len..];
        let seconds = value * seconds_per_unit;
        if !seconds.is_finite() || seconds > 1e12 {
            return Err(err("out of range"));
        }
        total += Duration::from_secs_f64(seconds);
    }
    Ok(total)
}

/// Formats a duration compactly: `850ms`, `12.3s`, `4m05s`, `3h12m`, `2d04h`.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let secs = d.as_secs();
    if secs < 60 {
        return format!("{:.1}s", d.as_secs_f64());
    }
    if secs < 3600 {
        return format!("{}m{:02}s", secs / 60, secs % 60);
    }
    if secs < 86400 {
        return format!("{}h{:02}m", secs / 3600, (secs % 3600) / 60);
    }
    format!("{}d{:02}h", secs / 86400, (secs % 86400) / 3600)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_binary_and_decimal_units() {
        assert_eq!(parse_bytes("20GiB").unwrap(), 20 << 30);
        assert_eq!(parse_bytes("20 gib").unwrap(), 20 << 30);
        assert_eq!(parse_bytes("20G").unwrap(), 20_000_000_000);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
    }

    #[test]
    fn bytes_rejects_garbage_with_a_reason() {
        let e = parse_bytes("GiB").unwrap_err().to_string();
        assert!(e.contains("expected a number"), "{e}");
        let e = parse_bytes("3 parsecs").unwrap_err().to_string();
        assert!(e.contains("unknown unit"), "{e}");
        assert!(parse_bytes("99999999999999999999TiB").is_err());
        assert!(parse_bytes("1.2.3GiB").is_err());
    }

    #[test]
    fn bytes_format() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(8 << 30), "8.0 GiB");
        assert_eq!(format_bytes(150_754_820_096), "140.4 GiB");
        assert_eq!(format_bytes(300 << 20), "300.0 MiB");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("10").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert!(parse_duration("10 parsecs").is_err());
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("10").is_ok());
        assert!(parse_duration("-1").is_err());
        assert!(parse_duration("5").is_ok());
        assert!(parse_duration("3x").is_err());
    }

    #[test]
    fn duration_format() {
        assert_eq!(format_duration(Duration::from_millis(850)), "850ms");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(format_duration(Duration::from_secs(245)), "4m05s");
        assert_eq!(
            format_duration(Duration::from_secs(3 * 3600 + 720)),
            "3h12m"
        );
    }

    proptest::proptest! {
        #[test]
        fn parsers_never_panic(s in ".{0,24}") {
            let _ = parse_bytes(&s);
            let _ = parse_duration(&s);
        }

        #[test]
        fn bytes_roundtrip_plain(n in 0u64..u64::MAX) {
            proptest::prop_assert_eq!(parse_bytes(&n.to_string()).unwrap(), n);
        }
    }
}
