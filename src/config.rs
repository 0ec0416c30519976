//! How one rank's engine runs.

use crate::error::{Error, Result};
use crate::optim::OptimizerConfig;

/// How gradients from the ranks combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GradReduction {
    /// Sum divided by the world size.
    #[default]
    Mean,
    Sum,
}

/// The engine's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Most gathered (syncing, in use or ready) buffers kept at once; a required gather may exceed
    /// it when no ready buffer can be evicted, a prefetch never does. At least 1.
    pub double_buffer_limit: usize,
    /// Most gradient reduce-scatters in flight before the oldest is retired. At least 1.
    pub max_reduces_in_flight: usize,
    /// Prefetch the next unit's gathers and keep reductions in flight; off, every collective
    /// completes before the hook that issued it returns.
    pub overlap: bool,
    pub grad_reduction: GradReduction,
    pub optimizer: OptimizerConfig,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            double_buffer_limit: 2,
            max_reduces_in_flight: 2,
            overlap: true,
            grad_reduction: GradReduction::Mean,
            optimizer: OptimizerConfig::default(),
        }
    }
}

impl EngineConfig {
    /// Checks every field.
    pub fn validate(&self) -> Result<()> {
        if self.double_buffer_limit == 0 {
            return Err(Error::InvalidConfig {
                field: "double_buffer_limit",
                reason: "must be at least 1".into(),
            });
        }
        if self.max_reduces_in_flight == 0 {
            return Err(Error::InvalidConfig {
                field: "max_reduces_in_flight",
                reason: "must be at least 1".into(),
            });
        }
        self.optimizer.validate()
    }
}
