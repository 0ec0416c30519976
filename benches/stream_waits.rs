//! Whether ranks on one GPU can meet through device memory instead of on the host: each rank's
//! streams write a flag (`cuStreamWriteValue32`) and wait for every other rank's
//! (`cuStreamWaitValue32`), as a loopback collective would, with no host wait between ranks.
//!
//! A stream's wait blocks the hardware queue the stream is mapped onto, and CUDA maps streams onto
//! `CUDA_DEVICE_MAX_CONNECTIONS` queues (8 unless set before the context is made, at most 32):
//! when two ranks' streams share a queue, a wait queued ahead of the flag it waits for never
//! ends. Each case runs in a child process with the variable set, is killed if it outlives its
//! deadline, and reports whether its barriers completed, and in how long per barrier:
//!
//!     .gpu/bin/bench-stream_waits [--barriers 200] [--deadline-s 15]
//!
//! A case issues `barriers` barriers on every rank's 3 streams (the engine's compute, gather and
//! reduce), each stream after the previous one of its rank through an event; "interleaved"
//! issues barrier k of every rank before barrier k + 1, "rank-major" every barrier of rank 0 first
//! (one rank running ahead). "batched" queues a stream's flag write and waits in one
//! `cuStreamBatchMemOp`. A case whose barriers do not complete within 5 s writes every flag
//! from the host, which should release every wait, and says whether it did.

use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use cudarc::driver::sys::{self, CUresult};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 200)]
    barriers: u32,
    /// Seconds after which a case's child process is killed as hung.
    #[arg(long, default_value_t = 15)]
    deadline_s: u64,
    /// Runs one case in this process: RANKS,ORDER,ISSUE (ORDER interleaved or rank-major, ISSUE
    /// single or batched).
    #[arg(long)]
    case: Option<String>,
    /// Accepted and ignored, as cargo bench passes it.
    #[arg(long, hide = true)]
    bench: bool,
}

const STREAMS_PER_RANK: usize = 3;
/// How long a case's barriers get before the host releases the flags.
const DEVICE_DEADLINE: Duration = Duration::from_secs(5);
const RELEASE: u32 = 0x7fff_ffff;

fn check(call: &str, r: CUresult) -> Result<(), String> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{call} failed: {r:?}"))
    }
}

