use super::GradEffect::*;
use super::*;

/// Each pass reduces; the optimizer steps after the backward.
const AFTER: (Passes, Updates) = (Passes::ReduceEach, Updates::AfterBackward);

fn reduces(effects: &[GradEffect]) -> usize {
    effects
        .iter()
        .filter(|e| matches!(e, Reduce { .. }))
        .count()
}

#[test]
fn a_group_reduces_once_its_last_gradient_arrives() {
    // Group 0: params 0 and 1.
    let mut p = GradPipeline::new(vec![vec![0, 1]], 2, (3, 2), true, GradRoute::Reduced, AFTER);
    let mut fx = Vec::new();
    p.on_grad(0, 0, &mut fx);
    assert_eq!(
        fx,
        vec![
            ZeroPadding {
                place: GradTarget::Slot(0),
                group: 0
            },
            Write {
                param: 0,
                place: GradTarget::Slot(0),
                add: false
            }
        ]
    );
    fx.clear();
    p.on_grad(1, 0, &mut fx);
    assert_eq!(
        fx,
        vec![
            Write {
                param: 1,
                place: GradTarget::Slot(0),
                add: false
            },
            Reduce {
                group: 0,
                place: GradTarget::Slot(0),
                overwrite: true
            }
        ]
    );
    assert_eq!(p.in_flight(), 1);
}

#[test]
fn at_most_max_in_flight_reductions() {
    let groups = 6;
    let mut p = GradPipeline::new(
        (0..groups).map(|g| vec![g]).collect(),
        groups,
        (3, 2),
        true,
        GradRoute::Reduced,
        AFTER,
    );
    let mut fx = Vec::new();
    for g in 0..groups {
        p.on_grad(g, g, &mut fx);
        assert!(p.in_flight() <= 2);
    }
    assert_eq!(reduces(&fx), groups);
    // The third reduction retired the first before launching.
    let first_retire = fx.iter().position(|e| matches!(e, Retire { .. })).unwrap();
    let third_reduce = fx
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(e, Reduce { .. }))
        .nth(2)
        .unwrap()
        .0;
    assert!(first_retire < third_reduce);
}

#[test]
fn overlap_off_retires_each_reduction_at_once() {
    let mut p = GradPipeline::new(
        vec![vec![0], vec![1]],
        2,
        (3, 2),
        false,
        GradRoute::Reduced,
        AFTER,
    );
    let mut fx = Vec::new();
    p.on_grad(0, 0, &mut fx);
    assert_eq!(p.in_flight(), 0);
    assert_eq!(fx.last(), Some(&Retire { slot: 0 }));
}

#[test]
fn full_slots_flush_the_oldest_partial_group() {
    // Three groups of two params each, two slots: the third group forces a partial reduce.
    let mut p = GradPipeline::new(
        vec![vec![0, 1], vec![2, 3], vec![4, 5]],
        6,
        (2, 1),
        true,
        GradRoute::Reduced,
        AFTER,
    );
    let mut fx = Vec::new();
    p.on_grad(0, 0, &mut fx);
    p.on_grad(2, 1, &mut fx);
    fx.clear();
    p.on_grad(4, 2, &mut fx);
    // Group 0 is reduced with what it has: param 1's place is zeroed first.
    assert_eq!(
        fx,
        vec![
            ZeroParam {
                place: GradTarget::Slot(0),
                param: 1
            },
            Reduce {
                group: 0,
                place: GradTarget::Slot(0),
                overwrite: true
            },
            Retire { slot: 0 },
            ZeroPadding {
                place: GradTarget::Slot(0),
                group: 2
            },
            Write {
                param: 4,
                place: GradTarget::Slot(0),
                add: false
            },
        ]
    );
    // Group 0's second gradient needs a slot: group 1, the oldest filling, is reduced early;
    // then group 0 completes in the fresh slot, where param 0's place is zeroed (it was
    // reduced already), and adds to its shard.
    fx.clear();
    p.on_grad(1, 0, &mut fx);
    assert_eq!(
        fx,
        vec![
            ZeroParam {
                place: GradTarget::Slot(1),
                param: 3
            },
            Reduce {
                group: 1,
                place: GradTarget::Slot(1),
                overwrite: true
            },
            Retire { slot: 1 },
            ZeroPadding {
                place: GradTarget::Slot(1),
                group: 0
            },
            Write {
                param: 1,
                place: GradTarget::Slot(1),
                add: false
            },
            ZeroParam {
                place: GradTarget::Slot(1),
                param: 0
            },
            Reduce {
                group: 0,
                place: GradTarget::Slot(1),
                overwrite: false
            },
        ]
    );
    fx.clear();
    p.finish(&mut fx);
    assert_eq!(
        fx,
        vec![
            ZeroParam {
                place: GradTarget::Slot(0),
                param: 5
            },
            Retire { slot: 1 },
            Reduce {
                group: 2,
                place: GradTarget::Slot(0),
                overwrite: true
            },
            Retire { slot: 0 },
        ]
    );
    assert_eq!(p.in_flight(), 0);
}

