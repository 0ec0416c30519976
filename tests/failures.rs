//! Ranks that diverge, leave, stop, panic or ask too much get an error, never a hang, an abort or
//! a wrong answer; a rank that survives can go on, or is cleanly poisoned. Each multi-rank case
//! runs eagerly and on asynchronous CPU backends, under the harness deadline.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fsdp_fusion::{
    Communicator, CpuBackend, DType, Engine, EngineConfig, Error, Input, ModelSpec,
    OptimizerConfig, ParamSpec, Plan, Policy, ProcessGroupSpec, Result, Unit,
};
use fsdp_fusion_support::faults::{Faulty, is_injected};
use fsdp_fusion_support::ranks::{Mode, for_each_mode, on_engines, on_ranks};

/// The failure under the wrappers an asynchronous stream or a poisoned engine puts around it.
fn root(e: &Error) -> &Error {
    match e {
        Error::StreamFailed { cause, .. } => root(cause),
        Error::Poisoned { cause } => root(cause),
        other => other,
    }
}

/// Two units of one f32 weight each, of equal size.
fn two_units() -> ModelSpec {
    ModelSpec::new(vec![
        ParamSpec::new("a", &[64], DType::F32).in_unit(0),
        ParamSpec::new("b", &[64], DType::F32).in_unit(1),
    ])
    .unwrap()
}

fn plan(model: &ModelSpec, world: usize) -> Arc<Plan> {
    Arc::new(Plan::new(model, world).unwrap())
}

fn sgd() -> EngineConfig {
    EngineConfig {
        optimizer: OptimizerConfig::sgd(0.5),
        ..EngineConfig::default()
    }
}

/// The forward of both units.
fn forward<C: Communicator<CpuBackend>>(e: &mut Engine<CpuBackend, C>) -> Result<()> {
    for u in [Unit::Layer(0), Unit::Layer(1)] {
        e.pre_forward(u)?;
        e.post_forward(u)?;
    }
    Ok(())
}

/// Hands over gradients of 1 for `names` in that order, then syncs, steps and ends the step, and
/// reads a shard: an asynchronous stream's failure shows where the host waits for it.
fn backward_in_order<C: Communicator<CpuBackend>>(
    e: &mut Engine<CpuBackend, C>,
    names: [&str; 2],
) -> Result<()> {
    for name in names {
        let id = e.plan().param_id(name)?;
        e.grad(id, Input::host(&[1f32; 64]))?;
    }
    e.finish_grad_sync()?;
    e.optimizer_step()?;
    e.end_step()?;
    e.param_shard(0).map(drop)
}

/// Runs the backward of the units of `names` in that order, each unit's gradient of 1 between
/// its hooks (its end reduces it), then syncs and reads a shard.
fn units_backward_in_order<C: Communicator<CpuBackend>>(
    e: &mut Engine<CpuBackend, C>,
    names: [&str; 2],
) -> Result<()> {
    for name in names {
        let id = e.plan().param_id(name)?;
        let unit = e.plan().param(id)?.unit();
        e.pre_backward(unit)?;
        e.grad(id, Input::host(&[1f32; 64]))?;
        e.post_backward(unit)?;
    }
    e.finish_grad_sync()?;
    e.param_shard(0).map(drop)
}

/// Checks that a rank's engine is poisoned: every call says why, and no view is handed out.
fn assert_poisoned<C: Communicator<CpuBackend>>(e: &mut Engine<CpuBackend, C>) {
    let a = e.plan().param_id("a").unwrap();
    assert!(matches!(
        e.pre_forward(Unit::Layer(0)),
        Err(Error::Poisoned { .. })
    ));
    assert!(matches!(e.param::<f32>(a), Err(Error::Poisoned { .. })));
    assert!(matches!(e.param_shard(0), Err(Error::Poisoned { .. })));
    assert!(e.poisoned().is_some());
}

