//! The link between two VM hosts: TLS 1.3 with both certificates pinned
//! (the same trust as the storage daemons: `<state>/tls/trusted/`), one
//! request line and one answer line per connection, and the pipe that
//! carries QEMU's migration stream between a local unix socket and the
//! link, compressed in [`Frame`](crate::peer::Frame)s.

use crate::peer::{
    decode_frame, decode_line, encode_ack, encode_frame, encode_line, Frame, PeerAnswer,
    PeerRequest,
};
use crate::{PeerFault, VmError};
use ferry_trust::store::{server_name, CertStore};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

pub type ClientLink = tokio_rustls::client::TlsStream<TcpStream>;
pub type ServerLink = tokio_rustls::server::TlsStream<TcpStream>;

/// How long connecting and the request/answer exchange may take.
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(60);

fn at(addr: &str) -> impl Fn(PeerFault) -> VmError + '_ {
    move |f| VmError::peer(addr, f)
}

fn link_err<'a>(addr: &'a str, what: &'static str) -> impl Fn(std::io::Error) -> VmError + 'a {
    move |e| VmError::peer(addr, PeerFault::link(what)(e))
}

/// Open a TLS connection to a peer host's move listener.
pub async fn connect(certs: &CertStore, addr: &str) -> Result<ClientLink, VmError> {
    let cfg = certs
        .client_config()
        .map_err(|e| VmError::peer(addr, PeerFault::Tls(e.to_string())))?;
    let tcp = tokio::time::timeout(EXCHANGE_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| VmError::peer(addr, PeerFault::Timeout("connect")))?
        .map_err(link_err(addr, "connect"))?;
    tcp.set_nodelay(true).ok();
    tokio_rustls::TlsConnector::from(cfg)
        .connect(server_name(), tcp)
        .await
        .map_err(|e| VmError::peer(addr, PeerFault::Tls(e.to_string())))
}

/// Read one line-delimited message; bytes after it are returned too.
pub async fn read_message<T: for<'de> serde::Deserialize<'de>, R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<(T, Vec<u8>), PeerFault> {
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 16 << 10];
    loop {
        if let Some(m) =
            decode_line::<T>(&mut buf).map_err(|e| PeerFault::Protocol(e.to_string()))?
        {
            return Ok((m, buf));
        }
        let n = match r.read(&mut chunk).await {
            Ok(n) => n,
            Err(e) if buf.is_empty() && e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(PeerFault::ClosedIdle)
            }
            Err(e) => return Err(PeerFault::link("read")(e)),
        };
        if n == 0 {
            return Err(if buf.is_empty() {
                PeerFault::ClosedIdle
            } else {
                PeerFault::Protocol("closed the connection".into())
            });
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Write `bytes` on a link and flush them out of its TLS session: a
/// session keeps the records it could not send while the socket was full,
/// and nothing sends them before the next write or flush (see
/// `ferry_client::write_all_vectored`).
pub(crate) async fn send_flushed<W: AsyncWrite + Unpin>(
    link: &mut W,
    bytes: &[u8],
) -> std::io::Result<()> {
    link.write_all(bytes).await?;
    link.flush().await
}

/// Write `req` on `link` and read the answer, with any bytes read past it.
async fn request<L: AsyncRead + AsyncWrite + Unpin>(
    link: &mut L,
    addr: &str,
    req: &PeerRequest,
) -> Result<(PeerAnswer, Vec<u8>), VmError> {
    send_flushed(link, &encode_line(req))
        .await
        .map_err(link_err(addr, "write"))?;
    read_message::<PeerAnswer, _>(link).await.map_err(at(addr))
}

/// `fut` (one exchange with the host at `addr`), within `limit`.
async fn within<T>(
    limit: Duration,
    addr: &str,
    fut: impl std::future::Future<Output = Result<T, VmError>>,
) -> Result<T, VmError> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| VmError::peer(addr, PeerFault::Timeout("the request")))?
}

/// The answer if it says `ok`; its refusal otherwise.
fn insist_ok(addr: &str, a: PeerAnswer) -> Result<PeerAnswer, VmError> {
    if a.ok {
        Ok(a)
    } else {
        Err(VmError::peer(
            addr,
            PeerFault::Refused(a.error.unwrap_or_else(|| "refused".into())),
        ))
    }
}

/// Send a request and read the answer; the connection is returned for
/// what follows (a stream), with any bytes read past the answer.
pub async fn exchange(
    certs: &CertStore,
    addr: &str,
    req: &PeerRequest,
    limit: Duration,
) -> Result<(PeerAnswer, ClientLink, Vec<u8>), VmError> {
    within(limit, addr, async {
        let mut link = connect(certs, addr).await?;
        let (a, rest) = request(&mut link, addr, req).await?;
        Ok((a, link, rest))
    })
    .await
}

/// Send a request and insist on `ok`.
pub async fn call(
    certs: &CertStore,
    addr: &str,
    req: &PeerRequest,
    limit: Duration,
) -> Result<PeerAnswer, VmError> {
    let (a, _, _) = exchange(certs, addr, req, limit).await?;
    insist_ok(addr, a)
}

/// Send a request on a link opened earlier ([`connect`]) and read the
/// answer, whatever it says: one round trip instead of three (TCP, TLS,
/// request) when every millisecond counts.
pub async fn ask_on(
    mut link: ClientLink,
    addr: &str,
    req: &PeerRequest,
    limit: Duration,
) -> Result<PeerAnswer, VmError> {
    within(limit, addr, async {
        Ok(request(&mut link, addr, req).await?.0)
    })
    .await
}

/// [`ask_on`], insisting on `ok`.
pub async fn call_on(
    link: ClientLink,
    addr: &str,
    req: &PeerRequest,
    limit: Duration,
) -> Result<PeerAnswer, VmError> {
    insist_ok(addr, ask_on(link, addr, req, limit).await?)
}

/// Bytes through a pipe: as QEMU wrote them, and as they went on the link.
#[derive(Debug, Default)]
pub struct PipeCounters {
    /// QEMU's bytes read here and sent.
    pub raw: AtomicU64,
    /// Link bytes they took.
    pub link: AtomicU64,
    /// Bytes received and handed to QEMU here.
    pub delivered: AtomicU64,
    /// How the sender's time went (see [`SendTiming`]).
    pub timing: parking_lot::Mutex<SendTiming>,
    /// When the latest data frame came in, and when QEMU had taken it.
    pub last_frame: parking_lot::Mutex<Option<(Instant, Instant)>>,
    /// The link's rate as the sender's window measured it once the stream
    /// was all acknowledged, and whether the link was full by then (what
    /// [`LinkRates::learn`] takes).
    pub link_rate: parking_lot::Mutex<Option<(f64, bool)>>,
}

