//! `ferry demo`: the README's first command. A daemon on a temporary pool, a
//! real ext4 disk image (built with `mke2fs -d` when available), imported
//! through the admin API, then every benchmark profile against it.

use anyhow::{Context, Result};
use clap::Args;
use ferry_api::{AdminClient, CreateVolume, Size};
use ferry_server::config::Config;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Args)]
pub struct DemoArgs {
    /// Seconds per benchmark profile.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Image size in MiB.
    #[arg(long, default_value_t = 512)]
    image_mib: u64,
}

/// Build an ext4 image filled from /usr/share/doc; fall back to a synthetic
/// image (text, random and zero regions) when mke2fs is missing.
fn build_image(path: &Path, mib: u64) -> Result<&'static str> {
    let src = Path::new("/usr/share/doc");
    let ok = src.is_dir()
        && Command::new("mke2fs")
            .args(["-q", "-F", "-t", "ext4", "-d"])
            .arg(src)
            .arg(path)
            .arg(format!("{mib}M"))
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
    if ok {
        return Ok("ext4 image of /usr/share/doc (mke2fs -d)");
    }
    let mut data = vec![0u8; usize::try_from(mib << 20)?];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for (i, chunk) in data.chunks_mut(1 << 20).enumerate() {
        if i % 3 == 2 {
            continue; // a zero region
        }
        for b in chunk.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = if i % 3 == 0 {
                b"ferry demo text "[usize::from(x.to_le_bytes()[0] % 16)]
            } else {
                x.to_le_bytes()[0]
            };
        }
    }
    std::fs::write(path, data)?;
    Ok("synthetic image (mke2fs not found)")
}

pub fn run(a: DemoArgs) -> Result<()> {
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let image = dir.path().join("disk.img");
    eprintln!("== building a {} MiB disk image", a.image_mib);
    let kind = build_image(&image, a.image_mib)?;
    eprintln!("   {kind}");
    let mut config = Config {
        pool: dir.path().join("pool"),
        ..Default::default()
    };
    config.nbd.listen = "127.0.0.1:0".into();
    config.admin.listen = "127.0.0.1:0".into();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let daemon = rt.block_on(ferry_server::Daemon::bind(config))?;
    let addrs = daemon.addrs();
    let nbd = addrs.nbd.context("no NBD listener")?.to_string();
    let admin = addrs.admin.context("no admin listener")?.to_string();
    let shutdown = CancellationToken::new();
    let server = rt.spawn(daemon.run(shutdown.clone()));
    eprintln!("== ferry serve on a temporary pool: NBD {nbd}, admin http://{admin}");

    let c = AdminClient::new(&admin);
    let size = std::fs::metadata(&image)?.len();
    c.create_volume(&CreateVolume {
        name: "demo".into(),
        size: Some(Size::Bytes(size)),
        ..CreateVolume::default()
    })?;
    let t = std::time::Instant::now();
    let r = crate::transfer::import(&c, "demo", &image)?;
    eprintln!(
        "== imported {} MiB in {:.2}s ({} MiB data, {} MiB holes); export nbd://{nbd}/demo",
        size >> 20,
        t.elapsed().as_secs_f64(),
        r.written >> 20,
        r.zeroed >> 20
    );
    let mut reports = Vec::new();
    for p in ferry_bench::expand_profiles(&["all".into()]).map_err(anyhow::Error::msg)? {
        let qd = if p.name.starts_with("dd") || p.name.starts_with("streaming") {
            4
        } else {
            16
        };
        eprintln!("== bench {} (qd {qd}, {:.0}s)", p.name, a.seconds);
        let spec = ferry_bench::BenchSpec {
            addr: nbd.clone(),
            export: "demo".into(),
            profile: p,
            connections: 1,
            queue_depth: qd,
            runtime: Duration::from_secs_f64(a.seconds),
            range: 0,
        };
        reports.push(rt.block_on(ferry_bench::run(&spec))?);
    }
    println!();
    print!("{}", ferry_bench::table(&reports));
    println!("(cpu% here is client and server together: the demo runs both in one process)");
    if let Some(v) = c.volume("demo")? {
        println!(
            "\nvolume demo: {} bytes, wwn {}, uuid {}",
            v.size, v.wwn, v.uuid
        );
    }
    shutdown.cancel();
    rt.block_on(server)??;
    Ok(())
}
