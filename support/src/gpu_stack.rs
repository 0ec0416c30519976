//! A stack of dense layers on one GPU, driven by an engine's hooks: bf16 weights, each layer an FSDP
//! unit, forward and backward GEMMs through cuBLAS on the compute stream, and each weight's fp32
//! gradient written by its GEMM straight into the engine's gradient slot. The workload of the
//! pipeline benchmark and of the host-blocking test; [`UnshardedStack`] runs the same GEMMs with no
//! engine, as the baseline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{self as blas, cublasOperation_t, cudaDataType_t};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DevicePtr, DriverError};

use fsdp_fusion::backend::cuda::CudaBackend;
use fsdp_fusion::types::Stream;
use fsdp_fusion::{
    Communicator, DType, Engine, Error, Input, ModelSpec, ParamId, ParamSpec, Result, Unit,
};

use crate::rng::Rng;
use crate::values::narrow;

/// Layers, their width, and the rows of the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackShape {
    pub layers: usize,
    pub width: usize,
    pub batch: usize,
}

impl StackShape {
    /// Shapes written `LAYERSxWIDTHxBATCH,...`; `None` for any other text.
    pub fn parse_list(text: &str) -> Option<Vec<StackShape>> {
        text.split(',')
            .map(|s| {
                let v: Vec<usize> = s
                    .split('x')
                    .map(|d| d.parse().ok())
                    .collect::<Option<_>>()?;
                match v[..] {
                    [layers, width, batch] => Some(StackShape {
                        layers,
                        width,
                        batch,
                    }),
                    _ => None,
                }
            })
            .collect()
    }

    /// One bf16 `width x width` weight per layer, layer `i` in unit `i`.
    pub fn spec(&self) -> Result<ModelSpec> {
        let w = self.width as u64;
        ModelSpec::new(
            (0..self.layers)
                .map(|i| {
                    ParamSpec::new(format!("layers.{i}.weight"), &[w, w], DType::Bf16)
                        .in_unit(i as u32)
                })
                .collect(),
        )
    }

    /// Floating-point operations of one forward and backward pass.
    pub fn flops(&self) -> f64 {
        6.0 * self.layers as f64 * self.batch as f64 * (self.width * self.width) as f64
    }

    /// Random initial weights, as bf16 bytes, in layer order.
    pub fn init(&self, seed: u64) -> Vec<Vec<u8>> {
        let mut rng = Rng::new(seed);
        let scale = 1.0 / (self.width as f32).sqrt();
        (0..self.layers)
            .map(|_| narrow(DType::Bf16, &rng.fill(self.width * self.width, scale)))
            .collect()
    }
}

fn driver(call: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Cuda {
        call,
        code: e.0 as i32,
        message: format!("{:?}", e.0),
    }
}

fn cublas(call: &'static str) -> impl FnOnce(cudarc::cublas::result::CublasError) -> Error {
    move |e| Error::Cuda {
        call,
        code: e.0 as i32,
        message: format!("{:?}", e.0),
    }
}

/// Row-major GEMMs on one stream through a cuBLAS handle: bf16 operands, fp32 accumulation.
pub struct Gemm {
    blas: CudaBlas,
}