/// How long a link's rate learnt from a memory stream is kept.
pub const LINK_RATE_MEMORY: Duration = Duration::from_secs(600);

/// The links' rates this host's memory streams found, by peer: a stream
/// to a peer starts from what the last one to it learnt, as TCP keeps a
/// path's metrics for the next connection (RFC 9040). See [`KNOWN_SHARE`].
/// Kept in `<state>/memory-link-rates.json` across the daemon's restarts
/// (with the wall-clock time each was learnt, so one older than
/// [`LINK_RATE_MEMORY`] is not read back).
#[derive(Debug, Default)]
pub struct LinkRates {
    rates: parking_lot::Mutex<std::collections::HashMap<String, (f64, Instant)>>,
    file: Option<std::path::PathBuf>,
    /// Held while the file is written, so the last write has the newest.
    writing: parking_lot::Mutex<()>,
}

/// What [`LinkRates`] keeps in its file: per peer, its rate (link bytes
/// per second) and when it was learnt (seconds since the Unix epoch).
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct SavedLinkRates {
    peers: std::collections::BTreeMap<String, SavedLinkRate>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct SavedLinkRate {
    rate: f64,
    learnt_unix_s: f64,
}

impl LinkRates {
    /// The rates kept in `file` that are still fresh (none if it is
    /// absent; a damaged file is reported and replaced at the next save).
    pub fn open(file: std::path::PathBuf) -> LinkRates {
        let saved = match ferry_state_file::load::<SavedLinkRates>(
            &file,
            crate::guest::files::LINK_RATES,
        ) {
            Ok(s) => s.unwrap_or_default(),
            Err(e) => {
                tracing::warn!(error = %e, "the links' rates learnt before are not read; learnt again from the next move");
                SavedLinkRates::default()
            }
        };
        let (now, wall) = (Instant::now(), crate::moves::unix_s(Instant::now()));
        let rates = saved
            .peers
            .into_iter()
            .filter_map(|(peer, s)| {
                let age = wall - s.learnt_unix_s;
                let fresh = (0.0..=LINK_RATE_MEMORY.as_secs_f64()).contains(&age);
                let at = now.checked_sub(Duration::from_secs_f64(age.max(0.0)))?;
                (fresh && usable_rate(s.rate)).then_some((peer, (s.rate, at)))
            })
            .collect();
        LinkRates {
            rates: parking_lot::Mutex::new(rates),
            file: Some(file),
            writing: parking_lot::Mutex::new(()),
        }
    }

    /// The rate to `peer` learnt within [`LINK_RATE_MEMORY`] of `now`.
    pub fn get(&self, peer: &str, now: Instant) -> Option<f64> {
        self.rates
            .lock()
            .get(peer)
            .and_then(|e| Self::fresh(e, now))
    }

    /// A rate and when it was learnt, if that is within
    /// [`LINK_RATE_MEMORY`] of `now`.
    fn fresh(&(rate, at): &(f64, Instant), now: Instant) -> Option<f64> {
        (now.saturating_duration_since(at) <= LINK_RATE_MEMORY).then_some(rate)
    }

    /// What a stream to `peer` measured: a link found full says its rate
    /// (it may have slowed); one the stream ended before filling says only
    /// that the link carries at least that much. Whether it was kept (and
    /// the file is then due a [`LinkRates::save`]).
    pub fn learn(&self, peer: &str, rate: f64, filled: bool, now: Instant) -> bool {
        if !usable_rate(rate) {
            return false;
        }
        let mut rates = self.rates.lock();
        let before = rates
            .get(peer)
            .and_then(|e| Self::fresh(e, now))
            .unwrap_or(0.0);
        let rate = if filled { rate } else { rate.max(before) };
        rates.insert(peer.to_string(), (rate, now));
        true
    }

    /// Write the fresh rates to the file (an fsync: callers on an async
    /// runtime run it on a blocking thread). A failure is logged: the
    /// rates stay known until the process ends.
    pub fn save(&self) {
        let Some(file) = &self.file else {
            return;
        };
        let _w = self.writing.lock();
        let now = Instant::now();
        let peers = self
            .rates
            .lock()
            .iter()
            .filter_map(|(peer, e)| {
                let rate = Self::fresh(e, now)?;
                let learnt_unix_s = crate::moves::unix_s(e.1);
                Some((
                    peer.clone(),
                    SavedLinkRate {
                        rate,
                        learnt_unix_s,
                    },
                ))
            })
            .collect();
        if let Err(e) = ferry_state_file::save(
            file,
            crate::guest::files::LINK_RATES,
            &SavedLinkRates { peers },
        ) {
            tracing::warn!(error = %e, "the links' rates learnt are not saved");
        }
    }
}

fn usable_rate(rate: f64) -> bool {
    rate.is_finite() && rate > 0.0
}

/// The sender's clock over a stream: when it read QEMU's first bytes and
/// sent its latest, and how long it waited on the link meanwhile (for
/// room in the window, or for the socket to take a frame: a slow link
/// and a far end slow to acknowledge look alike here). Where the waits
/// are a small share of the span, this end (QEMU walking the memory,
/// compression, encryption) set the stream's pace.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct SendTiming {
    pub first: Option<Instant>,
    pub last: Option<Instant>,
    pub link_wait: Duration,
    /// The smallest time a frame took from its send to its
    /// acknowledgement: the link's round trip, about.
    pub base_rtt: Option<Duration>,
    /// The largest delivery rate (link bytes per second, over one
    /// [`RATE_SAMPLE`]) the acknowledgements showed: what the link, or
    /// the far end, carries when the stream keeps it busy.
    pub delivery_peak_bps: Option<f64>,
}

impl SendTiming {
    /// From the first byte read to the latest sent.
    pub fn span(&self) -> Duration {
        match (self.first, self.last) {
            (Some(f), Some(l)) => l.saturating_duration_since(f),
            _ => Duration::ZERO,
        }
    }

    /// Whether the sender waited on the link (or the far end) for half
    /// the span or more: then they, not this end, set the stream's pace.
    pub fn held_back_by_link(&self) -> bool {
        self.link_wait * 2 >= self.span()
    }
}

const CHUNK: usize = 256 << 10;
/// The smallest frame the sender cuts from QEMU's stream.
const MIN_FRAME: usize = 16 << 10;
/// Bounds of the send window (link bytes not yet acknowledged).
pub const MIN_WINDOW: u64 = 256 << 10;
pub const MAX_WINDOW: u64 = 16 << 20;

