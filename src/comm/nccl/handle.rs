//! One NCCL communicator, nonblocking: every call that NCCL leaves in progress is polled to its
//! end under the rank's watch, so no wait lacks a deadline, and a communicator that failed or
//! whose wait ran out is aborted, never destroyed (destroying waits for peers).

use std::ffi::c_int;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cudarc::nccl::sys::{ncclComm, ncclComm_t, ncclUniqueId};

use super::library::{NCCL_IN_PROGRESS, Nccl, NcclConfig, NcclStatus};
use crate::error::{Error, Result};
use crate::watch::Watch;

/// How long a poll of a call in progress sleeps between looks.
const POLL: Duration = Duration::from_micros(50);

pub(super) struct Handle {
    nccl: &'static Nccl,
    shared: Arc<Shared>,
}

/// The raw handle, and whether it is still live (not aborted or destroyed): the lock orders an
/// abort against a watchdog's look from another thread.
struct Shared {
    raw: ncclComm_t,
    live: Mutex<bool>,
    /// Where NCCL wrote the handle: a nonblocking init or split writes it again when it ends,
    /// from NCCL's own thread, so the place lives as long as the handle.
    _slot: Slot,
}

/// A place for NCCL to write a communicator handle into.
type Slot = Box<AtomicPtr<ncclComm>>;

fn slot() -> Slot {
    Box::new(AtomicPtr::new(std::ptr::null_mut()))
}

// SAFETY: NCCL allows `ncclCommGetAsyncError` and `ncclCommAbort` from any thread while another
// uses the communicator; `live`'s lock keeps a look from racing the handle's end.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    fn live(&self) -> MutexGuard<'_, bool> {
        self.live
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A split under way: the place NCCL writes the new handle into, and the call's status.
pub(super) struct Split {
    /// Taken by [`Split::wait`] once NCCL is done with it; a split dropped before leaves it to
    /// NCCL (leaked), which may still write there.
    slot: Option<Slot>,
    status: NcclStatus,
}

impl Drop for Split {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            std::mem::forget(slot);
        }
    }
}

impl Split {
    /// Waits under `watch` for the split `parent` started, until the parent is idle again: NCCL
    /// writes the new handle before it marks the parent's split done, even when the split
    /// failed, so only then is the handle (or the parent's error) the outcome.
    pub(super) fn wait(
        mut self,
        parent: &Handle,
        watch: &Watch,
        op: impl Fn() -> String,
    ) -> Result<Handle> {
        let started = match self.status {
            0 | NCCL_IN_PROGRESS => Ok(()),
            failed => parent.check("ncclCommSplit", failed),
        };
        let mut parent_failed = false;
        let done = started.and_then(|()| {
            watch.poll(POLL, &op, || {
                let idle = parent.in_progress("ncclCommSplit").map(|busy| !busy);
                parent_failed = idle.is_err();
                idle
            })
        });
        if let Err(e) = done {
            if parent_failed {
                // The split ended (in failure): a child NCCL made regardless is aborted with
                // its handle.
                if let Some(slot) = self.slot.take() {
                    let _child = Handle::made(parent.nccl, slot, "ncclCommSplit", 0);
                }
            }
            // Aborting the parent ends a split still under way; `Drop` leaves its slot to NCCL.
            parent.abort();
            return Err(e);
        }
        match self.slot.take() {
            Some(slot) => Handle::made(parent.nccl, slot, "ncclCommSplit", 0),
            None => Err(Error::Nccl {
                call: "ncclCommSplit",
                code: NCCL_INTERNAL_ERROR,
                message: "the split was waited for twice".into(),
            }),
        }
    }
}

/// A look at one communicator's asynchronous error from another thread.
pub(super) struct Probe {
    nccl: &'static Nccl,
    shared: Arc<Shared>,
}

impl Probe {
    /// Ends the communicator at once (`ncclCommAbort`), as [`Handle::abort`] does, from any
    /// thread.
    pub(super) fn abort(&self) {
        let mut live = self.shared.live();
        if std::mem::replace(&mut *live, false) {
            // SAFETY: the handle is live and is aborted once; an error here leaves nothing to do.
            let _ = unsafe { (self.nccl.comm_abort)(self.shared.raw) };
        }
    }

