//! A TensorBoard event-file writer for scalar metrics: TFRecord framing (length, masked
//! CRC-32C of the length, the record, masked CRC-32C of the record) around hand-encoded
//! `Event` protocol buffers (wall time, step, one `Summary.Value` with `simple_value` per
//! metric).
//!
//! Written here rather than taken from a crate: the TensorBoard-writing crates pull in a
//! protobuf code generator and image libraries to write what is, for scalars, five protobuf
//! fields. The framing and checksums are tested against TensorBoard's own reader.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Appends scalar events to one `events.out.tfevents.*` file.
pub struct EventWriter {
    path: PathBuf,
    file: BufWriter<File>,
}

impl EventWriter {
    /// Creates a new event file in `dir` (created if missing) and writes its version
    /// record. The name holds the time and the process id, so a resumed run adds a file
    /// beside the first run's; TensorBoard reads every file of the directory.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let now = wall_time();
        let path = dir.join(format!(
            "events.out.tfevents.{}.dppo.{}",
            now as u64,
            std::process::id()
        ));
        let file = BufWriter::new(File::create(&path)?);
        let mut writer = Self { path, file };
        let mut event = Vec::new();
        put_f64(&mut event, 1, now);
        put_bytes(&mut event, 3, b"brain.Event:2");
        writer.record(&event)?;
        writer.file.flush()?;
        Ok(writer)
    }

    /// The event file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one event at `step` holding every `(tag, value)` scalar, and flushes it.
    pub fn scalars<'a>(
        &mut self,
        step: u64,
        values: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> std::io::Result<()> {
        let mut summary = Vec::new();
        for (tag, value) in values {
            let mut v = Vec::new();
            put_bytes(&mut v, 1, tag.as_bytes());
            put_f32(&mut v, 2, value as f32);
            put_bytes(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        put_f64(&mut event, 1, wall_time());
        put_varint_field(&mut event, 2, step);
        put_bytes(&mut event, 5, &summary);
        self.record(&event)?;
        self.file.flush()
    }

    /// One TFRecord: length, its masked CRC, the data, its masked CRC.
    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.file.write_all(&len)?;
        self.file.write_all(&masked_crc32c(&len).to_le_bytes())?;
        self.file.write_all(data)?;
        self.file.write_all(&masked_crc32c(data).to_le_bytes())
    }
}

fn wall_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Protobuf wire types.
const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LEN: u64 = 2;
const FIXED32: u64 = 5;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, field: u64, wire: u64) {
    put_varint(out, (field << 3) | wire);
}

fn put_varint_field(out: &mut Vec<u8>, field: u64, v: u64) {
    put_key(out, field, VARINT);
    put_varint(out, v);
}

fn put_f64(out: &mut Vec<u8>, field: u64, v: f64) {
    put_key(out, field, FIXED64);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_f32(out: &mut Vec<u8>, field: u64, v: f32) {
    put_key(out, field, FIXED32);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    put_key(out, field, LEN);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit: event records are a
/// few hundred bytes once per step, so a table buys nothing.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= byte as u32;
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// TFRecord's masking of a CRC (so that CRCs of CRCs do not degenerate).
fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_values() {
        // The CRC catalogue's check value of CRC-32/ISCSI, and RFC 3720's 32 zero bytes.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    }

    #[test]
    fn varints_encode_as_protobuf_does() {
        let enc = |v: u64| {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            out
        };
        assert_eq!(enc(1), [0x01]);
        assert_eq!(enc(150), [0x96, 0x01]);
        assert_eq!(enc(300), [0xAC, 0x02]);
    }

    #[test]
    fn records_are_framed_with_their_lengths_and_checksums() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(7, [("reward/mean", 0.5)]).unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        let mut at = 0;
        let mut records = 0;
        while at < bytes.len() {
            let len_bytes = &bytes[at..at + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            let crc = |b: &[u8]| u32::from_le_bytes(b.try_into().unwrap());
            assert_eq!(crc(&bytes[at + 8..at + 12]), masked_crc32c(len_bytes));
            let data = &bytes[at + 12..at + 12 + len];
            assert_eq!(
                crc(&bytes[at + 12 + len..at + 16 + len]),
                masked_crc32c(data)
            );
            at += 16 + len;
            records += 1;
        }
        assert_eq!((at, records), (bytes.len(), 2));
    }
}
