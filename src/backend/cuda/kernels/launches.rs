//! The launches of the kernels, one safe-to-call-with-valid-addresses function each.
//!
//! Each launch takes raw device addresses and goes on the caller's stream; nothing here
//! allocates, records events or waits. A zero-length call launches nothing. Addresses must be
//! aligned to their element size (a misaligned one is an error, not a fault); beyond that any
//! element offset works, and the kernels use 16-byte accesses wherever the operands allow.

use super::*;

impl Kernels {
    /// # Safety
    /// `dst` is valid for `bytes` bytes on `stream`.
    pub unsafe fn fill_zero(&self, stream: &CudaStream, dst: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let kernel = self.fill_zero;
        let n = bytes as u64;
        // SAFETY: fill_zero_bytes(uint8_t* dst, uint64_t bytes); the caller's contract.
        unsafe {
            self.launch(
                stream,
                kernel,
                elementwise_grid(bytes, round_elements(MOVE_ROUND, 1)),
                &mut [arg(&dst), arg(&n)],
            )
        }
    }

    /// `dst[i] = src[i]` for `i < n`, any alignment of either address.
    ///
    /// # Safety
    /// `src` and `dst` are valid for `n` elements of `dtype` and do not overlap.
    pub unsafe fn copy(
        &self,
        stream: &CudaStream,
        dtype: DType,
        src: u64,
        dst: u64,
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_aligned(src, dtype.size())?;
        check_aligned(dst, dtype.size())?;
        let (kernel, grid) = self.copy[dtype_index(dtype)].pick(
            elementwise_grid(n, round_elements(MOVE_ROUND, dtype.size())),
            elementwise_grid(n, round_elements(WAVE_ROUND, dtype.size())),
        );
        let n64 = n as u64;
        // SAFETY: copy_<dtype> and copy_wave_<dtype>(const T* src, T* dst, uint64_t n); the
        // caller's contract.
        unsafe { self.launch(stream, kernel, grid, &mut [arg(&src), arg(&dst), arg(&n64)]) }
    }

