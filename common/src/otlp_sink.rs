//! A small OTLP/gRPC trace receiver (opentelemetry-proto's generated `TraceService`
//! server): services export their spans to it exactly as they would to Jaeger or a
//! collector. `specd trace-sink` prints what arrives (for machines without Jaeger), and the
//! end-to-end tests read the spans back.

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

    /// One line: service, name, trace/span/parent ids, duration, attributes (sorted).
    pub fn line(&self) -> String {
        let mut attributes: Vec<String> = self.attributes.iter().map(|(k, v)| format!("{k}={v}")).collect();
        attributes.sort();
        format!(
            "span service={} name={:?} trace={} span={} parent={} ms={:.3} {}",
            self.service,
            self.name,
            self.trace_id,
            self.span_id,
            if self.parent_span_id.is_empty() {
                "-"
            } else {
                &self.parent_span_id
            },
            self.duration().as_secs_f64() * 1e3,
            attributes.join(" ")
        )
    }
}

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    /// Print each span as it arrives.
    print: bool,
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
        let mut spans = self.spans.lock().unwrap_or_else(|e| e.into_inner());
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
                    let received = ReceivedSpan {
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
                    };
                    if self.print {
                        println!("{}", received.line());
                    }
                    spans.push(received);
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
    /// Serves on `listen` in the current runtime; `print` writes each span to stdout.
    pub async fn start(listen: SocketAddr, print: bool) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(listen).await?;
        let address: SocketAddr = listener.local_addr()?;
        let collector = Collector {
            print,
            ..Collector::default()
        };
        let service = TraceServiceServer::new(collector.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        Ok(Self {
            endpoint: format!("http://{address}"),
            collector,
        })
    }

    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.collector
            .spans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits until `done` holds for the spans received so far; on timeout, the spans that
    /// did arrive are the error.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Result<Vec<ReceivedSpan>, Vec<ReceivedSpan>> {
        let started = Instant::now();
        loop {
            let spans = self.spans();
            if done(&spans) {
                return Ok(spans);
            }
            if started.elapsed() >= timeout {
                return Err(spans);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