/// The sender's window over the link's delivery rate × its round trip
/// while that rate still grows: the window doubles each round trip until
/// the stream finds what the link carries.
const STARTUP_GAIN: f64 = 2.0;
/// The same once the link is full, in all but one round trip of
/// [`PROBE_EVERY`]: one round trip of the rate, plus [`ACK_JITTER`]. Past
/// that, a window only queues bytes on the way (at the link's bottleneck,
/// in a relay, or before a far end that takes them slower), and every
/// later byte waits behind them: the last pre-copy pass and the device
/// state, sent with the guest stopped, most of all. At 100 and 200 ms RTT
/// a window of 1.25 round trips kept a quarter of a round trip of them
/// queued when QEMU stopped the guest, and one of two round trips a whole
/// one.
const CRUISE_GAIN: f64 = 1.0;
/// Once the link is full, one round trip in [`PROBE_EVERY`] has a window a
/// quarter larger: where the link carries more, the rate measured in that
/// round trip grows and the window with it. A window of exactly the rate
/// measured could never learn that the link is faster, nor hold its rate
/// where acknowledgements come late (BBR's bandwidth probe).
const PROBE_GAIN: f64 = 1.25;
const PROBE_EVERY: u64 = 8;
/// How late an acknowledgement may come on a busy host (the far end's
/// QEMU and ferry share its CPUs with the guests): a window that waits
/// for late acknowledgements leaves the link idle. With one round trip
/// and 4 ms, moves at 20 ms RTT and 100 Mbit/s took 4% longer than with
/// 1.25 round trips and 4 ms (4.20 and 4.26 s against 4.05 and 4.06).
const ACK_JITTER: Duration = Duration::from_millis(8);
/// The link is full once this many round trips in a row, each of which
/// the window held the sender back in, measured a rate within [`GROWTH`]
/// of the best before them; or once the fastest acknowledgement of one
/// such round trip came a [`queue_delay`] later than the round trip's
/// floor: bytes queue.
const FLAT_SAMPLES: u32 = 3;
const GROWTH: f64 = 1.25;
/// Where the host knows the link's rate from its last stream to the same
/// peer ([`LinkRates`]), the link counts as full once the rate measured
/// reaches this share of it, and the window grows no further than a probe's
/// over it meanwhile. A 256 MiB guest's stream lasts about six round trips
/// at 200 ms RTT: it ended before the rate stopped growing, with the
/// window up to twice the link's and a round trip of bytes queued behind
/// which the guest, stopped, waited.
const KNOWN_SHARE: f64 = 0.9;

/// How much longer than the round trip's floor every acknowledgement of
/// a round trip must take to say bytes queue on the way (HyStart's delay
/// increase, RFC 9406: an eighth of the floor, within 4-16 ms).
fn queue_delay(base_rtt: Duration) -> Duration {
    (base_rtt / 8).clamp(Duration::from_millis(4), Duration::from_millis(16))
}

/// A frame on the way: its end in sent bytes, when it went, and how many
/// bytes had been acknowledged then.
#[derive(Debug, Clone, Copy)]
struct Sent {
    end: u64,
    at: Instant,
    acked: u64,
}

/// The shortest span a delivery rate is measured over. Over one round trip
/// of a short link a window is only a few frames, and a rate over it is
/// off by a frame: at 8 ms RTT and 200 Mbit/s such rates came out 10-30%
/// above the link's (28-33 MB/s where it carries 25.6), and the window
/// with them.
const RATE_SPAN: Duration = Duration::from_millis(100);

/// The sender's window: the link's delivery rate, measured from the
/// acknowledgements, times its round trip, times [`STARTUP_GAIN`] until
/// the link is full and [`CRUISE_GAIN`] (plus [`ACK_JITTER`]) after. A
/// window much larger than the link holds only fills buffers on the way:
/// the guest's last bytes wait behind them while it is stopped, and QEMU,
/// which times its writes, would believe the link faster than it is and
/// stop the guest for longer than it promised.
///
/// Each acknowledgement gives a delivery rate: the bytes acknowledged over
/// the last round trip, or [`RATE_SPAN`] if longer. Round trips are
/// counted as a frame sent after the last one began is acknowledged;
/// whether the link is full is judged once per round trip. With rates
/// measured only over fixed 200 ms spans, a 200 ms round trip grew the
/// window by half as fast: a span saw the window of one round trip before
/// it only every other time.
#[derive(Debug)]
struct Window {
    in_flight: u64,
    sent: u64,
    acked: u64,
    /// When acknowledgements came over the last round trip (or
    /// [`RATE_SPAN`]) and one before, and the bytes acknowledged by then.
    acks: std::collections::VecDeque<(Instant, u64)>,
    pending: std::collections::VecDeque<Sent>,
    base_rtt: Option<Duration>,
    /// The largest delivery rates of the last [`RATE_MEMORY`], one per
    /// [`RATE_SAMPLE`], and the largest since the current one began.
    samples: std::collections::VecDeque<(Instant, f64)>,
    sample_max: f64,
    /// Bytes acknowledged since the current [`RATE_SAMPLE`] began.
    rate_since: Instant,
    rate_bytes: u64,
    /// The link's delivery rate: the largest recent sample. Not a mean:
    /// while QEMU has little to send (scanning zero pages, syncing its
    /// dirty bitmap) the acknowledged rate says nothing about the link,
    /// and a mean would shrink the window below what the link carries.
    rate: f64,
    /// The largest mean delivery rate over one [`RATE_SAMPLE`] of the
    /// whole stream (what [`SendTiming::delivery_peak_bps`] reports).
    peak: f64,
    /// Bytes acknowledged when the current round trip began, and how many
    /// round trips have ended.
    round_from: u64,
    rounds: u64,
    /// The sender waited for room in the current round trip: its rate
    /// measures the link (or the far end), not QEMU's pace.
    held_back: bool,
    /// The best rate at the end of a round trip held back, and how many
    /// such round trips since have not grown past it by [`GROWTH`].
    full_rate: f64,
    flat: u32,
    /// The fastest acknowledgement of the current round trip, and the
    /// round trip's floor before it began.
    round_fastest: Option<Duration>,
    floor: Option<Duration>,
    /// The link is full (see [`FLAT_SAMPLES`]).
    filled: bool,
    /// The link's rate as the host's last stream to the same peer found it
    /// ([`KNOWN_SHARE`]).
    known: Option<f64>,
}

