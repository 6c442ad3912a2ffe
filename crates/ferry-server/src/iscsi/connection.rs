//! One iSCSI connection: the login phase, then the full feature phase. The
//! connection task owns the protocol session; SCSI commands run on worker
//! threads and their results come back over a channel, so a slow command
//! never blocks the others or the socket.

use super::PortalTargets;
use crate::net::{Held, HeldFrames};
use crate::ServerState;
use bytes::{Bytes, BytesMut};
use ferry_iscsi::login::{LoginFailure, OUR_MAX_RECV_DATA};
use ferry_iscsi::pdu::BHS_LEN;
use ferry_iscsi::session::TmfFunction;
use ferry_iscsi::{
    CommandResult, Event, Login, LoginStep, Pdu, PduDecoder, PduError, ScsiTask, Session,
    SessionError, SessionType,
};
// How long a closing connection waits for its running commands: the grace
// an NBD connection gets, so a stopping daemon makes one promise to both.
use ferry_nbd_server::CLOSE_GRACE;
use ferry_scsi::op;
use ferry_scsi::{LogicalUnit, Nexus, Sense};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

/// How long an initiator may take over each login step.
const LOGIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle time before the target pings the initiator with a NOP-In.
const KEEPALIVE: Duration = Duration::from_secs(30);
/// Once a session's volume has moved away: the time the initiator is
/// asked to log out within (async event 1), and how long the connection
/// waits for that logout before it closes on its own.
const LOGOUT_WITHIN_S: u16 = 2;
const LOGOUT_GRACE: Duration = Duration::from_secs(5);

