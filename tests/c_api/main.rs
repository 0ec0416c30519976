//! The C API driven from Rust through the exported functions, by area (one module each); here
//! what the areas share. Every misuse returns a status and a message, never a crash. The CPU
//! cases run on eager and asynchronous groups.

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_void};
use std::ptr::{null, null_mut};

use fsdp_fusion::ffi::*;
use fsdp_fusion_support::ranks::{Mode, for_each_mode, within_deadline};

mod checkpoints;
mod devices;
mod experts;
mod liveness;
mod misuse;
mod training;
mod views;

const MODEL: &str = r#"{"params": [
    {"name": "embed", "shape": [4, 3], "dtype": "f32", "tied": true},
    {"name": "w", "shape": [3, 3], "dtype": "f32", "unit": 0},
    {"name": "g", "shape": [3], "dtype": "f32", "unit": 0, "trainable": false}
]}"#;

fn last_error() -> String {
    // SAFETY: never NULL, NUL-terminated.
    unsafe { CStr::from_ptr(fsdp_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// Checks a status, and that the thread's message mentions `words`.
#[track_caller]
fn expect(status: fsdp_status, want: fsdp_status, words: &str) {
    assert_eq!(status, want, "message: {}", last_error());
    let message = last_error();
    assert!(
        message.contains(words),
        "{message:?} does not mention {words:?}"
    );
}

fn ok(status: fsdp_status) {
    assert_eq!(status, fsdp_status::FSDP_OK, "{}", last_error());
}

/// Ends a step's backward, steps the optimizer and ends the step.
fn end_the_step(engine: *mut fsdp_engine) {
    ok(fsdp_engine_finish_grad_sync(engine));
    ok(fsdp_engine_optimizer_step(engine));
    ok(fsdp_engine_end_step(engine));
}

/// A CUDA engine on device 0 with NCCL at world size 1, `stream` its compute stream.
fn cuda_nccl_engine(plan: *mut fsdp_plan, config: &fsdp_config, stream: u64) -> *mut fsdp_engine {
    let mut id = [0u8; 128];
    let mut engine = null_mut();
    // SAFETY: valid pointers.
    unsafe {
        ok(fsdp_nccl_unique_id(id.as_mut_ptr(), id.len()));
        ok(fsdp_engine_create_cuda_nccl(
            plan,
            config,
            0,
            id.as_ptr(),
            id.len(),
            0,
            1,
            stream,
            null(),
            &mut engine,
        ));
    }
    engine
}

fn plan(world: usize) -> *mut fsdp_plan {
    let json = CString::new(MODEL).unwrap();
    let mut plan = null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { fsdp_plan_from_json(json.as_ptr(), world, &mut plan) });
    plan
}

fn config() -> fsdp_config {
    let mut c = std::mem::MaybeUninit::uninit();
    // SAFETY: valid pointer.
    ok(unsafe { fsdp_config_default(c.as_mut_ptr()) });
    // SAFETY: written by the call above.
    unsafe { c.assume_init() }
}

/// A local group of `world` ranks whose engines run in `mode`.
fn local_group(mode: Mode, world: usize) -> *mut fsdp_local_group {
    let mut group = null_mut();
    // SAFETY: valid pointers.
    unsafe {
        ok(match mode {
            Mode::Eager => fsdp_local_group_create(world, &mut group),
            Mode::Async(seed) => fsdp_local_group_create_async(world, seed, &mut group),
        })
    };
    group
}

/// One rank's engine at world size 1 in `mode`, with its plan and group.
fn engine(mode: Mode) -> (*mut fsdp_plan, *mut fsdp_local_group, *mut fsdp_engine) {
    engine_with(mode, &config())
}

/// As [`engine`], made with `config`.
fn engine_with(
    mode: Mode,
    config: &fsdp_config,
) -> (*mut fsdp_plan, *mut fsdp_local_group, *mut fsdp_engine) {
    let plan = plan(1);
    let group = local_group(mode, 1);
    let mut engine = null_mut();
    // SAFETY: valid pointers.
    unsafe { ok(fsdp_engine_create_cpu(plan, config, group, 0, &mut engine)) };
    (plan, group, engine)
}

const NULL: fsdp_status = fsdp_status::FSDP_NULL_POINTER;

const BAD: fsdp_status = fsdp_status::FSDP_INVALID_ARGUMENT;
const UNAVAILABLE: fsdp_status = fsdp_status::FSDP_UNAVAILABLE;

fn gpu_present() -> bool {
    fsdp_fusion::backend::cuda::is_driver_present()
}

/// Device memory for the GPU tests, through the driver as a C caller would use it.
mod device {
    use cudarc::driver::sys::CUstream;
    use cudarc::driver::{CudaContext, result};
    use std::sync::Arc;

    /// Device 0's primary context, current on the calling thread.
    pub fn context() -> Arc<CudaContext> {
        let ctx = CudaContext::new(0).unwrap_or_else(|e| panic!("device 0: {e}"));
        ctx.bind_to_thread().unwrap();
        ctx
    }

    /// Waits for the engine's compute stream: views were gathered before it, gradients and slots
    /// are read and zeroed on it.
    pub fn sync(stream: u64) {
        // SAFETY: a live stream of the current context (0: the legacy default stream).
        unsafe { result::stream::synchronize(stream as CUstream) }.unwrap();
    }

    /// A fresh device copy of `values`, written on `stream`.
    pub fn upload(stream: u64, values: &[f32]) -> u64 {
        // SAFETY: a fresh allocation of exactly the bytes copied.
        let ptr = unsafe { result::malloc_sync(values.len() * 4) }.unwrap();
        write(stream, ptr, values);
        ptr
    }

    /// Copies `values` to `ptr` on `stream`, after the work queued there, and waits.
    pub fn write(stream: u64, ptr: u64, values: &[f32]) {
        // SAFETY: `ptr` holds `values.len()` floats (the engine or `upload` vouches); `values`
        // outlives the copy, waited for below.
        unsafe { result::memcpy_htod_async(ptr, values, stream as CUstream) }.unwrap();
        sync(stream);
    }

    /// Copies `numel` floats from `ptr` on `stream`, after the work queued there, and waits.
    pub fn download(stream: u64, ptr: u64, numel: usize) -> Vec<f32> {
        let mut out = vec![0f32; numel];
        // SAFETY: `ptr` holds `numel` floats (the engine vouches); `out` outlives the copy,
        // waited for below.
        unsafe { result::memcpy_dtoh_async(&mut out, ptr, stream as CUstream) }.unwrap();
        sync(stream);
        out
    }

    pub fn free(stream: u64, ptr: u64) {
        sync(stream);
        // SAFETY: allocated by `upload`, no longer used once the device is idle.
        unsafe { result::free_sync(ptr) }.unwrap();
    }

    /// A non-blocking stream of the current context; the caller destroys it.
    pub fn stream() -> u64 {
        let s = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
        s as u64
    }

    /// Whether a capture of `stream` is under way (active or invalidated).
    pub fn capturing(stream: u64) -> bool {
        // SAFETY: a live stream of the current context.
        let status = unsafe { result::stream::is_capturing(stream as CUstream) }.unwrap();
        status != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    }

    pub fn destroy_stream(stream: u64) {
        sync(stream);
        // SAFETY: made by `stream`, idle after the sync.
        unsafe { result::stream::destroy(stream as CUstream) }.unwrap();
    }
}

/// The values of the test model's parameters: embed, w, g.
fn initial_values() -> [Vec<f32>; 3] {
    [
        (0..12).map(|i| i as f32 * 0.25).collect(),
        (0..9).map(|i| 1.0 - i as f32 * 0.125).collect(),
        vec![1.0; 3],
    ]
}

/// Loads parameter `i` of `engine` from `values[i]` (f32).
fn load_values(engine: *mut fsdp_engine, values: &[Vec<f32>]) {
    for (id, v) in values.iter().enumerate() {
        // SAFETY: `v` holds `v.len()` floats.
        ok(unsafe { fsdp_engine_load_param(engine, id, v.as_ptr().cast(), v.len(), FSDP_F32) });
    }
}

/// The memory an engine's views, gradients and slots live in, as a C caller reaches it.
trait CallerMemory {
    /// A gradient of `values` for the engine to read; valid until the step is over.
    fn gradient(&self, values: &[f32]) -> u64;
    fn read(&self, addr: u64, numel: usize) -> Vec<f32>;
    fn write(&self, addr: u64, values: &[f32]);
}

/// Host memory (a CPU engine); gradients stay alive as long as the value.
#[derive(Default)]
struct Host(RefCell<Vec<Vec<f32>>>);

impl CallerMemory for Host {
    fn gradient(&self, values: &[f32]) -> u64 {
        let kept = values.to_vec();
        let addr = kept.as_ptr() as u64;
        self.0.borrow_mut().push(kept);
        addr
    }

    fn read(&self, addr: u64, numel: usize) -> Vec<f32> {
        // SAFETY: the engine vouches for `numel` floats at a view's address while it is valid.
        unsafe { std::slice::from_raw_parts(addr as *const f32, numel) }.to_vec()
    }

    fn write(&self, addr: u64, values: &[f32]) {
        // SAFETY: the engine vouches for the slot's floats until the commit.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), addr as *mut f32, values.len()) };
    }
}

/// Device memory on a CUDA engine's compute stream; gradients are freed with the value.
struct Device {
    stream: u64,
    gradients: RefCell<Vec<u64>>,
}

impl Device {
    fn on(stream: u64) -> Device {
        Device {
            stream,
            gradients: RefCell::default(),
        }
    }
}

impl CallerMemory for Device {
    fn gradient(&self, values: &[f32]) -> u64 {
        let ptr = device::upload(self.stream, values);
        self.gradients.borrow_mut().push(ptr);
        ptr
    }

    fn read(&self, addr: u64, numel: usize) -> Vec<f32> {
        device::download(self.stream, addr, numel)
    }

    fn write(&self, addr: u64, values: &[f32]) {
        device::write(self.stream, addr, values)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        for &ptr in self.gradients.borrow().iter() {
            device::free(self.stream, ptr);
        }
    }
}

/// One SGD step (lr 0.5) through the C functions: views, a gradient handed over for `w`, the slot
/// for `embed`; returns what the updated shards hold for `embed` and `w`.
fn sgd_step(
    engine: *mut fsdp_engine,
    plan: *mut fsdp_plan,
    rank: usize,
    memory: &impl CallerMemory,
) -> [Vec<f32>; 2] {
    let values = initial_values();
    let scale = (rank + 1) as f32;
    let w_grad: Vec<f32> = (0..9).map(|i| scale * 0.1 * i as f32).collect();
    let embed_grad: Vec<f32> = (0..12).map(|i| scale * 0.01 * i as f32).collect();
    let mut data: *const c_void = null();
    let mut numel = 0usize;
    let mut dtype = 9u32;
    let mut slot: *mut f32 = null_mut();
    // SAFETY: valid pointers; device addresses are used while the engine says they are valid.
    unsafe {
        load_values(engine, &values);
        ok(fsdp_engine_pre_forward(engine, FSDP_ROOT));
        ok(fsdp_engine_param(
            engine, 0, &mut data, &mut numel, &mut dtype,
        ));
        assert_eq!((numel, dtype), (12, FSDP_F32));
        assert_eq!(memory.read(data as u64, numel), values[0]);
        ok(fsdp_engine_post_forward(engine, FSDP_ROOT));
        ok(fsdp_engine_pre_forward(engine, 0));
        ok(fsdp_engine_param(
            engine, 1, &mut data, &mut numel, &mut dtype,
        ));
        assert_eq!(memory.read(data as u64, numel), values[1]);
        ok(fsdp_engine_post_forward(engine, 0));

        ok(fsdp_engine_pre_backward(engine, 0));
        expect(
            fsdp_engine_grad(engine, 1, null(), 9, FSDP_F32),
            NULL,
            "data",
        );
        let grad = memory.gradient(&w_grad);
        ok(fsdp_engine_grad(
            engine,
            1,
            grad as *const c_void,
            9,
            FSDP_F32,
        ));
        ok(fsdp_engine_post_backward(engine, 0));
        ok(fsdp_engine_pre_backward(engine, FSDP_ROOT));
        ok(fsdp_engine_grad_slot(engine, 0, &mut slot));
        memory.write(slot as u64, &embed_grad);
        ok(fsdp_engine_commit_grad(engine, 0));
        ok(fsdp_engine_post_backward(engine, FSDP_ROOT));
        ok(fsdp_engine_finish_grad_sync(engine));
        ok(fsdp_engine_optimizer_step(engine));
        ok(fsdp_engine_end_step(engine));
    }
    [0, 1].map(|id| shard_values(engine, plan, id))
}

/// Parameter `id`'s part of this rank's shard (the whole parameter at world size 1).
fn shard_values(engine: *mut fsdp_engine, plan: *mut fsdp_plan, id: usize) -> Vec<f32> {
    let mut info = fsdp_param_info::default();
    let mut bytes = vec![0u8; 1 << 16];
    let mut written = 0usize;
    // SAFETY: valid pointers.
    unsafe {
        ok(fsdp_plan_param_info(plan, id, &mut info));
        ok(fsdp_engine_param_shard(
            engine,
            info.group,
            bytes.as_mut_ptr().cast(),
            bytes.len(),
            &mut written,
        ));
    }
    let floats: Vec<f32> = bytes[..written]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    floats[info.offset..(info.offset + info.numel).min(floats.len())].to_vec()
}

fn sgd_config() -> fsdp_config {
    fsdp_config {
        optimizer: FSDP_SGD,
        lr: 0.5,
        weight_decay: 0.0,
        ..config()
    }
}

/// `initial - 0.5 * mean gradient`, the gradient of rank r being `(r + 1)` times the base one.
fn after_sgd(initial: &[f32], base: impl Fn(usize) -> f32, world: usize) -> Vec<f32> {
    let mean = (1..=world).sum::<usize>() as f32 / world as f32;
    initial
        .iter()
        .enumerate()
        .map(|(i, v)| v - 0.5 * mean * base(i))
        .collect()
}

#[track_caller]
fn assert_close(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= 1e-6, "{got:?} != {want:?}");
    }
}

