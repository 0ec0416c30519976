use std::time::Duration;

use super::*;
use crate::backend::Backend;
use crate::comm::Purpose;
use crate::types::DType;

/// The tag of the `seq`th collective of step 0, for group `group`.
fn tag(group: usize, seq: u64) -> Tag {
    Tag {
        purpose: Purpose::Group(group),
        step: 0,
        seq,
    }
}

/// Eager, then asynchronous backends of a few seeds.
const EVERY_MODE: [Option<u64>; 4] = [None, Some(1), Some(2), Some(3)];

/// Runs `f` on every rank of a group, one thread each, eagerly and then on asynchronous
/// backends of a few seeds; returns each run's results in rank order.
fn run<R: Send>(world: usize, f: impl Fn(LocalComm, CpuBackend) -> R + Sync) -> Vec<Vec<R>> {
    run_in(&EVERY_MODE, world, f)
}

/// As [`run`], in the given modes (`None` for eager, else a seed).
fn run_in<R: Send>(
    modes: &[Option<u64>],
    world: usize,
    f: impl Fn(LocalComm, CpuBackend) -> R + Sync,
) -> Vec<Vec<R>> {
    let backends = |seed: Option<u64>| -> Vec<CpuBackend> {
        (0..world)
            .map(|rank| match seed {
                None => CpuBackend::new(),
                Some(s) => CpuBackend::asynchronous(s * 31 + rank as u64).unwrap(),
            })
            .collect()
    };
    modes
        .iter()
        .map(|&seed| {
            let comms = LocalComm::group(world).unwrap();
            std::thread::scope(|s| {
                let handles: Vec<_> = comms
                    .into_iter()
                    .zip(backends(seed))
                    .map(|(c, b)| {
                        let f = &f;
                        s.spawn(move || f(c, b))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            })
        })
        .collect()
}

fn f32s(len: usize) -> Region {
    Region::new(0, len, DType::F32)
}

fn read(b: &CpuBackend, buf: &CpuBuffer, len: usize) -> Vec<f32> {
    let mut out = vec![0f32; len];
    b.download(buf, f32s(len), bytemuck::cast_slice_mut(&mut out))
        .unwrap();
    out
}

fn filled(b: &CpuBackend, values: &[f32]) -> CpuBuffer {
    let mut buf = b.alloc(values.len() * 4).unwrap();
    b.upload(&mut buf, f32s(values.len()), bytemuck::cast_slice(values))
        .unwrap();
    buf
}

#[test]
fn a_batch_runs_its_collectives_in_order_only_when_it_ends() {
    let runs = run_in(&[None], 2, |mut c, b| {
        let r = c.rank() as f32;
        let shard = filled(&b, &[r]);
        let mut out = filled(&b, &[-1.0, -1.0]);
        let mut sums = filled(&b, &[r + 1.0, 10.0 * r]);
        c.begin_batch().unwrap();
        assert!(matches!(c.begin_batch(), Err(Error::Unsupported { .. })));
        unsafe {
            c.all_gather(
                &b,
                Stream::Gather,
                tag(0, 0),
                &shard,
                f32s(1),
                &mut out,
                f32s(2),
            )
            .unwrap();
            c.reduce_scatter(&b, Stream::Reduce, tag(1, 1), &mut sums, f32s(2), 1.0)
                .unwrap();
        }
        // The eager backend ran nothing yet: the collectives wait for the batch's end.
        let before = (read(&b, &out, 2), read(&b, &sums, 2));
        c.end_batch(&b).unwrap();
        (before, read(&b, &out, 2), read(&b, &sums, 2))
    });
    for (rank, (before, gathered, summed)) in runs[0].iter().enumerate() {
        let r = rank as f32;
        assert_eq!(before, &(vec![-1.0, -1.0], vec![r + 1.0, 10.0 * r]));
        assert_eq!(gathered, &vec![0.0, 1.0]);
        assert_eq!(summed[rank], [3.0, 10.0][rank], "rank {rank}");
    }
}

#[test]
fn all_gather_places_each_rank_in_order() {
    let runs = run(3, |mut c, b| {
        let r = c.rank() as f32;
        let shard = filled(&b, &[r, r + 0.5]);
        let mut full = b.alloc(24).unwrap();
        // SAFETY: both buffers are used on the gather stream only, then downloaded.
        unsafe {
            c.all_gather(
                &b,
                Stream::Gather,
                tag(0, 0),
                &shard,
                f32s(2),
                &mut full,
                f32s(6),
            )
        }
        .unwrap();
        read(&b, &full, 6)
    });
    for out in runs.into_iter().flatten() {
        assert_eq!(out, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
    }
}

#[test]
fn reduce_scatter_sums_in_rank_order() {
    // Values whose sum depends on the order of addition in f32.
    let vals = [1e8f32, 1.0, -1e8, 1.0];
    let ordered = ((vals[0] + vals[1]) + vals[2]) + vals[3];
    let runs = run(4, |mut c, b| {
        let mut buf = filled(&b, &[vals[c.rank()]; 4]);
        // SAFETY: the buffer is used on the reduce stream only, then downloaded.
        unsafe { c.reduce_scatter(&b, Stream::Reduce, tag(0, 0), &mut buf, f32s(4), 1.0) }.unwrap();
        read(&b, &buf, 4)[c.rank()]
    });
    for out in runs {
        assert_eq!(out, vec![ordered; 4]);
    }
}

#[test]
fn all_reduce_leaves_the_rank_ordered_sum_on_every_rank() {
    let vals = [1e8f32, 1.0, -1e8, 1.0];
    let ordered = ((vals[0] * 0.5 + vals[1] * 0.5) + vals[2] * 0.5) + vals[3] * 0.5;
    let runs = run(4, |mut c, b| {
        let mut buf = filled(&b, &[7.0, vals[c.rank()], vals[c.rank()], 7.0]);
        // SAFETY: the buffer is used on the reduce stream only, then downloaded.
        unsafe {
            c.all_reduce(
                &b,
                Stream::Reduce,
                tag(0, 0),
                &mut buf,
                Region::new(1, 2, DType::F32),
                0.5,
            )
        }
        .unwrap();
        read(&b, &buf, 4)
    });
    for out in runs {
        assert_eq!(out, vec![vec![7.0, ordered, ordered, 7.0]; 4]);
    }
    let f16 = run_in(&[None], 1, |mut c, b| {
        let mut buf = b.alloc(8).unwrap();
        let region = Region::new(0, 4, DType::F16);
        unsafe { c.all_reduce(&b, Stream::Reduce, tag(0, 0), &mut buf, region, 1.0) }
    });
    assert!(matches!(f16[0][0], Err(Error::Unsupported { .. })));
}

#[test]
fn a_scaled_sum_keeps_a_finite_mean_where_the_plain_sum_overflows() {
    let big = 3e38f32;
    let runs = run(2, |mut c, b| {
        let mut buf = filled(&b, &[big; 2]);
        // SAFETY: the buffer is used on the reduce stream only, then downloaded.
        unsafe { c.reduce_scatter(&b, Stream::Reduce, tag(0, 0), &mut buf, f32s(2), 0.5) }.unwrap();
        read(&b, &buf, 2)[c.rank()]
    });
    assert!((big + big).is_infinite());
    for out in runs {
        assert_eq!(out, vec![0.5 * big + 0.5 * big; 2]);
        assert!(out[0].is_finite());
    }
}

#[test]
fn a_gather_and_a_reduction_in_flight_at_once_each_meet_their_own() {
    // Rank 0 issues the reduction first, rank 1 the gather: each stream kind pairs its own.
    // (Eager ranks would each block in a different collective.)
    let runs = run_in(&EVERY_MODE[1..], 2, |mut c, b| {
        let rank = c.rank() as f32;
        let shard = filled(&b, &[rank]);
        let mut full = b.alloc(8).unwrap();
        let mut grads = filled(&b, &[rank + 1.0; 2]);
        // SAFETY: each buffer is used on one stream only, then downloaded.
        unsafe {
            let gather = |c: &mut LocalComm, full: &mut CpuBuffer| {
                c.all_gather(
                    &b,
                    Stream::Gather,
                    tag(0, 0),
                    &shard,
                    f32s(1),
                    full,
                    f32s(2),
                )
            };
            if c.rank() == 0 {
                c.reduce_scatter(&b, Stream::Reduce, tag(1, 1), &mut grads, f32s(2), 1.0)
                    .unwrap();
                gather(&mut c, &mut full).unwrap();
            } else {
                gather(&mut c, &mut full).unwrap();
                c.reduce_scatter(&b, Stream::Reduce, tag(1, 1), &mut grads, f32s(2), 1.0)
                    .unwrap();
            }
        }
        (read(&b, &full, 2), read(&b, &grads, 2)[c.rank()])
    });
    for out in runs {
        assert_eq!(out, vec![(vec![0.0, 1.0], 3.0); 2]);
    }
}

/// The error a collective gave: at once on an eager backend, at the next call otherwise.
/// The collective's outcome once its stream is done, a stream's failure as its cause (on an
/// asynchronous backend a failure may already show when the next call is issued).
fn outcome(b: &CpuBackend, issued: Result<()>) -> Result<(), Arc<Error>> {
    let cause = |e: Error| match e {
        Error::StreamFailed { cause, .. } => cause,
        e => Arc::new(e),
    };
    issued.map_err(cause)?;
    b.synchronize(&b.record(Stream::Reduce).map_err(cause)?)
        .map_err(cause)
}

/// The outcome of a reduce-scatter of 2 f32 for group 0, the first collective of step 0.
fn reduce_scatter_once(c: &mut LocalComm, b: &CpuBackend) -> Result<(), Arc<Error>> {
    let mut buf = b.alloc(8).unwrap();
    // SAFETY: the buffer is used on the reduce stream only.
    let issued = unsafe { c.reduce_scatter(b, Stream::Reduce, tag(0, 0), &mut buf, f32s(2), 1.0) };
    outcome(b, issued)
}

#[test]
fn mismatched_collectives_are_reported_on_every_rank() {
    let runs = run(2, |mut c, b| {
        let n = 2 + c.rank() * 2;
        let mut buf = b.alloc(n * 4).unwrap();
        // SAFETY: the buffer is used on the reduce stream only.
        let issued =
            unsafe { c.reduce_scatter(&b, Stream::Reduce, tag(0, 0), &mut buf, f32s(n), 1.0) };
        outcome(&b, issued)
    });
    for r in runs.into_iter().flatten() {
        assert!(
            matches!(
                r.as_ref().map_err(|e| &**e),
                Err(Error::CollectiveMismatch { rank: 1, .. })
            ),
            "{r:?}"
        );
    }
}

#[test]
fn a_rank_that_leaves_fails_the_others_instead_of_hanging() {
    let runs = run(2, |mut c, b| {
        if c.rank() == 1 {
            drop(c);
            return Ok(());
        }
        reduce_scatter_once(&mut c, &b)
    });
    for out in runs {
        let left = out[0].as_ref().map_err(|e| &**e);
        assert!(
            matches!(left, Err(Error::PeerGone { rank: 1, .. })),
            "{out:?}"
        );
    }
}

#[test]
fn lengths_are_checked_before_communicating() {
    let mut comms = LocalComm::group(2).unwrap();
    let b = CpuBackend::new();
    let mut buf = b.alloc(12).unwrap();
    // SAFETY: refused before anything is queued.
    let err =
        unsafe { comms[0].reduce_scatter(&b, Stream::Reduce, tag(0, 0), &mut buf, f32s(3), 1.0) }
            .unwrap_err();
    assert!(matches!(err, Error::OutOfRange { len: 3, .. }));
    assert!(matches!(LocalComm::group(0), Err(Error::ZeroWorldSize)));
}

#[test]
fn collectives_of_one_size_for_different_groups_are_a_mismatch_naming_both() {
    let runs = run(2, |mut c, b| {
        let mut buf = b.alloc(16).unwrap();
        // Rank 0 reduces group 0 first, rank 1 group 1: equal sizes, different purposes.
        let group = c.rank();
        // SAFETY: the buffer is used on the reduce stream only.
        let issued =
            unsafe { c.reduce_scatter(&b, Stream::Reduce, tag(group, 0), &mut buf, f32s(4), 1.0) };
        outcome(&b, issued)
    });
    for r in runs.into_iter().flatten() {
        match r.as_ref().map_err(|e| &**e) {
            Err(Error::CollectiveMismatch {
                rank: 1,
                expected,
                got,
            }) => {
                assert!(expected.contains("group 0"), "{expected}");
                assert!(got.contains("group 1"), "{got}");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_peer_that_never_comes_is_a_timeout_and_an_abort_ends_the_wait() {
    let runs = run(2, |mut c, b| {
        if c.rank() == 1 {
            // Stays in the group without taking part, past rank 0's deadline.
            std::thread::sleep(Duration::from_millis(300));
            return Ok(());
        }
        c.set_watch(&Watch::new(Duration::from_millis(50)));
        reduce_scatter_once(&mut c, &b)
    });
    for out in runs {
        let waited = out[0].as_ref().map_err(|e| &**e);
        assert!(
            matches!(waited, Err(Error::Timeout { op, .. }) if op.contains("reduce-scatter of group 0")),
            "{out:?}"
        );
    }
    // An abort while the collective waits ends the wait; one before the collective is its
    // error too, not the departure from the group that an abort also marks.
    for delay in [Some(Duration::from_millis(30)), None] {
        let runs = run(2, |mut c, b| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(300));
                return Ok(());
            }
            let watch = Watch::default();
            c.set_watch(&watch);
            let aborter = watch.clone();
            let abort = move || {
                if let Some(delay) = delay {
                    std::thread::sleep(delay);
                }
                aborter.abort();
            };
            let during = match delay {
                Some(_) => Some(std::thread::spawn(abort)),
                None => {
                    abort();
                    None
                }
            };
            let r = reduce_scatter_once(&mut c, &b);
            if let Some(during) = during {
                during.join().unwrap();
            }
            r
        });
        for out in runs {
            assert!(
                matches!(out[0].as_ref().map_err(|e| &**e), Err(Error::Aborted)),
                "{delay:?}: {out:?}"
            );
        }
    }
}

#[test]
fn a_rank_whose_watch_left_fails_its_peers_at_once() {
    let runs = run(2, |mut c, b| {
        let watch = Watch::default();
        c.set_watch(&watch);
        if c.rank() == 1 {
            watch.leave();
            std::thread::sleep(Duration::from_millis(200));
            return Ok(());
        }
        reduce_scatter_once(&mut c, &b)
    });
    for out in runs {
        let gone = out[0].as_ref().map_err(|e| &**e);
        assert!(
            matches!(gone, Err(Error::PeerGone { rank: 1, .. })),
            "{out:?}"
        );
    }
}

#[test]
fn a_rank_that_leaves_ends_its_own_collective_at_once() {
    let runs = run(2, |mut c, b| {
        if c.rank() == 1 {
            // Stays in the group without taking part.
            std::thread::sleep(Duration::from_millis(300));
            return Ok(());
        }
        let watch = Watch::new(Duration::from_secs(30));
        c.set_watch(&watch);
        let leaver = watch.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            leaver.leave();
        });
        let start = std::time::Instant::now();
        let r = reduce_scatter_once(&mut c, &b);
        t.join().unwrap();
        assert!(start.elapsed() < Duration::from_secs(10), "{r:?}");
        r
    });
    for out in runs {
        let gone = out[0].as_ref().map_err(|e| &**e);
        assert!(
            matches!(gone, Err(Error::PeerGone { rank: 0, .. })),
            "{out:?}"
        );
    }
}
