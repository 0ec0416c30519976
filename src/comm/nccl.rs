//! NCCL collectives, one rank per GPU: across processes (a unique id made by one rank and passed
//! to the others by the caller) or from one process driving several GPUs.
//!
//! Calls go on the stream the engine names (the backend's gather or reduce stream) and do not
//! block the host; creating a communicator does, until every rank joined. All-gathers are out of
//! place; reduce-scatters sum f32 in NCCL's in-place form (`recv == send + rank * count`), which
//! is the layout [`Communicator::reduce_scatter`] asks for. Lengths, bounds and the device are
//! checked before every call. The library is loaded as `libnccl.so.2`, then `libnccl.so`, or from
//! the path in [`NCCL_LIBRARY_ENV`].

mod handle;
mod library;

use std::cell::{Cell, RefCell};
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::sys::{cudaStream_t, ncclDataType_t, ncclUniqueId};

use crate::backend::Region;
use crate::backend::cuda::{CudaBackend, CudaBuffer, bind, primary_context};
use crate::comm::hybrid::{self, Hybrid};
use crate::comm::launch::LaunchEnv;
use crate::comm::{
    Communicator, Tag, check_all_gather, check_all_reduce, check_reduce_scatter, own_part,
};
use crate::dtype::store_f32;
use crate::error::{Error, Result};
use crate::spec::ProcessGroupSpec;
use crate::types::{DType, Stream};
use crate::watch::Watch;
use crate::watchdog::Watchdog;
use handle::{Handle, Probe};
use library::{NCCL_IN_PROGRESS, NCCL_SCALAR_HOST_IMMEDIATE, NCCL_SUM, Nccl, NcclRedOp};

/// How often the watchdog looks for NCCL's asynchronous error.
const WATCHDOG_PERIOD: std::time::Duration = std::time::Duration::from_millis(100);

pub use library::NCCL_LIBRARY_ENV;

/// Bytes of an NCCL unique id.
pub const UNIQUE_ID_BYTES: usize = 128;

// The id crosses as bytes; cudarc's binding of `ncclUniqueId` must be exactly those bytes.
const _: () = assert!(std::mem::size_of::<ncclUniqueId>() == UNIQUE_ID_BYTES);

/// The version of the NCCL library this process loads, as (major, minor, patch).
pub fn nccl_version() -> Result<(u32, u32, u32)> {
    let nccl = library::nccl()?;
    let mut code: c_int = 0;
    // SAFETY: writes one int.
    let status = unsafe { (nccl.get_version)(&mut code) };
    nccl.check("ncclGetVersion", status, std::ptr::null_mut())?;
    Ok(split_version(code))
}

/// NCCL's version code (`major * 10000 + minor * 100 + patch` since 2.9) as its three parts.
fn split_version(code: c_int) -> (u32, u32, u32) {
    let code = u32::try_from(code).unwrap_or(0);
    (code / 10_000, code / 100 % 100, code % 100)
}

