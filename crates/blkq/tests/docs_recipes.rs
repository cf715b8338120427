//! The docs' recipes run as written: every fenced block of README.md and docs/*.md whose info
//! string is `sh recipe` is run with bash, as a script, the built `blkq` first on PATH.
//!
//! Each recipe runs in a scratch directory (with `scripts` and `docs` linked from the
//! repository, as the docs run from its root), in a private mount, PID and network namespace
//! (`unshare`, as root): `/srv`, `/run` and `/var/tmp` are empty directories of its own,
//! `/etc/hosts` names this host `myhost`, and every process it leaves running is killed when
//! it ends. Lines that start with a host prompt, `a$ ` or `b$ `, run on that host: two network
//! namespaces joined by a veth pair (`common::Hosts`), known to each other as `a` and `b`.
//! The script runs under `set -e -o pipefail`: the first command that fails fails the test,
//! naming the page, the line and what the recipe printed. The convention is in
//! docs/testing.md ("Recipes").
//!
//! Needs root and `unshare` (util-linux); elsewhere it is skipped with a line saying why.

mod common;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long one recipe may run.
const LIMIT: Duration = Duration::from_secs(60);

/// One marked block.
#[derive(Debug, Clone, PartialEq)]
struct Recipe {
    /// The page, from the repository root.
    page: String,
    /// The line (from 1) of the block's first line of code.
    line: usize,
    /// Its lines.
    body: Vec<String>,
    /// The commands it needs (`needs=CMD,CMD` after `recipe`): without one it is skipped.
    needs: Vec<String>,
}

impl Recipe {
    /// Whether a line runs on another host (`a$ `, `b$ `).
    fn two_hosts(&self) -> bool {
        self.body.iter().any(|l| prompt(l).is_some())
    }
}

/// The host and the command of a line with a host prompt (`a$ CMD`).
fn prompt(line: &str) -> Option<(char, &str)> {
    let mut c = line.chars();
    let host = c.next()?;
    let rest = c.as_str().strip_prefix("$ ")?;
    (host == 'a' || host == 'b').then_some((host, rest))
}