#[test]
fn ranks_that_end_units_backward_in_another_order_all_fail_naming_both() {
    for world in [2, 3, 8] {
        for_each_mode(|mode| {
            let outcomes = on_engines(&plan(&two_units(), world), &sgd(), mode, |mut e| {
                let order = if e.rank() % 2 == 0 {
                    ["a", "b"]
                } else {
                    ["b", "a"]
                };
                let result = forward(&mut e).and_then(|()| units_backward_in_order(&mut e, order));
                let error = result.err().map(|e| root(&e).clone());
                assert_poisoned(&mut e);
                error
            });
            for (rank, error) in outcomes.iter().enumerate() {
                match error {
                    Some(Error::CollectiveMismatch {
                        rank: 1,
                        expected,
                        got,
                    }) => {
                        assert!(expected.contains("reduce-scatter of group 0"), "{expected}");
                        assert!(got.contains("reduce-scatter of group 1"), "{got}");
                    }
                    other => panic!("world {world} rank {rank}: {other:?}"),
                }
            }
        });
    }
}

#[test]
fn ranks_that_run_units_in_another_order_all_fail() {
    for_each_mode(|mode| {
        let outcomes = on_engines(&plan(&two_units(), 2), &sgd(), mode, |mut e| {
            let unit = Unit::Layer(e.rank() as u32);
            let result = e.pre_forward(unit).and_then(|()| e.post_forward(unit));
            let drained = result.and_then(|()| e.param_shard(0).map(drop));
            drained.err().map(|e| root(&e).clone())
        });
        for error in outcomes {
            assert!(
                matches!(&error, Some(Error::CollectiveMismatch { rank: 1, got, .. }) if got.contains("all-gather of group 1")),
                "{error:?}"
            );
        }
    });
}

#[test]
fn ranks_with_different_models_of_equal_sizes_refuse_to_start() {
    let models = [
        two_units(),
        // Another name for the first parameter.
        ModelSpec::new(vec![
            ParamSpec::new("z", &[64], DType::F32).in_unit(0),
            ParamSpec::new("b", &[64], DType::F32).in_unit(1),
        ])
        .unwrap(),
        // bf16 of the same padded bytes.
        ModelSpec::new(vec![
            ParamSpec::new("a", &[128], DType::Bf16).in_unit(0),
            ParamSpec::new("b", &[64], DType::F32).in_unit(1),
        ])
        .unwrap(),
        // The same layout, trained at another rate, or without weight decay.
        ModelSpec::new(vec![
            ParamSpec::new("a", &[64], DType::F32)
                .in_unit(0)
                .with_lr_scale(0.5),
            ParamSpec::new("b", &[64], DType::F32).in_unit(1),
        ])
        .unwrap(),
        ModelSpec::new(vec![
            ParamSpec::new("a", &[64], DType::F32)
                .in_unit(0)
                .no_weight_decay(),
            ParamSpec::new("b", &[64], DType::F32).in_unit(1),
        ])
        .unwrap(),
    ];
    for other in 1..models.len() {
        let plans = [plan(&models[0], 2), plan(&models[other], 2)];
        assert_eq!(
            plans[0].groups()[0].padded_bytes(),
            plans[1].groups()[0].padded_bytes()
        );
        for_each_mode(|mode| {
            let plans = plans.clone();
            let outcomes = on_ranks(2, mode, move |rank, backend, comm| {
                Engine::try_new(Arc::clone(&plans[rank]), sgd(), backend, comm)
                    .err()
                    .map(|refused| refused.error)
            });
            for error in outcomes {
                match error {
                    Some(Error::PlanMismatch {
                        rank: 1,
                        index: 0,
                        expected,
                        got,
                    }) => {
                        assert!(expected.starts_with("\"a\" (f32, shape [64]"), "{expected}");
                        assert_ne!(expected, got);
                    }
                    other => panic!("{other:?}"),
                }
            }
        });
    }
}