/// `rank` and `world_size` as NCCL takes them, checked.
fn membership(rank: usize, world_size: usize) -> Result<(c_int, c_int)> {
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
fn device_list(devices: &[usize]) -> Result<Vec<c_int>> {
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

fn nccl_dtype(dtype: DType) -> ncclDataType_t {
    match dtype {
        DType::Bf16 => ncclDataType_t::ncclBfloat16,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::F32 => ncclDataType_t::ncclFloat32,
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    AllGather,
    /// Each rank's values times `scale`, summed.
    ReduceScatter {
        scale: f32,
    },
    /// As a reduce-scatter, the whole sum kept on every rank.
    AllReduce {
        scale: f32,
    },
}

/// One NCCL call, its arguments checked: device addresses, and `count` elements per rank.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Call {
    kind: Kind,
    send: u64,
    recv: u64,
    count: usize,
    dtype: DType,
}

/// A buffer's base address and size in bytes.
#[derive(Clone, Copy, Debug)]
struct Extent {
    base: u64,
    bytes: usize,
}

impl Extent {
    fn of(buf: &CudaBuffer) -> Extent {
        Extent {
            base: buf.ptr(),
            bytes: buf.bytes(),
        }
    }

    /// The address of `region`, checked to lie inside.
    fn addr(self, region: Region) -> Result<u64> {
        Ok(self.base + region.byte_range(self.bytes)?.start as u64)
    }
}

fn all_gather_call(
    world_size: usize,
    shard: Extent,
    shard_region: Region,
    out: Extent,
    out_region: Region,
) -> Result<Call> {
    check_all_gather(world_size, shard_region, out_region)?;
    Ok(Call {
        kind: Kind::AllGather,
        send: shard.addr(shard_region)?,
        recv: out.addr(out_region)?,
        count: shard_region.len,
        dtype: shard_region.dtype,
    })
}

/// NCCL's in-place all-gather: the rank sends its own part of the output.
fn all_gather_in_place_call(
    world_size: usize,
    rank: usize,
    buf: Extent,
    region: Region,
) -> Result<Call> {
    let own = own_part(world_size, rank, region)?;
    Ok(Call {
        kind: Kind::AllGather,
        send: buf.addr(own)?,
        recv: buf.addr(region)?,
        count: own.len,
        dtype: own.dtype,
    })
}

/// NCCL's in-place form: the rank's result lands at its own part of the input.
fn reduce_scatter_call(
    world_size: usize,
    rank: usize,
    buf: Extent,
    region: Region,
    scale: f32,
) -> Result<Call> {
    check_reduce_scatter(world_size, region)?;
    let send = buf.addr(region)?;
    let count = region.len / world_size;
    Ok(Call {
        kind: Kind::ReduceScatter { scale },
        send,
        recv: send + (rank * count * region.dtype.size()) as u64,
        count,
        dtype: region.dtype,
    })
}

/// NCCL's in-place all-reduce of the region.
fn all_reduce_call(buf: Extent, region: Region, scale: f32) -> Result<Call> {
    check_all_reduce(region)?;
    let at = buf.addr(region)?;
    Ok(Call {
        kind: Kind::AllReduce { scale },
        send: at,
        recv: at,
        count: region.len,
        dtype: region.dtype,
    })
}

/// One collective of a [`NcclComm::batch`], with the buffers it reads and writes.
pub enum Collective<'a> {
    /// As [`Communicator::all_gather`].
    AllGather {
        shard: &'a CudaBuffer,
        shard_region: Region,
        out: &'a mut CudaBuffer,
        out_region: Region,
    },
    /// As [`Communicator::reduce_scatter`].
    ReduceScatter {
        buf: &'a mut CudaBuffer,
        region: Region,
        scale: f32,
    },
}

/// One rank's NCCL communicators, on one GPU: one for all-gathers and one for reductions (NCCL
/// runs one communicator's collectives one after another, so a prefetch would wait behind a
/// reduction), both nonblocking, so that joining, queueing and closing wait under the rank's
/// deadline. A watchdog thread looks for NCCL's asynchronous errors while the host waits; a
/// failure aborts both. Used from one thread at a time.
pub struct NcclComm {
    gathers: Handle,
    reductions: Handle,
    rank: usize,
    world_size: usize,
    device: usize,
    watch: Watch,
    watchdog: Option<Watchdog>,
    /// Inside [`Communicator::begin_batch`]: the collectives wait for the group's end.
    batching: bool,
    /// Whether a collective of the batch under way failed: both communicators are aborted
    /// once the group ended.
    batch_failed: Cell<bool>,
    /// The premultiplied sums made on the reductions' communicator, by factor and dtype.
    sums: RefCell<Vec<(u32, DType, NcclRedOp)>>,
    /// Keeps the device's primary context, which NCCL's resources live in, until the comm is gone.
    ctx: Arc<CudaContext>,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time; `NcclComm` is not
// `Sync` and every call takes `&mut self`, happens in `Drop`, or is one NCCL allows from any
// thread (`ncclCommGetAsyncError`, `ncclCommAbort`).
unsafe impl Send for NcclComm {}

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
            batching: false,
            batch_failed: Cell::new(false),
            sums: RefCell::default(),
            ctx,
        };
        comm.watchdog = Some(comm.start_watchdog(watch)?);
        Ok(comm)
    }

    fn start_watchdog(&self, watch: Watch) -> Result<Watchdog> {
        let probes = [self.gathers.probe(), self.reductions.probe()];
        let what = "the NCCL communicator's watchdog thread";
        Watchdog::start(what, watch, WATCHDOG_PERIOD, move || {
            probes.iter().find_map(Probe::failure)
        })
    }

    /// The device the communicator runs on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Issues `ops` in order as one NCCL group (`ncclGroupStart` / `ncclGroupEnd`), so that NCCL
    /// may run them together. Every op is checked before any is issued.
    ///
    /// # Safety
    /// As [`Communicator::all_gather`], for every op's regions.
    pub unsafe fn batch(
        &mut self,
        backend: &CudaBackend,
        stream: Stream,
        ops: &[Collective<'_>],
    ) -> Result<()> {
        let calls = ops
            .iter()
            .map(|op| match op {
                Collective::AllGather {
                    shard,
                    shard_region,
                    out,
                    out_region,
                } => all_gather_call(
                    self.world_size,
                    Extent::of(shard),
                    *shard_region,
                    Extent::of(out),
                    *out_region,
                ),
                Collective::ReduceScatter { buf, region, scale } => reduce_scatter_call(
                    self.world_size,
                    self.rank,
                    Extent::of(buf),
                    *region,
                    *scale,
                ),
            })
            .collect::<Result<Vec<_>>>()?;
        if calls.is_empty() {
            return Ok(());
        }
        let on = self.prepare(backend, stream, "ncclGroupStart")?;
        self.begin_batch()?;
        let issued = calls.iter().try_for_each(|call| self.issue(call, on));
        let ended = self.end_batch(backend);
        issued.and(ended)
    }

    /// Checks that `backend` is on the communicator's device and makes its context current;
    /// returns the stream to issue on.
    fn prepare<'b>(
        &self,
        backend: &'b CudaBackend,
        stream: Stream,
        call: &'static str,
    ) -> Result<&'b CudaStream> {
        if backend.ordinal() != self.device {
            return Err(Error::Nccl {
                call,
                code: NCCL_INVALID_ARGUMENT,
                message: format!(
                    "the backend is on device {}, the communicator on device {}",
                    backend.ordinal(),
                    self.device
                ),
            });
        }
        bind(backend.context_handle())?;
        Ok(backend.stream_handle(stream))
    }

    /// The communicator a call goes to: gathers and reductions each have their own.
    fn handle(&self, kind: Kind) -> &Handle {
        match kind {
            Kind::AllGather => &self.gathers,
            Kind::ReduceScatter { .. } | Kind::AllReduce { .. } => &self.reductions,
        }
    }

    fn issue(&self, call: &Call, stream: &CudaStream) -> Result<()> {
        if call.count == 0 {
            return Ok(());
        }
        let handle = self.handle(call.kind);
        let name = match call.kind {
            Kind::AllGather => "ncclAllGather",
            Kind::ReduceScatter { .. } => "ncclReduceScatter",
            Kind::AllReduce { .. } => "ncclAllReduce",
        };
        let comm = handle.raw(name).inspect_err(|_| {
            if self.batching {
                self.batch_failed.set(true);
            }
        })?;
        let s = stream.cu_stream() as cudaStream_t;
        let (send, recv) = (call.send as *const c_void, call.recv as *mut c_void);
        let dtype = nccl_dtype(call.dtype);
        let nccl = handle.nccl();
        // SAFETY: the addresses were checked against live buffers the caller borrows for this
        // call: `count` elements at `send`, and `count` (reduce-scatter, in place) or
        // `world_size * count` (all-gather, in another buffer) at `recv`; NCCL orders its work
        // on `stream` only.
        let queued = unsafe {
            match call.kind {
                Kind::AllGather => Ok((nccl.all_gather)(send, recv, call.count, dtype, comm, s)),
                Kind::ReduceScatter { scale } => scaled_sum(handle, &self.sums, scale, call.dtype)
                    .map(|op| (nccl.reduce_scatter)(send, recv, call.count, dtype, op, comm, s)),
                Kind::AllReduce { scale } => scaled_sum(handle, &self.sums, scale, call.dtype)
                    .map(|op| (nccl.all_reduce)(send, recv, call.count, dtype, op, comm, s)),
            }
        };
        if self.batching {
            // Inside a group the call only records the work, and the communicators stay as
            // they are until the group ended (`end_batch` aborts them after a failure).
            let recorded = queued.and_then(|status| handle.status(name, status));
            if recorded.is_err() {
                self.batch_failed.set(true);
            }
            return recorded;
        }
        match queued {
            Ok(status) => handle.settle(name, status, &self.watch, || {
                format!("NCCL's queueing of {name}")
            }),
            Err(e) => {
                handle.abort();
                Err(e)
            }
        }
    }
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
    // SAFETY: starts a group that the call below ends on every path.
    let status = unsafe { (nccl.group_start)() };
    nccl.check("ncclGroupStart", status, std::ptr::null_mut())?;
    let made = contexts
        .iter()
        .enumerate()
        .map(|(rank, ctx)| bind(ctx).and_then(|()| start(rank, ctx)))
        .collect::<Result<Vec<_>>>();
    // SAFETY: ends the group started above.
    let ended = unsafe { (nccl.group_end)() };
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

