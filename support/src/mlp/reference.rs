//! The unsharded reference trainer of the example model.

use super::*;

/// The unsharded trainer: every parameter whole, gradients of each rank's micro-batch combined
/// as the engine's [`GradPath`] does, the same optimizer arithmetic. With experts, one copy of
/// the model per group of expert ranks: the dense parameters' gradients combined over every
/// rank (the copies stay equal), the expert parameters' over the copy's ranks only.
pub struct Reference {
    model: Mlp,
    world_size: usize,
    optimizer: OptimizerConfig,
    recipe: Recipe,
    path: GradPath,
    trainable: Vec<bool>,
    /// Each parameter's learning-rate scale and whether weight decay applies.
    settings: Vec<(f32, bool)>,
    copies: Vec<CopyState>,
    /// bf16 moments round as the engine's do, by each element's group and place in its layout
    /// at this world size.
    moment_dtype: DType,
    layout: Vec<(usize, usize)>,
    steps: u64,
}

/// One copy of the reference's parameters and optimizer state, in id order.
struct CopyState {
    /// Current values, as rounded to the dtype.
    values: Vec<Vec<f32>>,
    masters: Vec<Vec<f32>>,
    moments: Vec<(Vec<f32>, Vec<f32>)>,
    grads: Vec<Vec<f32>>,
}

struct PassGrads<'a> {
    values: &'a [Vec<f32>],
    grads: Vec<Option<Vec<f32>>>,
}

impl Params for PassGrads<'_> {
    fn hook(&mut self, _: Hook, _: Unit) -> Result<()> {
        Ok(())
    }
    fn value(&mut self, param: ParamId) -> Result<Vec<f32>> {
        Ok(self.values[param.0].clone())
    }
    fn grad(&mut self, param: ParamId, grad: &[f32]) -> Result<()> {
        self.grads[param.0] = Some(grad.to_vec());
        Ok(())
    }
}

impl Reference {
    /// A reference for `world_size` ranks, starting from `init` (rounded to the dtype), with
    /// `config`'s optimizer and gradient path, and `recipe`.
    pub fn new(
        model: Mlp,
        init: &[Vec<f32>],
        world_size: usize,
        config: &EngineConfig,
        recipe: Recipe,
    ) -> Result<Reference> {
        Reference::hybrid(model, init, (1, world_size), config, recipe)
    }

    /// A reference for hybrid sharding: `replicas` of `shard_size` ranks, each rank with its
    /// own micro-batches.
    pub fn hybrid(
        model: Mlp,
        init: &[Vec<f32>],
        (replicas, shard_size): (usize, usize),
        config: &EngineConfig,
        recipe: Recipe,
    ) -> Result<Reference> {
        let world_size = replicas * shard_size;
        let optimizer = config.optimizer;
        let path = GradPath::hybrid(config, replicas, shard_size);
        let spec = model.spec()?;
        let dtype = model.config.dtype;
        let zeros = |v: &Vec<f32>| vec![0f32; v.len()];
        let plan = Plan::hybrid(&spec, replicas, shard_size)?;
        let copies = (0..model.experts.map_or(1, |size| world_size / size))
            .map(|copy| {
                let values: Vec<Vec<f32>> = model
                    .copy_init(init, copy)
                    .iter()
                    .map(|v| round_to(dtype, v))
                    .collect();
                CopyState {
                    masters: values.clone(),
                    moments: values.iter().map(|v| (zeros(v), zeros(v))).collect(),
                    grads: values.iter().map(zeros).collect(),
                    values,
                }
            })
            .collect();
        Ok(Reference {
            layout: plan
                .params()
                .iter()
                .map(|p| (p.group(), p.offset()))
                .collect(),
            moment_dtype: config.moment_dtype,
            trainable: spec.params.iter().map(|p| p.trainable).collect(),
            settings: spec
                .params
                .iter()
                .map(|p| (p.lr_scale, p.weight_decay))
                .collect(),
            copies,
            model,
            world_size,
            optimizer,
            recipe,
            path,
            steps: 0,
        })
    }

    /// Current values of every parameter, in id order (of the first copy, with experts).
    pub fn values(&self) -> &[Vec<f32>] {
        &self.copies[0].values
    }

    /// Current values of copy `copy` (its index among the groups of expert ranks), in id order.
    pub fn copy_values(&self, copy: usize) -> Option<&[Vec<f32>]> {
        self.copies.get(copy).map(|c| &c.values[..])
    }

    /// Copies of the parameters: one per group of expert ranks, 1 without experts.
    pub fn copies(&self) -> usize {
        self.copies.len()
    }

