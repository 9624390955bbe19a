//! One logging set-up for every binary: an env filter (`RUST_LOG`, default `info`) and text or
//! JSON lines on stderr.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. `json` switches to one JSON object per line.
pub fn init_telemetry(service_name: &str, json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    if result.is_ok() {
        tracing::debug!(service = service_name, "telemetry initialised");
    }
}
