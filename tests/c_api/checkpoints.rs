//! Checkpoints and safetensors through the C API.

use super::*;

#[test]
fn a_checkpoint_saved_and_loaded_through_the_c_api_continues_the_optimizer() {
    for_each_mode(|mode| {
        let dir = std::env::temp_dir().join(format!(
            "fsdp-fusion-c-checkpoint-{}-{mode:?}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let path = CString::new(dir.to_str().unwrap()).unwrap();
        let (plan, group, saved) = engine(mode);
        sgd_step(saved, plan, 0, &Host::default());
        let background = CString::new(dir.join("background").to_str().unwrap()).unwrap();
        // SAFETY: valid pointers throughout.
        unsafe {
            ok(fsdp_engine_save(saved, path.as_ptr()));
            expect(
                fsdp_engine_save(saved, path.as_ptr()),
                fsdp_status::FSDP_INVALID_ARGUMENT,
                "never overwrites",
            );
            ok(fsdp_engine_save_async(saved, background.as_ptr()));
            expect(
                fsdp_engine_save_async(saved, path.as_ptr()),
                fsdp_status::FSDP_MISUSE,
                "still being written",
            );
            ok(fsdp_engine_wait_save(saved));
            ok(fsdp_engine_wait_save(saved));
        }
        let data = |name: &str| std::fs::read(dir.join(name).join("rank-00000.bin")).unwrap();
        assert_eq!(
            data("background"),
            std::fs::read(dir.join("rank-00000.bin")).unwrap()
        );
        // The same initial values again, then a second step: it runs on the saved moments and
        // step count in both engines.
        let straight = sgd_step(saved, plan, 0, &Host::default());
        let other_group = local_group(mode, 1);
        let mut loaded = null_mut();
        // SAFETY: valid pointers throughout.
        unsafe {
            ok(fsdp_engine_create_cpu(
                plan,
                &config(),
                other_group,
                0,
                &mut loaded,
            ));
            let missing = CString::new(dir.join("nowhere").to_str().unwrap()).unwrap();
            expect(
                fsdp_engine_load(loaded, missing.as_ptr()),
                fsdp_status::FSDP_IO_ERROR,
                "no checkpoint directory",
            );
            expect(fsdp_engine_load(loaded, null()), NULL, "dir");
            ok(fsdp_engine_load(loaded, path.as_ptr()));
        }
        assert_eq!(sgd_step(loaded, plan, 0, &Host::default()), straight);
        ok(fsdp_engine_destroy(loaded));
        ok(fsdp_engine_destroy(saved));
        ok(fsdp_local_group_destroy(other_group));
        ok(fsdp_local_group_destroy(group));
        ok(fsdp_plan_destroy(plan));
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// Group 0's shard of `engine`, as bytes.
fn shard_bytes(engine: *mut fsdp_engine) -> Vec<u8> {
    let mut out = vec![0u8; 4096];
    let mut written = 0usize;
    // SAFETY: valid pointers.
    ok(unsafe {
        fsdp_engine_param_shard(engine, 0, out.as_mut_ptr().cast(), out.len(), &mut written)
    });
    out.truncate(written);
    out
}

#[test]
fn a_bf16_model_loaded_and_saved_before_any_step_loads_as_loaded_through_the_c_api() {
    for_each_mode(|mode| {
        let json = CString::new(
            r#"{"params": [{"name": "w", "shape": [5, 7], "dtype": "bf16", "unit": 0}]}"#,
        )
        .unwrap();
        let mut plan = null_mut();
        // SAFETY: valid pointers.
        ok(unsafe { fsdp_plan_from_json(json.as_ptr(), 1, &mut plan) });
        let engine = |group| {
            let mut engine = null_mut();
            // SAFETY: valid pointers.
            ok(unsafe { fsdp_engine_create_cpu(plan, &config(), group, 0, &mut engine) });
            engine
        };
        let (first, second) = (local_group(mode, 1), local_group(mode, 1));
        let (saved, loaded) = (engine(first), engine(second));
        let values: Vec<u16> = (0..35u16).map(|i| 0x3f80 + i).collect();
        let dir = std::env::temp_dir().join(format!(
            "fsdp-fusion-c-fresh-{}-{mode:?}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let path = CString::new(dir.to_str().unwrap()).unwrap();
        let empty = CString::new("").unwrap();
        // SAFETY: valid pointers throughout.
        unsafe {
            ok(fsdp_engine_load_param(
                saved,
                0,
                values.as_ptr().cast(),
                35,
                FSDP_BF16,
            ));
            expect(
                fsdp_engine_save(saved, empty.as_ptr()),
                fsdp_status::FSDP_INVALID_ARGUMENT,
                "empty path",
            );
            expect(
                fsdp_engine_load(loaded, empty.as_ptr()),
                fsdp_status::FSDP_INVALID_ARGUMENT,
                "empty path",
            );
            ok(fsdp_engine_save(saved, path.as_ptr()));
            ok(fsdp_engine_load(loaded, path.as_ptr()));
        }
        assert!(!std::path::Path::new("rank-00000.json").exists());
        let expected: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(&shard_bytes(loaded)[..70], &expected[..]);
        assert_eq!(shard_bytes(loaded), shard_bytes(saved));
        let _ = std::fs::remove_dir_all(&dir);
        ok(fsdp_engine_destroy(loaded));
        ok(fsdp_engine_destroy(saved));
        ok(fsdp_local_group_destroy(first));
        ok(fsdp_local_group_destroy(second));
        ok(fsdp_plan_destroy(plan));
    });
}

#[test]
fn a_model_exported_through_the_c_api_imports_into_a_fresh_engine() {
    for_each_mode(|mode| {
        let dir = std::env::temp_dir().join(format!(
            "fsdp-fusion-c-export-{}-{mode:?}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = CString::new(dir.join("model.safetensors").to_str().unwrap()).unwrap();
        let (plan, group, trained) = engine(mode);
        sgd_step(trained, plan, 0, &Host::default());
        let (other_plan, other_group, fresh) = engine(mode);
        let shard = shard_bytes;
        // SAFETY: valid pointers throughout.
        unsafe {
            expect(
                fsdp_engine_export_safetensors(trained, null()),
                NULL,
                "path",
            );
            ok(fsdp_engine_export_safetensors(trained, file.as_ptr()));
            expect(
                fsdp_engine_export_safetensors(trained, file.as_ptr()),
                fsdp_status::FSDP_INVALID_ARGUMENT,
                "exists",
            );
            assert_ne!(shard(fresh), shard(trained), "a step moved the values");
            let missing = CString::new(dir.join("none").to_str().unwrap()).unwrap();
            expect(
                fsdp_engine_import_safetensors(fresh, missing.as_ptr()),
                fsdp_status::FSDP_IO_ERROR,
                "none",
            );
            ok(fsdp_engine_import_safetensors(fresh, file.as_ptr()));
        }
        assert_eq!(shard(fresh), shard(trained));
        for e in [trained, fresh] {
            ok(fsdp_engine_destroy(e));
        }
        for g in [group, other_group] {
            ok(fsdp_local_group_destroy(g));
        }
        for p in [plan, other_plan] {
            ok(fsdp_plan_destroy(p));
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// A path is its bytes: a directory whose name is not UTF-8 (as Python's `os.fsencode` gives
/// for such a name) saves and loads.
#[test]
fn a_checkpoint_directory_whose_name_is_not_utf8_saves_and_loads() {
    use std::os::unix::ffi::OsStrExt;
    let base = std::env::temp_dir().join(format!("fsdp-fusion-c-bytes-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let dir = base.join(std::ffi::OsStr::from_bytes(b"ckpt-\xff"));
    let path = CString::new(dir.as_os_str().as_bytes()).unwrap();
    let (plan, group, engine) = engine(Mode::Eager);
    sgd_step(engine, plan, 0, &Host::default());
    // SAFETY: valid pointers.
    unsafe {
        ok(fsdp_engine_save(engine, path.as_ptr()));
        ok(fsdp_engine_load(engine, path.as_ptr()));
    }
    assert!(dir.join("rank-00000.json").exists());
    ok(fsdp_engine_destroy(engine));
    ok(fsdp_local_group_destroy(group));
    ok(fsdp_plan_destroy(plan));
    std::fs::remove_dir_all(&base).unwrap();
}
