//! N ranks on one GPU, one thread and one [`CudaBackend`] each: collectives as device copies and
//! rank-ordered sums, so results equal [`crate::comm::local::LocalComm`]'s bit for bit. For tests
//! of multi-rank runs on a single GPU, which NCCL refuses.
//!
//! Each collective meets twice on the host (threads wait for each other; the host never waits for
//! the device):
//! 1. every rank records an event where its stream reached the collective and deposits it with
//!    its data's address; each rank's stream then waits for every rank's event and does its own
//!    part: it only writes its own buffer, reading the others'.
//! 2. every rank deposits an event at the end of its part; each rank's stream waits for all of
//!    them, so no rank's later work (reusing a buffer another rank reads) starts before the
//!    collective is done everywhere.
//!
//! The ranks meet on the host, not through flags in device memory (`cuStreamWaitValue32`): a
//! stream's wait blocks the hardware queue it shares with other streams, and once the ranks'
//! streams outnumber the queues (`CUDA_DEVICE_MAX_CONNECTIONS`, process-wide) such waits deadlock
//! for good (`benches/stream_waits.rs` shows it at 4 ranks under the default 8 queues).

mod rendezvous;

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream, result};

use crate::backend::Region;
use crate::backend::cuda::{CudaBackend, CudaBuffer, DeviceMemory, PooledEvent, bind, cuda};
use crate::comm::{
    Communicator, Fingerprint, Tag, check_all_gather, check_all_reduce, check_reduce_scatter,
    own_part,
};
use crate::error::{Error, Result};
use crate::types::{DType, Stream};
use crate::watch::Watch;
use rendezvous::Rendezvous;

/// What a rank issued; every rank must issue the same, on the same device and context.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Op {
    fingerprint: Fingerprint,
    place: Place,
}

/// The device and context a rank's buffers live in: kernels of one context cannot read another's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Place {
    device: usize,
    context: usize,
}

impl Op {
    fn describe(&self) -> String {
        format!(
            "{} on device {} (context {:#x})",
            self.fingerprint, self.place.device, self.place.context
        )
    }
}

/// What a rank deposits at one of a collective's two meetings.
#[derive(Clone, Debug)]
enum Deposit {
    /// The rank's stream reached the collective at `reached`; `data` is its source address.
    Arrive {
        op: Op,
        reached: Arc<PooledEvent>,
        data: u64,
    },
    /// The rank failed on the device before taking part.
    Failed,
    /// The rank's part ends at this event (none if even recording it failed).
    Done(Option<Arc<PooledEvent>>),
}

/// Checks that every rank arrived with rank 0's operation (`op` is this rank's). A rank that
/// failed before taking part is reported as gone; a different operation as a mismatch, naming the
/// first such rank and both versions.
fn check_ops(op: &Op, ops: &[Option<&Op>]) -> Result<()> {
    if let Some(rank) = ops.iter().position(Option::is_none) {
        return Err(Error::PeerGone {
            rank,
            op: op.describe(),
        });
    }
    let expected = ops.first().copied().flatten();
    match ops.iter().position(|op| *op != expected) {
        Some(rank) => Err(Error::CollectiveMismatch {
            rank,
            expected: expected.map_or_else(|| "nothing".into(), Op::describe),
            got: ops[rank].map_or_else(|| "nothing".into(), Op::describe),
        }),
        None => Ok(()),
    }
}

/// The device array of source addresses that `reduce_sum` reads, one per rank.
#[derive(Debug)]
struct SourceTable {
    memory: DeviceMemory,
    /// The end of the last reduction that read the table, on whichever stream it ran.
    last_read: Option<CudaEvent>,
}

