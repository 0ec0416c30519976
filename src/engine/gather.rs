//! Gather slots, the placement of gathered groups, and the all-gathers.

use std::sync::Arc;

use super::{Engine, alloc, group_comm};
use crate::backend::{Backend, Region};
use crate::comm::{Communicator, Fingerprint, Purpose};
use crate::error::{Error, Result};
use crate::schedule::Schedule;
use crate::state::{GatherEffect, Gathers};
use crate::trace::SpanKind;
use crate::types::{BufferState, DType, Stream};

/// What gathering owns: the buffer machine, the unit order it prefetches by, the gather slots and
/// where each group's gathered values are.
pub(super) struct Gathering<Buf, E> {
    /// Each group's gathered buffer through FREED -> SYNCING -> USING -> READY.
    pub(super) machine: Gathers,
    pub(super) schedule: Schedule,
    pub(super) groups: Vec<GroupGather<E>>,
    pub(super) slots: Vec<Buf>,
    pub(super) free_slots: Vec<GatherSlot<E>>,
    /// The last write of the shards (the optimizer's, a load's), which the step's first gather
    /// waits for.
    pub(super) shards_updated: Option<E>,
    /// Reused between calls, so that a hook allocates nothing.
    pub(super) effects: Vec<GatherEffect>,
    pub(super) batch: GatherBatch<E>,
}

impl<Buf, E> Gathering<Buf, E> {
    /// Gathering for `groups` groups of `units` units, at most `limit` gathered at once, into
    /// `slots`.
    pub(super) fn new(groups: usize, units: usize, limit: usize, slots: Vec<Buf>) -> Self {
        let free_slots = (0..slots.len())
            .rev()
            .map(|buffer_index| GatherSlot {
                buffer_index,
                free_after: None,
            })
            .collect();
        Gathering {
            machine: Gathers::new(groups, limit),
            schedule: Schedule::new(units),
            groups: (0..groups)
                .map(|_| GroupGather {
                    placed: None,
                    gathered: None,
                    released: None,
                })
                .collect(),
            slots,
            free_slots,
            shards_updated: None,
            effects: Vec::new(),
            batch: GatherBatch::default(),
        }
    }
}

impl<Buf, E> Gathering<Buf, E> {
    /// Forgets every event kept: the last update of the shards, each group's and slot's
    /// uses. For where every stream's later work already follows every stream's work so far.
    pub(super) fn forget_events(&mut self) {
        self.shards_updated = None;
        for group in &mut self.groups {
            group.gathered = None;
            group.released = None;
            if let Some(Placement::Slot(slot)) = &mut group.placed {
                slot.free_after = None;
            }
        }
        for slot in &mut self.free_slots {
            slot.free_after = None;
        }
    }
}

/// One group's gathered values: where they are and the events around their use.
pub(super) struct GroupGather<E> {
    pub(super) placed: Option<Placement<E>>,
    /// The end of the group's gather, which compute waits for before the first use.
    pub(super) gathered: Option<Arc<E>>,
    /// Compute's last use, which the slot's next gather waits for.
    pub(super) released: Option<Arc<E>>,
}

/// Where a gathered group's values live.
pub(super) enum Placement<E> {
    Slot(GatherSlot<E>),
    /// At world size 1 the shard is the whole buffer: the view is the shard itself.
    Shard,
}

/// The gathers queued since the last wait, and the communicator whose batch began: the
/// process group's index, `Some(None)` for the data-parallel world's. A batch holds one
/// communicator's collectives.
pub(super) struct GatherBatch<E> {
    began: Option<Option<usize>>,
    /// Each group gathered, with its span's start when tracing and its collective (none where
    /// nothing travels).
    queued: Vec<(usize, Option<E>, Option<Fingerprint>)>,
}

impl<E> Default for GatherBatch<E> {
    fn default() -> Self {
        GatherBatch {
            began: None,
            queued: Vec::new(),
        }
    }
}

