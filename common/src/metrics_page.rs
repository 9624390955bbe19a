//! Reading a service's Prometheus page back (the page `--metrics-listen` serves): a plain
//! HTTP/1.1 GET of `/metrics` and its samples. `specd bench load` reads its verifiers' engine
//! time this way, and the end-to-end tests check exported metrics against what the
//! responses reported.

use std::io;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One sample line: `name{labels}` as written, and its value.
pub type Sample = (String, f64);

/// Fetches `http://address/metrics` and returns its samples (comments and blank lines
/// skipped). Errors when the service cannot be reached or does not answer 200.
pub async fn scrape(address: &str) -> io::Result<Vec<Sample>> {
    let mut socket = tokio::net::TcpStream::connect(address).await?;
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    socket.write_all(request.as_bytes()).await?;
    let mut page = String::new();
    socket.read_to_string(&mut page).await?;
    if !page.starts_with("HTTP/1.1 200") {
        let status = page.lines().next().unwrap_or_default().to_string();
        return Err(io::Error::other(format!("{address}/metrics answered {status:?}")));
    }
    let body = page.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    Ok(parse(body))
}

/// The samples of a Prometheus text page.
pub fn parse(page: &str) -> Vec<Sample> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// The value of the sample named exactly `key` (`name` or `name{labels}`), 0 when absent.
pub fn value(samples: &[Sample], key: &str) -> f64 {
    samples.iter().find(|(k, _)| k == key).map_or(0.0, |(_, v)| *v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_read_and_comments_skipped() {
        let page = "# TYPE a counter\na 3\n\nb_sum{kind=\"prompt\"} 1.5\n";
        let samples = parse(page);
        assert_eq!(value(&samples, "a"), 3.0);
        assert_eq!(value(&samples, "b_sum{kind=\"prompt\"}"), 1.5);
        assert_eq!(value(&samples, "missing"), 0.0);
        assert_eq!(samples.len(), 2, "{samples:?}");
    }
}