    /// `dst = scale * src` or `dst = dst + scale * src` computed in f32 and rounded to
    /// `dst_dtype` (f32 or bf16), exactly as [`crate::optim::accumulate_element`].
    ///
    /// # Safety
    /// `src` is valid for `n` elements of `src_dtype`, `dst` for `n` of `dst_dtype`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn accumulate(
        &self,
        stream: &CudaStream,
        (src_dtype, dst_dtype): (DType, DType),
        src: u64,
        dst: u64,
        n: usize,
        scale: f32,
        add: bool,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_aligned(src, src_dtype.size())?;
        check_aligned(dst, dst_dtype.size())?;
        let kernels = match dst_dtype {
            DType::F32 => &self.accumulate_to_f32,
            DType::Bf16 => &self.accumulate_to_bf16,
            DType::F16 => {
                return Err(Error::Unsupported {
                    backend: "cuda",
                    what: "accumulating into f16",
                });
            }
        };
        let twins = kernels[dtype_index(src_dtype)];
        let n64 = n as u64;
        let grid = elementwise_grid(n, accumulate_round_elements((src_dtype, dst_dtype), add));
        let widest = src_dtype.size().max(dst_dtype.size());
        let wave_grid = elementwise_grid(n, round_elements(WAVE_ROUND, widest));
        if !add && one_wave(grid, (twins.wave, wave_grid)) {
            // SAFETY: accumulate_wave_<src>_<dst>(const S* src, D* dst, uint64_t n, float
            // scale); the caller's contract.
            return unsafe {
                self.launch(
                    stream,
                    twins.wave,
                    wave_grid,
                    &mut [arg(&src), arg(&dst), arg(&n64), arg(&scale)],
                )
            };
        }
        let add = u32::from(add);
        // SAFETY: accumulate_<src>_<dst>(const S* src, D* dst, uint64_t n, float scale,
        // uint32_t add); the caller's contract.
        unsafe {
            self.launch(
                stream,
                twins.tuned,
                grid,
                &mut [arg(&src), arg(&dst), arg(&n64), arg(&scale), arg(&add)],
            )
        }
    }

    /// As [`Kernels::accumulate`] on each entry of `entries`, all of one dtype pair, in one
    /// launch per [`BATCH_SPANS`] entries (a launch costs the host more than most
    /// parameters' arithmetic costs the device).
    ///
    /// # Safety
    /// Each entry as [`Kernels::accumulate`] requires of its operands; no entry's `dst` overlaps
    /// another's operands.
    pub unsafe fn accumulate_many(
        &self,
        stream: &CudaStream,
        (src_dtype, dst_dtype): (DType, DType),
        entries: &[AccumulateEntry],
        scale: f32,
        add: bool,
    ) -> Result<()> {
        let kernels = match dst_dtype {
            DType::F32 => &self.accumulate_many_to_f32,
            DType::Bf16 => &self.accumulate_many_to_bf16,
            DType::F16 => {
                return Err(Error::Unsupported {
                    backend: "cuda",
                    what: "accumulating into f16",
                });
            }
        };
        let twins = kernels[dtype_index(src_dtype)];
        let add_flag = u32::from(add);
        let tuned_args = [arg(&scale), arg(&add_flag)];
        let tuned = SpanKernel {
            kernel: twins.tuned,
            per_thread: accumulate_round_elements((src_dtype, dst_dtype), add),
            args: &tuned_args,
        };
        let wave_args = [arg(&scale)];
        let wave = SpanKernel {
            kernel: twins.wave,
            per_thread: round_elements(WAVE_ROUND, src_dtype.size().max(dst_dtype.size())),
            args: &wave_args,
        };
        let spans = || {
            entries.iter().map(|e| {
                check_aligned(e.src, src_dtype.size())?;
                check_aligned(e.dst, dst_dtype.size())?;
                Ok(Span {
                    src: e.src,
                    dst: e.dst,
                    n: e.n,
                })
            })
        };
        // SAFETY: accumulate_many_<src>_<dst>(SpanBatch batch, float scale, uint32_t add) and
        // accumulate_many_wave_<src>_<dst>(SpanBatch batch, float scale), the twin only for
        // `dst = scale * src`; the caller's contract.
        unsafe { self.launch_spans(stream, spans, tuned, (!add).then_some(wave)) }
    }

    /// Launches `tuned.kernel` over the spans `spans()` gives, in batches of [`BATCH_SPANS`], each
    /// span's body on blocks of its own, as many as its length asks for at the kernel's elements
    /// a thread, after the blocks of the batch's edges (`first_blocks`); a batch runs as the
    /// `wave` twin instead where [`one_wave`] says. Every span is checked before the first
    /// launch: a span that is an error launches nothing.
    ///
    /// # Safety
    /// Each kernel takes `(SpanBatch, args...)` with its own `args`, and each span is valid for
    /// both.
    unsafe fn launch_spans<I: Iterator<Item = Result<Span>>>(
        &self,
        stream: &CudaStream,
        spans: impl Fn() -> I,
        tuned: SpanKernel<'_>,
        wave: Option<SpanKernel<'_>>,
    ) -> Result<()> {
        spans().try_for_each(|span| span.map(drop))?;
        let mut spans = spans();
        let mut params = [std::ptr::null_mut(); 3];
        let most_args = params.len() - 1;
        if tuned.args.len() > most_args || wave.is_some_and(|w| w.args.len() > most_args) {
            return Err(Error::Unsupported {
                backend: "cuda",
                what: "a batched kernel with more than two parameters after its batch",
            });
        }
        loop {
            let mut batch = SpanBatch {
                spans: [Span::default(); BATCH_SPANS],
                first_block: [0; BATCH_SPANS + 1],
            };
            let mut taken = 0;
            while taken < BATCH_SPANS {
                match spans.next() {
                    Some(span) => {
                        batch.spans[taken] = span?;
                        taken += 1;
                    }
                    None => break,
                }
            }
            let (chosen, first) = batch_kernel(tuned, wave, &batch.spans[..taken])?;
            batch.first_block = first;
            let grid = first[BATCH_SPANS];
            if grid > 0 {
                let count = chosen.args.len() + 1;
                params[0] = arg(&batch);
                params[1..count].copy_from_slice(chosen.args);
                // SAFETY: the caller's contract; the batch outlives the launch, which copies it.
                unsafe { self.launch(stream, chosen.kernel, grid, &mut params[..count]) }?;
            }
            if taken < BATCH_SPANS {
                return Ok(());
            }
        }
    }

    /// Pack's and unpack's kernel over spans, and its `_wave` twin.
    pub(super) fn moves_over_spans(
        &self,
        dtype: DType,
    ) -> (SpanKernel<'static>, SpanKernel<'static>) {
        let twins = self.move_many[dtype_index(dtype)];
        let tuned = SpanKernel {
            kernel: twins.tuned,
            per_thread: MOVE_SPAN_ROUNDS * round_elements(MOVE_ROUND, dtype.size()),
            args: &[],
        };
        let wave = SpanKernel {
            kernel: twins.wave,
            per_thread: round_elements(WAVE_ROUND, dtype.size()),
            args: &[],
        };
        (tuned, wave)
    }

    /// `dst[i] = convert(src[i])`, rounding to nearest even when narrowing.
    ///
    /// # Safety
    /// `src` and `dst` are valid for `n` elements of their dtypes and do not overlap.
    pub unsafe fn cast(
        &self,
        stream: &CudaStream,
        src_dtype: DType,
        src: u64,
        dst_dtype: DType,
        dst: u64,
        n: usize,
    ) -> Result<()> {
        let Some(twins) = self.cast[dtype_index(src_dtype)][dtype_index(dst_dtype)] else {
            // SAFETY: the caller's contract, with one dtype.
            return unsafe { self.copy(stream, src_dtype, src, dst, n) };
        };
        if n == 0 {
            return Ok(());
        }
        check_aligned(src, src_dtype.size())?;
        check_aligned(dst, dst_dtype.size())?;
        let n64 = n as u64;
        let widest = src_dtype.size().max(dst_dtype.size());
        let (kernel, grid) = twins.pick(
            elementwise_grid(n, round_elements(ROUND, widest)),
            elementwise_grid(n, round_elements(WAVE_ROUND, widest)),
        );
        // SAFETY: cast_<src>_<dst> and cast_wave_<src>_<dst>(const S* src, D* dst, uint64_t n);
        // the caller's contract.
        unsafe { self.launch(stream, kernel, grid, &mut [arg(&src), arg(&dst), arg(&n64)]) }
    }

    /// `*dst = values`, in stream order.
    ///
    /// # Safety
    /// `dst` is valid for [`crate::optim::STEP_VALUES_BYTES`] bytes on `stream`.
    pub unsafe fn write_step_values(
        &self,
        stream: &CudaStream,
        dst: u64,
        values: &StepValues,
    ) -> Result<()> {
        check_aligned(dst, std::mem::align_of::<StepValues>())?;
        // SAFETY: write_step_values(StepValues* dst, StepValues values), the struct laid out as
        // the #[repr(C)] one; the caller's contract.
        unsafe {
            self.launch(
                stream,
                self.write_step_values,
                1,
                &mut [arg(&dst), arg(values)],
            )
        }
    }

    /// Sets the `grad_scale` of the [`StepValues`] at `values` to the clipping coefficient of
    /// `max_norm` for the `ranks` norm parts at `parts`, as
    /// [`crate::backend::Backend::clip_step_values`] says.
    ///
    /// # Safety
    /// `parts` is valid for `ranks` parts, `values` for a [`StepValues`], on `stream`.
    pub unsafe fn clip_step_values(
        &self,
        stream: &CudaStream,
        (parts, ranks): (u64, usize),
        max_norm: f32,
        values: u64,
    ) -> Result<()> {
        let ranks = checked_parts((parts, ranks), values)?;
        // SAFETY: clip_step_values(const uint8_t* parts, uint32_t ranks, float max_norm,
        // StepValues* values); the caller's contract.
        unsafe {
            self.launch(
                stream,
                self.clip_step_values,
                1,
                &mut [arg(&parts), arg(&ranks), arg(&max_norm), arg(&values)],
            )
        }
    }

    /// Decides whether the step is skipped from the `ranks` norm parts at `parts`, as
    /// [`crate::backend::Backend::skip_nonfinite_step`] says.
    ///
    /// # Safety
    /// `parts` is valid for `ranks` parts, `skipped` for a u64, `values` for a [`StepValues`],
    /// on `stream`.
    pub unsafe fn skip_nonfinite_step(
        &self,
        stream: &CudaStream,
        (parts, ranks): (u64, usize),
        skipped: u64,
        values: u64,
    ) -> Result<()> {
        check_aligned(skipped, std::mem::align_of::<u64>())?;
        let ranks = checked_parts((parts, ranks), values)?;
        // SAFETY: skip_nonfinite_step(const uint8_t* parts, uint32_t ranks,
        // unsigned long long* skipped, StepValues* values); the caller's contract.
        unsafe {
            self.launch(
                stream,
                self.skip_nonfinite_step,
                1,
                &mut [arg(&parts), arg(&ranks), arg(&skipped), arg(&values)],
            )
        }
    }

    /// Counts out the steps skipped on the device from the [`StepValues`] at `values`, as
    /// [`crate::backend::Backend::correct_step_values`] says.
    ///
    /// # Safety
    /// `skipped` is valid for a u64 and `values` for a [`StepValues`], on `stream`.
    pub unsafe fn correct_step_values(
        &self,
        stream: &CudaStream,
        skipped: u64,
        values: u64,
    ) -> Result<()> {
        check_aligned(skipped, std::mem::align_of::<u64>())?;
        check_aligned(values, std::mem::align_of::<StepValues>())?;
        // SAFETY: correct_step_values(const unsigned long long* skipped, StepValues* values);
        // the caller's contract.
        unsafe {
            self.launch(
                stream,
                self.correct_step_values,
                1,
                &mut [arg(&skipped), arg(&values)],
            )
        }
    }

    /// AdamW exactly as [`crate::optim::adamw_element`] with the coefficients
    /// [`GroupUpdate::coefficients`] makes of the [`StepValues`] at `values`, on fp32 `master`
    /// and `grad` and moments `m`, `v` stored as `moments` says, writing the result to `master`
    /// and, rounded, to `param` (of `param_dtype`). For f32 params `master` may equal `param`.
    ///
    /// # Safety
    /// Every address but `values` is valid for `n` elements, `values` for a [`StepValues`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn adamw(
        &self,
        stream: &CudaStream,
        param_dtype: DType,
        master: u64,
        (m, v, moments): (u64, u64, MomentStorage),
        grad: u64,
        param: u64,
        n: usize,
        (values, group): (u64, GroupUpdate),
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        for addr in [master, grad] {
            check_aligned(addr, DType::F32.size())?;
        }
        check_aligned(param, param_dtype.size())?;
        check_aligned(values, std::mem::align_of::<StepValues>())?;
        let n64 = n as u64;
        let (lr_scale, decay) = (group.lr_scale, i32::from(group.decay));
        if let MomentStorage::Bf16Stochastic { group, first_index } = moments {
            for addr in [m, v] {
                check_aligned(addr, DType::Bf16.size())?;
            }
            let kernel = self.adamw_bf16_moments[dtype_index(param_dtype)];
            // SAFETY: adamw_bf16m_<param>(float* master, uint16_t* m, uint16_t* v, const float*
            // grad, P* param, uint64_t n, const StepValues* values, float lr_scale, int decay,
            // uint32_t group, uint64_t first_index); the caller's contract.
            return unsafe {
                self.launch(
                    stream,
                    kernel,
                    elementwise_grid(n, round_elements(OPTIMIZER_ROUND, 4)),
                    &mut [
                        arg(&master),
                        arg(&m),
                        arg(&v),
                        arg(&grad),
                        arg(&param),
                        arg(&n64),
                        arg(&values),
                        arg(&lr_scale),
                        arg(&decay),
                        arg(&group),
                        arg(&first_index),
                    ],
                )
            };
        }
        for addr in [m, v] {
            check_aligned(addr, DType::F32.size())?;
        }
        let kernel = self.adamw[dtype_index(param_dtype)];
        // SAFETY: adamw_<param>(float* master, float* m, float* v, const float* grad, P* param,
        // uint64_t n, const StepValues* values, float lr_scale, int decay); the caller's
        // contract.
        unsafe {
            self.launch(
                stream,
                kernel,
                elementwise_grid(n, round_elements(OPTIMIZER_ROUND, 4)),
                &mut [
                    arg(&master),
                    arg(&m),
                    arg(&v),
                    arg(&grad),
                    arg(&param),
                    arg(&n64),
                    arg(&values),
                    arg(&lr_scale),
                    arg(&decay),
                ],
            )
        }
    }

    /// SGD exactly as [`crate::optim::sgd_element`] with the coefficients
    /// [`GroupUpdate::coefficients`] makes of the [`StepValues`] at `values`; `master` may equal
    /// `param` for f32 params.
    ///
    /// # Safety
    /// Every address but `values` is valid for `n` elements, `values` for a [`StepValues`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn sgd(
        &self,
        stream: &CudaStream,
        param_dtype: DType,
        master: u64,
        grad: u64,
        param: u64,
        n: usize,
        (values, group): (u64, GroupUpdate),
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_aligned(master, DType::F32.size())?;
        check_aligned(grad, DType::F32.size())?;
        check_aligned(param, param_dtype.size())?;
        check_aligned(values, std::mem::align_of::<StepValues>())?;
        let kernel = self.sgd[dtype_index(param_dtype)];
        let n64 = n as u64;
        let (lr_scale, decay) = (group.lr_scale, i32::from(group.decay));
        // SAFETY: sgd_<param>(float* master, const float* grad, P* param, uint64_t n, const
        // StepValues* values, float lr_scale, int decay); the caller's contract.
        unsafe {
            self.launch(
                stream,
                kernel,
                elementwise_grid(n, round_elements(OPTIMIZER_ROUND, 4)),
                &mut [
                    arg(&master),
                    arg(&grad),
                    arg(&param),
                    arg(&n64),
                    arg(&values),
                    arg(&lr_scale),
                    arg(&decay),
                ],
            )
        }
    }

    /// Packs `entries` into `flat`: each entry's `numel` elements at its offset, and its padding
    /// (`numel..padded`) as zero. A param and its padding are a span each, [`BATCH_SPANS`] spans
    /// a launch, each span on blocks of its own: params of any sizes side by side keep every
    /// block busy, and small ones cost no block more than their length asks for.
    ///
    /// # Safety
    /// Each entry's `ptr` is valid for `numel` elements of `dtype`, and `flat` for each entry's
    /// `offset + padded`; no entry's range of `flat` overlaps another's or any `ptr`'s.
    pub unsafe fn pack(
        &self,
        stream: &CudaStream,
        dtype: DType,
        entries: &[PackEntry],
        flat: u64,
    ) -> Result<()> {
        let spans = || pack_spans(dtype, entries, flat);
        let (tuned, wave) = self.moves_over_spans(dtype);
        // SAFETY: move_many_<dtype> and move_many_wave_<dtype>(SpanBatch batch); the caller's
        // contract.
        unsafe { self.launch_spans(stream, spans, tuned, Some(wave)) }
    }

    /// The reverse of `pack`: each entry's `numel` elements copied out of `flat`.
    ///
    /// # Safety
    /// As `pack`.
    pub unsafe fn unpack(
        &self,
        stream: &CudaStream,
        dtype: DType,
        entries: &[PackEntry],
        flat: u64,
    ) -> Result<()> {
        let spans = || unpack_spans(dtype, entries, flat);
        let (tuned, wave) = self.moves_over_spans(dtype);
        // SAFETY: move_many_<dtype> and move_many_wave_<dtype>(SpanBatch batch); the caller's
        // contract.
        unsafe { self.launch_spans(stream, spans, tuned, Some(wave)) }
    }

    /// `dst[i] = ((s * src0[i] + s * src1[i]) + s * src2[i]) + ...` in f32 (`s` = `scale`), in
    /// source order, rounded once to `dtype` (f32 or bf16), `srcs` a device array of `count`
    /// addresses; `dst` may be one of the sources (element-wise in place).
    ///
    /// # Safety
    /// Every source and `dst` is valid for `n` elements of `dtype`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_sum(
        &self,
        stream: &CudaStream,
        dtype: DType,
        srcs: u64,
        count: usize,
        dst: u64,
        n: usize,
        scale: f32,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // The kernel counts sources in an `int`.
        let Some(count32) = i32::try_from(count).ok().filter(|&c| c > 0) else {
            return Err(Error::Unsupported {
                backend: "cuda",
                what: "a sum over zero sources, or over more than 2^31 - 1",
            });
        };
        let count32 = count32 as u32;
        check_aligned(srcs, std::mem::align_of::<u64>())?;
        check_aligned(dst, dtype.size())?;
        let kernel = match dtype {
            DType::F32 => self.reduce_sum_f32,
            DType::Bf16 => self.reduce_sum_bf16,
            DType::F16 => {
                return Err(Error::Unsupported {
                    backend: "cuda",
                    what: "an f16 sum",
                });
            }
        };
        let n64 = n as u64;
        // SAFETY: reduce_sum_<dtype>(const T* const* srcs, uint32_t count, T* dst, uint64_t n,
        // float scale); the caller's contract.
        unsafe {
            self.launch(
                stream,
                kernel,
                elementwise_grid(n, round_elements(sum_round(dtype), dtype.size())),
                &mut [arg(&srcs), arg(&count32), arg(&dst), arg(&n64), arg(&scale)],
            )
        }
    }

    /// `*counter += ` the number of infinite or NaN values among the `n` f32 at `src`
    /// (`counter` a device u64).
    ///
    /// # Safety
    /// `src` is valid for `n` f32 and `counter` for one u64, written by nothing else meanwhile.
    pub unsafe fn count_nonfinite(
        &self,
        stream: &CudaStream,
        src: u64,
        n: usize,
        counter: u64,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_aligned(src, DType::F32.size())?;
        check_aligned(counter, std::mem::align_of::<u64>())?;
        let kernel = self.count_nonfinite;
        let n64 = n as u64;
        // SAFETY: count_nonfinite_f32(const uint32_t* src, uint64_t n, unsigned long long*
        // counter); the caller's contract.
        unsafe {
            self.launch(
                stream,
                kernel,
                kernel.reduction_grid(n),
                &mut [arg(&src), arg(&n64), arg(&counter)],
            )
        }
    }

    /// Adds the sum of the squares of the `n` f32 at `src` to the f64 at `out`, and raises the
    /// u32 at `out + 8` to the largest magnitude's bits (see `norm_partials_f32`).
    ///
    /// # Safety
    /// `src` is valid for `n` f32 and `out` for 16 bytes, written by nothing else meanwhile.
    pub unsafe fn norm_partials(
        &self,
        stream: &CudaStream,
        src: u64,
        n: usize,
        out: u64,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_aligned(src, DType::F32.size())?;
        check_aligned(out, std::mem::align_of::<f64>())?;
        let kernel = self.norm_partials;
        let (n64, max_bits) = (n as u64, out + 8);
        // SAFETY: norm_partials_f32(const float* src, uint64_t n, double* sum_squares,
        // unsigned int* max_bits); the caller's contract.
        unsafe {
            self.launch(
                stream,
                kernel,
                kernel.reduction_grid(n),
                &mut [arg(&src), arg(&n64), arg(&out), arg(&max_bits)],
            )
        }
    }
}

