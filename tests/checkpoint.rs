//! Sharded checkpoints on CPU ranks: a run saved and loaded into fresh engines continues bit for
//! bit; every refusal (missing, incomplete, truncated, corrupted, another model, an existing
//! checkpoint, a save mid-step) is its own error and changes nothing. Eager and asynchronous.
//! (`checkpoint_integrity.rs` holds what a checkpoint must never do.)

use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier, Mutex};

use fsdp_fusion::optim::LrSchedule;
use fsdp_fusion::{DType, EngineConfig, Error, OptimizerConfig, ParamStorage, Plan, Unit};
use fsdp_fusion_support::mlp::{Checkpoints, Mlp, MlpConfig, Recipe, Training, load, sharded_step};
use fsdp_fusion_support::ranks::{
    CpuEngine, Mode, for_each_case_and_mode_of_a_long_suite, for_each_mode_of_a_long_suite,
    on_engines, on_threads, within_deadline,
};
use fsdp_fusion_support::scratch::Scratch;

const PASSES: u64 = 2;

fn model(dtype: DType, width: usize) -> Mlp {
    Mlp::new(MlpConfig::small(dtype, width))
}

fn recipe() -> Recipe {
    Recipe {
        schedule: LrSchedule::WarmupCosine {
            warmup_steps: 2,
            total_steps: 6,
            min_factor: 0.1,
        },
        clip: Some(0.05),
    }
}

/// Every group's shard, as bytes.
fn shards(e: &mut CpuEngine) -> Vec<Vec<u8>> {
    (0..e.plan().groups().len())
        .map(|g| e.param_shard(g).unwrap())
        .collect()
}

/// Makes an engine start from `init`, the model's initial values.
fn loaded_with(init: Vec<Vec<f32>>) -> impl Fn(&mut CpuEngine) + Send + Sync + 'static {
    move |e| load(e, &init).unwrap()
}

/// Every rank's parameter shards, as bytes, rank by rank.
type RankShards = Vec<Vec<Vec<u8>>>;

/// Every rank's shards after steps 0..6 from `init`, and after steps 0..3 of the same run,
/// which is saved to `dir` then.
fn straight_and_saved_halfway(
    run: (&Mlp, &Arc<Plan>, &EngineConfig),
    mode: Mode,
    init: Vec<Vec<f32>>,
    dir: &Path,
) -> (RankShards, RankShards) {
    let straight = train(run, mode, 0..6, loaded_with(init.clone()), shards);
    let dir = dir.to_path_buf();
    let halfway = train(run, mode, 0..3, loaded_with(init), move |e| {
        e.save(&dir).unwrap();
        shards(e)
    });
    (straight, halfway)
}

/// Steps `steps` of the model on every rank; each rank's engine is made by `make` (loaded with
/// the initial values or from a checkpoint) and handed to `after` when done.
fn train<R: Send + 'static>(
    (mlp, plan, config): (&Mlp, &Arc<Plan>, &EngineConfig),
    mode: Mode,
    steps: std::ops::Range<u64>,
    make: impl Fn(&mut CpuEngine) + Send + Sync + 'static,
    after: impl Fn(&mut CpuEngine) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let mlp = mlp.clone();
    let base_lr = config.optimizer.lr();
    on_engines(plan, config, mode, move |mut e| {
        make(&mut e);
        for step in steps.clone() {
            sharded_step(&mlp, &mut e, (step, PASSES), base_lr, recipe()).unwrap();
        }
        after(&mut e)
    })
}

#[test]
fn a_saved_run_continues_bit_for_bit_in_fresh_engines() {
    let adamw = OptimizerConfig::default();
    let shard = ParamStorage::ShardAndMaster;
    let cases = [
        (DType::F32, adamw, shard, 1),
        (DType::F32, adamw, shard, 2),
        (DType::F32, adamw, shard, 3),
        (DType::F32, adamw, shard, 4),
        (DType::Bf16, adamw, shard, 2),
        (DType::Bf16, adamw, ParamStorage::MasterOnly, 3),
        (DType::F16, OptimizerConfig::sgd(0.05), shard, 4),
    ];
    for_each_case_and_mode_of_a_long_suite(&cases, |&(dtype, optimizer, storage, world), mode| {
        let mlp = model(dtype, 24);
        let plan = Arc::new(Plan::new(&mlp.spec().unwrap(), world).unwrap());
        let config = EngineConfig {
            optimizer,
            param_storage: storage,
            ..EngineConfig::default()
        };
        let init = mlp.init(3);
        let what = format!("{dtype} {storage:?} world {world}");
        let scratch = Scratch::new("checkpoint");
        let (straight, halfway) =
            straight_and_saved_halfway((&mlp, &plan, &config), mode, init, scratch.path());
        assert_ne!(halfway, straight, "{what}: training moved nothing");
        let dir = scratch.path().to_path_buf();
        let resumed = train(
            (&mlp, &plan, &config),
            mode,
            3..6,
            move |e| e.load(&dir).unwrap(),
            shards,
        );
        assert_eq!(resumed, straight, "{what}: resumed != straight");
    });
}