impl Gemm {
    /// A handle whose work goes on `stream`. `Error::CudaUnavailable` without libcublas.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Gemm> {
        // SAFETY: only opens and closes the library under cudarc's candidate names.
        if !unsafe { blas::is_culib_present() } {
            return Err(Error::CudaUnavailable {
                reason: "the cuBLAS library (libcublas.so) was not found".into(),
            });
        }
        stream
            .context()
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        Ok(Gemm {
            blas: CudaBlas::new(Arc::clone(stream)).map_err(cublas("cublasCreate"))?,
        })
    }

    /// Column-major `c[m x n] = op(a) op(b)` with `op(a)` `m x k`; `c` of `c_type`, beta 0.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        &self,
        (ta, tb): (bool, bool),
        (m, n, k): (usize, usize, usize),
        (a, lda): (u64, usize),
        (b, ldb): (u64, usize),
        (c, ldc): (u64, usize),
        c_type: cudaDataType_t,
    ) -> Result<()> {
        let op = |t| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        let int = |v: usize| {
            i32::try_from(v).map_err(|_| Error::OutOfRange {
                offset: 0,
                len: v,
                capacity: i32::MAX as usize,
            })
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the caller vouches for the operands' sizes; alpha and beta live on the host
        // for the duration of the call (host pointer mode).
        unsafe {
            blas::cublasGemmEx(
                *self.blas.handle(),
                op(ta),
                op(tb),
                int(m)?,
                int(n)?,
                int(k)?,
                (&alpha as *const f32).cast(),
                a as usize as *const _,
                cudaDataType_t::CUDA_R_16BF,
                int(lda)?,
                b as usize as *const _,
                cudaDataType_t::CUDA_R_16BF,
                int(ldb)?,
                (&beta as *const f32).cast(),
                c as usize as *mut _,
                c_type,
                int(ldc)?,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .result()
        .map_err(cublas("cublasGemmEx"))
    }

    /// `y = x w` (bf16): `x` is `rows x k`, `w` `k x n`, `y` `rows x n`, all row-major.
    ///
    /// # Safety
    /// Each address holds its matrix on the handle's stream's device.
    pub unsafe fn forward(
        &self,
        x: u64,
        w: u64,
        y: u64,
        rows: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        // Row-major y = x w is column-major y^T = w^T x^T.
        // SAFETY: the caller's contract.
        unsafe {
            self.gemm(
                (false, false),
                (n, rows, k),
                (w, n),
                (x, k),
                (y, n),
                cudaDataType_t::CUDA_R_16BF,
            )
        }
    }

    /// `dx = dy w^T` (bf16), shapes as [`Gemm::forward`].
    ///
    /// # Safety
    /// As [`Gemm::forward`].
    pub unsafe fn backward_input(
        &self,
        dy: u64,
        w: u64,
        dx: u64,
        rows: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            self.gemm(
                (true, false),
                (k, rows, n),
                (w, n),
                (dy, n),
                (dx, k),
                cudaDataType_t::CUDA_R_16BF,
            )
        }
    }

    /// `dw = x^T dy` in fp32, overwriting `dw` (`k x n`).
    ///
    /// # Safety
    /// As [`Gemm::forward`]; `dw` holds `k x n` f32.
    pub unsafe fn backward_weight(
        &self,
        x: u64,
        dy: u64,
        dw: u64,
        rows: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            self.gemm(
                (false, true),
                (n, k, rows),
                (dy, n),
                (x, k),
                (dw, n),
                cudaDataType_t::CUDA_R_32F,
            )
        }
    }
}

/// Host time spent inside engine calls, and their number.
#[derive(Clone, Copy, Debug, Default)]
pub struct HookTime {
    pub calls: u64,
    pub total: Duration,
}

impl HookTime {
    fn time<T>(&mut self, call: impl FnOnce() -> Result<T>) -> Result<T> {
        let start = Instant::now();
        let out = call();
        self.total += start.elapsed();
        self.calls += 1;
        out
    }

    /// Mean host microseconds per call.
    pub fn mean_us(&self) -> f64 {
        if self.calls == 0 {
            0.0
        } else {
            self.total.as_secs_f64() * 1e6 / self.calls as f64
        }
    }
}

/// Device memory of a stream and its address, taken once so that a step asks nothing of it.
struct DeviceBytes {
    ptr: u64,
    memory: CudaSlice<u8>,
}

impl DeviceBytes {
    fn new(memory: CudaSlice<u8>, stream: &CudaStream) -> DeviceBytes {
        // The backend's context leaves stream ordering to its caller: nothing is recorded here.
        let ptr = memory.device_ptr(stream).0;
        DeviceBytes { ptr, memory }
    }

