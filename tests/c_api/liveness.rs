//! Blocked, aborted, destroyed and hung: every wait ends, and a failed creation can be retried.

use super::*;

#[test]
fn a_blocked_call_is_aborted_and_counters_never_wait_for_it() {
    for_each_mode(|mode| {
        let (blocked, other) = two_ranks(
            mode,
            |engine| {
                let aborter = std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_millis(200));
                    // Another thread reads the counters of the blocked engine, hands it a
                    // gradient that is refused before the engine's lock, then aborts it.
                    let mut counters = fsdp_counters::default();
                    // SAFETY: valid pointers.
                    ok(unsafe { fsdp_engine_counters(handle(engine), &mut counters) });
                    let started = std::time::Instant::now();
                    // SAFETY: a NULL gradient, which the call refuses.
                    let refused =
                        unsafe { fsdp_engine_grad(handle(engine), 1, null(), 9, FSDP_F32) };
                    let refused_after = started.elapsed();
                    ok(fsdp_engine_abort(handle(engine)));
                    (counters.all_gathers, refused, refused_after)
                });
                let status = forward_then_gradient(engine);
                let (gathers, refused, refused_after) = aborter.join().unwrap();
                assert_eq!(refused, NULL);
                assert!(
                    refused_after.as_millis() < 100,
                    "refused after {refused_after:?}"
                );
                let later = fsdp_engine_end_step(handle(engine));
                let message = last_error();
                ok(fsdp_engine_destroy(handle(engine)));
                (status, gathers, later, message)
            },
            |engine| {
                forward_only(engine);
                std::thread::sleep(std::time::Duration::from_millis(600));
                ok(fsdp_engine_destroy(handle(engine)));
                (fsdp_status::FSDP_OK, 0, fsdp_status::FSDP_OK, String::new())
            },
        );
        let (status, gathers, later, message) = blocked;
        assert_eq!(status, fsdp_status::FSDP_ABORTED, "{mode:?}");
        assert!(gathers >= 2, "the counters read while blocked: {gathers}");
        assert_eq!(later, fsdp_status::FSDP_POISONED);
        assert!(message.contains("aborted"), "{message}");
        assert_eq!(other.0, fsdp_status::FSDP_OK);
    });
}

/// A collective made to hang (`fsdp_engine_hang_collective`) on rank 0 of two, whose engines
/// wait `timeout_seconds` = 1: the call that queued it returns at once, the watchdog fails it at
/// the deadline, the next call names it, the peer fails instead of waiting, and destroy works. On
/// eager ranks the call that queues it refuses the hold instead of blocking for good.
#[test]
fn a_collective_hung_through_the_c_api_fails_at_its_deadline_and_poisons_the_engine() {
    let config = fsdp_config {
        timeout_seconds: 1.0,
        ..sgd_config()
    };
    for_each_mode(|mode| {
        let (hung, peer) = two_ranks_with(
            mode,
            config,
            |engine| {
                ok(fsdp_engine_hang_collective(handle(engine), 0));
                let issued = std::time::Instant::now();
                let queued = fsdp_engine_pre_forward(handle(engine), FSDP_ROOT);
                let queued_message = last_error();
                let returned_after = issued.elapsed();
                std::thread::sleep(std::time::Duration::from_millis(1600));
                let next = fsdp_engine_post_forward(handle(engine), FSDP_ROOT);
                let next_message = last_error();
                let later = fsdp_engine_end_step(handle(engine));
                ok(fsdp_engine_destroy(handle(engine)));
                let outcome = (queued, next, later);
                (
                    outcome,
                    returned_after,
                    format!("{queued_message} / {next_message}"),
                )
            },
            |engine| {
                let started = std::time::Instant::now();
                let status = forward_then_gradient(engine);
                ok(fsdp_engine_destroy(handle(engine)));
                let outcome = (status, fsdp_status::FSDP_OK, fsdp_status::FSDP_OK);
                (outcome, started.elapsed(), last_error())
            },
        );
        let ((queued, next, later), returned_after, messages) = hung;
        match mode {
            Mode::Eager => {
                assert_eq!(queued, fsdp_status::FSDP_UNAVAILABLE, "{messages}");
                assert!(messages.contains("eager"), "{messages}");
            }
            Mode::Async(_) => {
                assert_eq!(queued, fsdp_status::FSDP_OK, "{mode:?}: {messages}");
                assert!(returned_after.as_secs_f64() < 0.5, "{returned_after:?}");
                assert_eq!(next, fsdp_status::FSDP_TIMEOUT, "{mode:?}: {messages}");
                assert!(
                    messages.contains("all-gather") && messages.contains("still in flight"),
                    "{messages}"
                );
                assert_eq!(later, fsdp_status::FSDP_POISONED);
            }
        }
        let ((status, ..), waited, message) = peer;
        // The peer fails in its next gather: at rank 0's leaving, or at its own deadline.
        assert!(
            matches!(
                status,
                fsdp_status::FSDP_COMM_ERROR | fsdp_status::FSDP_TIMEOUT
            ) && message.contains("all-gather of group 1"),
            "{mode:?}: {status:?}, {message}"
        );
        assert!(
            waited.as_secs_f64() < 3.0,
            "the peer waited {waited:?}: {message}"
        );
    });
}

#[test]
fn destroying_an_engine_blocked_in_another_thread_unblocks_it() {
    for_each_mode(|mode| {
        let (blocked, _) = two_ranks(
            mode,
            |engine| {
                let destroyer = std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_millis(200));
                    fsdp_engine_destroy(handle(engine))
                });
                let status = forward_then_gradient(engine);
                (status, destroyer.join().unwrap())
            },
            |engine| {
                forward_only(engine);
                std::thread::sleep(std::time::Duration::from_millis(600));
                ok(fsdp_engine_destroy(handle(engine)));
                (fsdp_status::FSDP_OK, fsdp_status::FSDP_OK)
            },
        );
        assert_eq!(blocked, (fsdp_status::FSDP_ABORTED, fsdp_status::FSDP_OK));
    });
}

