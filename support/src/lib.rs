//! What fsdp-fusion's tests, benches and examples share, kept out of the library so that its
//! consumers carry none of it: the example model with its CPU math and unsharded reference
//! trainer ([`mlp`]), the cuBLAS layer stack of the pipeline benchmark ([`gpu_stack`]),
//! deterministic data ([`rng`], [`values`]), the harness that runs ranks as threads
//! ([`ranks`]), scratch directories ([`scratch`]), the examples built for a test
//! ([`examples`]) and a model of many one-element units for the engine's bookkeeping
//! ([`unit_stack`]).

pub mod examples;
pub mod faults;
pub mod gpu_stack;
pub mod mlp;
pub mod ranks;
pub mod rng;
pub mod scratch;
pub mod unit_stack;
pub mod values;
