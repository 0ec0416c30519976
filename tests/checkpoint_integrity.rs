//! What a checkpoint must never do, each on CPU ranks of world sizes 1 to 4, eager and on
//! asynchronous streams: save stale state (a master not yet widened from loaded weights), round
//! the fp32 state of parameters nobody loaded, trust a manifest whose fields or text were
//! changed, write through a file or symlink it did not create or leave temporaries behind, let
//! ranks disagree about a load, take two saves' files for one, or write into the wrong place.
//! Every refusal names the file and field and changes nothing on any rank.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use fsdp_fusion::checkpoint::{self, DataReader, RankManifest, SectionKind};
use fsdp_fusion::{DType, EngineConfig, Error, Input, Plan};
use fsdp_fusion_support::mlp::{Mlp, MlpConfig, Recipe, load, sharded_step};
use fsdp_fusion_support::ranks::{CpuEngine, Mode, for_each_mode, modes, on_engines};
use fsdp_fusion_support::scratch::Scratch;
use fsdp_fusion_support::values::{narrow, widen};

fn model(dtype: DType) -> Mlp {
    model_of(dtype, 24)
}

fn model_of(dtype: DType, width: usize) -> Mlp {
    Mlp::new(MlpConfig::small(dtype, width))
}

fn plan(mlp: &Mlp, world: usize) -> Arc<Plan> {
    Arc::new(Plan::new(&mlp.spec().unwrap(), world).unwrap())
}

/// Every group's shard, as bytes.
fn shards(e: &CpuEngine) -> Vec<Vec<u8>> {
    (0..e.plan().groups().len())
        .map(|g| e.param_shard(g).unwrap())
        .collect()
}

/// Trains `steps` steps of `mlp` from its initial values on every rank, then runs `after`.
fn trained<R: Send + 'static>(
    mlp: &Mlp,
    plan: &Arc<Plan>,
    mode: Mode,
    steps: u64,
    after: impl Fn(&mut CpuEngine) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let (mlp, init) = (mlp.clone(), mlp.init(3));
    let config = EngineConfig::default();
    let lr = config.optimizer.lr();
    on_engines(plan, &config, mode, move |mut e| {
        load(&mut e, &init).unwrap();
        for step in 0..steps {
            sharded_step(&mlp, &mut e, (step, 2), lr, Recipe::default()).unwrap();
        }
        after(&mut e)
    })
}

/// Every rank's shards once loaded from the checkpoint in `dir`.
fn loaded_from(plan: &Arc<Plan>, mode: Mode, dir: &Path) -> Vec<Vec<Vec<u8>>> {
    let dir = dir.to_path_buf();
    on_engines(plan, &EngineConfig::default(), mode, move |mut e| {
        e.load(&dir).unwrap();
        shards(&e)
    })
}

/// Each parameter's saved values (of a trainable bf16/f16 parameter, its fp32 master), read
/// with the checkpoint module's own reader.
fn saved_params(dir: &Path) -> Vec<Vec<u8>> {
    let saved = checkpoint::read_saved(dir).unwrap();
    let mut readers: Vec<_> = (0..saved.world_size())
        .map(|r| DataReader::open(&saved, r).unwrap())
        .collect();
    (0..saved.numels.len())
        .map(|i| {
            let group = saved.manifests[0].params[i].group;
            let kind = match saved.section(group, SectionKind::Values) {
                Some(_) => SectionKind::Values,
                None => SectionKind::Master,
            };
            let size = saved.dtype_of(&saved.groups[group], kind).size();
            let mut out = vec![0u8; saved.numels[i] * size];
            for run in saved.runs(i, kind, 0, 0..saved.numels[i]).unwrap() {
                let bytes = &mut out[run.elements.start * size..run.elements.end * size];
                readers[run.rank].read(run.offset, bytes).unwrap();
            }
            out
        })
        .collect()
}

/// Whether `e`, the error of a collective call on one rank, is the refusal of the file whose
/// path ends with `file`: the rank's own, or a peer's.
fn names_file(e: &Error, file: &str) -> bool {
    names_file_with(e, file, "")
}

/// As [`names_file`], for a refusal whose reason holds `reason`.
fn names_file_with(e: &Error, file: &str, reason_part: &str) -> bool {
    match e {
        Error::CheckpointUnreadable { path, reason } => {
            path.ends_with(file) && reason.contains(reason_part)
        }
        Error::PeerRefused { cause, .. } => names_file_with(cause, file, reason_part),
        _ => false,
    }
}

#[test]
fn a_save_right_after_loading_weights_holds_them() {
    for_each_mode(|mode| {
        for dtype in [DType::Bf16, DType::F16] {
            let mlp = model(dtype);
            for world in 1..=4 {
                for background in [false, true] {
                    let what = format!("{mode:?} {dtype} world {world} background {background}");
                    let scratch = Scratch::new("fresh-save");
                    let dir = scratch.path().to_path_buf();
                    let plan = plan(&mlp, world);
                    let loaded = trained(&mlp, &plan, mode, 0, move |e| {
                        match background {
                            true => e.save_async(&dir).and_then(|()| e.wait_save()),
                            false => e.save(&dir),
                        }
                        .unwrap();
                        shards(e)
                    });
                    assert!(
                        loaded.iter().flatten().flatten().any(|&b| b != 0),
                        "{what}: nothing loaded"
                    );
                    let resumed = loaded_from(&plan, mode, scratch.path());
                    assert_eq!(resumed, loaded, "{what}");
                }
            }
        }
    });
}