#[test]
fn at_world_size_1_gradients_go_straight_to_the_shard_and_later_passes_add() {
    let mut p = GradPipeline::new(
        vec![vec![0, 1]],
        2,
        (0, 1),
        true,
        GradRoute::IntoShards,
        AFTER,
    );
    let mut fx = Vec::new();
    p.on_grad(0, 0, &mut fx);
    p.on_grad(1, 0, &mut fx);
    let shard = GradTarget::Shard(0);
    let write = |param, add| Write {
        param,
        place: shard,
        add,
    };
    assert_eq!(
        fx,
        vec![
            ZeroPadding {
                place: shard,
                group: 0
            },
            write(0, false),
            write(1, false),
        ]
    );
    // The second pass adds; param 0 gets no gradient in it and keeps the first pass's.
    p.end_pass(&mut fx);
    fx.clear();
    assert!(p.next_adds(0));
    p.on_grad(1, 0, &mut fx);
    p.finish(&mut fx);
    assert_eq!(fx, vec![write(1, true)]);
    // The next step overwrites again.
    p.end_step();
    fx.clear();
    assert!(!p.next_adds(0));
    p.on_grad(0, 0, &mut fx);
    assert_eq!(fx[1], write(0, false));
}

#[test]
fn no_sync_passes_add_into_the_accumulator_and_the_sync_reduces_it_once() {
    for passes in [Passes::AccumulateInPlace, Passes::AccumulateStaged] {
        let mut p = GradPipeline::new(
            vec![vec![0, 1]],
            2,
            (2, 1),
            true,
            GradRoute::Reduced,
            (passes, Updates::AfterBackward),
        );
        let mut fx = Vec::new();
        let acc = GradTarget::Accumulator(0);
        p.on_grad(1, 0, &mut fx);
        p.end_pass(&mut fx);
        assert_eq!(
            fx,
            vec![
                ZeroPadding {
                    place: acc,
                    group: 0
                },
                Write {
                    param: 1,
                    place: acc,
                    add: false
                },
                ZeroParam {
                    place: acc,
                    param: 0
                },
            ],
            "{passes:?}: the first pass writes, and zeroes what it did not write"
        );
        fx.clear();
        p.on_grad(0, 0, &mut fx);
        p.on_grad(1, 0, &mut fx);
        assert!(
            fx.iter().all(|e| matches!(e, Write { add: true, .. })),
            "{passes:?}: {fx:?}"
        );
        fx.clear();
        p.finish(&mut fx);
        let expected = match passes {
            Passes::AccumulateInPlace => vec![Reduce {
                group: 0,
                place: acc,
                overwrite: true,
            }],
            _ => vec![
                Stage { group: 0, slot: 0 },
                Reduce {
                    group: 0,
                    place: GradTarget::Slot(0),
                    overwrite: true,
                },
                Retire { slot: 0 },
            ],
        };
        assert_eq!(fx, expected, "{passes:?}");
    }
}

