//! The pool as an NBD backend for `ferry_nbd_server`: the catalog is the
//! pool's exported volumes, and a connection's handler is its
//! [`ConnContext`], which answers small requests inline, tries large
//! page-cache I/O without blocking, and sends the rest to the blocking pool.

use super::catalog::PoolCatalog;
use super::exec::{self, ConnContext};
use crate::ServerState;
use ferry_nbd::{ErrorCode, ExportCatalog, Negotiated, Request};
use ferry_nbd_server::{Dispatch, ExportHandler, NbdBackend};
use std::sync::Arc;

/// The daemon's pool, served over NBD.
pub struct PoolBackend(pub Arc<ServerState>);

impl NbdBackend for PoolBackend {
    type Handler = ConnContext;

    fn catalog(&self) -> Box<dyn ExportCatalog + '_> {
        Box::new(PoolCatalog(&self.0.pool))
    }

    fn open(&self, neg: &Negotiated) -> Result<Arc<ConnContext>, String> {
        let volume = self
            .0
            .pool
            .get(&neg.export.name)
            .map_err(|e| e.to_string())?;
        Ok(Arc::new(ConnContext::new(volume, neg, &self.0)))
    }

    fn max_in_flight(&self) -> usize {
        self.0.config.nbd.max_in_flight
    }
}

impl ExportHandler for ConnContext {
    fn dispatch(self: &Arc<Self>, req: Request) -> Dispatch {
        if let Some(reply) = exec::try_inline(self, &req) {
            return Dispatch::Ready(reply);
        }
        let ctx = self.clone();
        if self.may_try_nowait(&req) {
            return Dispatch::Async(Box::pin(async move {
                if let Some(r) = exec::try_large_nowait(&ctx, &req) {
                    return r;
                }
                let (c, fallback) = (ctx.clone(), req.clone());
                match tokio::task::spawn_blocking(move || exec::execute_blocking(&c, &req)).await {
                    Ok(r) => r,
                    Err(e) => exec::error_reply(&ctx, &fallback, ErrorCode::Io, &e.to_string()),
                }
            }));
        }
        Dispatch::Blocking(Box::new(move || exec::execute_blocking(&ctx, &req)))
    }
}
