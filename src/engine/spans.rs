//! Tracing: timed events around every hook's compute and every collective, as spans of the three
//! streams.

use super::Engine;
use crate::backend::Backend;
use crate::comm::Communicator;
use crate::error::Result;
use crate::schedule::Phase;
use crate::trace::{Span, SpanKind};
use crate::types::Stream;

/// The spans being collected, and the open forward and backward of each unit.
pub(super) struct Trace<E> {
    spans: Vec<Span<E>>,
    forward: Vec<Option<E>>,
    backward: Vec<Option<E>>,
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Starts collecting spans of every stream's work (clearing earlier ones), or stops.
    /// Starting is refused during a capture ([`Engine::begin_capture`]): a span's times are host
    /// reads of the device.
    pub fn set_tracing(&mut self, on: bool) -> Result<()> {
        if on {
            self.check_not_capturing("a trace, whose times are host reads of the device")?;
        }
        let units = self.plan.units().len();
        self.trace = on.then(|| Trace {
            spans: Vec::new(),
            forward: (0..units).map(|_| None).collect(),
            backward: (0..units).map(|_| None).collect(),
        });
        Ok(())
    }

    /// The spans collected since tracing started or since the last call.
    pub fn take_trace(&mut self) -> Vec<Span<B::Event>> {
        self.trace
            .as_mut()
            .map(|t| std::mem::take(&mut t.spans))
            .unwrap_or_default()
    }

    /// A timed event on `stream` when tracing, to delimit a span.
    pub(super) fn mark(&self, stream: Stream) -> Result<Option<B::Event>> {
        match self.trace {
            Some(_) => self.backend.record_timed(stream).map(Some),
            None => Ok(None),
        }
    }

    pub(super) fn push_span(
        &mut self,
        stream: Stream,
        kind: SpanKind,
        start: Option<B::Event>,
    ) -> Result<()> {
        if let Some(start) = start {
            let end = self.backend.record_timed(stream)?;
            if let Some(trace) = self.trace.as_mut() {
                trace.spans.push(Span {
                    stream,
                    kind,
                    start,
                    end,
                });
            }
        }
        Ok(())
    }

    /// Uses unit `u` for `phase`; when tracing, records the compute stream's wait for its gathers
    /// and opens the unit's compute span.
    pub(super) fn use_unit_traced(&mut self, u: usize, phase: Phase) -> Result<()> {
        let before = self.mark(Stream::Compute)?;
        self.use_unit(u)?;
        let unit = self.plan.units()[u];
        self.push_span(Stream::Compute, SpanKind::GatherWait(unit), before)?;
        let start = self.mark(Stream::Compute)?;
        if let Some(trace) = self.trace.as_mut() {
            match phase {
                Phase::Forward => trace.forward[u] = start,
                Phase::Backward => trace.backward[u] = start,
            }
        }
        Ok(())
    }

    /// Closes unit `u`'s compute span of `phase`, if tracing opened one.
    pub(super) fn end_span(&mut self, u: usize, phase: Phase) -> Result<()> {
        let unit = self.plan.units()[u];
        let (start, kind) = match (self.trace.as_mut(), phase) {
            (Some(t), Phase::Forward) => (t.forward[u].take(), SpanKind::Forward(unit)),
            (Some(t), Phase::Backward) => (t.backward[u].take(), SpanKind::Backward(unit)),
            (None, _) => return Ok(()),
        };
        self.push_span(Stream::Compute, kind, start)
    }
}