    /// The communicator's asynchronous error, if it has one; `None` once it is gone.
    pub(super) fn failure(&self) -> Option<Error> {
        let live = self.shared.live();
        if !*live {
            return None;
        }
        let mut state: NcclStatus = 0;
        // SAFETY: the handle is live while the lock is held; writes one status.
        let status = unsafe { (self.nccl.comm_get_async_error)(self.shared.raw, &mut state) };
        let state = if status != 0 { status } else { state };
        if state == 0 || state == NCCL_IN_PROGRESS {
            return None;
        }
        self.nccl
            .check("ncclCommGetAsyncError", state, self.shared.raw)
            .err()
    }
}

impl Handle {
    /// Starts joining the group of `world` ranks named by `id` as `rank`, on the calling
    /// thread's current device; [`Handle::wait_ready`] waits for the others.
    pub(super) fn start_init(
        nccl: &'static Nccl,
        id: ncclUniqueId,
        rank: c_int,
        world: c_int,
    ) -> Result<Handle> {
        let mut config = NcclConfig::nonblocking();
        let slot = slot();
        // SAFETY: NCCL writes one handle into the slot (now, and again when the init ends), which
        // lives as long as the handle; it copies the config during the call.
        let status =
            unsafe { (nccl.comm_init_rank_config)(slot.as_ptr(), world, id, rank, &mut config) };
        Handle::made(nccl, slot, "ncclCommInitRankConfig", status)
    }

    /// Starts a communicator of the ranks that give the same `color`, ordered by `key`
    /// (`ncclCommSplit`), a collective of every rank; [`Split::wait`] waits for it.
    pub(super) fn start_split(&self, color: c_int, key: c_int) -> Result<Split> {
        let parent = self.raw("ncclCommSplit")?;
        let mut config = NcclConfig::nonblocking();
        let slot = slot();
        // SAFETY: the parent is live; NCCL writes one handle into the slot when the split ends
        // (a slot that outlives the split: `Split::wait`) and copies the config.
        let status =
            unsafe { (self.nccl.comm_split)(parent, color, key, slot.as_ptr(), &mut config) };
        Ok(Split {
            slot: Some(slot),
            status,
        })
    }

    /// Waits under `watch` until NCCL made the communicator `call` started.
    pub(super) fn wait_ready(
        &self,
        watch: &Watch,
        call: &'static str,
        op: impl Fn() -> String,
    ) -> Result<()> {
        self.settle(call, NCCL_IN_PROGRESS, watch, op)
    }

    /// The communicator's rank and number of ranks, as NCCL counts them.
    pub(super) fn place(&self) -> Result<(usize, usize)> {
        let raw = self.raw("ncclCommUserRank")?;
        let (mut rank, mut count): (c_int, c_int) = (0, 0);
        // SAFETY: the handle is live and ready; each call writes one int.
        let status = unsafe { (self.nccl.comm_user_rank)(raw, &mut rank) };
        self.check("ncclCommUserRank", status)?;
        // SAFETY: as above.
        let status = unsafe { (self.nccl.comm_count)(raw, &mut count) };
        self.check("ncclCommCount", status)?;
        match (usize::try_from(rank), usize::try_from(count)) {
            (Ok(rank), Ok(count)) if rank < count => Ok((rank, count)),
            _ => Err(Error::Nccl {
                call: "ncclCommUserRank",
                code: NCCL_INTERNAL_ERROR,
                message: format!("NCCL counts rank {rank} of {count}"),
            }),
        }
    }

