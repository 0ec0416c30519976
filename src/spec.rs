//! What a caller declares: the parameters of a model.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::types::DType;

/// The largest model file [`ModelSpec::from_path`] reads: far above a model of a million
/// parameters, far below what a file passed by mistake (a checkpoint's data) holds.
pub const MAX_MODEL_FILE_BYTES: u64 = 1 << 30;

/// One parameter as a caller declares it.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    /// Dimensions; empty for a scalar.
    pub shape: Vec<u64>,
    pub dtype: DType,
    /// The FSDP unit (a layer) the parameter belongs to; `None` for parameters outside every unit.
    pub unit: Option<u32>,
    pub trainable: bool,
    /// Shared between the input embedding and the output head.
    pub tied: bool,
    /// Whether the optimizer's weight decay applies (LLM recipes exempt biases, norms and
    /// embeddings).
    pub weight_decay: bool,
    /// The parameter's learning rate is the engine's times this (finite, >= 0).
    pub lr_scale: f32,
    /// The process group ([`ModelSpec::process_groups`]) whose ranks shard the parameter;
    /// `None` for the data-parallel world.
    pub process_group: Option<String>,
}

impl ParamSpec {
    /// A trainable, untied parameter outside every unit.
    pub fn new(name: impl Into<String>, shape: &[u64], dtype: DType) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            dtype,
            unit: None,
            trainable: true,
            tied: false,
            weight_decay: true,
            lr_scale: 1.0,
            process_group: None,
        }
    }

    /// Places the parameter in FSDP unit `unit`.
    pub fn in_unit(mut self, unit: u32) -> ParamSpec {
        self.unit = Some(unit);
        self
    }

    /// Marks the parameter frozen: gathered for compute, never given a gradient.
    pub fn frozen(mut self) -> ParamSpec {
        self.trainable = false;
        self
    }

    /// Marks the parameter as shared by the input and output ends of the model.
    pub fn tied(mut self) -> ParamSpec {
        self.tied = true;
        self
    }

    /// Exempts the parameter from weight decay.
    pub fn no_weight_decay(mut self) -> ParamSpec {
        self.weight_decay = false;
        self
    }

    /// Scales the parameter's learning rate by `scale`.
    pub fn with_lr_scale(mut self, scale: f32) -> ParamSpec {
        self.lr_scale = scale;
        self
    }

    /// Shards the parameter over the ranks of process group `name` (an expert group, say)
    /// instead of the whole data-parallel world.
    pub fn in_process_group(mut self, name: impl Into<String>) -> ParamSpec {
        self.process_group = Some(name.into());
        self
    }

    /// The element count (none where a dimension is 0), or `None` when the other dimensions
    /// multiply past a `usize`: whatever their order, so that a file's reader never overflows
    /// on the shape.
    pub fn numel(&self) -> Option<usize> {
        let others = self
            .shape
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(1usize, |acc, &d| {
                usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
            })?;
        match self.shape.contains(&0) {
            true => Some(0),
            false => Some(others),
        }
    }
}

/// A process group of `size` ranks other than the data-parallel world, such as the ranks that
/// hold the same experts of a mixture-of-experts model.
///
/// The data-parallel world of `W` ranks splits into `W / size` groups of consecutive ranks:
/// rank `r` is in group `r / size` at place `r % size`. A parameter of the process group has
/// one value per group (its copy: different experts, say), sharded over the group's ranks, and
/// its gradients are summed over them only.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessGroupSpec {
    pub name: String,
    pub size: usize,
}

impl ProcessGroupSpec {
    /// Refuses a size that does not split `world_size` ranks into whole groups.
    pub fn check_divides(&self, world_size: usize) -> Result<()> {
        if self.size == 0 || world_size % self.size != 0 {
            return Err(Error::InvalidProcessGroup {
                name: self.name.clone(),
                reason: format!(
                    "has {} ranks, which do not divide the {world_size} ranks",
                    self.size
                ),
            });
        }
        Ok(())
    }
}