#[derive(Debug, Error)]
pub enum ConnError {
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("framing: {0}")]
    Pdu(#[from] PduError),
    #[error("{0}")]
    Session(#[from] SessionError),
    #[error("login failed: {0:?}")]
    Login(LoginFailure),
    #[error("login timed out")]
    Timeout,
    #[error("no keepalive answer")]
    Dead,
}

/// Append the wire form of `p` to `out`, keeping large data segments as
/// their own buffers (no copy) when there is no data digest.
fn wire(p: &Pdu, hd: bool, dd: bool, out: &mut Vec<Bytes>) {
    if p.data.len() < 4096 || dd {
        out.push(p.to_bytes(hd, dd));
        return;
    }
    let mut h = BytesMut::with_capacity(BHS_LEN + p.ahs.len() + 4);
    p.encode_header(hd, &mut h);
    out.push(h.freeze());
    out.push(p.data.clone());
    let pad = (4 - p.data.len() % 4) % 4;
    if pad > 0 {
        out.push(Bytes::from_static(&[0u8; 3][..pad]));
    }
}

async fn read_pdu(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    dec: &PduDecoder,
) -> Result<Option<Pdu>, ConnError> {
    loop {
        if let Some(p) = dec.decode(buf)? {
            return Ok(Some(p));
        }
        let n = tokio::time::timeout(LOGIN_TIMEOUT, stream.read_buf(buf))
            .await
            .map_err(|_| ConnError::Timeout)??;
        if n == 0 {
            return Ok(None);
        }
    }
}

/// Answer a connection over the portal's limit: its first login request
/// gets "out of resources" (status 03/02), then the connection closes.
pub async fn refuse_busy(mut stream: TcpStream) {
    let mut buf = BytesMut::with_capacity(8192);
    let dec = PduDecoder::new(OUR_MAX_RECV_DATA);
    if let Ok(Some(pdu)) = read_pdu(&mut stream, &mut buf, &dec).await {
        let mut login = Login::new([0; 16], 0);
        let p = login.refuse_busy(&pdu);
        let _ = stream.write_all(&p.to_bytes(false, false)).await;
    }
    let _ = stream.shutdown().await;
}

pub async fn run(
    mut stream: TcpStream,
    portal: usize,
    state: &Arc<ServerState>,
    shutdown: CancellationToken,
) -> Result<(), ConnError> {
    stream.set_nodelay(true)?;
    crate::net::probe_vanished_client(&stream);
    let local = stream.local_addr()?;
    let targets = PortalTargets {
        state,
        portal,
        local,
    };
    let mut buf = BytesMut::with_capacity(64 * 1024);
    let mut dec = PduDecoder::new(OUR_MAX_RECV_DATA);
    let mut login = Login::new(rand::random(), state.iscsi.tsih());
    let params = loop {
        let Some(pdu) = read_pdu(&mut stream, &mut buf, &dec).await? else {
            return Ok(());
        };
        match login.feed(&pdu, &targets) {
            LoginStep::Continue(p) => stream.write_all(&p.to_bytes(false, false)).await?,
            LoginStep::Done(p, params) => {
                stream.write_all(&p.to_bytes(false, false)).await?;
                break params;
            }
            LoginStep::Redirect(p, to) => {
                stream.write_all(&p.to_bytes(false, false)).await?;
                tracing::info!(initiator = %login.params().initiator_name, %to, "iSCSI login redirected: the volume moved");
                return Ok(());
            }
            LoginStep::Fail(p, why) => {
                let _ = stream.write_all(&p.to_bytes(false, false)).await;
                tracing::info!(initiator = %login.params().initiator_name, ?why, "iSCSI login refused");
                return Err(ConnError::Login(why));
            }
        }
    };
    dec.header_digest = params.header_digest;
    dec.data_digest = params.data_digest;
    let portal_count = u16::try_from(state.iscsi.portals.lock().len()).unwrap_or(u16::MAX);
    let luns = match (params.session_type, &params.target_name) {
        (SessionType::Normal, Some(t)) => match targets.luns_of(t) {
            Some(vols) => Luns(
                vols.into_iter()
                    .map(|(number, v)| Lun {
                        number,
                        metrics: CommandMetrics::new(state, &v.name()),
                        unit: state.iscsi.units.unit(
                            &v,
                            t,
                            &state.pool,
                            (state.iscsi.port_group, portal_count),
                            state.config.storage.sanitize_bytes_per_sec,
                        ),
                        _hold: v.hold(ferry_storage::Holder::IscsiSession),
                        volume: v,
                    })
                    .collect(),
            ),
            None => return Ok(()),
        },
        _ => Luns(Vec::new()),
    };
    let luns = Arc::new(luns);
    let nexus = Nexus {
        initiator_port: params.initiator_port(),
        relative_port: ferry_scsi::relative_port(state.iscsi.port_group, portal),
    };
    tracing::debug!(initiator = %params.initiator_name, target = ?params.target_name, "iSCSI session starts");
    let session_key = (
        nexus.initiator_port.clone(),
        params.target_name.clone().unwrap_or_default(),
    );
    let mine = shutdown.child_token();
    let id = state.iscsi.session_ids.fetch_add(1, Ordering::Relaxed);
    if let Some((_, old)) = state
        .iscsi
        .sessions
        .lock()
        .insert(session_key.clone(), (id, mine.clone()))
    {
        // Session reinstatement: the old session with this ISID ends.
        old.cancel();
    }
    // A new session is a new I_T nexus, even when it reuses the ISID of one
    // whose connection is still being torn down.
    luns.nexus_lost(&nexus);
    let per_connection = state
        .config
        .iscsi
        .max_queued_bytes
        .clamp(1 << 20, Semaphore::MAX_PERMITS);
    let budget = Budget {
        per_connection,
        connection: Arc::new(Semaphore::new(per_connection)),
        total: state.iscsi.budget_total(&state.config.iscsi),
    };
    let result = full_feature(
        stream,
        buf,
        dec,
        *params,
        luns.clone(),
        &nexus,
        &targets,
        budget,
        mine,
        state.iscsi.watch_moves(),
    )
    .await;
    {
        // Remove our entry unless a reinstating session replaced it.
        let mut sessions = state.iscsi.sessions.lock();
        if sessions.get(&session_key).is_some_and(|(i, _)| *i == id) {
            sessions.remove(&session_key);
        }
    }
    luns.nexus_lost(&nexus);
    result
}

/// Sleep until `deadline`, or for ever without one.
async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Largest READ answered from the page cache on the connection's task.
const INLINE_READ_MAX: u64 = 128 * 1024;

/// Small buffered writes (no FUA) and state queries finish in
/// microseconds on the page cache: they run on the connection's task
/// instead of paying a hop to a worker thread (measured: 4 KiB writes at
/// QD 16 went from 25k to 46k IOPS). Not while a migration pauses or
/// throttles the volume's writes: those wait, and must not wait here.
fn inline_ok(t: &ScsiTask, lu: &LogicalUnit) -> bool {
    const INLINE_WRITE_MAX: usize = 64 * 1024;
    match t.cdb.first() {
        Some(&(op::WRITE_10 | op::WRITE_16)) => {
            t.data_out.len() <= INLINE_WRITE_MAX
                && t.cdb.get(1).is_some_and(|f| f & 0x08 == 0)
                && !lu.writes_may_wait()
        }
        // Tried without blocking; a miss goes to a worker thread.
        Some(&(op::READ_10 | op::READ_16)) => true,
        Some(
            &(op::TEST_UNIT_READY
            | op::INQUIRY
            | op::MODE_SENSE_6
            | op::MODE_SENSE_10
            | op::READ_CAPACITY_10
            | op::REPORT_LUNS),
        ) => true,
        // READ CAPACITY(16) only, of the SERVICE ACTION IN(16) family.
        Some(&op::SERVICE_ACTION_IN_16) => t.cdb.get(1).is_some_and(|sa| sa & 0x1f == 0x10),
        _ => false,
    }
}

/// Per-volume metrics of iSCSI commands: reads, writes, and the rest.
#[derive(Clone)]
struct CommandMetrics([crate::metrics::OpMetrics; 3]);

impl CommandMetrics {
    fn new(state: &ServerState, volume: &str) -> Self {
        CommandMetrics(
            ["iscsi_read", "iscsi_write", "iscsi_other"].map(|op| state.metrics.op(volume, op)),
        )
    }

    fn record(&self, t: &ScsiTask, r: &CommandResult, start: std::time::Instant) {
        let (m, bytes) = match t.cdb.first() {
            Some(&(op::READ_6 | op::READ_10 | op::READ_12 | op::READ_16)) => {
                (&self.0[0], r.data.len())
            }
            Some(
                &(op::WRITE_6
                | op::WRITE_10
                | op::WRITE_12
                | op::WRITE_16
                | op::WRITE_AND_VERIFY_10
                | op::WRITE_AND_VERIFY_12
                | op::WRITE_AND_VERIFY_16
                | op::COMPARE_AND_WRITE
                | op::ORWRITE_16
                | op::WRITE_ATOMIC_16
                | op::WRITE_SAME_10
                | op::WRITE_SAME_16),
            ) => (&self.0[1], t.data_out.len()),
            _ => (&self.0[2], 0),
        };
        m.ops.inc();
        m.bytes.inc_by(bytes as u64);
        m.size.observe(bytes as f64);
        m.latency.observe(start.elapsed().as_secs_f64());
        if r.status != 0 {
            m.errors.inc();
        }
    }
}

/// One logical unit of the session's target.
struct Lun {
    number: u64,
    unit: Arc<LogicalUnit>,
    metrics: CommandMetrics,
    /// Counts this session as a client of the volume.
    _hold: ferry_storage::HoldGuard,
    volume: Arc<ferry_storage::Volume>,
}

/// The LUNs of the target a session logged in to (none for discovery).
struct Luns(Vec<Lun>);

impl Luns {
    fn get(&self, number: u64) -> Option<&Lun> {
        self.0.iter().find(|l| l.number == number)
    }

    /// Whether any unit's volume has moved to another site.
    fn any_moved(&self) -> bool {
        self.0.iter().any(|l| l.volume.moved_to().is_some())
    }

    /// Whether `r`, the result of a command to `lun`, failed because the
    /// volume moved away (the command is then withheld, not answered).
    fn failed_by_move(&self, lun: u64, r: &CommandResult) -> bool {
        r.status != 0 && self.get(lun).is_some_and(|l| l.volume.moved_to().is_some())
    }

    fn nexus_lost(&self, nexus: &Nexus) {
        for l in &self.0 {
            l.unit.nexus_lost(nexus);
        }
    }

    /// A small READ answered from the page cache, if it can be at once.
    fn try_read_nowait(&self, nexus: &Nexus, t: &ScsiTask) -> Option<CommandResult> {
        let start = std::time::Instant::now();
        let l = self.get(t.lun)?;
        let r = l.unit.try_read_nowait(nexus, &t.cdb, INLINE_READ_MAX)?;
        let r = CommandResult {
            status: r.status as u8,
            transfer_len: r.transfer_len,
            data: Bytes::from(r.data),
            sense: Bytes::new(),
        };
        l.metrics.record(t, &r, start);
        Some(r)
    }

    /// Run one command: REPORT LUNS answers for the whole target, other
    /// commands go to their unit; an absent LUN answers INQUIRY with
    /// peripheral qualifier 3 and everything else with LUN NOT SUPPORTED.
    fn execute(&self, nexus: &Nexus, t: &ScsiTask) -> CommandResult {
        let start = std::time::Instant::now();
        let lun = self.get(t.lun);
        let r = match (t.cdb.first(), lun) {
            (Some(&op::REPORT_LUNS), _) => {
                let numbers: Vec<u64> = self.0.iter().map(|l| l.number).collect();
                match ferry_scsi::report_luns(&t.cdb, &numbers) {
                    Ok(d) => ferry_scsi::ScsiResponse::good(d),
                    Err(sense) => check_condition(sense),
                }
            }
            (_, Some(l)) => l.unit.execute(nexus, &t.cdb, &t.data_out),
            (Some(&op::INQUIRY), None) => match ferry_scsi::absent_lun(&t.cdb) {
                Some(d) => ferry_scsi::ScsiResponse::good(d),
                None => check_condition(Sense::LUN_NOT_SUPPORTED),
            },
            _ => check_condition(Sense::LUN_NOT_SUPPORTED),
        };
        let r = CommandResult {
            status: r.status as u8,
            data: Bytes::from(r.data),
            sense: Bytes::from(r.sense),
            transfer_len: r.transfer_len,
        };
        if let Some(l) = lun {
            l.metrics.record(t, &r, start);
        }
        r
    }
}

fn check_condition(sense: Sense) -> ferry_scsi::ScsiResponse {
    ferry_scsi::ScsiResponse {
        status: ferry_scsi::Status::CheckCondition,
        data: Vec::new(),
        sense: sense.encode(false),
        transfer_len: 0,
    }
}

/// What one connection's unsent Data-In may hold: its own budget and the
/// one all connections share. A READ is charged its expected length (at
/// most the whole connection budget) before it runs, and the charge is
/// given back once its Data-In is written; an initiator that does not read
/// therefore stops being read once its budget is spent.
struct Budget {
    per_connection: usize,
    connection: Arc<Semaphore>,
    total: Arc<Semaphore>,
}

impl Budget {
    /// What `t` is charged (0: nothing to hold).
    fn cost(&self, t: &ScsiTask) -> u32 {
        if !t.read || t.edtl == 0 {
            return 0;
        }
        let most = u32::try_from(self.per_connection).unwrap_or(u32::MAX);
        t.edtl.saturating_add(4096).min(most)
    }

    /// Charge `t` now, if both budgets have room.
    fn try_charge(&self, t: &ScsiTask) -> Option<Option<Held>> {
        let n = self.cost(t);
        if n == 0 {
            return Some(None);
        }
        let c = self.connection.clone().try_acquire_many_owned(n).ok()?;
        let a = self.total.clone().try_acquire_many_owned(n).ok()?;
        Some(Some(Held::new(c, Some(a))))
    }

    /// Charge `n`, waiting for room.
    async fn charge(&self, n: u32) -> Option<Held> {
        if n == 0 {
            return None;
        }
        let c = self.connection.clone().acquire_many_owned(n).await.ok()?;
        let a = self.total.clone().acquire_many_owned(n).await.ok()?;
        Some(Held::new(c, Some(a)))
    }
}

/// Run a command on a worker thread; its result comes back on `done`.
fn spawn_execute(
    luns: Arc<Luns>,
    nexus: Nexus,
    task: ScsiTask,
    done: mpsc::UnboundedSender<Finished>,
) {
    tokio::task::spawn_blocking(move || {
        let r = luns.execute(&nexus, &task);
        let _ = done.send((task.itt, task.lun, r));
    });
}

/// A command run on a worker thread: its tag, LUN and result.
type Finished = (u32, u64, CommandResult);

/// A session whose volume moved to another site while it was logged in:
/// the initiator is asked once to log out (it logs in again at the old
/// portal, is redirected to the destination and issues its unanswered
/// commands there), and the connection closes if it has not by `deadline`.
/// Commands that fail here because of the move are withheld, never
/// answered with an error a guest would see.
#[derive(Default)]
struct Leaving {
    deadline: Option<tokio::time::Instant>,
    withheld: u64,
}

impl Leaving {
    fn ask(&mut self, session: &mut Session, out: &mut Vec<Pdu>) {
        if self.deadline.is_none() {
            tracing::info!(
                "the session's volume moved to another site: asking the initiator to log out"
            );
            out.push(session.request_logout(LOGOUT_WITHIN_S));
            self.deadline = Some(tokio::time::Instant::now() + LOGOUT_GRACE);
        }
    }

    /// Answer a finished command, or withhold it if the move failed it.
    fn settle(
        &mut self,
        session: &mut Session,
        luns: &Luns,
        (itt, lun, r): (u32, u64, &CommandResult),
        out: &mut Vec<Pdu>,
    ) {
        if luns.failed_by_move(lun, r) {
            session.withhold(itt);
            self.withheld += 1;
            self.ask(session, out);
        } else {
            session.complete(itt, r, out);
        }
    }
}

/// Start an admitted command: on this task after the batch is decoded
/// (`inline`), or on a worker thread.
fn admit(
    task: ScsiTask,
    luns: &Arc<Luns>,
    nexus: &Nexus,
    inline: &mut Vec<ScsiTask>,
    running: &mut usize,
    done: &mpsc::UnboundedSender<Finished>,
) {
    if luns
        .get(task.lun)
        .is_some_and(|l| inline_ok(&task, &l.unit))
    {
        // Run after the rest of this batch is decoded, so an ABORT TASK
        // right behind it still counts.
        inline.push(task);
        return;
    }
    *running += 1;
    spawn_execute(luns.clone(), nexus.clone(), task, done.clone());
}

/// The full feature phase between two socket events: the protocol session,
/// the commands admitted, waiting or running, and what goes out next.
struct Phase<'a> {
    session: Session,
    luns: Arc<Luns>,
    nexus: &'a Nexus,
    budget: Budget,
    /// Charges of admitted READs until their answers go to the writer, and
    /// of answers ready to go with the next batch.
    held: HashMap<u32, Held>,
    answered: Vec<Held>,
    /// Commands waiting for budget, in arrival order; while any waits, no
    /// more PDUs are decoded or read.
    waiting: VecDeque<ScsiTask>,
    /// Commands to run on the connection task once the batch is decoded.
    inline: Vec<ScsiTask>,
    running: usize,
    done: mpsc::UnboundedSender<Finished>,
    out: Vec<Pdu>,
    events: Vec<Event>,
    ping_outstanding: u32,
    leaving: Leaving,
    closing: bool,
}