/// One rank's handle on a group of threads sharing one GPU. Dropping it tells the others it left.
#[derive(Debug)]
pub struct LoopbackComm {
    rendezvous: Arc<Rendezvous<Deposit>>,
    rank: usize,
    world_size: usize,
    watch: Watch,
    table: Option<SourceTable>,
    /// The copy of this rank's values an all-reduce's ranks read, while each writes its own
    /// region; grown to the largest all-reduce so far.
    scratch: Option<DeviceMemory>,
    /// Scratch memory outgrown, which other ranks' streams may still read: freed with the
    /// communicator.
    retired: Vec<DeviceMemory>,
    /// Where the last all-reduce's stream went past every rank's reads of the scratch: the
    /// next copy into it, on whichever stream, waits for it.
    scratch_free: Option<CudaEvent>,
}

impl LoopbackComm {
    /// Handles for `world_size` ranks, one per thread, in rank order. Each thread pairs its handle
    /// with its own [`CudaBackend`] on the same device.
    pub fn group(world_size: usize) -> Result<Vec<LoopbackComm>> {
        if world_size == 0 {
            return Err(Error::ZeroWorldSize);
        }
        let rendezvous = Arc::new(Rendezvous::new(world_size)?);
        let mut comms = crate::fallible::with_capacity(world_size, "a loopback group")?;
        comms.extend((0..world_size).map(|rank| LoopbackComm {
            rendezvous: Arc::clone(&rendezvous),
            rank,
            world_size,
            watch: Watch::default(),
            table: None,
            scratch: None,
            retired: Vec::new(),
            scratch_free: None,
        }));
        Ok(comms)
    }

    /// Runs one collective whose arguments were checked: meets the others, runs `work` with every
    /// rank's data address on this rank's stream once all streams reached the collective, meets
    /// again and holds this rank's stream until every rank's work is done.
    /// An all-gather of every rank's part (`fingerprint.len` elements at `src`) into `dst`,
    /// rank `r`'s at `r` times its bytes; `skip` names a rank whose part is there already.
    fn gather(
        &mut self,
        backend: &CudaBackend,
        stream: Stream,
        fingerprint: Fingerprint,
        (src, dst): (u64, u64),
        skip: Option<usize>,
    ) -> Result<()> {
        let bytes = fingerprint.len * fingerprint.dtype.size();
        let op = Op {
            fingerprint,
            place: place(backend),
        };
        self.run(backend, stream, op, src, |_, on, sources| {
            if bytes == 0 {
                return Ok(());
            }
            for (rank, &source) in sources.iter().enumerate() {
                if Some(rank) == skip {
                    continue;
                }
                let to = dst + (rank * bytes) as u64;
                // SAFETY: the output is checked to hold `world_size * bytes` bytes and every rank
                // checked its part to hold `bytes`; the streams' events order the copies after
                // every rank's writes and before its later reuse.
                unsafe { result::memcpy_dtod_async(to, source, bytes, on.cu_stream()) }
                    .map_err(cuda("cuMemcpyDtoDAsync"))?;
            }
            Ok(())
        })
    }

    fn run(
        &mut self,
        backend: &CudaBackend,
        stream: Stream,
        op: Op,
        data: u64,
        work: impl FnOnce(&mut Self, &CudaStream, &[u64]) -> Result<()>,
    ) -> Result<()> {
        let what = op.describe();
        let on = backend.stream_handle(stream);
        let (deposit, failure) =
            match bind(backend.context_handle()).and_then(|()| backend.record_raw(stream)) {
                Ok(event) => {
                    let reached = Arc::new(event);
                    (Deposit::Arrive { op, reached, data }, None)
                }
                // Still meet the others, so they fail too instead of pairing with a later collective.
                Err(e) => (Deposit::Failed, Some(e)),
            };
        let arrivals = self
            .rendezvous
            .exchange(self.rank, &self.watch, &what, deposit.clone())?;
        if let Some(e) = failure {
            return Err(e);
        }
        let ops: Vec<Option<&Op>> = arrivals
            .iter()
            .map(|d| match d {
                Deposit::Arrive { op, .. } => Some(op),
                _ => None,
            })
            .collect();
        let own = match &deposit {
            Deposit::Arrive { op, .. } => Some(op),
            _ => None,
        };
        if let Some(own) = own {
            check_ops(own, &ops)?;
        }
        let mut addresses = Vec::with_capacity(arrivals.len());
        let mut waited = Ok(());
        for (rank, d) in arrivals.iter().enumerate() {
            if let Deposit::Arrive { reached, data, .. } = d {
                addresses.push(*data);
                if rank != self.rank && waited.is_ok() {
                    waited = on.wait(reached).map_err(cuda("cuStreamWaitEvent"));
                }
            }
        }
        let launched = waited.and_then(|()| work(self, on, &addresses));
        let done = backend.record_raw(stream).ok().map(Arc::new);
        let finished =
            self.rendezvous
                .exchange(self.rank, &self.watch, &what, Deposit::Done(done))?;
        for (rank, d) in finished.iter().enumerate() {
            if let (false, Deposit::Done(Some(event))) = (rank == self.rank, d) {
                on.wait(event).map_err(cuda("cuStreamWaitEvent"))?;
            }
        }
        launched
    }

