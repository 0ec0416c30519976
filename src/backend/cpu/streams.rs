//! The asynchronous CPU backend's streams: one worker thread each, running its queue in order.
//!
//! Before each operation a worker sleeps for a delay drawn from the backend's seed (mostly none,
//! sometimes tens of microseconds, now and then milliseconds), so work that the engine did not
//! order with events runs in another order than it was issued, as it would on a GPU.
//!
//! The streams capture work as CUDA captures a stream's into a graph: between
//! [`Streams::begin_capture`] and [`Streams::end_capture`] nothing queued runs. The stream the
//! capture began on takes part from the start; another joins by waiting for a point recorded in
//! the capture, and must be joined back (the first stream waits for its last point) before the
//! end. Work on a stream that did not join, a wait on a point outside the capture, a host wait
//! and a query of a captured point are errors, as they are for CUDA's global capture mode; so is
//! a stream's wait for a captured point outside its capture, which only a replay reaches. A
//! replay ([`Streams::replay`]) is one operation of the first stream: each joined stream's work
//! runs on a thread of its own, ordered only by the captured points, and the first stream's later
//! work follows all of it; the other streams' later work does not.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
// Every critical section here leaves its data whole: a panic elsewhere changes nothing.
use crate::sync::lock;
use crate::types::Stream;
use crate::watch::Watch;

/// How many of the watch's timeouts a wait on the rank's own streams lasts.
const LOCAL_WAIT_FACTOR: u32 = 4;

/// Work for a stream; its error fails the backend. Runs once a queueing, and again at each
/// replay of a capture that holds it.
pub(crate) type Job = Arc<dyn Fn() -> Result<()> + Send + Sync>;

enum Task {
    Run(Job),
    /// The stream reached this point.
    Mark(Arc<Marker>),
    /// The stream's later work waits for another stream's point.
    Wait(Arc<Marker>),
}

/// A point in a stream's queue, reached when the stream's worker gets there; a point recorded in
/// a capture is never reached: only its replays' copies are.
#[derive(Debug, Default)]
pub(crate) struct Marker {
    reached: Mutex<Option<Instant>>,
    changed: Condvar,
    captured: std::sync::atomic::AtomicBool,
}

impl Marker {
    fn reach(&self) {
        *lock(&self.reached) = Some(Instant::now());
        self.changed.notify_all();
    }

    /// Whether the stream reached the point; an error for a point recorded in a capture.
    pub(crate) fn is_reached(&self) -> Result<bool> {
        self.check_not_captured("a query of a point recorded in a capture")?;
        Ok(lock(&self.reached).is_some())
    }

    fn check_not_captured(&self, what: &str) -> Result<()> {
        match self.captured.load(std::sync::atomic::Ordering::Relaxed) {
            true => Err(Error::Capture { what: what.into() }),
            false => Ok(()),
        }
    }

    /// When the stream reached the point; blocks until then, within `watch`'s deadline.
    pub(crate) fn wait(&self, watch: &Watch, what: &'static str) -> Result<Instant> {
        let reached = watch.wait_while(
            lock(&self.reached),
            &self.changed,
            || what.to_string(),
            |reached| Ok(reached.is_none()),
        )?;
        // `wait_while` returned because the point was reached.
        Ok(reached.unwrap_or_else(Instant::now))
    }

    /// As [`Marker::wait`], for a wait on the rank's own streams (by the host, or by one stream
    /// for another): it ends at once when a stream failed, and its deadline is
    /// [`LOCAL_WAIT_FACTOR`] times the watch's, since the work it waits for has deadlines of its
    /// own, and the collective that fails first names what it waited for.
    fn wait_local(&self, watch: &Watch, fault: &Fault, what: &'static str) -> Result<Instant> {
        let local = Watch::new(watch.timeout().saturating_mul(LOCAL_WAIT_FACTOR));
        let reached = local.wait_while(
            lock(&self.reached),
            &self.changed,
            || what.to_string(),
            |reached| {
                fault.check()?;
                watch.check()?;
                Ok(reached.is_none())
            },
        )?;
        Ok(reached.unwrap_or_else(Instant::now))
    }
}

