//! Reading telemetry back in tests: the OTLP receiver (from `specd_common::otlp_sink`),
//! a trace printed as a tree, and a Prometheus scrape.

use std::collections::HashMap;
use std::time::Duration;

pub use specd_common::otlp_sink::{OtlpReceiver, ReceivedSpan};

/// Starts a receiver on a fresh loopback port.
pub async fn receiver() -> OtlpReceiver {
    OtlpReceiver::start("127.0.0.1:0".parse().unwrap(), false)
        .await
        .expect("start the OTLP receiver")
}

/// Waits for spans; panics with what arrived on timeout.
pub async fn wait_for(
    receiver: &OtlpReceiver,
    timeout: Duration,
    done: impl Fn(&[ReceivedSpan]) -> bool,
) -> Vec<ReceivedSpan> {
    receiver.wait_for(timeout, done).await.unwrap_or_else(|spans| {
        panic!(
            "spans never arrived; got {}: {:?}",
            spans.len(),
            spans.iter().map(|s| (&s.service, &s.name)).collect::<Vec<_>>()
        )
    })
}

/// The trace as an indented tree: name, service, duration and the chosen attributes.
pub fn render_tree(spans: &[ReceivedSpan], keys: &[&str]) -> String {
    let ids: std::collections::HashSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    let mut children: HashMap<&str, Vec<&ReceivedSpan>> = HashMap::new();
    let mut roots = Vec::new();
    for span in spans {
        if span.parent_span_id.is_empty() || !ids.contains(span.parent_span_id.as_str()) {
            roots.push(span);
        } else {
            children
                .entry(span.parent_span_id.as_str())
                .or_default()
                .push(span);
        }
    }
    fn walk(
        span: &ReceivedSpan,
        depth: usize,
        children: &HashMap<&str, Vec<&ReceivedSpan>>,
        keys: &[&str],
        out: &mut String,
    ) {
        let attributes: Vec<String> = keys
            .iter()
            .filter_map(|k| span.attribute(k).map(|v| format!("{k}={v}")))
            .collect();
        out.push_str(&format!(
            "{}{} [{}] {:.2} ms {}\n",
            "  ".repeat(depth),
            span.name,
            span.service,
            span.duration().as_secs_f64() * 1e3,
            attributes.join(" ")
        ));
        let mut kids = children.get(span.span_id.as_str()).cloned().unwrap_or_default();
        kids.sort_by_key(|s| s.start_ns);
        for kid in kids {
            walk(kid, depth + 1, children, keys, out);
        }
    }
    let mut out = String::new();
    roots.sort_by_key(|s| s.start_ns);
    for root in roots {
        walk(root, 0, &children, keys, &mut out);
    }
    out
}

/// Fetches a service's Prometheus page and returns its samples: each line
/// `name{labels} value` as (`name{labels}`, value).
pub async fn scrape(address: &str) -> Vec<(String, f64)> {
    specd_common::metrics_page::scrape(address)
        .await
        .expect("scrape /metrics")
}
