//! What fsdp-fusion's tests, benches and examples share, kept out of the library so that its
//! consumers carry none of it: the example model with its CPU math and unsharded reference
//! trainer ([`mlp`]), the cuBLAS layer stack of the pipeline benchmark ([`gpu_stack`]),
//! deterministic data ([`rng`], [`values`]), the harness that runs ranks as threads
//! ([`ranks`]), scratch directories ([`scratch`]) and the examples built for a test
//! ([`examples`]).

pub mod examples;
pub mod faults;
pub mod gpu_stack;
pub mod mlp;
pub mod ranks;
pub mod rng;
pub mod scratch;
pub mod values;
