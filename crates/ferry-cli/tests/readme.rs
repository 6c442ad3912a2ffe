//! README.md's walkthrough, run as written: every `console` block's
//! commands, in order, in one scratch directory, with `ferry` on PATH; what
//! each prints is checked against the lines the README shows under it.
//!
//! The README's notation (that of `trycmd`): a line `$ CMD` is a command
//! (a trailing `\` continues it); the lines under it up to the next `$` are
//! what it prints (stdout, then stderr), where a line `...` stands for any
//! number of lines and `[..]` for any text within a line. A command with
//! no lines under it is only checked to succeed; one whose output shows a
//! line starting `Error: ` must fail. A command ending in `&` is a daemon:
//! it runs in the background until the walkthrough ends, and the next
//! command waits until every address it was told to listen on answers.
//! The guest's files are where `scripts/guest-image.sh` puts them,
//! `/var/cache/ferry-guest`, unless `FERRY_GUEST_DIR` says otherwise.

#[path = "../../ferry-server/tests/common/toxiproxy.rs"]
#[allow(dead_code)]
mod toxiproxy;

mod common;
mod guests;

use std::io::Read;
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

/// Flags after which a daemon's command names an address it listens on.
const LISTEN_FLAGS: &[&str] = &[
    "--nbd",
    "--admin",
    "--migrate",
    "--control",
    "--move-listen",
    "--listen",
];

/// Where the README says the guest's files are.
const README_GUEST_DIR: &str = "/var/cache/ferry-guest";

/// The longest one foreground command may take (a teleport under TCG).
const COMMAND_LIMIT_S: u32 = 300;

#[derive(Debug)]
struct Step {
    /// Line in README.md where the command starts (1-based).
    line: usize,
    command: String,
    expected: Vec<String>,
}

/// Every `$ ` command of every ```console block, with its expected output.
fn steps(readme: &str) -> Vec<Step> {
    let mut out: Vec<Step> = Vec::new();
    let mut in_block = false;
    let mut continuing = false;
    for (i, line) in readme.lines().enumerate() {
        let t = line.trim_end();
        if !in_block {
            in_block = t == "```console";
            continue;
        }
        if t == "```" {
            in_block = false;
            continuing = false;
            continue;
        }
        if continuing {
            let s = out.last_mut().unwrap();
            s.command.push('\n');
            s.command.push_str(t);
            continuing = t.ends_with('\\');
        } else if let Some(cmd) = t.strip_prefix("$ ") {
            out.push(Step {
                line: i + 1,
                command: cmd.to_string(),
                expected: Vec::new(),
            });
            continuing = t.ends_with('\\');
        } else if let Some(s) = out.last_mut() {
            s.expected.push(t.to_string());
        } else {
            panic!("README.md:{}: output before any command: {t:?}", i + 1);
        }
    }
    for s in &mut out {
        while s.expected.last().is_some_and(String::is_empty) {
            s.expected.pop();
        }
    }
    out
}

