//! TensorBoard event files (`train.log = ["jsonl", "tensorboard"]`): scalars a run logs, in the
//! format TensorBoard's readers (`tensorboard.backend.event_processing`) take.
//!
//! A file `events.out.tfevents.<unix seconds>.<host>.tallow` under `output_dir/tensorboard/`
//! (one per process: a resumed run adds a file, which TensorBoard reads with the first) is a
//! sequence of TFRecords, each:
//!
//! ```text
//! u64 length (little-endian) | u32 masked CRC-32C of those 8 bytes | data | u32 masked CRC-32C of data
//! ```
//!
//! where masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8, and data is a protobuf `Event`
//! (tensorflow/core/util/event.proto): the first record holds `file_version = "brain.Event:2"`,
//! each later one a step and a `Summary` of scalar values (`simple_value`). Records are flushed
//! as they are written, so a killed run loses at most the record being written (TensorBoard's
//! reader stops at a truncated last record).

use std::io::Write;
use std::path::{Path, PathBuf};

/// `tensorflow.Event`, the fields tallow writes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` with a scalar.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
}

/// TFRecord's masked CRC-32C.
pub fn masked_crc(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
        .rotate_right(15)
        .wrapping_add(0xa282_ead8)
}

/// One TFRecord around `data`.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// The events in a TFRecord file's bytes; an error names the record and what is wrong
/// (a CRC mismatch, a truncated record, a protobuf that does not decode).
pub fn read_events(bytes: &[u8]) -> Result<Vec<Event>, String> {
    use prost::Message;
    let mut events = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let n = events.len();
        let head = bytes
            .get(at..at + 12)
            .ok_or(format!("record {n}: truncated header"))?;
        let len = u64::from_le_bytes(head[..8].try_into().expect("8 bytes")) as usize;
        if masked_crc(&head[..8]).to_le_bytes() != head[8..12] {
            return Err(format!("record {n}: length CRC mismatch"));
        }
        let data = bytes
            .get(at + 12..at + 12 + len)
            .ok_or(format!("record {n}: truncated data"))?;
        let crc = bytes
            .get(at + 12 + len..at + 16 + len)
            .ok_or(format!("record {n}: truncated data CRC"))?;
        if masked_crc(data).to_le_bytes() != crc {
            return Err(format!("record {n}: data CRC mismatch"));
        }
        events.push(Event::decode(data).map_err(|e| format!("record {n}: {e}"))?);
        at += 16 + len;
    }
    Ok(events)
}

/// An open event file.
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// Creates `dir/events.out.tfevents.<secs>.<host>.tallow` and writes its version record.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let now = wall_time();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let path = dir.join(format!("events.out.tfevents.{}.{host}.tallow", now as u64));
        Self::create_at(path, now)
    }

    /// Creates the event file `path` whose version record has wall time `now`.
    pub fn create_at(path: PathBuf, now: f64) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        let mut w = Self { path, file };
        w.write(&Event {
            wall_time: now,
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        })?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the scalars `(tag, value)` of `step`, one event, and flushes.
    pub fn scalars(&mut self, step: usize, values: &[(&str, f64)]) -> std::io::Result<()> {
        self.scalars_at(step, wall_time(), values)
    }

    /// [`EventWriter::scalars`] at wall time `now`.
    pub fn scalars_at(
        &mut self,
        step: usize,
        now: f64,
        values: &[(&str, f64)],
    ) -> std::io::Result<()> {
        self.write(&Event {
            wall_time: now,
            step: step as i64,
            file_version: None,
            summary: Some(Summary {
                value: values
                    .iter()
                    .map(|(tag, v)| SummaryValue {
                        tag: tag.to_string(),
                        simple_value: Some(*v as f32),
                    })
                    .collect(),
            }),
        })
    }

    fn write(&mut self, e: &Event) -> std::io::Result<()> {
        use prost::Message;
        self.file.write_all(&record(&e.encode_to_vec()))?;
        self.file.flush()
    }
}

