//! Collectives on a stream, between the ranks of one data-parallel group.

pub mod hybrid;
pub mod launch;
pub mod local;
pub mod loopback;
pub mod nccl;

use std::fmt;

use crate::backend::{Backend, Region};
use crate::error::{Error, Result};
use crate::types::{DType, Stream};
use crate::watch::Watch;

/// What a collective is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Purpose {
    /// The gather, or the reduction, of a plan group.
    Group(usize),
    /// The ranks' comparison of their plans, when their engines are made.
    PlanCheck,
    /// The ranks' comparison of the collectives they issued in a step
    /// (`EngineConfig::verify_collectives`).
    CollectiveCheck,
    /// The exchange of the ranks' parts of the gradient norm.
    GradNorm,
    /// The ranks' agreement to take a step together or not at all: a save, a load, an import.
    Agreement,
}

/// A collective's place in its engine's sequence: every rank issues the same purposes in the
/// same order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tag {
    pub purpose: Purpose,
    /// Steps the engine had ended before this collective.
    pub step: u64,
    /// Its place among the engine's collectives of the step, from 0.
    pub seq: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CollectiveOp {
    AllGather,
    ReduceScatter,
    AllReduce,
}

/// A collective as the ranks compare it: its tag, kind, element type and length (per rank for an
/// all-gather, the whole region for a reduce-scatter).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    pub tag: Tag,
    pub op: CollectiveOp,
    pub dtype: DType,
    pub len: usize,
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = match self.op {
            CollectiveOp::AllGather => "all-gather",
            CollectiveOp::ReduceScatter => "reduce-scatter",
            CollectiveOp::AllReduce => "all-reduce",
        };
        let what = match self.tag.purpose {
            Purpose::Group(g) => format!("group {g}"),
            Purpose::PlanCheck => "the plan check".into(),
            Purpose::CollectiveCheck => "the collective check".into(),
            Purpose::GradNorm => "the gradient norm".into(),
            Purpose::Agreement => "an agreement of the ranks".into(),
        };
        write!(
            f,
            "{op} of {what} ({} {}), collective {} of step {}",
            self.len, self.dtype, self.tag.seq, self.tag.step
        )
    }
}

impl Fingerprint {
    pub fn all_gather(tag: Tag, shard: Region) -> Fingerprint {
        Fingerprint {
            tag,
            op: CollectiveOp::AllGather,
            dtype: shard.dtype,
            len: shard.len,
        }
    }

    pub fn reduce_scatter(tag: Tag, region: Region) -> Fingerprint {
        Fingerprint {
            tag,
            op: CollectiveOp::ReduceScatter,
            dtype: region.dtype,
            len: region.len,
        }
    }

    pub fn all_reduce(tag: Tag, region: Region) -> Fingerprint {
        Fingerprint {
            tag,
            op: CollectiveOp::AllReduce,
            dtype: region.dtype,
            len: region.len,
        }
    }

    /// A fixed encoding, the same on every machine, for hashing and exchanging.
    pub fn to_bytes(&self) -> [u8; FINGERPRINT_BYTES] {
        let (kind, group) = match self.tag.purpose {
            Purpose::Group(g) => (0u64, g as u64),
            Purpose::PlanCheck => (1, 0),
            Purpose::CollectiveCheck => (2, 0),
            Purpose::GradNorm => (3, 0),
            Purpose::Agreement => (4, 0),
        };
        let op = match self.op {
            CollectiveOp::AllGather => 0u64,
            CollectiveOp::ReduceScatter => 1,
            CollectiveOp::AllReduce => 2,
        };
        let dtype = match self.dtype {
            DType::Bf16 => 0u64,
            DType::F16 => 1,
            DType::F32 => 2,
        };
        let words = [
            kind,
            group,
            self.tag.step,
            self.tag.seq,
            op << 8 | dtype,
            self.len as u64,
        ];
        let mut out = [0u8; FINGERPRINT_BYTES];
        for (chunk, w) in out.chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// The fingerprint [`Fingerprint::to_bytes`] encoded, if `bytes` hold one.
    pub fn from_bytes(bytes: &[u8]) -> Option<Fingerprint> {
        let word = |i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(
                bytes.get(i * 8..i * 8 + 8)?.try_into().ok()?,
            ))
        };
        let purpose = match (word(0)?, word(1)?) {
            (0, g) => Purpose::Group(usize::try_from(g).ok()?),
            (1, _) => Purpose::PlanCheck,
            (2, _) => Purpose::CollectiveCheck,
            (3, _) => Purpose::GradNorm,
            (4, _) => Purpose::Agreement,
            _ => return None,
        };
        let kind = word(4)?;
        let op = match kind >> 8 {
            0 => CollectiveOp::AllGather,
            1 => CollectiveOp::ReduceScatter,
            2 => CollectiveOp::AllReduce,
            _ => return None,
        };
        let dtype = match kind & 0xff {
            0 => DType::Bf16,
            1 => DType::F16,
            2 => DType::F32,
            _ => return None,
        };
        Some(Fingerprint {
            tag: Tag {
                purpose,
                step: word(2)?,
                seq: word(3)?,
            },
            op,
            dtype,
            len: usize::try_from(word(5)?).ok()?,
        })
    }
}

