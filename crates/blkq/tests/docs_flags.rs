//! The flag reference pages stay in step with `--help`: every long flag of `blkq serve`,
//! `blkq certs`, `blkq raid` and each `raid` subcommand is written as `` `--name` `` in the page
//! that documents it, and every `` `--name` `` a page writes is a flag that `--help` still has.
//!
//! Subcommands of `raid` are read from `raid --help`'s "Commands:" list, so a new one is
//! covered without editing this file.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

/// `blkq ARGS... --help`, as text.
fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_blkq"))
        .args(args)
        .arg("--help")
        .output()
        .expect("run blkq");
    assert!(
        out.status.success(),
        "blkq {} --help failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("--help is UTF-8")
}

/// The long flags a `--help` defines (`--help` and `--version` left out). A flag is defined on
/// a line indented by at most six spaces that starts with `-` (`  -v, --verbose...`,
/// `      --socket <PATH>`); descriptions are indented further.
fn flags_of(help: &str) -> BTreeSet<String> {
    let mut flags = BTreeSet::new();
    for line in help.lines() {
        let body = line.trim_start();
        let indent = line.len() - body.len();
        if indent == 0 || indent > 6 || !body.starts_with('-') {
            continue;
        }
        let Some(at) = body.find("--") else { continue };
        let name: String = body[at + 2..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
            .collect();
        if !name.is_empty() && name != "help" && name != "version" {
            flags.insert(name);
        }
    }
    flags
}

/// The subcommands listed under "Commands:" (without `help`).
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

/// Every `` `--name` `` written in a page (an inline code span holding exactly one long flag),
/// `--help` and `--version` left out.
fn flags_written(doc: &str) -> BTreeSet<String> {
    let mut flags = BTreeSet::new();
    for (i, _) in doc.match_indices("`--") {
        let rest = &doc[i + 3..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
            .collect();
        if !name.is_empty()
            && rest[name.len()..].starts_with('`')
            && name != "help"
            && name != "version"
        {
            flags.insert(name);
        }
    }
    flags
}

fn docs_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs")
}

fn read_doc(name: &str) -> String {
    let path = docs_dir().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn list(flags: &BTreeSet<String>) -> String {
    flags
        .iter()
        .map(|f| format!("--{f}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The flags of each command, by the page that documents it.
struct Flags {
    serve: BTreeSet<String>,
    certs: BTreeSet<String>,
    /// Every `raid` subcommand's flags, together.
    raid: BTreeSet<String>,
    /// Every `export` subcommand's flags, together (documented in serve.md).
    export: BTreeSet<String>,
}

fn all_flags() -> Flags {
    let raid_help = help(&["raid"]);
    let subs = subcommands(&raid_help);
    assert!(
        subs.len() >= 10,
        "found only {subs:?} under Commands: in `blkq raid --help`"
    );
    let mut raid = flags_of(&raid_help);
    for sub in &subs {
        raid.extend(flags_of(&help(&["raid", sub])));
    }
    let export_help = help(&["export"]);
    let mut export = flags_of(&export_help);
    for sub in subcommands(&export_help) {
        export.extend(flags_of(&help(&["export", &sub])));
    }
    assert!(export.contains("timeout") && export.contains("read-only"));
    Flags {
        serve: flags_of(&help(&["serve"])),
        certs: flags_of(&help(&["certs"])),
        raid,
        export,
    }
}

/// Fails naming the flags of `required` that `doc` never writes as `` `--name` ``.
fn assert_documented(doc: &str, required: &BTreeSet<String>) {
    let written = flags_written(&read_doc(doc));
    let missing: BTreeSet<String> = required.difference(&written).cloned().collect();
    assert!(
        missing.is_empty(),
        "docs/{doc} does not document {} (write each as `--name` at least once)",
        list(&missing)
    );
}

/// Fails naming the `` `--name` ``s of `doc` that none of `known` has.
fn assert_current(doc: &str, known: &BTreeSet<String>) {
    let written = flags_written(&read_doc(doc));
    let stale: BTreeSet<String> = written.difference(known).cloned().collect();
    assert!(
        stale.is_empty(),
        "docs/{doc} names {}, which --help does not have (removed or renamed?)",
        list(&stale)
    );
}

#[test]
fn the_help_parser_finds_flags_and_subcommands() {
    let sample = "Usage: x\n\nCommands:\n  add   Add\n  help  Help\n\nOptions:\n      \
                  --socket <PATH>\n          Unix socket; see --not-a-flag\n  -v, --verbose...\n  \
                  -h, --help\n";
    assert_eq!(subcommands(sample), ["add"]);
    let flags = flags_of(sample);
    assert_eq!(flags.into_iter().collect::<Vec<_>>(), ["socket", "verbose"]);
    let written = flags_written("`--socket` PATH, `--socket PATH`, `--x=1`, `--a-b`");
    assert_eq!(written.into_iter().collect::<Vec<_>>(), ["a-b", "socket"]);
}

#[test]
fn every_serve_certs_and_export_flag_is_in_serve_md() {
    let f = all_flags();
    assert!(f.serve.contains("device") && f.certs.contains("ca-dir"));
    let mut required: BTreeSet<String> = f.serve.union(&f.certs).cloned().collect();
    required.extend(f.export.iter().cloned());
    assert_documented("serve.md", &required);
}

#[test]
fn every_raid_flag_and_serves_mirror_flags_are_in_raid1_md() {
    let f = all_flags();
    let mut required = f.raid.clone();
    required.extend(
        f.serve
            .iter()
            .filter(|n| n.starts_with("raid1") || *n == "control")
            .cloned(),
    );
    assert!(required.contains("raid1-create") && required.contains("write-mostly"));
    assert_documented("raid1.md", &required);
}

#[test]
fn the_reference_pages_name_no_flag_that_help_lacks() {
    let f = all_flags();
    let serve_certs: BTreeSet<String> = f.serve.union(&f.certs).cloned().collect();
    let mut serve_md = serve_certs.clone();
    serve_md.extend(f.export.iter().cloned());
    assert_current("serve.md", &serve_md);
    assert_current("network.md", &serve_certs);
    assert_current("raid1.md", &f.raid.union(&f.serve).cloned().collect());
}

/// The Rust paths (`nbd::server::X`) in `text`: `::` between identifier characters (an IPv6
/// address such as `::1` or `[::1]` is not one).
fn rust_paths(text: &str) -> Vec<String> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.split(|c: char| !(ident(c) || c == ':'))
        .filter(|w| {
            w.match_indices("::").any(|(i, _)| {
                let before = w[..i].chars().next_back();
                let after = w[i + 2..].chars().next();
                before.is_some_and(ident) && after.is_some_and(|c| c.is_ascii_alphabetic())
            })
        })
        .map(str::to_owned)
        .collect()
}

/// `--help` is for users: no Rust item names (a doc comment's intra-code reference) in it.
#[test]
fn help_names_no_rust_items() {
    assert_eq!(
        rust_paths("see nbd::server::DEFAULT_UNIX_PATH, [::1]:10809, ::1"),
        ["nbd::server::DEFAULT_UNIX_PATH"]
    );
    let raid_help = help(&["raid"]);
    let mut pages = vec![
        (String::from("blkq"), help(&[])),
        ("serve".into(), help(&["serve"])),
        ("certs".into(), help(&["certs"])),
        ("bench".into(), help(&["bench"])),
        ("bitmap".into(), help(&["bitmap"])),
        ("raid".into(), raid_help.clone()),
    ];
    for sub in subcommands(&raid_help) {
        pages.push((format!("raid {sub}"), help(&["raid", &sub])));
    }
    for sub in subcommands(&help(&["bitmap"])) {
        pages.push((format!("bitmap {sub}"), help(&["bitmap", &sub])));
    }
    for (cmd, text) in pages {
        let found = rust_paths(&text);
        assert!(
            found.is_empty(),
            "`blkq {cmd} --help` names Rust items: {found:?}"
        );
    }
}
