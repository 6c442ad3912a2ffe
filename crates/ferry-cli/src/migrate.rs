//! `ferry migrate` (start a migration through the source daemon's admin API,
//! follow it with a progress bar, print the report) and `ferry certs` (the
//! daemon's migration certificate and the peers it trusts).

use crate::human;
use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use ferry_api::{AdminClient, MigrateRequest, MigrationId, MigrationPhase, Report, Size};
use ferry_migration_engine::tls::{fingerprint, CertStore};
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
    /// Name the migration (a UUID): running the same command again with
    /// the same id follows the migration already started instead of
    /// starting another.
    #[arg(long)]
    pub id: Option<MigrationId>,
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
    /// Converge, then wait before pausing the guest until
    /// `ferry migrate-switch ID` (or POST /v1/migrations/ID/switch).
    #[arg(long)]
    pub hold_switch: bool,
    /// Print the final report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn migrate(a: MigrateArgs, c: &AdminClient) -> Result<()> {
    let req = MigrateRequest {
        to: a.to.clone(),
        id: a.id.clone(),
        plaintext: a.plaintext,
        max_downtime_ms: Some(u64::try_from(a.max_downtime.as_millis()).unwrap_or(u64::MAX)),
        bwlimit: a.bwlimit.as_deref().map(Size::from),
        max_rounds: Some(a.max_rounds),
        dedup: Some(!a.no_dedup),
        compress: Some(!a.no_compress),
        retry_for_s: Some(a.retry_for.as_secs()),
        hold_switch: a.hold_switch,
    };
    let started = c.migrate(&a.volume, &req)?;
    let id = started.id.clone();
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
    let mut last_phase: Option<MigrationPhase> = None;
    let status = c.watch_migration(&id, |s| {
        if let Some(pb) = &pb {
            pb.set_length(s.chunks_total.max(1));
            pb.set_position(s.chunks_printed);
            pb.set_prefix(s.phase.to_string());
            let secs = s.elapsed_s.max(1e-3);
            pb.set_message(format!(
                "sent {} at {}/s, rebuilt locally {:.0}%, round {}, dirty {}",
                human(s.wire_tx_bytes),
                human(per_second(s.wire_tx_bytes, secs)),
                s.rebuilt_share * 100.0,
                s.round,
                human(s.dirty_bytes),
            ));
        } else if last_phase != Some(s.phase) {
            eprintln!("migration {id}: {}", s.phase);
        }
        last_phase = Some(s.phase);
    })?;
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    if let Some(report) = &status.report {
        if a.json {
            println!("{}", serde_json::to_string_pretty(report)?);
        } else {
            print_summary(report);
        }
    }
    if status.phase != MigrationPhase::Switched {
        bail!(
            "migration {id} of {} failed: {}",
            a.volume,
            status.error.as_deref().unwrap_or("unknown error")
        );
    }
    Ok(())
}

/// `ferry migrate-switch ID`: release a migration held before its switch.
pub fn release(id: &MigrationId, c: &AdminClient) -> Result<()> {
    let s = c.release_switch(id)?;
    eprintln!("migration {id}: switch released (phase {})", s.phase);
    Ok(())
}

#[allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss
)]
fn per_second(bytes: u64, secs: f64) -> u64 {
    // Display only: a rate in bytes per second fits easily.
    (bytes as f64 / secs) as u64
}

fn print_summary(r: &Report) {
    let b = &r.bytes;
    let ch = &r.chunks;
    let t = &r.time;
    let switched = r.result == ferry_api::MigrationResult::Switched;
    if switched {
        println!(
            "volume {} moved to {}: NBD {}, admin {}",
            r.volume,
            r.to,
            r.new_location.as_deref().unwrap_or("-"),
            r.new_admin.as_deref().unwrap_or("not advertised")
        );
    } else {
        println!(
            "volume {} did not move to {}: {}; it stays here, unchanged",
            r.volume,
            r.to,
            r.error.as_deref().unwrap_or("unknown error")
        );
    }
    println!(
        "  wire: {} sent, {} received; fingerprints {}, data {} ({} raw), protocol {}",
        human(b.wire_tx),
        human(b.wire_rx),
        human(b.fingerprints),
        human(b.data),
        human(b.data_raw),
        human(b.protocol),
    );
    println!(
        "  chunks: {} total, {} zero, {} local, {} resumed, {} unchanged, {} sent, {} resent dirty, {} printed unread",
        ch.total, ch.zero, ch.local, ch.resumed, ch.unchanged, ch.sent, ch.dirty_resent, ch.unread,
    );
    if r.destination_copy != ferry_api::DestinationCopy::New {
        println!("  destination filled {}", r.destination_copy.describe());
    }
    println!(
        "  time: {:.2} s total, fingerprints {:.2} s, rounds {:.2} s ({} rounds), held {:.2} s, pause {:.1} ms{}",
        t.total_s,
        t.fingerprints_s,
        t.rounds_s,
        r.rounds,
        t.held_s,
        t.pause_ms,
        if switched {
            "; digests match"
        } else {
            ""
        },
    );
    println!(
        "  slowest client write or flush at the source during the move: {:.1} ms",
        t.slowest_write_ms
    );
}