#[test]
fn a_rank_whose_thread_ends_mid_step_fails_its_peers_at_once() {
    for_each_mode(|mode| {
        let start = Instant::now();
        let outcomes = on_engines(&plan(&two_units(), 2), &sgd(), mode, |mut e| {
            forward(&mut e).unwrap();
            if e.rank() == 1 {
                // The thread returns: its engine goes with it, mid-step.
                return None;
            }
            backward_in_order(&mut e, ["a", "b"])
                .err()
                .map(|e| root(&e).clone())
        });
        assert!(
            matches!(&outcomes[0], Some(Error::PeerGone { rank: 1, .. })),
            "{outcomes:?}"
        );
        assert!(start.elapsed() < Duration::from_secs(60), "the peer waited");
    });
}

#[test]
fn a_rank_that_leaves_mid_step_fails_its_expert_group_and_the_world_at_once() {
    // "a" sharded over the world of 4, "b" over groups of 2 ranks: rank 3 leaves both.
    let model = ModelSpec::with_process_groups(
        vec![
            ParamSpec::new("a", &[64], DType::F32).in_unit(0),
            ParamSpec::new("b", &[64], DType::F32)
                .in_unit(1)
                .in_process_group("experts"),
        ],
        vec![ProcessGroupSpec {
            name: "experts".into(),
            size: 2,
        }],
    )
    .unwrap();
    for_each_mode(|mode| {
        let start = Instant::now();
        let outcomes = on_engines(&plan(&model, 4), &sgd(), mode, |mut e| {
            forward(&mut e).unwrap();
            if e.rank() == 3 {
                return None;
            }
            let error = backward_in_order(&mut e, ["b", "a"]).unwrap_err();
            Some(root(&error).clone())
        });
        for (rank, outcome) in outcomes.iter().take(3).enumerate() {
            assert!(
                matches!(outcome, Some(Error::PeerGone { .. })),
                "rank {rank}: {outcome:?}"
            );
        }
        assert!(start.elapsed() < Duration::from_secs(60), "a peer waited");
    });
}

#[test]
fn a_rank_whose_thread_panics_mid_step_fails_its_peers_at_once() {
    for_each_mode(|mode| {
        let outcomes = on_engines(&plan(&two_units(), 2), &sgd(), mode, |mut e| {
            forward(&mut e).unwrap();
            if e.rank() == 1 {
                let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                    let _engine = e;
                    panic!("a bug in the training loop");
                }));
                assert!(caught.is_err());
                return None;
            }
            backward_in_order(&mut e, ["a", "b"])
                .err()
                .map(|e| root(&e).clone())
        });
        assert!(
            matches!(&outcomes[0], Some(Error::PeerGone { rank: 1, .. })),
            "{outcomes:?}"
        );
    });
}

