//! The crate's one error type.

use std::sync::Arc;
use std::time::Duration;

use crate::types::{BufferState, DType, Stream, Unit};

/// Every failure the crate reports. Variants carry the values a caller needs to find the cause.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("cannot read model file {path}: {source}")]
    ModelFile {
        path: String,
        #[source]
        source: Arc<std::io::Error>,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: Arc<std::io::Error>,
    },
    #[error("checkpoint {path}: {reason}")]
    CheckpointUnreadable { path: String, reason: String },
    #[error("the checkpoint is of another model: {}", differences.join("; "))]
    CheckpointMismatch { differences: Vec<String> },
    #[error("{path} exists: a save or an export never overwrites one (choose a new path)")]
    CheckpointExists { path: String },
    #[error(
        "a step is under way (hooks open, gradients taken, or synced): {action} is allowed between end_step and the next step's first hook"
    )]
    MidStep { action: &'static str },
    #[error("parameter name {name:?} is reserved: safetensors keeps its metadata under it")]
    ReservedName { name: String },
    #[error("an empty path was given for {what}: name a file or directory")]
    EmptyPath { what: String },
    #[error("rank {rank} refused, so no rank went on: {cause}")]
    PeerRefused {
        rank: usize,
        #[source]
        cause: Box<Error>,
    },
    #[error("the save into {dir} is still being written: wait for it (wait_save) before another")]
    SavePending { dir: String },
    #[error("model file {path} is not UTF-8: the bytes from offset {offset} on are not text")]
    NotUtf8 { path: String, offset: usize },
    #[error("malformed model JSON at line {line}, column {column}: {message}")]
    Json {
        line: usize,
        column: usize,
        message: String,
    },
    #[error("a model needs at least one parameter")]
    EmptyModel,
    #[error("parameter #{index} has an empty name")]
    EmptyName { index: usize },
    #[error("parameter {index}'s name holds a NUL character, which no C string can name")]
    NulInName { index: usize },
    #[error("parameter name {name:?} is declared twice (#{first} and #{second})")]
    DuplicateName {
        name: String,
        first: usize,
        second: usize,
    },
    #[error("parameter {name:?}: the element count of shape {shape:?} overflows")]
    NumelOverflow { name: String, shape: Vec<u64> },
    #[error("parameter {name:?}: unknown dtype {given:?} (expected bf16, f16 or f32)")]
    UnknownDtype { name: String, given: String },
    #[error("world size must be at least 1")]
    ZeroWorldSize,
    #[error("process group {name:?} {reason}")]
    InvalidProcessGroup { name: String, reason: String },
    #[error("parameter {name:?} names process group {group:?}, which the model does not declare")]
    UnknownProcessGroup { name: String, group: String },
    #[error(
        "process group {name:?}: the plan has {size} ranks per group, rank {rank} at place {place}; \
         its communicator has {comm_size} ranks, this one at place {comm_rank}"
    )]
    ProcessGroupMismatch {
        name: String,
        size: usize,
        rank: usize,
        place: usize,
        comm_size: usize,
        comm_rank: usize,
    },
    #[error("rank {rank} is out of range for world size {world_size}")]
    RankOutOfRange { rank: usize, world_size: usize },
    #[error(
        "parameter {name:?}: its padded place in its group overflows at world size {world_size}"
    )]
    LayoutOverflow { name: String, world_size: usize },
    #[error("invalid configuration: {field} {reason}")]
    InvalidConfig { field: &'static str, reason: String },
    #[error("the plan has world size {plan}, the communicator {comm}")]
    WorldSizeMismatch { plan: usize, comm: usize },
    #[error("the plan is for {plan} replicas, the communicator has {comm}")]
    ReplicasMismatch { plan: usize, comm: usize },

    #[error("no parameter named {name:?}")]
    UnknownParam { name: String },
    #[error("parameter id {id} is out of range ({count} parameters)")]
    ParamIdOutOfRange { id: usize, count: usize },
    #[error("group index {group} is out of range ({count} groups)")]
    GroupOutOfRange { group: usize, count: usize },
    #[error("{unit} has no parameters in this plan")]
    UnknownUnit { unit: Unit },
    #[error("{unit}: forward started twice without ending")]
    ForwardAlreadyOpen { unit: Unit },
    #[error("{unit}: forward ended but was not started (or was already ended)")]
    ForwardNotOpen { unit: Unit },
    #[error("{unit}: backward started twice without ending")]
    BackwardAlreadyOpen { unit: Unit },
    #[error("{unit}: backward ended but was not started (or was already ended)")]
    BackwardNotOpen { unit: Unit },
    #[error("{unit}: forward is still open; end it before syncing gradients or ending the step")]
    ForwardStillOpen { unit: Unit },
    #[error("{unit}: backward is still open; end the backward pass before ending the step")]
    BackwardStillOpen { unit: Unit },
    #[error("parameter {name:?} is frozen and takes no gradient")]
    FrozenGradient { name: String },
    #[error("parameter {name:?} already received a gradient in this backward pass")]
    DuplicateGradient { name: String },
    #[error("parameter {name:?}: lr_scale {scale} is not finite and >= 0")]
    InvalidLrScale { name: String, scale: f32 },
    #[error("parameter {name:?}: gradient has {got} elements, the parameter {expected}")]
    GradientLength {
        name: String,
        expected: usize,
        got: usize,
    },
    #[error("parameter {name:?} is {param}: its gradient must be {param} or f32, not {got}")]
    GradientDtype {
        name: String,
        param: DType,
        got: DType,
    },
    #[error("parameter {name:?}: {bytes} bytes are not a whole number of {dtype} elements")]
    PartialElement {
        name: String,
        bytes: usize,
        dtype: DType,
    },
    #[error("parameter {name:?}: data has {got} elements, the parameter {expected}")]
    DataLength {
        name: String,
        expected: usize,
        got: usize,
    },
    #[error("parameter {name:?} is {param}, not {requested}")]
    DtypeMismatch {
        name: String,
        param: DType,
        requested: DType,
    },
    #[error("the gradient slot of {name:?} is open: commit it before any other gradient or hook")]
    GradSlotOpen { name: String },
    #[error("parameter {name:?} has no open gradient slot to commit")]
    GradSlotNotOpen { name: String },
    #[error("no gradient slot to write into: {reason}; hand gradients over instead")]
    GradSlotUnavailable { reason: &'static str },
    #[error("gradients are not synced: call finish_grad_sync before {action}")]
    GradsNotSynced { action: &'static str },
    #[error("the optimizer already stepped in this step")]
    OptimizerAlreadyStepped,
    #[error("the optimizer stepped: end the step before {action}")]
    OptimizerStepped { action: &'static str },
    #[error(
        "{action} after the step's clipping or non-finite skip was decided over its gradients so far: clip and skip once the step's last backward pass was synced"
    )]
    GradientsDecided { action: &'static str },
    #[error(
        "{what} is refused with step_in_backward: each group is updated as soon as its gradient is final, before the whole gradient exists"
    )]
    StepInBackward { what: &'static str },
    #[error(
        "parameter {name:?} got its gradient after its unit's ({unit:?}) backward ended, which reduced the unit's gradients of the pass; where gradients travel between ranks a unit's gradients come before its post_backward (a parameter used outside its unit's forward belongs to the root)"
    )]
    GradientAfterItsUnit { name: String, unit: Unit },
    #[error("parameter {name:?} is not gathered: its unit's forward or backward must be open")]
    NotGathered { name: String },
    #[error("group {group}: transition {from:?} -> {to:?} is not allowed")]
    ForbiddenTransition {
        group: usize,
        from: BufferState,
        to: BufferState,
    },

    #[error("the ranks' collectives differ: rank 0 issued {expected}, rank {rank} issued {got}")]
    CollectiveMismatch {
        rank: usize,
        expected: String,
        got: String,
    },
    #[error(
        "the ranks' collectives crossed streams: rank {rank} waits in {mine} while rank {peer} waits in {theirs}, which the engine numbers the same: the ranks issue different collectives (a different number of micro-batches, or settings)"
    )]
    CollectivesCrossed {
        rank: usize,
        mine: String,
        peer: usize,
        theirs: String,
    },
    #[error(
        "the ranks' plans differ at parameter #{index}: rank 0 has {expected}, rank {rank} has {got}"
    )]
    PlanMismatch {
        rank: usize,
        index: usize,
        expected: String,
        got: String,
    },
    #[error(
        "the ranks' settings that shape their collectives differ: rank 0 has {expected}, rank {rank} has {got}"
    )]
    SettingsMismatch {
        rank: usize,
        expected: String,
        got: String,
    },
    #[error("rank {rank}'s thread panicked")]
    RankPanicked { rank: usize },
    #[error("{message}")]
    Panicked { message: String },
    #[error(
        "{op}: rank {rank} left the group (its engine was dropped or aborted, or its group destroyed before it made one)"
    )]
    PeerGone { rank: usize, op: String },
    #[error("{op} timed out after {waited:?}")]
    Timeout { op: String, waited: Duration },
    #[error(
        "{collective} (this rank at place {place} of {peers}) was still in flight after {waited:?}: a peer is stuck or gone; the rank's communicators were aborted"
    )]
    CollectiveTimedOut {
        collective: String,
        place: usize,
        peers: usize,
        waited: Duration,
    },
    #[error("the engine was aborted")]
    Aborted,
    #[error("the engine failed earlier and can only be dropped: {cause}")]
    Poisoned {
        #[source]
        cause: Box<Error>,
    },

    #[error("CUDA is not available: {reason}")]
    CudaUnavailable { reason: String },
    #[error(
        "the CUDA kernels are not in this build: nvcc was not found when it was compiled (rebuild \
         with nvcc on PATH, or NVCC or CUDA_HOME set)"
    )]
    KernelsUnavailable,
    #[error("CUDA call {call} failed: {message} (code {code})")]
    Cuda {
        call: &'static str,
        code: i32,
        message: String,
    },
    #[error("the launch environment's {variable} {reason}")]
    LaunchEnv {
        variable: &'static str,
        reason: String,
    },
    #[error("the NCCL unique id exchange with {peer} failed: {reason}")]
    Rendezvous { peer: String, reason: String },
    #[error("NCCL is not available: {reason}")]
    NcclUnavailable { reason: String },
    #[error("NCCL call {call} failed: {message} (code {code})")]
    Nccl {
        call: &'static str,
        code: i32,
        message: String,
    },
    /// Work that a captured step cannot hold (a host wait, an allocation), or streams that break
    /// a capture's rules (work on a stream that did not join it, a wait on work outside it, a
    /// stream not joined back at its end).
    #[error("cannot capture: {what}")]
    Capture { what: String },
    #[error("{backend} backend cannot take {what}")]
    Unsupported {
        backend: &'static str,
        what: &'static str,
    },
    #[error("the plan's {what} take more bytes than an address can count")]
    SizeOverflow { what: &'static str },
    #[error("out of memory: {bytes} bytes for {what}")]
    OutOfMemory { bytes: usize, what: String },
    /// The caller's device allocator gave an address that cannot be device memory it owns.
    #[error(
        "the caller's allocator gave address {address:#x} for {bytes} bytes: not a 256-byte aligned, non-null address"
    )]
    BadAllocation { address: u64, bytes: usize },
    #[error("the {stream:?} stream failed, and everything queued after it was skipped: {cause}")]
    StreamFailed {
        stream: Stream,
        #[source]
        cause: Arc<Error>,
    },
    #[error("cannot start {what}: {source}")]
    Spawn {
        what: &'static str,
        #[source]
        source: Arc<std::io::Error>,
    },
    #[error("the {stream:?} stream's worker panicked")]
    WorkerPanicked { stream: Stream },
    #[error("buffer access out of range: {offset} + {len} > {capacity} elements")]
    OutOfRange {
        offset: usize,
        len: usize,
        capacity: usize,
    },
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
