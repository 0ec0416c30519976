//! Invariants of every plan, on random models and world sizes.

use std::sync::Arc;

use fsdp_fusion::plan::ALIGNMENT_BYTES;
use fsdp_fusion::{
    CpuBackend, DType, Engine, EngineConfig, Input, LocalComm, ModelSpec, ParamId, ParamSpec, Plan,
    Unit,
};
use fsdp_fusion_support::ranks::on_threads;
use fsdp_fusion_support::values::narrow;
use proptest::prelude::*;

fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::Bf16), Just(DType::F16), Just(DType::F32)]
}

fn param(i: usize) -> impl Strategy<Value = ParamSpec> {
    (
        prop::collection::vec(0u64..40, 0..3),
        dtype(),
        prop::option::of(0u32..4),
        any::<bool>(),
        prop::bool::weighted(0.15),
        (
            any::<bool>(),
            prop_oneof![Just(1.0f32), Just(0.5), Just(0.0)],
        ),
    )
        .prop_map(
            move |(shape, dtype, unit, trainable, tied, (weight_decay, lr_scale))| ParamSpec {
                name: format!("p{i}"),
                shape,
                dtype,
                unit,
                trainable,
                tied,
                weight_decay,
                lr_scale,
                process_group: None,
            },
        )
}

fn model() -> impl Strategy<Value = ModelSpec> {
    (1usize..16)
        .prop_flat_map(|n| (0..n).map(param).collect::<Vec<_>>())
        .prop_map(|params| ModelSpec::new(params).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn layout_invariants(model in model(), world in 1usize..10) {
        let plan = Plan::new(&model, world).unwrap();
        let mut seen = vec![false; model.params.len()];
        for g in plan.groups() {
            prop_assert_eq!(g.padded_numel() % world, 0);
            prop_assert_eq!(g.shard_numel() * world, g.padded_numel());
            // Shards tile the buffer exactly.
            let mut next = 0;
            for rank in 0..world {
                let r = plan.shard_range(g, rank).unwrap();
                prop_assert_eq!(r.start, next);
                next = r.end;
            }
            prop_assert_eq!(next, g.padded_numel());
            // Params are aligned, in model order, back to back, none overlapping.
            let mut end = 0;
            let mut last_id = None;
            for &id in g.params() {
                let p = plan.param(id).unwrap();
                prop_assert_eq!(p.group(), g.index());
                // A group's members share its optimizer settings.
                let spec = &model.params[id.0];
                prop_assert_eq!(spec.weight_decay, g.weight_decay());
                prop_assert_eq!(spec.lr_scale.to_bits(), g.lr_scale().to_bits());
                prop_assert_eq!((p.offset() * p.dtype().size()) % ALIGNMENT_BYTES, 0);
                prop_assert_eq!(p.offset(), end);
                prop_assert!(p.padded_numel() >= p.numel());
                prop_assert!(p.padded_numel() - p.numel() < (ALIGNMENT_BYTES / p.dtype().size()) * world);
                prop_assert!(last_id.is_none_or(|l: ParamId| l < id));
                last_id = Some(id);
                end = p.offset() + p.padded_numel();
                prop_assert!(!seen[id.0]);
                seen[id.0] = true;
            }
            prop_assert_eq!(end, g.padded_numel());
        }
        prop_assert!(seen.iter().all(|&s| s));
        // Tied first, then frozen, then trainable; by unit inside each, the root last.
        let keys: Vec<(u8, Unit)> = plan
            .groups()
            .iter()
            .map(|g| (if g.tied() { 0 } else if !g.trainable() { 1 } else { 2 }, g.unit()))
            .collect();
        prop_assert!(keys.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn loaded_shards_hold_the_params_and_zero_padding(model in model(), world in 1usize..6) {
        let plan = Arc::new(Plan::new(&model, world).unwrap());
        let values: Vec<Vec<f32>> = plan
            .params()
            .iter()
            .enumerate()
            .map(|(i, p)| (0..p.numel()).map(|j| 1.0 + (i * 1000 + j) as f32).collect())
            .collect();
        // The ranks make their engines together: making one compares the ranks' plans.
        let shards: Vec<Vec<Vec<u8>>> = on_threads(LocalComm::group(world).unwrap(), |_, comm| {
            let mut e = Engine::new(Arc::clone(&plan), EngineConfig::default(), CpuBackend::new(), comm).unwrap();
            for (i, v) in values.iter().enumerate() {
                let dtype = plan.params()[i].dtype();
                let bytes = narrow(dtype, v);
                e.load_param(ParamId(i), Input::host_bytes(&bytes, dtype)).unwrap();
            }
            (0..plan.groups().len()).map(|g| e.param_shard(g).unwrap()).collect()
        });
        for g in plan.groups() {
            let flat: Vec<u8> = shards.iter().flat_map(|rank| rank[g.index()].clone()).collect();
            let values_of = |i: usize| narrow(g.dtype(), &values[i]);
            let size = g.dtype().size();
            for &id in g.params() {
                let p = plan.param(id).unwrap();
                let at = p.offset() * size;
                prop_assert_eq!(&flat[at..at + p.numel() * size], &values_of(id.0)[..]);
                prop_assert!(flat[at + p.numel() * size..at + p.padded_numel() * size].iter().all(|&b| b == 0));
            }
        }
    }
}