/// The delivery rate's memory is kept as one largest sample per this much
/// time, and [`SendTiming::delivery_peak_bps`] is a mean over as long.
const RATE_SAMPLE: Duration = Duration::from_millis(200);
/// Samples older than this are forgotten (the link may have slowed).
const RATE_MEMORY: Duration = Duration::from_secs(2);

impl Window {
    fn new(now: Instant) -> Window {
        Window {
            in_flight: 0,
            sent: 0,
            acked: 0,
            acks: Default::default(),
            pending: Default::default(),
            base_rtt: None,
            samples: Default::default(),
            sample_max: 0.0,
            rate_since: now,
            rate_bytes: 0,
            rate: 0.0,
            peak: 0.0,
            round_from: 0,
            rounds: 0,
            held_back: false,
            full_rate: 0.0,
            flat: 0,
            round_fastest: None,
            floor: None,
            filled: false,
            known: None,
        }
    }

    /// The link's rate the window measured, and whether the link was full.
    fn link_rate(&self) -> Option<(f64, bool)> {
        (self.rate > 0.0).then_some((self.rate, self.filled))
    }

    /// Say at debug level what is in flight, and the window.
    fn log(&self, what: &str) {
        tracing::debug!(
            in_flight = self.in_flight,
            window = self.limit(),
            rate_bps = self.rate,
            base_rtt_ms = self.base_rtt.map(|r| r.as_secs_f64() * 1e3),
            filled = self.filled,
            rounds = self.rounds,
            "{what}"
        );
    }

    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    fn limit(&self) -> u64 {
        match self.base_rtt {
            Some(rtt) if self.rate > 0.0 => {
                let (rtt, jitter) = (rtt.as_secs_f64(), ACK_JITTER.as_secs_f64());
                let w = if self.filled {
                    let gain = if self.rounds.is_multiple_of(PROBE_EVERY) {
                        PROBE_GAIN
                    } else {
                        CRUISE_GAIN
                    };
                    self.rate * (rtt * gain + jitter)
                } else {
                    let w = self.rate * rtt * STARTUP_GAIN;
                    self.known
                        .map_or(w, |k| w.min(k * (rtt * PROBE_GAIN + jitter)))
                };
                (w as u64).clamp(MIN_WINDOW, MAX_WINDOW)
            }
            _ => MIN_WINDOW * 4,
        }
    }

    /// Whether a frame of `len` link bytes may go now (an empty window
    /// always has room: a frame larger than the window still goes). A
    /// frame that may not marks the current round trip as held back.
    fn room(&mut self, len: u64) -> bool {
        let room = self.in_flight == 0 || self.in_flight + len <= self.limit();
        self.held_back |= !room;
        room
    }

    /// The most raw bytes to put in the next frame.
    fn frame_room(&self) -> usize {
        usize::try_from(self.limit() / 4)
            .unwrap_or(CHUNK)
            .clamp(MIN_FRAME, CHUNK)
    }

    fn on_send(&mut self, n: u64, now: Instant) {
        if self.in_flight == 0 {
            // Time the link stood idle is no part of a delivery rate.
            self.acks.clear();
            self.acks.push_back((now, self.acked));
        }
        self.sent += n;
        self.in_flight += n;
        self.pending.push_back(Sent {
            end: self.sent,
            at: now,
            acked: self.acked,
        });
    }

    #[allow(clippy::cast_precision_loss)]
    fn on_ack(&mut self, n: u64, now: Instant) {
        self.acked += n;
        self.in_flight = self.in_flight.saturating_sub(n);
        let mut round_ended = false;
        while let Some(s) = self.pending.front().copied() {
            if s.end > self.acked {
                break;
            }
            self.pending.pop_front();
            let rtt = now.saturating_duration_since(s.at);
            self.base_rtt = Some(self.base_rtt.map_or(rtt, |b| b.min(rtt)));
            self.round_fastest = Some(self.round_fastest.map_or(rtt, |b| b.min(rtt)));
            round_ended |= s.acked >= self.round_from;
        }
        // The rate over the last span: from the latest acknowledgement at
        // least that old.
        let span = self.base_rtt.map_or(RATE_SPAN, |b| b.max(RATE_SPAN));
        while self
            .acks
            .get(1)
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) >= span)
        {
            self.acks.pop_front();
        }
        if let Some((t, acked)) = self.acks.front() {
            let dt = now.saturating_duration_since(*t);
            if dt >= span {
                let r = (self.acked - acked) as f64 / dt.as_secs_f64();
                self.sample_max = self.sample_max.max(r);
            }
        }
        self.acks.push_back((now, self.acked));
        self.rate_bytes += n;
        let dt = now.saturating_duration_since(self.rate_since);
        if dt >= RATE_SAMPLE {
            self.peak = self.peak.max(self.rate_bytes as f64 / dt.as_secs_f64());
            self.samples.push_back((now, self.sample_max));
            while let Some((t, _)) = self.samples.front() {
                if now.duration_since(*t) <= RATE_MEMORY {
                    break;
                }
                self.samples.pop_front();
            }
            self.sample_max = 0.0;
            self.rate_since = now;
            self.rate_bytes = 0;
        }
        self.rate = self
            .samples
            .iter()
            .map(|x| x.1)
            .fold(self.sample_max, f64::max);
        if !self.filled && self.known.is_some_and(|k| self.rate >= k * KNOWN_SHARE) {
            self.filled = true;
            self.log("the link's known rate reached");
        }
        if round_ended {
            self.end_round();
        }
    }

    /// A round trip ended: judge whether the link is full by it, and begin
    /// the next.
    fn end_round(&mut self) {
        // Only a round trip the window held back says whether a larger
        // window would carry more: one QEMU left short says nothing.
        if self.held_back && !self.filled {
            let queued = match (self.round_fastest, self.floor) {
                (Some(fastest), Some(floor)) => fastest >= floor + queue_delay(floor),
                _ => false,
            };
            if self.rate >= self.full_rate * GROWTH {
                self.full_rate = self.rate;
                self.flat = 0;
            } else {
                self.flat += 1;
            }
            self.filled = queued || self.flat >= FLAT_SAMPLES;
        }
        tracing::trace!(
            rate_bps = self.rate,
            fastest_ms = self.round_fastest.map(|d| d.as_secs_f64() * 1e3),
            floor_ms = self.floor.map(|d| d.as_secs_f64() * 1e3),
            held_back = self.held_back,
            flat = self.flat,
            filled = self.filled,
            in_flight = self.in_flight,
            "the window's round trip"
        );
        self.rounds += 1;
        self.round_from = self.acked;
        self.round_fastest = None;
        self.floor = self.base_rtt;
        self.held_back = false;
    }
}

