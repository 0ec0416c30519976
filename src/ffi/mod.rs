//! The C ABI: `include/fsdp_fusion.h`, generated from this module by cbindgen.
//!
//! Conventions: every function returns an [`fsdp_status`]; on failure, [`fsdp_last_error`] gives
//! the calling thread's message. Handles (`fsdp_plan`, `fsdp_local_group`, `fsdp_loopback_group`,
//! `fsdp_engine`) are opaque numbers made by a `*_create` function and released by the matching
//! `*_destroy` (which accepts NULL); a destroyed handle is reported as `FSDP_INVALID_HANDLE`, never
//! dereferenced. Every function catches panics (`FSDP_PANIC`). Sizes are `size_t`. Handles may be
//! used from any thread; calls on one engine are serialized, and any thread may drive it, a pool of
//! them in turn (see `fsdp_engine`). Pointers passed in are borrowed for the call only unless a
//! function says otherwise.
//!
//! Engines run on the CPU backend (`fsdp_engine_create_cpu`: every address is host memory) or on
//! the CUDA backend (`fsdp_engine_create_cuda_nccl`, `fsdp_engine_create_cuda_loopback`): there
//! parameter views, gradients and gradient slots are device addresses used on the caller's stream,
//! while initial values and shard copies stay in host memory.
#![allow(non_camel_case_types)]

mod allocator;
mod capture;
mod checkpoint;
mod comms;
mod engine;
mod engine_hooks;
mod engine_values;
#[cfg(feature = "fault-injection")]
mod faults;
mod group;
pub(crate) mod handles;
mod plan;
mod recipe;
mod registry;
mod status;
mod stream;
mod types;

pub use allocator::fsdp_device_allocator;
pub use capture::*;
pub use checkpoint::*;
pub use engine::*;
pub use engine_hooks::*;
pub use engine_values::*;
#[cfg(feature = "fault-injection")]
pub use faults::*;
pub use group::*;
pub use plan::*;
pub use recipe::*;
pub use status::{FSDP_ABI_VERSION, fsdp_abi_version, fsdp_last_error, fsdp_status};
pub use stream::*;
pub use types::*;
