//! Memory-mapped safetensors checkpoints, single-file or sharded.
//!
//! We route tensor names to files ourselves (rather than through candle's `VarBuilder`) so that a
//! missing tensor or a shape mismatch is reported with the file it came from and the shape the
//! config implies, instead of a bare "cannot find tensor".

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use crate::error::WeightError;

pub struct WeightFiles {
    dir: PathBuf,
    files: Vec<(PathBuf, MmapedSafetensors)>,
    /// tensor name -> index into `files`
    route: HashMap<String, usize>,
}

impl std::fmt::Debug for WeightFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightFiles")
            .field("dir", &self.dir)
            .field(
                "files",
                &self.files.iter().map(|(p, _)| p).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl WeightFiles {
    /// Opens `dir/model.safetensors.index.json` (sharded) or `dir/model.safetensors`.
    pub fn open_dir(dir: impl AsRef<Path>) -> Result<Self, WeightError> {
        let dir = dir.as_ref();
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let paths: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| WeightError::Read {
                path: index.clone(),
                message: e.to_string(),
            })?;
            let value: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| WeightError::Read {
                    path: index.clone(),
                    message: format!("not valid JSON: {e}"),
                })?;
            let map = value
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| WeightError::Read {
                    path: index.clone(),
                    message: "no `weight_map` object".into(),
                })?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            return Err(WeightError::NoWeights {
                dir: dir.to_path_buf(),
            });
        };
        Self::open_files(dir, &paths)
    }

    /// Opens an explicit list of safetensors files (all memory-mapped).
    pub fn open_files(dir: &Path, paths: &[PathBuf]) -> Result<Self, WeightError> {
        let mut files = Vec::with_capacity(paths.len());
        let mut route = HashMap::new();
        for path in paths {
            // SAFETY: the file is mapped read-only; as with every mmap loader, the checkpoint must
            // not be modified while the server runs.
            let st = unsafe { MmapedSafetensors::new(path) }.map_err(|e| WeightError::Read {
                path: path.clone(),
                message: e.to_string(),
            })?;
            let idx = files.len();
            for (name, _) in st.tensors() {
                route.insert(name, idx);
            }
            files.push((path.clone(), st));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            route,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.route.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.route.keys().map(String::as_str)
    }

    /// Loads `name`, checks its shape against `shape`, and converts it to `dtype` on `device`.
    pub fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor, WeightError> {
        let &idx = self
            .route
            .get(name)
            .ok_or_else(|| WeightError::MissingTensor {
                dir: self.dir.clone(),
                name: name.to_string(),
                files: self
                    .files
                    .iter()
                    .map(|(p, _)| {
                        p.file_name()
                            .map(|f| f.to_string_lossy().into_owned())
                            .unwrap_or_default()
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
        let (file, st) = &self.files[idx];
        let view = st.get(name).map_err(|e| WeightError::Load {
            file: file.clone(),
            name: name.into(),
            message: e.to_string(),
        })?;
        if view.shape() != shape {
            return Err(WeightError::ShapeMismatch {
                file: file.clone(),
                name: name.into(),
                expected: shape.to_vec(),
                found: view.shape().to_vec(),
            });
        }
        use safetensors_dtype::is_float;
        if !is_float(view.dtype()) {
            return Err(WeightError::UnsupportedDtype {
                file: file.clone(),
                name: name.into(),
                dtype: format!("{:?}", view.dtype()),
            });
        }
        let t = st.load(name, device).map_err(|e| WeightError::Load {
            file: file.clone(),
            name: name.into(),
            message: e.to_string(),
        })?;
        t.to_dtype(dtype).map_err(|e| WeightError::Load {
            file: file.clone(),
            name: name.into(),
            message: e.to_string(),
        })
    }
}

mod safetensors_dtype {
    use safetensors::Dtype;
    pub fn is_float(d: Dtype) -> bool {
        matches!(d, Dtype::BF16 | Dtype::F16 | Dtype::F32)
    }
}