#[test]
fn either_storage_loads_the_other_s_checkpoint() {
    let mlp = model(DType::Bf16, 24);
    let plan = Arc::new(Plan::new(&mlp.spec().unwrap(), 2).unwrap());
    let config = |param_storage| EngineConfig {
        param_storage,
        ..EngineConfig::default()
    };
    let init = mlp.init(3);
    for (saved, loaded) in [
        (ParamStorage::ShardAndMaster, ParamStorage::MasterOnly),
        (ParamStorage::MasterOnly, ParamStorage::ShardAndMaster),
    ] {
        let straight = {
            let init = init.clone();
            train(
                (&mlp, &plan, &config(loaded)),
                Mode::Eager,
                0..4,
                move |e| load(e, &init).unwrap(),
                shards,
            )
        };
        let scratch = Scratch::new("checkpoint");
        let dir = scratch.path().to_path_buf();
        let init = init.clone();
        train(
            (&mlp, &plan, &config(saved)),
            Mode::Eager,
            0..2,
            move |e| load(e, &init).unwrap(),
            move |e| e.save(&dir).unwrap(),
        );
        let dir = scratch.path().to_path_buf();
        let resumed = train(
            (&mlp, &plan, &config(loaded)),
            Mode::Eager,
            2..4,
            move |e| e.load(&dir).unwrap(),
            shards,
        );
        assert_eq!(resumed, straight, "saved {saved:?}, loaded {loaded:?}");
    }
}

/// Two ranks, trained two steps and saved into `dir`.
fn saved_pair(mlp: &Mlp, dir: &Path) -> (Arc<Plan>, EngineConfig) {
    let plan = Arc::new(Plan::new(&mlp.spec().unwrap(), 2).unwrap());
    let config = EngineConfig::default();
    let init = mlp.init(3);
    let dir = dir.to_path_buf();
    train(
        (mlp, &plan, &config),
        Mode::Eager,
        0..2,
        move |e| load(e, &init).unwrap(),
        move |e| e.save(&dir).unwrap(),
    );
    (plan, config)
}

/// Each rank's error loading `dir` into an engine of `plan`, checking that the refusal changed
/// nothing: one step after it gives the shards of an engine that never tried.
fn refused(mlp: &Mlp, (plan, config): (&Arc<Plan>, &EngineConfig), dir: &Path) -> Vec<Error> {
    let init = mlp.init(3);
    let untouched = {
        let init = init.clone();
        train(
            (mlp, plan, config),
            Mode::Eager,
            0..1,
            move |e| load(e, &init).unwrap(),
            shards,
        )
    };
    let errors = Arc::new(Mutex::new(Vec::new()));
    let (seen, dir) = (Arc::clone(&errors), dir.to_path_buf());
    let after = train(
        (mlp, plan, config),
        Mode::Eager,
        0..1,
        move |e| {
            load(e, &init).unwrap();
            let err = e.load(&dir).unwrap_err();
            seen.lock().unwrap().push((e.rank(), err));
        },
        shards,
    );
    assert_eq!(after, untouched, "a refused load changed the engine");
    let mut errors = std::mem::take(&mut *errors.lock().unwrap());
    errors.sort_by_key(|(rank, _)| *rank);
    errors.into_iter().map(|(_, e)| e).collect()
}

fn reason(e: &Error) -> String {
    match e {
        Error::CheckpointUnreadable { path, reason } => format!("{path}: {reason}"),
        other => panic!("expected CheckpointUnreadable, got {other:?}"),
    }
}

