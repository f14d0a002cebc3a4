//! Dates past 2038 on 32-bit musl builds (ARMv6, ARMv7, MIPS).
//!
//! Rust's standard library links musl's `clock_gettime` with a 32-bit `time_t` on those
//! targets (its `libc` has no 64-bit `time_t` for them yet). Past 2038-01-19 03:14:07 UTC that
//! call fails with EOVERFLOW and every reading of the time aborts the process, in imgate and in
//! its dependencies alike (log timestamps, HTTP `Date` headers, certificate checks). Nothing here
//! can widen that: instead, before anything reads the time, these builds ask the kernel for it
//! with musl's own 64-bit clock and refuse to start with a reason, rather than abort with a
//! panic each time the service manager restarts them. The 64-bit builds are not affected.

/// The last second a signed 32-bit `time_t` holds: 2038-01-19 03:14:07 UTC.
const LAST_TIME32_SECOND: i64 = i32::MAX as i64;

/// Whether std keeps a 32-bit `time_t` on this target: the 32-bit musl targets that predate
/// musl's 64-bit `time_t` (newer ones, like riscv32, have only that and no `__clock_gettime64`).
const TIME32: bool = cfg!(all(target_env = "musl", any(target_arch = "arm", target_arch = "mips")));

/// Why this build cannot run at the kernel's current time, if it cannot.
pub fn refusal() -> Option<String> {
    refusal_at(kernel_seconds(), TIME32)
}

/// The kernel's time in Unix seconds, read without std's clock where that has a 32-bit `time_t`.
fn kernel_seconds() -> i64 {
    #[cfg(all(target_env = "musl", any(target_arch = "arm", target_arch = "mips")))]
    {
        musl_time64_seconds()
    }
    #[cfg(not(all(target_env = "musl", any(target_arch = "arm", target_arch = "mips"))))]
    {
        let since_1970 = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        since_1970.map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
    }
}

/// musl's own 64-bit clock (since musl 1.2 its `clock_gettime` for programs built against its
/// headers; std links the older 32-bit symbol). 0 when it fails, which refuses nothing.
#[cfg(all(target_env = "musl", any(target_arch = "arm", target_arch = "mips")))]
fn musl_time64_seconds() -> i64 {
    /// musl's `struct timespec` on 32-bit targets: a 64-bit `tv_sec`, then a 32-bit `tv_nsec`
    /// and 32 bits of padding in an order that follows the byte order (only `tv_sec` is read).
    #[repr(C)]
    struct Timespec64 {
        tv_sec: i64,
        nsec_and_padding: [u32; 2],
    }
    extern "C" {
        fn __clock_gettime64(clock: i32, ts: *mut Timespec64) -> i32;
    }
    const CLOCK_REALTIME: i32 = 0;
    let mut ts = Timespec64 {
        tv_sec: 0,
        nsec_and_padding: [0; 2],
    };
    // SAFETY: musl writes one `Timespec64` (16 bytes, 8-aligned: this struct's size and
    // alignment) through the pointer, which is valid for the call.
    let rc = unsafe { __clock_gettime64(CLOCK_REALTIME, &mut ts) };
    if rc == 0 {
        ts.tv_sec
    } else {
        0
    }
}

/// The refusal at `now` (Unix seconds) for a build whose standard library keeps a 32-bit
/// `time_t` (`time32`), or not.
fn refusal_at(now: i64, time32: bool) -> Option<String> {
    (time32 && now > LAST_TIME32_SECOND).then(|| {
        format!(
            "the system clock reads {now} s after 1970, past 2038-01-19 03:14:07 UTC ({LAST_TIME32_SECOND} s), \
             which this 32-bit build cannot represent (its standard library reads the time through musl's \
             32-bit time_t). If the clock is wrong, correct it (NTP) and start again; if it is right, install \
             imgate's 64-bit build where the board can run one. See docs/boards.md, \"Dates past 2038\"."
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_32_bit_build_refuses_from_the_first_second_past_2038_and_a_64_bit_one_never() {
        assert_eq!(
            refusal_at(LAST_TIME32_SECOND, true),
            None,
            "2038-01-19 03:14:07 still fits"
        );
        let past = refusal_at(LAST_TIME32_SECOND + 1, true).unwrap_or_default();
        assert!(past.contains("2147483648 s after 1970"), "{past}");
        assert!(past.contains("64-bit build"), "{past}");
        assert_eq!(refusal_at(4_102_444_800, false), None, "2100 on a 64-bit build");
    }
}