/// The first failure of any stream: later work is skipped, and every later call reports it.
#[derive(Debug, Default)]
struct Fault(Mutex<Option<(Stream, Arc<Error>)>>);

impl Fault {
    fn set(&self, stream: Stream, error: Error) {
        lock(&self.0).get_or_insert((stream, Arc::new(error)));
    }

    fn check(&self) -> Result<()> {
        match &*lock(&self.0) {
            None => Ok(()),
            Some((stream, cause)) => Err(Error::StreamFailed {
                stream: *stream,
                cause: Arc::clone(cause),
            }),
        }
    }
}

/// A seeded source of delays (splitmix64).
struct Delays(u64);

impl Delays {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE5_E4B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// 70% none, 27% 5 to 100 us, 3% 0.3 to 3 ms.
    fn draw(&mut self) -> Duration {
        let r = self.next();
        let spread = r >> 8;
        match r % 100 {
            0..70 => Duration::ZERO,
            70..97 => Duration::from_micros(5 + spread % 96),
            _ => Duration::from_micros(300 + spread % 2701),
        }
    }
}

const STREAMS: [Stream; 3] = [Stream::Compute, Stream::Gather, Stream::Reduce];

fn index(stream: Stream) -> usize {
    match stream {
        Stream::Compute => 0,
        Stream::Gather => 1,
        Stream::Reduce => 2,
    }
}

/// The three streams of an asynchronous CPU backend.
#[derive(Debug)]
pub(crate) struct Streams {
    queues: Vec<Sender<Task>>,
    workers: Vec<JoinHandle<()>>,
    fault: Arc<Fault>,
    /// The deadline and abort flag of the workers' and the host's waits.
    watch: Arc<Mutex<Watch>>,
    /// The capture under way, if any.
    capture: Mutex<Option<Capture>>,
    /// The seed of the delays of the streams and of the replays.
    seed: u64,
    replays: std::sync::atomic::AtomicU64,
}

/// One operation of a capture, on its stream.
#[derive(Clone)]
enum Captured {
    Run(Job),
    /// The stream reached the capture's point number `n`.
    Mark(usize),
    /// The stream's later work waits for the capture's point number `n`.
    Wait(usize),
}

/// What a capture under way holds.
struct Capture {
    origin: Stream,
    /// Each stream's operations, in order; `None` for a stream that has not joined.
    streams: [Option<Vec<Captured>>; 3],
    /// The points recorded in the capture: each with its stream and how many of that stream's
    /// operations come before it.
    points: Vec<(Arc<Marker>, Stream, usize)>,
}

impl std::fmt::Debug for Capture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ops = self
            .streams
            .each_ref()
            .map(|ops| ops.as_ref().map(Vec::len));
        write!(f, "Capture on {:?} ({ops:?} operations)", self.origin)
    }
}

impl Capture {
    /// Takes `task`, queued on `stream`, into the capture; gives it back where it goes to the
    /// stream as usual (a point or a wait of a stream that has not joined).
    fn take(&mut self, stream: Stream, task: Task) -> Result<Option<Task>> {
        let joined = &mut self.streams[index(stream)];
        match task {
            Task::Run(job) => match joined {
                Some(ops) => ops.push(Captured::Run(job)),
                None => {
                    return Err(Error::Capture {
                        what: format!(
                            "work on the {stream:?} stream, which did not join the capture (by a \
                             wait for a point captured on another stream)"
                        ),
                    });
                }
            },
            Task::Mark(marker) => match joined {
                Some(ops) => {
                    marker
                        .captured
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                    self.points.push((marker, stream, ops.len()));
                    ops.push(Captured::Mark(self.points.len() - 1));
                }
                None => return Ok(Some(Task::Mark(marker))),
            },
            Task::Wait(marker) => {
                let point = (self.points.iter()).position(|(p, ..)| Arc::ptr_eq(p, &marker));
                match (point, joined) {
                    (Some(n), joined) => joined.get_or_insert_default().push(Captured::Wait(n)),
                    (None, None) => return Ok(Some(Task::Wait(marker))),
                    (None, Some(_)) => {
                        return Err(Error::Capture {
                            what: format!(
                                "a wait of the {stream:?} stream for work outside the capture"
                            ),
                        });
                    }
                }
            }
        }
        Ok(None)
    }

