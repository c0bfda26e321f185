//! `GET /metrics`: the engine's counters and the server's own, in Prometheus text format.

use leyline_engine::MetricsSnapshot;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Engine values that are gauges; every other engine value is a counter.
const GAUGES: [&str; 7] = [
    "queue_depth",
    "running",
    "conversations",
    "pool_used_slots",
    "pool_capacity_slots",
    "pool_slot_bytes",
    "max_batch_seqs",
];

/// Counters kept by the server.
#[derive(Debug, Default)]
pub struct ServerMetrics {
    /// Responses by (route, status).
    responses: Mutex<BTreeMap<(String, u16), u64>>,
    /// Directive batches by (mode, outcome).
    directives: Mutex<BTreeMap<(String, &'static str), u64>>,
    /// Streams open now.
    pub streams_open: AtomicU64,
    /// Streams that ended with an error event.
    pub stream_errors: AtomicU64,
    /// HTTP connections open now.
    pub connections_open: AtomicU64,
    /// HTTP connections accepted.
    pub connections_accepted: AtomicU64,
    /// Sessions a turn named that this server did not hold, created again from the turn's
    /// history (after a failover or a rebalance).
    pub sessions_rebuilt: AtomicU64,
}

impl ServerMetrics {
    /// Counts one response.
    pub fn record_response(&self, route: &str, status: u16) {
        let mut m = self.responses.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((route.to_string(), status)).or_default() += 1;
    }

    /// Counts one directive batch.
    pub fn record_directives(&self, mode: &str, outcome: &'static str) {
        let mut m = self.directives.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((mode.to_string(), outcome)).or_default() += 1;
    }

    /// The whole exposition: engine values, then server values.
    pub fn render(&self, engine: &MetricsSnapshot, sessions: usize) -> String {
        let mut out = String::new();
        for (name, value) in engine.pairs() {
            if GAUGES.contains(&name) {
                let _ = writeln!(out, "# TYPE leyline_{name} gauge\nleyline_{name} {value}");
            } else {
                let _ = writeln!(
                    out,
                    "# TYPE leyline_{name}_total counter\nleyline_{name}_total {value}"
                );
            }
        }
        let _ = writeln!(
            out,
            "# TYPE leyline_sessions gauge\nleyline_sessions {sessions}"
        );
        let open = self.streams_open.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# TYPE leyline_streams_open gauge\nleyline_streams_open {open}"
        );
        let rebuilt = self.sessions_rebuilt.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# TYPE leyline_sessions_rebuilt_total counter\nleyline_sessions_rebuilt_total {rebuilt}"
        );
        let errs = self.stream_errors.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# TYPE leyline_stream_errors_total counter\nleyline_stream_errors_total {errs}"
        );
        let conns = self.connections_open.load(Ordering::Relaxed);
        let accepted = self.connections_accepted.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# TYPE leyline_http_connections_open gauge\nleyline_http_connections_open {conns}\n\
             # TYPE leyline_http_connections_total counter\nleyline_http_connections_total {accepted}"
        );
        let _ = writeln!(out, "# TYPE leyline_http_responses_total counter");
        for ((route, status), n) in self
            .responses
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "leyline_http_responses_total{{route=\"{}\",status=\"{status}\"}} {n}",
                escape(route)
            );
        }
        let _ = writeln!(out, "# TYPE leyline_directive_batches_total counter");
        for ((mode, outcome), n) in self
            .directives
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "leyline_directive_batches_total{{mode=\"{}\",outcome=\"{outcome}\"}} {n}",
                escape(mode)
            );
        }
        out
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_lines_parse_as_name_labels_value() {
        let m = ServerMetrics::default();
        m.record_response("/v1/chat/completions", 200);
        m.record_response("/v1/chat/completions", 200);
        m.record_directives("forget", "applied");
        let snap = MetricsSnapshot {
            prefilled_tokens: 42,
            queue_depth: 3,
            ..Default::default()
        };
        let text = m.render(&snap, 2);
        assert!(text.contains("leyline_prefilled_tokens_total 42\n"));
        assert!(text.contains("# TYPE leyline_queue_depth gauge\nleyline_queue_depth 3\n"));
        assert!(text.contains(
            "leyline_http_responses_total{route=\"/v1/chat/completions\",status=\"200\"} 2\n"
        ));
        assert!(text
            .contains("leyline_directive_batches_total{mode=\"forget\",outcome=\"applied\"} 1\n"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
    }
}
