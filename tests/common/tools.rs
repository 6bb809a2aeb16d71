//! Running the real clients (qemu-io, nbdinfo, nbdcopy, fio, …) from tests:
//! bounded, with a clear message when a tool is missing or fails.

use std::net::SocketAddr;
use std::process::Output;
use std::time::Duration;

/// Runs a tool to completion within `limit` and returns its output.
pub async fn run_within(program: &str, args: &[&str], limit: Duration) -> Output {
    let mut command = tokio::process::Command::new(program);
    command.args(args).kill_on_drop(true);
    let output = tokio::time::timeout(limit, command.output())
        .await
        .unwrap_or_else(|_| panic!("{program} {args:?} did not finish within {limit:?}"));
    output.unwrap_or_else(|err| {
        panic!("cannot run {program} ({err}); install qemu-utils libnbd-bin fio (.ci/run does)")
    })
}

/// Runs a tool that must succeed within `limit`; returns its stdout.
pub async fn run_ok_within(program: &str, args: &[&str], limit: Duration) -> String {
    let output = run_within(program, args, limit).await;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{program} {args:?} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// Writes 1 MiB of a pattern at `offset` through the NBD `uri` with
/// qemu-io, and reads it back; neither may fail.
pub async fn write_and_read_back(uri: &str, offset: u64, limit: Duration) {
    let out = run_ok_within(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            &format!("write -P 0x3c {offset} 1M"),
            "-c",
            &format!("read -P 0x3c {offset} 1M"),
            uri,
        ],
        limit,
    )
    .await;
    assert!(!out.contains("failed"), "{out}");
}

/// The NBD URI of the volume at `addr`.
pub fn uri(addr: SocketAddr) -> String {
    volume_uri(addr, "vol0")
}

/// The NBD URI of volume `name` (its export name) at `addr`.
pub fn volume_uri(addr: SocketAddr, name: &str) -> String {
    format!("nbd://{addr}/{name}")
}

/// What one fio job measured: its write IOPS and the median and 99th
/// percentile of its completion latency.
#[derive(Debug, Clone, Copy, Default)]
pub struct FioFigures {
    pub iops: f64,
    pub p50_us: f64,
    pub p99_us: f64,
}

/// fio's 4 KiB random writes at queue depth 32 (one job, its `nbd`
/// engine) over the first `span` (fio's `--size`, e.g. `1g`, or bytes) of
/// the export at `uri`, for `seconds` after a 1 s ramp; a fio that fails
/// (an I/O error) is an error with its first line of stderr. Panics when
/// fio cannot run.
pub async fn fio_randwrite_qd32(uri: &str, span: &str, seconds: u64) -> Result<FioFigures, String> {
    let args = [
        "--name=randwrite".to_string(),
        "--ioengine=nbd".into(),
        format!("--uri={uri}"),
        "--rw=randwrite".into(),
        "--bs=4k".into(),
        format!("--size={span}"),
        "--iodepth=32".into(),
        "--time_based".into(),
        format!("--runtime={seconds}"),
        "--ramp_time=1".into(),
        "--output-format=json".into(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = run_within("fio", &args, Duration::from_secs(seconds + 60)).await;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(stderr.lines().next().unwrap_or("no message").to_string());
    }
    // fio may print notes before the JSON document.
    let stdout = String::from_utf8_lossy(&output.stdout);
    let json: serde_json::Value = stdout
        .find('{')
        .and_then(|start| serde_json::from_str(&stdout[start..]).ok())
        .unwrap_or_else(|| panic!("fio printed no JSON: {stdout}"));
    let write = &json["jobs"][0]["write"];
    let percentile = |p: &str| write["clat_ns"]["percentile"][p].as_f64().unwrap_or(0.0) / 1000.0;
    Ok(FioFigures {
        iops: write["iops"].as_f64().unwrap_or(0.0),
        p50_us: percentile("50.000000"),
        p99_us: percentile("99.000000"),
    })
}

/// A plain HTTP/1.0 GET of `path` on `addr`: the status code and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: test\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let code = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = response.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (code, body)
}

/// `promtool check metrics` (Debian's `prometheus`) finds nothing wrong
/// with the exposition: names, types, help and units.
pub fn promtool_accepts(metrics: &str) {
    use std::io::Write;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool runs (.ci/run installs prometheus)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(metrics.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// `line` without its terminal colour codes (an escape sequence runs to
/// its final letter).
pub fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
