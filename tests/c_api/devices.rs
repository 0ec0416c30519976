//! CUDA engines and NCCL ids: their arguments are checked before a device is touched, and a group
//! is kept when the device fails.

use super::*;

#[test]
fn nccl_unique_id_checks_its_buffer_and_reports_a_missing_nccl() {
    let mut id = [0u8; 128];
    // SAFETY: valid pointers, or NULL on purpose.
    unsafe {
        expect(fsdp_nccl_unique_id(null_mut(), 128), NULL, "out");
        expect(
            fsdp_nccl_unique_id(id.as_mut_ptr(), 64),
            BAD,
            "128 bytes, not 64",
        );
        match fsdp_nccl_unique_id(id.as_mut_ptr(), 128) {
            fsdp_status::FSDP_OK => assert!(id.iter().any(|&b| b != 0), "an empty id"),
            status => expect(status, UNAVAILABLE, "NCCL is not available"),
        }
    }
}

#[test]
fn cuda_nccl_engine_checks_its_arguments_before_touching_a_device() {
    let plan = plan(1);
    let config = config();
    let id = [0u8; 128];
    let mut engine = null_mut();
    // SAFETY: valid pointers, or NULL on purpose.
    unsafe {
        let create = |plan, config, device, id, id_len, rank, world, out| {
            fsdp_engine_create_cuda_nccl(
                plan,
                config,
                device,
                id,
                id_len,
                rank,
                world,
                0,
                null(),
                out,
            )
        };
        let id = id.as_ptr();
        expect(
            create(null(), &config, 0, id, 128, 0, 1, &mut engine),
            NULL,
            "plan",
        );
        expect(
            create(plan, null(), 0, id, 128, 0, 1, &mut engine),
            NULL,
            "config",
        );
        expect(
            create(plan, &config, 0, null(), 128, 0, 1, &mut engine),
            NULL,
            "unique_id",
        );
        expect(
            create(plan, &config, 0, id, 128, 0, 1, null_mut()),
            NULL,
            "out",
        );
        expect(
            create(plan, &config, 0, id, 127, 0, 1, &mut engine),
            BAD,
            "128 bytes, not 127",
        );
        expect(
            create(plan, &config, -1, id, 128, 0, 1, &mut engine),
            BAD,
            "device -1",
        );
        expect(
            create(plan, &config, 0, id, 128, 0, 2, &mut engine),
            BAD,
            "world size 1, the communicator 2",
        );
        expect(
            create(plan, &config, 0, id, 128, 1, 1, &mut engine),
            BAD,
            "rank 1 is out of range",
        );
        if !gpu_present() {
            expect(
                create(plan, &config, 0, id, 128, 0, 1, &mut engine),
                UNAVAILABLE,
                "CUDA is not available",
            );
            assert!(engine.is_null(), "no engine on failure");
        }
        ok(fsdp_plan_destroy(plan));
    }
}

#[test]
fn cuda_loopback_engine_checks_its_group_and_keeps_it_when_the_device_fails() {
    let plan = plan(2);
    let config = config();
    let mut loopback = null_mut();
    let mut local = null_mut();
    let mut engine = null_mut();
    // SAFETY: valid pointers, or NULL and wrong handles on purpose.
    unsafe {
        expect(fsdp_loopback_group_create(2, null_mut()), NULL, "out");
        expect(
            fsdp_loopback_group_create(0, &mut loopback),
            BAD,
            "world size",
        );
        ok(fsdp_loopback_group_create(2, &mut loopback));
        ok(fsdp_local_group_create(2, &mut local));
        let create = |plan, config, device, group, rank, out| {
            fsdp_engine_create_cuda_loopback(plan, config, device, group, rank, 0, null(), out)
        };
        expect(
            create(null(), &config, 0, loopback, 0, &mut engine),
            NULL,
            "plan",
        );
        expect(
            create(plan, null(), 0, loopback, 0, &mut engine),
            NULL,
            "config",
        );
        expect(
            create(plan, &config, 0, null_mut(), 0, &mut engine),
            NULL,
            "group",
        );
        expect(
            create(plan, &config, 0, loopback, 0, null_mut()),
            NULL,
            "out",
        );
        expect(
            create(plan, &config, -3, loopback, 0, &mut engine),
            BAD,
            "device -3",
        );
        let stale = fsdp_status::FSDP_INVALID_HANDLE;
        expect(
            create(plan, &config, 0, local.cast(), 0, &mut engine),
            stale,
            "another kind",
        );
        expect(
            fsdp_engine_create_cpu(plan, &config, loopback.cast(), 0, &mut engine),
            stale,
            "another kind",
        );
        expect(
            fsdp_local_group_destroy(loopback.cast()),
            stale,
            "another kind",
        );
        expect(
            fsdp_loopback_group_destroy(local.cast()),
            stale,
            "another kind",
        );
        if !gpu_present() {
            // Twice: the failed call left rank 0's communicator in the group.
            for _ in 0..2 {
                expect(
                    create(plan, &config, 0, loopback, 0, &mut engine),
                    UNAVAILABLE,
                    "CUDA is not available",
                );
            }
        }
        ok(fsdp_loopback_group_destroy(loopback));
        ok(fsdp_loopback_group_destroy(null_mut()));
        ok(fsdp_local_group_destroy(local));
        ok(fsdp_plan_destroy(plan));
    }
}
