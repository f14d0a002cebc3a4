//! Reading one section's keys (`Fields`: strings, secrets and their `*_file`, URLs, durations,
//! sizes, numbers; the unknown keys with the nearest known one), and the duration and size
//! forms the file and the logs use.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::ini::Section;
use super::{denied_hint, Problems, Secret};

/// Reads the keys of one section; `finish` reports the ones nobody took.
pub struct Fields<'s, 'p> {
    section: &'s Section,
    pub(super) problems: &'s mut Problems<'p>,
    secrets: &'s [&'s str],
    used: Vec<bool>,
    /// Every key the section's reader asked for: what a misspelt key may have meant.
    asked: Vec<String>,
}

impl<'s, 'p> Fields<'s, 'p> {
    pub fn new(section: &'s Section, problems: &'s mut Problems<'p>, secrets: &'s [&'s str]) -> Fields<'s, 'p> {
        let used = vec![false; section.entries.len()];
        Fields {
            section,
            problems,
            secrets,
            used,
            asked: Vec::new(),
        }
    }

    pub(super) fn take(&mut self, key: &str) -> Option<(String, usize)> {
        if !self.asked.iter().any(|k| k == key) {
            self.asked.push(key.to_string());
        }
        let i = self.section.entries.iter().position(|e| e.key == key)?;
        self.used[i] = true;
        let e = &self.section.entries[i];
        Some((e.value.clone(), e.line))
    }

    /// Reports a problem at `line`.
    pub fn err_at(&mut self, line: usize, msg: impl fmt::Display) {
        self.problems.err(line, msg);
    }

    /// Reports a problem of the section as a whole, at its header.
    pub fn err(&mut self, msg: impl fmt::Display) {
        self.problems.err(self.section.line, msg);
    }

    /// A file's path, relative to the config file's directory unless absolute; empty is unset.
    pub fn path(&mut self, key: &str) -> Option<(PathBuf, usize)> {
        let (value, line) = self.take(key)?;
        (!value.is_empty()).then(|| (self.problems.resolve(&value), line))
    }

    /// The line `key` is on, without taking it.
    pub fn line_of(&self, key: &str) -> Option<usize> {
        self.section.entries.iter().find(|e| e.key == key).map(|e| e.line)
    }

    /// The value as written, empty included.
    pub fn raw(&mut self, key: &str) -> Option<(String, usize)> {
        self.take(key)
    }

    /// A non-empty value; an empty one means unset.
    pub fn text(&mut self, key: &str) -> Option<String> {
        self.take(key).map(|(v, _)| v).filter(|v| !v.is_empty())
    }

    /// A secret, from `key = value` or from the file named by `key_file = PATH` (a bare name
    /// is looked up in `$CREDENTIALS_DIRECTORY`, a relative path next to the config file).
    pub fn secret(&mut self, key: &str) -> Option<Secret> {
        debug_assert!(self.secrets.contains(&key), "{key} is declared secret");
        let file_key = format!("{key}_file");
        let direct = self.take(key);
        let from_file = self.take(&file_key);
        match (direct, from_file) {
            (Some(_), Some((_, line))) => {
                self.err_at(line, format!("`{key}` and `{file_key}` are both set; keep one"));
                None
            }
            (Some((v, _)), None) => Some(Secret::new(v)).filter(|s| !s.expose().is_empty()),
            (None, Some((v, line))) => self.read_secret_file(&v, &file_key, line),
            (None, None) => None,
        }
    }

    fn read_secret_file(&mut self, value: &str, key: &str, line: usize) -> Option<Secret> {
        if value.is_empty() {
            self.err_at(line, format!("{key} is empty"));
            return None;
        }
        let bare = !value.contains('/');
        let path = match std::env::var_os("CREDENTIALS_DIRECTORY") {
            Some(dir) if bare => Path::new(&dir).join(value),
            _ => self.problems.resolve(value),
        };
        match std::fs::read_to_string(&path) {
            Ok(s) => {
                let s = s.trim_end_matches(['\r', '\n']).to_string();
                if s.is_empty() {
                    self.err_at(line, format!("{key}: `{}` is empty", path.display()));
                    None
                } else {
                    Some(Secret::new(s))
                }
            }
            Err(e) => {
                let hint = denied_hint(&e);
                self.err_at(line, format!("{key}: cannot read `{}`: {e}{hint}", path.display()));
                None
            }
        }
    }

    /// An `http://` or `https://` URL with a host, without a trailing slash; empty is unset.
    pub fn url(&mut self, key: &str) -> Option<String> {
        let (value, line) = self.take(key)?;
        if value.is_empty() {
            return None;
        }
        let ok = (value.starts_with("http://") || value.starts_with("https://"))
            && value
                .split("://")
                .nth(1)
                .is_some_and(|rest| !rest.is_empty() && !rest.starts_with('/'));
        if ok {
            Some(value.trim_end_matches('/').to_string())
        } else {
            self.err_at(line, format!("{key}: `{value}` is not an http:// or https:// URL"));
            None
        }
    }

    /// One of `choices`.
    pub fn choice(&mut self, key: &str, choices: &[&'static str]) -> Option<&'static str> {
        let (value, line) = self.take(key)?;
        let found = choices.iter().find(|c| **c == value).copied();
        if found.is_none() {
            self.err_at(line, format!("{key}: `{value}` is not one of {}", choices.join(", ")));
        }
        found
    }

    /// `true` or `false`.
    pub fn bool(&mut self, key: &str) -> Option<bool> {
        self.choice(key, &["true", "false"]).map(|v| v == "true")
    }

    pub fn duration(&mut self, key: &str) -> Option<Duration> {
        let (value, line) = self.take(key)?;
        match parse_duration(&value) {
            Some(d) if !d.is_zero() => Some(d),
            _ => {
                self.err_at(line, not_a_duration(key, &value));
                None
            }
        }
    }

    pub fn size(&mut self, key: &str) -> Option<u64> {
        let (value, line) = self.take(key)?;
        match parse_size(&value) {
            Some(n) if n > 0 => Some(n),
            _ => {
                self.err_at(
                    line,
                    format!("{key}: `{value}` is not a size like 512KiB, 8MiB or 1GiB"),
                );
                None
            }
        }
    }

    pub fn count(&mut self, key: &str, min: u64, max: u64) -> Option<u64> {
        let (value, line) = self.take(key)?;
        match value.parse::<u64>() {
            Ok(n) if (min..=max).contains(&n) => Some(n),
            _ => {
                self.err_at(
                    line,
                    format!("{key}: `{value}` is not a whole number from {min} to {max}"),
                );
                None
            }
        }
    }

    /// Reports every key no getter took.
    pub fn finish(self) {
        for (e, used) in self.section.entries.iter().zip(&self.used) {
            if !used {
                let hint = closest(&e.key, &self.asked)
                    .map(|k| format!(" (did you mean `{k}`?)"))
                    .unwrap_or_default();
                self.problems.err(
                    e.line,
                    format!("unknown key `{}` in [{}]{hint}", e.key, self.section.name),
                );
            }
        }
    }
}

/// The known key nearest to a misspelt `key`: at most two edits away (one for short keys).
fn closest<'k>(key: &str, known: &'k [String]) -> Option<&'k str> {
    let limit = if key.chars().count() <= 4 { 1 } else { 2 };
    known
        .iter()
        .map(|k| (edit_distance(key, k), k))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.as_str())
}

