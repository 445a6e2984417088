//! Hostile model files: seeded truncations, bit flips and lying headers (tensors claiming
//! 2^40 elements, offsets past the end, huge or negative sizes) of GGUF, safetensors,
//! tokenizer.json and config.json are load errors: never a panic, an abort, or an
//! allocation out of proportion to the file.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;
use std::time::Instant;

use candle_core::Device;
use dppo_model::Policy;
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::util::fixture;

/// The system allocator, noting the largest single request of the thread that armed it.
struct PeakAlloc;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    if ARMED.with(Cell::get) {
        PEAK.with(|p| p.set(p.get().max(size)));
    }
}

// SAFETY: every call forwards to `System` with the caller's arguments.
unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: PeakAlloc = PeakAlloc;

/// Values a lying header puts where a size, a count or an offset belongs.
const LIES: [u64; 8] = [
    1 << 40,
    u64::MAX,
    1 << 63,
    1 << 32,
    (1 << 32) - 1,
    0,
    1,
    i64::MAX as u64,
];

/// Decimal lies for JSON numbers (the same, plus negatives and floats).
const JSON_LIES: [&str; 9] = [
    "1099511627776",
    "18446744073709551615",
    "9223372036854775808",
    "4294967296",
    "-1",
    "0",
    "1e308",
    "-9223372036854775808",
    "3.5",
];

/// One mutation of `bytes`, and what it was.
fn mutate(bytes: &[u8], rng: &mut StdRng, header_end: usize) -> (Vec<u8>, String) {
    let mut out = bytes.to_vec();
    let header_end = header_end.clamp(1, bytes.len());
    let what = match rng.random_range(0..5) {
        0 => {
            let cut = rng.random_range(0..bytes.len());
            out.truncate(cut);
            format!("truncated to {cut} bytes")
        }
        1 => {
            let flips: Vec<usize> = (0..rng.random_range(1..=8))
                .map(|_| rng.random_range(0..header_end * 8))
                .collect();
            for &bit in &flips {
                out[bit / 8] ^= 1 << (bit % 8);
            }
            format!("bits {flips:?} flipped")
        }
        2 => {
            let flips: Vec<usize> = (0..rng.random_range(1..=4))
                .map(|_| rng.random_range(0..bytes.len() * 8))
                .collect();
            for &bit in &flips {
                out[bit / 8] ^= 1 << (bit % 8);
            }
            format!("bits {flips:?} flipped anywhere")
        }
        3 => {
            let width = if rng.random_bool(0.5) { 8 } else { 4 };
            let at = rng.random_range(0..header_end.saturating_sub(width).max(1));
            let lie = LIES[rng.random_range(0..LIES.len())];
            let le = lie.to_le_bytes();
            let end = (at + width).min(out.len());
            out[at..end].copy_from_slice(&le[..end - at]);
            format!("{width} bytes at {at} set to {lie}")
        }
        _ => {
            let at = rng.random_range(0..header_end);
            let len = rng.random_range(1..=64).min(bytes.len() - at);
            out.drain(at..at + len);
            format!("{len} bytes at {at} deleted")
        }
    };
    (out, what)
}

/// A JSON text with one of its numbers replaced by a lie.
fn lie_in_json(text: &str, rng: &mut StdRng) -> Option<(String, String)> {
    let bytes = text.as_bytes();
    let starts: Vec<usize> = (0..bytes.len())
        .filter(|&i| {
            bytes[i].is_ascii_digit()
                && (i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'.'))
        })
        .collect();
    let start = *starts.get(rng.random_range(0..starts.len().max(1)))?;
    let end = (start..bytes.len())
        .find(|&i| !(bytes[i].is_ascii_digit() || b".eE+-".contains(&bytes[i])))
        .unwrap_or(bytes.len());
    let lie = JSON_LIES[rng.random_range(0..JSON_LIES.len())];
    let what = format!(
        "number {:?} at {start} replaced by {lie}",
        &text[start..end]
    );
    Some((format!("{}{lie}{}", &text[..start], &text[end..]), what))
}

/// A safetensors file whose JSON header holds a lie (the length prefix rewritten to fit,
/// so that the lie is what the reader meets).
fn lie_in_safetensors(bytes: &[u8], rng: &mut StdRng) -> Option<(Vec<u8>, String)> {
    let n = u64::from_le_bytes(bytes[..8].try_into().ok()?) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).ok()?;
    let (lied, what) = lie_in_json(header, rng)?;
    let mut out = (lied.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(lied.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    Some((out, format!("header {what}")))
}

/// A GGUF file with a lie in one tensor's record: a dimension (2^40 elements and more) or
/// its data offset (past the end).
fn lie_in_gguf_tensor(bytes: &[u8], rng: &mut StdRng) -> Option<(Vec<u8>, String)> {
    let names = ["token_embd.weight", "blk.0.ffn_up.weight", "output.weight"];
    let name = names[rng.random_range(0..names.len())];
    let at = bytes
        .windows(name.len())
        .position(|w| w == name.as_bytes())?
        + name.len();
    let num_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().ok()?) as usize;
    let field = rng.random_range(0..=num_dims);
    // Dimensions, then the u32 dtype, then the u64 offset.
    let pos = if field < num_dims {
        at + 4 + 8 * field
    } else {
        at + 4 + 8 * num_dims + 4
    };
    let lie = LIES[rng.random_range(0..LIES.len())];
    let mut out = bytes.to_vec();
    out[pos..pos + 8].copy_from_slice(&lie.to_le_bytes());
    let what = if field < num_dims {
        "dimension"
    } else {
        "offset"
    };
    Some((out, format!("{name}: {what} {field} set to {lie}")))
}