/// Runs `rank_0` and `rank_1` on threads of their own, each with its engine of a two-rank group
/// in `mode` (handles travel as numbers); returns what they return.
fn two_ranks<R: Send + 'static>(
    mode: Mode,
    rank_0: impl FnOnce(usize) -> R + Send + 'static,
    rank_1: impl FnOnce(usize) -> R + Send + 'static,
) -> (R, R) {
    two_ranks_with(mode, sgd_config(), rank_0, rank_1)
}

/// As [`two_ranks`], with engines of `config`.
fn two_ranks_with<R: Send + 'static>(
    mode: Mode,
    config: fsdp_config,
    rank_0: impl FnOnce(usize) -> R + Send + 'static,
    rank_1: impl FnOnce(usize) -> R + Send + 'static,
) -> (R, R) {
    let plan = plan(2) as usize;
    let group = local_group(mode, 2) as usize;
    let outcome = within_deadline("two ranks through the C API", move || {
        let spawn = |rank: usize, body: Box<dyn FnOnce(usize) -> R + Send>| {
            std::thread::spawn(move || {
                let mut engine = null_mut();
                // SAFETY: valid pointers.
                ok(unsafe {
                    fsdp_engine_create_cpu(
                        plan as *mut fsdp_plan,
                        &config,
                        group as *mut fsdp_local_group,
                        rank,
                        &mut engine,
                    )
                });
                body(engine as usize)
            })
        };
        let r0 = spawn(0, Box::new(rank_0));
        let r1 = spawn(1, Box::new(rank_1));
        (r0.join().unwrap(), r1.join().unwrap())
    });
    ok(fsdp_local_group_destroy(group as *mut fsdp_local_group));
    ok(fsdp_plan_destroy(plan as *mut fsdp_plan));
    outcome
}

