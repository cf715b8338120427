//! The binary's rooms stay apart: no two files of `crates/blkq/src` import each other (a file
//! that uses another is used by it in no way), so each reads in one direction, from the
//! command line down to the libraries. In every crate of the workspace no files go round in a
//! circle of imports, but the one known and said below.
//!
//! A file's imports are the modules its code names: `crate::a::b` paths, `super::x` paths (in
//! the file's own code, not its tests), and its child modules named by their own name
//! (`legs::plan`). Comments and `mod x;` declarations are not imports.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module path of each source file: `src/serve/args.rs` is `serve::args`.
fn modules(src: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().and_then(|x| x.to_str()) != Some("rs") {
                continue;
            }
            let rel = p.strip_prefix(src).unwrap();
            let mut m: Vec<String> = rel
                .iter()
                .map(|c| c.to_string_lossy().trim_end_matches(".rs").to_string())
                .collect();
            if matches!(m.last().map(String::as_str), Some("mod" | "main")) {
                m.pop();
            }
            out.insert(m, p);
        }
    }
    out
}

/// The path segments after each occurrence of `prefix` in `code` (`crate::a::b::C` gives
/// `[a, b, C]`).
fn paths_after<'a>(code: &'a str, prefix: &str) -> Vec<Vec<&'a str>> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(i) = code[at..].find(prefix) {
        let start = at + i;
        at = start + prefix.len();
        let before = code[..start].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let mut segs = Vec::new();
        let mut rest = &code[at..];
        loop {
            let n = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            if n == 0 {
                break;
            }
            segs.push(&rest[..n]);
            match rest[n..].strip_prefix("::") {
                Some(r) => rest = r,
                None => break,
            }
        }
        out.push(segs);
    }
    out
}

/// The longest prefix of `path` that is a module file.
fn resolve(mods: &BTreeMap<Vec<String>, PathBuf>, path: &[String]) -> Option<Vec<String>> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| mods.contains_key(p))
}

