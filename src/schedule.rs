//! Pure prefetch prediction: the order in which units ran in the last pass of each kind.

/// Most starts per unit in one recorded pass: a root used around both ends of a model and shared
/// layers stay well inside it.
const PASS_LIMIT: usize = 4;

/// Forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Forward,
    Backward,
}

impl Phase {
    fn index(self) -> usize {
        match self {
            Phase::Forward => 0,
            Phase::Backward => 1,
        }
    }
}

/// Records the units each forward and backward pass starts, in order, and predicts the next one
/// from the last complete pass of the same kind. Before any pass completed, the plan's unit order
/// (forward) or its reverse (backward) stands in.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// Units in plan order are `0..units`.
    units: usize,
    last: [Vec<usize>; 2],
    current: [Vec<usize>; 2],
    phase: Option<Phase>,
    /// Whether the step in progress entered a backward pass.
    backward_in_step: bool,
    /// Whether the last step ended entered one: a training step, whose passes are recorded.
    last_step_trained: bool,
}

impl Schedule {
    /// `units` units, in plan order `0..units`.
    pub fn new(units: usize) -> Schedule {
        Schedule {
            units,
            last: [Vec::new(), Vec::new()],
            current: [Vec::new(), Vec::new()],
            phase: None,
            backward_in_step: false,
            last_step_trained: false,
        }
    }

    pub fn phase(&self) -> Option<Phase> {
        self.phase
    }

    /// Whether the last step ended entered a backward pass (an empty or forward-only step did
    /// not): the passes predicted from now on are a training step's.
    pub fn last_step_trained(&self) -> bool {
        self.last_step_trained
    }

    /// Enters `phase`. Returns the phase left, if any: a new pass of `phase` begins, and the
    /// record of the pass it replaces becomes the prediction.
    pub fn enter(&mut self, phase: Phase) -> Option<Phase> {
        if self.phase == Some(phase) {
            return None;
        }
        let left = self.phase.replace(phase);
        self.backward_in_step |= phase == Phase::Backward;
        let current = &mut self.current[phase.index()];
        if !current.is_empty() {
            self.last[phase.index()] = std::mem::take(current);
        }
        left
    }

    /// Records that `unit` starts in the current phase, which must have been entered.
    ///
    /// A loop that never changes phase (forward passes for evaluation, with no backward and no
    /// end of step) still moves from pass to pass: a pass that repeated the last one whole and
    /// starts over is a new pass, and so is one that ran [`PASS_LIMIT`] starts per unit.
    pub fn record(&mut self, unit: usize) {
        let Some(phase) = self.phase else {
            return;
        };
        let (last, current) = (
            &mut self.last[phase.index()],
            &mut self.current[phase.index()],
        );
        let repeated = !last.is_empty() && current == last && last.first() == Some(&unit);
        let limit = PASS_LIMIT * self.units.max(1);
        if repeated || current.len() >= limit {
            *last = std::mem::take(current);
        }
        current.push(unit);
    }

    /// The unit expected to start next in the current phase.
    pub fn predict_next(&self) -> Option<usize> {
        let phase = self.phase?;
        let current = &self.current[phase.index()];
        let last = &self.last[phase.index()];
        if !last.is_empty() {
            return last.get(current.len()).copied();
        }
        let &now = current.last()?;
        match phase {
            Phase::Forward => Some(now + 1).filter(|&next| next < self.units),
            Phase::Backward => now.checked_sub(1),
        }
    }

    /// Ends the step: the passes in progress become the predictions.
    pub fn end_step(&mut self) {
        for phase in [Phase::Forward, Phase::Backward] {
            let current = &mut self.current[phase.index()];
            if !current.is_empty() {
                self.last[phase.index()] = std::mem::take(current);
            }
        }
        self.phase = None;
        self.last_step_trained = std::mem::take(&mut self.backward_in_step);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_pass_predicts_plan_order_then_the_recorded_order() {
        let mut s = Schedule::new(4);
        assert_eq!(s.enter(Phase::Forward), None);
        s.record(1);
        assert_eq!(s.predict_next(), Some(2));
        s.record(3);
        assert_eq!(s.predict_next(), None);
        assert_eq!(s.enter(Phase::Backward), Some(Phase::Forward));
        s.record(3);
        assert_eq!(s.predict_next(), Some(2));
        s.end_step();

        // The recorded forward order was [1, 3]: the prediction follows it, not the plan.
        s.enter(Phase::Forward);
        s.record(1);
        assert_eq!(s.predict_next(), Some(3));
        s.record(3);
        assert_eq!(s.predict_next(), None);
    }

    #[test]
    fn a_unit_used_twice_in_a_pass_is_predicted_at_each_place() {
        let mut s = Schedule::new(3);
        s.enter(Phase::Forward);
        for u in [0, 1, 2, 0] {
            s.record(u);
        }
        s.enter(Phase::Backward);
        s.enter(Phase::Forward);
        s.record(0);
        assert_eq!(s.predict_next(), Some(1));
        s.record(1);
        s.record(2);
        assert_eq!(s.predict_next(), Some(0));
    }

    #[test]
    fn a_forward_only_loop_moves_from_pass_to_pass_and_stays_bounded() {
        let pass = [3, 0, 1, 2, 3];
        let mut s = Schedule::new(4);
        // With no pass to follow, the record stops at the limit and starts over.
        s.enter(Phase::Forward);
        for _ in 0..1000 {
            for u in pass {
                s.record(u);
                assert!(s.current[0].len() <= PASS_LIMIT * 4);
            }
        }
        // After a training step, evaluation passes repeat the recorded forward pass: each one is
        // a pass of its own, and every unit after the first is predicted.
        s.enter(Phase::Backward);
        s.end_step();
        s.enter(Phase::Forward);
        for u in pass {
            s.record(u);
        }
        s.enter(Phase::Backward);
        s.end_step();
        s.enter(Phase::Forward);
        for _ in 0..1000 {
            for (i, u) in pass.into_iter().enumerate() {
                if i > 0 {
                    assert_eq!(s.predict_next(), Some(u));
                }
                s.record(u);
            }
            assert_eq!(s.current[0].len(), pass.len());
        }
    }

    #[test]
    fn a_step_trained_is_one_that_entered_a_backward_pass() {
        let mut s = Schedule::new(2);
        assert!(!s.last_step_trained());
        s.enter(Phase::Forward);
        s.record(0);
        s.enter(Phase::Backward);
        assert!(!s.last_step_trained(), "the step has not ended");
        s.end_step();
        assert!(s.last_step_trained());
        // An evaluation step: forward only.
        s.enter(Phase::Forward);
        s.record(0);
        s.end_step();
        assert!(!s.last_step_trained());
        // Gradients with no backward hook enter the backward pass too.
        s.enter(Phase::Backward);
        s.end_step();
        assert!(s.last_step_trained());
        // An empty step.
        s.end_step();
        assert!(!s.last_step_trained());
    }

    #[test]
    fn nothing_is_predicted_outside_a_phase() {
        let s = Schedule::new(2);
        assert_eq!(s.predict_next(), None);
    }
}
