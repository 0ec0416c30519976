//! Making a rank's NCCL communicators: from a unique id, from the launch environment, for
//! several GPUs of one process, and split from others (process groups, hybrid sharding).

use super::*;

impl NcclComm {
    /// A fresh unique id: made by one rank and passed, as bytes, to every rank's [`NcclComm::new`].
    pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
        let nccl = library::nccl()?;
        let mut id = ncclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: writes one `ncclUniqueId`.
        let status = unsafe { (nccl.get_unique_id)(&mut id) };
        nccl.check("ncclGetUniqueId", status, std::ptr::null_mut())?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// Joins the group of `world_size` ranks named by `id` as `rank`, on `backend`'s device.
    /// Blocks until every rank joined, at most `timeout`: past it, the half-made communicator is
    /// aborted and the error is [`Error::Timeout`].
    pub fn new(
        id: &[u8; UNIQUE_ID_BYTES],
        rank: usize,
        world_size: usize,
        backend: &CudaBackend,
        timeout: Duration,
    ) -> Result<NcclComm> {
        let (rank32, world32) = membership(rank, world_size)?;
        let nccl = library::nccl()?;
        let watch = Watch::new(timeout);
        // NCCL creates its resources on the calling thread's current device.
        bind(backend.context_handle())?;
        let id = ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let gathers = Handle::start_init(nccl, id, rank32, world32)?;
        gathers.wait_ready(&watch, "ncclCommInitRankConfig", || {
            format!("NCCL's init of rank {rank} of {world_size}, waiting for every rank to join")
        })?;
        let reductions = gathers
            .start_split(0, rank32)?
            .wait(&gathers, &watch, split_wait)?;
        NcclComm::assemble(
            (gathers, reductions),
            (rank, world_size),
            backend.ordinal(),
            Arc::clone(backend.context_handle()),
            watch,
        )
    }

    /// This process's rank, its place read from the environment a launcher such as torchrun
    /// sets ([`LaunchEnv::from_env`]; `backend` on the device `LOCAL_RANK` names): rank 0 makes
    /// the unique id and serves it over TCP, the others fetch it ([`LaunchEnv::share_id`]), then
    /// every rank joins as [`NcclComm::new`] does; each wait at most `timeout`.
    pub fn from_launch(
        env: &LaunchEnv,
        backend: &CudaBackend,
        timeout: Duration,
    ) -> Result<NcclComm> {
        let id = env.share_id(NcclComm::unique_id, timeout)?;
        NcclComm::new(&id, env.rank, env.world_size, backend, timeout)
    }

    /// The ranks of this group that give the same `color`, ordered by `key`, as a group of
    /// their own (`ncclCommSplit`, for each of the two communicators): a collective of every
    /// rank of this group, each with its own color and key, waited for at most `timeout`. A
    /// split that fails or runs out of time aborts this group's communicators: they are
    /// unusable after it.
    pub fn split(&self, color: usize, key: usize, timeout: Duration) -> Result<NcclComm> {
        let split = self.split_both(color, key, timeout);
        if split.is_err() {
            Communicator::<CudaBackend>::abort(self);
        }
        split
    }