fn wall_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRC-32C's check value (crc32c("123456789") = 0xE3069283), and TFRecord's mask of it
    /// written as TensorFlow's `crc32c::Mask` writes it.
    #[test]
    #[allow(clippy::manual_rotate)]
    fn masked_crc_of_the_check_string() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        let c: u32 = 0xE306_9283;
        assert_eq!(
            masked_crc(b"123456789"),
            ((c >> 15) | (c << 17)).wrapping_add(0xa282_ead8)
        );
    }

    /// TensorBoard's own reader (`EventAccumulator`, tensorboard 2.20, through
    /// `scripts/read_tensorboard_fixture.py`) read `tests/fixtures/tensorboard/
    /// events.out.tfevents.0.fixture.tallow` into `tensorboard.json`; the writer, given the same
    /// steps, values and wall times, writes that file byte for byte. Regenerate:
    /// `TALLOW_REGEN_TB=1 cargo test -p tallow-trainer --lib tensorboard`, then the script.
    #[test]
    fn tensorboards_reader_reads_what_the_writer_writes() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tensorboard");
        let name = "events.out.tfevents.0.fixture.tallow";
        type Step<'a> = (usize, f64, Vec<(&'a str, f64)>); // (step, wall time, scalars)
        let steps: Vec<Step> = (1..=3)
            .map(|s| {
                let s64 = s as f64;
                (
                    s,
                    1000.0 + s64,
                    vec![
                        ("train/loss", 2.0 / s64),
                        ("train/learning_rate", 1e-4 * s64),
                        ("memory/peak_backward_mib", 512.5),
                    ],
                )
            })
            .chain([(3, 1003.5, vec![("eval/loss", 0.75)])])
            .collect();
        let tmp = std::env::temp_dir().join(format!("tallow-tb-fixture-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        let path = tmp.join(name);
        let _ = std::fs::remove_file(&path);
        let mut w = EventWriter::create_at(path.clone(), 1000.0).unwrap();
        for (step, t, values) in &steps {
            w.scalars_at(*step, *t, values).unwrap();
        }
        let bytes = std::fs::read(&path).unwrap();
        if std::env::var_os("TALLOW_REGEN_TB").is_some() {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(name), &bytes).unwrap();
        }
        assert_eq!(
            bytes,
            std::fs::read(dir.join(name)).unwrap(),
            "writer output changed"
        );
        // What TensorBoard's reader made of those bytes: every scalar, step and wall time.
        let read: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("tensorboard.json")).unwrap())
                .unwrap();
        let mut n = 0;
        for (step, t, values) in &steps {
            for (tag, v) in values {
                let got = read["scalars"][tag]
                    .as_array()
                    .unwrap_or_else(|| panic!("TensorBoard read no {tag}"))
                    .iter()
                    .find(|e| e["step"] == *step as u64)
                    .unwrap_or_else(|| panic!("TensorBoard read no {tag} at step {step}"));
                assert_eq!(got["value"].as_f64().unwrap(), *v as f32 as f64, "{tag}");
                assert_eq!(got["wall_time"].as_f64().unwrap(), *t, "{tag}");
                n += 1;
            }
        }
        assert_eq!(read["count"].as_u64().unwrap(), n);
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    /// Records read back; a flipped byte or a cut file is an error naming the record.
    #[test]
    fn records_round_trip_and_corruption_is_caught() {
        let dir = std::env::temp_dir().join(format!("tallow-tb-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut w = EventWriter::create(&dir).unwrap();
        w.scalars(3, &[("train/loss", 1.25), ("train/learning_rate", 1e-4)])
            .unwrap();
        w.scalars(4, &[("eval/loss", 0.5)]).unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        let ev = read_events(&bytes).unwrap();
        assert_eq!(ev.len(), 3);
        assert_eq!(ev[0].file_version.as_deref(), Some("brain.Event:2"));
        let s = ev[1].summary.as_ref().unwrap();
        assert_eq!(ev[1].step, 3);
        assert_eq!(s.value[0].tag, "train/loss");
        assert_eq!(s.value[0].simple_value, Some(1.25));
        assert_eq!(s.value[1].simple_value, Some(1e-4));
        assert_eq!(ev[2].step, 4);
        let mut bad = bytes.clone();
        let last = bad.len() - 6;
        bad[last] ^= 1;
        assert_eq!(
            read_events(&bad).unwrap_err(),
            "record 2: data CRC mismatch"
        );
        assert_eq!(
            read_events(&bytes[..bytes.len() - 2]).unwrap_err(),
            "record 2: truncated data CRC"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
