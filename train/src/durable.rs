//! Durable file writes: a file reaches its name only whole and on disk.
//!
//! `rename` alone is atomic in the namespace but not durable: after a power loss the new name can
//! point at a file whose data never left the page cache (zero length or zeros on ext4/xfs). So the
//! data is fsynced before the rename, and the directory after it, so the rename itself survives.

use std::fs::File;
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` through `path.<ext>.tmp`, fsyncing the file before the rename and the
/// directory after it. A crash leaves either the old file or the new one, never a torn one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!(
        "{}.tmp",
        path.extension().and_then(|e| e.to_str()).unwrap_or("")
    ));
    write_synced(&tmp, bytes)?;
    std::fs::rename(&tmp, path)?;
    sync_parent(path)
}

/// Creates `path` with `bytes` and fsyncs it (no rename: for files inside a directory that is
/// itself renamed into place once complete).
pub fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = File::create(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// Fsyncs a directory, so the names created or renamed in it are on disk.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    // Only Unix can open a directory as a file to fsync it; elsewhere renames are journaled by the
    // file system and there is nothing to call.
    #[cfg(unix)]
    File::open(dir)?.sync_all()?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Fsyncs the directory holding `path` (the current directory for a bare file name).
pub fn sync_parent(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => sync_dir(p),
        _ => sync_dir(Path::new(".")),
    }
}