    /// The capture's graph, once every stream that joined is joined back into the first.
    fn end(self, seed: u64) -> Result<CpuGraph> {
        let origin_ops = self.streams[index(self.origin)].as_deref().unwrap_or(&[]);
        // Joined back: the first stream waits for a point of `stream` after its last work.
        let joined_back = |stream: Stream, ops: &[Captured]| {
            let work = ops.iter().rposition(|op| matches!(op, Captured::Run(_)));
            origin_ops.iter().any(|op| match op {
                Captured::Wait(n) => {
                    let (_, on, at) = &self.points[*n];
                    *on == stream && work.is_none_or(|last| *at > last)
                }
                _ => false,
            })
        };
        for (stream, ops) in STREAMS.into_iter().zip(&self.streams) {
            let Some(ops) = ops else { continue };
            if stream != self.origin && !joined_back(stream, ops) {
                return Err(Error::Capture {
                    what: format!(
                        "the {stream:?} stream's work, not joined back into the {:?} stream (by \
                         a wait for a point recorded after it)",
                        self.origin
                    ),
                });
            }
        }
        let joined = STREAMS.into_iter().zip(self.streams);
        let streams = joined
            .filter_map(|(stream, ops)| Some((stream, ops?)))
            .collect();
        Ok(CpuGraph(Arc::new(Graph {
            origin: self.origin,
            streams,
            points: self.points.len(),
            seed,
        })))
    }
}

/// The work a capture took from the streams that joined it, replayable as one operation of the
/// stream it began on ([`crate::backend::Backend::replay`]).
#[derive(Clone)]
pub struct CpuGraph(Arc<Graph>);

impl std::fmt::Debug for CpuGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ops: Vec<_> = (self.0.streams.iter())
            .map(|(stream, ops)| (*stream, ops.len()))
            .collect();
        write!(f, "CpuGraph({ops:?})")
    }
}

struct Graph {
    origin: Stream,
    streams: Vec<(Stream, Vec<Captured>)>,
    points: usize,
    seed: u64,
}

impl std::fmt::Debug for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Task::Run(_) => "Run",
            Task::Mark(_) => "Mark",
            Task::Wait(_) => "Wait",
        })
    }
}

