//! Timelines of the compute, gather and reduce streams from an engine's timed events: a Chrome
//! trace (opens in Perfetto or chrome://tracing) and an SVG picture, so the overlap shows without
//! a profiler.

use std::fmt::Write;

use crate::backend::Backend;
use crate::error::Result;
use crate::types::{Stream, Unit};

/// What a traced span covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    /// The compute stream waiting for a unit's gathers, at the start of one of its hooks.
    GatherWait(Unit),
    Forward(Unit),
    Backward(Unit),
    AllGather {
        group: usize,
    },
    /// A reduce-scatter and the accumulation of its result into the group's gradient shard.
    ReduceScatter {
        group: usize,
    },
    Optimizer,
}

/// An interval of one stream's work, between two timed events.
#[derive(Debug)]
pub struct Span<E> {
    pub stream: Stream,
    pub kind: SpanKind,
    pub start: E,
    pub end: E,
}

/// A span placed in time: milliseconds from the origin event.
#[derive(Clone, Debug, PartialEq)]
pub struct TimedSpan {
    pub stream: Stream,
    pub kind: SpanKind,
    pub start_ms: f64,
    pub duration_ms: f64,
}

const STREAMS: [Stream; 3] = [Stream::Compute, Stream::Gather, Stream::Reduce];

fn lane(stream: Stream) -> usize {
    match stream {
        Stream::Compute => 0,
        Stream::Gather => 1,
        Stream::Reduce => 2,
    }
}

fn stream_name(stream: Stream) -> &'static str {
    match stream {
        Stream::Compute => "compute",
        Stream::Gather => "gather",
        Stream::Reduce => "reduce",
    }
}

fn unit_name(unit: Unit) -> String {
    match unit {
        Unit::Layer(i) => format!("unit {i}"),
        Unit::Root => "root".to_string(),
    }
}

/// A short label for a span.
pub fn label(kind: SpanKind) -> String {
    match kind {
        SpanKind::GatherWait(u) => format!("wait {}", unit_name(u)),
        SpanKind::Forward(u) => format!("fwd {}", unit_name(u)),
        SpanKind::Backward(u) => format!("bwd {}", unit_name(u)),
        SpanKind::AllGather { group } => format!("all-gather g{group}"),
        SpanKind::ReduceScatter { group } => format!("reduce-scatter g{group}"),
        SpanKind::Optimizer => "optimizer".to_string(),
    }
}

fn color(kind: SpanKind) -> &'static str {
    match kind {
        SpanKind::GatherWait(_) => "#d62728",
        SpanKind::Forward(_) => "#1f77b4",
        SpanKind::Backward(_) => "#9467bd",
        SpanKind::AllGather { .. } => "#2ca02c",
        SpanKind::ReduceScatter { .. } => "#ff7f0e",
        SpanKind::Optimizer => "#8c564b",
    }
}

/// Places `spans` in time relative to `origin`, a timed event recorded before them. Blocks until
/// the last span's work completed.
pub fn resolve<B: Backend>(
    backend: &B,
    origin: &B::Event,
    spans: &[Span<B::Event>],
) -> Result<Vec<TimedSpan>> {
    spans
        .iter()
        .map(|s| {
            Ok(TimedSpan {
                stream: s.stream,
                kind: s.kind,
                start_ms: f64::from(backend.elapsed_ms(origin, &s.start)?),
                duration_ms: f64::from(backend.elapsed_ms(&s.start, &s.end)?),
            })
        })
        .collect()
}

/// The total time the compute stream spent waiting for gathers.
pub fn gather_wait_ms(spans: &[TimedSpan]) -> f64 {
    spans
        .iter()
        .filter(|s| matches!(s.kind, SpanKind::GatherWait(_)))
        .map(|s| s.duration_ms)
        .sum()
}

