//! Moving raw images in and out of volumes through the admin API, with a
//! progress bar; the calls themselves are `ferry_api::AdminClient`'s.

use anyhow::{bail, Context, Result};
use ferry_api::{AdminClient, ImportReport};
use indicatif::{ProgressBar, ProgressStyle};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

fn progress(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

/// Stream a raw image file into a volume.
pub fn import(c: &AdminClient, name: &str, file: &Path) -> Result<ImportReport> {
    let f = File::open(file).with_context(|| format!("opening {}", file.display()))?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        bail!("{} is not a regular file", file.display());
    }
    let len = meta.len();
    let pb = progress(len, &format!("import {name}"));
    let r = c.import(name, pb.wrap_read(f), len);
    pb.finish_and_clear();
    Ok(r?)
}

/// Stream a volume into a sparse raw image file.
pub fn export(c: &AdminClient, name: &str, file: &Path) -> Result<u64> {
    let (len, body) = c.export(name)?;
    let pb = progress(len, &format!("export {name}"));
    let mut rd = pb.wrap_read(body);
    let mut out = File::create(file).with_context(|| format!("creating {}", file.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let mut filled = 0;
        while filled < buf.len() {
            let n = rd.read(&mut buf[filled..])?;
            if n == 0 {
                break;
            }
            filled += n;
        }
        if filled == 0 {
            break;
        }
        let n = u64::try_from(filled)?;
        if buf[..filled].iter().all(|&b| b == 0) {
            out.seek(SeekFrom::Current(i64::try_from(n)?))?;
        } else {
            out.write_all(&buf[..filled])?;
        }
        total += n;
    }
    out.set_len(total)?;
    out.sync_all()?;
    pb.finish_and_clear();
    if len != 0 && total != len {
        bail!("export ended after {total} of {len} bytes");
    }
    Ok(total)
}
