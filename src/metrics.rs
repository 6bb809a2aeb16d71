//! Metrics primitives and the Prometheus text format.
//!
//! The data path is counted by [`MeteredDevice`], a [`Device`] wrapper the
//! node puts in front of the gate, so the NBD server and the admin `Write`
//! are counted alike. Everything else (role, term, replica states, Raft) is
//! read from the node's parts when `/metrics` is scraped; see
//! [`crate::http`]. Counters are relaxed atomics: a scrape may see one
//! counter a request ahead of another, never a torn value.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::time::Instant;

use crate::volume::{Access, Device, DeviceError};

/// Upper bounds of the latency buckets, in seconds.
const LATENCY_BUCKETS: [f64; 16] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0,
];

/// A latency histogram with fixed buckets.
#[derive(Debug, Default)]
pub struct Histogram {
    /// Non-cumulative counts per bucket; the last one is `+Inf`.
    buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        let bucket = LATENCY_BUCKETS
            .iter()
            .position(|bound| seconds <= *bound)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// How many observations were recorded.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

/// Counters of the data path.
#[derive(Debug, Default)]
pub struct DeviceMetrics {
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    pub writes: AtomicU64,
    pub write_bytes: AtomicU64,
    pub flushes: AtomicU64,
    /// Requests that failed, any kind.
    pub errors: AtomicU64,
    /// Writes refused by the gate or the fence (this node is not the writer).
    pub refused: AtomicU64,
    pub write_latency: Histogram,
}

impl DeviceMetrics {
    fn count_error(&self, err: &DeviceError) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        if matches!(
            err,
            DeviceError::NotLeader
                | DeviceError::LeaseExpired
                | DeviceError::Inactive
                | DeviceError::StaleTerm { .. }
        ) {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A device that counts what passes through it.
pub struct MeteredDevice {
    inner: Arc<dyn Device>,
    metrics: Arc<DeviceMetrics>,
}

impl MeteredDevice {
    /// Counts the requests to `inner` in `metrics`.
    pub fn new(inner: Arc<dyn Device>, metrics: Arc<DeviceMetrics>) -> Self {
        Self { inner, metrics }
    }
}

#[async_trait]
impl Device for MeteredDevice {
    async fn allocation(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<Vec<crate::volume::Extent>, DeviceError> {
        self.inner.allocation(offset, len).await
    }

    async fn read_at(&self, offset: u64, len: u64) -> Result<Bytes, DeviceError> {
        let result = self.inner.read_at(offset, len).await;
        match &result {
            Ok(data) => {
                self.metrics.reads.fetch_add(1, Ordering::Relaxed);
                let n = data.len() as u64;
                self.metrics.read_bytes.fetch_add(n, Ordering::Relaxed);
            }
            Err(err) => self.metrics.count_error(err),
        }
        result
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        let result = self.inner.discard(offset, len).await;
        if let Err(err) = &result {
            self.metrics.count_error(err);
        }
        result
    }

    async fn write_at(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), DeviceError> {
        let len = data.len() as u64;
        let started = Instant::now();
        let result = self.inner.write_at(offset, data, fua).await;
        match &result {
            Ok(()) => {
                self.metrics.write_latency.observe(started.elapsed());
                self.metrics.writes.fetch_add(1, Ordering::Relaxed);
                self.metrics.write_bytes.fetch_add(len, Ordering::Relaxed);
            }
            Err(err) => self.metrics.count_error(err),
        }
        result
    }

    async fn flush(&self) -> Result<(), DeviceError> {
        let result = self.inner.flush().await;
        match &result {
            Ok(()) => {
                self.metrics.flushes.fetch_add(1, Ordering::Relaxed);
            }
            Err(err) => self.metrics.count_error(err),
        }
        result
    }

    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn is_writable(&self) -> bool {
        self.inner.is_writable()
    }

    fn access(&self) -> Access {
        self.inner.access()
    }
}

/// A Prometheus text-format document being written.
#[derive(Debug, Default)]
pub struct Text {
    out: String,
}

impl Text {
    /// Starts a metric family: its `# HELP` and `# TYPE` lines.
    pub fn family(&mut self, name: &str, kind: &str, help: &str) -> &mut Self {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
        self
    }

    /// One sample; `labels` are name/value pairs.
    pub fn sample(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        value: impl Into<f64>,
    ) -> &mut Self {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (key, val)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{key}=\"{}\"", escape(val));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {}", value.into());
        self
    }

    /// A family with one unlabelled sample.
    pub fn single(
        &mut self,
        name: &str,
        kind: &str,
        help: &str,
        value: impl Into<f64>,
    ) -> &mut Self {
        self.family(name, kind, help).sample(name, &[], value)
    }

    /// A histogram family.
    pub fn histogram(&mut self, name: &str, help: &str, histogram: &Histogram) -> &mut Self {
        self.family(name, "histogram", help);
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0u64;
        for (i, count) in histogram.buckets.iter().enumerate() {
            cumulative += count.load(Ordering::Relaxed);
            let le = LATENCY_BUCKETS
                .get(i)
                .map(|bound| bound.to_string())
                .unwrap_or_else(|| "+Inf".into());
            self.sample(&bucket, &[("le", &le)], cumulative as f64);
        }
        let sum = histogram.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        self.sample(&format!("{name}_sum"), &[], sum);
        self.sample(&format!("{name}_count"), &[], cumulative as f64)
    }

    /// The finished document.
    pub fn finish(self) -> String {
        self.out
    }
}

/// Escapes a label value: backslash, double quote and newline.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A counter's value as a sample value.
pub fn load(counter: &AtomicU64) -> f64 {
    counter.load(Ordering::Relaxed) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ha::WriterEngine;
    use crate::ha::fake::MemoryEngine;
    use crate::ids::Term;

    #[test]
    fn histograms_are_cumulative_and_end_with_inf() {
        let histogram = Histogram::default();
        histogram.observe(Duration::from_micros(30));
        histogram.observe(Duration::from_millis(3));
        histogram.observe(Duration::from_secs(60));
        let mut text = Text::default();
        text.histogram("lat_seconds", "latency", &histogram);
        let text = text.finish();
        assert!(
            text.contains("lat_seconds_bucket{le=\"0.00005\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("lat_seconds_bucket{le=\"0.005\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("lat_seconds_bucket{le=\"5\"} 2\n"), "{text}");
        assert!(
            text.contains("lat_seconds_bucket{le=\"+Inf\"} 3\n"),
            "{text}"
        );
        assert!(text.contains("lat_seconds_count 3\n"), "{text}");
        assert_eq!(histogram.count(), 3);
    }

    #[test]
    fn label_values_are_escaped() {
        let mut text = Text::default();
        text.sample("m", &[("a", "x\"y\\z\n")], 1.0);
        assert_eq!(text.finish(), "m{a=\"x\\\"y\\\\z\\n\"} 1\n");
    }

    #[tokio::test]
    async fn the_metered_device_counts_successes_and_refusals() {
        let engine = MemoryEngine::new(8192);
        let metrics = Arc::new(DeviceMetrics::default());
        let device = MeteredDevice::new(engine.clone(), Arc::clone(&metrics));
        assert!(
            device
                .write_at(0, Bytes::from_static(b"abc"), false)
                .await
                .is_err()
        );
        engine.activate(Term(1)).await.unwrap();
        assert!(device.is_writable());
        device
            .write_at(0, Bytes::from_static(b"abcd"), true)
            .await
            .unwrap();
        device.read_at(0, 4).await.unwrap();
        device.flush().await.unwrap();
        assert!(device.read_at(8190, 4).await.is_err());
        assert_eq!(load(&metrics.writes), 1.0);
        assert_eq!(load(&metrics.write_bytes), 4.0);
        assert_eq!(load(&metrics.read_bytes), 4.0);
        assert_eq!(load(&metrics.flushes), 1.0);
        assert_eq!((load(&metrics.errors), load(&metrics.refused)), (2.0, 1.0));
        assert_eq!(metrics.write_latency.count(), 1);
    }
}
