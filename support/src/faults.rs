//! Communicators that misbehave on purpose, for the failure tests.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

pub use fsdp_fusion::backend::hold::Release;
use fsdp_fusion::backend::{Backend, Region};
use fsdp_fusion::comm::{Communicator, Purpose, Tag};
use fsdp_fusion::types::Stream;
use fsdp_fusion::watch::Watch;
use fsdp_fusion::{Error, Result};

/// A communicator seen as another kind: with `one_tag`, every collective goes out with one tag,
/// as over NCCL, so a local one compares nothing; `fault` set makes its health check fail, as
/// NCCL's asynchronous error does; `aborts` counts the engine's aborts; with `hang_at`, the
/// collective of that number (counted from 0 over every kind) is never issued: in its place its
/// stream waits until the rank ends ([`Watch::on_end`]: aborted, or failed by a collective past
/// its deadline), as a collective whose peer is stuck waits on the device.
pub struct Faulty<C> {
    pub inner: C,
    pub one_tag: bool,
    pub fault: Arc<AtomicBool>,
    pub aborts: Arc<AtomicUsize>,
    pub hang_at: Option<usize>,
    /// Collectives issued so far (the hung one counted).
    pub issued: Arc<AtomicUsize>,
    /// Set once the rank ended, which ends the hung collective's wait.
    pub released: Release,
}

impl<C> Faulty<C> {
    pub fn new(inner: C, one_tag: bool) -> Faulty<C> {
        Faulty {
            inner,
            one_tag,
            fault: Arc::default(),
            aborts: Arc::default(),
            hang_at: None,
            issued: Arc::default(),
            released: Release::default(),
        }
    }

    /// A communicator whose collective number `at` hangs on its stream until the rank ends.
    pub fn hanging(inner: C, at: usize) -> Faulty<C> {
        Faulty {
            hang_at: Some(at),
            ..Faulty::new(inner, false)
        }
    }

    /// Counts a collective; whether it is the one that hangs.
    fn hangs(&mut self) -> bool {
        let n = self.issued.fetch_add(1, Ordering::SeqCst);
        self.hang_at == Some(n)
    }

    /// With `one_tag`, one tag per stream: the ranks' collectives on a stream compare equal, and
    /// those on two streams never look like one collective.
    fn tag(&self, tag: Tag, stream: Stream) -> Tag {
        match self.one_tag {
            true => Tag {
                purpose: Purpose::Group(0),
                step: 0,
                seq: stream as u64,
            },
            false => tag,
        }
    }
}

/// The error a [`Faulty`] communicator's health check reports once its fault is set.
pub fn injected() -> Error {
    Error::Nccl {
        call: "ncclCommGetAsyncError",
        code: 6,
        message: "remote process exited or there was a network error".into(),
    }
}

/// Whether `e` is [`injected`]'s error.
pub fn is_injected(e: &Error) -> bool {
    matches!(e, Error::Nccl { call, code: 6, message }
        if *call == "ncclCommGetAsyncError" && message.starts_with("remote process exited"))
}

impl<B: Backend, C: Communicator<B>> Communicator<B> for Faulty<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn set_watch(&mut self, watch: &Watch) {
        self.inner.set_watch(watch);
        let released = self.released.clone();
        watch.on_end(Box::new(move || released.set()));
    }
    fn replica(&self) -> fsdp_fusion::comm::Replica {
        self.inner.replica()
    }
    fn grid_size(&self) -> usize {
        self.inner.grid_size()
    }
    fn health(&self) -> Result<()> {
        match self.fault.load(Ordering::SeqCst) {
            true => Err(injected()),
            false => self.inner.health(),
        }
    }
    fn abort(&self) {
        self.aborts.fetch_add(1, Ordering::SeqCst);
        self.inner.abort();
    }
    fn begin_batch(&mut self) -> Result<()> {
        self.inner.begin_batch()
    }
    fn end_batch(&mut self, backend: &B) -> Result<()> {
        self.inner.end_batch(backend)
    }
    unsafe fn all_gather(
        &mut self,
        backend: &B,
        stream: Stream,
        tag: Tag,
        shard: &B::Buffer,
        shard_region: Region,
        out: &mut B::Buffer,
        out_region: Region,
    ) -> Result<()> {
        if self.hangs() {
            return backend.hold(stream, &self.released);
        }
        let tag = self.tag(tag, stream);
        // SAFETY: the engine's own call, passed on.
        unsafe {
            self.inner
                .all_gather(backend, stream, tag, shard, shard_region, out, out_region)
        }
    }
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
        if self.hangs() {
            return backend.hold(stream, &self.released);
        }
        let tag = self.tag(tag, stream);
        // SAFETY: the engine's own call, passed on.
        unsafe {
            self.inner
                .all_gather_grid(backend, stream, tag, shard, shard_region, out, out_region)
        }
    }
    unsafe fn all_gather_in_place(
        &mut self,
        backend: &B,
        stream: Stream,
        tag: Tag,
        buf: &mut B::Buffer,
        region: Region,
    ) -> Result<()> {
        if self.hangs() {
            return backend.hold(stream, &self.released);
        }
        let tag = self.tag(tag, stream);
        // SAFETY: the engine's own call, passed on.
        unsafe {
            self.inner
                .all_gather_in_place(backend, stream, tag, buf, region)
        }
    }
    unsafe fn reduce_scatter(
        &mut self,
        backend: &B,
        stream: Stream,
        tag: Tag,
        buf: &mut B::Buffer,
        region: Region,
        scale: f32,
    ) -> Result<()> {
        if self.hangs() {
            return backend.hold(stream, &self.released);
        }
        let tag = self.tag(tag, stream);
        // SAFETY: the engine's own call, passed on.
        unsafe {
            self.inner
                .reduce_scatter(backend, stream, tag, buf, region, scale)
        }
    }
    unsafe fn all_reduce(
        &mut self,
        backend: &B,
        stream: Stream,
        tag: Tag,
        buf: &mut B::Buffer,
        region: Region,
        scale: f32,
    ) -> Result<()> {
        if self.hangs() {
            return backend.hold(stream, &self.released);
        }
        let tag = self.tag(tag, stream);
        // SAFETY: the engine's own call, passed on.
        unsafe {
            self.inner
                .all_reduce(backend, stream, tag, buf, region, scale)
        }
    }
}