#[test]
fn an_imported_model_saved_before_any_step_loads_as_imported() {
    for_each_mode(|mode| {
        let mlp = model(DType::Bf16);
        let scratch = Scratch::new("import-save");
        std::fs::create_dir_all(scratch.path()).unwrap();
        let file = scratch.join("model.safetensors");
        let export = file.clone();
        trained(&mlp, &plan(&mlp, 1), mode, 0, move |e| {
            e.export_safetensors(&export).unwrap()
        });
        for world in [2, 3] {
            let plan = plan(&mlp, world);
            let dir = scratch.join(&format!("saved-{world}"));
            let (file, to) = (file.clone(), dir.clone());
            let config = EngineConfig::default();
            let imported = on_engines(&plan, &config, mode, move |mut e| {
                e.import_safetensors(&file).unwrap();
                e.save(&to).unwrap();
                shards(&e)
            });
            let resumed = loaded_from(&plan, mode, &dir);
            assert_eq!(resumed, imported, "{mode:?} world {world}");
        }
    });
}

#[test]
fn loading_one_parameter_keeps_the_fp32_state_of_the_others() {
    for_each_mode(|mode| {
        let mlp = model(DType::Bf16);
        for world in [1, 2] {
            let scratch = Scratch::new("one-param");
            let (before, after) = (scratch.join("before"), scratch.join("after"));
            let (b, a) = (before.clone(), after.clone());
            let replaced = "layers.1.weight";
            let spec = mlp.spec().unwrap();
            let index = spec.params.iter().position(|p| p.name == replaced).unwrap();
            let numel = spec.params[index].numel().unwrap();
            let values: Vec<f32> = (0..numel).map(|i| i as f32 / 64.0 - 3.0).collect();
            let loaded = values.clone();
            let model = mlp.clone();
            trained(&mlp, &plan(&mlp, world), mode, 3, move |e| {
                e.save(&b).unwrap();
                let id = e.plan().param_id(replaced).unwrap();
                let bytes = narrow(DType::Bf16, &loaded);
                e.load_param(id, Input::host_bytes(&bytes, DType::Bf16))
                    .unwrap();
                // A step that moves nothing (learning rate 0) widens no master again.
                sharded_step(&model, e, (3, 2), 0.0, Recipe::default()).unwrap();
                e.save(&a).unwrap();
            });
            let (old, new) = (saved_params(&before), saved_params(&after));
            let names = mlp.spec().unwrap().params;
            for (i, p) in names.iter().enumerate() {
                let what = format!("{mode:?} world {world} {}", p.name);
                if p.name == replaced {
                    let wide: Vec<f32> = bytemuck::cast_slice(&new[i]).to_vec();
                    let rounded = fsdp_fusion_support::values::widen(
                        DType::Bf16,
                        &narrow(DType::Bf16, &values),
                    );
                    assert_eq!(wide, rounded, "{what}: the loaded value, widened");
                } else {
                    assert_eq!(new[i], old[i], "{what}: its master was rounded");
                }
            }
        }
    });
}

/// A 3-rank checkpoint of the bf16 model after two steps in `dir`, and the shards it holds.
fn saved_three(dir: &Path) -> (Mlp, Arc<Plan>) {
    let mlp = model(DType::Bf16);
    let plan = plan(&mlp, 3);
    let to = dir.to_path_buf();
    trained(&mlp, &plan, Mode::Eager, 2, move |e| e.save(&to).unwrap());
    (mlp, plan)
}

/// Loads `dir` on engines of `plan` holding the initial values: every rank's outcome, with
/// whether its shards stayed as they were.
fn load_outcomes(
    mlp: &Mlp,
    plan: &Arc<Plan>,
    mode: Mode,
    dir: &Path,
) -> Vec<(Result<(), Error>, bool)> {
    let dir = dir.to_path_buf();
    trained(mlp, plan, mode, 0, move |e| {
        let before = shards(e);
        let outcome = e.load(&dir);
        let unchanged = shards(e) == before;
        (outcome, unchanged)
    })
}

/// Rewrites rank `rank`'s manifest in `dir` with `change` applied, under a valid checksum.
fn rewrite(dir: &Path, rank: usize, change: impl FnOnce(&mut RankManifest)) {
    let mut m = checkpoint::read_manifest(dir, rank).unwrap();
    change(&mut m);
    std::fs::write(checkpoint::manifest_path(dir, rank), m.encode().unwrap()).unwrap();
}

#[test]
fn a_manifest_changed_in_any_field_is_refused_on_every_rank_by_file_and_field() {
    type Change = Box<dyn Fn(&mut RankManifest)>;
    let cases: Vec<(&str, usize, Change, &str)> = vec![
        (
            "a digit of an offset",
            1,
            Box::new(|m| m.sections[1].offset += 10),
            "sections[1]",
        ),
        (
            "two equal-sized sections swapped",
            2,
            Box::new(|m| {
                let (a, b) = (m.sections[1].offset, m.sections[2].offset);
                m.sections[1].offset = b;
                m.sections[2].offset = a;
            }),
            "sections[1]",
        ),
        (
            "a huge shape",
            0,
            Box::new(|m| m.params[0].shape = vec![u64::MAX / 2, 4]),
            "params[0].shape",
        ),
        (
            "a huge offset",
            0,
            Box::new(|m| m.params[1].offset = usize::MAX - 7),
            "params[1].offset",
        ),
        (
            "a longer data file",
            2,
            Box::new(|m| m.data_bytes += 4),
            "data_bytes",
        ),
        (
            "another world size",
            1,
            Box::new(|m| m.world_size = 4),
            "world_size",
        ),
        (
            "another step",
            2,
            Box::new(|m| m.optimizer_steps += 1),
            "optimizer_steps",
        ),
        (
            "a chunk digest",
            1,
            Box::new(|m| m.chunk_xxh3[0] = "0123456789abcdef".into()),
            "corrupted: chunk 0",
        ),
    ];
    let modes = modes();
    for (i, (what, rank, change, field)) in cases.into_iter().enumerate() {
        let scratch = Scratch::new("tampered");
        let (mlp, plan) = saved_three(scratch.path());
        rewrite(scratch.path(), rank, change);
        let file = format!(
            "rank-{rank:05}.{}",
            if what == "a chunk digest" {
                "bin"
            } else {
                "json"
            }
        );
        let mode = modes[i % modes.len()];
        for (r, (outcome, unchanged)) in load_outcomes(&mlp, &plan, mode, scratch.path())
            .into_iter()
            .enumerate()
        {
            let e = outcome.expect_err(what);
            assert!(unchanged, "{what}: rank {r} changed");
            assert!(names_file(&e, &file), "{what}: rank {r}: {e}");
            assert!(e.to_string().contains(field), "{what}: rank {r}: {e}");
        }
        let out = scratch.join("model.safetensors");
        let exported = fsdp_fusion::export::export_checkpoint(scratch.path(), &out);
        let e = exported.expect_err(what);
        assert!(names_file(&e, &file), "{what}: the export: {e}");
        assert!(!out.exists(), "{what}: an export was written");
    }
}