#[test]
fn a_step_driven_by_threads_in_turn_that_end_mid_step_goes_on() {
    for_each_mode(|mode| {
        // Each rank's step: its forward on one thread, which ends, its gradient on another.
        let in_turn = |engine: usize| {
            std::thread::spawn(move || forward_only(engine))
                .join()
                .unwrap();
            let (status, message) =
                std::thread::spawn(move || (gradient_after_forward(engine), last_error()))
                    .join()
                    .unwrap();
            (status, message, engine)
        };
        let (first, second) = two_ranks(mode, in_turn, in_turn);
        for (status, message, engine) in [first, second] {
            assert_eq!(status, fsdp_status::FSDP_OK, "{mode:?}: {message}");
            ok(fsdp_engine_destroy(handle(engine)));
        }
    });
}

#[test]
fn a_failed_creation_gives_the_communicator_back() {
    let huge = CString::new(
        r#"{"params": [{"name": "w", "shape": [33554432, 16777216], "dtype": "f32"}]}"#,
    )
    .unwrap();
    let mut huge_plan = null_mut();
    let config = config();
    let mut engine = null_mut();
    // SAFETY: valid pointers.
    unsafe {
        ok(fsdp_plan_from_json(huge.as_ptr(), 1, &mut huge_plan));
        let group = local_group(Mode::Eager, 1);
        expect(
            fsdp_engine_create_cpu(huge_plan, &config, group, 0, &mut engine),
            fsdp_status::FSDP_OUT_OF_MEMORY,
            "parameter shard of group 0",
        );
        let plan = plan(1);
        ok(fsdp_engine_create_cpu(plan, &config, group, 0, &mut engine));
        ok(fsdp_engine_destroy(engine));
        ok(fsdp_local_group_destroy(group));
        ok(fsdp_plan_destroy(plan));
        ok(fsdp_plan_destroy(huge_plan));
    }
}

#[test]
fn destroying_a_group_while_a_rank_is_inside_its_creation_fails_it_at_once() {
    within_deadline("a group destroyed under a creation", || {
        for_each_mode(destroy_the_group_under_a_creation)
    });
}

/// A creation of rank 0 in `mode` that waits for rank 1 while the group is destroyed.
fn destroy_the_group_under_a_creation(mode: Mode) {
    let plan = plan(2);
    let group = local_group(mode, 2);
    let (plan_handle, group_handle) = (plan as usize, group as usize);
    let creating = std::thread::spawn(move || {
        let mut engine = null_mut();
        let started = std::time::Instant::now();
        // SAFETY: valid pointers; the group is destroyed while this call waits in it.
        let status = unsafe {
            fsdp_engine_create_cpu(
                plan_handle as *mut fsdp_plan,
                &config(),
                group_handle as *mut fsdp_local_group,
                0,
                &mut engine,
            )
        };
        (status, last_error(), started.elapsed())
    });
    std::thread::sleep(std::time::Duration::from_millis(200));
    ok(fsdp_local_group_destroy(group));
    let (status, message, waited) = creating.join().unwrap();
    assert_eq!(status, fsdp_status::FSDP_COMM_ERROR, "{mode:?}: {message}");
    assert!(message.contains("group destroyed"), "{mode:?}: {message}");
    assert!(
        waited < std::time::Duration::from_secs(10),
        "{mode:?}: waited {waited:?} (the default deadline is 600 s)"
    );
    ok(fsdp_plan_destroy(plan));
}

/// A thread that reads an engine's counters while another destroys it never ends up dropping
/// the engine: `fsdp_engine_destroy` drops it before it returns (its asynchronous save's files
/// are on disk then, as it promises), and the reader's later calls name a handle that is gone.
#[test]
fn an_engine_destroyed_while_another_thread_reads_it_goes_before_destroy_returns() {
    within_deadline("a destroy beside a reader", || {
        for_each_mode(destroy_beside_a_reader)
    });
}

/// Twenty rounds in `mode` of a destroy while another thread reads the engine's counters.
fn destroy_beside_a_reader(mode: Mode) {
    for round in 0..20 {
        let dir = std::env::temp_dir().join(format!(
            "fsdp-fusion-c-destroy-{}-{mode:?}-{round}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let path = CString::new(dir.to_str().unwrap()).unwrap();
        let (plan, group, engine) = engine(mode);
        sgd_step(engine, plan, 0, &Host::default());
        // SAFETY: valid pointers.
        ok(unsafe { fsdp_engine_save_async(engine, path.as_ptr()) });
        let reader = {
            let engine = engine as usize;
            std::thread::spawn(move || {
                let mut counters = fsdp_counters::default();
                loop {
                    // SAFETY: valid pointers; the handle goes while this reads.
                    let read = unsafe { fsdp_engine_counters(handle(engine), &mut counters) };
                    if read != fsdp_status::FSDP_OK {
                        return read;
                    }
                }
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(1));
        ok(fsdp_engine_destroy(engine));
        let written = dir.join("rank-00000.json").exists();
        assert_eq!(reader.join().unwrap(), fsdp_status::FSDP_INVALID_HANDLE);
        assert!(
            written,
            "{mode:?}: destroy returned before the save's files"
        );
        ok(fsdp_local_group_destroy(group));
        ok(fsdp_plan_destroy(plan));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