/// Wait until `ready` says the window is as wanted, asking again each
/// time an acknowledgement opens it (`opened`).
async fn window_until(
    window: &parking_lot::Mutex<Window>,
    opened: &tokio::sync::Notify,
    mut ready: impl FnMut(&mut Window) -> bool,
) {
    loop {
        let wait = opened.notified();
        if ready(&mut window.lock()) {
            return;
        }
        wait.await;
    }
}

/// Why a memory stream's pipe ended early.
#[derive(Debug, thiserror::Error)]
pub enum PipeError {
    /// The link to the other host.
    #[error("the link: {0}")]
    Link(PeerFault),
    /// The local socket of QEMU's migration stream.
    #[error("QEMU's stream: {0}")]
    Qemu(#[source] std::io::Error),
}

/// Carry QEMU's stream (`qemu`, a unix socket) over `link` in frames, both
/// ways, until both directions end. `pending` holds link bytes already
/// read. Data sent waits for room in the [`Window`]; data received is
/// acknowledged once QEMU has it. Each direction ends its writer however
/// it ends, so that the end (or failure) of one side reaches the process
/// on the other as the end of its stream; a stream that ends whole ends
/// its writer only once every byte of it is acknowledged.
pub async fn pipe<Q, L>(
    qemu: Q,
    link: L,
    compress: bool,
    pending: Vec<u8>,
    known: Option<f64>,
    counters: &PipeCounters,
) -> Result<(), PipeError>
where
    Q: AsyncRead + AsyncWrite + Unpin,
    L: AsyncRead + AsyncWrite + Unpin,
{
    let (mut qr, mut qw) = tokio::io::split(qemu);
    let (mut lr, lw) = tokio::io::split(link);
    let lw = tokio::sync::Mutex::new(lw);
    let window = parking_lot::Mutex::new(Window {
        known,
        ..Window::new(Instant::now())
    });
    let opened = tokio::sync::Notify::new();
    // This side's stream is sent and every byte of it acknowledged.
    let said_all = std::sync::atomic::AtomicBool::new(false);
    let link_err = |what| move |e| PipeError::Link(PeerFault::link(what)(e));
    let out = async {
        let r = async {
            let mut buf = vec![0u8; CHUNK];
            let mut frame = Vec::with_capacity(CHUNK + 64);
            loop {
                // Frames of at most a quarter of the window, so that
                // several are in flight and the acknowledgements of the
                // first open room while the last are still on the way: a
                // window of one or two whole frames would stop and wait
                // once per frame and never grow past that.
                let most = window.lock().frame_room();
                let n = qr.read(&mut buf[..most]).await.map_err(PipeError::Qemu)?;
                if n == 0 {
                    window.lock().log("QEMU's stream all read");
                    break;
                }
                counters
                    .timing
                    .lock()
                    .first
                    .get_or_insert_with(Instant::now);
                frame.clear();
                encode_frame(&buf[..n], compress, &mut frame);
                let len = frame.len() as u64;
                let waiting = Instant::now();
                window_until(&window, &opened, |w| w.room(len)).await;
                window.lock().on_send(len, Instant::now());
                counters.raw.fetch_add(n as u64, Ordering::Relaxed);
                counters.link.fetch_add(len, Ordering::Relaxed);
                // Flushed: this task next waits on QEMU, not the link.
                send_flushed(&mut *lw.lock().await, &frame)
                    .await
                    .map_err(link_err("write"))?;
                let sent = Instant::now();
                let (rtt, peak) = {
                    let w = window.lock();
                    (w.base_rtt, w.peak)
                };
                let mut t = counters.timing.lock();
                t.link_wait += sent.duration_since(waiting);
                t.last = Some(sent);
                t.base_rtt = rtt;
                t.delivery_peak_bps = (peak > 0.0).then_some(peak);
            }
            // QEMU's stream is all sent. The link's end follows only once
            // the other side has acknowledged every byte: a relay on the
            // way (a TCP proxy, a load balancer) may close the far
            // connection as soon as it sees this end, and a socket closed
            // with unread bytes (acknowledgements) resets, dropping what
            // it had not yet sent on (issue 31: 2 MB of a memory stream).
            let all_acked = window_until(&window, &opened, |w| w.in_flight == 0);
            let all_acked = tokio::time::timeout(EXCHANGE_TIMEOUT, all_acked).await;
            if all_acked.is_ok() {
                said_all.store(true, Ordering::Relaxed);
            }
            *counters.link_rate.lock() = window.lock().link_rate();
            Ok::<(), PipeError>(())
        }
        .await;
        lw.lock().await.shutdown().await.ok();
        r
    };
    let back = async {
        let r = async {
            let mut buf = pending;
            let mut chunk = vec![0u8; CHUNK];
            let mut ack = Vec::with_capacity(16);
            loop {
                while let Some((f, size)) = decode_frame(&mut buf)
                    .map_err(|e| PipeError::Link(PeerFault::Protocol(e.to_string())))?
                {
                    match f {
                        Frame::Data(raw) => {
                            let came = Instant::now();
                            qw.write_all(&raw).await.map_err(PipeError::Qemu)?;
                            *counters.last_frame.lock() = Some((came, Instant::now()));
                            counters
                                .delivered
                                .fetch_add(raw.len() as u64, Ordering::Relaxed);
                            ack.clear();
                            encode_ack(u32::try_from(size).unwrap_or(u32::MAX), &mut ack);
                            // The other side may have finished sending; an
                            // acknowledgement that cannot go is not an error.
                            let _ = send_flushed(&mut *lw.lock().await, &ack).await;
                        }
                        Frame::Ack(n) => {
                            window.lock().on_ack(n, Instant::now());
                            opened.notify_waiters();
                        }
                    }
                }
                let n = match lr.read(&mut chunk).await {
                    Ok(n) => n,
                    // Once this side said all it had and heard it all
                    // acknowledged, a relay may close without TLS's
                    // close_notify: nothing is lost, the stream is whole.
                    Err(e)
                        if e.kind() == std::io::ErrorKind::UnexpectedEof
                            && said_all.load(Ordering::Relaxed) =>
                    {
                        0
                    }
                    Err(e) => return Err(link_err("read")(e)),
                };
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            if !buf.is_empty() {
                return Err(PipeError::Link(PeerFault::Protocol(
                    "the link ended inside a frame".into(),
                )));
            }
            Ok::<(), PipeError>(())
        }
        .await;
        qw.shutdown().await.ok();
        // Nothing will open the window any more.
        window.lock().in_flight = 0;
        opened.notify_waiters();
        r
    };
    let (a, b) = tokio::join!(out, back);
    a.and(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link closed before any byte is an unused spare, not a failure; one
    /// closed mid-message is.
    #[tokio::test]
    async fn a_link_closed_before_any_message_is_told_apart() {
        let mut empty: &[u8] = b"";
        let e = read_message::<serde_json::Value, _>(&mut empty)
            .await
            .unwrap_err();
        assert!(matches!(e, PeerFault::ClosedIdle), "{e}");
        let mut eof = eof_reader();
        let e = read_message::<serde_json::Value, _>(&mut eof)
            .await
            .unwrap_err();
        assert!(matches!(e, PeerFault::ClosedIdle), "{e}");
        let mut half: &[u8] = b"{\"a\":";
        let e = read_message::<serde_json::Value, _>(&mut half)
            .await
            .unwrap_err();
        assert!(matches!(e, PeerFault::Protocol(_)), "{e}");
    }

    /// A reader that fails at once as a TLS stream does when its peer
    /// drops the connection without a close_notify.
    fn eof_reader() -> impl AsyncRead + Unpin {
        struct Eof;
        impl AsyncRead for Eof {
            fn poll_read(
                self: std::pin::Pin<&mut Self>,
                _: &mut std::task::Context<'_>,
                _: &mut tokio::io::ReadBuf<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::task::Poll::Ready(Err(std::io::ErrorKind::UnexpectedEof.into()))
            }
        }
        Eof
    }

    /// The sender ends its side of the link only once the receiver has
    /// acknowledged all of QEMU's stream: a relay that closes the far
    /// connection when it sees this end cannot cut the stream's tail.
    #[tokio::test]
    async fn the_link_ends_only_after_every_byte_is_acknowledged() {
        let (qemu, mut qemu_peer) = tokio::io::duplex(1 << 20);
        let (link, mut far) = tokio::io::duplex(1 << 20);
        let counters = std::sync::Arc::new(PipeCounters::default());
        let c = counters.clone();
        let sender =
            tokio::spawn(async move { pipe(qemu, link, false, Vec::new(), None, &c).await });
        let stream: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        qemu_peer.write_all(&stream).await.unwrap();
        qemu_peer.shutdown().await.unwrap();
        // The far side reads every frame, acknowledging none yet.
        let (mut buf, mut got, mut sizes) = (Vec::new(), Vec::new(), Vec::new());
        let mut chunk = vec![0u8; 64 << 10];
        while got.len() < stream.len() {
            while let Some((f, size)) = decode_frame(&mut buf).unwrap() {
                if let Frame::Data(d) = f {
                    got.extend_from_slice(&d);
                    sizes.push(size);
                }
            }
            if got.len() == stream.len() {
                break;
            }
            let n = far.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the link ended before the stream did");
            buf.extend_from_slice(&chunk[..n]);
        }
        assert_eq!(got, stream);
        // Unacknowledged: the link stays open.
        let early = tokio::time::timeout(Duration::from_millis(300), far.read(&mut chunk)).await;
        assert!(
            early.is_err(),
            "the sender ended its side before the acknowledgements"
        );
        let mut acks = Vec::new();
        for size in sizes {
            encode_ack(u32::try_from(size).unwrap(), &mut acks);
        }
        far.write_all(&acks).await.unwrap();
        let end = tokio::time::timeout(Duration::from_secs(5), far.read(&mut chunk))
            .await
            .expect("the sender ends its side once all is acknowledged")
            .unwrap();
        assert_eq!(end, 0);
        far.shutdown().await.unwrap();
        sender.await.unwrap().unwrap();
        assert_eq!(counters.raw.load(Ordering::Relaxed), stream.len() as u64);
    }

    /// A far side slow to acknowledge shows as the sender's wait on the
    /// link, not as the machine's time: the host's stream rate must not
    /// take a link-bound stream for a slow machine.
    #[tokio::test]
    async fn the_sender_counts_its_waits_on_the_link_apart() {
        let (qemu, mut qemu_peer) = tokio::io::duplex(1 << 20);
        let (link, far) = tokio::io::duplex(1 << 20);
        let counters = std::sync::Arc::new(PipeCounters::default());
        let c = counters.clone();
        let sender =
            tokio::spawn(async move { pipe(qemu, link, false, Vec::new(), None, &c).await });
        let stream: Vec<u8> = (0..(4u32 << 20)).map(|i| (i % 251) as u8).collect();
        let feed = tokio::spawn(async move {
            qemu_peer.write_all(&stream).await.unwrap();
            qemu_peer.shutdown().await.unwrap();
            // QEMU's side reads until the pipe ends its stream back.
            let mut rest = Vec::new();
            qemu_peer.read_to_end(&mut rest).await.unwrap();
        });
        // The far side acknowledges each frame 40 ms after it arrives.
        let (mut fr, mut fw) = tokio::io::split(far);
        let (mut buf, mut chunk, mut got) = (Vec::new(), vec![0u8; 64 << 10], 0usize);
        while got < 4 << 20 {
            while let Some((f, size)) = decode_frame(&mut buf).unwrap() {
                if let Frame::Data(d) = f {
                    got += d.len();
                    tokio::time::sleep(Duration::from_millis(40)).await;
                    let mut ack = Vec::new();
                    encode_ack(u32::try_from(size).unwrap(), &mut ack);
                    fw.write_all(&ack).await.unwrap();
                }
            }
            if got >= 4 << 20 {
                break;
            }
            let n = fr.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the link ended before the stream did");
            buf.extend_from_slice(&chunk[..n]);
        }
        fw.shutdown().await.unwrap();
        sender.await.unwrap().unwrap();
        feed.await.unwrap();
        let t = *counters.timing.lock();
        assert!(t.first.is_some() && t.last.is_some(), "{t:?}");
        let span = t.span();
        assert!(span >= Duration::from_millis(200), "{t:?}");
        assert!(t.link_wait <= span, "{t:?}");
        assert!(
            t.link_wait * 2 >= span,
            "a stream held back by its acknowledgements waited on the link for most of its time: {t:?}"
        );
        assert_eq!(
            crate::moves::stream_measure(crate::moves::MIN_MEASURED_STREAM, &t),
            None,
            "nor is it measured"
        );
    }

    #[test]
    fn frames_are_a_quarter_of_the_window_within_bounds() {
        let mut w = Window::new(Instant::now());
        // No measurement yet: the starting window of 1 MiB, frames of 256 KiB.
        assert_eq!(w.frame_room(), CHUNK);
        // A slow link: 2 × 1 MB/s × 10 ms is under the smallest window.
        w.base_rtt = Some(Duration::from_millis(10));
        w.rate = 1e6;
        assert_eq!(w.limit(), MIN_WINDOW);
        assert_eq!(w.frame_room(), 64 << 10);
        // A fast one: frames never exceed a chunk.
        w.rate = 1e9;
        assert_eq!(w.limit(), MAX_WINDOW);
        assert_eq!(w.frame_room(), CHUNK);
    }

    #[test]
    fn the_rate_is_the_largest_recent_sample_not_a_mean() {
        let t0 = Instant::now();
        let mut w = Window::new(t0);
        // 1 MB acknowledged over a 250 ms sample: 4 MB/s.
        let mut now = t0 + Duration::from_millis(250);
        w.on_send(1_000_000, t0);
        w.on_ack(1_000_000, now);
        let fast = w.rate;
        assert!((fast - 4e6).abs() < 1.0, "{fast}");
        // Then a quiet sample (QEMU scanning zero pages): the rate holds.
        w.on_send(1000, now);
        now += Duration::from_millis(250);
        w.on_ack(1000, now);
        assert_eq!(w.rate, fast);
        // Samples older than the memory are forgotten.
        now += RATE_MEMORY;
        w.on_send(1000, now);
        now += Duration::from_millis(250);
        w.on_ack(1000, now);
        assert!(w.rate < 1e5, "{}", w.rate);
        assert_eq!(w.in_flight, 0);
        // The stream's peak is not forgotten: what the link carried when
        // the stream kept it busy.
        assert_eq!(w.peak, fast);
    }

    /// One round trip of 200 ms over a link that carries `link` bytes a
    /// second: the window sends what it allows, and the link delivers the
    /// lesser of that and its own rate.
    fn round_trip(w: &mut Window, now: &mut Instant, link: f64) {
        let rtt = Duration::from_millis(200);
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )]
        let n = (w.limit() as f64).min(link * rtt.as_secs_f64()) as u64;
        // The sender had more than the window let it send.
        w.held_back = true;
        w.on_send(n, *now);
        *now += rtt;
        w.on_ack(n, *now);
    }

    #[test]
    fn the_window_doubles_until_the_link_is_full_then_keeps_one_round_trip_and_probes() {
        let t0 = Instant::now();
        let mut w = Window::new(t0);
        let mut now = t0;
        let link = 40e6;
        let bdp = link * 0.2;
        // Starting from 1 MiB the window doubles each round trip while the
        // rate grows with it.
        let mut last = 0.0;
        for i in 0..3 {
            round_trip(&mut w, &mut now, link);
            assert_eq!(w.rounds, i + 1);
            assert!(!w.filled);
            assert!(w.rate > last * 1.9, "{} after {last}", w.rate);
            last = w.rate;
        }
        // Once the link is full the rate stops growing: three such round
        // trips and the window falls to one round trip of the link's.
        for _ in 0..4 {
            round_trip(&mut w, &mut now, link);
        }
        assert!(w.filled);
        // Then one round trip in eight a quarter more, to learn whether
        // the link carries more.
        let jitter = ACK_JITTER.as_secs_f64() / 0.2;
        let mut probes = 0;
        for _ in 0..PROBE_EVERY {
            #[allow(clippy::cast_precision_loss)]
            let over = w.limit() as f64 / bdp;
            if (over - (PROBE_GAIN + jitter)).abs() < 0.01 {
                probes += 1;
            } else {
                assert!((over - (CRUISE_GAIN + jitter)).abs() < 0.01, "{over}");
            }
            round_trip(&mut w, &mut now, link);
        }
        assert_eq!(probes, 1);
        // A faster link is found by the probes.
        for _ in 0..3 * PROBE_EVERY {
            round_trip(&mut w, &mut now, link * 2.0);
        }
        assert!(w.rate > link * 1.9, "{}", w.rate);
    }

    #[test]
    fn acknowledgements_that_all_come_late_say_the_link_is_full() {
        let t0 = Instant::now();
        let mut w = Window::new(t0);
        let mut now = t0;
        // Two round trips of 200 ms: the floor.
        for _ in 0..2 {
            round_trip(&mut w, &mut now, 1e9);
        }
        assert!(!w.filled);
        // Then every acknowledgement of a round trip held back comes 20 ms
        // later (more than 16 ms: an eighth of the floor, at most 16):
        // bytes queue on the way, whatever the rate did.
        w.held_back = true;
        w.on_send(1 << 20, now);
        now += Duration::from_millis(220);
        w.on_ack(1 << 20, now);
        assert!(w.filled);
        assert_eq!(w.base_rtt, Some(Duration::from_millis(200)));
        // Jitter on one acknowledgement is not a queue: the fastest counts.
        let mut v = Window::new(t0);
        let mut now = t0;
        round_trip(&mut v, &mut now, 1e9);
        round_trip(&mut v, &mut now, 1e9);
        v.held_back = true;
        // One round trip: its first acknowledgement on time, then one late
        // in the same round trip.
        v.on_send(1 << 20, now);
        v.on_send(1 << 20, now + Duration::from_millis(1));
        v.on_send(1 << 20, now + Duration::from_millis(2));
        v.on_ack(1 << 20, now + Duration::from_millis(201));
        assert_eq!(v.rounds, 3, "the round trip ended with its first frame");
        v.held_back = true;
        v.on_ack(1 << 20, now + Duration::from_millis(320));
        assert!(!v.filled);
        assert_eq!(
            v.rounds, 3,
            "a frame sent before the round trip began ends none"
        );
    }

    #[test]
    fn a_steady_stream_is_measured_at_its_rate_from_each_acknowledgement() {
        // Frames that go while others are on the way: each acknowledgement
        // gives the rate since its frame went, over at least a round trip.
        let t0 = Instant::now();
        let mut w = Window::new(t0);
        let rtt = Duration::from_millis(200);
        let step = Duration::from_millis(10);
        // A frame of 100 kB each 10 ms for 600 ms, each acknowledged a
        // round trip later: 10 MB/s.
        for i in 0..80u32 {
            // Acknowledgements first: they come in before the next send.
            if (20..80).contains(&i) {
                w.on_ack(100_000, t0 + rtt + step * (i - 20));
            }
            if i < 60 {
                w.on_send(100_000, t0 + step * i);
            }
        }
        assert_eq!(w.in_flight, 0);
        assert!((w.rate - 10e6).abs() < 1.5e6, "{}", w.rate);
    }

    #[test]
    fn a_link_rate_known_from_the_last_stream_ends_the_growth_without_overshoot() {
        let t0 = Instant::now();
        let link = 40e6;
        let bdp = link * 0.2;
        let mut w = Window {
            known: Some(link),
            ..Window::new(t0)
        };
        let mut now = t0;
        let mut most = 0;
        while !w.filled {
            round_trip(&mut w, &mut now, link);
            most = most.max(w.limit());
            assert!(w.rounds < 10);
        }
        // Never more in flight than a probe's over the link's round trip.
        #[allow(clippy::cast_precision_loss)]
        let over = most as f64 / bdp;
        assert!(
            over <= PROBE_GAIN + ACK_JITTER.as_secs_f64() / 0.2 + 0.01,
            "{over}"
        );
        // Unknown, the growth ends only after the link stopped it, with
        // the window twice the link's on the way.
        let mut v = Window::new(t0);
        let mut now = t0;
        let mut most = 0;
        while !v.filled {
            round_trip(&mut v, &mut now, link);
            most = most.max(v.limit());
        }
        #[allow(clippy::cast_precision_loss)]
        let over = most as f64 / bdp;
        assert!(over > 1.9, "{over}");
        assert!(v.rounds > w.rounds);
    }

    #[test]
    fn a_known_rate_the_link_no_longer_has_is_corrected_within_the_stream() {
        let t0 = Instant::now();
        let link = 40e6;
        // The link halved since the last stream to this peer: the window
        // grows toward the old rate, the link stops it, and the stream
        // ends with the link found full at its new rate (which the host
        // then learns: a full link sets the rate).
        let mut w = Window {
            known: Some(link * 2.0),
            ..Window::new(t0)
        };
        let mut now = t0;
        while !w.filled {
            round_trip(&mut w, &mut now, link);
            assert!(w.rounds < 12, "not found full: {}", w.rate);
        }
        let (rate, filled) = w.link_rate().unwrap();
        assert!(filled);
        assert!((rate / link - 1.0).abs() < 0.05, "{rate}");
        // The link doubled: the known rate ends the growth early, and the
        // probes (a quarter more one round trip in eight) find the rest
        // within a few dozen round trips.
        let mut v = Window {
            known: Some(link / 2.0),
            ..Window::new(t0)
        };
        let mut now = t0;
        while !v.filled {
            round_trip(&mut v, &mut now, link);
            assert!(v.rounds < 12);
        }
        assert!(v.rate < link * 0.6, "{}", v.rate);
        for _ in 0..4 * PROBE_EVERY {
            round_trip(&mut v, &mut now, link);
        }
        let (rate, _) = v.link_rate().unwrap();
        assert!(rate > link * 0.9, "{rate}");
    }

    #[test]
    fn a_link_found_full_says_its_rate_and_one_not_filled_only_raises_it() {
        let rates = LinkRates::default();
        let t0 = Instant::now();
        assert_eq!(rates.get("b:1", t0), None);
        rates.learn("b:1", 40e6, true, t0);
        assert_eq!(rates.get("b:1", t0), Some(40e6));
        // A stream that ended still growing: the link carries at least
        // what it reached, no less than known.
        rates.learn("b:1", 30e6, false, t0);
        assert_eq!(rates.get("b:1", t0), Some(40e6));
        rates.learn("b:1", 45e6, false, t0);
        assert_eq!(rates.get("b:1", t0), Some(45e6));
        // A full link that slowed says so.
        rates.learn("b:1", 20e6, true, t0);
        assert_eq!(rates.get("b:1", t0), Some(20e6));
        // Each peer its own; nothing measured teaches nothing; old news
        // is forgotten.
        assert_eq!(rates.get("c:1", t0), None);
        rates.learn("c:1", f64::NAN, true, t0);
        rates.learn("c:1", 0.0, true, t0);
        assert_eq!(rates.get("c:1", t0), None);
        assert_eq!(
            rates.get("b:1", t0 + LINK_RATE_MEMORY + Duration::from_secs(1)),
            None
        );
    }

    #[test]
    fn the_links_rates_outlive_a_restart_while_fresh() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(crate::guest::files::LINK_RATES_FILE);
        let rates = LinkRates::open(file.clone());
        assert_eq!(rates.get("b:1", Instant::now()), None);
        let now = Instant::now();
        assert!(rates.learn("b:1", 40e6, true, now));
        assert!(!rates.learn("b:1", f64::INFINITY, true, now));
        // One learnt long ago is not written.
        if let Some(old) = now.checked_sub(LINK_RATE_MEMORY + Duration::from_secs(5)) {
            rates.learn("c:1", 10e6, true, old);
        }
        rates.save();
        let again = LinkRates::open(file.clone());
        let got = again.get("b:1", Instant::now()).unwrap();
        assert!((got - 40e6).abs() < 1.0, "{got}");
        assert_eq!(again.get("c:1", Instant::now()), None);
        // A file whose rate was learnt before the memory's span, or
        // claims a time to come or a rate no stream measures, reads as
        // nothing learnt.
        let wall = crate::moves::unix_s(Instant::now());
        for (rate, learnt) in [
            (40e6, wall - LINK_RATE_MEMORY.as_secs_f64() - 1.0),
            (40e6, wall + 3600.0),
            (-1.0, wall),
        ] {
            let mut peers = std::collections::BTreeMap::new();
            peers.insert(
                "b:1".to_string(),
                SavedLinkRate {
                    rate,
                    learnt_unix_s: learnt,
                },
            );
            ferry_state_file::save(
                &file,
                crate::guest::files::LINK_RATES,
                &SavedLinkRates { peers },
            )
            .unwrap();
            assert_eq!(
                LinkRates::open(file.clone()).get("b:1", Instant::now()),
                None
            );
        }
        // A damaged file is read as nothing, and replaced by the next save.
        std::fs::write(&file, b"{ not json").unwrap();
        let damaged = LinkRates::open(file.clone());
        assert_eq!(damaged.get("b:1", Instant::now()), None);
        damaged.learn("b:1", 20e6, true, Instant::now());
        damaged.save();
        assert!(LinkRates::open(file).get("b:1", Instant::now()).is_some());
    }

    #[test]
    fn samples_qemu_left_short_do_not_end_the_growth() {
        let t0 = Instant::now();
        let mut w = Window::new(t0);
        let mut now = t0;
        w.base_rtt = Some(Duration::from_millis(200));
        // QEMU sends a trickle, the window never full: however long, the
        // window keeps its growth gain.
        for _ in 0..10 {
            w.on_send(10_000, now);
            now += Duration::from_millis(200);
            w.on_ack(10_000, now);
        }
        assert!(!w.filled);
    }
}
