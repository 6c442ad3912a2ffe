//! A volume's sample for the placement model: runs of neighbouring blocks
//! spread evenly over the volume, each non-zero block fingerprinted and
//! priced as a migration's zstd stream would send it.
//!
//! Runs rather than single blocks: a migration sends what a site lacks in
//! runs of neighbouring blocks, and a run of a journal's blocks compresses
//! far better than blocks far apart (after a disk's return trip, one
//! sampled block in eight priced the changed blocks +17% to +56% above
//! what the migration's stream sent for them).

use ferry_api::VolumeSample;
use std::io::Write;

/// Neighbouring blocks read together at each place the sample looks.
pub const RUN_BLOCKS: u64 = 8;

/// Level of the sample's zstd streams, the migration stream's.
const LEVEL: i32 = 3;

/// Window of the sample's streams (log2 bytes): 16 MiB holds a whole
/// sample of 4,096 blocks of 4 KiB, so, with long-distance matching as the
/// migration's stream has, a block may refer back to any earlier one, as
/// it may in a migration's 128 MiB window.
const WINDOW_LOG: u32 = 24;

/// The blocks of a volume of `total` blocks a sample of `n` reads: all of
/// them if `n >= total`, else `n / RUN_BLOCKS` runs of `RUN_BLOCKS`
/// neighbouring blocks (one run of `n` if `n` is smaller), one run in
/// each of as many equal stretches of the volume, at `offset` (taken
/// modulo the room the stretch leaves) into each.
pub fn sampled_blocks(total: u64, n: u64, offset: u64) -> Vec<u64> {
    if n >= total {
        return (0..total).collect();
    }
    if n == 0 {
        return Vec::new();
    }
    let run = RUN_BLOCKS.min(n);
    let runs = n / run;
    // `n < total`, so each stretch holds at least one run.
    let stretch = total / runs;
    let at = offset % (stretch - run + 1);
    (0..runs)
        .flat_map(|j| {
            let start = j * total / runs + at;
            start..start + run
        })
        .collect()
}

/// The blocks of a sample of `n` among those `written` marks (its
/// granularity the block size), in volume order: all of them if there are
/// no more than `n`, else [`sampled_blocks`] taken over their ranks (runs
/// of neighbours in that order, spread evenly).
pub fn sampled_written(written: &ferry_storage::DirtyBitmap, n: u64, offset: u64) -> Vec<u64> {
    written.dirty_at_ranks(&sampled_blocks(written.dirty_chunks(), n, offset))
}

/// Fingerprint and price the blocks `blocks` (from [`sampled_blocks`]),
/// read with `read(block, buf)`. Zero blocks are counted, not
/// fingerprinted (a migration never sends them). Each non-zero block's
/// `compressed` is its share of what its run adds to one zstd stream over
/// the sample: the run's cost, flushed at its end, split among its blocks
/// as each adds to a second stream flushed after every block (so a block
/// that repeats its neighbour costs little, and a run's cost carries no
/// per-block flush). `nonzero_compressed` is the whole stream's size.
/// `volume_size` and `uuid` are left for the caller.
pub fn price<E>(
    block_size: u32,
    blocks: &[u64],
    mut read: impl FnMut(u64, &mut [u8]) -> Result<(), E>,
) -> Result<VolumeSample, E> {
    let mut out = VolumeSample {
        block_size,
        volume_size: 0,
        sampled: 0,
        zero: 0,
        fingerprints: Vec::new(),
        nonzero_compressed: 0,
        compressed: Vec::new(),
        uuid: None,
        since_arrival: None,
        switch_hold_s: None,
        switch_holds_s: Vec::new(),
        move_setups_s: Vec::new(),
    };
    let bs = block_size as usize;
    let mut buf = vec![0u8; bs];
    let mut pricer = RunPricer::new(bs);
    let mut nonzero_bytes = 0u64;
    let mut last: Option<u64> = None;
    for &block in blocks {
        if last.is_some_and(|l| l + 1 != block) {
            pricer.end_run(&mut out.compressed);
        }
        last = Some(block);
        read(block, &mut buf)?;
        out.sampled += 1;
        if ferry_index::is_zero(&buf) {
            out.zero += 1;
            continue;
        }
        let fp = ferry_index::Fingerprint::of(&buf);
        out.fingerprints
            .push(fp.0.iter().map(|b| format!("{b:02x}")).collect());
        nonzero_bytes += buf.len() as u64;
        pricer.add(&buf);
    }
    pricer.end_run(&mut out.compressed);
    if nonzero_bytes > 0 {
        out.nonzero_compressed = pricer.finish().unwrap_or(nonzero_bytes).min(nonzero_bytes);
    }
    Ok(out)
}

