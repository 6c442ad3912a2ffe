//! Workload profiles from the seeds: OLTP (67% read, random, 2/4/8 KiB), file
//! server and web server (seed 003 Table 1 block-size mixes), streaming
//! (sequential 64 KiB) and dd (sequential 1 MiB, seed 004).

use rand::Rng;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    Random,
    Sequential,
}

/// A workload: read share, access pattern, and weighted request sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    pub name: String,
    pub read_pct: u32,
    pub pattern: Pattern,
    /// (size in bytes, weight)
    pub sizes: Vec<(u32, u32)>,
}

/// Seed 003, Table 1: block size percentages for file server and web server.
const TABLE1: [(u32, u32, u32); 10] = [
    (512, 10, 22),
    (1024, 5, 15),
    (2048, 5, 8),
    (4096, 60, 23),
    (8192, 2, 15),
    (16384, 4, 2),
    (32768, 4, 6),
    (65536, 10, 7),
    (131072, 0, 1),
    (524288, 0, 1),
];

/// Names accepted by [`Profile::named`] (plus the aliases of [`expand_profiles`]).
pub const PROFILE_NAMES: &[&str] = &[
    "oltp",
    "oltp-2k",
    "oltp-4k",
    "fileserver",
    "webserver",
    "streaming-read",
    "streaming-write",
    "dd-read",
    "dd-write",
];

impl Profile {
    pub fn named(name: &str) -> Option<Profile> {
        let p = |read_pct, pattern, sizes: Vec<(u32, u32)>| Profile {
            name: name.to_string(),
            read_pct,
            pattern,
            sizes,
        };
        Some(match name {
            "oltp" => p(67, Pattern::Random, vec![(8192, 1)]),
            "oltp-2k" => p(67, Pattern::Random, vec![(2048, 1)]),
            "oltp-4k" => p(67, Pattern::Random, vec![(4096, 1)]),
            "fileserver" => p(
                80,
                Pattern::Random,
                TABLE1.iter().map(|t| (t.0, t.1)).collect(),
            ),
            "webserver" => p(
                100,
                Pattern::Random,
                TABLE1.iter().map(|t| (t.0, t.2)).collect(),
            ),
            "streaming-read" => p(100, Pattern::Sequential, vec![(65536, 1)]),
            "streaming-write" => p(0, Pattern::Sequential, vec![(65536, 1)]),
            "dd-read" => p(100, Pattern::Sequential, vec![(1 << 20, 1)]),
            "dd-write" => p(0, Pattern::Sequential, vec![(1 << 20, 1)]),
            _ => return None,
        })
    }

    /// A custom job in fio's terms: `rw` one of read, write, randread,
    /// randwrite, randrw, rw; `bs` bytes; `read_pct` for the mixed kinds.
    pub fn custom(rw: &str, bs: u32, read_pct: u32) -> Option<Profile> {
        let (pattern, read) = match rw {
            "read" => (Pattern::Sequential, 100),
            "write" => (Pattern::Sequential, 0),
            "rw" | "readwrite" => (Pattern::Sequential, read_pct),
            "randread" => (Pattern::Random, 100),
            "randwrite" => (Pattern::Random, 0),
            "randrw" => (Pattern::Random, read_pct),
            _ => return None,
        };
        Some(Profile {
            name: format!("{rw}-{}k", bs / 1024),
            read_pct: read.min(100),
            pattern,
            sizes: vec![(bs, 1)],
        })
    }

    pub fn max_block_size(&self) -> u32 {
        self.sizes
            .iter()
            .filter(|s| s.1 > 0)
            .map(|s| s.0)
            .max()
            .unwrap_or(4096)
    }

    pub fn pick_size<R: Rng>(&self, rng: &mut R) -> u32 {
        let total: u32 = self.sizes.iter().map(|s| s.1).sum();
        let mut x = rng.gen_range(0..total.max(1));
        for (size, w) in &self.sizes {
            if x < *w {
                return *size;
            }
            x -= w;
        }
        self.sizes[0].0
    }
}

/// Expand names and aliases: `streaming` is streaming-read then
/// streaming-write, `dd` is dd-write then dd-read, `all` is every profile.
pub fn expand_profiles(names: &[String]) -> Result<Vec<Profile>, String> {
    let mut out = Vec::new();
    for n in names {
        let list: Vec<&str> = match n.as_str() {
            "streaming" => vec!["streaming-read", "streaming-write"],
            "dd" => vec!["dd-write", "dd-read"],
            "all" => PROFILE_NAMES.to_vec(),
            other => vec![other],
        };
        for l in list {
            out.push(Profile::named(l).ok_or_else(|| {
                format!(
                    "unknown profile {l:?}; known: {}, streaming, dd, all",
                    PROFILE_NAMES.join(", ")
                )
            })?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn table1_weights_sum_to_100() {
        for n in ["fileserver", "webserver"] {
            let p = Profile::named(n).unwrap();
            assert_eq!(p.sizes.iter().map(|s| s.1).sum::<u32>(), 100, "{n}");
        }
    }

    #[test]
    fn picks_follow_weights() {
        let p = Profile::named("fileserver").unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let n = 100_000;
        let fours = (0..n).filter(|_| p.pick_size(&mut rng) == 4096).count();
        assert!((fours as f64 / n as f64 - 0.60).abs() < 0.01);
        assert_eq!(p.max_block_size(), 65536);
    }

    #[test]
    fn aliases_expand_and_unknown_is_refused() {
        assert_eq!(expand_profiles(&["dd".into()]).unwrap().len(), 2);
        assert_eq!(
            expand_profiles(&["all".into()]).unwrap().len(),
            PROFILE_NAMES.len()
        );
        assert!(expand_profiles(&["nope".into()]).is_err());
        assert!(Profile::custom("randrw", 4096, 70).is_some());
        assert!(Profile::custom("zz", 4096, 70).is_none());
    }
}
