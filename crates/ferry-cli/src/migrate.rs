//! `ferry migrate` (start a migration through the source daemon's admin API,
//! follow it with a progress bar, print the report) and `ferry certs` (the
//! daemon's migration certificate and the peers it trusts).

use crate::admin_client::AdminClient;
use crate::human;
use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use ferry_server::migration::tls::{fingerprint, CertStore};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct MigrateArgs {
    /// Volume to move (held by the daemon at --admin).
    pub volume: String,
    /// Migration listener of the destination daemon, HOST:PORT.
    #[arg(long)]
    pub to: String,
    /// Target for the final pause of guest writes (e.g. 100ms, 1s).
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    pub max_downtime: Duration,
    /// Cap on the link, bytes per second (e.g. 12M).
    #[arg(long)]
    pub bwlimit: Option<String>,
    /// Dirty rounds before pausing anyway.
    #[arg(long, default_value_t = 30)]
    pub max_rounds: u32,
    /// Send every non-zero block instead of fingerprints first (baseline).
    #[arg(long)]
    pub no_dedup: bool,
    /// Do not compress literal data.
    #[arg(long)]
    pub no_compress: bool,
    /// No TLS. Only allowed when both daemons are on loopback.
    #[arg(long)]
    pub plaintext: bool,
    /// Keep resuming after link failures this long.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub retry_for: Duration,
    /// Print the final report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

fn num(v: &serde_json::Value, k: &str) -> u64 {
    v.get(k).and_then(|x| x.as_u64()).unwrap_or(0)
}

pub fn migrate(a: MigrateArgs, c: &AdminClient) -> Result<()> {
    let mut body = serde_json::json!({
        "to": a.to,
        "plaintext": a.plaintext,
        "max_downtime_ms": a.max_downtime.as_millis() as u64,
        "max_rounds": a.max_rounds,
        "dedup": !a.no_dedup,
        "compress": !a.no_compress,
        "retry_for_s": a.retry_for.as_secs(),
    });
    if let Some(b) = &a.bwlimit {
        body["bwlimit"] = serde_json::Value::String(b.clone());
    }
    let started = c.post_json(&format!("/v1/volumes/{}/migrate", a.volume), body)?;
    let id = started["id"]
        .as_str()
        .context("the daemon did not return a migration id")?
        .to_string();
    let tty = std::io::stderr().is_terminal();
    let pb = if tty {
        let pb = ProgressBar::new(1);
        pb.set_style(
            ProgressStyle::with_template(
                "{spinner} {prefix:>12} [{bar:30}] {percent:>3}% {msg} ETA {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        Some(pb)
    } else {
        None
    };
    let mut last_phase = String::new();
    let status = loop {
        let s = c.get_json(&format!("/v1/migrations/{id}"))?;
        let phase = s["phase"].as_str().unwrap_or("?").to_string();
        if let Some(pb) = &pb {
            let total = num(&s, "chunks_total").max(1);
            pb.set_length(total);
            pb.set_position(num(&s, "chunks_printed"));
            pb.set_prefix(phase.clone());
            let secs = s["elapsed_s"].as_f64().unwrap_or(0.0).max(1e-3);
            let tx = num(&s, "wire_tx_bytes");
            pb.set_message(format!(
                "sent {} at {}/s, rebuilt locally {:.0}%, round {}, dirty {}",
                human(tx),
                human((tx as f64 / secs) as u64),
                s["rebuilt_share"].as_f64().unwrap_or(0.0) * 100.0,
                num(&s, "round"),
                human(num(&s, "dirty_bytes")),
            ));
        } else if phase != last_phase {
            eprintln!("migration {id}: {phase}");
        }
        last_phase = phase.clone();
        if phase == "switched" || phase == "failed" {
            break s;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    let report = status["report"].clone();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_summary(&report);
    }
    if status["phase"] != "switched" {
        bail!(
            "migration failed: {}",
            status["error"].as_str().unwrap_or("unknown error")
        );
    }
    Ok(())
}

fn print_summary(r: &serde_json::Value) {
    let b = &r["bytes"];
    let ch = &r["chunks"];
    let t = &r["time"];
    println!(
        "volume {} -> {} ({}): {}",
        r["volume"].as_str().unwrap_or(""),
        r["to"].as_str().unwrap_or(""),
        r["new_location"].as_str().unwrap_or("-"),
        r["result"].as_str().unwrap_or("")
    );
    println!(
        "  wire: {} sent, {} received; fingerprints {}, data {} ({} raw), protocol {}",
        human(num(b, "wire_tx")),
        human(num(b, "wire_rx")),
        human(num(b, "fingerprints")),
        human(num(b, "data")),
        human(num(b, "data_raw")),
        human(num(b, "protocol")),
    );
    println!(
        "  chunks: {} total, {} zero, {} local, {} resumed, {} sent, {} resent dirty",
        num(ch, "total"),
        num(ch, "zero"),
        num(ch, "local"),
        num(ch, "resumed"),
        num(ch, "sent"),
        num(ch, "dirty_resent"),
    );
    println!(
        "  time: {:.2} s total, fingerprints {:.2} s, rounds {:.2} s ({} rounds), pause {:.1} ms; digest match: {}",
        t["total_s"].as_f64().unwrap_or(0.0),
        t["fingerprints_s"].as_f64().unwrap_or(0.0),
        t["rounds_s"].as_f64().unwrap_or(0.0),
        num(r, "rounds"),
        t["pause_ms"].as_f64().unwrap_or(0.0),
        r["digest"]["matches"],
    );
}

#[derive(Subcommand)]
pub enum CertsCmd {
    /// Print this daemon's certificate path and SHA-256 fingerprint
    /// (creates the certificate if there is none yet).
    Show,
    /// Trust a peer daemon's certificate (its `<pool>/tls/cert.pem`) for
    /// migrations in both directions.
    Trust {
        cert: PathBuf,
        /// File name to keep it under (default: its fingerprint).
        #[arg(long)]
        name: Option<String>,
    },
    /// List the trusted peer certificates.
    List,
}

pub fn certs(cmd: CertsCmd, pool: PathBuf) -> Result<()> {
    let store = CertStore::new(&pool);
    match cmd {
        CertsCmd::Show => {
            store.ensure_identity()?;
            let c = store.own_cert()?;
            println!("certificate: {}", store.cert_path().display());
            println!("sha256:      {}", fingerprint(&c));
        }
        CertsCmd::Trust { cert, name } => {
            let fp = store.trust(&cert, name.as_deref())?;
            println!(
                "trusted {} (sha256 {fp}) in {}",
                cert.display(),
                store.trusted_dir().display()
            );
        }
        CertsCmd::List => {
            for (file, fp) in store.trusted() {
                println!("{file}\t{fp}");
            }
        }
    }
    Ok(())
}