impl Phase<'_> {
    /// Decode and handle every whole PDU buffered, until a command has to
    /// wait for budget or the connection is to close.
    fn receive_buffered(
        &mut self,
        dec: &PduDecoder,
        buf: &mut BytesMut,
        targets: &PortalTargets<'_>,
    ) -> Result<(), ConnError> {
        while self.waiting.is_empty() && !self.closing {
            let Some(pdu) = dec.decode(buf)? else {
                break;
            };
            self.ping_outstanding = 0;
            self.session
                .receive(pdu, targets, &mut self.out, &mut self.events)?;
            let events = std::mem::take(&mut self.events);
            for ev in events {
                self.handle(ev);
            }
        }
        Ok(())
    }

    fn handle(&mut self, ev: Event) {
        match ev {
            Event::Execute(task) => {
                let charge = if self.waiting.is_empty() {
                    self.budget.try_charge(&task)
                } else {
                    None
                };
                match charge {
                    Some(charge) => self.admit(task, charge),
                    None => self.waiting.push_back(task),
                }
            }
            Event::Reset { function, lun } => {
                match (function, lun) {
                    (TmfFunction::LunReset, Some(n)) => {
                        if let Some(l) = self.luns.get(n) {
                            l.unit.reset(false, Some(self.nexus));
                        }
                    }
                    _ => {
                        for l in &self.luns.0 {
                            l.unit.reset(true, Some(self.nexus));
                        }
                    }
                }
                if function == TmfFunction::TargetColdReset {
                    self.closing = true;
                }
            }
            Event::Logout => self.closing = true,
        }
    }

    /// Start a command whose budget is charged.
    fn admit(&mut self, task: ScsiTask, charge: Option<Held>) {
        if let Some(h) = charge {
            self.held.insert(task.itt, h);
        }
        admit(
            task,
            &self.luns,
            self.nexus,
            &mut self.inline,
            &mut self.running,
            &self.done,
        );
    }

    /// Admit the first waiting command (its charge just granted) and every
    /// one after it that fits now.
    fn admit_waiting(&mut self, charge: Option<Held>) {
        if let Some(task) = self.waiting.pop_front() {
            self.admit(task, charge);
        }
        while let Some(charge) = self.waiting.front().and_then(|t| self.budget.try_charge(t)) {
            let task = self.waiting.pop_front().expect("front exists");
            self.admit(task, charge);
        }
    }

    /// Run the commands kept for the connection task: small reads the page
    /// cache holds (a miss goes to a worker thread) and quick commands.
    fn run_inline(&mut self) {
        for task in std::mem::take(&mut self.inline) {
            if self.session.is_aborted(task.itt) {
                self.session.discard(task.itt);
                self.held.remove(&task.itt);
                continue;
            }
            let r = if matches!(task.cdb.first(), Some(&(op::READ_10 | op::READ_16))) {
                match self.luns.try_read_nowait(self.nexus, &task) {
                    Some(r) => r,
                    None => {
                        self.running += 1;
                        spawn_execute(
                            self.luns.clone(),
                            self.nexus.clone(),
                            task,
                            self.done.clone(),
                        );
                        continue;
                    }
                }
            } else {
                self.luns.execute(self.nexus, &task)
            };
            self.answer((task.itt, task.lun, r));
        }
    }

    /// Answer (or withhold) a finished command; its charge goes back once
    /// the answer is written.
    fn answer(&mut self, (itt, lun, r): Finished) {
        self.leaving
            .settle(&mut self.session, &self.luns, (itt, lun, &r), &mut self.out);
        self.answered.extend(self.held.remove(&itt));
    }

    /// A command from a worker thread, and every other one already back.
    fn finished(&mut self, first: Finished, more: &mut mpsc::UnboundedReceiver<Finished>) {
        self.running -= 1;
        self.answer(first);
        while let Ok(f) = more.try_recv() {
            self.running -= 1;
            self.answer(f);
        }
    }

    /// The PDUs to send and the charges they release, if there are any.
    fn batch(&mut self, hd: bool, dd: bool) -> Option<HeldFrames> {
        if self.out.is_empty() && self.answered.is_empty() {
            return None;
        }
        let mut frames = Vec::with_capacity(self.out.len() * 2);
        for p in self.out.drain(..) {
            wire(&p, hd, dd, &mut frames);
        }
        Some(HeldFrames {
            frames,
            held: std::mem::take(&mut self.answered),
        })
    }

    /// Keepalive: ping an idle initiator; false once three pings went
    /// unanswered.
    fn ping(&mut self) -> bool {
        if self.ping_outstanding >= 3 {
            return false;
        }
        if self.running == 0 {
            self.ping_outstanding += 1;
            self.out.push(self.session.ping(self.ping_outstanding));
        }
        true
    }
}