/// A checkpoint at the largest step count (a manifest under a valid checksum) loads, and the steps
/// after it keep that count rather than wrapping to step 0, whose bias correction is 0.
#[test]
fn steps_after_a_checkpoint_at_the_largest_step_count_keep_it() {
    let scratch = Scratch::new("largest-step");
    let (mlp, plan) = saved_three(scratch.path());
    for rank in 0..plan.world_size() {
        rewrite(scratch.path(), rank, |m| m.optimizer_steps = u64::MAX);
    }
    let lr = EngineConfig::default().optimizer.lr();
    for (i, mode) in modes().into_iter().enumerate() {
        let (from, to) = (
            scratch.path().to_path_buf(),
            scratch.join(&format!("after-{i}")),
        );
        let (stepping, saved) = (mlp.clone(), to.clone());
        let stepped = trained(&mlp, &plan, mode, 0, move |e| {
            e.load(&from)?;
            for step in 0..2 {
                sharded_step(&stepping, e, (step, 2), lr, Recipe::default())?;
            }
            e.save(&to)?;
            let dtypes = e.plan().groups().iter().map(|g| g.dtype());
            Ok::<_, Error>(dtypes.zip(shards(e)).collect::<Vec<_>>())
        });
        for (rank, outcome) in stepped.into_iter().enumerate() {
            let shards = outcome.unwrap_or_else(|e| panic!("{mode:?}, rank {rank}: {e}"));
            for (dtype, shard) in shards {
                let values = widen(dtype, &shard);
                assert!(
                    values.iter().all(|v| v.is_finite()),
                    "{mode:?}, rank {rank}: {values:?}"
                );
            }
            let m = checkpoint::read_manifest(&saved, rank).unwrap();
            assert_eq!(m.optimizer_steps, u64::MAX, "{mode:?}, rank {rank}");
        }
    }
}

#[test]
fn a_manifest_whose_text_changed_is_refused_by_its_checksum() {
    let scratch = Scratch::new("edited");
    let (mlp, plan) = saved_three(scratch.path());
    let path = checkpoint::manifest_path(scratch.path(), 1);
    let text = std::fs::read_to_string(&path).unwrap();
    // Rank 0's learning rate is the one a load takes: only a checksum sees rank 1's change.
    let key = "\"lr\": 0.";
    assert!(text.contains(key), "{text}");
    std::fs::write(&path, text.replacen(key, "\"lr\": 1.", 1)).unwrap();
    for (outcome, unchanged) in load_outcomes(&mlp, &plan, Mode::Eager, scratch.path()) {
        let e = outcome.unwrap_err();
        assert!(unchanged);
        assert!(names_file(&e, "rank-00001.json"), "{e}");
        assert!(e.to_string().contains("the manifest was changed"), "{e}");
    }
    let out = scratch.join("model.safetensors");
    let e = fsdp_fusion::export::export_checkpoint(scratch.path(), &out).unwrap_err();
    assert!(names_file(&e, "rank-00001.json"), "{e}");
}

#[test]
fn a_damaged_file_refuses_the_load_on_every_rank_of_every_world_size() {
    for_each_mode(|mode| {
        let mlp = model(DType::Bf16);
        let scratch = Scratch::new("damaged");
        let saved = plan(&mlp, 4);
        let to = scratch.path().to_path_buf();
        trained(&mlp, &saved, mode, 1, move |e| e.save(&to).unwrap());
        let data = checkpoint::data_path(scratch.path(), 2);
        let mut bytes = std::fs::read(&data).unwrap();
        bytes[100] ^= 0x40;
        std::fs::write(&data, bytes).unwrap();
        for world in 1..=4 {
            let outcomes = load_outcomes(&mlp, &plan(&mlp, world), mode, scratch.path());
            let mut own = 0;
            for (r, (outcome, unchanged)) in outcomes.into_iter().enumerate() {
                let what = format!("{mode:?} world {world} rank {r}");
                let e = outcome.expect_err(&what);
                assert!(unchanged, "{what}: changed");
                assert!(names_file(&e, "rank-00002.bin"), "{what}: {e}");
                match e {
                    Error::CheckpointUnreadable { .. } => own += 1,
                    Error::PeerRefused { rank, .. } => assert_ne!(rank, r, "{what}"),
                    other => panic!("{what}: {other:?}"),
                }
            }
            assert!(own >= 1, "world {world}: no rank found the damage itself");
        }
    });
}