#[test]
fn passes_accumulate_and_steps_overwrite() {
    let mut p = GradPipeline::new(vec![vec![0]], 1, (2, 1), true, GradRoute::Reduced, AFTER);
    let mut fx = Vec::new();
    p.on_grad(0, 0, &mut fx);
    p.end_pass(&mut fx);
    assert!(!p.received(0));
    p.on_grad(0, 0, &mut fx);
    p.finish(&mut fx);
    let overwrites: Vec<bool> = fx
        .iter()
        .filter_map(|e| match e {
            Reduce { overwrite, .. } => Some(*overwrite),
            _ => None,
        })
        .collect();
    assert_eq!(overwrites, vec![true, false]);
    assert!(p.synced() && !p.pending());
    p.end_step();
    fx.clear();
    p.on_grad(0, 0, &mut fx);
    assert_eq!(
        fx,
        vec![
            ZeroPadding {
                place: GradTarget::Slot(0),
                group: 0
            },
            Write {
                param: 0,
                place: GradTarget::Slot(0),
                add: false
            },
            Reduce {
                group: 0,
                place: GradTarget::Slot(0),
                overwrite: true
            },
        ]
    );
}

#[test]
fn finish_zeroes_shards_without_gradients_and_reduces_partial_groups() {
    let mut p = GradPipeline::new(
        vec![vec![0, 1], vec![], vec![3]],
        4,
        (3, 2),
        true,
        GradRoute::Reduced,
        AFTER,
    );
    let mut fx = Vec::new();
    p.on_grad(0, 0, &mut fx);
    fx.clear();
    p.finish(&mut fx);
    assert_eq!(
        fx,
        vec![
            ZeroParam {
                place: GradTarget::Slot(0),
                param: 1
            },
            Reduce {
                group: 0,
                place: GradTarget::Slot(0),
                overwrite: true
            },
            Retire { slot: 0 },
            ZeroShard { group: 2 },
        ]
    );
}

/// Each pass reduces; the optimizer steps in the backward.
const IN_BACKWARD: (Passes, Updates) = (Passes::ReduceEach, Updates::InBackward);

fn finals(effects: &[GradEffect]) -> Vec<usize> {
    effects
        .iter()
        .filter_map(|e| match e {
            Final { group } => Some(*group),
            _ => None,
        })
        .collect()
}

#[test]
fn at_world_size_1_a_group_is_final_once_its_gradients_are_all_written() {
    // Group 0: params 0 and 1; group 1: param 2; group 2: param 3, which gets none.
    let members = vec![vec![0, 1], vec![2], vec![3]];
    let mut p = GradPipeline::new(members, 4, (0, 1), true, GradRoute::IntoShards, IN_BACKWARD);
    let mut fx = Vec::new();
    p.on_grad(0, 0, &mut fx);
    assert!(finals(&fx).is_empty() && !p.closed(0));
    p.on_grad(1, 0, &mut fx);
    // The update follows the group's last write.
    assert_eq!(
        &fx[fx.len() - 2..],
        [
            Write {
                param: 1,
                place: GradTarget::Shard(0),
                add: false
            },
            Final { group: 0 }
        ]
    );
    assert!(p.closed(0));
    fx.clear();
    p.finish(&mut fx);
    // Group 1 got nothing: a zero shard, then its update; every group once.
    assert_eq!(
        fx,
        vec![
            ZeroShard { group: 1 },
            Final { group: 1 },
            ZeroShard { group: 2 },
            Final { group: 2 }
        ]
    );
    // The same in steps that update after the backward: no update effect at all.
    let mut after = GradPipeline::new(
        vec![vec![0, 1]],
        2,
        (0, 1),
        true,
        GradRoute::IntoShards,
        AFTER,
    );
    let mut fx = Vec::new();
    after.on_grad(0, 0, &mut fx);
    after.on_grad(1, 0, &mut fx);
    after.finish(&mut fx);
    assert!(finals(&fx).is_empty() && !after.closed(0));
}