    fn zeros(stream: &Arc<CudaStream>, bytes: usize) -> Result<DeviceBytes> {
        let memory = stream.alloc_zeros(bytes).map_err(driver("cuMemAlloc"))?;
        Ok(DeviceBytes::new(memory, stream))
    }

    fn from_host(stream: &Arc<CudaStream>, bytes: &[u8]) -> Result<DeviceBytes> {
        let memory = stream.clone_htod(bytes).map_err(driver("cuMemcpyHtoD"))?;
        Ok(DeviceBytes::new(memory, stream))
    }

    fn ptr(&self) -> u64 {
        self.ptr
    }
}

/// Activations and the output gradient of one rank's stack.
struct Activations {
    /// `layers + 1` activations, `batch x width` bf16; the first is the input.
    acts: Vec<DeviceBytes>,
    /// The gradient at the output, then two buffers the backward pass alternates between.
    grads: [DeviceBytes; 3],
}

impl Activations {
    fn new(stream: &Arc<CudaStream>, shape: StackShape, seed: u64) -> Result<Activations> {
        let bytes = shape.batch * shape.width * 2;
        let mut rng = Rng::new(seed);
        let mut random = || {
            let values = narrow(DType::Bf16, &rng.fill(shape.batch * shape.width, 1.0));
            DeviceBytes::from_host(stream, &values)
        };
        let mut acts = vec![random()?];
        let grads = [
            random()?,
            DeviceBytes::zeros(stream, bytes)?,
            DeviceBytes::zeros(stream, bytes)?,
        ];
        for _ in 0..shape.layers {
            acts.push(DeviceBytes::zeros(stream, bytes)?);
        }
        Ok(Activations { acts, grads })
    }
}

/// One rank's stack, run through its engine.
pub struct Stack {
    shape: StackShape,
    gemm: Gemm,
    data: Activations,
    stream: Arc<CudaStream>,
    /// Where the weight GEMM writes when the engine has no slot to write into (bf16 transport,
    /// no-sync): the gradient is then handed over from here. Made at its first use.
    handed_over: Option<DeviceBytes>,
}

impl Stack {
    /// GEMMs on `backend`'s compute stream, with random input and output gradient from `seed`.
    pub fn new(backend: &CudaBackend, shape: StackShape, seed: u64) -> Result<Stack> {
        // SAFETY: the stack's GEMMs run on the compute stream only, on memory of its own that it
        // frees after synchronizing that stream; the engine orders its buffers' uses there.
        let stream = unsafe { backend.stream(Stream::Compute) };
        Ok(Stack {
            shape,
            gemm: Gemm::new(stream)?,
            data: Activations::new(stream, shape, seed)?,
            stream: Arc::clone(stream),
            handed_over: None,
        })
    }

    /// Loads the weights of [`StackShape::init`] into `engine`.
    pub fn load<C: Communicator<CudaBackend>>(
        &self,
        engine: &mut Engine<CudaBackend, C>,
        seed: u64,
    ) -> Result<()> {
        for (i, w) in self.shape.init(seed).iter().enumerate() {
            engine.load_param(ParamId(i), Input::host_bytes(w, DType::Bf16))?;
        }
        Ok(())
    }

    /// One forward and backward pass with every hook, then the gradient sync; no host wait.
    /// Host time inside engine calls goes to `hooks`.
    pub fn step<C: Communicator<CudaBackend>>(
        &mut self,
        engine: &mut Engine<CudaBackend, C>,
        hooks: &mut HookTime,
    ) -> Result<()> {
        let slots =
            engine.policy().grad_slot_dtype == DType::F32 && !engine.policy().grad_accumulators;
        let handed_over = match (&self.handed_over, slots) {
            (_, true) => None,
            (Some(buffer), false) => Some(buffer.ptr()),
            (None, false) => {
                let width = self.shape.width;
                let buffer = DeviceBytes::zeros(&self.stream, width * width * 4)?;
                Some(self.handed_over.insert(buffer).ptr())
            }
        };
        let numel = self.shape.width * self.shape.width;
        pass(
            &self.gemm,
            &self.data,
            self.shape,
            &mut EngineWeights {
                engine,
                hooks,
                handed_over: handed_over.map(|ptr| (ptr, numel)),
            },
        )?;
        hooks.time(|| engine.finish_grad_sync())
    }
}