type Stream = zstd::stream::write::Encoder<'static, ByteCount>;

/// A zstd stream as the sample prices with, over a byte counter.
fn encoder() -> Option<Stream> {
    let mut e = zstd::stream::write::Encoder::new(ByteCount(0), LEVEL).ok()?;
    e.long_distance_matching(true).ok()?;
    e.window_log(WINDOW_LOG).ok()?;
    Some(e)
}

/// The two streams of [`price`]: `whole`, flushed after each run, and
/// `each`, flushed after each block. A failure to set up or feed either
/// leaves the blocks priced raw: the estimate overcharges, the sample
/// still answers.
struct RunPricer {
    whole: Option<Stream>,
    each: Option<Stream>,
    /// `whole`'s size at the end of the last run.
    mark: u64,
    /// What each block of the current run added to `each`.
    costs: Vec<usize>,
    bs: usize,
}

impl RunPricer {
    fn new(bs: usize) -> RunPricer {
        RunPricer {
            whole: encoder(),
            each: encoder(),
            mark: 0,
            costs: Vec::new(),
            bs,
        }
    }

    /// A non-zero block of the current run.
    fn add(&mut self, block: &[u8]) {
        if self
            .whole
            .as_mut()
            .is_some_and(|e| e.write_all(block).is_err())
        {
            self.whole = None;
        }
        let added = self.each.as_mut().and_then(|e| {
            let before = e.get_ref().0;
            e.write_all(block).ok()?;
            e.flush().ok()?;
            usize::try_from(e.get_ref().0 - before).ok()
        });
        if added.is_none() {
            self.each = None;
        }
        self.costs.push(added.unwrap_or(self.bs).clamp(1, self.bs));
    }

    /// Close the run: flush `whole`, and split what it gained since the
    /// last run (the run's cost) among the run's blocks in proportion to
    /// what each added to `each`, each at most a block; push the shares
    /// to `compressed`.
    fn end_run(&mut self, compressed: &mut Vec<u32>) {
        if self.costs.is_empty() {
            return;
        }
        let sum: usize = self.costs.iter().sum();
        let mark = &mut self.mark;
        let run = self.whole.as_mut().and_then(|e| {
            e.flush().ok()?;
            let after = e.get_ref().0;
            let cost = usize::try_from(after - *mark).ok();
            *mark = after;
            cost
        });
        if run.is_none() {
            self.whole = None;
        }
        let run = run.unwrap_or(sum) as u128;
        for &c in &self.costs {
            let share = usize::try_from(c as u128 * run / sum.max(1) as u128).unwrap_or(self.bs);
            compressed.push(u32::try_from(share.min(self.bs)).unwrap_or(u32::MAX));
        }
        self.costs.clear();
    }

    /// The whole stream's size, once finished.
    fn finish(self) -> Option<u64> {
        self.whole.and_then(|e| e.finish().ok()).map(|c| c.0)
    }
}

/// A writer that only counts the bytes written to it.
struct ByteCount(u64);