    /// The 2-norm and largest magnitude of the step's whole gradient: squares summed in f64 in
    /// parameter order, an expert parameter's of every copy.
    fn grad_norm(&self) -> GradNorm {
        let trainable = || {
            self.copies.iter().enumerate().flat_map(move |(copy, c)| {
                c.grads
                    .iter()
                    .enumerate()
                    .filter(move |&(i, _)| {
                        self.trainable[i] && (copy == 0 || self.model.is_expert(ParamId(i)))
                    })
                    .map(|(_, g)| g)
            })
        };
        let sum: f64 = trainable()
            .flat_map(|g| g.iter())
            .map(|&g| f64::from(g) * f64::from(g))
            .sum();
        let top = trainable()
            .flat_map(|g| g.iter())
            .map(|g| g.to_bits() & 0x7FFF_FFFF)
            .max()
            .unwrap_or(0);
        GradNorm {
            l2: sum.sqrt() as f32,
            max: f32::from_bits(top),
        }
    }

    /// One step of `passes` micro-batches per rank; returns the mean loss over ranks and passes
    /// and the gradient norm before clipping.
    pub fn step(&mut self, step: u64, passes: u64) -> Result<(f32, GradNorm)> {
        let mut loss = 0.0;
        let params = self.trainable.len();
        // grads[param][pass][rank]; a parameter without a gradient in a pass gets zeros, as the
        // engine's slot does.
        let mut grads: Vec<Vec<Vec<Vec<f32>>>> = vec![Vec::new(); params];
        for pass in 0..passes {
            for g in &mut grads {
                g.push(Vec::new());
            }
            for rank in 0..self.world_size {
                let (x, y) = self.model.batch(step, pass, rank)?;
                let values = &self.copies[self.model.copy_of(rank)].values;
                let mut pg = PassGrads {
                    values,
                    grads: vec![None; params],
                };
                loss += self.model.pass(&mut pg, &x, &y)?;
                for (i, g) in pg.grads.into_iter().enumerate() {
                    let g = g.unwrap_or_else(|| vec![0.0; values[i].len()]);
                    if let Some(current) = grads[i].last_mut() {
                        current.push(g);
                    }
                }
            }
        }
        let copies = self.copies.len();
        let ranks_per_copy = self.world_size / copies;
        for (i, g) in grads.iter().enumerate() {
            if !self.trainable[i] {
                continue;
            }
            if self.model.is_expert(ParamId(i)) {
                for (copy, state) in self.copies.iter_mut().enumerate() {
                    let block = copy * ranks_per_copy..(copy + 1) * ranks_per_copy;
                    let own: Vec<Vec<Vec<f32>>> =
                        g.iter().map(|pass| pass[block.clone()].to_vec()).collect();
                    state.grads[i] = self.path.combine(&own);
                }
            } else {
                let combined = self.path.combine(g);
                for state in &mut self.copies {
                    state.grads[i] = combined.clone();
                }
            }
        }
        self.steps += 1;
        let norm = self.grad_norm();
        let grad_scale = self
            .recipe
            .clip
            .map_or(1.0, |max| norm.clip_coefficient(max));
        let lr = self.optimizer.lr() * self.recipe.schedule.factor(step);
        let optimizer = self
            .optimizer
            .with_lr_and_decay(lr, self.optimizer.weight_decay())?;
        let dtype = self.model.config.dtype;
        for i in 0..params {
            if !self.trainable[i] {
                continue;
            }
            let (lr_scale, decay) = self.settings[i];
            let update = optimizer.coefficients(
                self.steps,
                GroupSettings {
                    lr_scale,
                    decay,
                    grad_scale,
                },
            );
            let (group, offset) = self.layout[i];
            let seed = moment_seed(self.steps, group);
            let moment_dtype = self.moment_dtype;
            let stored = |x: f32, j: usize, which: u32| match moment_dtype {
                DType::Bf16 => {
                    let bits = rounding_bits(seed, (offset + j) as u64, which);
                    half::bf16::from_bits(bf16_stochastic(x, bits)).to_f32()
                }
                _ => x,
            };
            for state in &mut self.copies {
                let (m, v) = &mut state.moments[i];
                for j in 0..state.values[i].len() {
                    let g = state.grads[i][j];
                    let p = state.masters[i][j];
                    let p = match update {
                        Update::Sgd {
                            lr,
                            weight_decay,
                            grad_scale,
                        } => sgd_element(p, g, lr, weight_decay, grad_scale),
                        Update::AdamW(c) => {
                            let (p, mj, vj) = adamw_element(p, m[j], v[j], g, &c);
                            m[j] = stored(mj, j, 0);
                            v[j] = stored(vj, j, 1);
                            p
                        }
                    };
                    state.masters[i][j] = p;
                }
                state.values[i] = round_to(dtype, &state.masters[i]);
            }
        }
        Ok((loss / (passes as usize * self.world_size) as f32, norm))
    }
}
