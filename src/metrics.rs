//! Metrics primitives, and the `/metrics` document in the Prometheus text
//! format (written by the `prometheus` crate).
//!
//! The data path is counted by [`MeteredDevice`], a [`Device`] wrapper the
//! node puts in front of the gate, so the NBD server and the admin `Write`
//! are counted alike. Everything else (role, term, replica states, Raft) is
//! read from the node's parts when `/metrics` is scraped; see
//! [`crate::api::http`]. Counters are relaxed atomics: a scrape may see one
//! counter a request ahead of another, never a torn value.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use prometheus::TextEncoder;
use prometheus::proto::{self, LabelPair, Metric, MetricFamily, MetricType};
use tokio::time::Instant;

use crate::volume::{Access, Bond, Change, Device, DeviceError};

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
                | DeviceError::Abandoned
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
        self.change(Change::Discard { offset, len }, &Bond::default())
            .await
    }

    async fn write_at(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), DeviceError> {
        self.change(Change::Write { offset, data, fua }, &Bond::default())
            .await
    }

    async fn flush(&self) -> Result<(), DeviceError> {
        self.change(Change::Flush, &Bond::default()).await
    }

    /// Counts the change and passes it on with its bond.
    async fn change(&self, change: Change, bond: &Bond) -> Result<(), DeviceError> {
        let written = match &change {
            Change::Write { data, .. } => Some(data.len() as u64),
            Change::Discard { .. } | Change::Flush => None,
        };
        let flush = change == Change::Flush;
        let started = Instant::now();
        let result = self.inner.change(change, bond).await;
        match (&result, written) {
            (Ok(()), Some(len)) => {
                self.metrics.write_latency.observe(started.elapsed());
                self.metrics.writes.fetch_add(1, Ordering::Relaxed);
                self.metrics.write_bytes.fetch_add(len, Ordering::Relaxed);
            }
            (Ok(()), None) if flush => {
                self.metrics.flushes.fetch_add(1, Ordering::Relaxed);
            }
            (Ok(()), None) => {}
            (Err(err), _) => self.metrics.count_error(err),
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

/// The kind of a metric family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Gauge,
    Counter,
    /// Latency histograms ([`Text::observations`]).
    Histogram,
}

/// A `/metrics` document being gathered: metric families of the
/// `prometheus` crate, which writes and escapes the Prometheus text format
/// (0.0.4). Families are written in the order they were started; one that
/// got no sample is left out (the format has no empty families).
#[derive(Debug, Default)]
pub struct Text {
    families: Vec<MetricFamily>,
}

impl Text {
    /// Starts a metric family: its name, kind and help text.
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) -> &mut Self {
        let mut family = MetricFamily::default();
        family.set_name(name.to_string());
        family.set_help(help.to_string());
        family.set_field_type(match kind {
            Kind::Gauge => MetricType::GAUGE,
            Kind::Counter => MetricType::COUNTER,
            Kind::Histogram => MetricType::HISTOGRAM,
        });
        self.families.push(family);
        self
    }

    /// The latest started family of that name; a family never started
    /// starts as one of `kind` without help.
    fn latest(&mut self, name: &str, kind: Kind) -> &mut MetricFamily {
        let at = match self.families.iter().rposition(|f| f.name() == name) {
            Some(at) => at,
            None => {
                self.family(name, kind, "");
                self.families.len() - 1
            }
        };
        &mut self.families[at]
    }

    /// One sample of the family `name` (the latest started of that name;
    /// a sample of a family never started starts a gauge); `labels` are
    /// name/value pairs.
    pub fn sample(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        value: impl Into<f64>,
    ) -> &mut Self {
        let value = value.into();
        let family = self.latest(name, Kind::Gauge);
        let mut metric = labelled(labels);
        if family.get_field_type() == MetricType::COUNTER {
            let mut counter = proto::Counter::default();
            counter.set_value(value);
            metric.set_counter(counter);
        } else {
            let mut gauge = proto::Gauge::default();
            gauge.set_value(value);
            metric.set_gauge(gauge);
        }
        family.mut_metric().push(metric);
        self
    }

    /// A family with one unlabelled sample.
    pub fn single(
        &mut self,
        name: &str,
        kind: Kind,
        help: &str,
        value: impl Into<f64>,
    ) -> &mut Self {
        self.family(name, kind, help).sample(name, &[], value)
    }

    /// The observations of `histogram`, as one labelled series of the
    /// histogram family `name` (started as [`Kind::Histogram`]).
    pub fn observations(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        histogram: &Histogram,
    ) -> &mut Self {
        // The finite buckets; the encoder adds `+Inf` with the count (it
        // would write an infinite bound of ours as "inf").
        let mut cumulative = 0u64;
        let mut buckets = Vec::with_capacity(LATENCY_BUCKETS.len());
        for (count, bound) in histogram.buckets.iter().zip(LATENCY_BUCKETS) {
            cumulative += count.load(Ordering::Relaxed);
            let mut bucket = proto::Bucket::default();
            bucket.set_upper_bound(bound);
            bucket.set_cumulative_count(cumulative);
            buckets.push(bucket);
        }
        let overflow = &histogram.buckets[LATENCY_BUCKETS.len()];
        cumulative += overflow.load(Ordering::Relaxed);
        let mut summary = proto::Histogram::default();
        summary.set_bucket(buckets);
        // The count is the buckets' total, so the two always agree.
        summary.set_sample_count(cumulative);
        summary.set_sample_sum(histogram.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9);
        let mut metric = labelled(labels);
        metric.set_histogram(summary);
        self.latest(name, Kind::Histogram).mut_metric().push(metric);
        self
    }

    /// The finished document.
    pub fn finish(self) -> String {
        let families: Vec<MetricFamily> = self
            .families
            .into_iter()
            .filter(|f| !f.get_metric().is_empty())
            .collect();
        // Every family has a name and a sample, the only two things the
        // encoder refuses; it writes to a String, which cannot fail.
        TextEncoder::new()
            .encode_to_string(&families)
            .unwrap_or_else(|err| format!("# the metrics could not be encoded: {err}\n"))
    }
}