/// Levenshtein distance between two short strings (config keys), by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != *cb)).min(row[j] + 1).min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// Why `value` is not a duration: a bare number names no unit (`lease = 90` could mean seconds
/// or minutes), anything else is not one.
pub(super) fn not_a_duration(key: &str, value: &str) -> String {
    let v = value.trim();
    match !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        true => format!("{key}: `{v}` needs a unit: `{v}s` for seconds (or ms, m, h, d)"),
        false => format!("{key}: `{value}` is not a duration like 250ms, 30s, 5m or 1h"),
    }
}

/// `250ms`, `30s`, `5m`, `1h`, `2d`: a number and its unit.
pub fn parse_duration(v: &str) -> Option<Duration> {
    let v = v.trim();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (num, unit) = v.split_at(split);
    let n: u64 = num.parse().ok()?;
    let ms = match unit.trim() {
        "ms" => n,
        "s" => n.checked_mul(1000)?,
        "m" | "min" => n.checked_mul(60_000)?,
        "h" => n.checked_mul(3_600_000)?,
        "d" => n.checked_mul(86_400_000)?,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}

/// `512KiB`, `8MiB`, `1GiB` (also KB/MB/GB as powers of ten, and plain bytes).
pub fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (num, unit) = v.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// Human form of a duration for `imgate check` and logs.
pub fn fmt_duration(d: Duration) -> String {
    let ms = d.as_millis() as u64;
    if ms % 3_600_000 == 0 {
        format!("{}h", ms / 3_600_000)
    } else if ms % 60_000 == 0 {
        format!("{}m", ms / 60_000)
    } else if ms % 1000 == 0 {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// A byte count as a person reads it, one decimal (`1.2 GiB`): status lines and warnings, where
/// `fmt_size`'s exact form would be a long number.
pub fn approx_size(b: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if b >= 1 << shift {
            return format!("{:.1} {unit}", b as f64 / (1u64 << shift) as f64);
        }
    }
    format!("{b} B")
}

/// Human form of a byte size.
pub fn fmt_size(n: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if n >= 1 << shift && n % (1 << shift) == 0 {
            return format!("{}{}", n >> shift, unit);
        }
    }
    format!("{n}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes_parse_with_units() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("5m"), Some(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("5 parsecs"), None);
        assert_eq!(parse_duration("90"), None, "a bare number names no unit");
        assert_eq!(edit_distance("ttll", "ttl"), 1);
        assert_eq!(edit_distance("max_bytes_totl", "max_bytes_total"), 1);
        let known = ["ttl".to_string(), "overflow".to_string(), "max_bytes_total".to_string()];
        assert_eq!(closest("overfow", &known), Some("overflow"));
        assert_eq!(closest("tl", &known), Some("ttl"));
        assert_eq!(closest("frobnicate", &known), None);
        assert_eq!(
            not_a_duration("lease", " 90 "),
            "lease: `90` needs a unit: `90s` for seconds (or ms, m, h, d)"
        );
        assert_eq!(
            not_a_duration("ttl", "soon"),
            "ttl: `soon` is not a duration like 250ms, 30s, 5m or 1h"
        );
        assert_eq!(parse_size("512KiB"), Some(512 << 10));
        assert_eq!(parse_size("1GiB"), Some(1 << 30));
        assert_eq!(parse_size("99999999999999999999GiB"), None);
        assert_eq!(parse_size("-1"), None);
    }
}