/// One line against a pattern where `[..]` is any text.
fn line_matches(pattern: &str, line: &str) -> bool {
    let parts: Vec<&str> = pattern.split("[..]").collect();
    if parts.len() == 1 {
        return pattern == line;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !line.starts_with(first) || line.len() < first.len() + last.len() || !line.ends_with(last) {
        return false;
    }
    let mut rest = &line[first.len()..line.len() - last.len()];
    for p in &parts[1..parts.len() - 1] {
        match rest.find(p) {
            Some(k) => rest = &rest[k + p.len()..],
            None => return false,
        }
    }
    true
}

/// Lines against patterns where a line `...` is any number of lines.
fn lines_match(expected: &[String], actual: &[&str]) -> bool {
    match expected.split_first() {
        None => actual.is_empty(),
        Some((e, rest)) if e == "..." => {
            (0..=actual.len()).any(|k| lines_match(rest, &actual[k..]))
        }
        Some((e, rest)) => {
            !actual.is_empty() && line_matches(e, actual[0]) && lines_match(rest, &actual[1..])
        }
    }
}

/// The addresses a daemon's command line says it listens on.
fn listen_addrs(command: &str) -> Vec<String> {
    let words: Vec<&str> = command.split_whitespace().collect();
    words
        .windows(2)
        .filter(|w| LISTEN_FLAGS.contains(&w[0]))
        .map(|w| w[1].to_string())
        .filter(|a| {
            a.rsplit_once(':')
                .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        })
        .collect()
}

/// The scratch directory and the daemons the walkthrough started, ended
/// however the test ends (their guests too: QEMU outlives `ferry host`).
struct Walk {
    dir: PathBuf,
    daemons: Vec<Child>,
}

impl Drop for Walk {
    fn drop(&mut self) {
        for d in &mut self.daemons {
            // Each daemon leads a process group of its own (its shell and it).
            let _ = Command::new("kill")
                .args(["-9", "--", &format!("-{}", d.id())])
                .status();
            let _ = d.wait();
        }
        let _ = Command::new("pkill")
            .arg("-9")
            .arg("-f")
            .arg(format!("qemu-system.*{}/", self.dir.display()))
            .status();
    }
}

impl Walk {
    fn shell(&self, command: &str) -> Command {
        let mut c = Command::new("bash");
        let path = format!(
            "{}:{}",
            Path::new(FERRY).parent().unwrap().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        c.arg("-c")
            .arg(command)
            .current_dir(&self.dir)
            .env("PATH", path)
            .env_remove("FERRY_LOG")
            .env_remove("RUST_BACKTRACE")
            .env_remove("FERRY_ADMIN")
            .env_remove("FERRY_HOST")
            .env_remove("FERRY_CONTROLLER")
            .env_remove("FERRY_TLS_DIR");
        c
    }

    fn run(&mut self, s: &Step) {
        let cmd = s
            .command
            .replace("\\\n", " ")
            .replace(README_GUEST_DIR, &guests::guest_dir().display().to_string());
        match cmd.trim_end().strip_suffix('&') {
            Some(bg) => self.start_daemon(s, bg),
            None => self.run_command(s, &cmd),
        }
    }

    /// A daemon in the background, waited for on its listen addresses.
    fn start_daemon(&mut self, s: &Step, bg: &str) {
        let child = self
            .shell(bg)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap();
        self.daemons.push(child);
        let t = Instant::now();
        for a in listen_addrs(bg) {
            while TcpStream::connect(&a).is_err() {
                assert!(
                    t.elapsed() < Duration::from_secs(30),
                    "README.md:{}: {bg}: nothing listens on {a} after 30 s",
                    s.line
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// A command in the foreground: its status and output as the README
    /// shows them.
    fn run_command(&mut self, s: &Step, cmd: &str) {
        let mut child = self
            .shell(&format!(
                "timeout {COMMAND_LIMIT_S} bash -c {}",
                shell_quote(cmd)
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stderr = child.stderr.take().unwrap();
        let err = std::thread::spawn(move || {
            let mut e = String::new();
            stderr.read_to_string(&mut e).unwrap();
            e
        });
        let mut out = String::new();
        child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        let status = child.wait().unwrap();
        let err = err.join().unwrap();
        let all = format!("{out}{err}");
        let actual: Vec<&str> = all.lines().map(str::trim_end).collect();
        let must_fail = s.expected.iter().any(|l| l.starts_with("Error: "));
        assert!(
            status.success() != must_fail,
            "README.md:{}: `{cmd}` {} ({status}):\n{all}",
            s.line,
            if must_fail { "should fail" } else { "failed" }
        );
        if !s.expected.is_empty() {
            assert!(
                lines_match(&s.expected, &actual),
                "README.md:{}: `{cmd}` printed what the README does not show.\n--- README shows:\n{}\n--- it printed:\n{all}",
                s.line,
                s.expected.join("\n")
            );
        }
    }
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[test]
fn the_readme_walkthrough_runs_as_written() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let steps = steps(&readme);
    assert!(
        steps.len() > 20,
        "the walkthrough has {} commands",
        steps.len()
    );
    // It boots the test guest (scripts/guest-image.sh) under QEMU.
    if guests::guest_files().is_none() || !common::have("mke2fs") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut walk = Walk {
        dir: tmp.path().to_path_buf(),
        daemons: Vec::new(),
    };
    for s in &steps {
        eprintln!("README.md:{}: $ {}", s.line, s.command);
        walk.run(s);
    }
}

#[test]
fn output_patterns_match_as_documented() {
    assert!(line_matches(
        "moved [..] in [..] s",
        "moved web-root in 1.2 s"
    ));
    assert!(!line_matches(
        "moved [..] in [..] s",
        "moved web-root in 1.2 ms"
    ));
    assert!(line_matches("[..]", ""));
    let e: Vec<String> = ["a", "...", "c"].iter().map(|s| s.to_string()).collect();
    assert!(lines_match(&e, &["a", "b", "b", "c"]));
    assert!(lines_match(&e, &["a", "c"]));
    assert!(!lines_match(&e, &["a", "b"]));
    let st = steps("text\n```console\n$ a \\\n  b\nout\n...\n\n$ c &\n```\n$ not run\n");
    assert_eq!(st.len(), 2);
    assert_eq!(st[0].command, "a \\\n  b");
    assert_eq!(st[0].expected, ["out", "..."]);
    assert_eq!(st[1].line, 8);
    assert_eq!(
        listen_addrs("ferry serve --nbd 127.0.0.1:1 --admin 127.0.0.1:2 --pool p"),
        ["127.0.0.1:1", "127.0.0.1:2"]
    );
}