/// The reduction operator of `scale` in `dtype` on the reductions' communicator: `ncclSum`, or a
/// premultiplied sum made at its first use and kept until the communicator closes. NCCL may read
/// an operator until its call settled (a nonblocking `ncclInProgress`) or its group ended, so
/// none is destroyed between calls; a mean's factor is one operator for the communicator's life.
fn scaled_sum(
    handle: &Handle,
    made: &RefCell<Vec<(u32, DType, NcclRedOp)>>,
    scale: f32,
    dtype: DType,
) -> Result<NcclRedOp> {
    if scale == 1.0 {
        return Ok(NCCL_SUM);
    }
    let key = (scale.to_bits(), dtype);
    if let Some(&(_, _, op)) = made.borrow().iter().find(|(s, d, _)| (*s, *d) == key) {
        return Ok(op);
    }
    let comm = handle.raw("ncclRedOpCreatePreMulSum")?;
    // The scalar is passed in the data's dtype, as NCCL requires (rounded for bf16).
    let mut scalar = [0u8; 4];
    store_f32(&mut scalar, dtype, 0, scale);
    let mut op: NcclRedOp = NCCL_SUM;
    // SAFETY: NCCL writes one operator and reads the scalar, one element of `dtype`, during the
    // call (`ncclScalarHostImmediate`).
    let status = unsafe {
        (handle.nccl().red_op_create_pre_mul_sum)(
            &mut op,
            scalar.as_mut_ptr().cast(),
            nccl_dtype(dtype),
            NCCL_SCALAR_HOST_IMMEDIATE,
            comm,
        )
    };
    handle.status("ncclRedOpCreatePreMulSum", status)?;
    made.borrow_mut().push((key.0, key.1, op));
    Ok(op)
}

