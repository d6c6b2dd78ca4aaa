//! Driver versions with known bugs that change how their answers must be read.

/// A known driver problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverQuirk {
    /// What goes wrong.
    pub problem: &'static str,
    /// Where it was reported.
    pub reference: &'static str,
    /// What to do.
    pub advice: &'static str,
}

/// Parses `535.54.03` into `(535, 54, 3)`; missing parts are 0.
pub fn parse_driver_version(v: &str) -> Option<(u32, u32, u32)> {
    let mut parts = v.trim().split('.').map(|p| p.parse::<u32>());
    let major = parts.next()?.ok()?;
    let minor = parts.next().unwrap_or(Ok(0)).ok()?;
    let patch = parts.next().unwrap_or(Ok(0)).ok()?;
    Some((major, minor, patch))
}

/// Known problems of a driver version, if any.
pub fn known_quirks(driver_version: &str) -> Vec<DriverQuirk> {
    let mut quirks = Vec::new();
    if let Some((major, minor, _)) = parse_driver_version(driver_version)
        && major == 535
        && (43..=98).contains(&minor)
    {
        quirks.push(DriverQuirk {
            problem: "the _v3 running-process calls return records in a mismatched layout: \
                      scrambled or swapped pid/memory, only the first process, or none",
            reference: "nvitop #75 #88 #93, gpustat #157 #161, pynvml #50",
            advice: "upgrade to 535.104 or later; vramguard validates every record and falls \
                     back to the _v2 calls",
        });
    }
    quirks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_535_window_is_flagged() {
        assert!(!known_quirks("535.54.03").is_empty());
        assert!(!known_quirks("535.43.02").is_empty());
        assert!(!known_quirks("535.98").is_empty());
        assert!(known_quirks("535.104.05").is_empty());
        assert!(known_quirks("580.159.03").is_empty());
        assert!(known_quirks("garbage").is_empty());
    }
}
