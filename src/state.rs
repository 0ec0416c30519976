//! Pure decisions for the gathered parameter buffers: the FREED/SYNCING/USING/READY machine,
//! eviction under the limit, and prefetch. No I/O: each call returns the effects to apply.

use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::types::BufferState;

impl BufferState {
    /// Whether the machine allows `self -> to`.
    ///
    /// Allowed: FREED->SYNCING (gather issued), SYNCING->USING (gather awaited by compute),
    /// USING->READY (compute done), READY->USING (reuse without communication), READY->FREED
    /// (evicted), and SYNCING->FREED: a prefetch that no hook used, dropped at the end of a step
    /// (the next gather into its slot is ordered after it on the gather stream).
    pub fn allows(self, to: BufferState) -> bool {
        use BufferState::*;
        matches!(
            (self, to),
            (Freed, Syncing)
                | (Syncing, Using)
                | (Syncing, Freed)
                | (Using, Ready)
                | (Ready, Using)
                | (Ready, Freed)
        )
    }
}

/// An effect the engine applies, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatherEffect {
    /// Give the group's slot back (READY or unused SYNCING -> FREED).
    Evict(usize),
    /// Take a slot and all-gather the group into it (FREED -> SYNCING).
    Gather(usize),
    /// Make compute wait for the group's gather (SYNCING -> USING).
    Wait(usize),
}

/// The states of every group's gathered buffer, and the limit on how many are gathered. Every
/// decision takes O(log groups): the counts and the READY buffers by last use follow each
/// transition ([`Gathers::set`]), so no hook scans the groups.
#[derive(Clone, Debug)]
pub struct Gathers {
    states: Vec<BufferState>,
    users: Vec<u32>,
    last_use: Vec<u64>,
    clock: u64,
    limit: usize,
    /// Buffers not FREED.
    gathered: usize,
    /// The READY buffers as (last use, group): the first is the one to evict.
    ready: BTreeSet<(u64, usize)>,
}

impl Gathers {
    /// `groups` buffers, all FREED, at most `limit` gathered except when a required gather finds
    /// nothing to evict.
    pub fn new(groups: usize, limit: usize) -> Gathers {
        Gathers {
            states: vec![BufferState::Freed; groups],
            users: vec![0; groups],
            last_use: vec![0; groups],
            clock: 0,
            limit,
            gathered: 0,
            ready: BTreeSet::new(),
        }
    }

    pub fn state(&self, group: usize) -> BufferState {
        self.states[group]
    }

    /// Buffers SYNCING, USING or READY.
    pub fn gathered(&self) -> usize {
        self.gathered
    }

    /// The one place a state changes, and with it the count and the READY set.
    fn set(&mut self, group: usize, to: BufferState) -> Result<()> {
        let from = self.states[group];
        if !from.allows(to) {
            return Err(Error::ForbiddenTransition { group, from, to });
        }
        match (from, to) {
            (BufferState::Freed, _) => self.gathered += 1,
            (_, BufferState::Freed) => self.gathered -= 1,
            _ => {}
        }
        if from == BufferState::Ready {
            self.ready.remove(&(self.last_use[group], group));
        }
        if to == BufferState::Ready {
            self.ready.insert((self.last_use[group], group));
        }
        self.states[group] = to;
        Ok(())
    }

    /// The least recently used READY buffer (the lowest group among equals).
    fn eviction_candidate(&self) -> Option<usize> {
        self.ready.first().map(|&(_, group)| group)
    }

