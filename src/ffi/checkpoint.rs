//! Sharded checkpoints from C: each rank saves and loads its own part, the ranks agreeing first.

use std::ffi::c_char;

use super::handles::{AnyEngine, on_engine, with_engine};
use super::status::{boundary, file_path, fsdp_status};
use super::types::fsdp_engine;

/// Writes this rank's part of a checkpoint into directory `dir` (made if missing): its shards (a
/// trainable bf16/f16 group's fp32 master instead), AdamW moments, the optimizer's step and
/// settings and the plan's layout. A collective: every rank calls it with the same `dir`. The ranks
/// first agree on the save's id, which every manifest records, and that `dir` holds no rank file of
/// any checkpoint: `FSDP_INVALID_ARGUMENT` on every rank otherwise (the failing rank's message
/// naming the file, the others naming that rank), and nothing written. Each rank then writes its
/// data and then its manifest, each under a unique temporary name (created new: no existing file or
/// symlink is written through), flushed to disk, linked into place (never over an existing file)
/// and the directory flushed: an interrupted save never looks complete. Then the ranks agree on the
/// outcome: `FSDP_OK` on every rank once every rank's files are on disk; where a rank could not
/// write a file, `FSDP_IO_ERROR` on every rank (the others naming that rank), and no rank's file of
/// the save left (the ranks that wrote remove theirs); a failure that poisons a rank while it
/// writes (its device, an abort) fails the agreement instead, on every rank, and the files already
/// written stay (a load refuses them: the save is incomplete). The ranks' writes end within the
/// engine's timeout of each other; under hybrid sharding only the first replica's ranks write, and
/// the others wait for their outcome within the timeout, so a rank's whole write must take less
/// (`fsdp_engine_save_async` has no such bound: `fsdp_engine_wait_save` reports a write still under
/// way). `FSDP_INVALID_ARGUMENT` for an empty `dir`; `FSDP_MISUSE` between a step's first hook and
/// `fsdp_engine_end_step`, and while an asynchronous save's outcome was not given
/// (`fsdp_engine_wait_save`). Blocks until every byte is on disk.
///
/// # Safety
/// `dir` is NULL or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_save(
    engine: *mut fsdp_engine,
    dir: *const c_char,
) -> fsdp_status {
    // SAFETY: the caller's contract.
    unsafe { at_path(engine, dir, "dir", PathOp::Save) }
}

/// As `fsdp_engine_save` (a collective, with the same agreement first), with the files written
/// on a thread of the library's while training goes on: the call copies this rank's state on
/// the compute stream into host memory that the engine keeps for its next asynchronous save
/// (page-locked on a GPU; the size of the rank's state) and returns once the copy is done;
/// `fsdp_engine_wait_save` gives the save's outcome. One save is pending at a time, until
/// `fsdp_engine_wait_save` gave its outcome: `FSDP_MISUSE` on every rank while one rank's is.
/// A failure on this rank after the ranks agreed to the save is its status here: its writer's
/// start failing stays pending, for every rank's `fsdp_engine_wait_save` to report; its copy
/// failing poisons the engine (the device failed), and the other ranks'
/// `fsdp_engine_wait_save` fail at their deadline.
/// Destroying the engine waits for the files.
///
/// # Safety
/// `dir` is NULL or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_save_async(
    engine: *mut fsdp_engine,
    dir: *const c_char,
) -> fsdp_status {
    // SAFETY: the caller's contract.
    unsafe { at_path(engine, dir, "dir", PathOp::SaveAsync) }
}

/// The outcome of `fsdp_engine_save_async`, a collective: every rank calls it, between steps.
/// Each rank waits for its files (within half the engine's timeout above world size 1), then
/// the ranks agree on the outcome as `fsdp_engine_save`'s: `FSDP_OK` on every rank once every
/// rank's files are on disk; `FSDP_TIMEOUT` on every rank while a rank's files are still being
/// written, the save still pending, nothing removed and the engine not poisoned (call again;
/// a peer that never calls makes the agreement's own wait pass the deadline, which poisons);
/// where a rank's write
/// failed, the same status on every rank (`FSDP_IO_ERROR` naming the file, the others naming
/// that rank) and each rank's files of the save removed (a writer still running removes its
/// own when it ends). `FSDP_OK` when no save is pending on any rank. `FSDP_MISUSE` during a
/// capture and mid-step; `FSDP_POISONED` on a poisoned or aborted engine (destroying it still
/// waits for the files).
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_wait_save(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| on_engine(engine, |any| Ok(with_engine!(any, e => e.wait_save())?)))
}