    pub(super) fn nccl(&self) -> &'static Nccl {
        self.nccl
    }

    /// The handle NCCL wrote, unless the call that made it failed at once.
    fn made(
        nccl: &'static Nccl,
        slot: Slot,
        call: &'static str,
        status: NcclStatus,
    ) -> Result<Handle> {
        let raw = slot.load(Ordering::SeqCst);
        let handle = Handle {
            nccl,
            shared: Arc::new(Shared {
                raw,
                live: Mutex::new(!raw.is_null()),
                _slot: slot,
            }),
        };
        if status != NCCL_IN_PROGRESS {
            // A handle made despite the failure is aborted there.
            handle.check(call, status)?;
        }
        if raw.is_null() {
            return Err(Error::Nccl {
                call,
                code: NCCL_INTERNAL_ERROR,
                message: "NCCL returned no communicator".into(),
            });
        }
        Ok(handle)
    }

    /// A look at the communicator's asynchronous error for another thread.
    pub(super) fn probe(&self) -> Probe {
        Probe {
            nccl: self.nccl,
            shared: Arc::clone(&self.shared),
        }
    }

    /// The raw handle for `call`, unless it was aborted.
    pub(super) fn raw(&self, call: &'static str) -> Result<ncclComm_t> {
        match *self.shared.live() {
            true => Ok(self.shared.raw),
            false => Err(Error::Nccl {
                call,
                code: NCCL_INVALID_USAGE,
                message: "the communicator was aborted after a failure".into(),
            }),
        }
    }

    /// NCCL's asynchronous state of the communicator: `Ok(true)` while a call is in progress,
    /// `Ok(false)` when idle and healthy, the error once it failed.
    pub(super) fn in_progress(&self, call: &'static str) -> Result<bool> {
        let raw = self.raw(call)?;
        let mut state: NcclStatus = 0;
        // SAFETY: the handle is live; writes one status.
        let status = unsafe { (self.nccl.comm_get_async_error)(raw, &mut state) };
        self.check("ncclCommGetAsyncError", status)?;
        if state == NCCL_IN_PROGRESS {
            return Ok(true);
        }
        self.check(call, state).map(|()| false)
    }

    /// The result of `call`, which returned `status`: for `ncclInProgress`, polled under `watch`
    /// until NCCL ends it; the handle is aborted on a failure or when the wait ends early.
    pub(super) fn settle(
        &self,
        call: &'static str,
        status: NcclStatus,
        watch: &Watch,
        op: impl Fn() -> String,
    ) -> Result<()> {
        if status != NCCL_IN_PROGRESS {
            return self.check(call, status);
        }
        let result = watch.poll(POLL, op, || self.in_progress(call).map(|busy| !busy));
        if result.is_err() {
            self.abort();
        }
        result
    }

    /// `status` as a result, NCCL's last error for the handle in the message; a failure
    /// aborts the handle.
    pub(super) fn check(&self, call: &'static str, status: NcclStatus) -> Result<()> {
        let result = self.status(call, status);
        if result.is_err() {
            self.abort();
        }
        result
    }

    /// As [`Handle::check`], leaving the handle as it is: for a call inside an NCCL group, whose
    /// communicators are aborted only once the group ended.
    pub(super) fn status(&self, call: &'static str, status: NcclStatus) -> Result<()> {
        let comm = self.raw(call).unwrap_or(std::ptr::null_mut());
        self.nccl.check(call, status, comm)
    }

    /// Ends the communicator at once (`ncclCommAbort`): its kernels stop, its peers are left
    /// to their own deadlines.
    pub(super) fn abort(&self) {
        self.probe().abort();
    }

    /// Ends the communicator in order (`ncclCommFinalize`, then `ncclCommDestroy`), waiting for
    /// its work under `watch`; aborts it when that fails.
    pub(super) fn close(&self, watch: &Watch) {
        let Ok(raw) = self.raw("ncclCommFinalize") else {
            return;
        };
        // SAFETY: the handle is live.
        let status = unsafe { (self.nccl.comm_finalize)(raw) };
        let finalized = self.settle("ncclCommFinalize", status, watch, || {
            "NCCL's finalize of the communicator".into()
        });
        let mut live = self.shared.live();
        if finalized.is_ok() && std::mem::replace(&mut *live, false) {
            // SAFETY: the handle is live, finalized, and destroyed once.
            let _ = unsafe { (self.nccl.comm_destroy)(raw) };
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // A handle is closed by its owner; one dropped without that (a failed init) is aborted.
        self.abort();
    }
}

/// `ncclInternalError`.
const NCCL_INTERNAL_ERROR: i32 = 3;

/// `ncclInvalidUsage`.
const NCCL_INVALID_USAGE: i32 = 5;
