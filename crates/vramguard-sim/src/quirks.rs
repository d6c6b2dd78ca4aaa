//! The bytes of driver bugs the simulator reproduces, shared by its NVML library and its
//! in-process source so that both paths see the same thing.

/// Size of the `nvmlProcessInfo_v3_t` the 535.43–535.98 drivers write: pid, padding,
/// `usedGpuMemory`, `gpuInstanceId`, `computeInstanceId`, `usedGpuCcProtectedMemory`.
pub const V3_RECORD_32: usize = 32;
/// Size of the record callers built against other headers expect (`nvmlProcessInfo_v2_t`).
pub const V3_RECORD_24: usize = 24;

/// `records` (pid, used bytes) as those drivers lay them out, with MIG ids `0xFFFFFFFF`
/// and no protected memory.
pub fn v3_records_32_bytes(records: &[(u32, u64)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(records.len() * V3_RECORD_32);
    for &(pid, used) in records {
        out.extend_from_slice(&pid.to_ne_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&used.to_ne_bytes());
        out.extend_from_slice(&u32::MAX.to_ne_bytes());
        out.extend_from_slice(&u32::MAX.to_ne_bytes());
        out.extend_from_slice(&0u64.to_ne_bytes());
    }
    out
}

/// What a caller reading `count` 24-byte records out of `bytes` sees (pid, used bytes); bytes
/// past the end read as zeros, as the caller's zeroed buffer would.
pub fn read_as_24_byte_records(bytes: &[u8], count: usize) -> Vec<(u32, u64)> {
    let at = |i: usize| bytes.get(i).copied().unwrap_or(0);
    (0..count)
        .map(|k| {
            let o = k * V3_RECORD_24;
            let pid = u32::from_ne_bytes([at(o), at(o + 1), at(o + 2), at(o + 3)]);
            let used = u64::from_ne_bytes(std::array::from_fn(|j| at(o + 8 + j)));
            (pid, used)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_record_reads_right_and_the_next_ones_are_misaligned() {
        let bytes = v3_records_32_bytes(&[(4242, 8 << 30), (4243, 1 << 30)]);
        assert_eq!(bytes.len(), 64);
        let seen = read_as_24_byte_records(&bytes, 2);
        assert_eq!(seen[0], (4242, 8 << 30));
        // Record 1 starts at byte 24: the first record's protected memory (0), then the
        // second record's pid and padding read as memory.
        assert_eq!(seen[1], (0, 4243));
    }
}
