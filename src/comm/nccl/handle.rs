//! One NCCL communicator, nonblocking: every call that NCCL leaves in progress is polled to its
//! end under the rank's watch, so no wait lacks a deadline, and a communicator that failed or
//! whose wait ran out is aborted, never destroyed (destroying waits for peers). Every use of
//! the handle pins it ([`Pin`]): an abort from another thread (the watchdog, the caller's abort)
//! never frees it under a use, and never waits for one.

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

/// The raw handle, and its uses and end.
struct Shared {
    raw: ncclComm_t,
    uses: Mutex<Uses>,
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
// uses the communicator; `uses` keeps every use from meeting the handle's end.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    fn uses(&self) -> MutexGuard<'_, Uses> {
        // `Uses`' methods change a few fields and call nothing that panics.
        crate::sync::lock(&self.uses)
    }
}

/// Who uses a communicator's handle now, and whether it ended: a use pins it; an abort, from
/// any thread, ends it at once for new uses and is carried out by whoever is last, the aborter
/// (no use under way) or the last use's end. So no use meets a freed handle, and no abort
/// waits for a use.
#[derive(Debug)]
struct Uses {
    ended: bool,
    pins: usize,
    /// An abort asked during a use, for the last use's end.
    abort_due: bool,
}

impl Uses {
    fn new(live: bool) -> Uses {
        Uses {
            ended: !live,
            pins: 0,
            abort_due: false,
        }
    }

    /// A use begins; refused once the handle ended.
    fn pin(&mut self) -> bool {
        if self.ended {
            return false;
        }
        self.pins += 1;
        true
    }

    /// A use ends: whether an abort is now the caller's to carry out.
    fn unpin(&mut self) -> bool {
        self.pins = self.pins.saturating_sub(1);
        self.pins == 0 && std::mem::take(&mut self.abort_due)
    }

    /// An abort is asked: whether it is the caller's to carry out now; with a use under way,
    /// that use's end carries it out; nothing where the handle already ended.
    fn abort(&mut self) -> bool {
        if std::mem::replace(&mut self.ended, true) {
            return false;
        }
        self.abort_due = self.pins > 0;
        !self.abort_due
    }

    /// The owner's orderly end (a destroy), with no use under way: whether it is the caller's.
    fn end(&mut self) -> bool {
        if self.ended || self.pins > 0 {
            return false;
        }
        self.ended = true;
        true
    }
}

/// A use of a communicator's handle under way: the handle is not freed until it ends, and an
/// abort asked meanwhile is carried out at its end.
pub(super) struct Pin {
    nccl: &'static Nccl,
    shared: Arc<Shared>,
}

impl Pin {
    pub(super) fn raw(&self) -> ncclComm_t {
        self.shared.raw
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        if self.shared.uses().unpin() {
            // SAFETY: the handle ended for every other use, and no use is under way; aborted once.
            let _ = unsafe { (self.nccl.comm_abort)(self.shared.raw) };
        }
    }
}

