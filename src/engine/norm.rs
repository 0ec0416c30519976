//! The whole model's gradient norms over every rank's fp32 shards, and their clipping inside the
//! optimizer step.

use super::Engine;
use super::reduce::GroupGrads;
use crate::backend::{Backend, Region};
use crate::comm::{Communicator, Fingerprint, Purpose};
use crate::error::{Error, Result};
use crate::plan::{NORM_PART_BYTES, Plan};
use crate::types::{DType, Stream};

/// The 2-norm and the largest magnitude of the whole model's gradient (every trainable
/// parameter, over every rank; padding holds zeros). Either is NaN or infinite when a gradient
/// element is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradNorm {
    pub l2: f32,
    pub max: f32,
}

impl GradNorm {
    pub fn is_finite(&self) -> bool {
        self.l2.is_finite() && self.max.is_finite()
    }

    /// The factor `torch.nn.utils.clip_grad_norm_` multiplies gradients by for `max_norm`:
    /// `max_norm / (l2 + 1e-6)`, at most 1 (NaN stays NaN, as `torch.clamp` keeps it).
    pub fn clip_coefficient(&self, max_norm: f32) -> f32 {
        let coefficient = max_norm / (self.l2 + 1e-6);
        if coefficient.is_nan() {
            coefficient
        } else {
            coefficient.min(1.0)
        }
    }
}

/// The norms from every rank's part, summed in rank order (the same result on every rank).
fn combine(parts: &[Vec<u8>]) -> GradNorm {
    GradNorm::of_parts(parts.iter().map(Vec::as_slice))
}

impl GradNorm {
    /// The norms from `parts`, each a rank's ([`NORM_PART_BYTES`]), summed in their order: where
    /// the host and the CPU backend's clipping on the device add them up.
    pub(crate) fn of_parts<'a>(parts: impl Iterator<Item = &'a [u8]>) -> GradNorm {
        let (mut sum, mut top) = (0f64, 0u32);
        for part in parts {
            let field = |range: std::ops::Range<usize>| part.get(range).unwrap_or(&[]).to_vec();
            sum += f64::from_le_bytes(field(0..8).try_into().unwrap_or([0; 8]));
            top = top.max(u32::from_le_bytes(
                field(8..12).try_into().unwrap_or([0; 4]),
            ));
        }
        GradNorm {
            l2: sum.sqrt() as f32,
            max: f32::from_bits(top),
        }
    }
}

/// How this step's optimizer clips its gradients.
#[derive(Clone, Copy, Debug)]
pub(super) enum Clip {
    /// By a coefficient the host computed ([`Engine::clip_grad_norm`]).
    OnHost { coefficient: f32 },
    /// By the coefficient of `max_norm` the device computes from the gathered norm parts
    /// ([`Engine::clip_grad_norm_on_device`]).
    OnDevice { max_norm: f32 },
}

fn check_max_norm(max_norm: f32) -> Result<()> {
    match max_norm.is_finite() && max_norm > 0.0 {
        true => Ok(()),
        false => Err(Error::InvalidConfig {
            field: "max_norm",
            reason: format!("is {max_norm}, expected finite, > 0"),
        }),
    }
}

/// What a step's check of its gradients sums over the gradient shards.
#[derive(Clone, Copy)]
pub(super) enum ShardSum {
    /// The squares and the largest magnitude ([`Backend::norm_partials`]).
    Norms,
    /// The non-finite elements ([`Backend::count_nonfinite`]).
    NonFinite,
}

/// Zeroes the first `bytes.len()` bytes of `out`, adds `sum` of every gradient shard into them
/// on the compute stream, and downloads them into `bytes`.
pub(super) fn sum_over_grad_shards<B: Backend>(
    backend: &B,
    plan: &Plan,
    groups: &[GroupGrads<B::Buffer>],
    out: &mut B::Buffer,
    sum: ShardSum,
    bytes: &mut [u8],
) -> Result<()> {
    let record = Region::new(0, bytes.len() / 4, DType::F32);
    queue_sum_over_grad_shards(backend, plan, groups, (out, record), sum)?;
    backend.download(out, record, bytes)
}