impl Streams {
    /// Starts one worker per stream, each drawing its delays from `seed`.
    pub(crate) fn start(seed: u64) -> Result<Streams> {
        let mut streams = Streams {
            queues: Vec::with_capacity(STREAMS.len()),
            workers: Vec::with_capacity(STREAMS.len()),
            fault: Arc::default(),
            watch: Arc::default(),
            capture: Mutex::default(),
            seed,
            replays: std::sync::atomic::AtomicU64::new(0),
        };
        for stream in STREAMS {
            let (queue, tasks) = channel();
            let (fault, watch) = (Arc::clone(&streams.fault), Arc::clone(&streams.watch));
            let delays = Delays(seed ^ (index(stream) as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
            let worker = std::thread::Builder::new()
                .name(format!("fsdp-cpu-{stream:?}").to_lowercase())
                .spawn(move || work(stream, tasks, delays, &fault, &watch))
                .map_err(|source| Error::Spawn {
                    what: "a CPU stream worker",
                    source: Arc::new(source),
                })?;
            streams.queues.push(queue);
            streams.workers.push(worker);
        }
        Ok(streams)
    }

    fn send(&self, stream: Stream, task: Task) -> Result<()> {
        self.fault.check()?;
        let task = match lock(&self.capture).as_mut() {
            Some(capture) => match capture.take(stream, task)? {
                Some(task) => task,
                None => return Ok(()),
            },
            None => task,
        };
        if let Task::Wait(marker) = &task {
            // Only a replay reaches a captured point: a stream waiting for it would wait for good.
            marker.check_not_captured("a wait for a point recorded in a capture, outside it")?;
        }
        self.queues[index(stream)]
            .send(task)
            .map_err(|_| Error::StreamFailed {
                stream,
                cause: Arc::new(Error::WorkerPanicked { stream }),
            })
    }

    /// Queues `job` on `stream`.
    pub(crate) fn run(&self, stream: Stream, job: Job) -> Result<()> {
        self.send(stream, Task::Run(job))
    }

    /// A marker that `stream` reaches after its work so far.
    pub(crate) fn record(&self, stream: Stream) -> Result<Arc<Marker>> {
        let marker = Arc::new(Marker::default());
        self.send(stream, Task::Mark(Arc::clone(&marker)))?;
        Ok(marker)
    }

    /// Makes `stream`'s later work wait until `marker` is reached.
    pub(crate) fn wait(&self, stream: Stream, marker: &Arc<Marker>) -> Result<()> {
        self.send(stream, Task::Wait(Arc::clone(marker)))
    }

    /// Blocks the host until `marker` is reached, or a stream failed; reports the failure. An
    /// error during a capture, or for a point recorded in one.
    pub(crate) fn synchronize(&self, marker: &Marker) -> Result<Instant> {
        self.check_not_capturing("a host wait")?;
        marker.check_not_captured("a host wait for a point recorded in a capture")?;
        let watch = lock(&self.watch).clone();
        let reached = marker.wait_local(&watch, &self.fault, "a host wait for a CPU stream");
        self.fault.check()?;
        reached
    }

    pub(crate) fn set_watch(&self, watch: &Watch) {
        *lock(&self.watch) = watch.clone();
    }

    /// An error, naming `what`, while a capture is under way.
    pub(crate) fn check_not_capturing(&self, what: &str) -> Result<()> {
        match lock(&self.capture).as_ref() {
            Some(capture) => Err(Error::Capture {
                what: format!(
                    "{what} during the capture on the {:?} stream",
                    capture.origin
                ),
            }),
            None => Ok(()),
        }
    }

    /// Begins capturing the work queued on `origin` and on the streams that join it.
    pub(crate) fn begin_capture(&self, origin: Stream) -> Result<()> {
        let mut capture = lock(&self.capture);
        if let Some(under_way) = capture.as_ref() {
            return Err(Error::Capture {
                what: format!(
                    "a capture inside the capture on the {:?} stream",
                    under_way.origin
                ),
            });
        }
        let mut streams = [None, None, None];
        streams[index(origin)] = Some(Vec::new());
        *capture = Some(Capture {
            origin,
            streams,
            points: Vec::new(),
        });
        Ok(())
    }

    /// Ends the capture under way: its graph, or an error where a stream was not joined back
    /// (the capture is dropped either way).
    pub(crate) fn end_capture(&self) -> Result<CpuGraph> {
        let capture = lock(&self.capture).take().ok_or_else(|| Error::Capture {
            what: "an end with no capture under way".into(),
        })?;
        let seed = self.seed ^ 0x5851_F42D_4C95_7F2D;
        capture.end(seed)
    }

    /// The stream the capture under way began on, if one is.
    pub(crate) fn capture_origin(&self) -> Option<Stream> {
        lock(&self.capture).as_ref().map(|c| c.origin)
    }

    /// Queues a replay of `graph` on the stream its capture began on.
    pub(crate) fn replay(&self, graph: &CpuGraph) -> Result<()> {
        let graph = Arc::clone(&graph.0);
        let replay = self
            .replays
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let watch = Arc::clone(&self.watch);
        let origin = graph.origin;
        let job: Job = Arc::new(move || run_graph(&graph, replay, &watch));
        self.send(origin, Task::Run(job))
    }
}

/// Runs replay number `replay` of `graph`: each stream's operations on a thread of its own, with
/// fresh points; returns when every one is done, with the first failure.
fn run_graph(graph: &Graph, replay: u64, watch: &Mutex<Watch>) -> Result<()> {
    let points = crate::fallible::with_capacity(graph.points, "a replay's points")?;
    let mut points: Vec<Marker> = points;
    points.extend((0..graph.points).map(|_| Marker::default()));
    let failed = Fault::default();
    let seed = graph.seed ^ replay.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    std::thread::scope(|scope| {
        for (stream, ops) in &graph.streams {
            let delays = Delays(seed ^ (index(*stream) as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
            let (points, failed) = (&points, &failed);
            let spawned = std::thread::Builder::new()
                .name(format!("fsdp-replay-{stream:?}").to_lowercase())
                .spawn_scoped(scope, move || {
                    replay_stream(*stream, ops, delays, points, (failed, watch));
                });
            if let Err(source) = spawned {
                failed.set(
                    *stream,
                    Error::Spawn {
                        what: "a replay's stream",
                        source: Arc::new(source),
                    },
                );
                // The streams already running end: their waits see the failure.
            }
        }
    });
    failed.check()
}

/// One stream's part of a replay, as a worker runs its queue.
fn replay_stream(
    stream: Stream,
    ops: &[Captured],
    mut delays: Delays,
    points: &[Marker],
    (failed, watch): (&Fault, &Mutex<Watch>),
) {
    for op in ops {
        let step = match op {
            Captured::Run(job) => Step::Run(job),
            Captured::Mark(n) => Step::Mark(&points[*n]),
            Captured::Wait(n) => Step::Wait(&points[*n], "a replayed stream's wait"),
        };
        take_step(stream, step, &mut delays, (failed, watch));
    }
}

/// One operation of a stream's worker, or of a replayed stream.
enum Step<'a> {
    Run(&'a Job),
    Mark(&'a Marker),
    /// A wait for the point, named for a deadline's error.
    Wait(&'a Marker, &'static str),
}

/// Takes `step` on `stream` after a delay drawn from `delays`: its failure goes to `fault`, and
/// after a failure later work is skipped, while points are still reached, so that no wait
/// outlives the failure.
fn take_step(
    stream: Stream,
    step: Step<'_>,
    delays: &mut Delays,
    (fault, watch): (&Fault, &Mutex<Watch>),
) {
    let delay = delays.draw();
    if !delay.is_zero() {
        std::thread::sleep(delay);
    }
    match step {
        Step::Mark(marker) => marker.reach(),
        Step::Run(_) | Step::Wait(..) if fault.check().is_err() => {}
        Step::Run(job) => match catch_unwind(AssertUnwindSafe(|| job())) {
            Ok(Ok(())) => {}
            Ok(Err(error)) => fault.set(stream, error),
            Err(_) => fault.set(stream, Error::WorkerPanicked { stream }),
        },
        Step::Wait(marker, what) => {
            let watch = lock(watch).clone();
            if let Err(error) = marker.wait_local(&watch, fault, what) {
                fault.set(stream, error);
            }
        }
    }
}

impl Drop for Streams {
    /// Lets every worker finish its queue, then joins it.
    fn drop(&mut self) {
        self.queues.clear();
        for worker in self.workers.drain(..) {
            // A worker catches its jobs' panics; joining it cannot fail otherwise.
            let _ = worker.join();
        }
    }
}

fn work(
    stream: Stream,
    tasks: Receiver<Task>,
    mut delays: Delays,
    fault: &Fault,
    watch: &Mutex<Watch>,
) {
    for task in tasks {
        let step = match &task {
            Task::Run(job) => Step::Run(job),
            Task::Mark(marker) => Step::Mark(marker),
            Task::Wait(marker) => Step::Wait(marker, "a CPU stream's wait for another"),
        };
        take_step(stream, step, &mut delays, (fault, watch));
    }
}