/// Bytes of [`Fingerprint::to_bytes`].
pub const FINGERPRINT_BYTES: usize = 48;

/// The error for ranks whose collectives differ: rank 0's and rank `rank`'s, described.
pub(crate) fn mismatch(
    rank: usize,
    expected: Option<&Fingerprint>,
    got: Option<&Fingerprint>,
) -> Error {
    let describe =
        |f: Option<&Fingerprint>| f.map_or_else(|| "nothing".to_string(), |f| f.to_string());
    Error::CollectiveMismatch {
        rank,
        expected: describe(expected),
        got: describe(got),
    }
}

/// All-gather and reduce-scatter for one rank, over buffers of backend `B`.
///
/// Every rank must issue the same collectives, with the same lengths, in the same order; each
/// carries a [`Tag`], and communicators that can compare the ranks' [`Fingerprint`]s (local,
/// loopback) fail every rank on a difference, naming both versions. A
/// collective is queued on a stream like the backend's data operations, and runs when the stream
/// gets there; so, like them, it is `unsafe`: the caller orders every use of its buffers on other
/// streams with events.
pub trait Communicator<B: Backend>: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// The deadline and abort flag of the rank's waits, from its engine.
    fn set_watch(&mut self, watch: &Watch);

    /// This rank's replica and how many there are, under hybrid sharding
    /// ([`hybrid::Hybrid`]): the ranks of one replica shard the parameters among themselves, each
    /// replica holds them all. `(0, 1)` for a plain group.
    fn replica(&self) -> Replica {
        Replica { index: 0, count: 1 }
    }

    /// Whether the ranks' collectives meet on the host (a thread of each rank), which a captured
    /// step never reaches again: [`crate::Engine::begin_capture`] refuses such a communicator.
    fn meets_on_the_host(&self) -> bool {
        false
    }

    /// The ranks the engine's comparisons of plans and collectives span: every rank of the grid
    /// under hybrid sharding, else [`Communicator::world_size`].
    fn grid_size(&self) -> usize {
        self.world_size()
    }

    /// As [`Communicator::all_gather`] over every rank of the grid
    /// ([`Communicator::grid_size`]), replica by replica: `out_region.len` is `grid_size`
    /// times `shard_region.len`.
    ///
    /// # Safety
    /// As [`Communicator::all_gather`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn all_gather_grid(
        &mut self,
        backend: &B,
        stream: Stream,
        tag: Tag,
        shard: &B::Buffer,
        shard_region: Region,
        out: &mut B::Buffer,
        out_region: Region,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.all_gather(backend, stream, tag, shard, shard_region, out, out_region) }
    }

    /// `Err` once the communicator failed on its own, between calls (NCCL's asynchronous
    /// error: a peer's connection lost, say); checked by the engine at every call.
    fn health(&self) -> Result<()> {
        Ok(())
    }

    /// Ends the communicator after its rank failed: collectives queued and under way stop, so
    /// that the rank's streams drain instead of waiting for peers, and every later one fails.
    /// The engine calls it when it is poisoned.
    fn abort(&self) {}

    /// Starts a batch of collectives, ended by [`Communicator::end_batch`]: the collectives
    /// issued in between may be queued on their streams only there, together (NCCL's group
    /// call), so work queued on a stream between a batch's collective and its end may run
    /// before the collective. Batches do not nest.
    fn begin_batch(&mut self) -> Result<()> {
        Ok(())
    }

    /// Queues the collectives of the batch [`Communicator::begin_batch`] started.
    fn end_batch(&mut self, _backend: &B) -> Result<()> {
        Ok(())
    }

    /// Gathers every rank's `shard_region` of `shard` into `out_region` of `out`, rank `r`'s part
    /// at `r * shard_region.len`. `out_region.len` is `world_size * shard_region.len`.
    ///
    /// # Safety
    /// No work on another stream uses either region concurrently (see [`Backend::zero`]).
    #[allow(clippy::too_many_arguments)]
    unsafe fn all_gather(
        &mut self,
        backend: &B,
        stream: Stream,
        tag: Tag,
        shard: &B::Buffer,
        shard_region: Region,
        out: &mut B::Buffer,
        out_region: Region,
    ) -> Result<()>;

    /// As [`Communicator::all_gather`], with this rank's part already in place: `region` of
    /// `buf` holds `world_size` parts of `region.len / world_size` elements, rank `r`'s at
    /// `r * region.len / world_size`; afterwards every rank's part is in every rank's region.
    ///
    /// # Safety
    /// As [`Communicator::all_gather`], for the region.
    unsafe fn all_gather_in_place(
        &mut self,
        backend: &B,
        stream: Stream,
        tag: Tag,
        buf: &mut B::Buffer,
        region: Region,
    ) -> Result<()>;

    /// Sums `scale` times the `region` of `buf` (f32, or bf16) over the ranks (each rank's
    /// values scaled before the sum, which keeps a mean finite where a plain sum would
    /// overflow), and leaves this rank's part (`region.len / world_size` elements at `rank`
    /// times that) in place. The local and loopback communicators add in f32, in rank order 0,
    /// 1, 2, ..., and round a bf16 sum once; NCCL's order and bf16 roundings are its own.
    ///
    /// # Safety
    /// As [`Communicator::all_gather`], for the region.
    #[allow(clippy::too_many_arguments)]
    unsafe fn reduce_scatter(
        &mut self,
        backend: &B,
        stream: Stream,
        tag: Tag,
        buf: &mut B::Buffer,
        region: Region,
        scale: f32,
    ) -> Result<()>;

    /// Sums `scale` times the `region` of `buf` (f32, or bf16) over the ranks, leaving the sum
    /// in every rank's region, with the arithmetic of [`Communicator::reduce_scatter`].
    ///
    /// # Safety
    /// As [`Communicator::all_gather`], for the region.
    #[allow(clippy::too_many_arguments)]
    unsafe fn all_reduce(
        &mut self,
        backend: &B,
        stream: Stream,
        tag: Tag,
        buf: &mut B::Buffer,
        region: Region,
        scale: f32,
    ) -> Result<()>;
}

