//! Pure decisions for the gradient path: temporary slots (in the transport's dtype),
//! reduce-scatters in flight, unsharded accumulators of the no-sync mode, and accumulation into
//! the persistent fp32 shards. No I/O: each call returns the effects to apply.
//!
//! Where gradients are reduced (every place but the shards themselves), the ranks' reductions
//! must come in the same order, whichever gradients each rank got: so a group's gradients of a
//! pass end only when its unit's backward ends or the pass does, never on the arrival of its
//! last gradient, and then every trainable group of those that ended, in the plan's order, is
//! reduced once, its missing gradients zero (a group that got none is zero).

use std::collections::VecDeque;

/// Where a group's gradients of one pass are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradTarget {
    /// A temporary fp32 slot, reduce-scattered into the group's shard once the group is complete.
    Slot(usize),
    /// Group `.0`'s persistent fp32 shard itself: at world size 1 the shard is the whole buffer,
    /// so gradients need no slot, no reduction and no copy; a step's later passes add into it.
    Shard(usize),
    /// Group `.0`'s unsharded fp32 accumulator (no-sync mode): every pass of a step adds into
    /// it, and the step's sync reduces it once.
    Accumulator(usize),
}

/// How the passes of a step come together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Passes {
    /// Each pass reduces its gradients.
    ReduceEach,
    /// The passes add into accumulators, reduced by the sync in place (an f32 transport).
    AccumulateInPlace,
    /// As `AccumulateInPlace`, each accumulator staged into a slot of the transport's dtype
    /// first.
    AccumulateStaged,
}

/// An effect the engine applies, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradEffect {
    /// The reduction that used `slot` must complete before anything writes the slot again.
    Retire { slot: usize },
    /// Zero the padding of `group`'s layout at `place`: the gradients written later cover
    /// everything else.
    ZeroPadding { place: GradTarget, group: usize },
    /// Zero a parameter's place: it got no gradient before its group was reduced.
    ZeroParam { place: GradTarget, param: usize },
    /// Write the parameter's gradient into its place, or add it to what the place holds.
    Write {
        param: usize,
        place: GradTarget,
        add: bool,
    },
    /// Copy the group's accumulator into `slot`, rounded to the slot's dtype.
    Stage { group: usize, slot: usize },
    /// Reduce-scatter the place (a slot, or an accumulator) and add (or, for the step's first,
    /// write) this rank's part, scaled, into the group's persistent shard.
    Reduce {
        group: usize,
        place: GradTarget,
        overwrite: bool,
    },
    /// Zero the group's shard: it received no gradient this step.
    ZeroShard { group: usize },
    /// The group's shard holds the step's whole gradient, written and reduced ([`Updates::InBackward`]):
    /// its optimizer update can run.
    Final { group: usize },
}

/// Where a pass's gradients go, and so what ends a group's gradients of a pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradRoute {
    /// Straight into the fp32 shards (world size 1): a group's last gradient ends its pass.
    IntoShards,
    /// Into slots or accumulators reduced on this rank alone (world size 1, a scaled
    /// reduction): a group's last gradient ends its pass.
    Reduced,
    /// Into slots or accumulators reduced across ranks: the ranks' reductions must come in the
    /// same order whichever gradients each rank got, so only the end of a group's unit's
    /// backward, or of the pass, ends its gradients of the pass.
    ReducedAcrossRanks,
}

/// When the optimizer updates a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Updates {
    /// After the step's last backward pass, every group at once.
    AfterBackward,
    /// Each group as soon as its gradient shard is final, in the step's one backward pass: the
    /// pipeline emits [`GradEffect::Final`] once the group's gradients are complete (where they
    /// stay on the rank all of them arrived, or its unit's backward ended) and, where they
    /// travel, their last reduction was retired.
    InBackward,
}