/// The recipes of one page.
fn recipes_in(page: &str, text: &str) -> Vec<Recipe> {
    let mut out = Vec::new();
    let mut open: Option<(Option<Vec<String>>, usize, Vec<String>)> = None;
    for (i, line) in text.lines().enumerate() {
        match &mut open {
            None => {
                if let Some(info) = line.strip_prefix("```") {
                    let mut words = info.split_whitespace();
                    let marked = (words.next() == Some("sh") && words.next() == Some("recipe"))
                        .then(|| {
                            words
                                .filter_map(|w| w.strip_prefix("needs="))
                                .flat_map(|w| w.split(','))
                                .map(str::to_owned)
                                .collect()
                        });
                    open = Some((marked, i + 2, Vec::new()));
                }
            }
            Some((marked, first, body)) => {
                if line.starts_with("```") {
                    if let Some(needs) = marked.take() {
                        out.push(Recipe {
                            page: page.to_owned(),
                            line: *first,
                            body: std::mem::take(body),
                            needs,
                        });
                    }
                    open = None;
                } else {
                    body.push(line.to_owned());
                }
            }
        }
    }
    out
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every recipe of README.md and docs/*.md.
fn all_recipes() -> Vec<Recipe> {
    let root = repo();
    let mut pages = vec!["README.md".to_owned()];
    let mut docs: Vec<String> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
        .iter()
        .flat_map(|p| recipes_in(p, &std::fs::read_to_string(root.join(p)).unwrap()))
        .collect()
}

/// Single-quotes `s` for bash.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The lines before the recipe's own in the script.
const PREAMBLE: &str = "set -eE -o pipefail\n\
    trap 'echo \"recipe-failed-at $LINENO: $BASH_COMMAND\" >&2' ERR\n";

/// The script that runs `r`: its lines one for one after [`PREAMBLE`], a prompted line run
/// by bash inside that host's network namespace (`$BLKQ_HOST_A`/`_B`, bound by the setup).
fn script(r: &Recipe) -> String {
    let mut s = String::from(PREAMBLE);
    for l in &r.body {
        match prompt(l) {
            Some((host, cmd)) => {
                assert!(
                    !cmd.trim_end().ends_with('\\'),
                    "{}:{}: a prompted line cannot continue on the next",
                    r.page,
                    r.line
                );
                let ns = if host == 'a' { "A" } else { "B" };
                writeln!(
                    s,
                    "nsenter --net=\"$BLKQ_HOST_{ns}\" bash -c {}",
                    quote(cmd)
                )
                .unwrap();
            }
            None => writeln!(s, "{l}").unwrap(),
        }
    }
    s
}

/// The clients recipes use, which `BLKQ_NO_INSTALL=1` may leave out: a recipe that names one
/// needs it.
const CLIENTS: &[&str] = &["nbdinfo", "nbdcopy", "qemu-img", "qemu-io", "curl", "nbdsh"];

/// What `r` needs that is missing here, if anything: its `needs=`, the clients it names, and
/// python3's libnbd for `scripts/cbt-backup.py`.
fn missing(r: &Recipe) -> Option<String> {
    let text = r.body.join("\n");
    let named = CLIENTS
        .iter()
        .filter(|c| text.contains(*c))
        .map(|c| c.to_string());
    if let Some(m) = r.needs.iter().cloned().chain(named).find(|c| !on_path(c)) {
        return Some(m);
    }
    if text.contains("cbt-backup.py") {
        // The interpreter of the script's first line (the system one, where python3-libnbd
        // installs), not whichever python3 comes first on PATH.
        let ok = Command::new("/usr/bin/python3")
            .args(["-c", "import nbd"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            return Some("python3-libnbd".into());
        }
    }
    None
}

/// Whether `cmd` is on PATH.
fn on_path(cmd: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(cmd).is_file()))
}

/// Runs `r`; `Err` says where it failed and what it printed. A recipe that needs a command
/// missing here is skipped, saying so (failed instead for a `needs=` one under
/// `BLKQ_REQUIRE_CEPH=1`, as the rbd tests do).
fn run(r: &Recipe) -> Result<(), String> {
    if let Some(missing) = missing(r) {
        let why = format!("{}:{}: needs {missing}, not installed", r.page, r.line);
        let ceph = r.needs.contains(&missing);
        if ceph && std::env::var_os("BLKQ_REQUIRE_CEPH").is_some_and(|v| v == "1") {
            return Err(format!("{why} (BLKQ_REQUIRE_CEPH=1)"));
        }
        eprintln!("SKIPPED {why}");
        return Ok(());
    }
    let hosts = if r.two_hosts() {
        match common::Hosts::new() {
            Ok(h) => Some(h),
            Err(why) => {
                eprintln!(
                    "SKIPPED {}:{}: the two hosts cannot be made here: {why}",
                    r.page, r.line
                );
                return Ok(());
            }
        }
    } else {
        None
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for sub in ["srv", "run", "var-tmp", "work", "ns"] {
        std::fs::create_dir(d.join(sub)).unwrap();
    }
    let mut etc_hosts = String::from("127.0.0.1 localhost myhost\n::1 localhost\n");
    if hosts.is_some() {
        writeln!(etc_hosts, "{} a\n{} b", common::FRONT_IP, common::BACK_IP).unwrap();
    }
    std::fs::write(d.join("hosts"), etc_hosts).unwrap();
    std::fs::write(d.join("recipe.sh"), script(r)).unwrap();
    let root = repo().canonicalize().unwrap();
    for link in ["scripts", "docs"] {
        std::os::unix::fs::symlink(root.join(link), d.join("work").join(link)).unwrap();
    }
    let bin_dir = Path::new(common::BIN).parent().unwrap();
    // Mounts first (the host namespaces' files under /run/netns are bound into the scratch
    // directory before /run is covered), then the recipe from the work directory.
    let mut setup = String::from("set -e\nip link set lo up\n");
    if let Some(h) = &hosts {
        for (name, ns) in [("a", h.front()), ("b", h.back())] {
            let at = d.join("ns").join(name);
            std::fs::write(&at, "").unwrap();
            writeln!(setup, "mount --bind {} {}", ns.display(), at.display()).unwrap();
        }
    }
    for (what, on) in [("srv", "/srv"), ("run", "/run"), ("var-tmp", "/var/tmp")] {
        writeln!(setup, "mount --bind {} {on}", d.join(what).display()).unwrap();
    }
    writeln!(
        setup,
        "mount --bind {} /etc/hosts",
        d.join("hosts").display()
    )
    .unwrap();
    writeln!(setup, "cd {}", d.join("work").display()).unwrap();
    writeln!(setup, "bash {}", d.join("recipe.sh").display()).unwrap();
    let out_path = d.join("output");
    let out = std::fs::File::create(&out_path).unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut child = Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "--net",
            "--pid",
            "--fork",
            "--kill-child",
            "bash",
            "-c",
            &setup,
        ])
        .env("PATH", path)
        .env("BLKQ_HOST_A", d.join("ns/a"))
        .env("BLKQ_HOST_B", d.join("ns/b"))
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .map_err(|e| format!("cannot run unshare: {e}"))?;
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if t0.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = std::fs::read_to_string(&out_path).unwrap_or_default();
    let at = |script_line: usize| {
        let preamble = PREAMBLE.lines().count();
        r.line + script_line.saturating_sub(preamble + 1)
    };
    match status {
        Some(st) if st.success() => Ok(()),
        Some(st) => {
            let line = output
                .lines()
                .rev()
                .find_map(|l| l.strip_prefix("recipe-failed-at "))
                .and_then(|rest| rest.split(':').next()?.parse::<usize>().ok())
                .map(at)
                .unwrap_or(r.line);
            Err(format!(
                "{}:{line}: the recipe failed ({st}); it printed:\n{output}",
                r.page
            ))
        }
        None => Err(format!(
            "{}:{}: the recipe did not end within {LIMIT:?}; it printed:\n{output}",
            r.page, r.line
        )),
    }
}

/// Why recipes cannot run here, if they cannot.
fn cannot_run() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root (the recipes run in namespaces of their own)".into());
    }
    let probe = Command::new("unshare")
        .args(["--mount", "--net", "--pid", "--fork", "true"])
        .output();
    match probe {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "unshare cannot make the namespaces here: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("no unshare(1) (util-linux): {e}")),
    }
}

#[test]
fn marked_blocks_are_found_with_their_lines() {
    let page = "x\n```sh\nnot this\n```\n\n```sh recipe\necho one\nb$ echo two\n```\n\
                ```sh recipe needs=ceph-mon,rbd\nrbd ls\n```\n";
    let r = recipes_in("p.md", page);
    assert_eq!(r.len(), 2);
    assert_eq!(r[1].needs, ["ceph-mon", "rbd"]);
    assert!(r[0].needs.is_empty());
    assert_eq!(r[0].line, 7);
    assert_eq!(r[0].body, ["echo one", "b$ echo two"]);
    assert!(r[0].two_hosts());
    let s = script(&r[0]);
    assert!(s.ends_with("echo one\nnsenter --net=\"$BLKQ_HOST_B\" bash -c 'echo two'\n"));
    assert_eq!(quote("it's"), r"'it'\''s'");
    let mut lacking = r[1].clone();
    lacking.needs = vec!["blkq-no-such-command".into()];
    assert_eq!(missing(&lacking).as_deref(), Some("blkq-no-such-command"));
    // The docs have recipes.
    assert!(all_recipes().len() >= 3, "{:?}", all_recipes());
}

/// A failing recipe is reported at its page and line, with its output.
#[test]
fn a_failing_recipe_names_its_line() {
    if let Some(why) = cannot_run() {
        eprintln!("SKIPPED a_failing_recipe_names_its_line: {why}");
        return;
    }
    let r = Recipe {
        page: "docs/x.md".into(),
        line: 10,
        body: vec![
            "echo fine".into(),
            "blkq raid status --control /run/none.sock".into(),
            "echo never".into(),
        ],
        needs: Vec::new(),
    };
    let e = run(&r).unwrap_err();
    assert!(e.starts_with("docs/x.md:11: the recipe failed"), "{e}");
    assert!(e.contains("fine") && !e.contains("never"), "{e}");
}

#[test]
fn every_recipe_runs_as_written() {
    if let Some(why) = cannot_run() {
        eprintln!("SKIPPED every_recipe_runs_as_written: {why}");
        return;
    }
    let recipes = all_recipes();
    let failures: Vec<String> = std::thread::scope(|s| {
        let runs: Vec<_> = recipes.iter().map(|r| s.spawn(move || run(r))).collect();
        runs.into_iter()
            .filter_map(|h| h.join().unwrap().err())
            .collect()
    });
    assert!(
        failures.is_empty(),
        "{} of {} recipes failed:\n\n{}",
        failures.len(),
        recipes.len(),
        failures.join("\n\n")
    );
}