#[test]
fn a_rank_that_stops_issuing_collectives_times_its_peers_out() {
    let config = EngineConfig {
        timeout: Duration::from_millis(300),
        ..sgd()
    };
    for_each_mode(|mode| {
        let outcomes = on_engines(&plan(&two_units(), 2), &config, mode, |mut e| {
            forward(&mut e).unwrap();
            if e.rank() == 1 {
                // Stays in the group, silent, past the peer's deadline.
                std::thread::sleep(Duration::from_millis(1500));
                return None;
            }
            let started = Instant::now();
            let error = backward_in_order(&mut e, ["a", "b"]).unwrap_err();
            assert!(started.elapsed() < Duration::from_secs(30));
            Some(root(&error).clone())
        });
        // The meeting's own deadline, or the watchdog's of the collective in flight: whichever
        // comes first names the collective.
        match &outcomes[0] {
            Some(
                Error::Timeout { op, waited }
                | Error::CollectiveTimedOut {
                    collective: op,
                    waited,
                    ..
                },
            ) => {
                assert!(op.contains("reduce-scatter of group 0"), "{op}");
                assert!(*waited >= Duration::from_millis(300));
            }
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn a_blocked_call_is_aborted_from_another_thread() {
    for_each_mode(|mode| {
        let outcomes = on_engines(&plan(&two_units(), 2), &sgd(), mode, |mut e| {
            forward(&mut e).unwrap();
            if e.rank() == 1 {
                std::thread::sleep(Duration::from_millis(1000));
                return None;
            }
            let handle = e.abort_handle();
            let aborter = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                handle.abort();
            });
            let started = Instant::now();
            let error = backward_in_order(&mut e, ["a", "b"]).unwrap_err();
            assert!(started.elapsed() < Duration::from_secs(30));
            aborter.join().unwrap();
            assert_poisoned(&mut e);
            Some(root(&error).clone())
        });
        assert!(matches!(outcomes[0], Some(Error::Aborted)), "{outcomes:?}");
    });
}

#[test]
fn zero_sized_parameters_train_at_every_world_size() {
    let model = ModelSpec::new(vec![
        ParamSpec::new("empty", &[3, 0], DType::F32).in_unit(0),
        ParamSpec::new("w", &[5], DType::F32).in_unit(0),
        ParamSpec::new("none", &[0], DType::Bf16).in_unit(1),
    ])
    .unwrap();
    for world in [1, 2, 3] {
        for_each_mode(|mode| {
            let shards = on_engines(&plan(&model, world), &sgd(), mode, |mut e| {
                let ids = ["empty", "w", "none"].map(|n| e.plan().param_id(n).unwrap());
                e.load_param(ids[1], Input::host(&[1f32; 5])).unwrap();
                for unit in [Unit::Layer(0), Unit::Layer(1)] {
                    e.pre_forward(unit).unwrap();
                    e.post_forward(unit).unwrap();
                }
                e.grad(ids[0], Input::host::<f32>(&[])).unwrap();
                e.grad(ids[1], Input::host(&[0.5f32; 5])).unwrap();
                e.grad(ids[2], Input::host::<half::bf16>(&[])).unwrap();
                e.finish_grad_sync().unwrap();
                e.optimizer_step().unwrap();
                e.end_step().unwrap();
                let group = e.plan().param(ids[1]).unwrap().group();
                e.param_shard(group).unwrap()
            });
            let p = plan(&model, world);
            let w = p.param(p.param_id("w").unwrap()).unwrap().clone();
            let bytes = p.assemble_param(p.param_id("w").unwrap(), &shards).unwrap();
            let values: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert_eq!(values, vec![0.75f32; 5], "world {world}: {w:?}");
        });
    }
}

#[test]
fn limits_past_any_use_act_as_the_plan_allows() {
    let config = EngineConfig {
        double_buffer_limit: usize::MAX,
        max_reduces_in_flight: usize::MAX,
        ..sgd()
    };
    let model = two_units();
    for_each_mode(|mode| {
        let p = plan(&model, 2);
        let predicted = Policy::new(&p, &config).unwrap().memory;
        assert_eq!(Policy::new(&p, &config).unwrap().limits.gathered, 2);
        let outcomes = on_engines(&p, &config, mode, move |mut e| {
            assert_eq!(e.memory().current, predicted.peak);
            forward(&mut e).unwrap();
            backward_in_order(&mut e, ["a", "b"]).unwrap();
            e.memory().peak
        });
        assert_eq!(outcomes, vec![predicted.peak; 2]);
    });
}

#[test]
fn an_engine_larger_than_memory_is_an_error_and_the_rank_can_try_again() {
    // 2^48 f32 elements per rank: far past any machine's memory.
    let huge = ModelSpec::new(vec![
        ParamSpec::new("a", &[1 << 25, 1 << 24], DType::F32).in_unit(0),
        ParamSpec::new("b", &[64], DType::F32).in_unit(1),
    ])
    .unwrap();
    let (huge, small) = (plan(&huge, 2), plan(&two_units(), 2));
    for_each_mode(|mode| {
        let (huge, small) = (Arc::clone(&huge), Arc::clone(&small));
        let outcomes = on_ranks(2, mode, move |rank, backend, comm| {
            let (backend, comm) = if rank == 1 {
                let refused = Engine::try_new(Arc::clone(&huge), sgd(), backend, comm)
                    .err()
                    .unwrap_or_else(|| {
                        panic!(
                            "a {} byte engine",
                            Policy::new(&huge, &sgd()).map_or(0, |p| p.memory.peak)
                        )
                    });
                assert!(
                    matches!(&refused.error, Error::OutOfMemory { what, .. } if what.contains("group")),
                    "{:?}",
                    refused.error
                );
                (refused.backend, refused.comm)
            } else {
                (backend, comm)
            };
            let mut e = Engine::new(Arc::clone(&small), sgd(), backend, comm).unwrap();
            forward(&mut e).unwrap();
            backward_in_order(&mut e, ["a", "b"]).unwrap();
            e.param_shard(0).unwrap()
        });
        assert_eq!(outcomes.len(), 2);
    });
}

#[test]
fn non_finite_gradients_are_counted_and_the_mean_does_not_overflow() {
    let model = two_units();
    for_each_mode(|mode| {
        let outcomes = on_engines(&plan(&model, 2), &sgd(), mode, |mut e| {
            let a = e.plan().param_id("a").unwrap();
            let b = e.plan().param_id("b").unwrap();
            assert!(matches!(
                e.nonfinite_grads(),
                Err(Error::GradsNotSynced { .. })
            ));
            forward(&mut e).unwrap();
            let mut g = [1f32; 64];
            if e.rank() == 0 {
                g[3] = f32::NAN;
                g[40] = f32::INFINITY;
            }
            e.grad(a, Input::host(&g)).unwrap();
            // Each rank's 3e38 sums past f32's range; their mean does not.
            e.grad(b, Input::host(&[3e38f32; 64])).unwrap();
            e.finish_grad_sync().unwrap();
            let count = e.nonfinite_grads().unwrap();
            let b_group = e.plan().param(b).unwrap().group();
            let b_shard = e.grad_shard(b_group).unwrap();
            e.optimizer_step().unwrap();
            e.end_step().unwrap();
            (count, b_shard)
        });
        // Element 3 lands on rank 0's part of `a`'s group, element 40 too: each counted once.
        let total: u64 = outcomes.iter().map(|(c, _)| c).sum();
        assert_eq!(total, 2);
        let held: Vec<f32> = outcomes
            .iter()
            .flat_map(|(_, s)| s.iter().copied())
            .take(64)
            .collect();
        assert!(held.iter().all(|&x| x == 3e38), "{held:?}");
    });
}

#[test]
fn a_communicator_failure_found_between_calls_poisons_the_rank_and_fails_its_peers_at_once() {
    for_each_mode(|mode| {
        let p = plan(&two_units(), 2);
        // When rank 1's fault was set: the peer's wait is measured from there.
        let injected_at = Arc::new(std::sync::OnceLock::<Instant>::new());
        let outcomes = on_ranks(2, mode, move |rank, backend, comm| {
            let comm = Faulty::new(comm, false);
            let (fault, aborts) = (Arc::clone(&comm.fault), Arc::clone(&comm.aborts));
            let mut e = Engine::new(Arc::clone(&p), sgd(), backend, comm).unwrap();
            if rank == 1 {
                // Its peer cannot fail before this rank leaves, which is after this.
                forward(&mut e).unwrap();
                let _ = injected_at.set(Instant::now());
                fault.store(true, Ordering::SeqCst);
                let err = e.pre_backward(Unit::Layer(1)).unwrap_err();
                assert!(is_injected(&err), "{err:?}");
                assert_poisoned(&mut e);
                assert!(e.poisoned().is_some_and(is_injected), "{:?}", e.poisoned());
                // Aborted once, when poisoned: the peer is not left waiting while this rank's
                // thread lives on.
                assert_eq!(aborts.load(Ordering::SeqCst), 1);
                std::thread::sleep(Duration::from_millis(1000));
                return None;
            }
            // On an asynchronous backend this rank's forward may still be meeting the peer's
            // collectives when the peer leaves: the error comes in the forward or after it.
            let err = forward(&mut e)
                .and_then(|()| backward_in_order(&mut e, ["b", "a"]))
                .unwrap_err();
            let failed_at = Instant::now();
            assert_eq!(aborts.load(Ordering::SeqCst), 1, "the peer's own abort");
            let waited = injected_at
                .get()
                .map(|at| failed_at.saturating_duration_since(*at));
            Some((root(&err).clone(), waited))
        });
        match &outcomes[0] {
            Some((Error::PeerGone { rank: 1, .. }, Some(waited))) => {
                assert!(
                    *waited < Duration::from_millis(700),
                    "the peer waited {waited:?} after the fault"
                )
            }
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn verifying_collectives_catches_what_a_communicator_cannot_compare() {
    for verify in [false, true] {
        let config = EngineConfig {
            verify_collectives: verify,
            ..sgd()
        };
        for_each_mode(|mode| {
            let p = plan(&two_units(), 2);
            let config = config.clone();
            let outcomes = on_ranks(2, mode, move |_, backend, comm| {
                let mut e = Engine::new(
                    Arc::clone(&p),
                    config.clone(),
                    backend,
                    Faulty::new(comm, true),
                )
                .unwrap();
                let order = if e.rank() == 0 {
                    ["a", "b"]
                } else {
                    ["b", "a"]
                };
                let mut step = || -> Result<()> {
                    for u in [Unit::Layer(0), Unit::Layer(1)] {
                        e.pre_forward(u)?;
                        e.post_forward(u)?;
                    }
                    units_backward_in_order(&mut e, order)
                };
                step().err().map(|e| root(&e).clone())
            });
            for error in outcomes {
                if !verify {
                    // Unseen: the ranks paired group 0's reduction with group 1's.
                    assert!(error.is_none(), "{error:?}");
                    continue;
                }
                match error {
                    Some(Error::CollectiveMismatch {
                        rank: 1,
                        expected,
                        got,
                    }) => {
                        assert!(expected.contains("reduce-scatter of group 0"), "{expected}");
                        assert!(got.contains("reduce-scatter of group 1"), "{got}");
                    }
                    other => panic!("{other:?}"),
                }
            }
        });
    }
}

#[test]
fn an_engine_aborted_while_idle_refuses_every_later_call_as_poisoned() {
    for_each_mode(|mode| {
        let outcomes = on_engines(&plan(&two_units(), 2), &sgd(), mode, |mut e| {
            e.abort_handle().abort();
            let poisoned = |r: Result<(), Error>| matches!(r, Err(Error::Poisoned { cause }) if matches!(*cause, Error::Aborted));
            [
                poisoned(e.pre_forward(Unit::Layer(0))),
                poisoned(e.set_lr(0.5)),
                poisoned(e.set_weight_decay(0.0)),
                poisoned(e.wait_save()),
                poisoned(e.end_step()),
                // Reads still work.
                e.counters().steps == 0,
            ]
        });
        for (rank, checks) in outcomes.into_iter().enumerate() {
            assert_eq!(checks, [true; 6], "{mode:?} rank {rank}");
        }
    });
}

#[test]
fn a_rank_running_two_micro_batches_against_one_fails_at_once_across_streams() {
    // One gathered unit at a time: rank 1's second forward gathers again, as collective 2 of the
    // step, on the gather stream, while rank 0's backward reduces as collective 2, on the reduce
    // stream. Neither can meet the other; both fail at once instead of at the deadline.
    let config = EngineConfig {
        double_buffer_limit: 1,
        timeout: Duration::from_secs(60),
        ..sgd()
    };
    for_each_mode(|mode| {
        let outcomes = on_engines(&plan(&two_units(), 2), &config, mode, |mut e| {
            forward(&mut e).unwrap();
            let started = Instant::now();
            let diverged = if e.rank() == 0 {
                backward_in_order(&mut e, ["b", "a"])
            } else {
                // A shard read is a host wait: where the second forward's gather failed on its
                // stream, it shows there.
                forward(&mut e)
                    .and_then(|()| e.end_step())
                    .and_then(|()| e.param_shard(0).map(drop))
            };
            (diverged.map_err(|e| root(&e).clone()), started.elapsed())
        });
        let crossed = outcomes
            .iter()
            .filter(|(o, _)| matches!(o, Err(Error::CollectivesCrossed { .. })))
            .count();
        assert!(crossed >= 1, "{mode:?}: {outcomes:?}");
        for (rank, (outcome, waited)) in outcomes.into_iter().enumerate() {
            assert!(
                waited < Duration::from_secs(10),
                "{mode:?} rank {rank}: {waited:?}"
            );
            match outcome {
                Err(Error::CollectivesCrossed { mine, theirs, .. }) => {
                    let ops = [mine.as_str(), theirs.as_str()];
                    assert!(ops.iter().any(|o| o.starts_with("all-gather")), "{ops:?}");
                    assert!(
                        ops.iter().any(|o| o.starts_with("reduce-scatter")),
                        "{ops:?}"
                    );
                }
                // A rank whose peer failed first sees it gone.
                Err(Error::PeerGone { .. }) => {}
                other => panic!("{mode:?} rank {rank}: {other:?}"),
            }
        }
    });
}

#[test]
fn ranks_whose_settings_shape_other_collectives_refuse_to_start() {
    for (field, differs) in [
        (
            "double_buffer_limit",
            EngineConfig {
                double_buffer_limit: 1,
                ..sgd()
            },
        ),
        (
            "overlap",
            EngineConfig {
                overlap: false,
                ..sgd()
            },
        ),
        (
            "reduce_dtype",
            EngineConfig {
                reduce_dtype: DType::Bf16,
                ..sgd()
            },
        ),
        // Settings that shape no collective but the result, which replicas and shards must
        // share.
        (
            "grad_reduction",
            EngineConfig {
                grad_reduction: fsdp_fusion::GradReduction::Sum,
                ..sgd()
            },
        ),
        (
            "optimizer",
            EngineConfig {
                optimizer: OptimizerConfig::sgd(0.25),
                ..sgd()
            },
        ),
    ] {
        let p = plan(&two_units(), 2);
        let outcomes = on_ranks(2, Mode::Eager, move |rank, backend, comm| {
            let config = if rank == 1 { differs.clone() } else { sgd() };
            Engine::new(Arc::clone(&p), config, backend, comm).err()
        });
        for (rank, e) in outcomes.into_iter().enumerate() {
            assert!(
                matches!(&e, Some(Error::SettingsMismatch { rank: 1, .. })),
                "{field}: rank {rank}: {e:?}"
            );
        }
    }
}

#[test]
fn a_creation_that_timed_out_waiting_for_its_peer_can_be_retried() {
    for_each_mode(|mode| {
        let p = plan(&two_units(), 2);
        let outcomes = on_ranks(2, mode, move |rank, backend, comm| {
            let (backend, comm) = match rank {
                0 => {
                    let short = EngineConfig {
                        timeout: Duration::from_millis(150),
                        ..sgd()
                    };
                    let refused = Engine::try_new(Arc::clone(&p), short, backend, comm)
                        .err()
                        .expect("made without its peer");
                    // The meeting's deadline, or the watchdog's of the exchange in flight.
                    let error = root(&refused.error);
                    assert!(
                        matches!(
                            error,
                            Error::Timeout { .. } | Error::CollectiveTimedOut { .. }
                        ),
                        "{error:?}"
                    );
                    // An asynchronous backend's stream that ran the meeting failed with it: the
                    // retry takes a fresh backend there, and the communicator given back.
                    let backend = match mode {
                        Mode::Eager => refused.backend,
                        Mode::Async(_) => mode.backend(rank),
                    };
                    (backend, refused.comm)
                }
                _ => {
                    std::thread::sleep(Duration::from_millis(500));
                    (backend, comm)
                }
            };
            // Both ranks meet now: the failed meeting left nothing behind.
            let mut e = Engine::new(Arc::clone(&p), sgd(), backend, comm)?;
            forward(&mut e)?;
            backward_in_order(&mut e, ["a", "b"])?;
            (0..2).map(|g| e.param_shard(g)).collect::<Result<Vec<_>>>()
        });
        let shards: Vec<_> = outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|e| panic!("{mode:?}: {e}")))
            .collect();
        assert_ne!(
            shards[0], shards[1],
            "{mode:?}: each rank holds its own shards"
        );
    });
}
