//! NCCL collectives, one rank per GPU: across processes (a unique id made by one rank and passed
//! to the others by the caller) or from one process driving several GPUs.
//!
//! Calls go on the stream the engine names (the backend's gather or reduce stream) and do not
//! block the host; creating a communicator does, until every rank joined. All-gathers are out of
//! place; reduce-scatters sum f32 in NCCL's in-place form (`recv == send + rank * count`), which
//! is the layout [`Communicator::reduce_scatter`] asks for. Lengths, bounds and the device are
//! checked before every call. The library is loaded as `libnccl.so.2`, then `libnccl.so`, or from
//! the path in [`NCCL_LIBRARY_ENV`].

mod calls;
mod group;
mod handle;
mod library;
mod setup;

use std::cell::{Cell, RefCell};
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::sys::{cudaStream_t, ncclUniqueId};

use crate::backend::Region;
use crate::backend::cuda::{CudaBackend, CudaBuffer, bind, primary_context};
use crate::comm::hybrid::{self, Hybrid};
use crate::comm::launch::LaunchEnv;
use crate::comm::{Communicator, Tag};
use crate::dtype::store_f32;
use crate::error::{Error, Result};
use crate::spec::ProcessGroupSpec;
use crate::types::{DType, Stream};
use crate::watch::Watch;
use crate::watchdog::Watchdog;
use calls::{
    Call, Extent, Kind, all_gather_call, all_gather_in_place_call, all_reduce_call, nccl_dtype,
    reduce_scatter_call,
};
use group::NcclGroup;
use handle::{Handle, Pin, Probe};
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
    /// The group [`Communicator::begin_batch`] started, the collectives waiting for its end,
    /// and both communicators pinned until then (NCCL reads them at the group's end).
    batch: Option<(NcclGroup, [Pin; 2])>,
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
        // Held until the call returned; a group's handles stay pinned until the group ended.
        let use_ = handle.pin(name).inspect_err(|_| {
            if self.batch.is_some() {
                self.batch_failed.set(true);
            }
        })?;
        let comm = use_.raw();
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
        if self.batch.is_some() {
            // Inside a group the call only records the work, and the communicators stay as
            // they are until the group ended (`end_batch` aborts them after a failure).
            let recorded = queued.and_then(|status| handle.status(name, status));
            if recorded.is_err() {
                self.batch_failed.set(true);
            }
            return recorded;
        }
        drop(use_);
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
    let use_ = handle.pin("ncclRedOpCreatePreMulSum")?;
    let comm = use_.raw();
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
    drop(use_);
    handle.status("ncclRedOpCreatePreMulSum", status)?;
    made.borrow_mut().push((key.0, key.1, op));
    Ok(op)
}

/// `ncclInvalidArgument`.
pub(crate) const NCCL_INVALID_ARGUMENT: i32 = 4;

impl Drop for NcclComm {
    fn drop(&mut self) {
        // The watchdog looks at the handles: it ends first; a batch still open ends before its
        // communicators go.
        self.watchdog = None;
        self.batch = None;
        // Errors cannot be reported here; the process keeps running without the communicator.
        let _ = bind(&self.ctx);
        // The operators end before their communicator (none of its calls is still queueing).
        if let Ok(use_) = self.reductions.pin("ncclRedOpDestroy") {
            for &(_, _, op) in self.sums.borrow().iter() {
                // SAFETY: made for this communicator, destroyed once; an error only leaks it.
                let _ = unsafe { (self.reductions.nccl().red_op_destroy)(op, use_.raw()) };
            }
        }
        // A finalize that failed (a peer on the node stuck) would make the next one wait out
        // the deadline again: the other communicator is aborted instead.
        if self.reductions.close(&self.watch) {
            self.gathers.close(&self.watch);
        } else {
            self.gathers.abort();
        }
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
        if self.batch.is_some() {
            return Err(Error::Unsupported {
                backend: "communicator",
                what: "a batch of collectives inside another",
            });
        }
        let pins = [
            self.gathers.pin("ncclGroupStart")?,
            self.reductions.pin("ncclGroupStart")?,
        ];
        self.batch = Some((NcclGroup::start(self.gathers.nccl())?, pins));
        Ok(())
    }

    fn end_batch(&mut self, backend: &CudaBackend) -> Result<()> {
        let Some((group, pins)) = self.batch.take() else {
            return Ok(());
        };
        // NCCL takes the group's end on the thread's current device; the group ends whatever
        // happened, or later collectives of the thread would wait in it.
        let bound = bind(backend.context_handle());
        let status = group.end();
        // NCCL reads the communicators until the group's end returned; its settling below pins
        // each look, so that an abort asked meanwhile ends the poll at once.
        drop(pins);
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
}
