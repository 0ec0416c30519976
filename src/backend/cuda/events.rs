//! Events without timing, made once and used again: marking a point of a stream costs one
//! `cuEventRecord`, not an event made before it and destroyed after its last use.
//!
//! Using an event again is safe because the driver reads an event's state when it is used: a
//! `cuStreamWaitEvent` waits for the record current at the call, and only a holder of the
//! [`PooledEvent`] queries or waits on it, so no one looks at it once it is back in the pool.

use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use super::driver::cuda;
use crate::error::Result;
// A free list: a panic while it is held leaves at worst an event too few.
use crate::sync::lock;

/// At most this many events wait in a pool; more are destroyed. A step holds a few per group in
/// flight, so this covers any pipeline's depth without keeping many events past a burst.
const KEPT: usize = 1024;

/// The events of one context, free for the next record.
#[derive(Debug, Default)]
pub(crate) struct EventPool(Mutex<Vec<CudaEvent>>);

impl EventPool {
    /// Records the current end of `stream`'s work in an event of the pool (made when none is
    /// free).
    pub(crate) fn record(
        self: &Arc<Self>,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
    ) -> Result<PooledEvent> {
        // A panic while the lock was held left at worst an event too few: make one.
        let reused = lock(&self.0).pop();
        let event = match reused {
            Some(event) => event,
            None => ctx.new_event(None).map_err(cuda("cuEventCreate"))?,
        };
        let pooled = PooledEvent {
            event: ManuallyDrop::new(event),
            pool: Some(Arc::clone(self)),
        };
        pooled.record(stream).map_err(cuda("cuEventRecord"))?;
        Ok(pooled)
    }

    fn give_back(&self, event: CudaEvent) {
        let mut free = lock(&self.0);
        if free.len() < KEPT {
            free.push(event);
        }
    }
}

/// An event that goes back to its pool when dropped (or is destroyed, for one made outside a
/// pool: a timed event).
#[derive(Debug)]
pub(crate) struct PooledEvent {
    event: ManuallyDrop<CudaEvent>,
    pool: Option<Arc<EventPool>>,
}

impl PooledEvent {
    /// An event of no pool, destroyed when dropped.
    pub(crate) fn unpooled(event: CudaEvent) -> PooledEvent {
        PooledEvent {
            event: ManuallyDrop::new(event),
            pool: None,
        }
    }
}

impl Deref for PooledEvent {
    type Target = CudaEvent;

    fn deref(&self) -> &CudaEvent {
        &self.event
    }
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is not used after.
        let event = unsafe { ManuallyDrop::take(&mut self.event) };
        match &self.pool {
            Some(pool) => pool.give_back(event),
            None => drop(event),
        }
    }
}
