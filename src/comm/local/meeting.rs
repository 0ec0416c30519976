//! Where the ranks of a local group meet: one channel per stream kind, a round per collective
//! in which every rank deposits its part, compares fingerprints and takes every rank's parts.

use super::*;

/// The collectives of one stream kind: the one in progress, met by every rank in turn.
#[derive(Debug)]
pub(super) struct Channel {
    pub(super) generation: u64,
    pub(super) arrived: usize,
    pub(super) deposits: Vec<Option<(Fingerprint, Vec<u8>)>>,
}

#[derive(Debug)]
pub(super) struct Round {
    pub(super) channels: [Channel; 3],
    /// Ranks whose handle was dropped.
    pub(super) dropped: Vec<bool>,
    /// Each rank's watch: an aborted rank, or one whose thread ended, is gone for the others.
    pub(super) watches: Vec<Watch>,
}

impl Round {
    /// A rank waiting in a channel other than `channel` for the collective that `mine` is in
    /// the engine's numbering (the same step and place in it), and its fingerprint: each rank
    /// issues that collective once, so the ranks diverged, and no meeting can come.
    pub(super) fn crossed(
        &self,
        channel: usize,
        mine: &Fingerprint,
    ) -> Option<(usize, Fingerprint)> {
        let same_place = |f: &Fingerprint| (f.tag.step, f.tag.seq) == (mine.tag.step, mine.tag.seq);
        self.channels
            .iter()
            .enumerate()
            .filter(|&(c, _)| c != channel)
            .flat_map(|(_, ch)| ch.deposits.iter().enumerate())
            .find_map(|(r, d)| match d {
                Some((f, _)) if same_place(f) && f != mine => Some((r, *f)),
                _ => None,
            })
    }

    /// The first rank other than `rank` that is gone.
    pub(super) fn gone(&self, rank: usize) -> Option<usize> {
        (0..self.dropped.len())
            .find(|&r| r != rank && (self.dropped[r] || self.watches[r].has_left()))
    }
}

pub(super) fn channel_index(stream: Stream) -> usize {
    match stream {
        Stream::Compute => 0,
        Stream::Gather => 1,
        Stream::Reduce => 2,
    }
}

#[derive(Debug)]
pub(super) struct Shared {
    pub(super) world_size: usize,
    pub(super) round: Mutex<Round>,
    pub(super) changed: Condvar,
}

/// One rank's part in a collective.
pub(super) struct Meeting<'a> {
    pub(super) shared: &'a Shared,
    pub(super) rank: usize,
    pub(super) channel: usize,
    pub(super) fingerprint: Fingerprint,
    pub(super) watch: &'a Watch,
}

impl Meeting<'_> {
    pub(super) fn lock(&self) -> MutexGuard<'_, Round> {
        // A rank that panicked while holding the lock left the round as it was: keep going.
        crate::sync::lock(&self.shared.round)
    }

    /// Waits until every rank arrived at this barrier of the channel; fails if a rank is gone
    /// first, this rank is aborted, or the deadline passes.
    pub(super) fn barrier<'a>(
        &'a self,
        mut round: MutexGuard<'a, Round>,
    ) -> Result<MutexGuard<'a, Round>> {
        // An abort (which leaves too) is the rank's own error to give.
        self.watch.check()?;
        if self.watch.has_left() {
            return Err(self.gone(self.rank));
        }
        let channel = &mut round.channels[self.channel];
        let generation = channel.generation;
        channel.arrived += 1;
        if channel.arrived == self.shared.world_size {
            channel.arrived = 0;
            channel.generation += 1;
            self.shared.changed.notify_all();
            return Ok(round);
        }
        let (c, rank) = (self.channel, self.rank);
        self.shared.changed.notify_all();
        let waited = self.watch.wait_while(
            round,
            &self.shared.changed,
            || self.fingerprint.to_string(),
            |round| {
                if round.channels[c].generation != generation {
                    return Ok(false);
                }
                // An abort (which leaves too) is the rank's own error to give.
                self.watch.check()?;
                if self.watch.has_left() {
                    return Err(self.gone(rank));
                }
                if let Some(r) = round.gone(rank) {
                    return Err(self.gone(r));
                }
                match round.crossed(c, &self.fingerprint) {
                    Some((peer, theirs)) => Err(Error::CollectivesCrossed {
                        rank,
                        mine: self.fingerprint.to_string(),
                        peer,
                        theirs: theirs.to_string(),
                    }),
                    None => Ok(true),
                }
            },
        );
        if waited.is_err() {
            // This rank leaves the meeting it never completed, so that a later one (a retried
            // engine creation) starts from an empty channel.
            let mut round = self.lock();
            let channel = &mut round.channels[c];
            if channel.generation == generation {
                channel.arrived = channel.arrived.saturating_sub(1);
            }
        }
        waited
    }

    pub(super) fn gone(&self, rank: usize) -> Error {
        Error::PeerGone {
            rank,
            op: self.fingerprint.to_string(),
        }
    }

    /// Deposits this rank's data, waits for all, checks they issued the same collective, and
    /// hands every rank's data to `read`; then waits until all have read.
    pub(super) fn exchange(&self, data: Vec<u8>, read: impl FnOnce(&[&[u8]])) -> Result<()> {
        let c = self.channel;
        let mut round = self.lock();
        round.channels[c].deposits[self.rank] = Some((self.fingerprint, data));
        round = match self.barrier(round) {
            Ok(round) => round,
            Err(e) => {
                // No rank read it: the deposit goes with this rank's arrival.
                self.lock().channels[c].deposits[self.rank] = None;
                return Err(e);
            }
        };
        let deposits = &round.channels[c].deposits;
        let expected = deposits[0].as_ref().map(|(f, _)| f);
        let differing = deposits
            .iter()
            .position(|d| d.as_ref().map(|(f, _)| f) != expected);
        let failure = match differing {
            Some(rank) => Some(mismatch(
                rank,
                expected,
                deposits[rank].as_ref().map(|(f, _)| f),
            )),
            None => {
                let parts: Vec<&[u8]> = deposits
                    .iter()
                    .filter_map(|d| d.as_ref().map(|(_, bytes)| bytes.as_slice()))
                    .collect();
                read(&parts);
                None
            }
        };
        let mut round = self.barrier(round)?;
        round.channels[c].deposits[self.rank] = None;
        drop(round);
        failure.map_or(Ok(()), Err)
    }
}
