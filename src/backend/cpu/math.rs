//! The CPU backend's arithmetic over byte slices, element by element as `crate::optim` defines it.

use crate::backend::OptimizerShard;
use crate::dtype::{load_f32, store_f32};
use crate::optim::{
    MomentStorage, OptimizerKind, Update, accumulate_element, adamw_element, bf16_stochastic,
    rounding_bits, sgd_element,
};
use crate::types::DType;

/// f32 values over bytes that hold them (every region of an f32 buffer is 4-byte aligned).
pub(crate) fn f32s(bytes: &[u8]) -> &[f32] {
    bytemuck::cast_slice(bytes)
}

pub(crate) fn f32s_mut(bytes: &mut [u8]) -> &mut [f32] {
    bytemuck::cast_slice_mut(bytes)
}

/// `dst = scale * src` (or `+=` when `add`) in f32, rounded to `dst`'s dtype; `src` holds as many
/// elements of its dtype as `dst` of its own.
pub(crate) fn accumulate(
    (dst, dst_dtype): (&mut [u8], DType),
    (src, src_dtype): (&[u8], DType),
    scale: f32,
    add: bool,
) {
    if dst_dtype == DType::F32 {
        // The source may be a caller's bytes, with no alignment to read them as f32 slices.
        for (i, d) in f32s_mut(dst).iter_mut().enumerate() {
            *d = accumulate_element(*d, load_f32(src, src_dtype, i), scale, add);
        }
        return;
    }
    for i in 0..dst.len() / dst_dtype.size() {
        let d = load_f32(dst, dst_dtype, i);
        let value = accumulate_element(d, load_f32(src, src_dtype, i), scale, add);
        store_f32(dst, dst_dtype, i, value);
    }
}

/// The slices of one optimizer step: the parameter shard in its dtype, its fp32 gradient, and
/// the fp32 master and moments where the group has them.
pub(crate) struct OptimizerSlices<'a> {
    pub(crate) param: &'a mut [u8],
    pub(crate) dtype: DType,
    pub(crate) grad: &'a [f32],
    pub(crate) master: Option<&'a mut [f32]>,
    pub(crate) moments: Option<MomentSlices<'a>>,
}

/// AdamW's moments of a shard, as bytes stored as `storage` says, rounded (where stochastically)
/// with the step's `seed`.
pub(crate) struct MomentSlices<'a> {
    pub(crate) first: &'a mut [u8],
    pub(crate) second: &'a mut [u8],
    pub(crate) storage: MomentStorage,
    pub(crate) seed: u32,
}

impl MomentSlices<'_> {
    fn load(&self, i: usize) -> (f32, f32) {
        let dtype = self.storage.dtype();
        (
            load_f32(self.first, dtype, i),
            load_f32(self.second, dtype, i),
        )
    }

    fn store(&mut self, i: usize, (m, v): (f32, f32)) {
        match self.storage {
            MomentStorage::F32 => {
                store_f32(self.first, DType::F32, i, m);
                store_f32(self.second, DType::F32, i, v);
            }
            MomentStorage::Bf16Stochastic { first_index, .. } => {
                let (seed, index) = (self.seed, first_index + i as u64);
                let bits = |x, which| bf16_stochastic(x, rounding_bits(seed, index, which));
                self.first[2 * i..2 * i + 2].copy_from_slice(&bits(m, 0).to_le_bytes());
                self.second[2 * i..2 * i + 2].copy_from_slice(&bits(v, 1).to_le_bytes());
            }
        }
    }
}

/// Adds `src`'s sum of squares (f64) to the f64 at `out[0..8]` and raises the u32 at
/// `out[8..12]` to the largest magnitude's bits, as `Backend::norm_partials` says.
pub(crate) fn norm_partials(src: &[f32], out: &mut [u8]) {
    let mut sum = f64::from_le_bytes(out[..8].try_into().unwrap_or([0; 8]));
    let mut top = u32::from_le_bytes(out[8..12].try_into().unwrap_or([0; 4]));
    for &x in src {
        sum += f64::from(x) * f64::from(x);
        top = top.max(x.to_bits() & 0x7FFF_FFFF);
    }
    out[..8].copy_from_slice(&sum.to_le_bytes());
    out[8..12].copy_from_slice(&top.to_le_bytes());
}

/// The shapes an optimizer step needs, checked before anything is queued.
pub(crate) fn check_optimizer<B: crate::backend::Backend + ?Sized>(
    kind: OptimizerKind,
    shard: &OptimizerShard<'_, B>,
) -> crate::error::Result<()> {
    if kind == OptimizerKind::AdamW && shard.moments.is_none() {
        return Err(crate::error::Error::InvalidConfig {
            field: "optimizer",
            reason: "AdamW needs moment buffers".into(),
        });
    }
    Ok(())
}

/// One optimizer update of every element; moments are present for AdamW (checked by
/// [`check_optimizer`]).
pub(crate) fn optimizer_step(update: &Update, s: OptimizerSlices<'_>) {
    let OptimizerSlices {
        param,
        dtype,
        grad,
        mut master,
        mut moments,
    } = s;
    for (i, &g) in grad.iter().enumerate() {
        let p = match &master {
            Some(master) => master[i],
            None => load_f32(param, dtype, i),
        };
        let p = match (update, &mut moments) {
            (
                Update::Sgd {
                    lr,
                    weight_decay,
                    grad_scale,
                },
                _,
            ) => sgd_element(p, g, *lr, *weight_decay, *grad_scale),
            (Update::AdamW(c), Some(moments)) => {
                let (m, v) = moments.load(i);
                let (p, m, v) = adamw_element(p, m, v, g, c);
                moments.store(i, (m, v));
                p
            }
            // Refused by `check_optimizer` before anything was queued.
            (Update::AdamW(_), None) => p,
        };
        if let Some(master) = &mut master {
            master[i] = p;
        }
        store_f32(param, dtype, i, p);
    }
}
