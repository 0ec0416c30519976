//! The communicators a group handle holds until each rank's engine takes its own: taken once
//! per rank, given back when the rank's engine could not be made, released when the group is
//! destroyed.

use std::sync::Mutex;

use super::registry::lock;
use super::status::{Outcome, invalid};
use crate::comm::local::LocalComm;
use crate::comm::loopback::LoopbackComm;
use crate::comm::process_group_comms;
use crate::error::{Error, Result};
use crate::spec::ProcessGroupSpec;

/// The communicators of a group handle; each rank's engine takes its own once (and gives it back
/// when its engine could not be made).
pub(crate) enum Comms {
    Local {
        comms: Mutex<Takeable<LocalComm>>,
        /// The seed of the group's asynchronous backends; none for eager ones.
        seed: Option<u64>,
    },
    Loopback(Mutex<Takeable<LoopbackComm>>),
}

/// A group's communicators, each taken once by its rank's engine: the world's, made with the
/// group, and, for each process group a plan declares, every rank's of its group of ranks,
/// made when the first rank's engine asks for them.
pub(crate) struct Takeable<C> {
    world: Vec<Option<C>>,
    process_groups: Vec<(ProcessGroupSpec, Vec<Option<C>>)>,
}

impl<C> Takeable<C> {
    /// Drops every communicator no engine took: the ranks waiting for them (inside their own
    /// creation) see them gone at once.
    fn release(&mut self) {
        self.world.iter_mut().for_each(|c| drop(c.take()));
        for (_, comms) in &mut self.process_groups {
            comms.iter_mut().for_each(|c| drop(c.take()));
        }
    }
}

impl Comms {
    /// As [`Takeable::release`], for a group being destroyed.
    pub(crate) fn release(&self) {
        let released = match self {
            Comms::Local { comms, .. } => lock(comms).map(|mut c| c.release()),
            Comms::Loopback(comms) => lock(comms).map(|mut c| c.release()),
        };
        // A lock that failed holds nothing to release: a panic poisoned it mid-take.
        drop(released);
    }
}

pub(crate) fn takeable<C>(comms: Vec<C>) -> Mutex<Takeable<C>> {
    Mutex::new(Takeable {
        world: comms.into_iter().map(Some).collect(),
        process_groups: Vec::new(),
    })
}

/// Takes rank `rank`'s communicators out of a group of `plan_world` ranks, once: the world's,
/// and those of its groups of ranks of the `declared` process groups (made by `make(n)`, which
/// makes the handles of one group of `n` ranks, where no rank asked for them before). Nothing is
/// taken on an error.
pub(crate) fn take_comms<C>(
    comms: &Mutex<Takeable<C>>,
    (rank, plan_world): (usize, usize),
    declared: &[ProcessGroupSpec],
    mut make: impl FnMut(usize) -> Result<Vec<C>>,
) -> Outcome<(C, Vec<C>)> {
    let mut comms = lock(comms)?;
    let world_size = comms.world.len();
    if world_size != plan_world {
        return Err(Error::WorldSizeMismatch {
            plan: plan_world,
            comm: world_size,
        }
        .into());
    }
    let taken = || invalid(format!("rank {rank}'s communicator was already taken"));
    match comms.world.get(rank) {
        None => return Err(Error::RankOutOfRange { rank, world_size }.into()),
        Some(None) => return Err(taken()),
        Some(Some(_)) => {}
    }
    let mut indices = Vec::with_capacity(declared.len());
    for g in declared {
        let index = match comms.process_groups.iter().position(|(made, _)| made == g) {
            Some(index) => index,
            None => {
                let made = process_group_comms(world_size, g.size, &mut make)?;
                comms
                    .process_groups
                    .push((g.clone(), made.into_iter().map(Some).collect()));
                comms.process_groups.len() - 1
            }
        };
        if comms.process_groups[index].1[rank].is_none() {
            return Err(taken());
        }
        indices.push(index);
    }
    let groups = indices
        .into_iter()
        .filter_map(|index| comms.process_groups[index].1[rank].take())
        .collect();
    let world = comms.world[rank].take().ok_or_else(taken)?;
    Ok((world, groups))
}

/// Puts rank `rank`'s communicators back into its group (the world's, and those of the
/// `declared` process groups), after its engine could not be made.
pub(crate) fn give_back<C>(
    comms: &Mutex<Takeable<C>>,
    rank: usize,
    declared: &[ProcessGroupSpec],
    (comm, groups): (C, Vec<C>),
) -> Outcome {
    let mut comms = lock(comms)?;
    if let Some(slot) = comms.world.get_mut(rank) {
        *slot = Some(comm);
    }
    for (g, c) in declared.iter().zip(groups) {
        if let Some((_, slots)) = comms.process_groups.iter_mut().find(|(made, _)| made == g)
            && let Some(slot) = slots.get_mut(rank)
        {
            *slot = Some(c);
        }
    }
    Ok(())
}
