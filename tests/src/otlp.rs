//! A real OTLP/gRPC trace receiver in the test process (opentelemetry-proto's generated
//! `TraceService` server): services export their spans to it exactly as they would to
//! Jaeger or a collector, and tests read them back.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use tonic::{Request, Response, Status};

/// One received span with the name of the service that sent it.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub start_ns: u64,
    pub end_ns: u64,
    pub attributes: HashMap<String, String>,
}

impl ReceivedSpan {
    pub fn duration(&self) -> Duration {
        Duration::from_nanos(self.end_ns.saturating_sub(self.start_ns))
    }

    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
}

fn text(value: Option<&Value>) -> String {
    match value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .map(|kv| text(kv.value.as_ref().and_then(|v| v.value.as_ref())))
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    spans.push(ReceivedSpan {
                        service: service.clone(),
                        name: span.name,
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_span_id: hex(&span.parent_span_id),
                        start_ns: span.start_time_unix_nano,
                        end_ns: span.end_time_unix_nano,
                        attributes: span
                            .attributes
                            .iter()
                            .map(|kv| {
                                (
                                    kv.key.clone(),
                                    text(kv.value.as_ref().and_then(|v| v.value.as_ref())),
                                )
                            })
                            .collect(),
                    });
                }
            }
        }
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A running receiver.
pub struct OtlpReceiver {
    pub endpoint: String,
    collector: Collector,
}

impl OtlpReceiver {
    /// Serves on a fresh loopback port in the current runtime.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address: SocketAddr = listener.local_addr().unwrap();
        let collector = Collector::default();
        let service = TraceServiceServer::new(collector.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        Self {
            endpoint: format!("http://{address}"),
            collector,
        }
    }

    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.collector.spans.lock().unwrap().clone()
    }

    /// Waits until `done` holds for the spans received so far.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        let started = Instant::now();
        loop {
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            assert!(
                started.elapsed() < timeout,
                "spans never arrived; got {} spans: {:?}",
                spans.len(),
                spans.iter().map(|s| (&s.service, &s.name)).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
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

/// Fetches a Prometheus text page over plain HTTP/1.1 and returns its samples: each line
/// `name{labels} value` as (`name{labels}`, value).
pub async fn scrape(address: &str) -> Vec<(String, f64)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect to /metrics");
    socket
        .write_all(
            format!("GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
    let mut body = String::new();
    socket.read_to_string(&mut body).await.unwrap();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect()
}