#[test]
fn a_units_end_completes_its_groups_the_missing_gradients_zero() {
    let mut p = GradPipeline::new(
        vec![vec![0, 1], vec![2]],
        3,
        (0, 1),
        true,
        GradRoute::IntoShards,
        IN_BACKWARD,
    );
    let mut fx = Vec::new();
    p.on_grad(0, 0, &mut fx);
    p.on_grad(2, 1, &mut fx);
    fx.clear();
    p.complete_groups_where(|g| g == 0, &mut fx);
    assert_eq!(
        fx,
        vec![
            ZeroParam {
                place: GradTarget::Shard(0),
                param: 1
            },
            Final { group: 0 }
        ]
    );
    assert!(p.closed(0));
}

#[test]
fn where_gradients_travel_a_group_is_final_at_the_retire_of_its_last_reduction() {
    // Three one-parameter groups, two reductions in flight, three slots.
    let mut p = GradPipeline::new(
        (0..3).map(|g| vec![g]).collect(),
        3,
        (3, 2),
        true,
        GradRoute::Reduced,
        IN_BACKWARD,
    );
    let mut fx = Vec::new();
    p.on_grad(0, 0, &mut fx);
    p.on_grad(1, 1, &mut fx);
    // Reduced, not yet retired: not final, but closed to more gradients.
    assert!(finals(&fx).is_empty() && p.closed(0) && p.closed(1));
    fx.clear();
    p.on_grad(2, 2, &mut fx);
    // The third reduction retires the first: group 0's update waits for its reduction.
    let retire = fx.iter().position(|e| *e == Retire { slot: 0 }).unwrap();
    assert_eq!(fx[retire + 1], Final { group: 0 });
    assert_eq!(finals(&fx), vec![0]);
    fx.clear();
    p.finish(&mut fx);
    assert_eq!(finals(&fx), vec![1, 2]);
}

/// Groups [0, 1], [2, 3] and [4], one reduction in flight and two slots, after gradients of
/// params 0, 2 and 4: the third group needed the slot of group 0, still filling, whose
/// gradients so far were reduced early.
fn reduced_in_part(overlap: bool) -> (GradPipeline, Vec<GradEffect>) {
    let mut p = GradPipeline::new(
        vec![vec![0, 1], vec![2, 3], vec![4]],
        5,
        (2, 1),
        overlap,
        GradRoute::Reduced,
        IN_BACKWARD,
    );
    let mut fx = Vec::new();
    p.on_grad(0, 0, &mut fx);
    p.on_grad(2, 1, &mut fx);
    p.on_grad(4, 2, &mut fx);
    (p, fx)
}

/// The groups `effects` finalize, in group order.
fn sorted_finals(effects: &[GradEffect]) -> Vec<usize> {
    let mut all = finals(effects);
    all.sort_unstable();
    all
}

#[test]
fn a_group_reduced_in_parts_is_final_only_after_its_last_part() {
    // With overlap off the part's reduction retires at once, and its slot serves the third group.
    for overlap in [true, false] {
        let (mut p, mut fx) = reduced_in_part(overlap);
        // Group 0 was reduced in part (and retired): not final, still open.
        assert!(!finals(&fx).contains(&0), "{fx:?}");
        assert!(!p.closed(0));
        p.on_grad(1, 0, &mut fx);
        p.finish(&mut fx);
        assert_eq!(
            sorted_finals(&fx),
            vec![0, 1, 2],
            "overlap {overlap}: {fx:?}"
        );
        // Group 0 in two parts, groups 1 and 2 once.
        assert_eq!(reduces(&fx), 4, "overlap {overlap}: {fx:?}");
    }
}

#[test]
fn a_group_reduced_in_part_whose_other_gradients_never_come_is_final_when_its_unit_ends() {
    // As above, but param 1 never gets a gradient: the unit's end (or the pass's) completes the
    // group reduced in part, and every group is updated once.
    for end_of_unit in [true, false] {
        let (mut p, mut fx) = reduced_in_part(true);
        if end_of_unit {
            p.complete_groups_where(|g| g == 0, &mut fx);
            assert!(p.closed(0));
        }
        p.on_grad(3, 1, &mut fx);
        p.finish(&mut fx);
        assert_eq!(
            sorted_finals(&fx),
            vec![0, 1, 2],
            "end of unit {end_of_unit}: {fx:?}"
        );
    }
}

