//! The file's INI dialect: `[section]` headers, `key = value` lines, `#` comments, quoted values;
//! repeated sections and keys refused, every problem collected as `FILE:LINE: message`.

use std::fmt;
use std::path::{Path, PathBuf};

use super::{Config, ConfigError};

/// One `[section]` of the file with its `key = value` lines, in order.
pub struct Section {
    pub name: String,
    pub line: usize,
    pub(super) entries: Vec<Entry>,
}

pub(super) struct Entry {
    pub(super) key: String,
    pub(super) value: String,
    pub(super) line: usize,
}

/// Where problems are collected; also resolves `*_file` paths.
pub struct Problems<'a> {
    file: &'a str,
    dir: Option<&'a Path>,
    errors: Vec<String>,
}

impl<'a> Problems<'a> {
    pub(super) fn new(file: &'a str, dir: Option<&'a Path>) -> Problems<'a> {
        Problems {
            file,
            dir,
            errors: Vec::new(),
        }
    }

    /// The config when no problem was found, else every problem.
    pub(super) fn into_result(self, cfg: Config) -> Result<Config, ConfigError> {
        match self.errors.is_empty() {
            true => Ok(cfg),
            false => Err(ConfigError(self.errors)),
        }
    }

    pub fn err(&mut self, line: usize, msg: impl fmt::Display) {
        self.errors.push(format!("{}:{line}: {msg}", self.file));
    }

    pub(super) fn resolve(&self, value: &str) -> PathBuf {
        let p = Path::new(value);
        match self.dir {
            Some(d) if p.is_relative() => d.join(p),
            _ => p.to_path_buf(),
        }
    }
}

/// Splits the text into sections; reports lines that are neither and repeated sections or keys.
pub(super) fn sections(text: &str, p: &mut Problems) -> Vec<Section> {
    let mut out: Vec<Section> = Vec::new();
    for (idx, raw) in text.lines().enumerate() {
        let line_no = idx + 1;
        let line = strip_comment(raw).trim();
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('[') {
            let Some(inner) = rest.strip_suffix(']') else {
                p.err(line_no, format!("section header `{line}` lacks a closing `]`"));
                continue;
            };
            let name = inner.trim().to_string();
            if out.iter().any(|s| s.name == name) {
                p.err(line_no, format!("section [{name}] appears twice"));
            }
            out.push(Section {
                name,
                line: line_no,
                entries: Vec::new(),
            });
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            p.err(line_no, format!("expected `key = value`, found `{line}`"));
            continue;
        };
        let key = key.trim();
        let Some(section) = out.last_mut() else {
            p.err(line_no, format!("key `{key}` appears before any [section]"));
            continue;
        };
        if section.entries.iter().any(|e| e.key == key) {
            p.err(line_no, format!("key `{key}` is set twice in [{}]", section.name));
            continue;
        }
        section.entries.push(Entry {
            key: key.to_string(),
            value: unquote(value.trim()).to_string(),
            line: line_no,
        });
    }
    out
}

/// `#` starts a comment at the line start or after whitespace, so `a#b` stays a value.
fn strip_comment(line: &str) -> &str {
    let bytes = line.as_bytes();
    let mut in_quotes = false;
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'"' => in_quotes = !in_quotes,
            b'#' if !in_quotes && (i == 0 || bytes[i - 1].is_ascii_whitespace()) => return &line[..i],
            _ => {}
        }
    }
    line
}

fn unquote(v: &str) -> &str {
    if v.len() >= 2 && v.starts_with('"') && v.ends_with('"') {
        &v[1..v.len() - 1]
    } else {
        v
    }
}