/// Loads `spec` as `dppo serve` would (the policy, then its model) with the allocation
/// tracker armed; a panic becomes `Err` with its message. Returns whether it loaded, and
/// the largest single allocation.
fn load_guarded(spec: &Path) -> Result<(bool, usize), String> {
    let spec = spec.to_str().unwrap().to_string();
    PEAK.with(|p| p.set(0));
    ARMED.with(|a| a.set(true));
    let result = std::panic::catch_unwind(|| {
        Policy::load(&spec, &Device::Cpu).and_then(|p| p.model().map(drop))
    });
    ARMED.with(|a| a.set(false));
    match result {
        Ok(loaded) => Ok((loaded.is_ok(), PEAK.with(Cell::get))),
        Err(panic) => Err(panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()),
    }
}

/// Copies the HF fixture `name` into `to`.
fn copy_fixture(name: &str, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(fixture(&format!("hf/{name}"))).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
    }
}

#[test]
fn mutated_model_files_are_errors_not_crashes() {
    let start = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let (llama, sharded) = (dir.path().join("llama"), dir.path().join("sharded"));
    copy_fixture("llama", &llama);
    copy_fixture("llama_tied", &sharded);
    let gguf = dir.path().join("m.gguf");
    let cfg = crate::model_files::gguf_test_config();
    let source = Policy {
        config: cfg.clone(),
        weights: crate::util::random_weights(&cfg, 13),
        tokenizer: dppo_model::presets::task_tokenizer().unwrap(),
    };
    crate::model_files::write_llama_gguf(&source, &gguf);
    // candle's reader divides by `general.alignment`: a zero there is an error too.
    let original = std::fs::read(&gguf).unwrap();
    let key = b"general.alignment";
    let at = original.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    let mut zero = original.clone();
    zero[at + 4..at + 8].copy_from_slice(&0u32.to_le_bytes());
    std::fs::write(&gguf, &zero).unwrap();
    let err = Policy::load(gguf.to_str().unwrap(), &Device::Cpu).unwrap_err();
    assert!(err.to_string().contains("general.alignment"), "{err}");
    std::fs::write(&gguf, &original).unwrap();
    // (file, what loads it, cases)
    let targets = [
        (gguf.clone(), gguf.clone(), 1200),
        (llama.join("model.safetensors"), llama.clone(), 700),
        (llama.join("config.json"), llama.clone(), 400),
        (llama.join("tokenizer.json"), llama.clone(), 400),
        (llama.join("tokenizer_config.json"), llama.clone(), 150),
        (
            sharded.join("model.safetensors.index.json"),
            sharded.clone(),
            100,
        ),
        (
            sharded.join("model-00003-of-00011.safetensors"),
            sharded.clone(),
            50,
        ),
    ];
    let mut rng = StdRng::seed_from_u64(23);
    let (mut failures, mut loaded, mut total) = (Vec::new(), 0, 0);
    for (file, spec, cases) in &targets {
        let original = std::fs::read(file).unwrap();
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let is_json = name.ends_with(".json");
        let header_end = match &name {
            n if n.ends_with(".gguf") => {
                let mut f = std::fs::File::open(file).unwrap();
                let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
                content.tensor_data_offset as usize
            }
            n if n.ends_with(".safetensors") => {
                8 + u64::from_le_bytes(original[..8].try_into().unwrap()) as usize
            }
            _ => original.len(),
        };
        let size_limit = 64 * (1 << 20) + 16 * original.len();
        for case in 0..*cases {
            let lie = rng.random_bool(0.4);
            let mutated = match (lie, is_json, name.ends_with(".gguf")) {
                (true, true, _) => lie_in_json(std::str::from_utf8(&original).unwrap(), &mut rng)
                    .map(|(text, what)| (text.into_bytes(), what)),
                (true, false, true) => lie_in_gguf_tensor(&original, &mut rng),
                (true, false, false) => lie_in_safetensors(&original, &mut rng),
                (false, ..) => None,
            };
            let (bytes, what) = mutated.unwrap_or_else(|| mutate(&original, &mut rng, header_end));
            std::fs::write(file, &bytes).unwrap();
            total += 1;
            match load_guarded(spec) {
                Ok((_, peak)) if peak > size_limit => failures.push(format!(
                    "{name} case {case} ({what}): allocated {peak} bytes at once"
                )),
                Ok((is_loaded, _)) => loaded += usize::from(is_loaded),
                Err(panic) => {
                    failures.push(format!("{name} case {case} ({what}): panicked: {panic}"))
                }
            }
        }
        std::fs::write(file, &original).unwrap();
    }
    assert!(
        failures.is_empty(),
        "{} of {total} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_eq!(total, 3000);
    // Most mutations break the file; the loads that still succeed are the harmless ones
    // (a flipped bit in a weight, a truncated tail the loader does not read).
    assert!(
        loaded < total / 2,
        "{loaded} of {total} mutated files loaded"
    );
    assert!(
        start.elapsed().as_secs() < 120,
        "took {:?}",
        start.elapsed()
    );
}
