//! Communicators that misbehave on purpose, for the failure tests.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use fsdp_fusion::backend::{Backend, Region};
use fsdp_fusion::comm::{Communicator, Purpose, Tag};
use fsdp_fusion::types::Stream;
use fsdp_fusion::watch::Watch;
use fsdp_fusion::{Error, Result};

/// A communicator seen as another kind: with `one_tag`, every collective goes out with one tag,
/// as over NCCL, so a local one compares nothing; `fault` set makes its health check fail, as
/// NCCL's asynchronous error does; `aborts` counts the engine's aborts.
pub struct Faulty<C> {
    pub inner: C,
    pub one_tag: bool,
    pub fault: Arc<AtomicBool>,
    pub aborts: Arc<AtomicUsize>,
}

impl<C> Faulty<C> {
    pub fn new(inner: C, one_tag: bool) -> Faulty<C> {
        Faulty {
            inner,
            one_tag,
            fault: Arc::default(),
            aborts: Arc::default(),
        }
    }

    fn tag(&self, tag: Tag) -> Tag {
        match self.one_tag {
            true => Tag {
                purpose: Purpose::Group(0),
                step: 0,
                seq: 0,
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
        let tag = self.tag(tag);
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
        let tag = self.tag(tag);
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
        let tag = self.tag(tag);
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
        let tag = self.tag(tag);
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
        let tag = self.tag(tag);
        // SAFETY: the engine's own call, passed on.
        unsafe {
            self.inner
                .all_reduce(backend, stream, tag, buf, region, scale)
        }
    }
}