    /// The scratch memory for an all-reduce of `bytes`, made or grown in `backend`'s context
    /// (outside its counted memory, as the table is).
    fn scratch(&mut self, backend: &CudaBackend, bytes: usize) -> Result<u64> {
        if let Some(scratch) = &self.scratch {
            if scratch.bytes() >= bytes {
                return Ok(scratch.ptr());
            }
        }
        let outgrown = self.scratch.as_ref().map_or(0, DeviceMemory::bytes);
        let grown = DeviceMemory::alloc(
            backend.context_handle(),
            bytes.max(outgrown.saturating_mul(2)),
        )?;
        self.retired
            .try_reserve(1)
            .map_err(|_| Error::OutOfMemory {
                bytes: std::mem::size_of::<DeviceMemory>(),
                what: "the loopback communicator's outgrown scratch".into(),
            })?;
        self.retired.extend(self.scratch.take());
        Ok(self.scratch.insert(grown).ptr())
    }

    /// The source table, allocated on first use in `backend`'s context (outside its counted
    /// memory: it is the communicator's, not the engine's).
    fn table(&mut self, backend: &CudaBackend) -> Result<&mut SourceTable> {
        let table = match self.table.take() {
            Some(table) => table,
            None => SourceTable {
                memory: DeviceMemory::alloc(backend.context_handle(), self.world_size * 8)?,
                last_read: None,
            },
        };
        Ok(self.table.insert(table))
    }
}

impl Drop for LoopbackComm {
    fn drop(&mut self) {
        self.rendezvous.leave(self.rank);
    }
}

fn place(backend: &CudaBackend) -> Place {
    Place {
        device: backend.ordinal(),
        context: backend.context_handle().cu_ctx() as usize,
    }
}

/// Writes `addresses` into the table on `stream` with stream-ordered 32-bit memsets: the values
/// travel as arguments, so no host memory has to outlive the call and the host never waits.
/// One rank's part of a reduction: `scale` times every source summed into `dst`.
struct Sum<'a> {
    dtype: DType,
    /// One address per rank, `len` elements of `dtype` each.
    sources: &'a [u64],
    dst: u64,
    len: usize,
    scale: f32,
}

impl Sum<'_> {
    /// Lists the sources in `table` (after its last reader) and sums them on `on`.
    ///
    /// # Safety
    /// Every source and `dst` is valid for `len` elements of `dtype` while `on` runs the sum,
    /// as `reduce_sum` asks.
    unsafe fn run(
        &self,
        table: &mut SourceTable,
        backend: &CudaBackend,
        on: &CudaStream,
    ) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        if let Some(last) = &table.last_read {
            on.wait(last).map_err(cuda("cuStreamWaitEvent"))?;
        }
        write_table(table, on, self.sources)?;
        // SAFETY: the table now lists the sources, valid as the caller promises.
        let summed = unsafe {
            backend.kernels().reduce_sum(
                on,
                self.dtype,
                table.memory.ptr(),
                self.sources.len(),
                self.dst,
                self.len,
                self.scale,
            )
        };
        table.last_read = Some(on.record_event(None).map_err(cuda("cuEventRecord"))?);
        summed
    }
}