pub(super) struct GatherSlot<E> {
    pub(super) buffer_index: usize,
    /// Compute's last use of the group that held the slot.
    pub(super) free_after: Option<Arc<E>>,
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Makes unit `u`'s groups USING (gathering those FREED) and prefetches the unit predicted next.
    pub(super) fn use_unit(&mut self, u: usize) -> Result<()> {
        let mut fx = std::mem::take(&mut self.gathering.effects);
        fx.clear();
        let plan = Arc::clone(&self.plan);
        let mut result = Ok(());
        for &g in plan.unit_groups(u).unwrap_or_default() {
            if self.gathering.machine.state(g) == BufferState::Ready {
                self.counters.reuses += 1;
            }
            result = self.gathering.machine.acquire(g, &mut fx);
            if result.is_err() {
                break;
            }
        }
        if result.is_ok() && self.config.overlap {
            if let Some(next) = self.gathering.schedule.predict_next() {
                for &g in plan.unit_groups(next).unwrap_or_default() {
                    let before = fx.len();
                    match self.gathering.machine.prefetch(g, &mut fx) {
                        Ok(true) => self.counters.prefetches += (fx.len() > before) as u64,
                        Ok(false) => {}
                        Err(e) => {
                            result = Err(e);
                            break;
                        }
                    }
                }
            }
        }
        let applied = self.apply_gather_effects(&fx);
        self.gathering.effects = fx;
        result.and(applied)
    }

    /// One use of unit `u`'s groups ended on the compute stream.
    pub(super) fn release_unit(&mut self, u: usize) -> Result<()> {
        let plan = Arc::clone(&self.plan);
        let groups = plan.unit_groups(u).unwrap_or_default();
        // Compute's last use matters to the next gather into a group's slot only: a group whose
        // view is its shard (world size 1) is written next by the optimizer, on compute itself.
        let in_slot = groups
            .iter()
            .any(|&g| matches!(self.gathering.groups[g].placed, Some(Placement::Slot(_))));
        let done = match in_slot {
            true => Some(Arc::new(self.backend.record(Stream::Compute)?)),
            false => None,
        };
        for &g in groups {
            self.gathering.machine.release(g)?;
            self.gathering.groups[g].released = done.clone();
        }
        Ok(())
    }

    /// Applies `effects` in order; the gathers between two waits go to the communicator as one
    /// batch, and each group's gathered event is recorded after the batch's end.
    pub(super) fn apply_gather_effects(&mut self, effects: &[GatherEffect]) -> Result<()> {
        // Empty: every apply ends with `end_gathers`, which drains it.
        let mut batch = std::mem::take(&mut self.gathering.batch);
        let mut result = Ok(());
        for &effect in effects {
            result = match effect {
                GatherEffect::Evict(g) => {
                    if let Some(Placement::Slot(mut slot)) = self.gathering.groups[g].placed.take()
                    {
                        slot.free_after = self.gathering.groups[g].released.take();
                        self.gathering.free_slots.push(slot);
                    }
                    self.gathering.groups[g].gathered = None;
                    self.counters.evictions += 1;
                    Ok(())
                }
                GatherEffect::Gather(g) => self.gather(g, &mut batch),
                GatherEffect::Wait(g) => self.end_gathers(&mut batch).and_then(|()| {
                    match self.gathering.groups[g].gathered.take() {
                        Some(done) => self.backend.wait(Stream::Compute, &done),
                        None => Ok(()),
                    }
                }),
            };
            if result.is_err() {
                break;
            }
        }
        let ended = self.end_gathers(&mut batch);
        self.gathering.batch = batch;
        result.and(ended)
    }

    /// Ends the gathers queued since the last end: the communicator's batch, if one began, then
    /// each group's span and gathered event, which follow its collective on the gather stream.
    fn end_gathers(&mut self, batch: &mut GatherBatch<B::Event>) -> Result<()> {
        let mut result = match batch.began.take() {
            Some(process_group) => {
                group_comm(&mut self.comm, &mut self.process_groups, process_group)
                    .and_then(|comm| comm.end_batch(&self.backend))
            }
            None => Ok(()),
        };
        for (g, start, collective) in batch.queued.drain(..) {
            if result.is_ok() {
                let peers = self.peers(self.plan.groups()[g].process_group);
                result = self
                    .push_span(Stream::Gather, SpanKind::AllGather { group: g }, start)
                    .and_then(|()| {
                        self.record_collective(Stream::Gather, collective.map(|c| (c, peers)))
                    })
                    .map(|done| self.gathering.groups[g].gathered = Some(done));
            }
        }
        result
    }