/// Restores this rank's part of the checkpoint in `dir`, saved by engines of the same model
/// (parameters declared in the same order) and optimizer at this world size or another: each
/// rank reads only the bytes its shards need from the saved ranks' files, each once. The
/// optimizer continues from the saved step, learning rate and weight decay. A collective:
/// nothing changes on any rank unless every rank's part checked out, and every rank returns
/// the same status for the failures named here (a rank whose own part was fine names the
/// failing rank in its message); a rank that failed otherwise before the ranks agreed (a reader
/// thread the system refused it, say) returns its own status, the others `FSDP_IO_ERROR` naming
/// it; a rank whose upload fails after they agreed (its device, or a thread of its copy that the
/// system refused) is poisoned, its state half loaded, while the others return `FSDP_OK`.
/// `FSDP_IO_ERROR` naming the file and field for a checkpoint that is missing, incomplete (a
/// rank's manifest absent), truncated, corrupted (a chunk's checksum), changed (a manifest's
/// own checksum, or fields that disagree with the layout they describe) or made of two saves'
/// files (their save ids); `FSDP_INVALID_ARGUMENT` listing the differences for one of another
/// model or optimizer, for an empty `dir`, and on every rank where ranks read directories (a
/// node-local copy each) of two saves, naming both saves' ids; `FSDP_OUT_OF_MEMORY` when the
/// host cannot hold this rank's state (it is read whole before anything changes);
/// `FSDP_MISUSE` inside a step. Blocks until the state is loaded.
///
/// # Safety
/// `dir` is NULL or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_load(
    engine: *mut fsdp_engine,
    dir: *const c_char,
) -> fsdp_status {
    // SAFETY: the caller's contract.
    unsafe { at_path(engine, dir, "dir", PathOp::Load) }
}

/// Writes the full model into the safetensors file `path`: every parameter under its name,
/// shape and dtype, readable by the Python `safetensors` package and loadable into a PyTorch
/// model's `state_dict`. Written under a unique temporary name, flushed and linked into place
/// (never over an existing file or symlink), the directory flushed. World size 1 only
/// (`FSDP_UNAVAILABLE` otherwise: save, then `fsdp_checkpoint_export_safetensors`); between
/// steps only (`FSDP_MISUSE`); `FSDP_INVALID_ARGUMENT` where `path` is empty or exists;
/// `FSDP_IO_ERROR` when it cannot be written. Holds one group's values in host memory at a
/// time.
///
/// # Safety
/// `path` is NULL or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_export_safetensors(
    engine: *mut fsdp_engine,
    path: *const c_char,
) -> fsdp_status {
    // SAFETY: the caller's contract.
    unsafe { at_path(engine, path, "path", PathOp::Export) }
}

/// Loads every parameter's values from the safetensors file `path` (an export, or a pretrained
/// model's) at any world size: each rank reads only its shard's elements, with plain reads (no
/// memory map: a file changed meanwhile gives an error or the bytes read, never a crash). A
/// collective: every rank calls it, and nothing is loaded on any rank unless every rank read
/// its part and has the host memory to widen it for the fp32 masters; a rank whose upload
/// fails after the ranks agreed (its device) is poisoned, its parameters half loaded. The file
/// must hold exactly the model's parameters by name, shape and dtype:
/// `FSDP_INVALID_ARGUMENT` lists every difference. Ranks whose files differ (node-local copies
/// of two models, say) in their length, header or the first 4 KiB of a tensor get
/// `FSDP_INVALID_ARGUMENT` alike, nothing loaded; files that differ only past those bytes are
/// not told apart. `FSDP_IO_ERROR` for
/// a file that is missing, truncated or not safetensors; `FSDP_MISUSE` inside a step. The
/// optimizer's state is left as it is.
///
/// # Safety
/// `path` is NULL or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_import_safetensors(
    engine: *mut fsdp_engine,
    path: *const c_char,
) -> fsdp_status {
    // SAFETY: the caller's contract.
    unsafe { at_path(engine, path, "path", PathOp::Import) }
}

/// Writes the full model of the sharded checkpoint in directory `dir` (saved by engines of any
/// world size) into the safetensors file `path`, as `fsdp_engine_export_safetensors` does at
/// world size 1: no engine and no communication, so one process exports after every rank saved.
/// Every manifest is checked and every chunk read is checked: `FSDP_IO_ERROR` naming the file
/// for a checkpoint that is missing, incomplete, truncated, corrupted or changed;
/// `FSDP_INVALID_ARGUMENT` where `path` is empty or exists, or a parameter is named
/// `__metadata__` (safetensors' own key). Holds one parameter in host memory at a time.
///
/// # Safety
/// `dir` and `path` are NULL or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_checkpoint_export_safetensors(
    dir: *const c_char,
    path: *const c_char,
) -> fsdp_status {
    boundary(|| {
        // SAFETY: the caller's contract.
        let dir = unsafe { file_path(dir, "dir") }?;
        // SAFETY: the caller's contract.
        let path = unsafe { file_path(path, "path") }?;
        Ok(crate::export::export_checkpoint(dir, path)?)
    })
}

/// What an engine does with a path from C.
#[derive(Clone, Copy)]
enum PathOp {
    Save,
    SaveAsync,
    Load,
    Export,
    Import,
}

/// Runs `op` on the engine with the NUL-terminated `path` (named `what` when NULL).
///
/// # Safety
/// `path` is NULL or NUL-terminated.
unsafe fn at_path(
    engine: *mut fsdp_engine,
    path: *const c_char,
    what: &'static str,
    op: PathOp,
) -> fsdp_status {
    boundary(|| {
        // SAFETY: the caller's contract.
        let path = unsafe { file_path(path, what) }?;
        on_engine(engine, |any: &mut AnyEngine| {
            Ok(with_engine!(any, e => match op {
                PathOp::Save => e.save(path),
                PathOp::SaveAsync => e.save_async(path),
                PathOp::Load => e.load(path),
                PathOp::Export => e.export_safetensors(path),
                PathOp::Import => e.import_safetensors(path),
            })?)
        })
    })
}