#[derive(Subcommand)]
pub enum CertsCmd {
    /// Print this daemon's certificate path and SHA-256 fingerprint
    /// (creates the certificate if there is none yet).
    Show,
    /// Trust a peer's certificate (a daemon's `<pool>/tls/cert.pem` or
    /// `<state>/tls/cert.pem`, an operator's or controller's `cert.pem`).
    /// Without --role it is a peer of the store's own kind: another storage
    /// daemon migrating to and from this one, another host moving guests.
    Trust {
        cert: PathBuf,
        /// File name to keep it under (default: its fingerprint).
        #[arg(long)]
        name: Option<String>,
        /// What the certificate may do here: operator (everything),
        /// controller (read, sample, probe, start and cancel moves), host
        /// (drive its guests' volume migrations), storage, monitor (read).
        #[arg(long)]
        role: Option<ferry_trust::Role>,
    },
    /// List the trusted certificates with their roles.
    List,
    /// Make an identity for a person or a program that calls the APIs
    /// (cert.pem, key.pem in --tls-dir, or the pool's tls/): give its
    /// cert.pem to each daemon with `ferry certs trust FILE --role ...`,
    /// trust each daemon's certificate in it the same way, and call with
    /// `--tls-dir DIR` (or FERRY_TLS_DIR).
    Identity {
        /// What the identity is (named in its certificate).
        #[arg(long, default_value = "operator")]
        role: ferry_trust::Role,
    },
    /// Make the certificates NBD over TLS needs: a certificate authority
    /// (OUT/ca-cert.pem, OUT/ca-key.pem), OUT/server/ for
    /// `ferry serve --nbd-tls-dir`, and OUT/client-NAME/ for each client
    /// (QEMU's tls-creds-x509 dir, or nbdinfo's tls-certificates).
    Nbd {
        /// Directory to create them in.
        #[arg(long)]
        out: PathBuf,
        /// DNS name or IP address clients reach the server by (repeatable).
        #[arg(long = "server-name", value_name = "HOST", required = true)]
        server_names: Vec<String>,
        /// A client to make a certificate for (repeatable).
        #[arg(long = "client", value_name = "NAME", default_value = "ferry-client")]
        clients: Vec<String>,
    },
}

pub fn certs(cmd: CertsCmd, pool: PathBuf, tls_dir: Option<PathBuf>) -> Result<()> {
    let store = match (&tls_dir, &cmd) {
        (Some(d), _) => CertStore::at(d, ferry_trust::Role::Operator),
        (None, CertsCmd::Identity { .. }) => {
            anyhow::bail!("say where to keep the identity: ferry certs --tls-dir DIR identity")
        }
        (None, _) => CertStore::new(&pool),
    };
    match cmd {
        CertsCmd::Show => {
            store.ensure_identity()?;
            let c = store.own_cert()?;
            println!("certificate: {}", store.cert_path().display());
            println!("sha256:      {}", fingerprint(&c));
        }
        CertsCmd::Trust { cert, name, role } => {
            let fp = store.trust(&cert, name.as_deref(), role)?;
            let what = match role {
                Some(r) => format!("as {r}"),
                None => "as a peer of the same kind (migrations, moves)".into(),
            };
            println!(
                "trusted {} (sha256 {fp}) {what} in {}",
                cert.display(),
                store.trusted_dir().display()
            );
        }
        CertsCmd::List => {
            for p in store.trusted() {
                println!("{}\t{}\t{}", p.role, p.name, p.fingerprint);
            }
        }
        CertsCmd::Identity { role } => {
            let store = CertStore::at(store.dir(), role);
            store.ensure_identity()?;
            let c = store.own_cert()?;
            println!("identity ({role}): {}", store.cert_path().display());
            println!("sha256:      {}", fingerprint(&c));
            println!(
                "next: on each daemon `ferry certs trust {} --role {role}`; here, `ferry --tls-dir {} certs trust DAEMON-CERT --role storage|host|controller`",
                store.cert_path().display(),
                store.dir().display()
            );
        }
        CertsCmd::Nbd {
            out,
            server_names,
            clients,
        } => {
            crate::nbd_certs::make(&out, &server_names, &clients)?;
            println!(
                "certificate authority: {}/ca-cert.pem (its key: ca-key.pem; keep it apart)",
                out.display()
            );
            println!(
                "server:  ferry serve --nbd-tls-dir {}/server",
                out.display()
            );
            for c in &clients {
                println!(
                    "client {c}: {}/client-{c} (QEMU: --object tls-creds-x509,id=tls0,dir=...,endpoint=client; nbdinfo: nbds://HOST/VOLUME?tls-certificates=...)",
                    out.display()
                );
            }
        }
    }
    Ok(())
}