    fn split_both(&self, color: usize, key: usize, timeout: Duration) -> Result<NcclComm> {
        let number = |what: &'static str, n: usize| {
            c_int::try_from(n).map_err(|_| Error::InvalidConfig {
                field: what,
                reason: format!("is {n}, NCCL takes at most {}", c_int::MAX),
            })
        };
        let (color32, key32) = (number("color", color)?, number("key", key)?);
        let watch = Watch::new(timeout);
        bind(&self.ctx)?;
        let gathers =
            self.gathers
                .start_split(color32, key32)?
                .wait(&self.gathers, &watch, split_wait)?;
        let reductions = self.reductions.start_split(color32, key32)?.wait(
            &self.reductions,
            &watch,
            split_wait,
        )?;
        let place = gathers.place()?;
        NcclComm::assemble(
            (gathers, reductions),
            place,
            self.device,
            Arc::clone(&self.ctx),
            watch,
        )
    }

    /// This rank's communicators for hybrid sharding of this group's ranks in `replicas`
    /// replicas ([`crate::comm::hybrid`]): rank `r` in replica `r / shard_size` at place
    /// `r % shard_size`. A collective of every rank, each wait at most `timeout`.
    pub fn hybrid(&self, replicas: usize, timeout: Duration) -> Result<Hybrid<NcclComm>> {
        let shard_size = hybrid::shard_size(self.world_size, replicas)?;
        let (replica, place) = (self.rank / shard_size, self.rank % shard_size);
        let shard = self.split(replica, place, timeout)?;
        let across = self.split(place, replica, timeout)?;
        Ok(Hybrid::new(shard, across))
    }

    /// This rank's communicator of its group of ranks of each of `process_groups`
    /// ([`crate::ProcessGroupSpec`], in that order): rank `r` at place `r % size` of the ranks
    /// `r / size * size ..`. A collective of every rank, each split waited for at most
    /// `timeout`; a size that does not divide the world is refused before any split. Every rank
    /// must pass the same groups: a rank that splits less leaves the others to time out (the
    /// engine's comparison of the ranks' plans comes after).
    pub fn process_groups(
        &self,
        process_groups: &[ProcessGroupSpec],
        timeout: Duration,
    ) -> Result<Vec<NcclComm>> {
        for g in process_groups {
            g.check_divides(self.world_size)?;
        }
        process_groups
            .iter()
            .map(|g| self.split(self.rank / g.size, self.rank % g.size, timeout))
            .collect()
    }

    /// One communicator per device of `devices`, in that order (rank `i` on `devices[i]`), for
    /// one process driving several GPUs: pair each with a backend on its device, one thread each.
    /// Waits at most `timeout` for NCCL to make them.
    pub fn group(devices: &[usize], timeout: Duration) -> Result<Vec<NcclComm>> {
        let list = device_list(devices)?;
        let nccl = library::nccl()?;
        let contexts = devices
            .iter()
            .map(|&d| primary_context(d))
            .collect::<Result<Vec<_>>>()?;
        let world = list.len();
        let (_, world32) = membership(0, world)?;
        let watch = Watch::new(timeout);
        let id = ncclUniqueId {
            internal: NcclComm::unique_id()?.map(|b| b as std::ffi::c_char),
        };
        // One process joins every rank: each init (and each split) is one call of a group.
        let gathers = grouped(nccl, &contexts, |rank, _| {
            Handle::start_init(nccl, id, rank as c_int, world32)
        })?;
        wait_all(&gathers, &watch, "ncclCommInitRankConfig", || {
            format!("NCCL's init of {world} ranks in one process")
        })?;
        let splits = grouped(nccl, &contexts, |rank, _| {
            gathers[rank].start_split(0, rank as c_int)
        })?;
        let reductions = splits
            .into_iter()
            .zip(&gathers)
            .map(|(split, parent)| split.wait(parent, &watch, split_wait))
            .collect::<Result<Vec<_>>>();
        let reductions = match reductions {
            Ok(r) => r,
            Err(e) => {
                gathers.iter().for_each(Handle::abort);
                return Err(e);
            }
        };
        gathers
            .into_iter()
            .zip(reductions)
            .zip(contexts)
            .enumerate()
            .map(|(rank, (pair, ctx))| {
                // Each rank its own watch: one rank's failure is not another's.
                NcclComm::assemble(pair, (rank, world), devices[rank], ctx, Watch::new(timeout))
            })
            .collect()
    }

    fn assemble(
        (gathers, reductions): (Handle, Handle),
        (rank, world_size): (usize, usize),
        device: usize,
        ctx: Arc<CudaContext>,
        watch: Watch,
    ) -> Result<NcclComm> {
        let mut comm = NcclComm {
            gathers,
            reductions,
            rank,
            world_size,
            device,
            watch: watch.clone(),
            watchdog: None,
            batch: None,
            batch_failed: Cell::new(false),
            sums: RefCell::default(),
            ctx,
        };
        comm.watchdog = Some(comm.start_watchdog(watch)?);
        Ok(comm)
    }

    pub(super) fn start_watchdog(&self, watch: Watch) -> Result<Watchdog> {
        let probes = [self.gathers.probe(), self.reductions.probe()];
        let what = "the NCCL communicator's watchdog thread";
        Watchdog::start(what, watch, WATCHDOG_PERIOD, move || {
            probes.iter().find_map(Probe::failure)
        })
    }
}