/// Polls every stream until all are idle or `deadline` passes; whether they finished.
fn drained(streams: &[sys::CUstream], deadline: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < deadline {
        // SAFETY: every stream is a live stream of the current context.
        if streams
            .iter()
            .all(|&s| unsafe { sys::cuStreamQuery(s) } == CUresult::CUDA_SUCCESS)
        {
            return true;
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    false
}

/// One case in this process; prints its outcome as one line.
fn run_case(case: &str, barriers: u32) -> Result<(), String> {
    let fields: Vec<&str> = case.split(',').collect();
    let [ranks, order, issue] = fields[..] else {
        return Err(format!("--case {case:?} is not RANKS,ORDER,ISSUE"));
    };
    let ranks: usize = ranks.parse().map_err(|e| format!("ranks {ranks:?}: {e}"))?;
    let rank_major = order == "rank-major";
    let batched = issue == "batched";
    if ranks == 0 || ranks > 32 {
        return Err(format!("ranks {ranks} is not in 1..=32"));
    }
    let streams_total = ranks * STREAMS_PER_RANK;
    // SAFETY: plain driver calls on handles made here, in this process's one context; the flags
    // are page-locked host memory mapped into the device, alive until the process ends.
    unsafe {
        check("cuInit", sys::cuInit(0))?;
        let mut dev = 0;
        check("cuDeviceGet", sys::cuDeviceGet(&mut dev, 0))?;
        let mut ctx = std::ptr::null_mut();
        check(
            "cuDevicePrimaryCtxRetain",
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
        )?;
        check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        check(
            "cuMemHostAlloc",
            sys::cuMemHostAlloc(&mut host, streams_total * 4, sys::CU_MEMHOSTALLOC_DEVICEMAP),
        )?;
        let flags_host = host.cast::<u32>();
        for i in 0..streams_total {
            flags_host.add(i).write_volatile(0);
        }
        let mut flags: sys::CUdeviceptr = 0;
        check(
            "cuMemHostGetDevicePointer",
            sys::cuMemHostGetDevicePointer_v2(&mut flags, host, 0),
        )?;
        let mut streams = Vec::with_capacity(streams_total);
        let mut events = Vec::with_capacity(streams_total);
        for _ in 0..streams_total {
            let mut s = std::ptr::null_mut();
            check(
                "cuStreamCreate",
                sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
            )?;
            streams.push(s);
            let mut e = std::ptr::null_mut();
            check(
                "cuEventCreate",
                sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32),
            )?;
            events.push(e);
        }
        // Stream `s` of every rank meets through flags `s * ranks ..`, one per rank.
        let flag = |stream: usize, rank: usize| flags + 4 * (stream * ranks + rank) as u64;
        let barrier = |rank: usize, k: u32| -> Result<(), String> {
            for s in 0..STREAMS_PER_RANK {
                let on = streams[rank * STREAMS_PER_RANK + s];
                if s > 0 {
                    let before = events[rank * STREAMS_PER_RANK + s - 1];
                    check("cuStreamWaitEvent", sys::cuStreamWaitEvent(on, before, 0))?;
                }
                let peers = (0..ranks).filter(|&q| q != rank);
                if batched {
                    let mut ops: Vec<sys::CUstreamBatchMemOpParams> = Vec::new();
                    let mut write: sys::CUstreamBatchMemOpParams = std::mem::zeroed();
                    write.writeValue.operation =
                        sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_32;
                    write.writeValue.address = flag(s, rank);
                    write.writeValue.__bindgen_anon_1.value = k;
                    ops.push(write);
                    for q in peers {
                        let mut wait: sys::CUstreamBatchMemOpParams = std::mem::zeroed();
                        wait.waitValue.operation =
                            sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_32;
                        wait.waitValue.address = flag(s, q);
                        wait.waitValue.__bindgen_anon_1.value = k;
                        wait.waitValue.flags =
                            sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
                        ops.push(wait);
                    }
                    check(
                        "cuStreamBatchMemOp",
                        sys::cuStreamBatchMemOp_v2(on, ops.len() as u32, ops.as_mut_ptr(), 0),
                    )?;
                } else {
                    check(
                        "cuStreamWriteValue32",
                        sys::cuStreamWriteValue32_v2(on, flag(s, rank), k, 0),
                    )?;
                    for q in peers {
                        check(
                            "cuStreamWaitValue32",
                            sys::cuStreamWaitValue32_v2(
                                on,
                                flag(s, q),
                                k,
                                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
                            ),
                        )?;
                    }
                }
                let after = events[rank * STREAMS_PER_RANK + s];
                check("cuEventRecord", sys::cuEventRecord(after, on))?;
            }
            Ok(())
        };
        let start = Instant::now();
        if rank_major {
            for rank in 0..ranks {
                for k in 1..=barriers {
                    barrier(rank, k)?;
                }
            }
        } else {
            for k in 1..=barriers {
                for rank in 0..ranks {
                    barrier(rank, k)?;
                }
            }
        }
        let issued = start.elapsed();
        let done = drained(&streams, DEVICE_DEADLINE);
        let total = start.elapsed();
        let per = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(barriers);
        if done {
            println!(
                "completed: issue {:.1} us, done {:.1} us per barrier",
                per(issued),
                per(total)
            );
        } else {
            for i in 0..streams_total {
                std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
                flags_host.add(i).write_volatile(RELEASE);
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            let released = drained(&streams, DEVICE_DEADLINE);
            println!(
                "deadlocked: not done {} s after issue; after the host wrote every flag: {}",
                DEVICE_DEADLINE.as_secs(),
                if released { "released" } else { "still stuck" }
            );
        }
    }
    Ok(())
}

/// Runs `case` in a child process under `connections` queues (None: the driver's default),
/// killed after `deadline`; its line of outcome.
fn run_child(
    connections: Option<u32>,
    case: &str,
    barriers: u32,
    deadline: Duration,
) -> Result<String, String> {
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    let mut command = Command::new(exe);
    command
        .args(["--case", case, "--barriers", &barriers.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    match connections {
        Some(n) => command.env("CUDA_DEVICE_MAX_CONNECTIONS", n.to_string()),
        None => command.env_remove("CUDA_DEVICE_MAX_CONNECTIONS"),
    };
    let mut child = command.spawn().map_err(|e| format!("spawning: {e}"))?;
    let start = Instant::now();
    loop {
        match child.try_wait().map_err(|e| format!("waiting: {e}"))? {
            Some(_) => break,
            None if start.elapsed() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Ok(format!(
                    "hung: killed after {} s (the issuing thread blocked)",
                    deadline.as_secs()
                ));
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("reading: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    Ok(if err.is_empty() {
        text
    } else {
        format!("{text} {err}")
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(case) = &args.case {
        return match run_case(case, args.barriers) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                println!("error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if !fsdp_fusion::backend::cuda::is_driver_present() {
        eprintln!("bench-stream_waits needs the NVIDIA driver");
        return ExitCode::FAILURE;
    }
    let deadline = Duration::from_secs(args.deadline_s);
    println!(
        "{:<12} {:>5}  {:<12} {:<8}  outcome ({} barriers)",
        "connections", "ranks", "order", "issue", args.barriers
    );
    let cases: &[(Option<u32>, usize, &str, &str)] = &[
        (None, 1, "interleaved", "batched"),
        (None, 2, "interleaved", "batched"),
        (None, 4, "interleaved", "batched"),
        (Some(16), 4, "interleaved", "batched"),
        (Some(16), 8, "interleaved", "batched"),
        (Some(32), 8, "interleaved", "single"),
        (Some(32), 8, "interleaved", "batched"),
        (Some(32), 8, "rank-major", "single"),
        (Some(32), 8, "rank-major", "batched"),
    ];
    for &(connections, ranks, order, issue) in cases {
        let case = format!("{ranks},{order},{issue}");
        let outcome = run_child(connections, &case, args.barriers, deadline)
            .unwrap_or_else(|e| format!("error: {e}"));
        let shown = connections.map_or_else(|| "default (8)".to_string(), |n| n.to_string());
        println!("{shown:<12} {ranks:>5}  {order:<12} {issue:<8}  {outcome}");
    }
    ExitCode::SUCCESS
}
