//! One telemetry set-up for every binary: logs (an env filter, `RUST_LOG`, default `info`;
//! text or JSON lines on stderr), OpenTelemetry spans exported over OTLP/gRPC when an
//! endpoint is given (off otherwise; filtered by `SPECD_TRACE_FILTER`, default `info`), W3C trace-context propagation over gRPC metadata
//! ([`inject`] on the client side, [`TraceContextLayer`] on the server side), and a
//! Prometheus text endpoint for the `metrics` facade.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

/// Telemetry flags every service binary takes.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TelemetryArgs {
    /// OTLP/gRPC endpoint spans are exported to, e.g. http://jaeger:4317; tracing export
    /// is off when unset.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Service name in traces (default: the binary's name).
    #[arg(long, env = "OTEL_SERVICE_NAME")]
    pub service_name: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 0.0.0.0:9464; off when unset.
    #[arg(long, env = "SPECD_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Log one JSON object per line instead of text.
    #[arg(long, env = "SPECD_LOG_JSON")]
    pub log_json: bool,
}

/// Keeps the span pipeline alive; dropping it flushes the spans not yet exported.
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(error) = provider.shutdown()
        {
            eprintln!("telemetry: flushing spans failed: {error}");
        }
    }
}

/// Installs logging, span export and the metrics endpoint as `args` say. Call once, inside
/// the tokio runtime, and keep the guard until the process ends.
pub fn init(default_service_name: &str, args: &TelemetryArgs) -> Result<TelemetryGuard, String> {
    let service_name = args
        .service_name
        .clone()
        .unwrap_or_else(|| default_service_name.to_string());
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let provider = match &args.otlp_endpoint {
        None => None,
        Some(endpoint) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint.clone())
                .build()
                .map_err(|e| format!("cannot set up OTLP export to {endpoint}: {e}"))?;
            let resource = opentelemetry_sdk::Resource::builder()
                .with_service_name(service_name.clone())
                .build();
            Some(
                SdkTracerProvider::builder()
                    .with_batch_exporter(exporter)
                    .with_resource(resource)
                    .build(),
            )
        }
    };
    // Logs follow RUST_LOG; spans follow SPECD_TRACE_FILTER (default: info), so quiet logs
    // do not cost the traces.
    let log_filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let trace_filter =
        EnvFilter::try_from_env("SPECD_TRACE_FILTER").unwrap_or_else(|_| EnvFilter::new("info"));
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("specd"))
            .with_filter(trace_filter)
    });
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let logs: Box<dyn Layer<Registry> + Send + Sync> = if args.log_json {
        fmt.json().with_filter(log_filter).boxed()
    } else {
        fmt.with_filter(log_filter).boxed()
    };
    // A second call (tests) keeps the first subscriber.
    let _ = tracing_subscriber::registry().with(logs).with(otel).try_init();
    if let Some(listen) = args.metrics_listen {
        use metrics_exporter_prometheus::Matcher;
        let seconds = [
            0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        ];
        let counts = [
            1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0,
        ];
        let ratios = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];
        let buckets = |e: metrics_exporter_prometheus::BuildError| format!("bad metric buckets: {e}");
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &seconds)
            .map_err(buckets)?
            .set_buckets_for_metric(Matcher::Suffix("_rate".into()), &ratios)
            .map_err(buckets)?
            .set_buckets_for_metric(Matcher::Suffix("_ratio".into()), &ratios)
            .map_err(buckets)?
            .set_buckets_for_metric(Matcher::Suffix("_length".into()), &counts)
            .map_err(buckets)?
            .set_buckets_for_metric(Matcher::Suffix("_size".into()), &counts)
            .map_err(buckets)?
            .set_buckets_for_metric(Matcher::Suffix("_tokens".into()), &counts)
            .map_err(buckets)?
            .with_http_listener(listen)
            .install()
            .map_err(|e| format!("cannot serve metrics on {listen}: {e}"))?;
        tracing::info!(%listen, "serving Prometheus metrics at /metrics");
    }
    tracing::debug!(service = %service_name, otlp = ?args.otlp_endpoint, "telemetry initialised");
    Ok(TelemetryGuard { provider })
}

/// Logging only (command-line tools).
pub fn init_logging() {
    let _ = init("specd", &TelemetryArgs::default());
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(key, value);
        }
    }
}

/// Puts the current span's trace context (W3C `traceparent`) into an outgoing request.
pub fn inject<T>(request: &mut tonic::Request<T>) {
    let context = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&context, &mut MetadataInjector(request.metadata_mut()));
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// A tower layer for gRPC servers: each call runs in a server span named after its method,
/// a child of the caller's span when the request carries a `traceparent`, and is counted
/// by method and status (`specd_grpc_requests_total`, `specd_grpc_request_seconds`). Health
/// checks and reflection are left out (they would drown what matters).
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceContextLayer;

impl<S> tower::Layer<S> for TraceContextLayer {
    type Service = TraceContextService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TraceContextService { inner }
    }
}

#[derive(Debug, Clone)]
pub struct TraceContextService<S> {
    inner: S,
}

impl<S, B, ResponseBody> tower::Service<http::Request<B>> for TraceContextService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<ResponseBody>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let path = request.uri().path().to_string();
        if path.starts_with("/grpc.health.") || path.starts_with("/grpc.reflection.") {
            return Box::pin(self.inner.call(request));
        }
        let parent = TraceContextPropagator::new().extract(&HeaderExtractor(request.headers()));
        let method = path.trim_start_matches('/').to_string();
        let span = tracing::info_span!(
            "grpc.server",
            otel.name = %method,
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.method = %method,
            rpc.grpc.status_code = tracing::field::Empty,
        );
        let _ = span.set_parent(parent);
        let call = self.inner.call(request).instrument(span.clone());
        let started = std::time::Instant::now();
        Box::pin(async move {
            let result = call.await;
            // An error is sent at once in the headers; success arrives in the trailers.
            let status = match &result {
                Ok(response) => response
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<i32>().ok())
                    .map_or(tonic::Code::Ok, tonic::Code::from_i32),
                Err(_) => tonic::Code::Unknown,
            };
            span.record("rpc.grpc.status_code", status as i32);
            metrics::counter!("specd_grpc_requests_total", "method" => method.clone(), "status" => format!("{status:?}"))
                .increment(1);
            metrics::histogram!("specd_grpc_request_seconds", "method" => method)
                .record(started.elapsed().as_secs_f64());
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::TraceContextExt;

    #[test]
    fn trace_context_round_trips_through_metadata() {
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("client");
            let _entered = span.enter();
            let mut request = tonic::Request::new(());
            inject(&mut request);
            let header = request
                .metadata()
                .get("traceparent")
                .expect("traceparent injected")
                .to_str()
                .unwrap()
                .to_string();
            let sent = span.context().span().span_context().clone();
            assert!(header.contains(&sent.trace_id().to_string()), "{header}");
            assert!(header.contains(&sent.span_id().to_string()), "{header}");
            let headers = request.metadata().clone().into_headers();
            let received = TraceContextPropagator::new().extract(&HeaderExtractor(&headers));
            let remote = received.span().span_context().clone();
            assert_eq!(remote.trace_id(), sent.trace_id());
            assert_eq!(remote.span_id(), sent.span_id());
            assert!(remote.is_remote());
        });
    }
}