/// The code of a file without its comments; and without its `mod tests` tail when
/// `own_code_only`.
fn code(text: &str, own_code_only: bool) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let t = line.trim_start();
        if own_code_only && t.starts_with("mod tests") {
            break;
        }
        if t.starts_with("//") {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Each file of `src` (by module path) and the modules its code names.
type Imports = BTreeMap<Vec<String>, BTreeSet<Vec<String>>>;

/// The imports of every file of the crate whose sources are `src`.
fn imports_of(src: &Path) -> (BTreeMap<Vec<String>, PathBuf>, Imports) {
    let mods = modules(src);
    let mut imports = Imports::new();
    for (m, file) in &mods {
        let text = std::fs::read_to_string(file).unwrap();
        let all = code(&text, false);
        let own = code(&text, true);
        let mut found = BTreeSet::new();
        for p in paths_after(&all, "crate::") {
            let p: Vec<String> = p.iter().map(|s| s.to_string()).collect();
            found.extend(resolve(&mods, &p));
        }
        if let Some((_, parent)) = m.split_last() {
            for p in paths_after(&own, "super::") {
                let mut full = parent.to_vec();
                full.extend(p.iter().map(|s| s.to_string()));
                // `super::Item` names the parent module's own file.
                found.insert(resolve(&mods, &full).unwrap_or_else(|| parent.to_vec()));
            }
        }
        for (child, _) in mods.range(m.clone()..) {
            if child.len() != m.len() + 1 || !child.starts_with(m) {
                continue;
            }
            let name = child.last().unwrap();
            let named = paths_after(&own, &format!("{name}::"));
            if !named.is_empty() {
                found.insert(child.clone());
            }
        }
        found.remove(m);
        imports.insert(m.clone(), found);
    }
    (mods, imports)
}

/// The circles of `imports`: each set of two or more files that reach each other by
/// following imports, as sorted module paths (`a::b`).
fn circles(imports: &Imports) -> Vec<Vec<String>> {
    let reach = |from: &Vec<String>| {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.clone()];
        while let Some(m) = stack.pop() {
            for n in imports.get(&m).into_iter().flatten() {
                if seen.insert(n.clone()) {
                    stack.push(n.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<_, _> = imports.keys().map(|m| (m.clone(), reach(m))).collect();
    let mut out: Vec<Vec<String>> = Vec::new();
    for (m, r) in &reaches {
        if !r.contains(m) {
            continue;
        }
        let mut circle: Vec<String> = r
            .iter()
            .filter(|n| reaches[*n].contains(m))
            .map(|n| n.join("::"))
            .collect();
        circle.sort();
        if !out.contains(&circle) {
            out.push(circle);
        }
    }
    out
}

#[test]
fn no_two_files_of_the_binary_import_each_other() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (mods, imports) = imports_of(&src);
    assert!(mods.contains_key(&vec!["serve".to_string(), "args".to_string()]));
    let name = |m: &Vec<String>| mods[m].strip_prefix(&src).unwrap().display().to_string();
    let mut pairs = Vec::new();
    for (a, uses) in &imports {
        for b in uses {
            if a < b && imports.get(b).is_some_and(|u| u.contains(a)) {
                pairs.push(format!("{} <-> {}", name(a), name(b)));
            }
        }
    }
    assert!(
        pairs.is_empty(),
        "files of crates/blkq/src that import each other:\n  {}",
        pairs.join("\n  ")
    );
}

/// The one circle of files left in the workspace: the queue's core holds the scheduler, and
/// the `Scheduler` trait (mq-deadline's state among its users) takes that core; breaking it
/// would change blk's public traits and put a virtual call or a type parameter on the I/O
/// path.
const KNOWN_CIRCLES: &[(&str, &[&str])] = &[(
    "blk",
    &[
        "queue",
        "sched",
        "sched::deadline",
        "sched::deadline::state",
    ],
)];

#[test]
fn no_crate_has_a_circle_of_files_but_the_known_one() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut found = Vec::new();
    let mut scanned = 0;
    for e in std::fs::read_dir(crates).unwrap() {
        let dir = e.unwrap().path();
        let src = dir.join("src");
        if !src.is_dir() {
            continue;
        }
        scanned += 1;
        let krate = dir.file_name().unwrap().to_string_lossy().to_string();
        for c in circles(&imports_of(&src).1) {
            let known = KNOWN_CIRCLES.iter().any(|(k, files)| {
                *k == krate && c.iter().map(String::as_str).eq(files.iter().copied())
            });
            if !known {
                found.push(format!("{krate}: {}", c.join(", ")));
            }
        }
    }
    assert!(scanned >= 10, "scanned {scanned} crates");
    assert!(
        found.is_empty(),
        "circles of files (files that reach each other through their imports; move what they \
         share to a file that names neither):\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn a_circle_is_found() {
    let m = |s: &str| s.split("::").map(str::to_string).collect::<Vec<_>>();
    let mut imports = Imports::new();
    imports.insert(m("a"), [m("b")].into());
    imports.insert(m("b"), [m("c")].into());
    imports.insert(m("c"), [m("a")].into());
    imports.insert(m("d"), [m("a")].into());
    assert_eq!(circles(&imports), [vec!["a", "b", "c"]]);
    imports.insert(m("c"), BTreeSet::new());
    assert!(circles(&imports).is_empty());
}

#[test]
fn the_scanner_sees_imports() {
    let code = "use crate::serve::args::{A, B};\nlet x = super::config::load();\nfoo::bar();";
    assert_eq!(paths_after(code, "crate::"), [vec!["serve", "args"]]);
    assert_eq!(paths_after(code, "super::"), [vec!["config", "load"]]);
    assert_eq!(paths_after(code, "foo::"), [vec!["bar"]]);
    assert!(paths_after("xfoo::bar", "foo::").is_empty());
}
