//! Plans from C: made from a model file, its text or declarations; queried by parameter.

use std::ffi::c_char;
use std::sync::Arc;

use super::handles::{destroy, handles, plan_of};
use super::registry::Object;
use super::status::{
    Outcome, boundary, caller_slice, file_path, fsdp_status, invalid, null, put, text,
};
use super::types::{
    FSDP_ROOT, config_of, dtype_code, dtype_of, flag, fsdp_config, fsdp_memory, fsdp_param_info,
    fsdp_param_spec, fsdp_plan, unit_of,
};
use crate::plan::{Plan, Policy};
use crate::spec::{ModelSpec, ParamSpec};
use crate::types::{ParamId, Unit};

/// Stores a plan and writes its handle to `out`, which the caller checked for NULL first.
fn new_plan(model: &ModelSpec, world_size: usize, out: *mut *mut fsdp_plan) -> Outcome {
    let plan = Plan::new(model, world_size)?;
    let handle = handles()?.insert(Object::Plan(Arc::new(plan)))?;
    // SAFETY: the caller guarantees it is valid for a write.
    unsafe { put(out, "out", handle as *mut fsdp_plan) }
}

/// Creates a plan from a model file's JSON text (NUL-terminated). A malformed text fails with
/// `FSDP_INVALID_ARGUMENT` and a message giving its line and column. The plan is the caller's:
/// release it with `fsdp_plan_destroy` (engines keep what they need).
///
/// The file may declare process groups (`"process_groups": [{"name": "experts", "size": 2}]`)
/// that parameters name (`"group": "experts"`), for mixture-of-experts parameters: the world's
/// ranks split into groups of `size` consecutive ranks (rank `r` in group `r / size` at place
/// `r % size`), each holding its own copy of such a parameter, sharded over the group's ranks,
/// its gradients summed over them only (a mean still divides by the world size). A size that
/// does not divide `world_size` is `FSDP_INVALID_ARGUMENT`. The engine functions make each
/// rank's communicators of its groups themselves.
///
/// # Safety
/// `json` is NULL or NUL-terminated; `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_plan_from_json(
    json: *const c_char,
    world_size: usize,
    out: *mut *mut fsdp_plan,
) -> fsdp_status {
    boundary(|| {
        // SAFETY: the caller's contract.
        let json = unsafe { text(json, "json") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        new_plan(&ModelSpec::from_json(json)?, world_size, out)
    })
}

/// Creates a plan from a model file at `path`; as `fsdp_plan_from_json`. Reads the file: a
/// regular file of at most 1 GiB (`FSDP_IO_ERROR` otherwise, as for a file that cannot be read).
///
/// # Safety
/// `path` is NULL or NUL-terminated; `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_plan_from_file(
    path: *const c_char,
    world_size: usize,
    out: *mut *mut fsdp_plan,
) -> fsdp_status {
    boundary(|| {
        // SAFETY: the caller's contract.
        let path = unsafe { file_path(path, "path") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        new_plan(&ModelSpec::from_path(path)?, world_size, out)
    })
}

/// Creates a plan from `count` declarations in model order; as `fsdp_plan_from_json`, with no
/// process groups (a model file declares those).
///
/// # Safety
/// `specs` is NULL or valid for `count` entries, each with a NUL-terminated name and `ndim`
/// dimensions; `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_plan_from_specs(
    specs: *const fsdp_param_spec,
    count: usize,
    world_size: usize,
    out: *mut *mut fsdp_plan,
) -> fsdp_status {
    boundary(|| {
        if specs.is_null() {
            return Err(null("specs"));
        }
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: valid for `count` entries by the caller's contract.
        let specs = unsafe { caller_slice(specs, count, "specs") }?;
        let params = specs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                // SAFETY: the caller's contract for each entry.
                let name = unsafe { text(s.name, &format!("specs[{i}].name")) }?;
                let shape = if s.ndim != 0 && s.shape.is_null() {
                    return Err(invalid(format!(
                        "specs[{i}].shape is NULL with ndim {}",
                        s.ndim
                    )));
                } else {
                    // SAFETY: valid for `ndim` entries by the caller's contract.
                    unsafe { caller_slice(s.shape, s.ndim, &format!("specs[{i}].shape")) }?.to_vec()
                };
                let unit = match unit_of(s.unit)
                    .map_err(|f| invalid(format!("specs[{i}]: {}", f.message)))?
                {
                    Unit::Root => None,
                    Unit::Layer(u) => Some(u),
                };
                let dtype =
                    dtype_of(s.dtype).map_err(|f| invalid(format!("specs[{i}]: {}", f.message)))?;
                Ok(ParamSpec {
                    name: name.to_string(),
                    shape,
                    dtype,
                    unit,
                    trainable: flag(s.trainable, &format!("specs[{i}].trainable"))?,
                    tied: flag(s.tied, &format!("specs[{i}].tied"))?,
                    weight_decay: !flag(s.no_weight_decay, &format!("specs[{i}].no_weight_decay"))?,
                    lr_scale: if s.lr_scale == 0.0 { 1.0 } else { s.lr_scale },
                    process_group: None,
                })
            })
            .collect::<Outcome<Vec<_>>>()?;
        new_plan(&ModelSpec::new(params)?, world_size, out)
    })
}

/// Releases a plan; NULL is accepted.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_plan_destroy(plan: *mut fsdp_plan) -> fsdp_status {
    boundary(|| destroy(plan as u64, |o| matches!(o, Object::Plan(_)), "plan"))
}

/// The number of parameters, in model order (ids `0..count`).
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_plan_param_count(
    plan: *const fsdp_plan,
    out: *mut usize,
) -> fsdp_status {
    boundary(|| {
        let plan = plan_of(plan)?;
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", plan.params().len()) }
    })
}

/// The id of the parameter named `name`.
///
/// # Safety
/// `name` is NULL or NUL-terminated; `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_plan_param_id(
    plan: *const fsdp_plan,
    name: *const c_char,
    out: *mut usize,
) -> fsdp_status {
    boundary(|| {
        let plan = plan_of(plan)?;
        // SAFETY: the caller's contract.
        let name = unsafe { text(name, "name") }?;
        let id = plan.param_id(name)?;
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", id.0) }
    })
}

/// Where parameter `param` lives in the plan.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_plan_param_info(
    plan: *const fsdp_plan,
    param: usize,
    out: *mut fsdp_param_info,
) -> fsdp_status {
    boundary(|| {
        let plan = plan_of(plan)?;
        let p = plan.param(ParamId(param))?;
        let info = fsdp_param_info {
            numel: p.numel,
            dtype: dtype_code(p.dtype),
            unit: p.unit.layer().map_or(FSDP_ROOT, i64::from),
            trainable: p.trainable,
            group: p.group,
            offset: p.offset,
            padded_numel: p.padded_numel,
        };
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", info) }
    })
}

/// The bytes one rank allocates for `plan` under `config`; `FSDP_INVALID_ARGUMENT` when a total
/// does not fit in a `size_t`.
///
/// # Safety
/// `config` is NULL or valid for a read; `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_plan_memory(
    plan: *const fsdp_plan,
    config: *const fsdp_config,
    out: *mut fsdp_memory,
) -> fsdp_status {
    boundary(|| {
        let plan = plan_of(plan)?;
        // SAFETY: the caller's contract.
        let config = config_of(unsafe { config.as_ref() }.ok_or_else(|| null("config"))?)?;
        let memory = fsdp_memory::from(Policy::new(&plan, &config)?.memory);
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", memory) }
    })
}
