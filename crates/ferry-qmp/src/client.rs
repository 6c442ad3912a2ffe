//! A QMP connection over a unix socket: greeting and capability
//! negotiation, commands whose replies are matched by id (QEMU may answer
//! around events), and events delivered to whoever waits for them.
//!
//! A reader task owns the socket's read half: it routes each return or
//! error to the command waiting for that id, and broadcasts every event.
//! Events are also kept (the last [`EVENT_BACKLOG`]) so that a waiter that
//! subscribes just after an event still sees it: `wait_event` looks at the
//! backlog from a mark taken before the command that causes the event.

use crate::wire::{command, Event, Greeting, LineDecoder, ServerMessage, WireError};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::{oneshot, watch};

/// Events kept for late waiters.
pub const EVENT_BACKLOG: usize = 256;
/// How long a command may take before it is given up on.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Error)]
pub enum QmpError {
    #[error("QMP socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("QMP: {0}")]
    Wire(#[from] WireError),
    #[error("QMP: expected the greeting, got {0}")]
    NoGreeting(String),
    /// QEMU refused the command.
    #[error("QEMU refused {command}: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    #[error("QMP: no answer to {0} in time")]
    Timeout(String),
    #[error("QMP: the connection closed")]
    Closed,
    #[error("QMP: answer to {command} does not decode: {detail}")]
    Decode { command: String, detail: String },
}

type Pending = HashMap<u64, oneshot::Sender<Result<Value, (String, String)>>>;

struct Shared {
    pending: Mutex<Pending>,
    /// Every event seen, numbered; `seq` counts them.
    events: Mutex<VecDeque<(u64, Event)>>,
    seq: watch::Sender<u64>,
    closed: watch::Sender<bool>,
}

/// A connected, negotiated QMP session.
pub struct QmpClient {
    greeting: Greeting,
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    next_id: AtomicU64,
    shared: Arc<Shared>,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for QmpClient {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// A position in the event stream (see [`QmpClient::mark`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct EventMark(u64);

impl QmpClient {
    /// Connect to QEMU's `-qmp unix:PATH,server=on` socket and negotiate.
    pub async fn connect(path: &Path) -> Result<QmpClient, QmpError> {
        let stream = UnixStream::connect(path).await?;
        let (mut rd, wr) = stream.into_split();
        let mut dec = LineDecoder::new();
        let mut buf = vec![0u8; 64 << 10];
        let greeting = loop {
            if let Some(m) = dec.next_message()? {
                match m {
                    ServerMessage::Greeting(g) => break g,
                    other => return Err(QmpError::NoGreeting(format!("{other:?}"))),
                }
            }
            let n = tokio::time::timeout(COMMAND_TIMEOUT, rd.read(&mut buf))
                .await
                .map_err(|_| QmpError::Timeout("greeting".into()))??;
            if n == 0 {
                return Err(QmpError::Closed);
            }
            dec.feed(&buf[..n]);
        };
        let shared = Arc::new(Shared {
            pending: Mutex::new(HashMap::new()),
            events: Mutex::new(VecDeque::new()),
            seq: watch::channel(0).0,
            closed: watch::channel(false).0,
        });
        let sh = shared.clone();
        let reader = tokio::spawn(async move {
            let r = read_loop(rd, dec, buf, &sh).await;
            if let Err(e) = r {
                tracing::debug!(error = %e, "QMP reader ended");
            }
            sh.closed.send_replace(true);
            // Whoever still waits learns the connection is gone.
            sh.pending.lock().map(|mut p| p.clear()).ok();
        });
        let c = QmpClient {
            greeting,
            writer: tokio::sync::Mutex::new(wr),
            next_id: AtomicU64::new(1),
            shared,
            reader,
        };
        c.execute_value("qmp_capabilities", None).await?;
        Ok(c)
    }

    /// What QEMU said it is.
    pub fn greeting(&self) -> &Greeting {
        &self.greeting
    }

    /// Run a command and return its raw answer.
    pub async fn execute_value(
        &self,
        name: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.shared
            .pending
            .lock()
            .map_err(|_| QmpError::Closed)?
            .insert(id, tx);
        if *self.shared.closed.borrow() {
            return Err(QmpError::Closed);
        }
        {
            let mut w = self.writer.lock().await;
            w.write_all(&command(name, arguments.as_ref(), id)).await?;
        }
        match tokio::time::timeout(COMMAND_TIMEOUT, rx).await {
            Err(_) => {
                if let Ok(mut p) = self.shared.pending.lock() {
                    p.remove(&id);
                }
                Err(QmpError::Timeout(name.into()))
            }
            Ok(Err(_)) => Err(QmpError::Closed),
            Ok(Ok(Ok(v))) => Ok(v),
            Ok(Ok(Err((class, desc)))) => Err(QmpError::Command {
                command: name.into(),
                class,
                desc,
            }),
        }
    }

    /// Run a command and decode its answer.
    pub async fn execute<T: DeserializeOwned>(
        &self,
        name: &str,
        arguments: Option<Value>,
    ) -> Result<T, QmpError> {
        let v = self.execute_value(name, arguments).await?;
        serde_json::from_value(v).map_err(|e| QmpError::Decode {
            command: name.into(),
            detail: e.to_string(),
        })
    }

    /// Before the first event of the session: every event kept is after it.
    pub fn origin(&self) -> EventMark {
        EventMark(0)
    }

    /// The current end of the event stream: events after it are "new".
    pub fn mark(&self) -> EventMark {
        EventMark(*self.shared.seq.borrow())
    }

    /// Wait until an event after `since` satisfies `pred`, at most `limit`.
    pub async fn wait_event(
        &self,
        since: EventMark,
        limit: Duration,
        mut pred: impl FnMut(&Event) -> bool,
    ) -> Result<Event, QmpError> {
        let mut seq = self.shared.seq.subscribe();
        let mut closed = self.shared.closed.subscribe();
        let mut from = since.0;
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Ok(ev) = self.shared.events.lock() {
                for (n, e) in ev.iter() {
                    if *n > from && pred(e) {
                        return Ok(e.clone());
                    }
                }
                from = ev.back().map_or(from, |(n, _)| (*n).max(from));
            }
            if *closed.borrow() {
                return Err(QmpError::Closed);
            }
            tokio::select! {
                r = seq.changed() => if r.is_err() { return Err(QmpError::Closed) },
                _ = closed.changed() => {}
                () = tokio::time::sleep_until(deadline) => {
                    return Err(QmpError::Timeout("an event".into()));
                }
            }
        }
    }

    /// Wait for the named event after `since`.
    pub async fn wait_named(
        &self,
        since: EventMark,
        name: &str,
        limit: Duration,
    ) -> Result<Event, QmpError> {
        self.wait_event(since, limit, |e| e.name == name).await
    }

    /// Wait until the connection is closed by QEMU (after `quit`).
    pub async fn closed(&self, limit: Duration) -> Result<(), QmpError> {
        let mut c = self.shared.closed.subscribe();
        tokio::time::timeout(limit, c.wait_for(|x| *x))
            .await
            .map_err(|_| QmpError::Timeout("the end of the session".into()))?
            .map_err(|_| QmpError::Closed)?;
        Ok(())
    }
}

async fn read_loop(
    mut rd: tokio::net::unix::OwnedReadHalf,
    mut dec: LineDecoder,
    mut buf: Vec<u8>,
    sh: &Shared,
) -> Result<(), QmpError> {
    loop {
        while let Some(m) = dec.next_message()? {
            match m {
                ServerMessage::Return { id, value } => reply(sh, id, Ok(value)),
                ServerMessage::Error { id, class, desc } => reply(sh, id, Err((class, desc))),
                ServerMessage::Event(e) => {
                    tracing::debug!(event = %e.name, "QMP event");
                    let n = *sh.seq.borrow() + 1;
                    if let Ok(mut ev) = sh.events.lock() {
                        ev.push_back((n, e));
                        while ev.len() > EVENT_BACKLOG {
                            ev.pop_front();
                        }
                    }
                    sh.seq.send_replace(n);
                }
                ServerMessage::Greeting(_) => {
                    return Err(QmpError::Wire(WireError::Unknown(
                        "a second greeting".into(),
                    )))
                }
            }
        }
        let n = rd.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        dec.feed(&buf[..n]);
    }
}

fn reply(sh: &Shared, id: Option<Value>, r: Result<Value, (String, String)>) {
    let Some(id) = id.and_then(|v| v.as_u64()) else {
        tracing::warn!("QMP answer without an id of ours; dropped");
        return;
    };
    let tx = sh.pending.lock().ok().and_then(|mut p| p.remove(&id));
    if let Some(tx) = tx {
        let _ = tx.send(r);
    }
}