/// `rank` and `world_size` as NCCL takes them, checked.
pub(super) fn membership(rank: usize, world_size: usize) -> Result<(c_int, c_int)> {
    if world_size == 0 {
        return Err(Error::ZeroWorldSize);
    }
    if rank >= world_size {
        return Err(Error::RankOutOfRange { rank, world_size });
    }
    let world = c_int::try_from(world_size).map_err(|_| Error::InvalidConfig {
        field: "world_size",
        reason: format!("is {world_size}, NCCL takes at most {} ranks", c_int::MAX),
    })?;
    // rank < world_size <= c_int::MAX.
    Ok((rank as c_int, world))
}

/// `devices` as NCCL takes them: at least one, each once.
pub(super) fn device_list(devices: &[usize]) -> Result<Vec<c_int>> {
    if devices.is_empty() {
        return Err(Error::ZeroWorldSize);
    }
    let mut list = Vec::with_capacity(devices.len());
    for (i, &device) in devices.iter().enumerate() {
        if devices[..i].contains(&device) {
            return Err(Error::InvalidConfig {
                field: "devices",
                reason: format!("device {device} is listed twice; NCCL takes one rank per GPU"),
            });
        }
        list.push(c_int::try_from(device).map_err(|_| Error::InvalidConfig {
            field: "devices",
            reason: format!("device {device} is not a CUDA device ordinal"),
        })?);
    }
    membership(0, list.len())?;
    Ok(list)
}

fn split_wait() -> String {
    "NCCL's split of the communicator for reductions, waiting for every rank".into()
}

/// Starts one call per context in one NCCL group, `start(rank, context)` on that context.
fn grouped<T>(
    nccl: &'static Nccl,
    contexts: &[Arc<CudaContext>],
    mut start: impl FnMut(usize, &Arc<CudaContext>) -> Result<T>,
) -> Result<Vec<T>> {
    let group = NcclGroup::start(nccl)?;
    let made = contexts
        .iter()
        .enumerate()
        .map(|(rank, ctx)| bind(ctx).and_then(|()| start(rank, ctx)))
        .collect::<Result<Vec<_>>>();
    let ended = group.end();
    let made = made?;
    if ended != NCCL_IN_PROGRESS {
        nccl.check("ncclGroupEnd", ended, std::ptr::null_mut())?;
    }
    Ok(made)
}

fn wait_all(
    handles: &[Handle],
    watch: &Watch,
    call: &'static str,
    op: impl Fn() -> String,
) -> Result<()> {
    let result = handles
        .iter()
        .try_for_each(|h| h.wait_ready(watch, call, &op));
    if result.is_err() {
        handles.iter().for_each(Handle::abort);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_and_world_sizes_are_checked() {
        assert!(matches!(membership(0, 0), Err(Error::ZeroWorldSize)));
        assert!(matches!(
            membership(2, 2),
            Err(Error::RankOutOfRange {
                rank: 2,
                world_size: 2
            })
        ));
        assert!(matches!(
            membership(0, c_int::MAX as usize + 1),
            Err(Error::InvalidConfig {
                field: "world_size",
                ..
            })
        ));
        assert_eq!(membership(1, 2).unwrap(), (1, 2));
    }

    #[test]
    fn device_lists_are_checked() {
        assert!(matches!(device_list(&[]), Err(Error::ZeroWorldSize)));
        assert!(matches!(
            device_list(&[0, 1, 0]),
            Err(Error::InvalidConfig {
                field: "devices",
                ..
            })
        ));
        assert!(matches!(
            device_list(&[usize::MAX]),
            Err(Error::InvalidConfig {
                field: "devices",
                ..
            })
        ));
        assert_eq!(device_list(&[3, 1]).unwrap(), vec![3, 1]);
    }
}
