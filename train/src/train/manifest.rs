//! A checkpoint's `manifest.json`: the size and SHA-256 of every other file in it, checked
//! before a resume reads a byte of them.
//!
//! Why: a damaged checkpoint otherwise loads without complaint. Four overwritten bytes in
//! `optimizer.safetensors` resumed into non-finite steps, and a truncated `model.safetensors`
//! (which a resume never reads: the f32 master weights come from the optimizer file) went
//! unnoticed until serving. The manifest is written last, after every listed file is fsynced, and
//! the directory is renamed into place only after that, so a checkpoint either carries a manifest
//! that matches its files or is damaged, and the check says which file and how.
//!
//! The manifest is an extra file: `config.json` and `model.safetensors` stay exactly the z-lab
//! files that z-lab, SGLang and vLLM load. The digests are SHA-256 in hex, the same as
//! `sha256sum` prints, so a checkpoint can also be checked by hand.

use std::collections::BTreeMap;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

pub const MANIFEST_FILE: &str = "manifest.json";
const FORMAT: &str = "dflash-checkpoint-manifest/1";

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FileEntry {
    pub bytes: u64,
    /// SHA-256 of the file, lowercase hex.
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    pub format: String,
    /// File name (inside the checkpoint directory) -> its size and digest.
    pub files: BTreeMap<String, FileEntry>,
}

impl Default for Manifest {
    fn default() -> Self {
        Self {
            format: FORMAT.into(),
            files: BTreeMap::new(),
        }
    }
}

impl Manifest {
    /// Records `bytes` as the content of `name`; call with exactly the bytes written.
    pub fn add(&mut self, name: &str, bytes: &[u8]) {
        self.files.insert(
            name.to_string(),
            FileEntry {
                bytes: bytes.len() as u64,
                sha256: hex(&Sha256::digest(bytes)),
            },
        );
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("manifest serializes")
    }
}

/// Why a checkpoint directory fails verification; each names the file to look at.
#[derive(Debug, thiserror::Error)]
pub enum IntegrityError {
    #[error("{path} is missing, so nothing in the checkpoint can be verified (it was written by a dflash-train without checkpoint checksums, or copied without it)")]
    NoManifest { path: PathBuf },
    #[error("{path} is not a checkpoint manifest: {message}")]
    BadManifest { path: PathBuf, message: String },
    #[error("{path} does not list {file}, which every checkpoint has")]
    NotListed { path: PathBuf, file: String },
    #[error("{path} is missing (the manifest lists it)")]
    Missing { path: PathBuf },
    #[error("{path} is truncated: {actual} bytes of the {expected} written")]
    Truncated {
        path: PathBuf,
        actual: u64,
        expected: u64,
    },
    #[error("{path} grew after it was written: {actual} bytes, {expected} written")]
    Grown {
        path: PathBuf,
        actual: u64,
        expected: u64,
    },
    #[error("{path} does not match the SHA-256 in the manifest: the file changed after it was written (sha256 {actual}, written as {expected})")]
    Checksum {
        path: PathBuf,
        actual: String,
        expected: String,
    },
    #[error("cannot read {path}: {message}")]
    Read { path: PathBuf, message: String },
}

/// Checks every file the manifest of `dir` lists (sizes first, so a truncated file is named
/// without hashing gigabytes), and that it lists each of `required`.
pub fn verify(dir: &Path, required: &[&str]) -> Result<Manifest, IntegrityError> {
    let path = dir.join(MANIFEST_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(IntegrityError::NoManifest { path })
        }
        Err(e) => {
            return Err(IntegrityError::Read {
                path,
                message: e.to_string(),
            })
        }
    };
    let manifest: Manifest =
        serde_json::from_str(&text).map_err(|e| IntegrityError::BadManifest {
            path: path.clone(),
            message: e.to_string(),
        })?;
    if manifest.format != FORMAT {
        return Err(IntegrityError::BadManifest {
            path,
            message: format!("format `{}`, expected `{FORMAT}`", manifest.format),
        });
    }
    if let Some(file) = required.iter().find(|f| !manifest.files.contains_key(**f)) {
        return Err(IntegrityError::NotListed {
            path,
            file: file.to_string(),
        });
    }
    for (name, entry) in &manifest.files {
        let file = dir.join(name);
        let actual = match std::fs::metadata(&file) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(IntegrityError::Missing { path: file })
            }
            Err(e) => {
                return Err(IntegrityError::Read {
                    path: file,
                    message: e.to_string(),
                })
            }
        };
        let (path, expected) = (file, entry.bytes);
        if actual < expected {
            return Err(IntegrityError::Truncated {
                path,
                actual,
                expected,
            });
        }
        if actual > expected {
            return Err(IntegrityError::Grown {
                path,
                actual,
                expected,
            });
        }
    }
    for (name, entry) in &manifest.files {
        let file = dir.join(name);
        let digest = sha256_of_file(&file).map_err(|e| IntegrityError::Read {
            path: file.clone(),
            message: e.to_string(),
        })?;
        if digest != entry.sha256 {
            return Err(IntegrityError::Checksum {
                path: file,
                actual: digest,
                expected: entry.sha256.clone(),
            });
        }
    }
    Ok(manifest)
}

/// Streams the file through SHA-256 (an optimizer file can be many GiB; it is never held whole).
fn sha256_of_file(path: &Path) -> std::io::Result<String> {
    let f = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut BufReader::with_capacity(1 << 20, f), &mut hasher)?;
    Ok(hex(&hasher.finalize()))
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}
