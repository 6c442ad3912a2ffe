//! Writes through librbd's asynchronous API: the write is queued to librbd
//! on the caller's thread and its end wakes the caller's task from
//! librbd's own thread, so a server's event loop writes an image without a
//! thread of its own per write (`rbd_aio_write2`, `rbd_aio_create_completion`).

use crate::ffi::{self, CompletionT};
use crate::{api, Cluster, Image, RbdError, Result};
use bytes::Bytes;
use std::ffi::c_void;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

/// What librbd's callback and the waiting future share.
#[derive(Default)]
struct Slot {
    /// librbd's return value, once the write ended.
    done: Option<isize>,
    waker: Option<Waker>,
}

/// Owned by librbd from the write's start to its callback: the data it
/// reads (kept alive even if the future is dropped) and the slot.
struct InFlight {
    _data: Bytes,
    slot: Arc<Mutex<Slot>>,
}

/// librbd's completion callback: take the result, free the completion and
/// the request, wake the waiter. Never unwinds into C.
unsafe extern "C" fn finished(c: CompletionT, arg: *mut c_void) {
    let Ok(api) = api() else { return };
    // SAFETY: `c` is the completion this request made; librbd calls back
    // once, after which it is ours to release.
    let r = unsafe { (api.rbd_aio_get_return_value)(c) };
    // SAFETY: as above; nothing uses `c` after this.
    unsafe { (api.rbd_aio_release)(c) };
    // SAFETY: `arg` is the `Box<InFlight>` leaked at the start, given back
    // exactly once, here.
    let inflight = unsafe { Box::from_raw(arg.cast::<InFlight>()) };
    let waker = {
        let mut s = inflight.slot.lock().unwrap_or_else(PoisonError::into_inner);
        s.done = Some(r);
        s.waker.take()
    };
    drop(inflight);
    if let Some(w) = waker {
        w.wake();
    }
}

/// A write in flight: resolves when librbd acknowledged it (the OSDs'
/// journals have it, as with [`Image::write_at`]).
pub struct AioWrite {
    slot: Arc<Mutex<Slot>>,
    /// `pool/image`, for an error.
    target: Arc<str>,
    /// The client it went through (notes a refusal that fences it).
    cluster: Arc<Cluster>,
}

impl Future for AioWrite {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let mut s = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
        match s.done {
            // librbd answers a whole write's success with 0 (or its length).
            Some(r) if r >= 0 => Poll::Ready(Ok(())),
            Some(r) => Poll::Ready(Err(RbdError::Io {
                op: "write",
                target: self.target.to_string(),
                source: self.cluster.call_error(r),
            })),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl Image {
    /// Start writing `data` at `offset` without waiting: the returned
    /// future ends when librbd does. The data stays alive until librbd is
    /// done with it, whether or not the future is still awaited.
    pub fn write_async(&self, data: Bytes, offset: u64) -> Result<AioWrite> {
        let api = api()?;
        let slot = Arc::new(Mutex::new(Slot::default()));
        let (ptr, len) = (data.as_ptr(), data.len());
        let arg = Box::into_raw(Box::new(InFlight {
            _data: data,
            slot: slot.clone(),
        }));
        let mut c: CompletionT = std::ptr::null_mut();
        // SAFETY: `arg` stays valid until the callback frees it; `c` is an
        // out-pointer to a local.
        let r = unsafe {
            (api.rbd_aio_create_completion)(arg.cast(), finished as ffi::AioCallback, &mut c)
        };
        if r < 0 {
            // SAFETY: no completion holds `arg`: it is still ours.
            drop(unsafe { Box::from_raw(arg) });
            return Err(self.io("write", r));
        }
        // SAFETY: an open handle; `ptr..ptr+len` is the `Bytes` that `arg`
        // owns, alive until the callback; `c` is a fresh completion.
        let r = unsafe { (api.rbd_aio_write2)(self.handle, offset, len, ptr.cast(), c, 0) };
        if r < 0 {
            // Not queued: librbd will not call back.
            // SAFETY: the completion and `arg` are ours again.
            unsafe { (api.rbd_aio_release)(c) };
            // SAFETY: as above.
            drop(unsafe { Box::from_raw(arg) });
            return Err(self.io("write", r));
        }
        Ok(AioWrite {
            slot,
            target: self.spec_shared(),
            cluster: self.cluster().clone(),
        })
    }
}
