//! The hand-written kernels of `kernels/*.cu`, embedded as one fatbin, and their launches.
//!
//! SKELETON: the signatures are the contract with the CUDA backend; the bodies are to be written.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::AdamwCoefficients;

/// One parameter of a pack or unpack table, in elements of the group's dtype.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct PackEntry {
    /// Device address of the parameter's own (unpadded) storage.
    pub ptr: u64,
    /// First element of the parameter in the flat buffer.
    pub offset: u64,
    pub numel: u64,
    /// Elements reserved in the flat buffer; `numel..padded` is written as zero by `pack`.
    pub padded: u64,
}

/// The loaded kernels of one CUDA context.
pub struct Kernels {}

impl Kernels {
    pub fn load(_ctx: &Arc<CudaContext>) -> Result<Kernels> {
        Err(Error::KernelsUnavailable)
    }

    /// # Safety
    /// `dst` is valid for `bytes` bytes on `stream`.
    pub unsafe fn fill_zero(&self, _stream: &CudaStream, _dst: u64, _bytes: usize) -> Result<()> {
        Err(Error::KernelsUnavailable)
    }

    /// `dst[i] = src[i]` for `i < n`, any alignment of either address.
    ///
    /// # Safety
    /// `src` and `dst` are valid for `n` elements of `dtype` and do not overlap.
    pub unsafe fn copy(&self, _stream: &CudaStream, _dtype: DType, _src: u64, _dst: u64, _n: usize) -> Result<()> {
        Err(Error::KernelsUnavailable)
    }

    /// `dst = scale * src` or `dst = dst + scale * src` (f32 `dst`), exactly as
    /// [`crate::optim::accumulate_element`].
    ///
    /// # Safety
    /// `src` is valid for `n` elements of `src_dtype`, `dst` for `n` f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn accumulate(
        &self,
        _stream: &CudaStream,
        _src_dtype: DType,
        _src: u64,
        _dst: u64,
        _n: usize,
        _scale: f32,
        _add: bool,
    ) -> Result<()> {
        Err(Error::KernelsUnavailable)
    }

    /// `dst[i] = convert(src[i])`, rounding to nearest even when narrowing.
    ///
    /// # Safety
    /// `src` and `dst` are valid for `n` elements of their dtypes and do not overlap.
    pub unsafe fn cast(
        &self,
        _stream: &CudaStream,
        _src_dtype: DType,
        _src: u64,
        _dst_dtype: DType,
        _dst: u64,
        _n: usize,
    ) -> Result<()> {
        Err(Error::KernelsUnavailable)
    }

    /// AdamW exactly as [`crate::optim::adamw_element`] on fp32 `master`, `m`, `v`, `grad`, writing
    /// the result to `master` and, rounded, to `param` (of `param_dtype`). For f32 params `master`
    /// may equal `param`.
    ///
    /// # Safety
    /// Every address is valid for `n` elements.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn adamw(
        &self,
        _stream: &CudaStream,
        _param_dtype: DType,
        _master: u64,
        _m: u64,
        _v: u64,
        _grad: u64,
        _param: u64,
        _n: usize,
        _c: &AdamwCoefficients,
    ) -> Result<()> {
        Err(Error::KernelsUnavailable)
    }

    /// SGD exactly as [`crate::optim::sgd_element`]; `master` may equal `param` for f32 params.
    ///
    /// # Safety
    /// Every address is valid for `n` elements.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn sgd(
        &self,
        _stream: &CudaStream,
        _param_dtype: DType,
        _master: u64,
        _grad: u64,
        _param: u64,
        _n: usize,
        _lr: f32,
    ) -> Result<()> {
        Err(Error::KernelsUnavailable)
    }

    /// Packs `count` params (a device array of [`PackEntry`]) into `flat` in one launch; the
    /// entries tile `0..flat_numel`, padding is written as zero.
    ///
    /// # Safety
    /// `table` holds `count` entries whose addresses are valid; `flat` holds `flat_numel` elements.
    pub unsafe fn pack(
        &self,
        _stream: &CudaStream,
        _dtype: DType,
        _table: u64,
        _count: usize,
        _flat: u64,
        _flat_numel: usize,
    ) -> Result<()> {
        Err(Error::KernelsUnavailable)
    }

    /// The reverse of `pack`: each entry's `numel` elements copied out of `flat`.
    ///
    /// # Safety
    /// As `pack`.
    pub unsafe fn unpack(
        &self,
        _stream: &CudaStream,
        _dtype: DType,
        _table: u64,
        _count: usize,
        _flat: u64,
    ) -> Result<()> {
        Err(Error::KernelsUnavailable)
    }

    /// `dst[i] = ((src0[i] + src1[i]) + src2[i]) + ...` in f32, in source order, `srcs` a device
    /// array of `count` addresses; `dst` may be one of the sources (element-wise in place).
    ///
    /// # Safety
    /// Every source and `dst` is valid for `n` f32.
    pub unsafe fn reduce_sum(
        &self,
        _stream: &CudaStream,
        _srcs: u64,
        _count: usize,
        _dst: u64,
        _n: usize,
    ) -> Result<()> {
        Err(Error::KernelsUnavailable)
    }
}