/// Where a pass finds each layer's weight and puts its fp32 gradient.
trait Weights {
    /// Before layer `layer`'s forward (`backward` false) or backward: its weight's address.
    fn open(&mut self, layer: usize, backward: bool) -> Result<u64>;
    /// Where the weight gradient goes (backward only).
    fn grad(&mut self, layer: usize) -> Result<u64>;
    /// After the gradient was written (backward) and the layer is done.
    fn close(&mut self, layer: usize, backward: bool) -> Result<()>;
}

/// The engine's gathered weights and gradient slots (or, where it has none to write into, a
/// buffer of `numel` f32 whose gradient is handed over), with the hooks timed.
struct EngineWeights<'a, C: Communicator<CudaBackend>> {
    engine: &'a mut Engine<CudaBackend, C>,
    hooks: &'a mut HookTime,
    handed_over: Option<(u64, usize)>,
}

impl<C: Communicator<CudaBackend>> Weights for EngineWeights<'_, C> {
    fn open(&mut self, layer: usize, backward: bool) -> Result<u64> {
        let unit = Unit::Layer(layer as u32);
        let engine = &mut *self.engine;
        if backward {
            self.hooks.time(|| engine.pre_backward(unit))?;
        } else {
            self.hooks.time(|| engine.pre_forward(unit))?;
        }
        Ok(self.engine.param_device(ParamId(layer))?.ptr)
    }

    fn grad(&mut self, layer: usize) -> Result<u64> {
        if let Some((ptr, _)) = self.handed_over {
            return Ok(ptr);
        }
        let engine = &mut *self.engine;
        self.hooks
            .time(|| engine.grad_slot_device(ParamId(layer)))
            .map(|slot| slot.ptr)
    }

    fn close(&mut self, layer: usize, backward: bool) -> Result<()> {
        let unit = Unit::Layer(layer as u32);
        let engine = &mut *self.engine;
        if backward {
            match self.handed_over {
                Some((ptr, numel)) => {
                    // SAFETY: the buffer holds `numel` f32, written by this layer's GEMM on the
                    // compute stream, where the engine reads it; the next write to it (the next
                    // layer's GEMM) is queued there after that read.
                    let gradient = unsafe { Input::device(ptr, numel, DType::F32) };
                    self.hooks.time(|| engine.grad(ParamId(layer), gradient))?;
                }
                None => self.hooks.time(|| engine.commit_grad(ParamId(layer)))?,
            }
            self.hooks.time(|| engine.post_backward(unit))
        } else {
            self.hooks.time(|| engine.post_forward(unit))
        }
    }
}

/// Plain device weights and gradients.
struct PlainWeights<'a> {
    weights: &'a [DeviceBytes],
    grads: &'a [DeviceBytes],
}

impl Weights for PlainWeights<'_> {
    fn open(&mut self, layer: usize, _backward: bool) -> Result<u64> {
        Ok(self.weights[layer].ptr())
    }

    fn grad(&mut self, layer: usize) -> Result<u64> {
        Ok(self.grads[layer].ptr())
    }

    fn close(&mut self, _layer: usize, _backward: bool) -> Result<()> {
        Ok(())
    }
}