/// Zeroes `record` of `out` and adds `sum` of every gradient shard into it on the compute
/// stream.
fn queue_sum_over_grad_shards<B: Backend>(
    backend: &B,
    plan: &Plan,
    groups: &[GroupGrads<B::Buffer>],
    (out, record): (&mut B::Buffer, Region),
    sum: ShardSum,
) -> Result<()> {
    // SAFETY: `out` is the engine's own, used on the compute stream only; the gradient shards are
    // read there after `finish_grad_sync` made it wait for the reductions, and before the next
    // step's first ones, queued after compute's event.
    unsafe { backend.zero(Stream::Compute, out, record) }?;
    for g in plan.groups() {
        let Some(shard) = groups.get(g.index).and_then(|grads| grads.shard.as_ref()) else {
            continue;
        };
        let region = Region::new(0, g.shard_numel, DType::F32);
        // SAFETY: as above.
        unsafe {
            match sum {
                ShardSum::Norms => backend.norm_partials(Stream::Compute, shard, region, out),
                ShardSum::NonFinite => backend.count_nonfinite(Stream::Compute, shard, region, out),
            }
        }?;
    }
    Ok(())
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// The whole model's gradient norms, after [`Engine::finish_grad_sync`] and before the
    /// optimizer step. A collective (every rank calls it) that blocks the host.
    pub fn grad_norm(&mut self) -> Result<GradNorm> {
        self.healthy()?;
        self.check_not_capturing("the gradient norm, a host read of the device")?;
        self.refuse_in_backward_updates("the gradient norm")?;
        self.check_synced("the gradient norm")?;
        self.effects(|e| {
            // Nothing trains: the part is zero (and the ranks still meet below).
            let mut bytes = [0u8; NORM_PART_BYTES];
            if let Some(checks) = e.optimizer.checks.as_mut() {
                let groups = &e.reducing.groups;
                let part = &mut checks.norm_part;
                sum_over_grad_shards(
                    &e.backend,
                    &e.plan,
                    groups,
                    part,
                    ShardSum::Norms,
                    &mut bytes,
                )?;
            }
            let parts = if e.plan.world_size() == 1 {
                vec![bytes.to_vec()]
            } else {
                // Every replica holds the same shards: the replica's ranks hold the gradient once.
                e.exchange(Purpose::GradNorm, &bytes, false)?
            };
            Ok(combine(&parts))
        })
    }

    /// [`Engine::grad_norm`], and this step's optimizer multiplies every gradient by
    /// [`GradNorm::clip_coefficient`] of `max_norm` inside its update (no pass over memory of its
    /// own), as `torch.nn.utils.clip_grad_norm_` would before the step. Returns the norms before
    /// clipping. `max_norm` must be finite and > 0. The step takes no gradient and no backward
    /// hook after it (`Error::GradientsDecided`): the coefficient would not see them; so for
    /// [`Engine::clip_grad_norm_on_device`] and [`Engine::skip_nonfinite_on_device`].
    pub fn clip_grad_norm(&mut self, max_norm: f32) -> Result<GradNorm> {
        self.refuse_in_backward_updates("clipping by the global norm")?;
        check_max_norm(max_norm)?;
        let norm = self.grad_norm()?;
        self.optimizer.clip = Some(Clip::OnHost {
            coefficient: norm.clip_coefficient(max_norm),
        });
        Ok(norm)
    }

    /// Clips this step's gradients by the global norm as [`Engine::clip_grad_norm`] does (its
    /// coefficient from the same norms bit for bit; on a GPU a rank's sum of squares adds its
    /// threads' parts in the order they finish, so two computations of it can differ in the
    /// last bits), with no host wait: each rank's part of the norms is summed, gathered across the
    /// ranks (on the gather stream) and turned into the clipping coefficient on the device,
    /// where the optimizer step reads it. The host never sees the norms
    /// ([`Engine::clip_grad_norm`] returns them, at a host wait). A collective (every rank calls
    /// it); allowed during a capture, whose replays clip by each replay's own gradients.
    /// `max_norm` must be finite and > 0.
    pub fn clip_grad_norm_on_device(&mut self, max_norm: f32) -> Result<()> {
        self.healthy()?;
        self.refuse_in_backward_updates("clipping by the global norm")?;
        check_max_norm(max_norm)?;
        self.check_synced("clipping by the global norm")?;
        self.effects(|e| {
            e.optimizer.clip = Some(Clip::OnDevice { max_norm });
            e.gather_norm_parts_on_device()
        })
    }

    /// Skips this step's update on the device where the whole gradient's norm is not finite
    /// ([`GradNorm::is_finite`]: the f32 2-norm or the largest magnitude infinite or NaN, as
    /// any infinite or NaN element makes it), with no host wait: the shards, masters and moments
    /// stay as they are, and the step counts neither for AdamW's bias correction nor for the
    /// optimizer's steps (as where the host saw that norm, [`Engine::grad_norm`], and called no
    /// [`Engine::optimizer_step`]: later updates equal that run's bit for bit). Each rank's part
    /// of the norms is summed and gathered across the ranks as for
    /// [`Engine::clip_grad_norm_on_device`] (once for both), so every rank decides alike;
    /// [`Engine::optimizer_step`] follows as usual. The host learns of the skipped steps when it
    /// reads them ([`Engine::read_device_skips`], which a save does first): until then
    /// [`Counters::skipped_steps`](crate::Counters) leaves them out. A collective (every rank
    /// calls it); allowed during a capture, whose replays decide each on their own gradients.
    /// Refused where the optimizer steps in the backward.
    pub fn skip_nonfinite_on_device(&mut self) -> Result<()> {
        self.healthy()?;
        self.refuse_in_backward_updates("skipping a non-finite step")?;
        self.check_synced("skipping a non-finite step")?;
        self.effects(|e| {
            e.optimizer.skip_nonfinite = true;
            e.gather_norm_parts_on_device()
        })
    }

    /// Sums this rank's part of the norms and gathers every rank's (above world size 1) on the
    /// device, once a step, for the step's clipping and skip decision there.
    fn gather_norm_parts_on_device(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.optimizer.parts_on_device, true) {
            return Ok(());
        }
        if self.optimizer.checks.is_none() {
            // Nothing trains: no update reads a coefficient or a decision.
            return Ok(());
        }
        let world = self.plan.world_size();
        let record = Region::new(0, NORM_PART_BYTES / 4, DType::F32);
        let fingerprint = |tag| Fingerprint::all_gather(tag, record);
        let tag = (world > 1).then(|| self.next_tag(Purpose::GradNorm, fingerprint));
        let Some(checks) = self.optimizer.checks.as_mut() else {
            return Ok(());
        };
        let groups = &self.reducing.groups;
        let part = &mut checks.norm_part;
        queue_sum_over_grad_shards(
            &self.backend,
            &self.plan,
            groups,
            (part, record),
            ShardSum::Norms,
        )?;
        let Some(tag) = tag else {
            // At world size 1 the rank's part is the whole.
            return Ok(());
        };
        let summed = self.backend.record(Stream::Compute)?;
        self.backend.wait(Stream::Gather, &summed)?;
        let gathered = Region::new(0, record.len * world, DType::F32);
        // SAFETY: both buffers are the engine's, used on the compute stream otherwise: the part
        // was summed there before the event the gather stream waits for, and the compute stream
        // waits for the gather below before the update reads the parts. An all-gather goes on
        // the gather stream, as the gathers' communicator's collectives all do.
        unsafe {
            self.comm.all_gather(
                &self.backend,
                Stream::Gather,
                tag,
                &checks.norm_part,
                record,
                &mut checks.norm_parts,
                gathered,
            )
        }?;
        let collective = (fingerprint(tag), (self.rank, world));
        let done = self.record_collective(Stream::Gather, Some(collective))?;
        self.backend.wait(Stream::Compute, &done)
    }

    /// Refuses what needs the step's gradients synced and not yet stepped on.
    fn check_synced(&self, action: &'static str) -> Result<()> {
        self.check_not_stepped(action)?;
        if !self.reducing.pipeline.synced() {
            return Err(Error::GradsNotSynced { action });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_combine_in_rank_order_and_keep_non_finite_values() {
        let part = |sum: f64, max: f32| {
            let mut p = sum.to_le_bytes().to_vec();
            p.extend(max.to_bits().to_le_bytes());
            p.extend([0u8; 4]);
            p
        };
        let norm = combine(&[part(9.0, 2.0), part(16.0, 3.5)]);
        assert_eq!(norm, GradNorm { l2: 5.0, max: 3.5 });
        assert!(norm.is_finite());
        let nan = combine(&[part(1.0, f32::NAN), part(1.0, 1.0)]);
        assert!(nan.max.is_nan() && !nan.is_finite());
        let inf = combine(&[part(f64::INFINITY, f32::INFINITY)]);
        assert_eq!(inf.l2, f32::INFINITY);
    }

    #[test]
    fn the_clip_coefficient_is_torch_s() {
        let norm = GradNorm { l2: 4.0, max: 1.0 };
        assert_eq!(norm.clip_coefficient(2.0), 2.0 / (4.0 + 1e-6));
        assert_eq!(norm.clip_coefficient(10.0), 1.0);
        let nan = GradNorm {
            l2: f32::NAN,
            max: f32::NAN,
        };
        assert!(nan.clip_coefficient(1.0).is_nan());
        let inf = GradNorm {
            l2: f32::INFINITY,
            max: f32::INFINITY,
        };
        assert_eq!(inf.clip_coefficient(1.0), 0.0);
    }
}
