//! Making a CUDA backend (its context, its three streams, its kernels), the handles a caller
//! may borrow, and the host's waits on the streams.

use std::sync::atomic::Ordering;

use super::*;

/// How long a host wait for the device sleeps between looks.
const POLL_PAUSE: Duration = Duration::from_micros(20);

/// Blocks until `event` completed, looking every [`POLL_PAUSE`], within `watch`'s deadline.
pub(super) fn wait_for(watch: &Watch, event: &CudaEvent) -> Result<()> {
    watch.poll(
        POLL_PAUSE,
        || "a host wait for the device".to_string(),
        || event.try_is_complete().map_err(cuda("cuEventQuery")),
    )
}

impl CudaBackend {
    /// A backend on device `ordinal`'s primary context with a compute stream of its own.
    /// `Error::CudaUnavailable` without a driver; `Error::Cuda` for a device that does not exist.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        let ctx = primary_context(ordinal)?;
        let compute = ctx.new_stream().map_err(cuda("cuStreamCreate"))?;
        CudaBackend::build(ctx, compute)
    }

    /// A backend whose compute stream is the caller's `stream`, which must belong to its
    /// device's primary context (`Error::Cuda` otherwise). The backend keeps the stream alive and
    /// drives it through a context handle of its own, so the caller's `CudaContext` keeps its
    /// settings (cudarc's event tracking included).
    pub fn with_stream(stream: Arc<CudaStream>) -> Result<CudaBackend> {
        let ordinal = stream.context().ordinal();
        let ctx = primary_context(ordinal)?;
        if stream.context().cu_ctx() != ctx.cu_ctx() {
            return Err(driver::cuda_error(
                "cuStreamGetCtx",
                CUresult::CUDA_ERROR_INVALID_CONTEXT,
                format!(
                    "the stream belongs to another context than device {ordinal}'s primary context"
                ),
            ));
        }
        // SAFETY: the stream belongs to `ctx`'s context (checked above), and the backend holds
        // the caller's handle, which keeps it alive, for as long as it lives.
        let compute = unsafe { ctx.wrap_borrowed_stream(stream.cu_stream()) };
        let mut backend = CudaBackend::build(ctx, compute)?;
        backend.caller_stream = Some(stream);
        Ok(backend)
    }

    /// A backend whose compute stream is a foreign stream handle (a `CUstream` / `cudaStream_t`,
    /// e.g. PyTorch's `torch.cuda.current_stream().cuda_stream`), on device `ordinal`'s primary
    /// context; 0 is the legacy default stream.
    ///
    /// The handle is checked to belong to that context (`Error::Cuda` from `cuStreamGetCtx`
    /// otherwise). The caller keeps ownership: the stream must stay alive until the backend and
    /// every buffer it made are dropped (memory from an allocator goes back after a wait on it),
    /// and it is never destroyed here.
    ///
    /// # Safety
    /// `stream` is 0 or a live stream handle (the driver cannot tell a freed handle from a live
    /// one), and it outlives the backend and its buffers.
    pub unsafe fn with_raw_stream(ordinal: usize, stream: u64) -> Result<CudaBackend> {
        let ctx = primary_context(ordinal)?;
        bind(&ctx)?;
        let raw = stream as usize as CUstream;
        let mut owner: CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle; the driver validates the stream handle.
        unsafe { cudarc::driver::sys::cuStreamGetCtx(raw, &mut owner) }
            .result()
            .map_err(cuda("cuStreamGetCtx"))?;
        if owner != ctx.cu_ctx() {
            return Err(driver::cuda_error(
                "cuStreamGetCtx",
                CUresult::CUDA_ERROR_INVALID_CONTEXT,
                format!(
                    "stream {stream:#x} belongs to another context than device {ordinal}'s primary context"
                ),
            ));
        }
        // SAFETY: the stream belongs to `ctx`; the caller keeps it alive (documented above) and
        // the wrapper never destroys it.
        let compute = unsafe { ctx.wrap_borrowed_stream(raw) };
        CudaBackend::build(ctx, compute)
    }

    fn build(ctx: Arc<CudaContext>, compute: Arc<CudaStream>) -> Result<CudaBackend> {
        bind(&ctx)?;
        let (_least, greatest) =
            result::stream::get_priority_range().map_err(cuda("cuCtxGetStreamPriorityRange"))?;
        let gather = ctx.new_stream().map_err(cuda("cuStreamCreate"))?;
        let reduce = ctx
            .new_stream_with_priority(greatest)
            .map_err(cuda("cuStreamCreateWithPriority"))?;
        let kernels = Kernels::load(&ctx)?;
        Ok(CudaBackend {
            ctx,
            compute,
            gather,
            reduce,
            kernels,
            tracker: Arc::default(),
            host_waits: AtomicU64::new(0),
            staging: Mutex::default(),
            caller_stream: None,
            allocator: None,
            watch: Watch::default(),
            events: Arc::default(),
            capture: Mutex::default(),
        })
    }

    /// The backend, with its buffers from now on (scratch included) taken from `allocator`
    /// rather than `cuMemAlloc`; they go back to it in stream order when dropped, so that the
    /// backend frees in stream order ([`Backend::frees_in_stream_order`]).
    pub fn with_allocator(mut self, allocator: Arc<dyn DeviceAllocator>) -> CudaBackend {
        self.allocator = Some(allocator);
        self
    }

    /// The device's context, as the backend drives it: cudarc's event tracking is off on it, so
    /// the memory cudarc allocates through it is not ordered across streams for the caller.
    ///
    /// # Safety
    /// Every buffer made through the handle, or used on a stream made from it, is ordered
    /// against its other streams' uses with events by the caller, and freed only once no stream
    /// still uses it.
    ///
    /// ```compile_fail
    /// // A safe call hands out no handle that would let safe code race the device.
    /// fn handle(b: &fsdp_fusion::backend::cuda::CudaBackend) {
    ///     let _ = b.context();
    /// }
    /// ```
    pub unsafe fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The context, for the crate's own calls (which order their work with events).
    pub(crate) fn context_handle(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// One of the rank's streams; the compute stream is the one to launch the model's work on.
    /// Its context has cudarc's event tracking off: cudarc does not order the memory used on it.
    ///
    /// # Safety
    /// As [`CudaBackend::context`]: the caller orders every use of memory on the stream against
    /// the other streams' with events, and frees memory only once no stream still uses it.
    ///
    /// ```compile_fail
    /// fn handle(b: &fsdp_fusion::backend::cuda::CudaBackend) {
    ///     let _ = b.stream(fsdp_fusion::Stream::Compute);
    /// }
    /// ```
    pub unsafe fn stream(&self, stream: Stream) -> &Arc<CudaStream> {
        self.stream_handle(stream)
    }

    /// The stream, for the crate's own calls (which order their work with events).
    pub(crate) fn stream_handle(&self, stream: Stream) -> &Arc<CudaStream> {
        match stream {
            Stream::Compute => &self.compute,
            Stream::Gather => &self.gather,
            Stream::Reduce => &self.reduce,
        }
    }

    pub(crate) fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// Allocates `bytes`, zero-filled as [`Backend::alloc`] says, counted by `tracker`.
    pub(super) fn alloc_counted(
        &self,
        bytes: usize,
        tracker: &Arc<Tracker>,
        contents: Contents,
    ) -> Result<CudaBuffer> {
        self.check_not_capturing("an allocation")?;
        let memory = match &self.allocator {
            None => BufferMemory::Driver(DeviceMemory::alloc(&self.ctx, bytes)?),
            Some(allocator) => {
                bind(&self.ctx)?;
                let streams = [&self.compute, &self.gather, &self.reduce].map(Arc::clone);
                let caller = self.caller_stream.clone();
                let lent = LentMemory::allocate(allocator, bytes, streams, caller)?;
                // The caller's allocator may have made another context current.
                bind(&self.ctx)?;
                BufferMemory::Lent(lent)
            }
        };
        let memory = CudaBuffer::new(memory, tracker);
        if bytes > 0 && contents == Contents::Zeroed {
            // SAFETY: the allocation holds `bytes` bytes and is not yet used by anything (lent
            // memory only by work queued on the compute stream before this fill).
            unsafe { result::memset_d8_async(memory.ptr(), 0, bytes, self.compute.cu_stream()) }
                .map_err(cuda("cuMemsetD8Async"))?;
            let zeroed = self.record_raw(Stream::Compute)?;
            for other in [&self.gather, &self.reduce] {
                other.wait(&zeroed).map_err(cuda("cuStreamWaitEvent"))?;
            }
        }
        Ok(memory)
    }

    pub(crate) fn record_raw(&self, stream: Stream) -> Result<PooledEvent> {
        self.events.record(&self.ctx, self.stream_handle(stream))
    }

    /// Counts a host wait, then blocks until `stream`'s work so far completed.
    pub(super) fn block_on(&self, stream: Stream) -> Result<()> {
        let reached = self.record_raw(stream)?;
        self.wait_for(&reached)
    }

    /// Counts a host wait, then blocks until `event` completed, within the watch's deadline.
    pub(super) fn wait_for(&self, event: &CudaEvent) -> Result<()> {
        self.check_not_capturing("a host wait")?;
        self.host_waits.fetch_add(1, Ordering::Relaxed);
        wait_for(&self.watch, event)
    }

    /// Makes the compute stream wait for the gather and reduce streams' work so far, so that a
    /// copy on it is ordered after every use of a buffer on any of the rank's streams.
    pub(super) fn join_on_compute(&self) -> Result<()> {
        for other in [Stream::Gather, Stream::Reduce] {
            let event = self.record_raw(other)?;
            self.compute
                .wait(&event)
                .map_err(cuda("cuStreamWaitEvent"))?;
        }
        Ok(())
    }

    pub(super) fn staging(&self) -> MutexGuard<'_, Staging> {
        // A panic while staging leaves at worst an area whose readers are waited on: keep going.
        lock(&self.staging)
    }

    /// `Error::Capture` naming `what` while a capture is under way: `what` would fail it.
    pub(super) fn check_not_capturing(&self, what: &str) -> Result<()> {
        no_capture_under_way(*lock(&self.capture), what)
    }

    /// `Error::Capture` unless a capture of `stream` is active (not begun, or invalidated by a
    /// call that failed it).
    pub(super) fn check_capture_active(&self, stream: Stream) -> Result<()> {
        let status = self
            .stream_handle(stream)
            .capture_status()
            .map_err(cuda("cuStreamIsCapturing"))?;
        match status {
            CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Ok(()),
            status => Err(Error::Capture {
                what: format!("work for a capture of the {stream:?} stream, which is {status:?}"),
            }),
        }
    }
}

/// `Error::Capture` naming `what` where `capture` is under way.
pub(super) fn no_capture_under_way(capture: Option<CaptureUnderWay>, what: &str) -> Result<()> {
    match capture {
        Some(under_way) => Err(Error::Capture {
            what: format!(
                "{what} during the capture on the {:?} stream",
                under_way.stream
            ),
        }),
        None => Ok(()),
    }
}