#[allow(clippy::too_many_arguments)]
async fn full_feature(
    stream: TcpStream,
    mut buf: BytesMut,
    dec: PduDecoder,
    params: ferry_iscsi::SessionParams,
    luns: Arc<Luns>,
    nexus: &Nexus,
    targets: &PortalTargets<'_>,
    budget: Budget,
    shutdown: CancellationToken,
    mut moves: tokio::sync::watch::Receiver<u64>,
) -> Result<(), ConnError> {
    let (hd, dd) = (params.header_digest, params.data_digest);
    let (mut rd, wr) = stream.into_split();
    let (tx, rx) = mpsc::channel::<HeldFrames>(256);
    let writer = tokio::spawn(crate::net::write_loop(wr, rx));
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Finished>();
    let mut ph = Phase {
        session: Session::new(params),
        luns,
        nexus,
        budget,
        held: HashMap::new(),
        answered: Vec::new(),
        waiting: VecDeque::new(),
        inline: Vec::new(),
        running: 0,
        done: done_tx,
        out: Vec::new(),
        events: Vec::new(),
        ping_outstanding: 0,
        leaving: Leaving::default(),
        closing: false,
    };
    if ph.luns.any_moved() {
        ph.leaving.ask(&mut ph.session, &mut ph.out);
    }
    let mut idle = tokio::time::interval(KEEPALIVE);
    idle.tick().await;
    let mut result = Ok(());
    loop {
        if let Err(e) = ph.receive_buffered(&dec, &mut buf, targets) {
            result = Err(e);
            ph.closing = true;
        }
        ph.run_inline();
        if let Some(batch) = ph.batch(hd, dd) {
            if tx.send(batch).await.is_err() {
                break;
            }
        }
        if ph.closing {
            break;
        }
        buf.reserve(dec.wanted(&buf).max(64 * 1024));
        let next_cost = ph.waiting.front().map_or(0, |t| ph.budget.cost(t));
        tokio::select! {
            r = rd.read_buf(&mut buf), if ph.waiting.is_empty() => match r {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => { result = Err(e.into()); break; }
            },
            charge = ph.budget.charge(next_cost), if !ph.waiting.is_empty() => {
                ph.admit_waiting(charge);
            }
            Some(f) = done_rx.recv() => ph.finished(f, &mut done_rx),
            _ = idle.tick() => {
                if !ph.ping() {
                    result = Err(ConnError::Dead);
                    break;
                }
            }
            Ok(()) = moves.changed() => {
                if ph.luns.any_moved() {
                    ph.leaving.ask(&mut ph.session, &mut ph.out);
                }
            }
            () = sleep_until(ph.leaving.deadline) => {
                tracing::info!(withheld = ph.leaving.withheld, "the initiator did not log out after its volume moved: closing the connection");
                ph.closing = true;
            }
            () = shutdown.cancelled() => {
                // Ask the initiator to log out, then close.
                ph.out.push(ph.session.request_logout(0));
                ph.closing = true;
            }
        }
        if ph.closing {
            // Let running commands answer before the connection goes, for
            // a while: storage that does not answer (a cluster cut off)
            // must not keep the connection, which the initiator would
            // otherwise wait on instead of reconnecting elsewhere.
            let grace = tokio::time::sleep(CLOSE_GRACE);
            tokio::pin!(grace);
            while ph.running > 0 {
                tokio::select! {
                    f = done_rx.recv() => match f {
                        Some(f) => {
                            ph.running -= 1;
                            ph.answer(f);
                        }
                        None => break,
                    },
                    () = &mut grace => {
                        tracing::warn!(running = ph.running, "closing with commands unanswered: the storage did not answer in time (the initiator re-issues them)");
                        break;
                    }
                }
            }
            if let Some(batch) = ph.batch(hd, dd) {
                let _ = tx.send(batch).await;
            }
            break;
        }
    }
    // Commands still running finish on their threads; their answers have
    // nowhere to go.
    drop(tx);
    let _ = writer.await;
    result
}
