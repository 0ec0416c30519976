//! The asynchronous CPU backend's streams: one worker thread each, running its queue in order.
//!
//! Before each operation a worker sleeps for a delay drawn from the backend's seed (mostly none,
//! sometimes tens of microseconds, now and then milliseconds), so work that the engine did not
//! order with events runs in another order than it was issued, as it would on a GPU.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::types::Stream;
use crate::watch::Watch;

/// How many of the watch's timeouts a wait on the rank's own streams lasts.
const LOCAL_WAIT_FACTOR: u32 = 4;

/// Work for a stream; its error fails the backend.
pub(crate) type Job = Box<dyn FnOnce() -> Result<()> + Send>;

enum Task {
    Run(Job),
    /// The stream reached this point.
    Mark(Arc<Marker>),
    /// The stream's later work waits for another stream's point.
    Wait(Arc<Marker>),
}

/// A point in a stream's queue, reached when the stream's worker gets there.
#[derive(Debug, Default)]
pub(crate) struct Marker {
    reached: Mutex<Option<Instant>>,
    changed: Condvar,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here leaves its data whole: a panic elsewhere changes nothing.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Marker {
    fn reach(&self) {
        *lock(&self.reached) = Some(Instant::now());
        self.changed.notify_all();
    }

    /// Whether the stream reached the point.
    pub(crate) fn is_reached(&self) -> bool {
        lock(&self.reached).is_some()
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

    /// Blocks the host until `marker` is reached, or a stream failed; reports the failure.
    pub(crate) fn synchronize(&self, marker: &Marker) -> Result<Instant> {
        let watch = lock(&self.watch).clone();
        let reached = marker.wait_local(&watch, &self.fault, "a host wait for a CPU stream");
        self.fault.check()?;
        reached
    }

    pub(crate) fn set_watch(&self, watch: &Watch) {
        *lock(&self.watch) = watch.clone();
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
        let delay = delays.draw();
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        match task {
            // After a failure later work is skipped; markers are still reached, so no wait
            // outlives the failure.
            Task::Mark(marker) => marker.reach(),
            Task::Run(_) | Task::Wait(_) if fault.check().is_err() => {}
            Task::Run(job) => match catch_unwind(AssertUnwindSafe(job)) {
                Ok(Ok(())) => {}
                Ok(Err(error)) => fault.set(stream, error),
                Err(_) => fault.set(stream, Error::WorkerPanicked { stream }),
            },
            Task::Wait(marker) => {
                let watch = lock(watch).clone();
                let waited = marker.wait_local(&watch, fault, "a CPU stream's wait for another");
                if let Err(error) = waited {
                    fault.set(stream, error);
                }
            }
        }
    }
}
