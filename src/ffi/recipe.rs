//! A step's recipe from C: the learning rate and weight decay between steps, the gradient norms
//! and their clipping.

use super::handles::{on_engine, with_engine};
use super::status::{boundary, fsdp_status, null, put};
use super::types::{fsdp_engine, fsdp_grad_norm};
use crate::engine::GradNorm;

impl From<GradNorm> for fsdp_grad_norm {
    fn from(n: GradNorm) -> fsdp_grad_norm {
        fsdp_grad_norm {
            l2: n.l2,
            max: n.max,
        }
    }
}

/// Sets the learning rate of the next optimizer steps (call it before each step for a
/// schedule); every parameter's is this times its `lr_scale`. Every rank must set the same.
/// `FSDP_INVALID_ARGUMENT` for a negative or non-finite rate, and `FSDP_MISUSE` once the step's
/// gradients began where the optimizer steps in the backward (an update may have run), both
/// changing nothing; `FSDP_POISONED` on a poisoned or aborted engine.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_set_lr(engine: *mut fsdp_engine, lr: f32) -> fsdp_status {
    boundary(|| on_engine(engine, |any| Ok(with_engine!(any, e => e.set_lr(lr))?)))
}

/// Sets the weight decay of the next optimizer steps, for the parameters that take it.
/// `FSDP_INVALID_ARGUMENT` for a negative or non-finite decay, and `FSDP_MISUSE` once the step's
/// gradients began where the optimizer steps in the backward, both changing nothing;
/// `FSDP_POISONED` on a poisoned or aborted engine.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_set_weight_decay(
    engine: *mut fsdp_engine,
    weight_decay: f32,
) -> fsdp_status {
    boundary(|| {
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.set_weight_decay(weight_decay))?)
        })
    })
}

/// The whole model's gradient norms over every rank, after `fsdp_engine_finish_grad_sync` and
/// before the optimizer step (`FSDP_MISUSE` otherwise). A collective: every rank calls it. Blocks
/// the host until the norms are known.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_grad_norm(
    engine: *mut fsdp_engine,
    out: *mut fsdp_grad_norm,
) -> fsdp_status {
    boundary(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        let norm = on_engine(engine, |any| Ok(with_engine!(any, e => e.grad_norm())?))?;
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", norm.into()) }
    })
}

/// As `fsdp_engine_grad_norm`, and this step's optimizer multiplies every gradient by
/// `min(1, max_norm / (l2 + 1e-6))` inside its update, as `torch.nn.utils.clip_grad_norm_`
/// would before the step; `*out` gets the norms before clipping. A step with non-finite norms
/// can be skipped: end it with `fsdp_engine_end_step` without `fsdp_engine_optimizer_step` (the
/// counters count it). `max_norm` must be finite and > 0. The step takes no gradient and no
/// backward hook after it (`FSDP_MISUSE`, nothing changed): the coefficient would not see them;
/// so for `fsdp_engine_clip_grad_norm_on_device` and `fsdp_engine_skip_nonfinite_on_device`.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_clip_grad_norm(
    engine: *mut fsdp_engine,
    max_norm: f32,
    out: *mut fsdp_grad_norm,
) -> fsdp_status {
    boundary(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        let norm = on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.clip_grad_norm(max_norm))?)
        })?;
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", norm.into()) }
    })
}

/// As `fsdp_engine_clip_grad_norm` (its coefficient from the same norms bit for bit; on a GPU a
/// rank's sum of squares adds its threads' parts in the order they finish, so two computations
/// of it can differ in the last bits), with no host wait: each rank's part of the
/// norms is summed, gathered across the ranks and turned into the clipping coefficient on the
/// device, where `fsdp_engine_optimizer_step` reads it; the host never sees the norms. A
/// collective (every rank calls it). `max_norm` must be finite and > 0.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_clip_grad_norm_on_device(
    engine: *mut fsdp_engine,
    max_norm: f32,
) -> fsdp_status {
    boundary(|| {
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.clip_grad_norm_on_device(max_norm))?)
        })
    })
}

/// Skips this step's update on the device where the whole gradient's norm is not finite (the f32
/// 2-norm or the largest magnitude infinite or NaN, as any infinite or NaN element makes it),
/// with no host wait: the shards, masters and moments stay, and the step counts neither for
/// AdamW's bias correction nor for the optimizer's steps, as a step whose caller saw that norm
/// (`fsdp_engine_grad_norm`) and called no `fsdp_engine_optimizer_step`. Each rank's part of the
/// norms is summed and gathered across the ranks as for `fsdp_engine_clip_grad_norm_on_device`
/// (once for both), so every rank decides alike; `fsdp_engine_optimizer_step` follows as usual. The
/// host counts the skipped steps when it reads them (`fsdp_engine_read_device_skips`, which a save
/// does first). A collective (every rank calls it), from `fsdp_engine_finish_grad_sync` to
/// `fsdp_engine_optimizer_step`; allowed during a capture, whose replays decide each on their own
/// gradients. `FSDP_MISUSE` where the optimizer steps in the backward.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_skip_nonfinite_on_device(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| {
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.skip_nonfinite_on_device())?)
        })
    })
}