/// Every rank's communicator of its group of a process group of `size` ranks
/// ([`crate::ProcessGroupSpec`]) among `world` ranks, in rank order: rank `r` joins the ranks
/// `r / size * size ..` at place `r % size`. `group(n)` makes the handles of one group of `n`
/// ranks (such as [`crate::LocalComm::group`]).
pub fn process_group_comms<C>(
    world: usize,
    size: usize,
    mut group: impl FnMut(usize) -> Result<Vec<C>>,
) -> Result<Vec<C>> {
    if size == 0 || world % size != 0 {
        return Err(Error::InvalidConfig {
            field: "process group size",
            reason: format!("is {size}, which does not divide the {world} ranks"),
        });
    }
    let mut comms = crate::fallible::with_capacity(world, "the process group communicators")?;
    for _ in 0..world / size {
        let handles = group(size)?;
        if handles.len() != size {
            return Err(Error::InvalidConfig {
                field: "group",
                reason: format!("made {} handles for a group of {size}", handles.len()),
            });
        }
        comms.extend(handles);
    }
    Ok(comms)
}

/// A rank's replica under hybrid sharding, and how many there are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Replica {
    pub index: usize,
    pub count: usize,
}

/// Checks the element type of an all-reduce before any communication.
pub(crate) fn check_all_reduce(region: Region) -> Result<()> {
    if region.dtype == DType::F16 {
        return Err(Error::Unsupported {
            backend: "communicator",
            what: "an f16 reduction (f32 or bf16 only)",
        });
    }
    Ok(())
}

/// Checks the lengths of an all-gather before any communication.
pub(crate) fn check_all_gather(world_size: usize, shard: Region, out: Region) -> Result<()> {
    if shard.dtype != out.dtype || shard.len.checked_mul(world_size) != Some(out.len) {
        return Err(Error::OutOfRange {
            offset: out.offset,
            len: out.len,
            capacity: shard.len.saturating_mul(world_size),
        });
    }
    Ok(())
}

/// This rank's part of an in-place all-gather's `region`, checked to split evenly.
pub(crate) fn own_part(world_size: usize, rank: usize, region: Region) -> Result<Region> {
    if region.len % world_size != 0 {
        return Err(Error::OutOfRange {
            offset: region.offset,
            len: region.len,
            capacity: region.len / world_size * world_size,
        });
    }
    let part = region.len / world_size;
    Ok(Region::new(region.offset + rank * part, part, region.dtype))
}

/// Checks the length of a reduce-scatter before any communication.
pub(crate) fn check_reduce_scatter(world_size: usize, region: Region) -> Result<()> {
    if region.dtype == DType::F16 {
        return Err(Error::Unsupported {
            backend: "communicator",
            what: "an f16 reduction (f32 or bf16 only)",
        });
    }
    if region.len % world_size != 0 {
        return Err(Error::OutOfRange {
            offset: region.offset,
            len: region.len,
            capacity: region.len / world_size * world_size,
        });
    }
    Ok(())
}
