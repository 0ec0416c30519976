//! Fully-sharded data-parallel training with fused, padded flat buffers.
//!
//! A caller declares its parameters ([`ParamSpec`]); a [`Plan`] groups them by dtype,
//! trainability, FSDP unit and tying, pads each to 256 bytes times the world size and shards every
//! group's flat buffer evenly over the ranks. Each rank runs an [`Engine`] that gathers a unit's
//! groups before its forward and backward (prefetching the next unit), turns gathered buffers into
//! views of the parameters, reduce-scatters gradients into fp32 shards, and steps the optimizer
//! on the shards.
//!
//! One training step on two CPU ranks (threads):
//!
//! ```
//! use std::sync::Arc;
//! use fsdp_fusion::{
//!     CpuBackend, DType, Engine, EngineConfig, Input, LocalComm, ModelSpec, OptimizerConfig,
//!     ParamSpec, Plan, Unit,
//! };
//!
//! # fn main() -> fsdp_fusion::Result<()> {
//! let model = ModelSpec::new(vec![
//!     ParamSpec::new("w0", &[4, 4], DType::F32).in_unit(0),
//!     ParamSpec::new("w1", &[4, 4], DType::F32).in_unit(1),
//! ])?;
//! let plan = Arc::new(Plan::new(&model, 2)?);
//! let config = EngineConfig {
//!     optimizer: OptimizerConfig::sgd(0.5),
//!     ..EngineConfig::default()
//! };
//! let ranks: Vec<_> = LocalComm::group(2)?
//!     .into_iter()
//!     .map(|comm| {
//!         let (plan, config) = (Arc::clone(&plan), config.clone());
//!         std::thread::spawn(move || -> fsdp_fusion::Result<Vec<f32>> {
//!             let mut engine = Engine::new(plan, config, CpuBackend::new(), comm)?;
//!             let units = [Unit::Layer(0), Unit::Layer(1)];
//!             let ids = [engine.plan().param_id("w0")?, engine.plan().param_id("w1")?];
//!             for id in ids {
//!                 engine.load_param(id, Input::host(&[1.0f32; 16]))?;
//!             }
//!             for unit in units {
//!                 engine.pre_forward(unit)?;
//!                 // Compute with the gathered weights, e.g. engine.param::<f32>(ids[0])?.
//!                 engine.post_forward(unit)?;
//!             }
//!             // Each rank's gradient differs; the engine averages them over the ranks.
//!             let grad = [0.1 * (engine.rank() + 1) as f32; 16];
//!             for (unit, id) in units.into_iter().zip(ids).rev() {
//!                 engine.pre_backward(unit)?;
//!                 engine.grad(id, Input::host(&grad))?;
//!                 engine.post_backward(unit)?;
//!             }
//!             engine.finish_grad_sync()?;
//!             engine.optimizer_step()?;
//!             engine.end_step()?;
//!             // The next forward sees the updated weights.
//!             engine.pre_forward(units[0])?;
//!             let w0 = engine.param::<f32>(ids[0])?.to_vec();
//!             engine.post_forward(units[0])?;
//!             Ok(w0)
//!         })
//!     })
//!     .collect();
//! for rank in ranks {
//!     let w0 = rank.join().expect("rank thread")?;
//!     // 1 - 0.5 * mean(0.1, 0.2)
//!     assert!(w0.iter().all(|&w| (w - 0.925).abs() < 1e-6));
//! }
//! # Ok(())
//! # }
//! ```

pub mod backend;
pub mod checkpoint;
pub mod comm;
pub mod config;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod export;
mod fallible;
pub mod ffi;
mod grads;
mod nvtx;
pub mod optim;
pub mod plan;
mod schedule;
pub mod spec;
mod state;
mod sync;
mod threads;
pub mod trace;
pub mod types;
pub mod watch;
mod watchdog;

pub use backend::cpu::CpuBackend;
pub use backend::{Backend, Input, MemoryUsage};
pub use comm::Communicator;
pub use comm::local::LocalComm;
pub use config::{Accumulation, EngineConfig, GradReduction, GradShardMemory, ParamStorage};
pub use dtype::Element;
pub use engine::{CapturedStep, Counters, Engine, StepReplay};
pub use error::{Error, Result};
pub use optim::OptimizerConfig;
pub use plan::{BufferReport, Group, MemoryPerRank, ParamLayout, Plan, Policy};
pub use spec::{ModelSpec, ParamSpec, ProcessGroupSpec};
pub use types::{BufferState, DType, ParamId, Stream, Unit};
