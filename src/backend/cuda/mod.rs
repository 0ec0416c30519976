//! The CUDA backend.

pub mod kernels;