    /// Queues group `g`'s gather into a slot; [`Engine::end_gathers`] completes it.
    fn gather(&mut self, g: usize, batch: &mut GatherBatch<B::Event>) -> Result<()> {
        self.counters.all_gathers += 1;
        let master_only = self.policy.master_only(g);
        if self.plan.world_size() == 1 && !master_only {
            self.gathering.groups[g].placed = Some(Placement::Shard);
            return Ok(());
        }
        // A batch holds one communicator's collectives: the previous one's go out before this
        // group's waits are queued behind them.
        let process_group = self.plan.groups()[g].process_group;
        if batch.began.is_some_and(|began| began != process_group) {
            self.end_gathers(batch)?;
        }
        let slot = match self.gathering.free_slots.pop() {
            Some(slot) => slot,
            None => {
                let index = self.gathering.slots.len();
                let buffer = alloc(&self.backend, self.plan.gather_slot_bytes(), || {
                    format!("gather slot {index}, beyond the planned ones")
                })?;
                self.gathering.slots.push(buffer);
                self.counters.extra_slots += 1;
                GatherSlot {
                    buffer_index: index,
                    free_after: None,
                }
            }
        };
        if let Some(done) = &slot.free_after {
            self.backend.wait(Stream::Gather, done)?;
        }
        // The first gather after an optimizer step waits for it; later ones follow on the stream.
        if let Some(updated) = self.gathering.shards_updated.take() {
            self.backend.wait(Stream::Gather, &updated)?;
        }
        let start = self.mark(Stream::Gather)?;
        let plan = Arc::clone(&self.plan);
        let group = &plan.groups()[g];
        let shard_region = Region::new(0, group.shard_numel, group.dtype);
        let full_region = Region::new(0, group.padded_numel, group.dtype);
        let world = self.plan.world_size();
        let tag = (world > 1).then(|| {
            self.next_tag(Purpose::Group(g), |tag| {
                Fingerprint::all_gather(tag, shard_region)
            })
        });
        // Queued before the batch can end, so that a failure below still completes it.
        let collective = tag.map(|tag| Fingerprint::all_gather(tag, shard_region));
        batch.queued.push((g, start, collective));
        let comm = group_comm(
            &mut self.comm,
            &mut self.process_groups,
            group.process_group,
        )?;
        if tag.is_some() && batch.began.is_none() {
            comm.begin_batch()?;
            batch.began = Some(group.process_group);
        }
        let out = &mut self.gathering.slots[slot.buffer_index];
        // SAFETY (the cast and the all-gathers): the gather stream writes the slot after
        // compute's last use of the group that held it (`free_after`, waited above) and reads the
        // shard or master after the optimizer's last write (`shards_updated`, waited above for
        // the step's first gather; later ones follow it on the gather stream). The optimizer
        // waits for the gather stream before it writes.
        let result = match (master_only, self.optimizer.groups[g].master.as_ref()) {
            (true, Some(master)) => {
                let own = Region::new(
                    plan.shard_index(group, self.rank)? * group.shard_numel,
                    group.shard_numel,
                    group.dtype,
                );
                let master_region = Region::new(0, group.shard_numel, DType::F32);
                let cast = unsafe {
                    self.backend
                        .cast(Stream::Gather, master, master_region, out, own)
                };
                match (cast, tag) {
                    (Ok(()), Some(tag)) => unsafe {
                        comm.all_gather_in_place(
                            &self.backend,
                            Stream::Gather,
                            tag,
                            out,
                            full_region,
                        )
                    },
                    (cast, _) => cast,
                }
            }
            _ => match tag {
                Some(tag) => unsafe {
                    comm.all_gather(
                        &self.backend,
                        Stream::Gather,
                        tag,
                        &self.param_shards[g],
                        shard_region,
                        out,
                        full_region,
                    )
                },
                None => Err(Error::GroupOutOfRange {
                    group: g,
                    count: self.optimizer.groups.len(),
                }),
            },
        };
        self.gathering.groups[g].placed = Some(Placement::Slot(GatherSlot {
            free_after: None,
            ..slot
        }));
        result
    }
}
