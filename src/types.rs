//! The crate's shared vocabulary: element types, units, parameter ids, buffer states and
//! streams. It depends on nothing else in the crate, so every module (errors included) can name
//! these without a cycle.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The element type of a parameter, a gradient or a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    Bf16,
    F16,
    F32,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }

    /// The name used in model files and printed tables.
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
        }
    }

    /// Parses a model file's dtype name; `None` for anything else.
    pub fn parse(name: &str) -> Option<DType> {
        [DType::Bf16, DType::F16, DType::F32]
            .into_iter()
            .find(|d| d.name() == name)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An FSDP unit: a layer, or the root that holds every parameter outside the layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unit {
    Layer(u32),
    Root,
}

impl From<Option<u32>> for Unit {
    fn from(unit: Option<u32>) -> Unit {
        unit.map_or(Unit::Root, Unit::Layer)
    }
}

impl Unit {
    /// The model file's form: the layer index, or `None` for the root.
    pub fn layer(self) -> Option<u32> {
        match self {
            Unit::Layer(i) => Some(i),
            Unit::Root => None,
        }
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unit::Layer(i) => write!(f, "unit {i}"),
            Unit::Root => f.write_str("the root unit"),
        }
    }
}

/// A parameter's index in model order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(pub usize);

/// The state of one group's gathered parameter buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufferState {
    /// Only the rank's shard exists.
    Freed,
    /// An all-gather into a slot is in flight.
    Syncing,
    /// Gathered and in use by compute.
    Using,
    /// Gathered, compute done, kept for reuse until evicted.
    Ready,
}

impl BufferState {
    pub const ALL: [BufferState; 4] = [
        BufferState::Freed,
        BufferState::Syncing,
        BufferState::Using,
        BufferState::Ready,
    ];
}

/// The three streams of a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stream {
    /// The caller's compute: gradients are written and the optimizer runs here.
    Compute,
    /// All-gathers of parameter shards into gathered slots.
    Gather,
    /// Reduce-scatters of gradients and accumulation into the gradient shards.
    Reduce,
}