/// `ncclInvalidArgument`.
pub(crate) const NCCL_INVALID_ARGUMENT: i32 = 4;

impl Drop for NcclComm {
    fn drop(&mut self) {
        // The watchdog looks at the handles: it ends first.
        self.watchdog = None;
        // Errors cannot be reported here; the process keeps running without the communicator.
        let _ = bind(&self.ctx);
        // The operators end before their communicator (none of its calls is still queueing).
        if let Ok(comm) = self.reductions.raw("ncclRedOpDestroy") {
            for &(_, _, op) in self.sums.borrow().iter() {
                // SAFETY: made for this communicator, destroyed once; an error only leaks it.
                let _ = unsafe { (self.reductions.nccl().red_op_destroy)(op, comm) };
            }
        }
        self.reductions.close(&self.watch);
        self.gathers.close(&self.watch);
    }
}

impl Communicator<CudaBackend> for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    /// The engine's deadline for queueing and closing; the watchdog fails this watch on an
    /// asynchronous error, so the backend's waits under it end.
    fn set_watch(&mut self, watch: &Watch) {
        self.watch = watch.clone();
        // When the rank is aborted or fails off its thread (a collective past its deadline),
        // both communicators end, so that their kernels stop and the streams drain.
        let probes = [self.gathers.probe(), self.reductions.probe()];
        watch.on_end(Box::new(move || probes.iter().for_each(Probe::abort)));
        // Without a watchdog the hooks' health checks still find the errors.
        self.watchdog = None;
        self.watchdog = self.start_watchdog(watch.clone()).ok();
    }

    fn health(&self) -> Result<()> {
        self.gathers.in_progress("a collective")?;
        self.reductions.in_progress("a collective")?;
        Ok(())
    }

    fn abort(&self) {
        self.gathers.abort();
        self.reductions.abort();
    }

    fn begin_batch(&mut self) -> Result<()> {
        if self.batching {
            return Err(Error::Unsupported {
                backend: "communicator",
                what: "a batch of collectives inside another",
            });
        }
        let nccl = self.gathers.nccl();
        // SAFETY: starts a group that `end_batch` ends.
        let status = unsafe { (nccl.group_start)() };
        nccl.check("ncclGroupStart", status, std::ptr::null_mut())?;
        self.batching = true;
        Ok(())
    }

    fn end_batch(&mut self, backend: &CudaBackend) -> Result<()> {
        if !std::mem::replace(&mut self.batching, false) {
            return Ok(());
        }
        // NCCL takes the group's end on the thread's current device; the group ends whatever
        // happened, or later collectives of the thread would wait in it.
        let bound = bind(backend.context_handle());
        let nccl = self.gathers.nccl();
        // SAFETY: ends the group `begin_batch` started.
        let status = unsafe { (nccl.group_end)() };
        let mut result = bound;
        for handle in [&self.gathers, &self.reductions] {
            let settled = handle.settle("ncclGroupEnd", status, &self.watch, || {
                "NCCL's queueing of a group of collectives".into()
            });
            result = result.and(settled);
        }
        if self.batch_failed.replace(false) || result.is_err() {
            self.gathers.abort();
            self.reductions.abort();
        }
        result
    }

    unsafe fn all_gather(
        &mut self,
        backend: &CudaBackend,
        stream: Stream,
        _tag: Tag,
        shard: &CudaBuffer,
        shard_region: Region,
        out: &mut CudaBuffer,
        out_region: Region,
    ) -> Result<()> {
        let call = all_gather_call(
            self.world_size,
            Extent::of(shard),
            shard_region,
            Extent::of(out),
            out_region,
        )?;
        let on = self.prepare(backend, stream, "ncclAllGather")?;
        self.issue(&call, on)
    }

    unsafe fn all_gather_in_place(
        &mut self,
        backend: &CudaBackend,
        stream: Stream,
        _tag: Tag,
        buf: &mut CudaBuffer,
        region: Region,
    ) -> Result<()> {
        let call = all_gather_in_place_call(self.world_size, self.rank, Extent::of(buf), region)?;
        let on = self.prepare(backend, stream, "ncclAllGather")?;
        self.issue(&call, on)
    }

    unsafe fn reduce_scatter(
        &mut self,
        backend: &CudaBackend,
        stream: Stream,
        _tag: Tag,
        buf: &mut CudaBuffer,
        region: Region,
        scale: f32,
    ) -> Result<()> {
        let call = reduce_scatter_call(self.world_size, self.rank, Extent::of(buf), region, scale)?;
        let on = self.prepare(backend, stream, "ncclReduceScatter")?;
        self.issue(&call, on)
    }

    unsafe fn all_reduce(
        &mut self,
        backend: &CudaBackend,
        stream: Stream,
        _tag: Tag,
        buf: &mut CudaBuffer,
        region: Region,
        scale: f32,
    ) -> Result<()> {
        let call = all_reduce_call(Extent::of(buf), region, scale)?;
        let on = self.prepare(backend, stream, "ncclAllReduce")?;
        self.issue(&call, on)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: u64 = 0x7f00_0000_0000;

    fn extent(bytes: usize) -> Extent {
        Extent { base: BASE, bytes }
    }

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

    #[test]
    fn reduce_scatter_is_in_place_at_the_ranks_part() {
        let region = Region::new(8, 12, DType::F32);
        let call = reduce_scatter_call(3, 2, extent(80), region, 0.5).unwrap();
        assert_eq!(
            call,
            Call {
                kind: Kind::ReduceScatter { scale: 0.5 },
                send: BASE + 32,
                recv: BASE + 32 + 2 * 4 * 4,
                count: 4,
                dtype: DType::F32,
            }
        );
    }

    #[test]
    fn reduce_scatter_arguments_are_checked() {
        let err =
            reduce_scatter_call(2, 0, extent(64), Region::new(0, 3, DType::F32), 1.0).unwrap_err();
        assert!(matches!(err, Error::OutOfRange { len: 3, .. }), "{err:?}");
        let err =
            reduce_scatter_call(2, 0, extent(64), Region::new(0, 4, DType::F16), 1.0).unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{err:?}");
        // bf16: this rank's part is counted in 2-byte elements.
        let call = reduce_scatter_call(2, 1, extent(64), Region::new(2, 8, DType::Bf16), 1.0);
        assert!(
            matches!(call, Ok(Call { recv, count: 4, dtype: DType::Bf16, .. }) if recv == BASE + 4 + 8),
            "{call:?}"
        );
        let err =
            reduce_scatter_call(2, 1, extent(16), Region::new(2, 4, DType::F32), 1.0).unwrap_err();
        assert!(
            matches!(
                err,
                Error::OutOfRange {
                    offset: 2,
                    len: 4,
                    capacity: 4
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn all_gather_is_out_of_place_with_a_count_per_rank() {
        let call = all_gather_call(
            4,
            extent(8),
            Region::new(1, 3, DType::Bf16),
            Extent {
                base: BASE + 4096,
                bytes: 64,
            },
            Region::new(2, 12, DType::Bf16),
        )
        .unwrap();
        assert_eq!(
            call,
            Call {
                kind: Kind::AllGather,
                send: BASE + 2,
                recv: BASE + 4096 + 4,
                count: 3,
                dtype: DType::Bf16,
            }
        );
    }

    #[test]
    fn all_gather_arguments_are_checked() {
        let shard = Region::new(0, 2, DType::F32);
        let err = all_gather_call(
            2,
            extent(8),
            shard,
            extent(64),
            Region::new(0, 5, DType::F32),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                Error::OutOfRange {
                    len: 5,
                    capacity: 4,
                    ..
                }
            ),
            "{err:?}"
        );
        let err = all_gather_call(
            2,
            extent(8),
            shard,
            extent(64),
            Region::new(0, 4, DType::F16),
        )
        .unwrap_err();
        assert!(matches!(err, Error::OutOfRange { .. }), "{err:?}");
        let err = all_gather_call(
            2,
            extent(4),
            shard,
            extent(64),
            Region::new(0, 4, DType::F32),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                Error::OutOfRange {
                    offset: 0,
                    len: 2,
                    capacity: 1
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn version_codes_split_into_their_parts() {
        assert_eq!(split_version(22803), (2, 28, 3));
        assert_eq!(split_version(-1), (0, 0, 0));
    }

    /// Scaled reductions at world size 1 (NCCL runs them at one rank too): each factor's
    /// premultiplied sum is made once and kept, and every reduction scales by its own factor.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn a_premultiplied_sum_is_made_once_per_factor() {
        use crate::backend::Backend;
        let backend = CudaBackend::new(0).unwrap();
        let id = NcclComm::unique_id().unwrap();
        let mut comm = NcclComm::new(&id, 0, 1, &backend, Duration::from_secs(60)).unwrap();
        let values: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let region = Region::new(0, values.len(), DType::F32);
        let bytes: &[u8] = bytemuck::cast_slice(&values);
        for (seq, scale) in [0.5f32, 0.5, 0.25, 0.5, 1.0].into_iter().enumerate() {
            let mut buf = backend.alloc(bytes.len()).unwrap();
            backend.upload(&mut buf, region, bytes).unwrap();
            let tag = Tag {
                purpose: crate::comm::Purpose::Group(0),
                step: 0,
                seq: seq as u64,
            };
            // SAFETY: the buffer is this test's; the download orders itself after the stream.
            unsafe { comm.reduce_scatter(&backend, Stream::Reduce, tag, &mut buf, region, scale) }
                .unwrap();
            let mut out = vec![0u8; bytes.len()];
            backend.download(&buf, region, &mut out).unwrap();
            let want: Vec<f32> = values.iter().map(|v| v * scale).collect();
            assert_eq!(bytemuck::cast_slice::<u8, f32>(&out), want, "scale {scale}");
        }
        let made: Vec<(f32, DType)> = comm
            .sums
            .borrow()
            .iter()
            .map(|&(scale, dtype, _)| (f32::from_bits(scale), dtype))
            .collect();
        assert_eq!(made, [(0.5, DType::F32), (0.25, DType::F32)]);
    }

    #[test]
    fn dtypes_map_to_nccls() {
        assert_eq!(nccl_dtype(DType::Bf16), ncclDataType_t::ncclBfloat16);
        assert_eq!(nccl_dtype(DType::F16), ncclDataType_t::ncclFloat16);
        assert_eq!(nccl_dtype(DType::F32), ncclDataType_t::ncclFloat32);
    }
}
