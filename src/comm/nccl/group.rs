//! An NCCL group as a value: `ncclGroupStart` makes it, and it ends exactly once, by
//! [`NcclGroup::end`] or, on any other path (an early return, a panic, a communicator dropped in
//! the middle of a batch), by its drop, so no thread is left inside a group that would hold its
//! later collectives.

use super::library::{Nccl, NcclStatus};
use crate::error::Result;

/// An open NCCL group of the calling thread.
pub(super) struct NcclGroup {
    nccl: &'static Nccl,
    ended: bool,
}

impl NcclGroup {
    pub(super) fn start(nccl: &'static Nccl) -> Result<NcclGroup> {
        // SAFETY: starts a group that `end` or the drop ends.
        let status = unsafe { (nccl.group_start)() };
        nccl.check("ncclGroupStart", status, std::ptr::null_mut())?;
        Ok(NcclGroup { nccl, ended: false })
    }

    /// Ends the group; `ncclGroupEnd`'s status, which the caller settles (a nonblocking
    /// communicator answers `ncclInProgress` until its calls are queued).
    pub(super) fn end(mut self) -> NcclStatus {
        self.ended = true;
        // SAFETY: ends the group `start` began, once.
        unsafe { (self.nccl.group_end)() }
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        if !self.ended {
            // SAFETY: as in `end`. Its status goes with the path that dropped the group, which
            // already fails (the communicator is aborted or gone).
            unsafe { (self.nccl.group_end)() };
        }
    }
}