    /// Makes room for one more gathered buffer if at the limit and something READY can go.
    /// Returns false when at the limit with nothing to evict.
    fn make_room(&mut self, effects: &mut Vec<GatherEffect>) -> Result<bool> {
        if self.gathered() < self.limit {
            return Ok(true);
        }
        match self.eviction_candidate() {
            Some(victim) => {
                self.set(victim, BufferState::Freed)?;
                effects.push(GatherEffect::Evict(victim));
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Compute needs `group`: afterwards it is USING. A FREED buffer is gathered even when the
    /// limit is reached and nothing can be evicted (the engine takes one more slot).
    pub fn acquire(&mut self, group: usize, effects: &mut Vec<GatherEffect>) -> Result<()> {
        match self.states[group] {
            BufferState::Using => {}
            BufferState::Ready => self.set(group, BufferState::Using)?,
            BufferState::Syncing => {
                self.set(group, BufferState::Using)?;
                effects.push(GatherEffect::Wait(group));
            }
            BufferState::Freed => {
                self.make_room(effects)?;
                self.set(group, BufferState::Syncing)?;
                effects.push(GatherEffect::Gather(group));
                self.set(group, BufferState::Using)?;
                effects.push(GatherEffect::Wait(group));
            }
        }
        // Stamped once USING, out of the READY set that is ordered by the stamps.
        self.clock += 1;
        self.last_use[group] = self.clock;
        self.users[group] += 1;
        Ok(())
    }

    /// Starts gathering `group` ahead of use if it is FREED and a slot is free under the limit
    /// (evicting a READY buffer if needed). Never exceeds the limit. Returns whether it gathers.
    pub fn prefetch(&mut self, group: usize, effects: &mut Vec<GatherEffect>) -> Result<bool> {
        if self.states[group] != BufferState::Freed || !self.make_room(effects)? {
            return Ok(false);
        }
        self.set(group, BufferState::Syncing)?;
        effects.push(GatherEffect::Gather(group));
        Ok(true)
    }

    /// One user of `group` is done; the last one makes it READY.
    pub fn release(&mut self, group: usize) -> Result<()> {
        if self.states[group] != BufferState::Using || self.users[group] == 0 {
            return Err(Error::ForbiddenTransition {
                group,
                from: self.states[group],
                to: BufferState::Ready,
            });
        }
        self.users[group] -= 1;
        if self.users[group] == 0 {
            self.set(group, BufferState::Ready)?;
        }
        Ok(())
    }

    /// Frees every gathered buffer (their contents go stale when the shards change). Fails, with
    /// nothing changed, if a buffer is still in use.
    pub fn reset(&mut self, effects: &mut Vec<GatherEffect>) -> Result<()> {
        if let Some(group) = self.states.iter().position(|&s| s == BufferState::Using) {
            return Err(Error::ForbiddenTransition {
                group,
                from: BufferState::Using,
                to: BufferState::Freed,
            });
        }
        for group in 0..self.states.len() {
            if self.states[group] != BufferState::Freed {
                self.set(group, BufferState::Freed)?;
                effects.push(GatherEffect::Evict(group));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::BufferState::*;
    use super::GatherEffect::*;
    use super::*;

    fn gathers_count(effects: &[GatherEffect]) -> usize {
        effects.iter().filter(|e| matches!(e, Gather(_))).count()
    }

    #[test]
    fn transition_table_allows_exactly_the_machine() {
        let allowed = [
            (Freed, Syncing),
            (Syncing, Using),
            (Syncing, Freed),
            (Using, Ready),
            (Ready, Using),
            (Ready, Freed),
        ];
        for from in BufferState::ALL {
            for to in BufferState::ALL {
                assert_eq!(
                    from.allows(to),
                    allowed.contains(&(from, to)),
                    "{from:?} -> {to:?}"
                );
            }
        }
    }

    #[test]
    fn forbidden_transitions_are_errors_that_change_nothing() {
        for from in BufferState::ALL {
            for to in BufferState::ALL {
                if from.allows(to) {
                    continue;
                }
                let mut g = Gathers::new(1, 2);
                g.states[0] = from;
                let err = g.set(0, to).unwrap_err();
                assert!(
                    matches!(err, Error::ForbiddenTransition { group: 0, from: f, to: t } if f == from && t == to)
                );
                assert_eq!(g.state(0), from);
            }
        }
    }

    #[test]
    fn ready_reuse_issues_no_gather() {
        let mut g = Gathers::new(3, 2);
        let mut fx = Vec::new();
        g.acquire(0, &mut fx).unwrap();
        assert_eq!(fx, vec![Gather(0), Wait(0)]);
        g.release(0).unwrap();
        assert_eq!(g.state(0), Ready);
        fx.clear();
        g.acquire(0, &mut fx).unwrap();
        assert!(fx.is_empty());
        assert_eq!(g.state(0), Using);
    }

    #[test]
    fn prefetch_never_exceeds_the_limit() {
        let mut g = Gathers::new(4, 2);
        let mut fx = Vec::new();
        g.acquire(0, &mut fx).unwrap();
        g.acquire(1, &mut fx).unwrap();
        fx.clear();
        // Both gathered buffers are in use: the prefetch is skipped.
        assert!(!g.prefetch(2, &mut fx).unwrap());
        assert!(fx.is_empty());
        assert_eq!(g.gathered(), 2);
        // One READY buffer can go: the prefetch evicts it.
        g.release(0).unwrap();
        assert!(g.prefetch(2, &mut fx).unwrap());
        assert_eq!(fx, vec![Evict(0), Gather(2)]);
        assert_eq!(g.gathered(), 2);
        assert_eq!(g.state(2), Syncing);
        // Waiting on a prefetched buffer issues no second gather.
        fx.clear();
        g.release(1).unwrap();
        g.acquire(2, &mut fx).unwrap();
        assert_eq!(fx, vec![Wait(2)]);
    }

    #[test]
    fn required_gather_at_the_limit_proceeds() {
        let mut g = Gathers::new(3, 1);
        let mut fx = Vec::new();
        g.acquire(0, &mut fx).unwrap();
        g.acquire(1, &mut fx).unwrap();
        g.acquire(2, &mut fx).unwrap();
        assert_eq!(gathers_count(&fx), 3);
        assert_eq!(g.gathered(), 3);
    }

    #[test]
    fn eviction_takes_the_least_recently_used_ready_buffer() {
        let mut g = Gathers::new(3, 2);
        let mut fx = Vec::new();
        g.acquire(0, &mut fx).unwrap();
        g.acquire(1, &mut fx).unwrap();
        g.release(1).unwrap();
        g.release(0).unwrap();
        g.acquire(0, &mut fx).unwrap();
        g.release(0).unwrap();
        fx.clear();
        g.acquire(2, &mut fx).unwrap();
        assert_eq!(fx, vec![Evict(1), Gather(2), Wait(2)]);
    }

    #[test]
    fn users_count_nested_uses() {
        let mut g = Gathers::new(1, 2);
        let mut fx = Vec::new();
        g.acquire(0, &mut fx).unwrap();
        g.acquire(0, &mut fx).unwrap();
        g.release(0).unwrap();
        assert_eq!(g.state(0), Using);
        g.release(0).unwrap();
        assert_eq!(g.state(0), Ready);
        assert!(matches!(
            g.release(0),
            Err(Error::ForbiddenTransition {
                from: Ready,
                to: Ready,
                ..
            })
        ));
    }

    #[test]
    fn reset_frees_everything_but_refuses_buffers_in_use() {
        let mut g = Gathers::new(3, 3);
        let mut fx = Vec::new();
        g.acquire(0, &mut fx).unwrap();
        g.prefetch(1, &mut fx).unwrap();
        fx.clear();
        assert!(g.reset(&mut fx).is_err());
        assert!(fx.is_empty());
        assert_eq!(g.gathered(), 2);
        g.release(0).unwrap();
        g.reset(&mut fx).unwrap();
        assert_eq!(fx, vec![Evict(0), Evict(1)]);
        assert_eq!(g.gathered(), 0);
    }
}