/// A use of `shared`, unless its handle ended.
fn pin(nccl: &'static Nccl, shared: &Arc<Shared>) -> Option<Pin> {
    shared.uses().pin().then(|| Pin {
        nccl,
        shared: Arc::clone(shared),
    })
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
    /// thread: no use begins after it, and a use under way carries it out when it ends.
    pub(super) fn abort(&self) {
        let now = self.shared.uses().abort();
        if now {
            // SAFETY: the handle ended for every use, none is under way, and it is aborted once;
            // an error here leaves nothing to do.
            let _ = unsafe { (self.nccl.comm_abort)(self.shared.raw) };
        }
    }

    /// The communicator's asynchronous error, if it has one; `None` once it is gone.
    pub(super) fn failure(&self) -> Option<Error> {
        let use_ = pin(self.nccl, &self.shared)?;
        let mut state: NcclStatus = 0;
        // SAFETY: the handle is pinned; writes one status.
        let status = unsafe { (self.nccl.comm_get_async_error)(use_.raw(), &mut state) };
        let state = if status != 0 { status } else { state };
        if state == 0 || state == NCCL_IN_PROGRESS {
            return None;
        }
        self.nccl
            .check("ncclCommGetAsyncError", state, use_.raw())
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
        let parent = self.pin("ncclCommSplit")?;
        let mut config = NcclConfig::nonblocking();
        let slot = slot();
        // SAFETY: the parent is pinned; NCCL writes one handle into the slot when the split ends
        // (a slot that outlives the split: `Split::wait`) and copies the config.
        let status =
            unsafe { (self.nccl.comm_split)(parent.raw(), color, key, slot.as_ptr(), &mut config) };
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
        let use_ = self.pin("ncclCommUserRank")?;
        let (mut rank, mut count): (c_int, c_int) = (0, 0);
        // SAFETY: the handle is pinned and ready; each call writes one int.
        let status = unsafe { (self.nccl.comm_user_rank)(use_.raw(), &mut rank) };
        self.check("ncclCommUserRank", status)?;
        // SAFETY: as above.
        let status = unsafe { (self.nccl.comm_count)(use_.raw(), &mut count) };
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
                uses: Mutex::new(Uses::new(!raw.is_null())),
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

    /// A use of the handle for `call`, unless it was aborted: hold it while NCCL may read the
    /// handle (a call, or a group of calls until the group ended).
    pub(super) fn pin(&self, call: &'static str) -> Result<Pin> {
        pin(self.nccl, &self.shared).ok_or(Error::Nccl {
            call,
            code: NCCL_INVALID_USAGE,
            message: "the communicator was aborted after a failure".into(),
        })
    }

    /// NCCL's asynchronous state of the communicator: `Ok(true)` while a call is in progress,
    /// `Ok(false)` when idle and healthy, the error once it failed.
    pub(super) fn in_progress(&self, call: &'static str) -> Result<bool> {
        let use_ = self.pin(call)?;
        let mut state: NcclStatus = 0;
        // SAFETY: the handle is pinned; writes one status.
        let status = unsafe { (self.nccl.comm_get_async_error)(use_.raw(), &mut state) };
        drop(use_);
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
        let use_ = self.pin(call).ok();
        let comm = use_.as_ref().map_or(std::ptr::null_mut(), Pin::raw);
        self.nccl.check(call, status, comm)
    }

    /// Ends the communicator at once (`ncclCommAbort`): its kernels stop, its peers are left
    /// to their own deadlines.
    pub(super) fn abort(&self) {
        self.probe().abort();
    }

    /// Ends the communicator in order (`ncclCommFinalize`, then `ncclCommDestroy`), waiting for
    /// its work under `watch`; aborts it when that fails. Whether it ended in order.
    pub(super) fn close(&self, watch: &Watch) -> bool {
        let Ok(use_) = self.pin("ncclCommFinalize") else {
            return false;
        };
        // SAFETY: the handle is pinned.
        let status = unsafe { (self.nccl.comm_finalize)(use_.raw()) };
        drop(use_);
        let finalized = self.settle("ncclCommFinalize", status, watch, || {
            "NCCL's finalize of the communicator".into()
        });
        if finalized.is_err() {
            return false;
        }
        if self.shared.uses().end() {
            // SAFETY: the handle ended for every use, none is under way; finalized, destroyed
            // once.
            let _ = unsafe { (self.nccl.comm_destroy)(self.shared.raw) };
            return true;
        }
        // A use still under way (none is, from the owner's drop): it aborts the handle.
        self.abort();
        false
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

#[cfg(test)]
mod tests {
    use super::Uses;

    #[test]
    fn an_abort_during_a_use_is_carried_out_by_the_last_use_s_end_and_once() {
        let mut uses = Uses::new(true);
        assert!(uses.pin() && uses.pin());
        // Asked from another thread: no use begins after it, and the aborter frees nothing.
        assert!(!uses.abort());
        assert!(!uses.pin());
        assert!(!uses.abort(), "a second abort is nobody's");
        assert!(!uses.unpin(), "a use is still under way");
        assert!(uses.unpin(), "the last use's end carries the abort out");
        assert!(!uses.unpin() && !uses.end());
    }

    #[test]
    fn an_abort_with_no_use_under_way_is_the_aborter_s_and_ends_every_use() {
        let mut uses = Uses::new(true);
        assert!(uses.pin());
        assert!(!uses.unpin(), "no abort was asked");
        assert!(uses.abort());
        assert!(!uses.pin() && !uses.abort() && !uses.end());
        // A handle NCCL never made has no use and no end to carry out.
        let mut none = Uses::new(false);
        assert!(!none.pin() && !none.abort() && !none.end());
    }

    #[test]
    fn the_owner_s_orderly_end_waits_for_no_use_and_is_refused_during_one() {
        let mut uses = Uses::new(true);
        assert!(uses.pin());
        assert!(!uses.end(), "a use is under way");
        assert!(!uses.unpin());
        assert!(uses.end());
        assert!(!uses.pin() && !uses.abort());
    }
}