/// A model: its parameters in model order, and the process groups they name.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    pub params: Vec<ParamSpec>,
    pub process_groups: Vec<ProcessGroupSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelFile {
    params: Vec<ParamEntry>,
    #[serde(default)]
    process_groups: Vec<ProcessGroupSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ParamEntry {
    name: String,
    shape: Vec<u64>,
    dtype: String,
    #[serde(default)]
    unit: Option<u32>,
    #[serde(default = "default_true")]
    trainable: bool,
    #[serde(default)]
    tied: bool,
    #[serde(default = "default_true")]
    weight_decay: bool,
    #[serde(default = "default_lr_scale")]
    lr_scale: f32,
    #[serde(default)]
    group: Option<String>,
}

fn default_true() -> bool {
    true
}

fn default_lr_scale() -> f32 {
    1.0
}

impl ModelSpec {
    /// Checks the declared parameters: names non-empty and unique, element counts that fit.
    pub fn new(params: Vec<ParamSpec>) -> Result<ModelSpec> {
        ModelSpec::with_process_groups(params, Vec::new())
    }

    /// As [`ModelSpec::new`], with the process groups the parameters may name: each named
    /// once, of at least one rank; a parameter's group must be one of them.
    pub fn with_process_groups(
        params: Vec<ParamSpec>,
        process_groups: Vec<ProcessGroupSpec>,
    ) -> Result<ModelSpec> {
        let model = ModelSpec {
            params,
            process_groups,
        };
        model.check()?;
        Ok(model)
    }

    /// The checks of [`ModelSpec::with_process_groups`], for a model whose fields were changed
    /// since (they are public): a plan makes them again.
    pub fn check(&self) -> Result<()> {
        let (params, process_groups) = (&self.params, &self.process_groups);
        let mut group_names = std::collections::HashSet::with_capacity(process_groups.len());
        for g in process_groups {
            if g.name.is_empty() || g.size == 0 {
                return Err(Error::InvalidProcessGroup {
                    name: g.name.clone(),
                    reason: "needs a name and at least one rank".into(),
                });
            }
            if !group_names.insert(g.name.as_str()) {
                return Err(Error::InvalidProcessGroup {
                    name: g.name.clone(),
                    reason: "is declared twice".into(),
                });
            }
        }
        if params.is_empty() {
            return Err(Error::EmptyModel);
        }
        let mut seen: HashMap<&str, usize> = HashMap::with_capacity(params.len());
        for (index, p) in params.iter().enumerate() {
            if p.name.is_empty() {
                return Err(Error::EmptyName { index });
            }
            if p.name.contains('\0') {
                return Err(Error::NulInName { index });
            }
            if p.name == crate::export::RESERVED_NAME {
                return Err(Error::ReservedName {
                    name: p.name.clone(),
                });
            }
            if let Some(&first) = seen.get(p.name.as_str()) {
                return Err(Error::DuplicateName {
                    name: p.name.clone(),
                    first,
                    second: index,
                });
            }
            seen.insert(&p.name, index);
            if p.numel().is_none() {
                return Err(Error::NumelOverflow {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                });
            }
            if !(p.lr_scale.is_finite() && p.lr_scale >= 0.0) {
                return Err(Error::InvalidLrScale {
                    name: p.name.clone(),
                    scale: p.lr_scale,
                });
            }
            if let Some(group) = &p.process_group
                && !group_names.contains(group.as_str())
            {
                return Err(Error::UnknownProcessGroup {
                    name: p.name.clone(),
                    group: group.clone(),
                });
            }
        }
        Ok(())
    }

    /// The process group of `param`: its index in [`ModelSpec::process_groups`], `None` for
    /// the data-parallel world.
    pub fn process_group_of(&self, param: &ParamSpec) -> Option<usize> {
        let name = param.process_group.as_ref()?;
        self.process_groups.iter().position(|g| &g.name == name)
    }

    /// Parses a model file's JSON text: `{"params": [{"name", "shape", "dtype", "unit"?,
    /// "trainable"?, "tied"?, "weight_decay"?, "lr_scale"?, "group"?}, ...],
    /// "process_groups"?: [{"name", "size"}, ...]}`, a parameter's `"group"` naming one of the
    /// process groups. A leading UTF-8 byte-order mark is skipped.
    pub fn from_json(text: &str) -> Result<ModelSpec> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let file: ModelFile = serde_json::from_str(text).map_err(|e| {
            // serde_json's message ends with the position, which the error states once itself.
            let message = e.to_string();
            let message = match message.rsplit_once(" at line ") {
                Some((message, _)) => message.to_string(),
                None => message,
            };
            Error::Json {
                line: e.line(),
                column: e.column(),
                message,
            }
        })?;
        let params = file
            .params
            .into_iter()
            .map(|p| {
                let dtype = DType::parse(&p.dtype).ok_or_else(|| Error::UnknownDtype {
                    name: p.name.clone(),
                    given: p.dtype.clone(),
                })?;
                Ok(ParamSpec {
                    name: p.name,
                    shape: p.shape,
                    dtype,
                    unit: p.unit,
                    trainable: p.trainable,
                    tied: p.tied,
                    weight_decay: p.weight_decay,
                    lr_scale: p.lr_scale,
                    process_group: p.group,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        ModelSpec::with_process_groups(params, file.process_groups)
    }

    /// Reads and parses a model file: a regular file of at most [`MAX_MODEL_FILE_BYTES`].
    pub fn from_path(path: &Path) -> Result<ModelSpec> {
        let bytes = crate::fallible::read_file(path, MAX_MODEL_FILE_BYTES).map_err(|source| {
            Error::ModelFile {
                path: path.display().to_string(),
                source: Arc::new(source),
            }
        })?;
        let text = std::str::from_utf8(&bytes).map_err(|e| Error::NotUtf8 {
            path: path.display().to_string(),
            offset: e.valid_up_to(),
        })?;
        ModelSpec::from_json(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_apply_to_omitted_fields() {
        let m = ModelSpec::from_json(
            r#"{"params": [
                {"name": "embed", "shape": [10, 4], "dtype": "bf16", "unit": null, "tied": true},
                {"name": "w", "shape": [4, 4], "dtype": "f32", "unit": 0},
                {"name": "s", "shape": [], "dtype": "f16", "trainable": false},
                {"name": "b", "shape": [4], "dtype": "f32", "weight_decay": false, "lr_scale": 0.5}
            ]}"#,
        )
        .unwrap();
        assert_eq!(
            m.params[0],
            ParamSpec::new("embed", &[10, 4], DType::Bf16).tied()
        );
        assert_eq!(
            m.params[1],
            ParamSpec::new("w", &[4, 4], DType::F32).in_unit(0)
        );
        assert_eq!(m.params[2], ParamSpec::new("s", &[], DType::F16).frozen());
        assert_eq!(m.params[2].numel(), Some(1));
        assert_eq!(
            m.params[3],
            ParamSpec::new("b", &[4], DType::F32)
                .no_weight_decay()
                .with_lr_scale(0.5)
        );
    }

    #[test]
    fn malformed_json_reports_line_and_column() {
        let err = ModelSpec::from_json("{\"params\": [\n  {\"name\": \"a\",, }\n]}").unwrap_err();
        match err {
            Error::Json { line, column, .. } => assert_eq!((line, column), (2, 16)),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn a_position_is_stated_once() {
        let err = ModelSpec::from_json("{\"params\": [\n  {\"name\": \"a\",, }\n]}").unwrap_err();
        let message = err.to_string();
        assert_eq!(message.matches("line").count(), 1, "{message}");
        assert!(
            message.starts_with("malformed model JSON at line 2, column 16: "),
            "{message}"
        );
    }

    #[test]
    fn a_byte_order_mark_is_skipped_and_other_bytes_than_utf8_are_named() {
        let text = "\u{feff}{\"params\": [{\"name\": \"a\", \"shape\": [2], \"dtype\": \"f32\"}]}";
        assert_eq!(ModelSpec::from_json(text).unwrap().params[0].name, "a");
        let dir = std::env::temp_dir().join(format!("fsdp-spec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("latin1.json");
        std::fs::write(&path, b"{\"params\": [{\"name\": \"caf\xe9\"}]}").unwrap();
        let err = ModelSpec::from_path(&path).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(&err, Error::NotUtf8 { offset: 25, .. }), "{err:?}");
        assert!(err.to_string().contains("is not UTF-8"), "{err}");
    }

    #[test]
    fn a_model_file_that_never_ends_is_refused_before_it_is_read() {
        let err = ModelSpec::from_path(Path::new("/dev/zero")).unwrap_err();
        assert!(matches!(&err, Error::ModelFile { .. }), "{err:?}");
        assert!(err.to_string().contains("not a regular file"), "{err}");
    }

    #[test]
    fn unknown_field_is_rejected_with_its_position() {
        let err = ModelSpec::from_json(
            r#"{"params": [{"name": "a", "shape": [1], "dtype": "f32", "trainabel": false}]}"#,
        )
        .unwrap_err();
        assert!(matches!(err, Error::Json { line: 1, .. }), "{err}");
        assert!(err.to_string().contains("trainabel"), "{err}");
    }

    #[test]
    fn unknown_dtype_names_the_param() {
        let err =
            ModelSpec::from_json(r#"{"params": [{"name": "a", "shape": [1], "dtype": "fp8"}]}"#)
                .unwrap_err();
        assert!(
            matches!(&err, Error::UnknownDtype { name, given } if name == "a" && given == "fp8"),
            "{err}"
        );
    }

    #[test]
    fn bad_declarations_are_rejected() {
        let p = |n: &str| ParamSpec::new(n, &[2], DType::F32);
        assert!(matches!(ModelSpec::new(vec![]), Err(Error::EmptyModel)));
        assert!(matches!(
            ModelSpec::new(vec![p("a"), p("")]),
            Err(Error::EmptyName { index: 1 })
        ));
        assert!(matches!(
            ModelSpec::new(vec![p("a"), p("__metadata__")]),
            Err(Error::ReservedName { name }) if name == "__metadata__"
        ));
        assert!(matches!(
            ModelSpec::new(vec![p("a"), p("b"), p("a")]),
            Err(Error::DuplicateName {
                first: 0,
                second: 2,
                ..
            })
        ));
        for scale in [-1.0, f32::NAN, f32::INFINITY] {
            assert!(matches!(
                ModelSpec::new(vec![p("a").with_lr_scale(scale)]),
                Err(Error::InvalidLrScale { name, .. }) if name == "a"
            ));
        }
        let huge = ParamSpec::new("h", &[u64::MAX / 2, 3], DType::F32);
        assert!(matches!(
            ModelSpec::new(vec![huge]),
            Err(Error::NumelOverflow { name, .. }) if name == "h"
        ));
        // A 0 makes no elements, and the other dimensions still multiply within a usize,
        // whatever the order.
        for shape in [[1 << 32, 1 << 32, 0], [0, 1 << 32, 1 << 32]] {
            assert_eq!(ParamSpec::new("e", &shape, DType::F32).numel(), None);
        }
        for shape in [[1 << 62, 0], [0, 1 << 62]] {
            assert_eq!(ParamSpec::new("e", &shape, DType::F32).numel(), Some(0));
        }
    }

    #[test]
    fn missing_file_names_the_path() {
        let err = ModelSpec::from_path(Path::new("no/such/model.json")).unwrap_err();
        assert!(err.to_string().contains("no/such/model.json"), "{err}");
    }
}