#[test]
fn a_missing_incomplete_truncated_or_corrupted_checkpoint_is_refused_by_name() {
    let mlp = model(DType::Bf16, 24);
    let scratch = Scratch::new("checkpoint");
    let dir = scratch.path();
    let (plan, config) = saved_pair(&mlp, dir);
    let nowhere = dir.join("nowhere");
    for e in refused(&mlp, (&plan, &config), &nowhere) {
        assert!(reason(&e).contains("no checkpoint directory"), "{e}");
    }
    // A save that did not finish: rank 1's manifest never appeared.
    let manifest = dir.join("rank-00001.json");
    let kept = std::fs::read(&manifest).unwrap();
    std::fs::remove_file(&manifest).unwrap();
    for e in refused(&mlp, (&plan, &config), dir) {
        let r = reason(&e);
        assert!(
            r.contains("rank-00001.json") && r.contains("incomplete"),
            "{r}"
        );
    }
    std::fs::write(&manifest, kept).unwrap();
    // Every rank's data truncated, then one byte of each flipped.
    let data = |rank: usize| dir.join(format!("rank-{rank:05}.bin"));
    let bytes: Vec<Vec<u8>> = (0..2).map(|r| std::fs::read(data(r)).unwrap()).collect();
    for (r, b) in bytes.iter().enumerate() {
        std::fs::write(data(r), &b[..b.len() - 7]).unwrap();
    }
    for (rank, e) in refused(&mlp, (&plan, &config), dir).iter().enumerate() {
        let r = reason(e);
        assert!(
            r.contains(&format!("rank-{rank:05}.bin")) && r.contains("truncated"),
            "{r}"
        );
    }
    for (r, b) in bytes.iter().enumerate() {
        let mut flipped = b.clone();
        flipped[b.len() / 2] ^= 0x10;
        std::fs::write(data(r), &flipped).unwrap();
    }
    for (rank, e) in refused(&mlp, (&plan, &config), dir).iter().enumerate() {
        let r = reason(e);
        assert!(
            r.contains(&format!("rank-{rank:05}.bin")) && r.contains("corrupted"),
            "{r}"
        );
    }
    for (r, b) in bytes.iter().enumerate() {
        std::fs::write(data(r), b).unwrap();
    }
    std::fs::write(&manifest, "{ not json").unwrap();
    for e in refused(&mlp, (&plan, &config), dir) {
        assert!(reason(&e).contains("rank-00001.json"), "{e}");
    }
}

#[test]
fn a_checkpoint_of_another_model_is_refused_with_its_differences() {
    let scratch = Scratch::new("checkpoint");
    saved_pair(&model(DType::Bf16, 24), scratch.path());
    // Another width (every parameter but the output bias changes shape) and another dtype
    // (every parameter changes): one line per parameter that differs.
    let saved = model(DType::Bf16, 24).spec().unwrap().params;
    for other in [model(DType::Bf16, 16), model(DType::F32, 24)] {
        let spec = other.spec().unwrap();
        let differing = spec
            .params
            .iter()
            .zip(&saved)
            .filter(|(a, b)| (&a.shape, a.dtype) != (&b.shape, b.dtype))
            .count();
        assert!(differing >= spec.params.len() - 1);
        let plan = Arc::new(Plan::new(&spec, 2).unwrap());
        for e in refused(&other, (&plan, &EngineConfig::default()), scratch.path()) {
            let Error::CheckpointMismatch { differences } = &e else {
                panic!("{e:?}");
            };
            assert_eq!(differences.len(), differing, "{e}");
            assert!(differences.iter().all(|d| d.contains("saved as")), "{e}");
        }
    }
    // Another optimizer.
    let mlp = model(DType::Bf16, 24);
    let plan = Arc::new(Plan::new(&mlp.spec().unwrap(), 2).unwrap());
    let sgd = EngineConfig {
        optimizer: OptimizerConfig::sgd(0.1),
        ..EngineConfig::default()
    };
    for e in refused(&mlp, (&plan, &sgd), scratch.path()) {
        assert!(
            e.to_string().contains("saved with adamw, loaded with sgd"),
            "{e}"
        );
    }
}