fn handle(engine: usize) -> *mut fsdp_engine {
    engine as *mut fsdp_engine
}

/// The forward of both units of the test model on `engine`, then `w`'s gradient (at world size
/// 2 its group's reduction needs the other rank) and a read of a shard, which waits for the
/// streams: returns the first status that is not `FSDP_OK`, or `FSDP_OK`.
fn forward_then_gradient(engine: usize) -> fsdp_status {
    for unit in [FSDP_ROOT, 0] {
        for status in [
            fsdp_engine_pre_forward(handle(engine), unit),
            fsdp_engine_post_forward(handle(engine), unit),
        ] {
            if status != fsdp_status::FSDP_OK {
                return status;
            }
        }
    }
    gradient_after_forward(engine)
}

/// `w`'s gradient after the forward, the end of the backward (which reduces it), then a read of
/// its shard (a host wait).
fn gradient_after_forward(engine: usize) -> fsdp_status {
    let e = handle(engine);
    let g = [0.5f32; 9];
    let mut bytes = [0u8; 4096];
    let mut written = 0usize;
    // SAFETY: a valid host gradient of `w`'s 9 elements, and valid out-pointers.
    unsafe {
        match fsdp_engine_grad(e, 1, g.as_ptr().cast(), 9, FSDP_F32) {
            fsdp_status::FSDP_OK => match fsdp_engine_finish_grad_sync(e) {
                fsdp_status::FSDP_OK => fsdp_engine_param_shard(
                    e,
                    1,
                    bytes.as_mut_ptr().cast(),
                    bytes.len(),
                    &mut written,
                ),
                failed => failed,
            },
            failed => failed,
        }
    }
}

fn forward_only(engine: usize) {
    for (pre, post) in [(FSDP_ROOT, FSDP_ROOT), (0, 0)] {
        ok(fsdp_engine_pre_forward(handle(engine), pre));
        ok(fsdp_engine_post_forward(handle(engine), post));
    }
}