/// The groups a rank's effects reduce, in order.
fn reduced_groups(effects: &[GradEffect]) -> Vec<usize> {
    effects
        .iter()
        .filter_map(|e| match e {
            Reduce { group, .. } => Some(*group),
            _ => None,
        })
        .collect()
}

#[test]
fn across_ranks_the_reductions_follow_the_units_ends_in_the_plans_order_whatever_arrived() {
    // Groups 0 and 1 in unit A (params 0, 1 and 2), group 2 in unit B (param 3), group 3 the
    // root's (param 4), group 4 frozen. Ranks hand over different subsets in different orders:
    // each reduces the same groups in the same order, once each, a missing gradient zeroed.
    let members = vec![vec![0, 1], vec![2], vec![3], vec![4], vec![]];
    let in_a = |g: usize| g < 2;
    let in_b = |g: usize| g == 2;
    // Each rank's gradients (param, group) in unit B's backward, then in unit A's.
    type Gradients = &'static [(usize, usize)];
    let ranks: [(Gradients, Gradients); 4] = [
        (&[(3, 2)], &[(0, 0), (1, 0), (2, 1), (4, 3)]),
        (&[], &[(2, 1), (1, 0)]),
        (&[(4, 3), (3, 2)], &[(0, 0)]),
        (&[], &[]),
    ];
    let mut sequences = Vec::new();
    for (b_grads, a_grads) in ranks {
        let mut p = GradPipeline::new(
            members.clone(),
            5,
            (3, 2),
            true,
            GradRoute::ReducedAcrossRanks,
            AFTER,
        );
        let mut fx = Vec::new();
        p.begin_pass();
        for &(param, group) in b_grads {
            p.on_grad(param, group, &mut fx);
        }
        // No gradient reduces: the ends do.
        assert_eq!(reduces(&fx), 0);
        p.end_unit(in_b, false, &mut fx);
        assert!(p.ended(2) && !p.ended(0));
        for &(param, group) in a_grads {
            p.on_grad(param, group, &mut fx);
        }
        p.end_unit(in_a, false, &mut fx);
        // The root's end waits for the pass's.
        p.end_unit(|g| g == 3, true, &mut fx);
        assert!(!p.ended(3));
        p.finish(&mut fx);
        // Every trainable place written whole: a group that got nothing is opened and zeroed.
        for (param, group) in [(0, 0), (1, 0), (2, 1), (3, 2), (4, 3)] {
            let got = b_grads.contains(&(param, group)) || a_grads.contains(&(param, group));
            let zeroed = fx
                .iter()
                .any(|e| matches!(e, ZeroParam { param: p, .. } if *p == param));
            assert_eq!(got, !zeroed, "param {param}");
        }
        assert!(!fx.iter().any(|e| matches!(e, ZeroShard { .. })));
        sequences.push(reduced_groups(&fx));
    }
    for sequence in &sequences {
        assert_eq!(sequence, &[2, 0, 1, 3]);
    }
}

#[test]
fn across_ranks_a_pass_that_never_began_reduces_nothing_and_its_groups_are_zero() {
    let mut p = GradPipeline::new(
        vec![vec![0], vec![1]],
        2,
        (3, 2),
        true,
        GradRoute::ReducedAcrossRanks,
        AFTER,
    );
    let mut fx = Vec::new();
    p.end_pass(&mut fx);
    p.finish(&mut fx);
    assert_eq!(fx, vec![ZeroShard { group: 0 }, ZeroShard { group: 1 }]);
    // A pass with no gradient at all reduces every trainable group (a peer may have some).
    let mut fx = Vec::new();
    p.end_step();
    p.begin_pass();
    p.finish(&mut fx);
    assert_eq!(reduced_groups(&fx), [0, 1]);
}