#[test]
fn a_save_never_overwrites_and_never_runs_mid_step() {
    for_each_mode_of_a_long_suite(|mode| {
        let mlp = model(DType::F32, 24);
        let scratch = Scratch::new("checkpoint");
        let dir = scratch.path().to_path_buf();
        let plan = Arc::new(Plan::new(&mlp.spec().unwrap(), 2).unwrap());
        let init = mlp.init(3);
        // Every rank's part is on disk before any rank loads (a rank's collectives may still
        // be queued on its streams when its calls return).
        let saved = Arc::new(Barrier::new(2));
        on_engines(&plan, &EngineConfig::default(), mode, move |mut e| {
            load(&mut e, &init).unwrap();
            e.save(&dir).unwrap();
            saved.wait();
            let again = e.save(&dir).unwrap_err();
            assert!(
                matches!(&again, Error::CheckpointExists { path } if path.contains("rank-")),
                "{again:?}"
            );
            e.pre_forward(Unit::Root).unwrap();
            let mid = e.save(&dir.join("later")).unwrap_err();
            assert!(matches!(mid, Error::MidStep { .. }), "{mid:?}");
            let mid = e.load(&dir).unwrap_err();
            assert!(matches!(mid, Error::MidStep { .. }), "{mid:?}");
            e.post_forward(Unit::Root).unwrap();
            e.end_step().unwrap();
            // At the boundary again: the first save loads.
            e.load(&dir).unwrap();
        });
        assert!(
            !scratch
                .path()
                .join("later")
                .join("rank-00000.json")
                .exists()
        );
    });
}

/// Every parameter's values as bytes in its dtype, assembled from each rank's shards.
fn values(plan: &Plan, ranks: &[Vec<Vec<u8>>]) -> Vec<Vec<u8>> {
    (0..plan.params().len())
        .map(|i| {
            let group = plan.params()[i].group();
            let shards: Vec<Vec<u8>> = ranks.iter().map(|r| r[group].clone()).collect();
            plan.assemble_param(fsdp_fusion::ParamId(i), &shards)
                .unwrap()
        })
        .collect()
}

/// Saves at `saved` ranks after 3 steps and loads at `loaded`: the values are exactly the saved
/// ones. Saved again there and loaded back at `saved` ranks, 3 more steps give exactly the
/// uninterrupted run's shards: masters and moments went through both reshardings unchanged.
fn reshard(mode: Mode, dtype: DType, sizes: (usize, usize)) {
    reshard_with(mode, dtype, sizes, EngineConfig::default());
}

fn reshard_with(mode: Mode, dtype: DType, (saved, loaded): (usize, usize), config: EngineConfig) {
    let mlp = model(dtype, 24);
    let plan = |world| Arc::new(Plan::new(&mlp.spec().unwrap(), world).unwrap());
    let (from, to) = (plan(saved), plan(loaded));
    let init = mlp.init(3);
    let (first, second) = (Scratch::new("checkpoint"), Scratch::new("checkpoint"));
    let (straight, at_save) =
        straight_and_saved_halfway((&mlp, &from, &config), mode, init, first.path());
    let (dir, again) = (first.path().to_path_buf(), second.path().to_path_buf());
    let at_load = train(
        (&mlp, &to, &config),
        mode,
        0..0,
        move |e| e.load(&dir).unwrap(),
        move |e| {
            e.save(&again).unwrap();
            shards(e)
        },
    );
    let what = format!("{dtype} saved by {saved}, loaded by {loaded}");
    assert_eq!(
        values(&to, &at_load),
        values(&from, &at_save),
        "{what}: values"
    );
    let dir = second.path().to_path_buf();
    let back = train(
        (&mlp, &from, &config),
        mode,
        3..6,
        move |e| e.load(&dir).unwrap(),
        shards,
    );
    assert_eq!(
        back, straight,
        "{what}, and back: not the uninterrupted run"
    );
}

#[test]
fn a_checkpoint_loads_at_every_other_world_size() {
    let worlds = [1, 2, 3, 4, 8];
    let mut cases: Vec<_> = worlds
        .iter()
        .flat_map(|&saved| worlds.map(|loaded| (DType::F32, (saved, loaded))))
        .collect();
    cases.extend([(DType::Bf16, (3, 8)), (DType::F16, (8, 1))]);
    on_threads(cases, |_, (dtype, sizes)| {
        reshard(Mode::Eager, dtype, sizes)
    });
}