#[test]
fn a_damaged_file_refuses_the_load_on_every_rank_of_a_hybrid_grid_and_expert_groups() {
    use fsdp_fusion::comm::hybrid::Hybrid;
    use fsdp_fusion::{CpuBackend, Engine, LocalComm};
    // Hybrid: 2 replicas of 2 shards; only the first replica's ranks write.
    let mlp = model(DType::Bf16);
    let scratch = Scratch::new("damaged-grid");
    let grid = Arc::new(Plan::hybrid(&mlp.spec().unwrap(), 2, 2).unwrap());
    let run = |dir: PathBuf, damage: bool| {
        let grid = Arc::clone(&grid);
        let init = mlp.init(3);
        let comms = Hybrid::grid(2, 2, LocalComm::group).unwrap();
        fsdp_fusion_support::ranks::within_deadline("a hybrid grid", move || {
            fsdp_fusion_support::ranks::on_threads(comms, |_, comm| {
                let config = EngineConfig::default();
                let mut e =
                    Engine::new(Arc::clone(&grid), config, CpuBackend::new(), comm).unwrap();
                load(&mut e, &init).unwrap();
                match damage {
                    false => e.save(&dir).map(|()| true),
                    true => {
                        let before: Vec<_> = (0..e.plan().groups().len())
                            .map(|g| e.param_shard(g).unwrap())
                            .collect();
                        let outcome = e.load(&dir);
                        let after: Vec<_> = (0..e.plan().groups().len())
                            .map(|g| e.param_shard(g).unwrap())
                            .collect();
                        outcome.map(|()| before == after)
                    }
                }
            })
        })
    };
    assert!(
        run(scratch.path().to_path_buf(), false)
            .into_iter()
            .all(|r| r.unwrap())
    );
    let data = checkpoint::data_path(scratch.path(), 1);
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[7] ^= 1;
    std::fs::write(&data, bytes).unwrap();
    for (r, outcome) in run(scratch.path().to_path_buf(), true)
        .into_iter()
        .enumerate()
    {
        let e = outcome.expect_err("a damaged hybrid checkpoint loaded");
        assert!(names_file(&e, "rank-00001.bin"), "grid rank {r}: {e}");
    }
    // Expert groups: 4 ranks, experts sharded over pairs.
    let experts = Mlp::with_experts(MlpConfig::small(DType::Bf16, 24), 2);
    let scratch = Scratch::new("damaged-experts");
    let four = plan(&experts, 4);
    let to = scratch.path().to_path_buf();
    trained(&experts, &four, Mode::Eager, 1, move |e| {
        e.save(&to).unwrap()
    });
    let data = checkpoint::data_path(scratch.path(), 3);
    let mut bytes = std::fs::read(&data).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&data, bytes).unwrap();
    for (r, (outcome, unchanged)) in load_outcomes(&experts, &four, Mode::Eager, scratch.path())
        .into_iter()
        .enumerate()
    {
        let e = outcome.expect_err("a damaged expert checkpoint loaded");
        assert!(unchanged);
        assert!(names_file(&e, "rank-00003.bin"), "rank {r}: {e}");
    }
}

#[test]
fn rank_files_of_two_saves_never_load_as_one() {
    let mlp = model(DType::Bf16);
    let plan = plan(&mlp, 2);
    let scratch = Scratch::new("two-saves");
    let (a, b) = (scratch.join("a"), scratch.join("b"));
    let (to_a, to_b) = (a.clone(), b.clone());
    // Two runs at the same step and layout, of other values.
    trained(&mlp, &plan, Mode::Eager, 2, move |e| e.save(&to_a).unwrap());
    let other = model(DType::Bf16);
    let init = other.init(9);
    let to = to_b.clone();
    on_engines(
        &plan,
        &EngineConfig::default(),
        Mode::Eager,
        move |mut e| {
            load(&mut e, &init).unwrap();
            for step in 0..2 {
                sharded_step(&other, &mut e, (step, 2), 1e-3, Recipe::default()).unwrap();
            }
            e.save(&to).unwrap();
        },
    );
    for path in [checkpoint::manifest_path, checkpoint::data_path] {
        std::fs::copy(path(&b, 1), path(&a, 1)).unwrap();
    }
    for (r, (outcome, unchanged)) in load_outcomes(&mlp, &plan, Mode::Eager, &a)
        .into_iter()
        .enumerate()
    {
        let e = outcome.unwrap_err();
        assert!(unchanged);
        assert!(names_file(&e, "rank-00001.json"), "rank {r}: {e}");
        assert!(e.to_string().contains("field `save_id`"), "rank {r}: {e}");
    }
    let e = fsdp_fusion::export::export_checkpoint(&a, &scratch.join("model.safetensors"));
    assert!(e.is_err_and(|e| e.to_string().contains("save_id")));
}

/// Each rank loading its own directory (node-local copies): copies of one save load as the
/// checkpoint itself does; two saves, though every rank's files check out, are refused on
/// every rank alike, naming both saves' ids, and change nothing.
#[test]
fn ranks_loading_node_local_copies_of_two_saves_refuse_alike() {
    let mlp = model(DType::Bf16);
    let plan = plan(&mlp, 2);
    let scratch = Scratch::new("node-local");
    let (a, b, copy) = (scratch.join("a"), scratch.join("b"), scratch.join("copy"));
    let (to_a, to_b) = (a.clone(), b.clone());
    trained(&mlp, &plan, Mode::Eager, 1, move |e| e.save(&to_a).unwrap());
    trained(&mlp, &plan, Mode::Eager, 2, move |e| e.save(&to_b).unwrap());
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(&a).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
    }
    let id = |dir: &Path| checkpoint::read_manifest(dir, 0).unwrap().save_id;
    let (id_a, id_b) = (id(&a), id(&b));
    for_each_mode(|mode| {
        let from_a = loaded_from(&plan, mode, &a);
        let (a, copy) = (a.clone(), copy.clone());
        let copies = trained(&mlp, &plan, mode, 0, move |e| {
            let dir = if e.rank() == 0 { &a } else { &copy };
            e.load(dir).unwrap();
            shards(e)
        });
        assert_eq!(copies, from_a, "{mode:?}");
        let (a, b) = (scratch.join("a"), b.clone());
        let outcomes = trained(&mlp, &plan, mode, 0, move |e| {
            let dir = if e.rank() == 0 { &a } else { &b };
            let before = shards(e);
            let outcome = e.load(dir);
            (outcome, shards(e) == before)
        });
        for (r, (outcome, unchanged)) in outcomes.into_iter().enumerate() {
            assert!(unchanged, "{mode:?}, rank {r}");
            match outcome {
                Err(Error::CheckpointMismatch { differences }) => assert_eq!(
                    differences,
                    [format!(
                        "the ranks read different saves: rank 0 {id_a}, rank 1 {id_b}"
                    )],
                    "{mode:?}, rank {r}"
                ),
                other => panic!("{mode:?}, rank {r}: {other:?}"),
            }
        }
    });
}