/// A Chrome trace event list: one process per rank, one thread per stream, times in microseconds.
pub fn chrome_trace(ranks: &[Vec<TimedSpan>]) -> serde_json::Value {
    let mut events = Vec::new();
    for (rank, spans) in ranks.iter().enumerate() {
        events.push(serde_json::json!({
            "name": "process_name", "ph": "M", "pid": rank, "args": {"name": format!("rank {rank}")}
        }));
        for stream in STREAMS {
            events.push(serde_json::json!({
                "name": "thread_name", "ph": "M", "pid": rank, "tid": lane(stream),
                "args": {"name": stream_name(stream)}
            }));
        }
        for s in spans {
            events.push(serde_json::json!({
                "name": label(s.kind),
                "cat": stream_name(s.stream),
                "ph": "X",
                "pid": rank,
                "tid": lane(s.stream),
                "ts": s.start_ms * 1e3,
                "dur": s.duration_ms * 1e3,
            }));
        }
    }
    serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

/// An SVG picture of one rank's streams: a lane per stream, a box per span, a millisecond axis.
pub fn svg(spans: &[TimedSpan], title: &str) -> String {
    const WIDTH: f64 = 1400.0;
    const LEFT: f64 = 80.0;
    const LANE: f64 = 44.0;
    const TOP: f64 = 40.0;
    let end = spans
        .iter()
        .map(|s| s.start_ms + s.duration_ms)
        .fold(0.0f64, f64::max);
    let start = spans.iter().map(|s| s.start_ms).fold(end, f64::min);
    // No span, or spans of no length at one time, still give an axis.
    let span_ms = (end - start).max(1e-3);
    let scale = (WIDTH - LEFT - 20.0) / span_ms;
    let x = |ms: f64| LEFT + (ms - start) * scale;
    let height = TOP + LANE * 3.0 + 40.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="20" font-size="14">{}</text>"#,
        escape(title)
    );
    for stream in STREAMS {
        let y = TOP + LANE * lane(stream) as f64;
        let _ = writeln!(
            out,
            r#"<text x="4" y="{}">{}</text>"#,
            y + LANE / 2.0,
            stream_name(stream)
        );
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{0}" x2="{1}" y2="{0}" stroke="#ccc"/>"##,
            y + LANE - 4.0,
            WIDTH - 20.0
        );
    }
    for s in spans {
        let y = TOP + LANE * lane(s.stream) as f64 + 4.0;
        let w = (s.duration_ms * scale).max(0.5);
        let _ = writeln!(
            out,
            r#"<rect x="{:.2}" y="{y}" width="{w:.2}" height="{}" fill="{}"><title>{} {:.3} ms</title></rect>"#,
            x(s.start_ms),
            LANE - 12.0,
            color(s.kind),
            escape(&label(s.kind)),
            s.duration_ms
        );
    }
    let ticks = 10;
    for i in 0..=ticks {
        let ms = start + span_ms * f64::from(i) / f64::from(ticks);
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{:.2} ms</text>"#,
            x(ms),
            TOP + LANE * 3.0 + 20.0,
            ms - start
        );
    }
    out.push_str("</svg>\n");
    out
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(stream: Stream, kind: SpanKind, start_ms: f64, duration_ms: f64) -> TimedSpan {
        TimedSpan {
            stream,
            kind,
            start_ms,
            duration_ms,
        }
    }

    #[test]
    fn chrome_trace_has_a_complete_event_per_span_in_microseconds() {
        let spans = vec![
            span(Stream::Gather, SpanKind::AllGather { group: 2 }, 0.5, 0.25),
            span(Stream::Compute, SpanKind::Forward(Unit::Layer(1)), 1.0, 2.0),
        ];
        let trace = chrome_trace(&[spans]);
        let events: Vec<&serde_json::Value> = trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X")
            .collect();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0]["name"], "all-gather g2");
        assert_eq!(events[0]["tid"], 1);
        assert_eq!(events[0]["ts"], 500.0);
        assert_eq!(events[0]["dur"], 250.0);
        assert_eq!(events[1]["name"], "fwd unit 1");
    }

    #[test]
    fn svg_draws_each_span_in_its_lane() {
        let spans = vec![
            span(Stream::Compute, SpanKind::GatherWait(Unit::Root), 0.0, 1.0),
            span(
                Stream::Reduce,
                SpanKind::ReduceScatter { group: 0 },
                1.0,
                1.0,
            ),
        ];
        let picture = svg(&spans, "a <step>");
        assert_eq!(picture.matches("<rect").count(), 2);
        assert!(picture.contains("a &lt;step&gt;"));
        assert!(picture.contains("reduce-scatter g0 1.000 ms"));
        assert!(picture.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn svg_of_no_span_or_spans_of_no_length_has_finite_coordinates() {
        let instant = [span(
            Stream::Gather,
            SpanKind::AllGather { group: 1 },
            2.0,
            0.0,
        )];
        for spans in [&[][..], &instant[..]] {
            let picture = svg(spans, "t");
            assert!(
                !picture.contains("NaN") && !picture.contains("inf"),
                "{picture}"
            );
            assert!(picture.contains(r#"x="80.0""#), "{picture}");
        }
    }

    #[test]
    fn gather_wait_sums_only_waits() {
        let spans = vec![
            span(
                Stream::Compute,
                SpanKind::GatherWait(Unit::Layer(0)),
                0.0,
                0.5,
            ),
            span(Stream::Compute, SpanKind::Forward(Unit::Layer(0)), 0.5, 3.0),
            span(
                Stream::Compute,
                SpanKind::GatherWait(Unit::Layer(1)),
                3.5,
                0.25,
            ),
        ];
        assert_eq!(gather_wait_ms(&spans), 0.75);
    }
}