#[test]
fn bf16_moments_save_load_and_reshard_exactly_and_refuse_f32_ones() {
    let bf16_moments = EngineConfig {
        moment_dtype: DType::Bf16,
        ..EngineConfig::default()
    };
    for sizes in [(1, 1), (2, 3), (4, 1)] {
        reshard_with(Mode::Eager, DType::Bf16, sizes, bf16_moments.clone());
    }
    let mlp = model(DType::F32, 24);
    let plan = Arc::new(Plan::new(&mlp.spec().unwrap(), 2).unwrap());
    let scratch = Scratch::new("checkpoint");
    let dir = scratch.path().to_path_buf();
    let init = mlp.init(3);
    let f32_moments = EngineConfig::default();
    train(
        (&mlp, &plan, &f32_moments),
        Mode::Eager,
        0..1,
        move |e| load(e, &init).unwrap(),
        {
            let dir = dir.clone();
            move |e| e.save(&dir).unwrap()
        },
    );
    on_engines(&plan, &bf16_moments, Mode::Eager, move |mut e| {
        match e.load(&dir) {
            Err(Error::CheckpointMismatch { differences }) => {
                assert_eq!(differences, ["moments saved in f32, loaded into bf16"]);
            }
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn resharding_holds_on_asynchronous_streams() {
    for_each_mode_of_a_long_suite(|mode| reshard(mode, DType::Bf16, (4, 3)));
}

/// Trains 3 steps at world size 1, exports; the file holds every parameter's values under its
/// name and shape (read back with the `safetensors` crate alone), and engines of every world
/// size importing it hold exactly those values.
fn export_and_import(mode: Mode, dtype: DType, storage: ParamStorage) {
    let mlp = model(dtype, 24);
    let plan = |world| Arc::new(Plan::new(&mlp.spec().unwrap(), world).unwrap());
    let one = plan(1);
    let config = EngineConfig {
        param_storage: storage,
        ..EngineConfig::default()
    };
    let init = mlp.init(3);
    let scratch = Scratch::new("checkpoint");
    std::fs::create_dir_all(scratch.path()).unwrap();
    let file = scratch.path().join("model.safetensors");
    let path = file.clone();
    let trained = train(
        (&mlp, &one, &config),
        mode,
        0..3,
        move |e| load(e, &init).unwrap(),
        move |e| {
            e.export_safetensors(&path).unwrap();
            match e.export_safetensors(&path) {
                Err(Error::CheckpointExists { .. }) => {}
                other => panic!("an export over a file: {other:?}"),
            }
            shards(e)
        },
    );
    let exported = values(&one, &trained);
    let bytes = std::fs::read(&file).unwrap();
    let read = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(read.len(), one.params().len());
    for (p, values) in one.params().iter().zip(&exported) {
        let t = read.tensor(p.name()).unwrap();
        let shape: Vec<u64> = t.shape().iter().map(|&d| d as u64).collect();
        assert_eq!(shape, p.shape(), "{}", p.name());
        assert_eq!(t.data(), &values[..], "{}", p.name());
    }
    for world in [1, 2, 3, 4, 8] {
        let path = file.clone();
        let imported = train(
            (&mlp, &plan(world), &config),
            mode,
            0..0,
            move |e| e.import_safetensors(&path).unwrap(),
            shards,
        );
        assert_eq!(
            values(&plan(world), &imported),
            exported,
            "{dtype} {storage:?} imported at world size {world}"
        );
    }
}

#[test]
fn a_model_exported_as_safetensors_imports_exactly_at_every_world_size() {
    export_and_import(Mode::Eager, DType::F32, ParamStorage::ShardAndMaster);
    export_and_import(Mode::Eager, DType::Bf16, ParamStorage::ShardAndMaster);
    export_and_import(Mode::Eager, DType::F16, ParamStorage::MasterOnly);
    for_each_mode_of_a_long_suite(|mode| {
        export_and_import(mode, DType::Bf16, ParamStorage::MasterOnly)
    });
}

#[test]
fn an_import_of_another_model_lists_every_difference_and_loads_nothing() {
    let scratch = Scratch::new("checkpoint");
    std::fs::create_dir_all(scratch.path()).unwrap();
    let file = scratch.path().join("narrow.safetensors");
    let narrow = model(DType::F32, 12);
    let plan = Arc::new(Plan::new(&narrow.spec().unwrap(), 1).unwrap());
    let path = file.clone();
    let config = EngineConfig::default();
    train(
        (&narrow, &plan, &config),
        Mode::Eager,
        0..0,
        move |e| e.export_safetensors(&path).unwrap(),
        |_| (),
    );
    for (other, what) in [
        (model(DType::F32, 24), "shape"),
        (model(DType::Bf16, 12), "F32"),
    ] {
        let plan = Arc::new(Plan::new(&other.spec().unwrap(), 2).unwrap());
        let path = file.clone();
        let what = what.to_string();
        on_engines(&plan, &config, Mode::Eager, move |mut e| {
            let before = shards(&mut e);
            match e.import_safetensors(&path) {
                Err(Error::CheckpointMismatch { differences }) => {
                    assert!(!differences.is_empty());
                    assert!(
                        differences.iter().any(|d| d.contains(&what)),
                        "{differences:?}"
                    );
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(shards(&mut e), before, "a refused import changed nothing");
            let elsewhere = path.with_extension("sharded");
            match e.export_safetensors(&elsewhere) {
                Err(Error::Unsupported { what, .. }) => assert!(what.contains("world size 1")),
                other => panic!("an export at world size 2: {other:?}"),
            }
            assert!(!elsewhere.exists());
        });
    }
    // A file that is not safetensors, a missing one, and one whose header's tensors tile more
    // than 2^64 - 8 bytes after it, are refused by name.
    let garbage = scratch.path().join("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file at all").unwrap();
    let huge = scratch.path().join("huge.safetensors");
    let n = (u64::MAX - 7) / 8;
    let tensors: Vec<String> = (0..8)
        .map(|i| {
            format!(
                "\"t{i}\":{{\"dtype\":\"U8\",\"shape\":[{n}],\"data_offsets\":[{},{}]}}",
                i * n,
                (i + 1) * n
            )
        })
        .collect();
    let header = format!("{{{}}}", tensors.join(","));
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    std::fs::write(&huge, bytes).unwrap();
    on_engines(&plan, &config, Mode::Eager, move |mut e| {
        for path in [
            huge.clone(),
            garbage.clone(),
            garbage.with_extension("missing"),
        ] {
            match e.import_safetensors(&path) {
                Err(Error::CheckpointUnreadable {
                    path: named,
                    reason,
                }) => {
                    assert_eq!(named, path.display().to_string());
                    assert!(path != huge || reason.contains("over 2^64"), "{reason}");
                }
                other => panic!("{other:?}"),
            }
        }
    });
}

#[test]
fn a_checkpoint_of_any_world_size_exports_what_the_engines_hold() {
    for (dtype, storage) in [
        (DType::F32, ParamStorage::ShardAndMaster),
        (DType::Bf16, ParamStorage::ShardAndMaster),
        (DType::Bf16, ParamStorage::MasterOnly),
    ] {
        let mlp = model(dtype, 24);
        let config = EngineConfig {
            param_storage: storage,
            ..EngineConfig::default()
        };
        let scratch = Scratch::new("checkpoint");
        for world in [1, 2, 3, 4, 8] {
            let plan = Arc::new(Plan::new(&mlp.spec().unwrap(), world).unwrap());
            let dir = scratch.path().join(format!("saved-{world}"));
            let direct = scratch.path().join(format!("direct-{world}.safetensors"));
            let (to_save, to_export) = (dir.clone(), direct.clone());
            let init = mlp.init(3);
            let trained = train(
                (&mlp, &plan, &config),
                Mode::Eager,
                0..3,
                move |e| load(e, &init).unwrap(),
                move |e| {
                    e.save(&to_save).unwrap();
                    if e.plan().world_size() == 1 {
                        e.export_safetensors(&to_export).unwrap();
                    }
                    shards(e)
                },
            );
            let file = scratch
                .path()
                .join(format!("converted-{world}.safetensors"));
            fsdp_fusion::export::export_checkpoint(&dir, &file).unwrap();
            let what = format!("{dtype} {storage:?} saved at world size {world}");
            let bytes = std::fs::read(&file).unwrap();
            let read = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (p, values) in plan.params().iter().zip(values(&plan, &trained)) {
                assert_eq!(read.tensor(p.name()).unwrap().data(), &values[..], "{what}");
            }
            if world == 1 {
                assert_eq!(
                    bytes,
                    std::fs::read(&direct).unwrap(),
                    "{what}: the engine's export"
                );
            }
            match fsdp_fusion::export::export_checkpoint(&dir, &file) {
                Err(Error::CheckpointExists { .. }) => {}
                other => panic!("{what}: over an export: {other:?}"),
            }
        }
    }
    // An incomplete checkpoint (a rank's manifest gone) is refused by name, and nothing written.
    let mlp = model(DType::F32, 24);
    let plan = Arc::new(Plan::new(&mlp.spec().unwrap(), 2).unwrap());
    let scratch = Scratch::new("checkpoint");
    let dir = scratch.path().to_path_buf();
    let init = mlp.init(3);
    let config = EngineConfig::default();
    train(
        (&mlp, &plan, &config),
        Mode::Eager,
        0..1,
        move |e| load(e, &init).unwrap(),
        {
            let dir = dir.clone();
            move |e| e.save(&dir).unwrap()
        },
    );
    std::fs::remove_file(scratch.path().join("rank-00001.json")).unwrap();
    let file = scratch.path().join("model.safetensors");
    match fsdp_fusion::export::export_checkpoint(scratch.path(), &file) {
        Err(Error::CheckpointUnreadable { path, .. }) => assert!(path.ends_with("rank-00001.json")),
        other => panic!("{other:?}"),
    }
    assert!(!file.exists());
}

#[test]
fn the_training_harness_saves_and_resumes_where_the_reference_is() {
    within_deadline("the harness's save and resume", || {
        // What the main job's --save and --resume do: 3 steps and a save, then steps 3..6 from it,
        // compared with a reference that ran all 6 from the start.
        let mlp = model(DType::Bf16, 24);
        let plan = Arc::new(Plan::new(&mlp.spec().unwrap(), 3).unwrap());
        let config = EngineConfig::default();
        let init = mlp.init(3);
        let training = |steps| Training {
            model: &mlp,
            plan: &plan,
            config: &config,
            init: &init,
            steps,
            passes: PASSES,
            recipe: recipe(),
        };
        let straight = std::cell::RefCell::new(Vec::new());
        training(6)
            .compare_on_cpu(|_, c| {
                straight.borrow_mut().push(*c);
                Ok(())
            })
            .unwrap();
        let scratch = Scratch::new("checkpoint");
        let saving = Checkpoints {
            resume: None,
            save: Some(scratch.path()),
        };
        let ranks = || {
            fsdp_fusion::LocalComm::group(3)
                .unwrap()
                .into_iter()
                .map(|c| (fsdp_fusion::CpuBackend::new(), c))
                .collect()
        };
        training(3)
            .compare_with(ranks(), saving, |_, _| Ok(()))
            .unwrap();
        let resuming = Checkpoints {
            resume: Some(scratch.path()),
            save: None,
        };
        let mut resumed = Vec::new();
        training(6)
            .compare_with(ranks(), resuming, |step, c| {
                resumed.push((step, *c));
                Ok(())
            })
            .unwrap();
        let straight = straight.into_inner();
        assert_eq!(resumed.iter().map(|r| r.0).collect::<Vec<_>>(), [3, 4, 5]);
        for (step, c) in resumed {
            assert_eq!(c, straight[step as usize], "step {step}");
            assert_eq!(c.difference, 0.0);
        }
    });
}

#[test]
fn an_asynchronous_save_writes_the_state_of_its_call_while_training_goes_on() {
    for_each_mode_of_a_long_suite(|mode| {
        for (world, save_staging) in [(1, false), (3, false), (2, true)] {
            let mlp = model(DType::Bf16, 24);
            let plan = Arc::new(Plan::new(&mlp.spec().unwrap(), world).unwrap());
            let config = EngineConfig {
                save_staging,
                ..EngineConfig::default()
            };
            let scratch = Scratch::new("checkpoint");
            let (blocking, background) = (
                scratch.path().join("blocking"),
                scratch.path().join("async"),
            );
            let (b, a) = (blocking.clone(), background.clone());
            let init = mlp.init(3);
            let trained = mlp.clone();
            on_engines(&plan, &config, mode, move |mut e| {
                load(&mut e, &init).unwrap();
                let lr = e.config().optimizer.lr();
                for step in 0..3 {
                    sharded_step(&trained, &mut e, (step, PASSES), lr, recipe()).unwrap();
                }
                e.save(&b).unwrap();
                e.save_async(&a).unwrap();
                // One save is written at a time; a blocking one into the same place waits too.
                for refused in [e.save_async(&scratch_other(&a)), e.save(&a)] {
                    assert!(
                        matches!(refused, Err(Error::SavePending { .. })),
                        "{refused:?}"
                    );
                }
                // Training goes on while the files are written; they hold the call's state.
                for step in 3..5 {
                    sharded_step(&trained, &mut e, (step, PASSES), lr, recipe()).unwrap();
                }
                e.wait_save().unwrap();
                assert!(!e.save_pending());
                e.wait_save().unwrap();
            });
            for rank in 0..world {
                let what = format!("{mode:?} world {world} rank {rank}");
                let data = fsdp_fusion::checkpoint::data_path;
                let same = std::fs::read(data(&background, rank)).unwrap()
                    == std::fs::read(data(&blocking, rank)).unwrap();
                assert!(same, "{what}: the data files differ");
                let manifest = |dir| fsdp_fusion::checkpoint::read_manifest(dir, rank).unwrap();
                let (mut a, b) = (manifest(&background), manifest(&blocking));
                assert_ne!(a.save_id, b.save_id, "{what}: two saves of one id");
                a.save_id = b.save_id.clone();
                assert_eq!(a, b, "{what}");
            }
        }
    });
}

/// A `wait_save` that runs out of time while the files are still being written fails, the
/// save still pending and nothing removed: a later `wait_save` gives its outcome, the whole
/// checkpoint, which loads.
#[test]
fn a_wait_for_files_still_being_written_leaves_the_save_pending_and_whole() {
    let mlp = model(DType::F32, 256);
    let plan = Arc::new(Plan::new(&mlp.spec().unwrap(), 1).unwrap());
    // Shorter than any write of the state and its flush to disk: the first wait runs out.
    let config = EngineConfig {
        timeout: std::time::Duration::from_nanos(1),
        ..EngineConfig::default()
    };
    let scratch = Scratch::new("checkpoint");
    let dir = scratch.path().join("slow");
    let to = dir.clone();
    let init = mlp.init(3);
    let shards = on_engines(&plan, &config, Mode::Eager, move |mut e| {
        load(&mut e, &init).unwrap();
        e.save_async(&to).unwrap();
        let waited = e.wait_save();
        assert!(
            matches!(&waited, Err(Error::Timeout { op, .. }) if op.contains("stays pending")),
            "{waited:?}"
        );
        assert!(matches!(e.save(&to), Err(Error::SavePending { .. })));
        while e.save_pending() {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        e.wait_save().unwrap();
        e.wait_save().unwrap();
        (0..e.plan().groups().len())
            .map(|g| e.param_shard(g).unwrap())
            .collect::<Vec<_>>()
    });
    let config = EngineConfig::default();
    let loaded = on_engines(&plan, &config, Mode::Eager, move |mut e| {
        e.load(&dir).unwrap();
        (0..e.plan().groups().len())
            .map(|g| e.param_shard(g).unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(loaded, shards);
}

fn scratch_other(dir: &Path) -> PathBuf {
    dir.with_extension("other")
}

#[test]
fn every_rank_gathers_the_whole_groups_it_holds_a_part_of() {
    for_each_mode_of_a_long_suite(|mode| {
        for storage in [ParamStorage::ShardAndMaster, ParamStorage::MasterOnly] {
            for world in [1, 2, 3, 4] {
                let mlp = model(DType::Bf16, 24);
                let plan = Arc::new(Plan::new(&mlp.spec().unwrap(), world).unwrap());
                let config = EngineConfig {
                    param_storage: storage,
                    ..EngineConfig::default()
                };
                let init = mlp.init(3);
                let trained = mlp.clone();
                let ranks = on_engines(&plan, &config, mode, move |mut e| {
                    load(&mut e, &init).unwrap();
                    let lr = e.config().optimizer.lr();
                    for step in 0..2 {
                        sharded_step(&trained, &mut e, (step, PASSES), lr, recipe()).unwrap();
                    }
                    let held = shards(&mut e);
                    let groups: Vec<Vec<u8>> = (0..e.plan().groups().len())
                        .map(|g| e.gather_group(g).unwrap())
                        .collect();
                    // Training goes on after the gathers.
                    sharded_step(&trained, &mut e, (2, PASSES), lr, recipe()).unwrap();
                    (held, groups)
                });
                let shards: Vec<Vec<Vec<u8>>> = ranks.iter().map(|r| r.0.clone()).collect();
                for (p, values) in plan.params().iter().zip(values(&plan, &shards)) {
                    let size = p.dtype().size();
                    for (rank, (_, groups)) in ranks.iter().enumerate() {
                        let whole = &groups[p.group()];
                        let mine = &whole[p.offset() * size..(p.offset() + p.numel()) * size];
                        assert_eq!(
                            mine,
                            &values[..],
                            "{mode:?} {storage:?} world {world} rank {rank}"
                        );
                    }
                }
            }
        }
    });
}
