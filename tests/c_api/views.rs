//! Views and gradients: single and batched calls, and the plan's queries.

use super::*;

#[test]
fn views_and_plan_queries_return_the_values() {
    for_each_mode(|mode| {
        let (plan, group, engine) = engine(mode);
        let w: Vec<f32> = (0..9).map(|i| i as f32 - 4.0).collect();
        let name = CString::new("w").unwrap();
        let mut id = 0usize;
        let mut count = 0usize;
        let mut info = fsdp_param_info::default();
        let mut data: *const c_void = null();
        let mut numel = 0usize;
        let mut dtype = 9u32;
        // SAFETY: valid pointers; the view is read while unit 0's forward is open.
        unsafe {
            ok(fsdp_plan_param_count(plan, &mut count));
            ok(fsdp_plan_param_id(plan, name.as_ptr(), &mut id));
            ok(fsdp_plan_param_info(plan, id, &mut info));
            assert_eq!(
                (count, id, info.numel, info.unit, info.trainable),
                (3, 1, 9, 0, true)
            );
            ok(fsdp_engine_load_param(
                engine,
                id,
                w.as_ptr().cast(),
                9,
                FSDP_F32,
            ));
            ok(fsdp_engine_pre_forward(engine, 0));
            ok(fsdp_engine_param(
                engine, id, &mut data, &mut numel, &mut dtype,
            ));
            assert_eq!((numel, dtype), (9, FSDP_F32));
            assert_eq!(
                std::slice::from_raw_parts(data.cast::<f32>(), numel),
                &w[..]
            );
            ok(fsdp_engine_post_forward(engine, 0));
            ok(fsdp_engine_end_step(engine));
            ok(fsdp_engine_destroy(engine));
            ok(fsdp_local_group_destroy(group));
            ok(fsdp_plan_destroy(plan));
        }
    });
}

/// Unit 0 holds two trainable parameters and a frozen one; the root holds `r`.
const BATCH_MODEL: &str = r#"{"params": [
    {"name": "a", "shape": [2, 3], "dtype": "f32", "unit": 0},
    {"name": "b", "shape": [3], "dtype": "f32", "unit": 0},
    {"name": "f", "shape": [2], "dtype": "f32", "unit": 0, "trainable": false},
    {"name": "r", "shape": [4], "dtype": "f32"}
]}"#;

fn grad_entry(param: usize, values: &[f32], numel: usize, dtype: u32) -> fsdp_grad {
    fsdp_grad {
        param,
        data: values.as_ptr().cast(),
        numel,
        dtype,
    }
}

