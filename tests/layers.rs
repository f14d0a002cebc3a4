//! The source's shape, read as text: no two modules import each other (ARCHITECTURE.md,
//! "Layers"). A module and its own parent or child are one unit (a folder's `mod.rs` declares
//! its files, which use its types); any other pair that refers both ways is a circle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Module = Vec<String>;

/// Every module of `src/` with its source, test modules left out (a test may reach anywhere).
fn modules() -> BTreeMap<Module, String> {
    let mut out = BTreeMap::new();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(&root).unwrap().with_extension("");
            let mut module: Module = rel.iter().map(|c| c.to_string_lossy().to_string()).collect();
            if matches!(module.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                module.pop();
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let code = match text.find("#[cfg(test)]\nmod tests") {
                Some(i) => text[..i].to_string(),
                None => text,
            };
            let code: String = code
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            out.insert(module, code);
        }
    }
    out
}

/// The paths written in `code` that start at `crate`, `super` or `self`, as segments, with one
/// level of `{…}` groups spread (`use super::{api::Api, poll}`).
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let bytes = code.as_bytes();
    for start in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(i) = code[from..].find(start) {
            let at = from + i;
            from = at + start.len();
            if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_' || bytes[at - 1] == b':') {
                continue;
            }
            let mut segs: Vec<String> = Vec::new();
            let mut rest = &code[at..];
            loop {
                let ident: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if ident.is_empty() {
                    break;
                }
                segs.push(ident.clone());
                rest = &rest[ident.len()..];
                match rest.strip_prefix("::") {
                    Some(r) => rest = r,
                    None => break,
                }
            }
            if let Some(group) = rest.strip_prefix('{').and_then(|g| g.split('}').next()) {
                for item in group.split(',') {
                    let mut p = segs.clone();
                    p.extend(
                        item.trim()
                            .split("::")
                            .map(|s| s.trim().to_string())
                            .filter(|s| !s.is_empty()),
                    );
                    found.push(p);
                }
            } else {
                found.push(segs);
            }
        }
    }
    found
}

/// The module a path from `module` names: its longest prefix that is a module.
fn resolve(module: &Module, path: &[String], known: &BTreeSet<Module>) -> Option<Module> {
    let mut full: Module = Vec::new();
    let mut base = module.clone();
    let mut segs = path.iter().peekable();
    match segs.peek().map(|s| s.as_str()) {
        Some("crate") => {
            segs.next();
        }
        Some("self") | Some("super") => {
            while let Some(s) = segs.peek() {
                match s.as_str() {
                    "self" => {}
                    "super" => {
                        base.pop()?;
                    }
                    _ => break,
                }
                segs.next();
            }
            full = base;
        }
        _ => return None,
    }
    full.extend(segs.cloned());
    (0..=full.len())
        .rev()
        .map(|n| full[..n].to_vec())
        .find(|m| known.contains(m))
}

fn related(a: &Module, b: &Module) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

/// Each module's references to modules that are not its own parent or child, as `(from, to)`.
fn edges() -> BTreeSet<(Module, Module)> {
    let modules = modules();
    let known: BTreeSet<Module> = modules.keys().cloned().collect();
    let mut edges = BTreeSet::new();
    for (module, code) in &modules {
        for path in paths(code) {
            if let Some(target) = resolve(module, &path, &known) {
                if !related(module, &target) {
                    edges.insert((module.clone(), target));
                }
            }
        }
    }
    edges
}

#[test]
fn no_two_modules_import_each_other() {
    let edges = edges();
    assert!(
        edges.len() > 100,
        "the reader finds the crate's references: {}",
        edges.len()
    );
    assert!(
        edges.contains(&(
            vec!["providers".into(), "telegram".into(), "link".into()],
            vec!["providers".into(), "telegram".into(), "api".into()]
        )),
        "a sibling's `use super::api::…` is seen"
    );
    let circles: Vec<String> = edges
        .iter()
        .filter(|(a, b)| a < b && edges.contains(&(b.clone(), a.clone())))
        .map(|(a, b)| format!("{} <-> {}", a.join("::"), b.join("::")))
        .collect();
    assert!(
        circles.is_empty(),
        "modules that import each other:\n{}",
        circles.join("\n")
    );
}