/// A sample without a value yet, with `labels` (name/value pairs).
fn labelled(labels: &[(&str, &str)]) -> Metric {
    Metric::from_label(
        labels
            .iter()
            .map(|(key, val)| {
                let mut pair = LabelPair::default();
                pair.set_name(key.to_string());
                pair.set_value(val.to_string());
                pair
            })
            .collect(),
    )
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
        text.family("lat_seconds", Kind::Histogram, "latency")
            .observations("lat_seconds", &[], &histogram);
        text.single("after", Kind::Gauge, "A gauge after it.", 1u8);
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
        assert!(text.contains("# TYPE lat_seconds histogram\n"), "{text}");
        assert!(text.ends_with("after 1\n"), "{text}");
        assert_eq!(histogram.count(), 3);
    }

    #[test]
    fn label_values_and_help_are_escaped() {
        let mut text = Text::default();
        text.family("m", Kind::Gauge, "a \\ and\na newline").sample(
            "m",
            &[("a", "x\"y\\z\n")],
            1.0,
        );
        assert_eq!(
            text.finish(),
            "# HELP m a \\\\ and\\na newline\n# TYPE m gauge\nm{a=\"x\\\"y\\\\z\\n\"} 1\n"
        );
    }

    #[test]
    fn counters_keep_their_name_and_empty_families_are_left_out() {
        let mut text = Text::default();
        text.single("c_total", Kind::Counter, "A count.", 3u32);
        text.family("nothing", Kind::Gauge, "No sample.");
        text.sample("undeclared", &[], 2u8);
        let text = text.finish();
        assert!(
            text.contains("# TYPE c_total counter\nc_total 3\n"),
            "{text}"
        );
        assert!(!text.contains("nothing"), "{text}");
        assert!(
            text.contains("# TYPE undeclared gauge\nundeclared 2\n"),
            "{text}"
        );
    }

    #[test]
    fn a_histogram_family_has_one_series_for_each_label_set() {
        let (fast, slow) = (Histogram::default(), Histogram::default());
        fast.observe(Duration::from_micros(30));
        slow.observe(Duration::from_secs(1));
        slow.observe(Duration::from_secs(2));
        let mut text = Text::default();
        text.family("lat_seconds", Kind::Histogram, "latency")
            .observations("lat_seconds", &[("volume", "a")], &fast)
            .observations("lat_seconds", &[("volume", "b")], &slow);
        let text = text.finish();
        assert_eq!(text.matches("# TYPE lat_seconds histogram\n").count(), 1);
        assert!(
            text.contains("lat_seconds_count{volume=\"a\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("lat_seconds_bucket{volume=\"b\",le=\"+Inf\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("lat_seconds_sum{volume=\"b\"} 3\n"), "{text}");
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