impl GradEffect {
    /// The group whose persistent fp32 shard the effect writes, if any.
    pub fn shard_written(&self) -> Option<usize> {
        match *self {
            GradEffect::ZeroPadding { place, .. }
            | GradEffect::ZeroParam { place, .. }
            | GradEffect::Write { place, .. } => match place {
                GradTarget::Shard(group) => Some(group),
                GradTarget::Slot(_) | GradTarget::Accumulator(_) => None,
            },
            GradEffect::Reduce { group, .. } | GradEffect::ZeroShard { group } => Some(group),
            GradEffect::Retire { .. } | GradEffect::Stage { .. } | GradEffect::Final { .. } => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Free,
    Filling,
    Reducing,
}

/// The gradient pipeline of one rank.
#[derive(Clone, Debug)]
pub struct GradPipeline {
    /// Trainable parameters of each group.
    members: Vec<Vec<usize>>,
    received: Vec<bool>,
    /// Parameters written into their group's current slot since it was taken.
    in_slot: Vec<bool>,
    received_count: Vec<usize>,
    filling: Vec<Option<GradTarget>>,
    fill_order: VecDeque<usize>,
    slots: Vec<Slot>,
    /// The group each slot's reduction in flight belongs to.
    slot_group: Vec<usize>,
    in_flight: VecDeque<usize>,
    /// Per group, its reductions in flight.
    group_in_flight: Vec<usize>,
    updates: Updates,
    /// Groups whose gradients of the pass are complete: no more arrive.
    complete: Vec<bool>,
    /// Groups reduced in part (every slot was being filled) whose other gradients may still
    /// come, in the order of their first part.
    partial: VecDeque<usize>,
    /// Where gradients are reduced, the groups whose gradients of the pass ended (their unit's
    /// backward did): each reduced once more, none may come any more in this pass.
    ended: Vec<bool>,
    /// A backward pass began and did not end yet.
    in_pass: bool,
    /// Groups whose [`GradEffect::Final`] was emitted this step.
    finalized: Vec<bool>,
    max_in_flight: usize,
    overlap: bool,
    /// A step's first gradients of a group go straight into its shard (world size 1).
    direct: bool,
    /// Only units' and passes' ends end a group's gradients ([`GradRoute::ReducedAcrossRanks`]).
    ordered: bool,
    passes: Passes,
    /// Groups whose accumulator holds this step's gradients.
    accumulated: Vec<bool>,
    written: Vec<bool>,
    pending: bool,
    synced: bool,
}

impl GradPipeline {
    /// `members[g]`: the trainable parameters of group `g` (none for a frozen group); `params`:
    /// number of parameters; `slots` temporary buffers, at least `max_in_flight + 1` when any
    /// group trains and a slot is used at all; `route`: where gradients go (straight into the
    /// shards at world size 1, where no group uses an accumulator).
    pub fn new(
        members: Vec<Vec<usize>>,
        params: usize,
        (slots, max_in_flight): (usize, usize),
        overlap: bool,
        route: GradRoute,
        (passes, updates): (Passes, Updates),
    ) -> GradPipeline {
        let groups = members.len();
        GradPipeline {
            members,
            received: vec![false; params],
            in_slot: vec![false; params],
            received_count: vec![0; groups],
            filling: vec![None; groups],
            fill_order: VecDeque::new(),
            slots: vec![Slot::Free; slots],
            slot_group: vec![0; slots],
            in_flight: VecDeque::new(),
            group_in_flight: vec![0; groups],
            updates,
            complete: vec![false; groups],
            partial: VecDeque::new(),
            ended: vec![false; groups],
            in_pass: false,
            finalized: vec![false; groups],
            max_in_flight,
            overlap,
            direct: route == GradRoute::IntoShards,
            ordered: route == GradRoute::ReducedAcrossRanks,
            passes,
            accumulated: vec![false; groups],
            written: vec![false; groups],
            pending: false,
            synced: false,
        }
    }

    /// Whether `param` already has a gradient in this backward pass.
    pub fn received(&self, param: usize) -> bool {
        self.received[param]
    }

    /// Gradients arrived since the last [`GradPipeline::finish`].
    pub fn pending(&self) -> bool {
        self.pending
    }

    /// [`GradPipeline::finish`] ran this step and no gradient arrived since.
    pub fn synced(&self) -> bool {
        self.synced
    }

    /// Whether `group`'s gradients of the step are complete where updates run in the backward
    /// ([`Updates::InBackward`]): its update is queued or will be, and no gradient of it may
    /// come any more.
    pub fn closed(&self, group: usize) -> bool {
        self.updates == Updates::InBackward && self.complete[group]
    }

    /// Whether `group`'s gradients of this pass ended with its unit's backward, where gradients
    /// are reduced across ranks: none may come any more in this pass.
    pub fn ended(&self, group: usize) -> bool {
        self.ended[group]
    }

    /// Reductions launched and not yet retired.
    #[cfg(test)]
    fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    fn retire_oldest(&mut self, effects: &mut Vec<GradEffect>) -> Option<usize> {
        let slot = self.in_flight.pop_front()?;
        self.slots[slot] = Slot::Free;
        effects.push(GradEffect::Retire { slot });
        let group = self.slot_group[slot];
        self.group_in_flight[group] -= 1;
        if self.complete[group] && self.group_in_flight[group] == 0 {
            self.finalize(group, effects);
        }
        Some(slot)
    }

    /// Emits `group`'s [`GradEffect::Final`], once, where updates run in the backward.
    fn finalize(&mut self, group: usize, effects: &mut Vec<GradEffect>) {
        if self.updates == Updates::InBackward
            && !std::mem::replace(&mut self.finalized[group], true)
        {
            effects.push(GradEffect::Final { group });
        }
    }

    /// A backward pass begins at a unit's backward hook, which every rank issues alike, with or
    /// without gradients (a gradient begins one too, in [`GradPipeline::open`]).
    pub fn begin_pass(&mut self) {
        self.in_pass = true;
    }

    /// The backward of a unit whose groups `in_unit` picks ended: where gradients are reduced
    /// across ranks, every trainable group of it is reduced once more (unless `root`: the
    /// root's parameters take gradients until the pass ends); elsewhere, where updates run in
    /// the backward, its groups with gradients are final.
    pub fn end_unit(
        &mut self,
        in_unit: impl FnMut(usize) -> bool,
        root: bool,
        effects: &mut Vec<GradEffect>,
    ) {
        match self.ordered {
            true if !root => self.end_groups_where(in_unit, effects),
            true => {}
            false if self.updates == Updates::InBackward => {
                self.complete_groups_where(in_unit, effects)
            }
            false => {}
        }
    }

    /// Where gradients are reduced across ranks, ends the pass's gradients of every trainable
    /// group that `ended` picks and that did not end yet, in the plan's order, whatever arrived:
    /// each is reduced once more (opened, all zero, if no gradient of it is waiting), so that
    /// every rank reduces the same groups in the same order.
    fn end_groups_where(
        &mut self,
        mut ended: impl FnMut(usize) -> bool,
        effects: &mut Vec<GradEffect>,
    ) {
        for group in 0..self.members.len() {
            if self.members[group].is_empty() || self.ended[group] || !ended(group) {
                continue;
            }
            self.ended[group] = true;
            self.take_place(group, effects);
            self.launch(group, effects);
        }
    }

    /// Ends the pass's gradients of every group with some that `ended` picks, as
    /// [`GradPipeline::end_pass`] does for all (the parameters that got none count as zero):
    /// where updates run in the backward, a unit's groups are final once its backward ended.
    /// Where no rank waits for another only: the groups end in the order they began taking
    /// gradients.
    pub fn complete_groups_where(
        &mut self,
        mut ended: impl FnMut(usize) -> bool,
        effects: &mut Vec<GradEffect>,
    ) {
        let mut i = 0;
        while let Some(&group) = self.fill_order.get(i) {
            if ended(group) {
                // Takes the group out of the fill order.
                self.launch(group, effects);
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while let Some(&group) = self.partial.get(i) {
            if ended(group) {
                self.partial.remove(i);
                self.complete_reduced(group, effects);
            } else {
                i += 1;
            }
        }
    }

    /// `group`, reduced in part and taking no more gradients, is complete: final once its
    /// reductions in flight retire.
    fn complete_reduced(&mut self, group: usize, effects: &mut Vec<GradEffect>) {
        self.complete[group] = true;
        if self.group_in_flight[group] == 0 {
            self.finalize(group, effects);
        }
    }

    /// Launches `group`'s gradients of the pass so far: they are complete (every one arrived,
    /// or none will any more), unless a slot is needed and the reduction of a later part of
    /// them will follow (`claim_slot`).
    fn launch(&mut self, group: usize, effects: &mut Vec<GradEffect>) {
        self.launch_part(group, true, effects);
    }

    fn launch_part(&mut self, group: usize, complete: bool, effects: &mut Vec<GradEffect>) {
        let Some(place) = self.filling[group].take() else {
            return;
        };
        self.fill_order.retain(|&g| g != group);
        // A place an earlier pass filled keeps its values where this one wrote none.
        let keeps = self.adds(place);
        for &param in &self.members[group] {
            if !std::mem::take(&mut self.in_slot[param]) && !keeps {
                effects.push(GradEffect::ZeroParam { place, param });
            }
        }
        match place {
            // The gradients are in the shard already.
            GradTarget::Shard(_) => {
                self.written[group] = true;
                if complete {
                    self.complete[group] = true;
                    self.finalize(group, effects);
                }
            }
            // The step's sync reduces them.
            GradTarget::Accumulator(_) => self.accumulated[group] = true,
            GradTarget::Slot(slot) => self.reduce_slot(group, slot, complete, effects),
        }
    }

    fn reduce_slot(
        &mut self,
        group: usize,
        slot: usize,
        complete: bool,
        effects: &mut Vec<GradEffect>,
    ) {
        match complete {
            true => self.partial.retain(|&g| g != group),
            false if !self.partial.contains(&group) => self.partial.push_back(group),
            false => {}
        }
        if self.in_flight.len() >= self.max_in_flight {
            self.retire_oldest(effects);
        }
        effects.push(GradEffect::Reduce {
            group,
            place: GradTarget::Slot(slot),
            overwrite: !self.written[group],
        });
        self.written[group] = true;
        self.slots[slot] = Slot::Reducing;
        self.slot_group[slot] = group;
        self.group_in_flight[group] += 1;
        // Final at the retire of this reduction, the group's last.
        self.complete[group] = complete;
        self.in_flight.push_back(slot);
        if !self.overlap {
            self.retire_oldest(effects);
        }
    }

    /// Reduces every accumulator this step filled, each once.
    fn reduce_accumulators(&mut self, effects: &mut Vec<GradEffect>) {
        for group in 0..self.members.len() {
            if !std::mem::take(&mut self.accumulated[group]) {
                continue;
            }
            if self.passes == Passes::AccumulateStaged {
                let slot = self.claim_slot(effects);
                effects.push(GradEffect::Stage { group, slot });
                self.reduce_slot(group, slot, true, effects);
            } else {
                // A sync earlier in the step wrote the shard: this one adds to it.
                effects.push(GradEffect::Reduce {
                    group,
                    place: GradTarget::Accumulator(group),
                    overwrite: !self.written[group],
                });
                self.written[group] = true;
            }
        }
    }

    fn claim_slot(&mut self, effects: &mut Vec<GradEffect>) -> usize {
        if let Some(slot) = self.free_or_retired(effects) {
            return slot;
        }
        // Every slot is being filled: reduce the oldest group's gradients so far. Reduction is
        // linear, so its later gradients reduced from a fresh slot add up to the same result.
        let filling = &self.filling;
        if let Some(&oldest) = self
            .fill_order
            .iter()
            .find(|&&g| matches!(filling[g], Some(GradTarget::Slot(_))))
        {
            self.launch_part(oldest, false, effects);
        }
        // Without overlap that reduction retired at once and its slot is free; with it, the
        // reduction holds its slot until retired here.
        match self.free_or_retired(effects) {
            Some(slot) => slot,
            None => unreachable!("a launched reduction holds a slot"),
        }
    }

    /// A free slot, else the slot of the oldest reduction in flight, retired; `None` when every
    /// slot is being filled.
    fn free_or_retired(&mut self, effects: &mut Vec<GradEffect>) -> Option<usize> {
        match self.slots.iter().position(|&s| s == Slot::Free) {
            Some(free) => Some(free),
            None => self.retire_oldest(effects),
        }
    }

    /// A gradient for `param` of `group` arrives. The caller has checked that the parameter is
    /// trainable and has no gradient yet in this pass.
    pub fn on_grad(&mut self, param: usize, group: usize, effects: &mut Vec<GradEffect>) {
        let place = self.open(group, effects);
        let add = self.adds(place);
        effects.push(GradEffect::Write { param, place, add });
        self.commit(param, group, effects);
    }

    /// Whether a gradient written at `place` adds to what it holds: a shard or an accumulator an
    /// earlier pass of the step filled.
    pub fn adds(&self, place: GradTarget) -> bool {
        match place {
            GradTarget::Slot(_) => false,
            GradTarget::Shard(group) => self.written[group],
            GradTarget::Accumulator(group) => self.accumulated[group],
        }
    }

    /// Whether `group`'s next gradient (by [`GradPipeline::open`]) would add to what its place
    /// holds, so that a caller cannot write the place whole.
    pub fn next_adds(&self, group: usize) -> bool {
        match self.filling[group] {
            Some(place) => self.adds(place),
            None if self.direct => self.written[group],
            None if self.passes != Passes::ReduceEach => self.accumulated[group],
            None => false,
        }
    }

    /// Where `group`'s gradient, arriving now, goes in this pass: its shard at world size 1, its
    /// accumulator in no-sync accumulation, else a slot, taken (its padding zeroed) if the
    /// group has none. A slot stays the group's until a later `open` of another group needs
    /// its place, so a caller writing into it commits before asking for another.
    pub fn open(&mut self, group: usize, effects: &mut Vec<GradEffect>) -> GradTarget {
        // A gradient outside a pass (after the step's sync, with no hook) begins one.
        self.in_pass = true;
        self.take_place(group, effects)
    }

    /// `group`'s place in this pass, taken if it has none: gradients are pending until the
    /// step's sync.
    fn take_place(&mut self, group: usize, effects: &mut Vec<GradEffect>) -> GradTarget {
        self.pending = true;
        self.synced = false;
        if let Some(place) = self.filling[group] {
            return place;
        }
        let place = if self.direct {
            GradTarget::Shard(group)
        } else if self.passes != Passes::ReduceEach {
            GradTarget::Accumulator(group)
        } else {
            let slot = self.claim_slot(effects);
            self.slots[slot] = Slot::Filling;
            GradTarget::Slot(slot)
        };
        if !self.adds(place) {
            effects.push(GradEffect::ZeroPadding { place, group });
        }
        self.filling[group] = Some(place);
        self.fill_order.push_back(group);
        place
    }

    /// `param`'s gradient is in `group`'s open slot; the group's last one ends the group's
    /// gradients of the pass, unless they are reduced across ranks (there its unit's end or
    /// the pass's does).
    pub fn commit(&mut self, param: usize, group: usize, effects: &mut Vec<GradEffect>) {
        debug_assert!(!self.received[param] && self.filling[group].is_some());
        self.received[param] = true;
        self.in_slot[param] = true;
        self.received_count[group] += 1;
        if !self.ordered && self.received_count[group] == self.members[group].len() {
            self.launch(group, effects);
        }
    }

    /// The backward pass ended: every group's gradients of it end, the parameters that got none
    /// zero. Where gradients are reduced across ranks, every trainable group is reduced in the
    /// pass (those whose unit's backward ended already were), and nothing where no pass began
    /// (no rank's hooks or gradients began one since the last end).
    pub fn end_pass(&mut self, effects: &mut Vec<GradEffect>) {
        match self.ordered {
            true if self.in_pass => self.end_groups_where(|_| true, effects),
            true => {}
            // Every group ends, those reduced in part too: they get nothing more in this pass.
            false => self.complete_groups_where(|_| true, effects),
        }
        self.in_pass = false;
        self.ended.fill(false);
        self.received.fill(false);
        self.received_count.fill(0);
    }

    /// Reduces everything outstanding and retires every reduction; groups that received nothing
    /// this step get a zero shard.
    pub fn finish(&mut self, effects: &mut Vec<GradEffect>) {
        self.end_pass(effects);
        self.reduce_accumulators(effects);
        while self.retire_oldest(effects).is_some() {}
        for group in 0..self.members.len() {
            if !self.members[group].is_empty() && !self.written[group] {
                effects.push(GradEffect::ZeroShard { group });
                self.written[group] = true;
                self.complete[group] = true;
                self.finalize(group, effects);
            }
        }
        self.pending = false;
        self.synced = true;
    }

    /// A new step begins: the next reduction of each group overwrites its shard.
    pub fn end_step(&mut self) {
        self.in_pass = false;
        self.ended.fill(false);
        self.written.fill(false);
        self.complete.fill(false);
        self.finalized.fill(false);
        self.synced = false;
    }
}

#[cfg(test)]
mod tests;
