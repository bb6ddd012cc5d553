//! TensorBoard event files (`events.out.tfevents.*`) with scalar summaries, written by hand:
//! the format is small and the crates that write it pull in protobuf stacks.
//!
//! A file is a sequence of TFRecords: `u64 len (LE)`, `u32 masked_crc32c(len bytes)`, the
//! payload, `u32 masked_crc32c(payload)`. Each payload is an `Event` protobuf: `wall_time`
//! (field 1, double), `step` (2, int64), `file_version` (3, string, first record
//! "brain.Event:2"), `summary` (5, message) holding repeated `Summary.Value` (1) with `tag` (1,
//! string) and `simple_value` (2, float). [`read_scalars`] decodes files back (for tests).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bitwise table.
fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, e) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 == 1 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
            }
            *e = c;
        }
        t
    });
    let mut crc = !0u32;
    for &b in data {
        crc = table[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn field_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, field << 3 | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn event(wall_time: f64, step: i64, body: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut e = Vec::new();
    e.push(1 << 3 | 1);
    e.extend_from_slice(&wall_time.to_le_bytes());
    varint(&mut e, 2 << 3);
    varint(&mut e, step as u64);
    body(&mut e);
    e
}

/// Appends scalars to one event file.
pub struct EventWriter {
    out: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `dir/events.out.tfevents.<secs>.<host>` and writes the version record.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "dflash".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            now.as_secs(),
            std::process::id()
        ));
        let mut w = Self {
            out: BufWriter::new(File::create(&path)?),
            path,
        };
        let version = event(now.as_secs_f64(), 0, |e| {
            field_bytes(e, 3, b"brain.Event:2")
        });
        w.record(&version)?;
        w.out.flush()?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn record(&mut self, payload: &[u8]) -> std::io::Result<()> {
        let len = (payload.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc(&len).to_le_bytes())?;
        self.out.write_all(payload)?;
        self.out.write_all(&masked_crc(payload).to_le_bytes())
    }

    /// One event holding every `(tag, value)` at `step`; flushed so TensorBoard sees it live.
    pub fn scalars(&mut self, step: i64, values: &[(&str, f64)]) -> std::io::Result<()> {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let payload = event(wall, step, |e| {
            let mut summary = Vec::new();
            for (tag, v) in values {
                let mut value = Vec::new();
                field_bytes(&mut value, 1, tag.as_bytes());
                value.push(2 << 3 | 5);
                value.extend_from_slice(&(*v as f32).to_le_bytes());
                field_bytes(&mut summary, 1, &value);
            }
            field_bytes(e, 5, &summary);
        });
        self.record(&payload)?;
        self.out.flush()
    }
}

/// One decoded scalar: `(step, tag, value, wall_time)`.
pub type Scalar = (i64, String, f32, f64);

struct Reader<'a> {
    b: &'a [u8],
    i: usize,
}

impl Reader<'_> {
    fn varint(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *self.b.get(self.i).ok_or("truncated varint")?;
            self.i += 1;
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("varint too long".into())
    }
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let s = self.b.get(self.i..self.i + n).ok_or("truncated field")?;
        self.i += n;
        Ok(s)
    }
    /// Calls `f(field, wire_type, value)` for each field; value is the payload slice for
    /// length-delimited and fixed fields, empty for varints (whose value is passed as `v`).
    fn fields(
        mut self,
        mut f: impl FnMut(u64, &[u8], u64) -> Result<(), String>,
    ) -> Result<(), String> {
        while self.i < self.b.len() {
            let key = self.varint()?;
            let (field, wire) = (key >> 3, key & 7);
            match wire {
                0 => {
                    let v = self.varint()?;
                    f(field, &[], v)?
                }
                1 => f(field, self.take(8)?, 0)?,
                2 => {
                    let n = self.varint()? as usize;
                    f(field, self.take(n)?, 0)?
                }
                5 => f(field, self.take(4)?, 0)?,
                w => return Err(format!("unsupported wire type {w}")),
            }
        }
        Ok(())
    }
}

/// Decodes every scalar of an event file, checking both CRCs of every record.
pub fn read_scalars(path: &Path) -> Result<Vec<Scalar>, String> {
    let data = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    let mut i = 0;
    while i < data.len() {
        let head = data.get(i..i + 12).ok_or("truncated record header")?;
        let len = u64::from_le_bytes(head[..8].try_into().expect("8 bytes")) as usize;
        if masked_crc(&head[..8]).to_le_bytes() != head[8..12] {
            return Err(format!("bad length crc at byte {i}"));
        }
        let payload = data.get(i + 12..i + 12 + len).ok_or("truncated record")?;
        let crc = data
            .get(i + 12 + len..i + 16 + len)
            .ok_or("truncated crc")?;
        if masked_crc(payload).to_le_bytes() != crc {
            return Err(format!("bad payload crc at byte {i}"));
        }
        i += 16 + len;
        let (mut step, mut wall, mut values) = (0i64, 0f64, Vec::new());
        Reader { b: payload, i: 0 }.fields(|field, bytes, v| {
            match field {
                1 => wall = f64::from_le_bytes(bytes.try_into().map_err(|_| "wall_time")?),
                2 => step = v as i64,
                5 => Reader { b: bytes, i: 0 }.fields(|vf, vb, _| {
                    if vf == 1 {
                        let (mut tag, mut val) = (String::new(), f32::NAN);
                        Reader { b: vb, i: 0 }.fields(|f, b, _| {
                            match f {
                                1 => tag = String::from_utf8_lossy(b).into_owned(),
                                2 => val = f32::from_le_bytes(b.try_into().map_err(|_| "value")?),
                                _ => {}
                            }
                            Ok(())
                        })?;
                        values.push((tag, val));
                    }
                    Ok(())
                })?,
                _ => {}
            }
            Ok(())
        })?;
        out.extend(values.into_iter().map(|(t, v)| (step, t, v, wall)));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC-32C check value of "123456789" (RFC 3720 / the Castagnoli catalogue).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn scalars_decode_back_with_valid_crcs() {
        let dir = std::env::temp_dir().join(format!("tfevents-test-{}", std::process::id()));
        let mut w = EventWriter::create(&dir).unwrap();
        w.scalars(3, &[("train/loss", 2.5), ("train/acc", 0.25)])
            .unwrap();
        w.scalars(7, &[("train/loss", 1.5)]).unwrap();
        let path = w.path().to_path_buf();
        drop(w);
        let s = read_scalars(&path).unwrap();
        let view: Vec<_> = s
            .iter()
            .map(|(st, t, v, _)| (*st, t.as_str(), *v))
            .collect();
        assert_eq!(
            view,
            vec![
                (3, "train/loss", 2.5),
                (3, "train/acc", 0.25),
                (7, "train/loss", 1.5)
            ]
        );
        // A flipped byte is caught by the payload CRC.
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        assert!(read_scalars(&path).unwrap_err().contains("crc"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