/// Each rank importing its own file (node-local copies): copies of one export import as the
/// export itself does; two exports of the model with other weights, though each file checks
/// out against the plan, are refused on every rank alike and change nothing.
#[test]
fn ranks_importing_node_local_copies_of_two_models_refuse_alike() {
    let mlp = model(DType::Bf16);
    let plan = plan(&mlp, 2);
    let scratch = Scratch::new("node-local-import");
    std::fs::create_dir_all(scratch.path()).unwrap();
    let (a, b, copy) = (
        scratch.join("a.safetensors"),
        scratch.join("b.safetensors"),
        scratch.join("copy.safetensors"),
    );
    let (to_a, to_b, whole) = (a.clone(), b.clone(), self::plan(&mlp, 1));
    trained(&mlp, &whole, Mode::Eager, 1, move |e| {
        e.export_safetensors(&to_a).unwrap()
    });
    trained(&mlp, &whole, Mode::Eager, 2, move |e| {
        e.export_safetensors(&to_b).unwrap()
    });
    std::fs::copy(&a, &copy).unwrap();
    for_each_mode(|mode| {
        let imported = |files: [PathBuf; 2]| {
            trained(&mlp, &plan, mode, 0, move |e| {
                let before = shards(e);
                let outcome = e.import_safetensors(&files[e.rank()]);
                let after = shards(e);
                (outcome, after == before, after)
            })
        };
        let from_a = imported([a.clone(), a.clone()]);
        let copies = imported([a.clone(), copy.clone()]);
        for (r, ((outcome, _, shards), (expected, _, from_a))) in
            copies.into_iter().zip(from_a).enumerate()
        {
            assert!(outcome.is_ok() && expected.is_ok(), "{mode:?}, rank {r}");
            assert_eq!(shards, from_a, "{mode:?}, rank {r}");
        }
        for (r, (outcome, unchanged, _)) in imported([a.clone(), b.clone()]).into_iter().enumerate()
        {
            assert!(unchanged, "{mode:?}, rank {r}");
            match outcome {
                Err(Error::CheckpointMismatch { differences }) => {
                    assert_eq!(differences.len(), 1, "{mode:?}, rank {r}");
                    assert!(
                        differences[0].starts_with("the ranks read different files: rank 0 "),
                        "{mode:?}, rank {r}: {differences:?}"
                    );
                }
                other => panic!("{mode:?}, rank {r}: {other:?}"),
            }
        }
    });
}

/// A directory under `base` whose path a directory can take and its files cannot: a file's
/// temporary name in it passes the system's limit on a path (4096 bytes), so that a write
/// there fails after the ranks agreed to it, even for a user whom no permission stops.
fn too_deep_for_files(base: &Path) -> PathBuf {
    const LENGTH: usize = 4080;
    let mut dir = base.to_path_buf();
    while dir.as_os_str().len() < LENGTH {
        let room = LENGTH - dir.as_os_str().len() - 1;
        dir.push("d".repeat(room.clamp(1, 200)));
    }
    dir
}

/// The rank files in `dir`, if it exists.
fn rank_files(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("rank-") || name.ends_with(".partial"))
        .collect()
}

/// A save that fails on one rank after the ranks agreed to it fails on every rank (that rank's
/// error there, `PeerRefused` naming it on the others) and leaves no file of it, blocking or
/// asynchronous (at `wait_save`); the directory then takes the next save.
#[test]
fn a_save_failing_on_one_rank_fails_on_every_rank_and_leaves_no_file() {
    let mlp = model(DType::Bf16);
    let plan = plan(&mlp, 2);
    let scratch = Scratch::new("one-rank-fails");
    for_each_mode(|mode| {
        for asynchronous in [false, true] {
            // Each mode's own, as the modes run side by side.
            let name = format!("{mode:?}-{asynchronous}");
            let good = scratch.join(&format!("good-{name}"));
            let deep = too_deep_for_files(&scratch.join(&format!("deep-{name}")));
            let (to_good, deep) = (good.clone(), deep.clone());
            let outcomes = trained(&mlp, &plan, mode, 1, move |e| {
                let good = &to_good;
                let dir = if e.rank() == 0 { good } else { &deep };
                let outcome = match asynchronous {
                    false => e.save(dir),
                    true => e.save_async(dir).and_then(|()| e.wait_save()),
                };
                let files = rank_files(dir);
                // The directory is free for the next save, which every rank makes there.
                let next = e.save(good);
                (outcome, files, next, e.save_pending())
            });
            let what = format!("{mode:?}, asynchronous {asynchronous}");
            for (r, (outcome, files, next, pending)) in outcomes.into_iter().enumerate() {
                match (r, outcome) {
                    (1, Err(Error::Write { .. })) => {}
                    (0, Err(Error::PeerRefused { rank: 1, cause })) => {
                        assert!(matches!(*cause, Error::Write { .. }), "{what}: {cause}")
                    }
                    (r, other) => panic!("{what}, rank {r}: {other:?}"),
                }
                assert!(files.is_empty(), "{what}, rank {r} left {files:?}");
                next.unwrap();
                assert!(!pending, "{what}, rank {r}");
            }
            assert_eq!(checkpoint::read_saved(&good).unwrap().world_size(), 2);
        }
    });
}

