//! The pool as an NBD backend for `ferry_nbd_server`: the catalog is the
//! pool's exported volumes, and a connection's handler is its
//! [`ConnContext`], which answers small requests inline, has the kernel
//! send large cached READs from the file, tries large page-cache I/O
//! without blocking, writes RBD images through librbd's
//! asynchronous API, and sends the rest to the blocking pool.

use super::catalog::PoolCatalog;
use super::exec::{self, ConnContext};
use crate::ServerState;
use ferry_nbd::consts::CMD_FLAG_FUA;
use ferry_nbd::{Command, ExportCatalog, Negotiated, Request};
use ferry_nbd_server::{Dispatch, ExportHandler, NbdBackend, ReplyBudget};
use std::sync::Arc;
use tokio::sync::Semaphore;

/// The daemon's pool, served over NBD; `total` is the reply budget all its
/// connections share.
pub struct PoolBackend {
    pub state: Arc<ServerState>,
    pub total: Arc<Semaphore>,
}

impl PoolBackend {
    /// The budget shared by every connection of this daemon.
    pub fn total_budget(state: &ServerState) -> Arc<Semaphore> {
        let c = &state.config.nbd;
        crate::net::shared_budget(c.max_queued_bytes, c.max_queued_bytes_total)
    }
}

impl NbdBackend for PoolBackend {
    type Handler = ConnContext;

    fn catalog(&self) -> Box<dyn ExportCatalog + '_> {
        Box::new(PoolCatalog(&self.state.pool))
    }

    fn open(&self, neg: &Negotiated) -> Result<Arc<ConnContext>, String> {
        let volume = self
            .state
            .pool
            .get(&neg.export.name)
            .map_err(|e| e.to_string())?;
        Ok(Arc::new(ConnContext::new(volume, neg, &self.state)))
    }

    fn max_in_flight(&self) -> usize {
        self.state.config.nbd.max_in_flight
    }

    fn reply_budget(&self) -> ReplyBudget {
        ReplyBudget {
            per_connection: self.state.config.nbd.max_queued_bytes,
            total: Some(self.total.clone()),
        }
    }

    fn extended_headers(&self) -> bool {
        self.state.config.nbd.extended_headers
    }
}

impl ExportHandler for ConnContext {
    fn dispatch(self: &Arc<Self>, req: Request) -> Dispatch {
        if let Some(reply) = exec::try_inline(self, &req) {
            return Dispatch::Ready(reply);
        }
        let pieces = match exec::try_file_reply(self, &req) {
            exec::FileReply::Ready(head, range) => return Dispatch::ReadyFile(head, range),
            exec::FileReply::Sparse(pieces) => Some(pieces),
            exec::FileReply::Elsewhere => None,
        };
        let ctx = self.clone();
        if self.writes_async(&req) {
            return Dispatch::Async(Box::pin(exec::write_async(ctx, req)));
        }
        if self.may_try_nowait(&req) {
            return Dispatch::Async(Box::pin(async move {
                if let Some(r) = exec::try_large_nowait(&ctx, &req, pieces) {
                    return r;
                }
                exec::execute_on_thread(ctx, req).await
            }));
        }
        // Buffered writes without FUA are quick once on a thread: batch
        // them with their neighbours (one hand-off for a pipeline of them).
        if req.command == Command::Write && !req.has_flag(CMD_FLAG_FUA) && !self.writes_wait() {
            let bytes = req.payload.as_ref().map_or(0, |p| p.len());
            return Dispatch::Batchable {
                work: Box::new(move || exec::execute_blocking(&ctx, &req)),
                bytes,
            };
        }
        Dispatch::Blocking(Box::new(move || exec::execute_blocking(&ctx, &req)))
    }
}
