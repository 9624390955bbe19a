//! Device selection by name (`cpu`, `cuda`, `cuda:N`) and the CPU compute thread count.

use std::str::FromStr;

use candle_core::Device;

use crate::error::{ModelError, Result};

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("unknown device `{other}` (use cpu, cuda or cuda:N)")),
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSpec {
    pub fn open(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(ordinal) => Device::new_cuda(ordinal).map_err(|e| {
                ModelError::Device(format!(
                    "cannot open cuda:{ordinal}: {e} (build with `--features cuda` on a machine with CUDA)"
                ))
            }),
        }
    }
}

/// Sets the number of CPU threads candle's kernels use. Call it once at start-up, before
/// any model code runs and before other threads exist (it sets `CANDLE_NUM_THREADS`, which
/// candle reads once). `0` keeps candle's default (all cores).
pub fn set_compute_threads(threads: usize) {
    if threads > 0 {
        // SAFETY: documented to be called at start-up while the process is single-threaded.
        unsafe { std::env::set_var("CANDLE_NUM_THREADS", threads.to_string()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_names() {
        assert_eq!("cpu".parse::<DeviceSpec>(), Ok(DeviceSpec::Cpu));
        assert_eq!("cuda".parse::<DeviceSpec>(), Ok(DeviceSpec::Cuda(0)));
        assert_eq!("cuda:3".parse::<DeviceSpec>(), Ok(DeviceSpec::Cuda(3)));
        assert!("tpu".parse::<DeviceSpec>().is_err());
    }
}