/// Makes a FIFO at `path`, which no process writes.
fn fifo(path: &Path) {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(
        unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) },
        0,
        "{path:?}"
    );
}

/// A FIFO in place of the imported file or of a checkpoint's data file, which would block its
/// open until some process wrote it, is refused by name at once, on every rank.
#[test]
fn a_fifo_in_place_of_an_imported_or_saved_file_is_refused_without_waiting() {
    let mlp = model(DType::Bf16);
    let plan = plan(&mlp, 2);
    let scratch = Scratch::new("fifo");
    let (file, dir) = (scratch.join("model.safetensors"), scratch.join("saved"));
    std::fs::create_dir_all(scratch.path()).unwrap();
    fifo(&file);
    let to = dir.clone();
    trained(&mlp, &plan, Mode::Eager, 1, move |e| e.save(&to).unwrap());
    let data = checkpoint::data_path(&dir, 1);
    std::fs::remove_file(&data).unwrap();
    fifo(&data);
    let outcomes = trained(&mlp, &plan, Mode::Eager, 0, move |e| {
        (e.import_safetensors(&file), e.load(&dir))
    });
    for (r, (imported, loaded)) in outcomes.into_iter().enumerate() {
        for (what, outcome, name) in [
            ("import", imported, "model.safetensors"),
            ("load", loaded, "rank-00001.bin"),
        ] {
            match outcome {
                Err(e) => assert!(
                    names_file_with(&e, name, "not a regular file"),
                    "rank {r}, {what}: {e:?}"
                ),
                Ok(()) => panic!("rank {r}, {what}: loaded"),
            }
        }
    }
}

#[test]
fn an_empty_path_or_a_folder_holding_a_checkpoint_is_refused_before_anything_is_written() {
    let mlp = model(DType::F32);
    let scratch = Scratch::new("paths");
    let two = scratch.path().to_path_buf();
    trained(&mlp, &plan(&mlp, 2), Mode::Eager, 1, move |e| {
        e.save(&two).unwrap()
    });
    let listing = |dir: &Path| {
        let mut names: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        names
    };
    let before = listing(scratch.path());
    let cwd = listing(Path::new("."));
    for world in [1, 4] {
        let dir = scratch.path().to_path_buf();
        let outcomes = trained(&mlp, &plan(&mlp, world), Mode::Eager, 0, move |e| {
            let empty = [
                e.save(Path::new("")),
                e.save_async(Path::new("")),
                e.load(Path::new("")),
                e.import_safetensors(Path::new("")),
            ];
            (empty, e.save(&dir), e.save_async(&dir))
        });
        for (r, (empty, into_other, background)) in outcomes.into_iter().enumerate() {
            for e in empty {
                assert!(matches!(e, Err(Error::EmptyPath { .. })), "rank {r}: {e:?}");
            }
            for e in [into_other, background] {
                assert!(
                    matches!(e, Err(Error::CheckpointExists { .. })),
                    "rank {r}: {e:?}"
                );
            }
        }
    }
    assert_eq!(listing(scratch.path()), before, "a refused save wrote");
    assert_eq!(
        listing(Path::new(".")),
        cwd,
        "a save wrote into the working directory"
    );
    let out = scratch.join("model.safetensors");
    let export = fsdp_fusion::export::export_checkpoint;
    assert!(matches!(
        export(Path::new(""), &out),
        Err(Error::EmptyPath { .. })
    ));
    assert!(matches!(
        export(scratch.path(), Path::new("")),
        Err(Error::EmptyPath { .. })
    ));
    // A manifest naming a parameter as safetensors' metadata key exports nothing.
    for rank in 0..2 {
        rewrite(scratch.path(), rank, |m| {
            m.params[0].name = "__metadata__".into()
        });
    }
    match export(scratch.path(), &out) {
        Err(Error::ReservedName { name }) => assert_eq!(name, "__metadata__"),
        other => panic!("{other:?}"),
    }
    assert!(!out.exists());
}

/// Whether any file in `dir` is a temporary one left behind.
fn temporaries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".partial"))
        .collect()
}

