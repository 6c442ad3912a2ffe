//! A small blocking client of the daemon's admin API, for the CLI.

use anyhow::{anyhow, bail, Context, Result};
use ferry_server::admin::VolumeView;
use indicatif::{ProgressBar, ProgressStyle};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

pub struct AdminClient {
    base: String,
    agent: ureq::Agent,
}

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

impl AdminClient {
    pub fn new(url: &str) -> Self {
        let base = if url.starts_with("http://") || url.starts_with("https://") {
            url.trim_end_matches('/').to_string()
        } else {
            format!("http://{}", url.trim_end_matches('/'))
        };
        AdminClient {
            base,
            agent: ureq::AgentBuilder::new().build(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    fn check(&self, r: Result<ureq::Response, ureq::Error>) -> Result<ureq::Response> {
        match r {
            Ok(r) => Ok(r),
            Err(ureq::Error::Status(code, resp)) => {
                let body: serde_json::Value = resp.into_json().unwrap_or_default();
                let msg = body.get("error").and_then(|e| e.as_str()).unwrap_or("no details").to_string();
                bail!("admin API answered {code}: {msg}")
            }
            Err(e) => Err(anyhow!(e)).with_context(|| {
                format!("cannot reach the ferry admin API at {} (is `ferry serve` running? set --admin or FERRY_ADMIN)", self.base)
            }),
        }
    }

    pub fn get_json(&self, path: &str) -> Result<serde_json::Value> {
        Ok(self
            .check(self.agent.get(&self.url(path)).call())?
            .into_json()?)
    }

    pub fn post_json(&self, path: &str, body: serde_json::Value) -> Result<serde_json::Value> {
        Ok(self
            .check(self.agent.post(&self.url(path)).send_json(body))?
            .into_json()?)
    }

    pub fn delete(&self, path: &str) -> Result<()> {
        self.check(self.agent.delete(&self.url(path)).call())?;
        Ok(())
    }

    pub fn volume(&self, name: &str) -> Result<Option<VolumeView>> {
        match self
            .agent
            .get(&self.url(&format!("/v1/volumes/{name}")))
            .call()
        {
            Err(ureq::Error::Status(404, _)) => Ok(None),
            r => Ok(Some(self.check(r)?.into_json()?)),
        }
    }

    /// Stream a raw image file into a volume.
    pub fn import(&self, name: &str, file: &Path) -> Result<serde_json::Value> {
        let f = File::open(file).with_context(|| format!("opening {}", file.display()))?;
        let len = f.metadata()?.len();
        let pb = progress(len, &format!("import {name}"));
        let r = self
            .agent
            .put(&self.url(&format!("/v1/volumes/{name}/data")))
            .set("Content-Type", "application/octet-stream")
            .set("Content-Length", &len.to_string())
            .send(pb.wrap_read(f));
        pb.finish_and_clear();
        Ok(self.check(r)?.into_json()?)
    }

    /// Stream a volume into a sparse raw image file.
    pub fn export(&self, name: &str, file: &Path) -> Result<u64> {
        let r = self.check(
            self.agent
                .get(&self.url(&format!("/v1/volumes/{name}/data")))
                .call(),
        )?;
        let len: u64 = r
            .header("Content-Length")
            .and_then(|l| l.parse().ok())
            .unwrap_or(0);
        let pb = progress(len, &format!("export {name}"));
        let mut rd = pb.wrap_read(r.into_reader());
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
            if buf[..filled].iter().all(|&b| b == 0) {
                out.seek(SeekFrom::Current(filled as i64))?;
            } else {
                out.write_all(&buf[..filled])?;
            }
            total += filled as u64;
        }
        out.set_len(total)?;
        out.sync_all()?;
        pb.finish_and_clear();
        if len != 0 && total != len {
            bail!("export ended after {total} of {len} bytes");
        }
        Ok(total)
    }
}