fn write_table(table: &SourceTable, stream: &CudaStream, addresses: &[u64]) -> Result<()> {
    for (i, &address) in addresses.iter().enumerate() {
        let at = table.memory.ptr() + 8 * i as u64;
        // Little-endian: the low word first.
        for (word, value) in [(at, address as u32), (at + 4, (address >> 32) as u32)] {
            // SAFETY: the table holds one 8-byte entry per rank, and `i` is a rank.
            unsafe { cudarc::driver::sys::cuMemsetD32Async(word, value, 1, stream.cu_stream()) }
                .result()
                .map_err(cuda("cuMemsetD32Async"))?;
        }
    }
    Ok(())
}

impl Communicator<CudaBackend> for LoopbackComm {
    fn rank(&self) -> usize {
        self.rank
    }

    /// Every collective's ranks meet on the host before their copies are queued.
    fn meets_on_the_host(&self) -> bool {
        true
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn set_watch(&mut self, watch: &Watch) {
        self.watch = watch.clone();
        self.rendezvous.set_watch(self.rank, watch);
    }

    /// The rank leaves the group: its peers' waits for it fail.
    fn abort(&self) {
        self.watch.leave();
    }

    unsafe fn all_gather(
        &mut self,
        backend: &CudaBackend,
        stream: Stream,
        tag: Tag,
        shard: &CudaBuffer,
        shard_region: Region,
        out: &mut CudaBuffer,
        out_region: Region,
    ) -> Result<()> {
        check_all_gather(self.world_size, shard_region, out_region)?;
        let src = shard.addr(shard_region)?;
        let dst = out.addr(out_region)?;
        let fingerprint = Fingerprint::all_gather(tag, shard_region);
        self.gather(backend, stream, fingerprint, (src, dst), None)
    }

    unsafe fn all_gather_in_place(
        &mut self,
        backend: &CudaBackend,
        stream: Stream,
        tag: Tag,
        buf: &mut CudaBuffer,
        region: Region,
    ) -> Result<()> {
        let own = own_part(self.world_size, self.rank, region)?;
        let src = buf.addr(own)?;
        let dst = buf.addr(region)?;
        let fingerprint = Fingerprint::all_gather(tag, Region::new(0, own.len, own.dtype));
        // This rank's part is in place: it is not copied onto itself.
        self.gather(backend, stream, fingerprint, (src, dst), Some(self.rank))
    }

    unsafe fn reduce_scatter(
        &mut self,
        backend: &CudaBackend,
        stream: Stream,
        tag: Tag,
        buf: &mut CudaBuffer,
        region: Region,
        scale: f32,
    ) -> Result<()> {
        check_reduce_scatter(self.world_size, region)?;
        let base = buf.addr(region)?;
        let part = region.len / self.world_size;
        let op = Op {
            fingerprint: Fingerprint::reduce_scatter(tag, region),
            place: place(backend),
        };
        let rank = self.rank;
        let own = (rank * part * region.dtype.size()) as u64;
        // Allocated before meeting the others: a failure here is an ordinary early error.
        self.table(backend)?;
        self.run(backend, stream, op, base, |comm, on, bases| {
            // Every rank's copy of this rank's part, in rank order.
            let sources: Vec<u64> = bases.iter().map(|&b| b + own).collect();
            let sum = Sum {
                dtype: region.dtype,
                sources: &sources,
                dst: base + own,
                len: part,
                scale,
            };
            // SAFETY: every source is `part` elements of the region's dtype, checked by its
            // rank; the destination is one of them (this rank's own part), which `reduce_sum`
            // allows; the streams' events order the reads after every rank's writes.
            unsafe { sum.run(comm.table(backend)?, backend, on) }
        })
    }

    /// Each rank copies its region into its scratch memory first, then sums every rank's
    /// scratch into its own region: no rank writes what another reads.
    unsafe fn all_reduce(
        &mut self,
        backend: &CudaBackend,
        stream: Stream,
        tag: Tag,
        buf: &mut CudaBuffer,
        region: Region,
        scale: f32,
    ) -> Result<()> {
        check_all_reduce(region)?;
        let base = buf.addr(region)?;
        let bytes = region.len * region.dtype.size();
        let op = Op {
            fingerprint: Fingerprint::all_reduce(tag, region),
            place: place(backend),
        };
        // Allocated before meeting the others: a failure here is an ordinary early error.
        self.table(backend)?;
        let scratch = self.scratch(backend, bytes)?;
        let on = backend.stream_handle(stream);
        if bytes > 0 {
            bind(backend.context_handle())?;
            if let Some(free) = &self.scratch_free {
                on.wait(free).map_err(cuda("cuStreamWaitEvent"))?;
            }
            // SAFETY: the region was checked to hold `bytes`, the scratch holds at least as many;
            // the scratch's last readers (the previous all-reduce's ranks) finished before
            // `scratch_free`, waited for above.
            unsafe { result::memcpy_dtod_async(scratch, base, bytes, on.cu_stream()) }
                .map_err(cuda("cuMemcpyDtoDAsync"))?;
        }
        self.run(backend, stream, op, scratch, |comm, on, sources| {
            let sum = Sum {
                dtype: region.dtype,
                sources,
                dst: base,
                len: region.len,
                scale,
            };
            // SAFETY: every source is a rank's scratch holding the region's values, checked by
            // its rank; the destination is this rank's own region, which no rank reads; the
            // streams' events order the reads after every rank's copy.
            unsafe { sum.run(comm.table(backend)?, backend, on) }
        })?;
        // The stream waited for every rank's part: every read of the scratch is behind it.
        self.scratch_free = Some(on.record_event(None).map_err(cuda("cuEventRecord"))?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::DType;

    use crate::comm::Purpose;

    /// An all-gather of `len` bf16 per rank of group `group`.
    fn gather(group: usize, len: usize) -> Op {
        let tag = Tag {
            purpose: Purpose::Group(group),
            step: 1,
            seq: 3,
        };
        Op {
            fingerprint: Fingerprint::all_gather(tag, Region::new(0, len, DType::Bf16)),
            place: Place {
                device: 0,
                context: 0x10,
            },
        }
    }

    #[test]
    fn the_same_operation_everywhere_passes() {
        let op = gather(0, 64);
        assert!(check_ops(&op, &[Some(&op), Some(&op), Some(&op)]).is_ok());
    }

    #[test]
    fn the_first_differing_rank_is_named_with_both_versions() {
        for (a, b) in [
            (gather(0, 64), gather(0, 32)),
            (gather(0, 64), gather(1, 64)),
        ] {
            let err = check_ops(&a, &[Some(&a), Some(&a), Some(&b), Some(&b)]).unwrap_err();
            match err {
                Error::CollectiveMismatch {
                    rank: 2,
                    expected,
                    got,
                } => {
                    assert_eq!(expected, a.describe());
                    assert_eq!(got, b.describe());
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(
            gather(3, 8)
                .describe()
                .starts_with("all-gather of group 3 (8 bf16), collective 3 of step 1")
        );
    }

    #[test]
    fn another_context_is_a_mismatch() {
        let a = gather(0, 64);
        let mut b = gather(0, 64);
        b.place.context = 0x20;
        assert!(matches!(
            check_ops(&a, &[Some(&a), Some(&b)]),
            Err(Error::CollectiveMismatch { rank: 1, .. })
        ));
    }

    #[test]
    fn a_rank_that_failed_before_taking_part_is_gone() {
        let op = gather(0, 64);
        assert!(matches!(
            check_ops(&op, &[Some(&op), None, Some(&op)]),
            Err(Error::PeerGone { rank: 1, .. })
        ));
    }

    #[test]
    fn a_group_needs_a_rank() {
        assert!(matches!(LoopbackComm::group(0), Err(Error::ZeroWorldSize)));
        let comms = LoopbackComm::group(3).unwrap();
        let ranks: Vec<_> = comms.iter().map(|c| (c.rank, c.world_size)).collect();
        assert_eq!(ranks, vec![(0, 3), (1, 3), (2, 3)]);
    }
}