#[test]
fn a_save_or_export_never_writes_through_a_file_or_symlink_it_did_not_make() {
    let mlp = model(DType::Bf16);
    let scratch = Scratch::new("symlinks");
    let dir = scratch.join("ckpt");
    std::fs::create_dir_all(&dir).unwrap();
    let victim = scratch.join("victim");
    std::fs::write(&victim, b"the caller's").unwrap();
    // The names earlier saves and exports wrote their temporaries under.
    std::fs::write(dir.join("rank-00000.partial"), b"mine").unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("rank-00001.partial")).unwrap();
    std::os::unix::fs::symlink(&victim, scratch.join("model.partial")).unwrap();
    std::os::unix::fs::symlink(&victim, scratch.join("dangling.safetensors")).unwrap();
    std::fs::remove_file(&victim).unwrap();
    std::fs::write(&victim, b"the caller's").unwrap();
    let to = dir.clone();
    trained(&mlp, &plan(&mlp, 2), Mode::Eager, 1, move |e| {
        e.save(&to).unwrap()
    });
    assert_eq!(
        std::fs::read(dir.join("rank-00000.partial")).unwrap(),
        b"mine"
    );
    assert_eq!(std::fs::read(&victim).unwrap(), b"the caller's");
    // Two exports at once, into names that once shared a temporary.
    let exports = [scratch.join("model.v1"), scratch.join("model.v2")];
    let written: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = exports
            .iter()
            .map(|out| s.spawn(|| fsdp_fusion::export::export_checkpoint(&dir, out)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(written.iter().all(Result::is_ok), "{written:?}");
    let files: Vec<_> = exports.iter().map(|f| std::fs::read(f).unwrap()).collect();
    assert_eq!(files[0], files[1]);
    assert!(safetensors::SafeTensors::deserialize(&files[0]).is_ok());
    assert_eq!(std::fs::read(&victim).unwrap(), b"the caller's");
    // A symlink at the target is an existing file: refused, its target not written.
    let dangling = scratch.join("dangling.safetensors");
    match fsdp_fusion::export::export_checkpoint(&dir, &dangling) {
        Err(Error::CheckpointExists { .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(std::fs::read(&victim).unwrap(), b"the caller's");
    for d in [&dir, &scratch.path().to_path_buf()] {
        let left: Vec<_> = temporaries(d)
            .into_iter()
            .filter(|n| !n.starts_with("rank-0000") && n != "model.partial")
            .collect();
        assert!(left.is_empty(), "temporaries left behind: {left:?}");
    }
}

/// Set in a child process: the directory its save writes into, under a file size limit.
const LIMITED_DIR: &str = "FSDP_CHECKPOINT_LIMITED_DIR";

#[test]
fn a_save_that_runs_out_of_space_leaves_nothing_behind() {
    let mlp = model_of(DType::F32, 160);
    if let Ok(dir) = std::env::var(LIMITED_DIR) {
        // The child: every file larger than 64 KiB fails to grow (EFBIG), as on a full disk.
        // SAFETY: plain calls on this process, before any thread of its own starts.
        unsafe {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let limit = libc::rlimit {
                rlim_cur: 64 << 10,
                rlim_max: 64 << 10,
            };
            assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
        }
        let dir = PathBuf::from(dir);
        let plan = plan(&mlp, 2);
        let outcomes = trained(&mlp, &plan, Mode::Eager, 1, move |e| e.save(&dir));
        for outcome in outcomes {
            assert!(matches!(outcome, Err(Error::Write { .. })), "{outcome:?}");
        }
        return;
    }
    let scratch = Scratch::new("full");
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_save_that_runs_out_of_space_leaves_nothing_behind",
        ])
        .env(LIMITED_DIR, scratch.path())
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "the child failed");
    let left: Vec<_> = std::fs::read_dir(scratch.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(left.is_empty(), "a failed save left {left:?}");
}

/// Set in a child process: the checkpoint it resumes from and the directory it saves into.
const KILLED_DIRS: &str = "FSDP_CHECKPOINT_KILLED_DIRS";

/// Resumes 2 ranks from `previous`, takes a step and (where `next`) saves into it; the ranks'
/// shards after the step.
fn resumed_step(previous: PathBuf, next: Option<PathBuf>) -> Vec<Vec<Vec<u8>>> {
    let mlp = model_of(DType::F32, 320);
    let config = EngineConfig::default();
    let lr = config.optimizer.lr();
    on_engines(&plan(&mlp, 2), &config, Mode::Eager, move |mut e| {
        e.load(&previous).unwrap();
        sharded_step(&mlp, &mut e, (1, 2), lr, Recipe::default()).unwrap();
        if let Some(next) = &next {
            e.save(next).unwrap();
        }
        shards(&e)
    })
}

#[test]
fn a_save_killed_at_any_point_never_harms_the_last_checkpoint_nor_loads() {
    if let Ok(dirs) = std::env::var(KILLED_DIRS) {
        // The child: resume, step, save, and be killed somewhere on the way.
        let (previous, next) = dirs.split_once('\n').unwrap();
        resumed_step(previous.into(), Some(next.into()));
        return;
    }
    // The last good checkpoint: 2 ranks of a model of about 5 MB of state, after one step.
    let mlp = model_of(DType::F32, 320);
    let scratch = Scratch::new("killed");
    let previous = scratch.join("previous");
    let to = previous.clone();
    let at_previous = trained(&mlp, &plan(&mlp, 2), Mode::Eager, 1, move |e| {
        e.save(&to).unwrap();
        shards(e)
    });
    let expected = resumed_step(previous.clone(), None);
    let exe = std::env::current_exe().unwrap();
    // Runs the child, killed (SIGKILL) after `delay` or left to finish; loads both folders.
    let run = |k: u32, delay: Option<std::time::Duration>| {
        let next = scratch.join(&format!("next-{k}"));
        let mut child = std::process::Command::new(&exe)
            .args([
                "--exact",
                "a_save_killed_at_any_point_never_harms_the_last_checkpoint_nor_loads",
            ])
            .env(
                KILLED_DIRS,
                format!("{}\n{}", previous.display(), next.display()),
            )
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        if let Some(delay) = delay {
            std::thread::sleep(delay);
            let _ = child.kill();
        }
        let finished = child.wait().unwrap().success();
        assert!(finished || delay.is_some(), "the child failed");
        let config = EngineConfig::default();
        let load = |dir: PathBuf| {
            on_engines(&plan(&mlp, 2), &config, Mode::Eager, move |mut e| {
                e.load(&dir).map(|()| shards(&e))
            })
        };
        let old: Vec<_> = load(previous.clone())
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(
            old, at_previous,
            "killed at {k}/24: the last checkpoint changed"
        );
        let new: Result<Vec<_>, Error> = load(next).into_iter().collect();
        (finished, new)
    };
    let started = std::time::Instant::now();
    let (finished, whole) = run(0, None);
    assert!(finished);
    assert_eq!(whole.unwrap(), expected, "an uninterrupted save");
    let whole = started.elapsed();
    let mut outcomes = (0, 0);
    // Kill points spread over the child's whole run: its start, load, step and save.
    for k in 1..=24u32 {
        match run(k, Some(whole * k / 24)) {
            (_, Ok(got)) => {
                assert_eq!(
                    got, expected,
                    "killed at {k}/24: a checkpoint loaded wrong data"
                );
                outcomes.0 += 1;
            }
            (false, Err(e)) if names_file(&e, ".json") || names_file(&e, ".bin") => {
                outcomes.1 += 1;
            }
            (_, Err(other)) => panic!("killed at {k}/24: {other:?}"),
        }
    }
    eprintln!("{} loads complete, {} refused", outcomes.0, outcomes.1);
}

/// A save of 20 ranks, loaded onto 1 and 3 and exported: each parameter's values are the ones
/// each rank's file holds (read with a reader per rank), though the load and the export read
/// the files one at a time, rank after rank.
#[test]
fn a_save_of_many_ranks_loads_and_exports_its_values_reading_one_file_at_a_time() {
    let mlp = model(DType::F32);
    let scratch = Scratch::new("many-ranks");
    let dir = scratch.join("saved");
    let to = dir.clone();
    trained(&mlp, &plan(&mlp, 20), Mode::Eager, 1, move |e| {
        e.save(&to).unwrap()
    });
    let expected = saved_params(&dir);
    assert!(expected.iter().flatten().any(|&b| b != 0), "nothing saved");
    let file = scratch.join("model.safetensors");
    fsdp_fusion::export::export_checkpoint(&dir, &file).unwrap();
    let whole = plan(&mlp, 1);
    let exported = |e: &mut CpuEngine, file: &Path| {
        e.export_safetensors(file).unwrap();
        std::fs::read(file).unwrap()
    };
    for world in [1, 3] {
        let (from, into) = (dir.clone(), scratch.join(&format!("loaded-{world}")));
        std::fs::create_dir_all(&into).unwrap();
        // Saved again from the world loaded into, and exported at world size 1.
        let resaved = into.join("saved");
        let resave = resaved.clone();
        on_engines(
            &plan(&mlp, world),
            &EngineConfig::default(),
            Mode::Eager,
            move |mut e| {
                e.load(&from).unwrap();
                e.save(&resave).unwrap();
            },
        );
        let again = into.join("model.safetensors");
        let bytes = on_engines(
            &whole,
            &EngineConfig::default(),
            Mode::Eager,
            move |mut e| {
                e.load(&resaved).unwrap();
                exported(&mut e, &again)
            },
        );
        assert_eq!(bytes[0], std::fs::read(&file).unwrap(), "world {world}");
    }
    let tensors = std::fs::read(&file).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&tensors).unwrap();
    for (i, p) in mlp.spec().unwrap().params.iter().enumerate() {
        assert_eq!(
            tensors.tensor(&p.name).unwrap().data(),
            &expected[i][..],
            "{}",
            p.name
        );
    }
}

#[test]
fn a_state_of_many_pieces_and_chunks_saves_and_loads_exactly_on_several_threads() {
    use fsdp_fusion::{Engine, LocalComm, ModelSpec, OptimizerConfig, ParamSpec};
    // 72 MiB of f32 in one parameter at world size 1, and one of 3 elements: the save moves it
    // through its host pieces, the load reads it on several threads, its chunks cut between them.
    let numel = 18 << 20;
    let spec = ModelSpec::new(vec![
        ParamSpec::new("big", &[numel as u64], DType::F32),
        ParamSpec::new("small", &[3], DType::F32).in_unit(0),
    ])
    .unwrap();
    let plan = Arc::new(Plan::new(&spec, 1).unwrap());
    let config = EngineConfig {
        optimizer: OptimizerConfig::sgd(0.1),
        ..EngineConfig::default()
    };
    let engine = |save_staging| {
        let comm = LocalComm::group(1).unwrap().remove(0);
        let config = EngineConfig {
            save_staging,
            ..config.clone()
        };
        Engine::new(
            Arc::clone(&plan),
            config,
            fsdp_fusion::CpuBackend::new(),
            comm,
        )
        .unwrap()
    };
    let values: Vec<f32> = (0..numel).map(|i| (i % 65521) as f32 * 0.5 - 7.0).collect();
    let mut saved = engine(false);
    saved
        .load_param(fsdp_fusion::ParamId(0), Input::host(&values))
        .unwrap();
    saved
        .load_param(fsdp_fusion::ParamId(1), Input::host(&[1.0f32, 2.0, 3.0]))
        .unwrap();
    let scratch = Scratch::new("pieces");
    saved.save(scratch.path()).unwrap();
    // Loaded into the asynchronous saves' staging area, which the next save then uses.
    let mut loaded = engine(true);
    loaded.load(scratch.path()).unwrap();
    for g in 0..plan.groups().len() {
        assert!(
            loaded.param_shard(g).unwrap() == saved.param_shard(g).unwrap(),
            "group {g}"
        );
    }
    let again = scratch.join("again");
    loaded.save_async(&again).unwrap();
    loaded.wait_save().unwrap();
    let data = |dir: &Path| std::fs::read(checkpoint::data_path(dir, 0)).unwrap();
    assert!(
        data(&again) == data(scratch.path()),
        "the state saved again differs"
    );
    let m = checkpoint::read_manifest(scratch.path(), 0).unwrap();
    assert!(m.chunk_xxh3.len() > 16, "{} chunks", m.chunk_xxh3.len());
}