/// The spans of a pack of `entries` into `flat`: each entry's data, then its padding (no
/// source: zeros), the empty ones left out; an entry that cannot be packed is an error in its
/// place.
pub(super) fn pack_spans(
    dtype: DType,
    entries: &[PackEntry],
    flat: u64,
) -> impl Iterator<Item = Result<Span>> + '_ {
    let spans = entries.iter().flat_map(move |e| {
        let padding = e.padded.checked_sub(e.numel).ok_or(Error::Unsupported {
            backend: "cuda",
            what: "a pack entry padded to fewer elements than it holds",
        });
        let padding = padding.and_then(|n| {
            let start = e.offset.checked_add(e.numel).ok_or(PAST_THE_ADDRESSES)?;
            let dst = flat_address(dtype, flat, start, n)?;
            Ok(Span { src: 0, dst, n })
        });
        [data_span(dtype, e, flat), padding]
    });
    spans.filter(not_empty)
}

/// The spans of an unpack of `entries` out of `flat`: each entry's data, the empty ones left out.
pub(super) fn unpack_spans(
    dtype: DType,
    entries: &[PackEntry],
    flat: u64,
) -> impl Iterator<Item = Result<Span>> + '_ {
    let spans = entries.iter().map(move |e| {
        data_span(dtype, e, flat).map(|span| Span {
            src: span.dst,
            dst: span.src,
            n: span.n,
        })
    });
    spans.filter(not_empty)
}

