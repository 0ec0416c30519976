//! Fully-sharded data-parallel training with fused, padded flat buffers.

pub mod backend;
pub mod comm;
pub mod config;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod grads;
pub mod mlp;
pub mod optim;
pub mod plan;
pub mod schedule;
pub mod spec;
pub mod state;

pub use backend::cpu::CpuBackend;
pub use backend::{Backend, Input, MemoryUsage};
pub use comm::Communicator;
pub use comm::local::LocalComm;
pub use config::{EngineConfig, GradReduction};
pub use dtype::{DType, Element};
pub use engine::{Counters, Engine};
pub use error::{Error, Result};
pub use optim::OptimizerConfig;
pub use plan::{Group, MemoryPerRank, ParamId, ParamLayout, Plan, Unit};
pub use spec::{ModelSpec, ParamSpec};