impl Write for ByteCount {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0 += b.len() as u64;
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, RngCore, SeedableRng};

    const BS: usize = 4096;

    /// Where block `b` starts in a volume held in memory.
    fn at(b: u64) -> usize {
        usize::try_from(b).unwrap() * BS
    }

    #[test]
    fn runs_of_neighbouring_blocks_are_spread_evenly() {
        assert_eq!(sampled_blocks(5, 16, 3), vec![0, 1, 2, 3, 4]);
        assert_eq!(sampled_blocks(100, 0, 3), Vec::<u64>::new());
        // Fewer than a run: one run.
        assert_eq!(sampled_blocks(100, 3, 0), vec![0, 1, 2]);
        for (total, n, offset) in [
            (32_768, 4096, 0),
            (32_768, 4096, 77),
            (1 << 20, 4096, 12_345),
        ] {
            let b = sampled_blocks(total, n, offset);
            assert_eq!(b.len() as u64, n);
            assert!(b.windows(2).all(|w| w[0] < w[1]), "in order, no repeats");
            assert!(*b.last().unwrap() < total);
            let stretch = total / (n / RUN_BLOCKS);
            for (j, run) in b.chunks(usize::try_from(RUN_BLOCKS).unwrap()).enumerate() {
                assert!(
                    run.windows(2).all(|w| w[1] == w[0] + 1),
                    "a run is neighbours"
                );
                let j = j as u64;
                assert!(run[0] >= j * stretch && run[0] < (j + 1) * stretch);
                assert_eq!(run[0] - j * stretch, offset % (stretch - RUN_BLOCKS + 1));
            }
        }
        // A sample not a multiple of a run: whole runs only.
        assert_eq!(sampled_blocks(1000, 20, 0).len(), 16);
    }

    /// A volume of `blocks` blocks: a database's records (neighbouring
    /// records share their values, as a journal's blocks do), a stretch
    /// of zeroes, random data.
    fn volume(blocks: usize) -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut v = vec![0u8; blocks * BS];
        let records = blocks / 2 * BS / 128;
        let mut value = [0u8; 24];
        for r in 0..records {
            if r % 40 == 0 {
                rng.fill_bytes(&mut value);
            }
            let hex: String = value.iter().map(|b| format!("{b:02x}")).collect();
            let line = format!("{r:012} {:08x} {hex}", rng.gen::<u32>());
            let at = r * 128;
            v[at..at + line.len()].copy_from_slice(line.as_bytes());
            v[at + 127] = b'\n';
        }
        let random = blocks * 3 / 4 * BS;
        rng.fill_bytes(&mut v[random..]);
        v
    }

    /// What a migration's stream sends for `blocks` of `v`: one stream,
    /// a flushed piece per run of neighbours (at most 256 blocks).
    fn streamed(v: &[u8], blocks: &[u64]) -> u64 {
        let mut e = encoder().unwrap();
        let mut last: Option<u64> = None;
        let mut in_piece = 0;
        for &b in blocks {
            if last.is_some_and(|l| l + 1 != b) || in_piece == 256 {
                e.flush().unwrap();
                in_piece = 0;
            }
            last = Some(b);
            let buf = &v[at(b)..][..BS];
            if !ferry_index::is_zero(buf) {
                e.write_all(buf).unwrap();
                in_piece += 1;
            }
        }
        e.finish().unwrap().0
    }

    fn priced(v: &[u8], blocks: &[u64]) -> VolumeSample {
        price(u32::try_from(BS).unwrap(), blocks, |b, buf| {
            buf.copy_from_slice(&v[at(b)..][..BS]);
            Ok::<_, ()>(())
        })
        .unwrap()
    }

    #[test]
    fn a_volume_is_priced_as_its_stream_sends_it() {
        let total = 16_384u64;
        let v = volume(at(total) / BS);
        let sampled = sampled_blocks(total, 2048, 5);
        let s = priced(&v, &sampled);
        assert_eq!(s.sampled, 2048);
        let zero = s.zero as f64 / s.sampled as f64;
        assert!((zero - 0.25).abs() < 0.01, "{zero}");
        assert_eq!(s.compressed.len(), s.fingerprints.len());
        // The per-block shares add up to the whole stream (less its frame
        // and what rounding each share down leaves).
        let shares: u64 = s.compressed.iter().map(|&c| u64::from(c)).sum();
        let nonzero = s.sampled - s.zero;
        assert!(
            shares <= s.nonzero_compressed && s.nonzero_compressed - shares < nonzero + 64,
            "{shares} {}",
            s.nonzero_compressed
        );
        // The whole volume, and the records alone (a return trip's
        // blocks), priced from the sample against the stream's own.
        let scale = total as f64 / s.sampled as f64;
        let whole = streamed(&v, &(0..total).collect::<Vec<_>>()) as f64;
        let est = s.nonzero_compressed as f64 * scale;
        assert!(
            (est / whole - 1.0).abs() < 0.05,
            "whole volume: {est} for {whole}"
        );
        let records: Vec<u64> = (0..total / 2).collect();
        let truth = streamed(&v, &records) as f64;
        let in_records = sampled.iter().filter(|&&b| b < total / 2).count();
        let est: f64 = s.compressed[..in_records]
            .iter()
            .map(|&c| f64::from(c))
            .sum::<f64>()
            * scale;
        assert!(
            (est / truth - 1.0).abs() < 0.15,
            "records: {est} for {truth}"
        );
    }

    #[test]
    fn random_blocks_cost_their_size_and_zero_blocks_nothing() {
        let mut v = vec![0u8; 64 * BS];
        rand::thread_rng().fill_bytes(&mut v[32 * BS..]);
        let s = priced(&v, &sampled_blocks(64, 64, 0));
        assert_eq!((s.sampled, s.zero, s.fingerprints.len()), (64, 32, 32));
        assert!(
            s.compressed.iter().all(|&c| c as usize == BS),
            "{:?}",
            s.compressed
        );
        assert!((32 * BS as u64 * 99 / 100..=32 * BS as u64).contains(&s.nonzero_compressed));
    }
}