/// One forward and backward pass of the stack's GEMMs on `gemm`'s stream.
fn pass(gemm: &Gemm, d: &Activations, shape: StackShape, weights: &mut impl Weights) -> Result<()> {
    let StackShape {
        layers,
        width,
        batch,
    } = shape;
    for i in 0..layers {
        let w = weights.open(i, false)?;
        // SAFETY: the weight is valid on the compute stream until `close`; the activations hold
        // batch x width bf16.
        unsafe { gemm.forward(d.acts[i].ptr(), w, d.acts[i + 1].ptr(), batch, width, width) }?;
        weights.close(i, false)?;
    }
    for i in (0..layers).rev() {
        // The output gradient feeds the last layer; the others alternate between two buffers.
        let dy = if i + 1 == layers {
            d.grads[0].ptr()
        } else {
            d.grads[1 + (i + 1) % 2].ptr()
        };
        let dx = d.grads[1 + i % 2].ptr();
        let w = weights.open(i, true)?;
        let dw = weights.grad(i)?;
        // SAFETY: as in forward; the gradient target holds width x width f32.
        unsafe {
            gemm.backward_weight(d.acts[i].ptr(), dy, dw, batch, width, width)?;
            gemm.backward_input(dy, w, dx, batch, width, width)?;
        }
        weights.close(i, true)?;
    }
    Ok(())
}

/// An [`UnshardedStack`]'s step as one CUDA graph.
pub struct UnshardedGraph(CudaGraph);

impl UnshardedGraph {
    /// Queues the captured step on the stack's compute stream.
    pub fn replay(&self) -> Result<()> {
        self.0.launch().map_err(driver("cuGraphLaunch"))
    }
}

/// The same GEMMs with plain device weights and fp32 gradients: no sharding, no engine.
pub struct UnshardedStack {
    shape: StackShape,
    stream: Arc<CudaStream>,
    gemm: Gemm,
    data: Activations,
    weights: Vec<DeviceBytes>,
    grads: Vec<DeviceBytes>,
}

impl UnshardedStack {
    pub fn new(backend: &CudaBackend, shape: StackShape, seed: u64) -> Result<UnshardedStack> {
        // SAFETY: as in `Stack::new`.
        let stream = Arc::clone(unsafe { backend.stream(Stream::Compute) });
        let weights = shape
            .init(seed)
            .iter()
            .map(|w| DeviceBytes::from_host(&stream, w))
            .collect::<Result<Vec<_>>>()?;
        let grads = (0..shape.layers)
            .map(|_| DeviceBytes::zeros(&stream, shape.width * shape.width * 4))
            .collect::<Result<Vec<_>>>()?;
        Ok(UnshardedStack {
            shape,
            gemm: Gemm::new(&stream)?,
            data: Activations::new(&stream, shape, seed)?,
            stream,
            weights,
            grads,
        })
    }

    /// One forward and backward pass.
    pub fn step(&mut self) -> Result<()> {
        let mut weights = PlainWeights {
            weights: &self.weights,
            grads: &self.grads,
        };
        pass(&self.gemm, &self.data, self.shape, &mut weights)
    }

    /// One step captured on the compute stream as a CUDA graph, for [`UnshardedGraph::replay`]:
    /// nothing runs until a replay. Run a step first, so that cuBLAS has made its workspace.
    pub fn capture(&mut self) -> Result<UnshardedGraph> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("cuStreamBeginCapture"))?;
        let step = self.step();
        let graph = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(driver("cuStreamEndCapture"))?;
        step?;
        graph.map(UnshardedGraph).ok_or_else(|| Error::Capture {
            what: "a capture that holds no work".into(),
        })
    }

    /// Layer `layer`'s fp32 weight gradient of the last step. Blocks until it is copied.
    pub fn weight_grad(&self, layer: usize) -> Result<Vec<f32>> {
        let grad = self.grads.get(layer).ok_or(Error::ParamIdOutOfRange {
            id: layer,
            count: self.grads.len(),
        })?;
        let bytes = self
            .stream
            .clone_dtoh(&grad.memory)
            .map_err(driver("cuMemcpyDtoH"))?;
        Ok(crate::values::widen(DType::F32, &bytes))
    }
}
