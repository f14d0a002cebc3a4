//! A time's civil date, for the build's stamp (`build.rs` includes this file) and for times a
//! person reads (`ids::utc`).

/// Seconds since 1970-01-01 UTC as (year, month, day, hour, minute, second) in the proleptic
/// Gregorian calendar (Howard Hinnant's `civil_from_days`), all in `u64`: nothing before 1970
/// is asked for, and no `u64` of seconds overflows it.
pub fn civil(secs: u64) -> (u64, u64, u64, u64, u64, u64) {
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let z = days + 719_468;
    let (era, doe) = (z / 146_097, z % 146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day, rest / 3600, rest % 3600 / 60, rest % 60)
}