#[test]
fn batched_views_and_gradients_act_as_the_single_calls_and_a_refused_batch_takes_nothing() {
    for_each_mode(|mode| {
        let json = CString::new(BATCH_MODEL).unwrap();
        let mut plan = null_mut();
        let group = local_group(mode, 1);
        let mut engine = null_mut();
        let values: [Vec<f32>; 4] = [
            (0..6).map(|i| i as f32).collect(),
            vec![-1.0, -2.0, -3.0],
            vec![7.0, 8.0],
            vec![0.5; 4],
        ];
        let ga: Vec<f32> = (0..6).map(|i| 0.1 * i as f32).collect();
        let gb = vec![1.0f32, 2.0, 3.0];
        let stale = 0xdead as *const c_void;
        // SAFETY: valid pointers throughout; views are read while unit 0's forward is open.
        unsafe {
            ok(fsdp_plan_from_json(json.as_ptr(), 1, &mut plan));
            ok(fsdp_engine_create_cpu(
                plan,
                &sgd_config(),
                group,
                0,
                &mut engine,
            ));
            load_values(engine, &values);
            ok(fsdp_engine_pre_forward(engine, 0));
            let ids = [2usize, 0, 1];
            let mut addresses = [stale; 3];
            ok(fsdp_engine_params(
                engine,
                ids.as_ptr(),
                3,
                addresses.as_mut_ptr(),
            ));
            for (&id, &address) in ids.iter().zip(&addresses) {
                let (mut data, mut numel, mut dtype) = (null(), 0usize, 0u32);
                ok(fsdp_engine_param(
                    engine, id, &mut data, &mut numel, &mut dtype,
                ));
                assert_eq!(address, data, "param {id}");
                let seen = std::slice::from_raw_parts(address.cast::<f32>(), numel);
                assert_eq!(seen, &values[id][..]);
            }
            // The root is not open: nothing is written, not even the entries before it.
            let mut untouched = [stale; 2];
            let with_root = [0usize, 3];
            expect(
                fsdp_engine_params(engine, with_root.as_ptr(), 2, untouched.as_mut_ptr()),
                fsdp_status::FSDP_MISUSE,
                "r",
            );
            assert_eq!(untouched, [stale; 2]);
            expect(
                fsdp_engine_params(engine, null(), 2, untouched.as_mut_ptr()),
                NULL,
                "params",
            );
            expect(
                fsdp_engine_params(engine, ids.as_ptr(), 2, null_mut()),
                NULL,
                "data",
            );
            ok(fsdp_engine_params(engine, null(), 0, null_mut()));
            ok(fsdp_engine_post_forward(engine, 0));

            ok(fsdp_engine_pre_backward(engine, 0));
            let refused: [(Vec<fsdp_grad>, fsdp_status, &str); 5] = [
                (
                    vec![
                        grad_entry(0, &ga, 6, FSDP_F32),
                        grad_entry(1, &gb, 2, FSDP_F32),
                    ],
                    BAD,
                    "b",
                ),
                (
                    vec![
                        grad_entry(0, &ga, 6, FSDP_F32),
                        grad_entry(0, &ga, 6, FSDP_F32),
                    ],
                    fsdp_status::FSDP_MISUSE,
                    "a",
                ),
                (
                    vec![
                        grad_entry(0, &ga, 6, FSDP_F32),
                        grad_entry(2, &gb, 2, FSDP_F32),
                    ],
                    fsdp_status::FSDP_MISUSE,
                    "frozen",
                ),
                (
                    vec![grad_entry(0, &ga, 6, FSDP_F32), grad_entry(1, &gb, 3, 7)],
                    BAD,
                    "grads[1]",
                ),
                (
                    vec![
                        grad_entry(0, &ga, 6, FSDP_F32),
                        grad_entry(9, &gb, 3, FSDP_F32),
                    ],
                    BAD,
                    "9",
                ),
            ];
            for (batch, status, words) in &refused {
                expect(
                    fsdp_engine_grads(engine, batch.as_ptr(), batch.len()),
                    *status,
                    words,
                );
            }
            expect(fsdp_engine_grads(engine, null(), 1), NULL, "grads");
            ok(fsdp_engine_grads(engine, null(), 0));
            // Nothing of the refused batches was taken: both gradients are still welcome.
            let batch = [
                grad_entry(1, &gb, 3, FSDP_F32),
                grad_entry(0, &ga, 6, FSDP_F32),
            ];
            ok(fsdp_engine_grads(engine, batch.as_ptr(), 2));
            expect(
                fsdp_engine_grads(engine, batch.as_ptr(), 1),
                fsdp_status::FSDP_MISUSE,
                "already received",
            );
            ok(fsdp_engine_post_backward(engine, 0));
            end_the_step(engine);
            let sgd = |v: &[f32], g: &[f32]| -> Vec<f32> {
                v.iter().zip(g).map(|(v, g)| v - 0.5 * g).collect()
            };
            assert_close(&shard_values(engine, plan, 0), &sgd(&values[0], &ga));
            assert_close(&shard_values(engine, plan, 1), &sgd(&values[1], &gb));
            assert_eq!(shard_values(engine, plan, 2), values[2]);
            ok(fsdp_engine_destroy(engine));
            ok(fsdp_local_group_destroy(group));
            ok(fsdp_plan_destroy(plan));
        }
    });
}