/// Entry `e`'s data from its param to its place in `flat`, checked.
fn data_span(dtype: DType, e: &PackEntry, flat: u64) -> Result<Span> {
    let in_flat = flat_address(dtype, flat, e.offset, e.numel)?;
    param_span(dtype, e.ptr, in_flat, e.numel)
}

/// Whether a span moves anything, or is an error to report.
fn not_empty(span: &Result<Span>) -> bool {
    !matches!(span, Ok(Span { n: 0, .. }))
}

const PAST_THE_ADDRESSES: Error = Error::Unsupported {
    backend: "cuda",
    what: "a pack entry past the end of the address space",
};

/// The address of element `start` of `flat`, where a span of `n` elements lies, checked; a null
/// `flat` is refused under a span that is not empty (an unpack from it would read zeros, as a span
/// with no source does).
fn flat_address(dtype: DType, flat: u64, start: u64, n: u64) -> Result<u64> {
    present(flat, n, "a pack with a null flat buffer")?;
    check_aligned(flat, dtype.size())?;
    start
        .checked_mul(dtype.size() as u64)
        .and_then(|bytes| flat.checked_add(bytes))
        .ok_or(PAST_THE_ADDRESSES)
}

/// The span of `n` elements from the param at `ptr` to `in_flat`: the param's address checked
/// for alignment, and refused when null (a span with no source writes zeros).
fn param_span(dtype: DType, ptr: u64, in_flat: u64, n: u64) -> Result<Span> {
    present(ptr, n, "a pack entry with a null parameter address")?;
    check_aligned(ptr, dtype.size())?;
    Ok(Span {
        src: ptr,
        dst: in_flat,
        n,
    })
}

/// Refuses a null `address` under `n` elements (`what` says whose): a span with no source writes
/// zeros, so a null one would not fault.
fn present(address: u64, n: u64, what: &'static str) -> Result<()> {
    match address == 0 && n > 0 {
        true => Err(Error::Unsupported {
            backend: "cuda",
            what,
        }),
        false => Ok(()),
    }
}

/// The number of norm parts at `parts` as the kernels take it, the parts and the
/// [`StepValues`] at `values` checked to be aligned.
fn checked_parts((parts, ranks): (u64, usize), values: u64) -> Result<u32> {
    check_aligned(parts, std::mem::align_of::<f64>())?;
    check_aligned(values, std::mem::align_of::<StepValues>())?;
    u32::try_from(ranks).map_err(|_| Error::SizeOverflow {
        what: "the ranks' norm parts",
    })
}
