//! The fault campaign: a three-node cluster of real processes on loopback,
//! a workload of NBD clients, a seeded schedule of faults, and a checker
//! that knows the safety property (Jepsen's method, on a small scale).
//!
//! Each schedule starts a fresh cluster whose links run through stalling
//! proxies, lets the clients write, then injects its faults one after the
//! other (SIGKILL, SIGSTOP beyond the lease, isolation, a cut link, restart,
//! leadership transfer; see `schedule`). At the end it heals everything,
//! waits for the cluster to converge, gathers the evidence — every block's
//! final content, the replicas' audit counters, the gate journals, the
//! replicas' digests — and runs the checker (see `checker`).
//!
//! The default test suite runs a short, bounded slice. A campaign runs from
//! `cluster/chaos --seed N --schedules K [--faults F]`, which sets
//! `CHAOS_SEED`, `CHAOS_SCHEDULES` and `CHAOS_FAULTS` for this test. Every
//! schedule prints its own seed; `--seed S --schedules 1` replays it.
//! `CHAOS_KEEP=1` keeps every schedule's evidence, not only a failed one's.
//! `CHAOS_ATTACH=1` runs the clients through `replica-ha attach` (design
//! C3) instead of letting them find the writer themselves; its `pause-leader`
//! then freezes the writer under `attach` (SIGSTOP), which must switch to
//! the next writer within its own deadlines, whatever the frozen one does.
//! Throughout every schedule a role-abuse client (`abuse`) tries to write
//! with a viewer's certificate and a non-member node's (S9).
//! `CHAOS_MIN_IN_SYNC=M` starts the nodes with `--min-in-sync M`.

#[path = "../common/mod.rs"]
mod common;

mod abuse;
mod checker;
mod nbd;
mod rng;
mod schedule;
mod workload;

use std::collections::BTreeMap;
use std::io::Read;
use std::time::Duration;

use common::cluster::{Cluster, one_cluster_at_a_time};
use common::env_u64;
use tokio::time::Instant;

use checker::{Evidence, Violation};
use schedule::{Fault, Step, Target};
use workload::{BLOCK, Layout, Workload};

const NODES: u64 = 3;
/// The part of the volume the workload's clients write, after the fill
/// region.
const SIZE: u64 = 32 * 1024 * 1024;
/// The first part of the volume, which the `fill` fault streams into.
const FILL: u64 = 32 * 1024 * 1024;
const EXTENT: u64 = 1024 * 1024;
const LAYOUT: Layout = Layout {
    base: FILL,
    clients: 3,
    per_client: 600,
    hot: 40,
    size: SIZE,
    // The last MiB of the volume, past the clients' blocks.
    overlap: FILL + SIZE - EXTENT,
};

/// Each node's replica directory on its own small tmpfs, so a schedule can
/// fill it up (a real ENOSPC, not a simulated one). Needs root; without it
/// disk faults are replaced by isolations, and the run says so.
struct Disks {
    mounts: Vec<std::path::PathBuf>,
    keep: bool,
}

impl Disks {
    fn mount(cluster: &Cluster) -> Result<Disks, String> {
        let mut disks = Disks {
            mounts: Vec::new(),
            keep: false,
        };
        for id in &cluster.ids {
            let dir = cluster.data_dir(*id).join("replica");
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            let size = format!("size={}", SIZE + FILL + 32 * 1024 * 1024);
            let out = std::process::Command::new("mount")
                .args(["-t", "tmpfs", "-o", &size, "tmpfs"])
                .arg(&dir)
                .output()
                .map_err(|e| format!("mount: {e}"))?;
            if !out.status.success() {
                return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
            }
            disks.mounts.push(dir);
        }
        Ok(disks)
    }

    fn filler(cluster: &Cluster, id: u64) -> std::path::PathBuf {
        cluster.data_dir(id).join("replica").join("fill")
    }

    /// Fills node `id`'s replica file system to the last byte.
    fn fill(cluster: &Cluster, id: u64) {
        common::fill_file_system(&Self::filler(cluster, id));
    }

    fn free(cluster: &Cluster, id: u64) {
        let _ = std::fs::remove_file(Self::filler(cluster, id));
    }
}

impl Drop for Disks {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        for dir in &self.mounts {
            // Lazy: a node may still hold files open for a moment.
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(dir)
                .status();
        }
    }
}

/// What one schedule did and found.
struct Outcome {
    seed: u64,
    faults: Vec<Fault>,
    acked: usize,
    /// Overlapping writes acknowledged (judged by the diverged rule only).
    overlapping: usize,
    /// The NBD error of each refused write.
    errnos: Vec<u32>,
    unknown: usize,
    violations: Vec<Violation>,
    /// A crash or a failure to recover: not a safety violation, but a
    /// failed schedule.
    stuck: Option<String>,
}

/// The bounded slice of the default suite; `cluster/chaos` runs campaigns
/// through the same test with other settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_fault_campaign_keeps_every_safety_rule() {
    let _one = one_cluster_at_a_time().await;
    let seed = env_u64("CHAOS_SEED", 20261202);
    let schedules = env_u64("CHAOS_SCHEDULES", 5);
    let faults = env_u64("CHAOS_FAULTS", 3) as usize;
    let only: Vec<String> = std::env::var("CHAOS_ONLY")
        .unwrap_or_default()
        .split(',')
        .filter(|name| !name.is_empty())
        .map(str::to_string)
        .collect();
    eprintln!(
        "chaos: base seed {seed}, {schedules} schedule(s) of {faults} fault(s){}{}",
        if only.is_empty() {
            String::new()
        } else {
            format!(" among {only:?}")
        },
        std::env::var("CHAOS_MIN_IN_SYNC")
            .map(|min| format!(", min_in_sync {min}"))
            .unwrap_or_default()
    );
    let mut outcomes = Vec::new();
    for i in 0..schedules {
        let steps = schedule::generate(seed + i, faults, &only);
        assert!(!steps.is_empty(), "CHAOS_ONLY={only:?} names no fault");
        let outcome = run_schedule(seed + i, steps).await;
        report(&outcome);
        outcomes.push(outcome);
    }
    remove_scratch_files();
    let table = summary(&outcomes);
    eprintln!("{table}");
    if let Ok(path) = std::env::var("CHAOS_SUMMARY") {
        std::fs::write(&path, &table).expect("write the summary");
    }
    let failed: Vec<u64> = outcomes
        .iter()
        .filter(|o| !o.violations.is_empty() || o.stuck.is_some())
        .map(|o| o.seed)
        .collect();
    assert!(
        failed.is_empty(),
        "schedules with violations or without recovery: {failed:?} \
         (replay one with cluster/chaos --seed S --schedules 1 --faults {faults})"
    );
}

fn report(outcome: &Outcome) {
    let faults: Vec<String> = outcome.faults.iter().map(|f| f.to_string()).collect();
    eprintln!(
        "chaos: seed {} [{}]: {} acked (+{} overlapping), {} refused, {} unknown, {} violation(s){}",
        outcome.seed,
        faults.join(", "),
        outcome.acked,
        outcome.overlapping,
        outcome.errnos.len(),
        outcome.unknown,
        outcome.violations.len(),
        outcome
            .stuck
            .as_ref()
            .map(|why| format!(", FAILED: {why}"))
            .unwrap_or_default()
    );
    for violation in &outcome.violations {
        eprintln!("chaos:   VIOLATION ({}): {violation}", violation.rule());
    }
}

fn summary(outcomes: &[Outcome]) -> String {
    let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
    let mut by_rule: BTreeMap<&str, usize> = BTreeMap::new();
    for outcome in outcomes {
        for fault in &outcome.faults {
            *by_kind.entry(fault.to_string()).or_default() += 1;
        }
        for violation in &outcome.violations {
            *by_rule.entry(violation.rule()).or_default() += 1;
        }
    }
    let sum = |f: fn(&Outcome) -> usize| outcomes.iter().map(f).sum::<usize>();
    let mut text = String::from("\n| chaos summary | |\n|---|---|\n");
    let mut row = |k: &str, v: String| text.push_str(&format!("| {k} | {v} |\n"));
    row("schedules", outcomes.len().to_string());
    row("faults injected", sum(|o| o.faults.len()).to_string());
    for (kind, n) in &by_kind {
        row(&format!("  {kind}"), n.to_string());
    }
    row("writes acknowledged", sum(|o| o.acked).to_string());
    row(
        "overlapping writes acknowledged",
        sum(|o| o.overlapping).to_string(),
    );
    row(
        "writes refused (NBD error)",
        sum(|o| o.errnos.len()).to_string(),
    );
    let mut errnos: BTreeMap<u32, usize> = BTreeMap::new();
    for errno in outcomes.iter().flat_map(|o| &o.errnos) {
        *errnos.entry(*errno).or_default() += 1;
    }
    for (errno, n) in errnos {
        row(
            &format!("  errno {errno} ({})", errno_name(errno)),
            n.to_string(),
        );
    }
    row("writes of unknown outcome", sum(|o| o.unknown).to_string());
    row(
        "schedules failed otherwise (a crash, no writer, no convergence)",
        outcomes
            .iter()
            .filter(|o| o.stuck.is_some())
            .count()
            .to_string(),
    );
    row("violations", sum(|o| o.violations.len()).to_string());
    for rule in [
        "lost write",
        "stale accept",
        "gate overlap",
        "diverged",
        "role abuse",
    ] {
        row(
            &format!("  {rule}"),
            by_rule.get(rule).copied().unwrap_or(0).to_string(),
        );
    }
    text
}

fn errno_name(errno: u32) -> &'static str {
    match errno {
        1 => "EPERM",
        5 => "EIO",
        22 => "EINVAL",
        28 => "ENOSPC",
        108 => "ESHUTDOWN",
        _ => "?",
    }
}

/// Starts `replica-ha attach` for `cluster` on a local TCP port, as the
/// clients' host would run it; returns it and the address to connect to.
async fn start_attach(cluster: &Cluster) -> (std::process::Child, std::net::SocketAddr) {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], common::cluster::free_port()));
    let mut command = std::process::Command::new(common::cluster::BIN);
    command
        .arg("attach")
        .arg("--socket")
        .arg(cluster.dir.path().join("attach.sock"))
        .arg("--listen")
        .arg(addr.to_string());
    for (id, node) in &cluster.addrs {
        command.arg("--peer").arg(format!("{id}={node}"));
    }
    command.args(cluster.cli_tls("user"));
    let log = std::fs::File::create(cluster.dir.path().join("attach.log")).expect("attach log");
    let child = command.stderr(log).spawn().expect("attach");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "attach never listened"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (child, addr)
}

async fn run_schedule(seed: u64, steps: Vec<Step>) -> Outcome {
    let mut cluster = Cluster::new(NODES);
    cluster.extra_args = vec!["--size".into(), (SIZE + FILL).to_string()];
    if let Ok(min) = std::env::var("CHAOS_MIN_IN_SYNC") {
        cluster.extra_args.extend(["--min-in-sync".into(), min]);
    }
    let through_attach = std::env::var_os("CHAOS_ATTACH").is_some();
    // TLS on offer (plaintext stays open on loopback for the workload):
    // `attach` opens the writer's export with it, and the role-abuse
    // client presents certificates that must not write.
    cluster
        .extra_args
        .extend(["--nbd-tls".into(), "optional".into()]);
    let shim = fsync_shim();
    if let Some(shim) = &shim {
        cluster.env = vec![
            ("LD_PRELOAD".into(), shim.display().to_string()),
            // Each node reads its own control file: see `fsync_delay_file`.
            (
                "REPLICA_HA_FSYNC_DELAY_FILE".into(),
                format!("{{dir}}/{FSYNC_DELAY}"),
            ),
        ];
    }
    cluster.add_proxies().await;
    let mut disks = match Disks::mount(&cluster) {
        Ok(disks) => Some(disks),
        Err(why) => {
            eprintln!("chaos: no disk faults (cannot mount a tmpfs: {why}); isolating instead");
            None
        }
    };
    for id in cluster.ids.clone() {
        cluster.spawn(id);
    }
    let all = cluster.ids.clone();

    let mut stuck = None;
    if let Err(why) = writer_within(&cluster, Duration::from_secs(30)).await {
        // Not a safety question, but the schedule cannot run: report it
        // and go on with the campaign.
        stuck = Some(format!("the new cluster elected no writer: {why}"));
    }

    let mut attach = None;
    let targets = if through_attach {
        let (child, addr) = start_attach(&cluster).await;
        attach = Some(child);
        BTreeMap::from([(0, addr)])
    } else {
        cluster.nbd_addrs.clone()
    };
    let workload = Workload::start(LAYOUT, targets, seed);
    let abuse = abuse::Abuse::start(&cluster, cluster.nbd_addrs.clone(), LAYOUT.base);
    wait_for_acks(&workload, 20, Duration::from_secs(20)).await;
    let mut injected = Vec::new();
    let mut crashes = Vec::new();
    for step in &steps {
        injected.push(inject(&mut cluster, step, disks.is_some(), shim.is_some()).await);
        crashes.extend(cluster.exited());
    }
    crashes.extend(cluster.exited());
    heal(&mut cluster);
    // The healed cluster must take writes again before the clients stop.
    let before = workload.acked();
    if !wait_for_acks(&workload, before + 20, Duration::from_secs(30)).await {
        stuck = Some("no writes acknowledged within 30 s of the heal".into());
    }
    let overlapping = std::sync::Arc::clone(&workload.overlapping);
    let history = workload.stop().await;
    let abused = abuse.stop().await;
    eprintln!(
        "chaos: seed {seed}: role abuse: {} attempts, {} viewer writes refused",
        abused.attempts, abused.refused_writes
    );
    let overlapping = overlapping.load(std::sync::atomic::Ordering::Relaxed) as usize;
    if let Some(mut attach) = attach {
        let _ = attach.kill();
        let _ = attach.wait();
    }
    crashes.extend(cluster.exited());
    if !crashes.is_empty() {
        // A node that exits by itself is a bug whatever the checker says.
        let tails: Vec<String> = crashes
            .iter()
            .map(|(id, status)| {
                let log = cluster.log(*id);
                let last = log.lines().last().unwrap_or_default().to_string();
                format!("node {id} exited by itself ({status}): {last}")
            })
            .collect();
        stuck = Some(tails.join("; "));
    }

    let mut evidence = Evidence {
        history,
        ..Evidence::default()
    };
    let converged = converge(&cluster, Duration::from_secs(90)).await;
    let in_sync = match converged {
        Ok((writer, in_sync)) => match read_blocks(&cluster, writer).await {
            Ok(blocks) => {
                evidence.final_blocks = blocks;
                in_sync
            }
            Err(why) => {
                stuck.get_or_insert(why);
                Vec::new()
            }
        },
        Err(why) => {
            stuck.get_or_insert(why);
            Vec::new()
        }
    };
    // The committed size: a copy may be longer (one that grew for a
    // resize that failed elsewhere, or a growth cut off), never shorter.
    let mut size = 0;
    for id in &all {
        if let Some(status) = cluster.status(*id).await {
            size = size.max(status.volume_size);
            let own = status.replicas.iter().find(|r| r.local);
            let count = own.map_or(0, |r| r.stale_accepts);
            evidence.stale_accepts.insert(*id, count);
        }
    }
    for id in &all {
        if cluster.is_running(*id) {
            cluster.terminate(*id);
        }
        let journal = std::fs::read_to_string(cluster.journal_path(*id)).unwrap_or_default();
        evidence.journals.insert(*id, journal);
    }
    for id in &in_sync {
        evidence
            .replicas
            .insert(*id, file_digests(&cluster, *id, size));
    }
    // The rules must have something to judge, or they pass vacuously.
    if checker::intervals(&evidence.journals).is_empty() {
        stuck.get_or_insert("no gate journal recorded a writer".into());
    }
    let mut violations = checker::check(&evidence);
    violations.extend(
        abused
            .violations
            .into_iter()
            .map(|what| Violation::RoleAbuse { what }),
    );
    for violation in &violations {
        if let Violation::LostWrite { block, .. } = violation {
            for record in evidence.history.iter().filter(|r| r.block == *block) {
                eprintln!(
                    "chaos: seed {seed}: block {block}: {:?} via node {} from {:?} to {:?}: {:?}",
                    record.id, record.node, record.invoked, record.completed, record.outcome
                );
            }
        }
    }
    let keep = std::env::var_os("CHAOS_KEEP").is_some();
    if !violations.is_empty() || stuck.is_some() || keep {
        // Keep the evidence: the data dirs, logs and journals.
        if let Some(disks) = disks.as_mut() {
            disks.keep = true;
        }
        let kept = cluster.dir.path().to_path_buf();
        let history: String = evidence
            .history
            .iter()
            .map(|r| {
                format!(
                    "block {} {:?} node {} {:?}..{:?} {:?}\n",
                    r.block, r.id, r.node, r.invoked, r.completed, r.outcome
                )
            })
            .collect();
        let _ = std::fs::write(kept.join("history.txt"), history);
        std::mem::forget(std::mem::replace(
            &mut cluster.dir,
            tempfile::tempdir().unwrap(),
        ));
        eprintln!("chaos: seed {seed}: evidence kept in {}", kept.display());
    }
    let count = |f: fn(&workload::Outcome) -> bool| {
        evidence.history.iter().filter(|r| f(&r.outcome)).count()
    };
    Outcome {
        seed,
        faults: injected,
        acked: count(|o| *o == workload::Outcome::Acked),
        overlapping,
        errnos: evidence
            .history
            .iter()
            .filter_map(|r| match r.outcome {
                workload::Outcome::Refused(errno) => Some(errno),
                _ => None,
            })
            .collect(),
        unknown: count(|o| matches!(o, workload::Outcome::Unknown(_))),
        violations,
        stuck,
    }
}

/// Waits until the workload has `count` acknowledgements; false on timeout.
async fn wait_for_acks(workload: &Workload, count: usize, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while workload.acked() < count {
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// The node a target names now: the writer (or Raft leader), or a random
/// other node.
async fn resolve(cluster: &Cluster, target: Target, pick: u64) -> u64 {
    let mut leader = None;
    for id in &cluster.ids {
        if let Some(status) = cluster.status(*id).await {
            if status.role == "leader" && status.gate_open {
                leader = Some(*id);
                break;
            }
            if status.leader != 0 {
                leader.get_or_insert(status.leader);
            }
        }
    }
    let leader = leader.unwrap_or(cluster.ids[pick as usize % cluster.ids.len()]);
    let others: Vec<u64> = cluster
        .ids
        .iter()
        .copied()
        .filter(|id| *id != leader)
        .collect();
    match target {
        Target::Leader => leader,
        Target::Follower => others[pick as usize % others.len()],
    }
}

/// Injects, holds and heals one step's fault; returns the fault injected.
async fn inject(cluster: &mut Cluster, step: &Step, disks: bool, shim: bool) -> Fault {
    let pick = step.hold.as_millis() as u64;
    let fault = match step.fault {
        Fault::DiskFull(target) if !disks => Fault::Isolate(target),
        Fault::SlowFsync(target) if !shim => Fault::Pause(target),
        fault => fault,
    };
    eprintln!(
        "chaos:   {fault} (hold {:?}, settle {:?})",
        step.hold, step.settle
    );
    match fault {
        Fault::Kill(target) => {
            let id = resolve(cluster, target, pick).await;
            cluster.kill(id);
            tokio::time::sleep(step.hold).await;
            cluster.spawn(id);
        }
        Fault::Pause(target) => {
            let id = resolve(cluster, target, pick).await;
            cluster.pause(id);
            tokio::time::sleep(step.hold).await;
            cluster.resume(id);
        }
        Fault::Isolate(target) => {
            let id = resolve(cluster, target, pick).await;
            cluster.isolate(id, true);
            tokio::time::sleep(step.hold).await;
            cluster.isolate(id, false);
        }
        Fault::CutLink => {
            let leader = resolve(cluster, Target::Leader, pick).await;
            let follower = resolve(cluster, Target::Follower, pick).await;
            cluster.cut_link(leader, follower, true);
            tokio::time::sleep(step.hold).await;
            cluster.cut_link(leader, follower, false);
        }
        Fault::Restart(target) => {
            let id = resolve(cluster, target, pick).await;
            cluster.terminate(id);
            tokio::time::sleep(step.hold).await;
            cluster.spawn(id);
        }
        Fault::Transfer => {
            let leader = resolve(cluster, Target::Leader, pick).await;
            let to = resolve(cluster, Target::Follower, pick).await;
            // Best effort: a transfer during an election may be refused.
            let _ = transfer(cluster, leader, to).await;
        }
        Fault::Fill => {
            let id = resolve(cluster, Target::Leader, pick).await;
            let mut stream = stream_into(cluster, id, step.hold);
            tokio::time::sleep(step.hold).await;
            cluster.kill(id);
            eprintln!("chaos:   node {id} killed while a client streamed into it");
            // The copy loop ends by itself once its connection is gone.
            let deadline = Instant::now() + Duration::from_secs(20);
            while stream
                .as_mut()
                .is_some_and(|f| f.try_wait().ok().flatten().is_none())
            {
                if Instant::now() > deadline {
                    let _ = stream.as_mut().map(|f| f.kill());
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            cluster.spawn(id);
        }
        Fault::SlowFsync(target) => {
            let id = resolve(cluster, target, pick).await;
            let file = cluster.data_dir(id).join(FSYNC_DELAY);
            std::fs::write(&file, "2000").expect("write the fsync delay");
            tokio::time::sleep(step.hold).await;
            let _ = std::fs::remove_file(&file);
        }
        Fault::Resize => {
            let writer = resolve(cluster, Target::Leader, pick).await;
            if let Some(status) = cluster.status(writer).await {
                let size = (status.volume_size + (1 << 20)).to_string();
                // Best effort: a resize during an election is refused.
                let (ok, out, err) = cluster.cli(writer, &["resize", "--size", &size]).await;
                let said = if ok { out } else { err };
                eprintln!("chaos:   resize to {size}: {}", said.trim());
            }
        }
        Fault::WipeFollower => {
            let id = resolve(cluster, Target::Follower, pick).await;
            cluster.kill(id);
            cluster.wipe(id);
            tokio::time::sleep(step.hold).await;
            cluster.spawn(id);
            replace(cluster, id).await;
        }
        Fault::DiskFull(target) => {
            let id = resolve(cluster, target, pick).await;
            Disks::fill(cluster, id);
            eprintln!("chaos:   node {id}'s replica disk is full");
            tokio::time::sleep(step.hold).await;
            Disks::free(cluster, id);
        }
    }
    tokio::time::sleep(step.settle).await;
    fault
}

/// Brings node `id`, restarted on a wiped data dir, back: waits until it
/// says it waits to be re-added, then asks the writer to replace it, again
/// until it is done (a change meets elections and refusals now and then).
/// Bounded: gives up with a note after a minute.
async fn replace(cluster: &Cluster, id: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    while Instant::now() < deadline {
        let waiting = cluster
            .status(id)
            .await
            .is_some_and(|s| s.not_member.starts_with("replaced disk"));
        if waiting {
            let writer = resolve(cluster, Target::Leader, 0).await;
            let (ok, out, err) = cluster
                .cli(writer, &["members", "replace", "--id", &id.to_string()])
                .await;
            if ok {
                eprintln!("chaos:   node {id} replaced: {}", out.trim());
                return;
            }
            last = err.trim().to_string();
        } else if cluster
            .status(id)
            .await
            .is_some_and(|s| s.not_member.is_empty())
            && cluster.member_ids(id).await.contains(&id)
        {
            // Replaced already (an earlier attempt got through).
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("chaos:   node {id} could not be replaced within a minute: {last}");
}

/// The file in a node's data dir that the fsync shim reads.
const FSYNC_DELAY: &str = "fsync-delay-ms";

/// The fsync shim and the fill image, once made (in the temporary
/// directory, named by the test process; removed when the campaign ends).
static FSYNC_SHIM: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
static FILL_IMAGE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// Removes the fsync shim and the fill image, if they were made.
fn remove_scratch_files() {
    let shim = FSYNC_SHIM.get().and_then(Option::as_ref);
    for path in shim.into_iter().chain(FILL_IMAGE.get()) {
        let _ = std::fs::remove_file(path);
    }
}

/// Builds the fsync shim (`fsync_shim.c`) once per test process with the C
/// compiler; `None`, with a note, when there is none (the slow-fsync fault
/// then becomes a pause).
fn fsync_shim() -> Option<std::path::PathBuf> {
    FSYNC_SHIM
        .get_or_init(|| {
            let source =
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/chaos/fsync_shim.c");
            let out = std::env::temp_dir()
                .join(format!("replica-ha-fsync-shim-{}.so", std::process::id()));
            let built = std::process::Command::new("cc")
                .args(["-shared", "-fPIC", "-O2", "-o"])
                .arg(&out)
                .arg(&source)
                .arg("-ldl")
                .output();
            match built {
                Ok(o) if o.status.success() => Some(out),
                Ok(o) => {
                    eprintln!(
                        "chaos: no fsync shim ({}); slow-fsync pauses instead",
                        String::from_utf8_lossy(&o.stderr).trim()
                    );
                    None
                }
                Err(err) => {
                    eprintln!("chaos: no fsync shim (cc: {err}); slow-fsync pauses instead");
                    None
                }
            }
        })
        .clone()
}

/// Streams into the fill region of node `id`'s export for about `hold`:
/// `nbdcopy` at its default parallelism (several connections, many
/// requests in flight) copies a 32 MiB image over the region again and
/// again, the way a user copies a disk image in. Runs in the background;
/// `None` (and a note) when nbdcopy is not installed.
fn stream_into(cluster: &Cluster, id: u64, hold: Duration) -> Option<std::process::Child> {
    let url = format!("nbd://{}/vol0", cluster.nbd_addrs[&id]);
    let image = fill_image();
    let script = format!(
        "end=$((SECONDS + {})); while [ $SECONDS -lt $end ]; do nbdcopy {} {url} || exit 0; done",
        hold.as_secs() + 5,
        image.display()
    );
    let spawned = std::process::Command::new("bash")
        .args(["-c", &script])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
    match spawned {
        Ok(child) => Some(child),
        Err(err) => {
            eprintln!("chaos:   fill skipped: cannot run nbdcopy: {err}");
            None
        }
    }
}

/// A 32 MiB image of pseudo-random bytes for the fill fault, made once
/// per test process.
fn fill_image() -> std::path::PathBuf {
    FILL_IMAGE
        .get_or_init(|| {
            let path =
                std::env::temp_dir().join(format!("replica-ha-fill-{}.img", std::process::id()));
            let mut rng = rng::Rng::new(0x5eed);
            let mut bytes = Vec::with_capacity(FILL as usize);
            while bytes.len() < FILL as usize {
                bytes.extend_from_slice(&rng.below(u64::MAX).to_le_bytes());
            }
            std::fs::write(&path, &bytes).expect("write the fill image");
            path
        })
        .clone()
}

async fn transfer(cluster: &Cluster, from: u64, to: u64) -> Result<(), String> {
    use replica_ha::proto::admin::TransferRequest;
    use replica_ha::proto::admin::admin_client::AdminClient;
    let channel = cluster.channel(from);
    let mut request = tonic::Request::new(TransferRequest {
        to,
        ..Default::default()
    });
    request.set_timeout(Duration::from_secs(2));
    AdminClient::new(channel)
        .transfer_leader(request)
        .await
        .map(|_| ())
        .map_err(|status| status.to_string())
}

/// Undoes whatever is still broken: stopped processes, cut links, dead nodes.
fn heal(cluster: &mut Cluster) {
    for id in cluster.ids.clone() {
        Disks::free(cluster, id);
        cluster.resume(id);
        cluster.isolate(id, false);
        if !cluster.is_running(id) {
            cluster.spawn(id);
        }
    }
}

/// Waits for one writer whose committed in-sync set holds every node, with
/// no resync running; returns the writer and the in-sync set.
async fn converge(cluster: &Cluster, within: Duration) -> Result<(u64, Vec<u64>), String> {
    let deadline = Instant::now() + within;
    let mut last = String::new();
    while Instant::now() < deadline {
        for id in &cluster.ids {
            let Some(status) = cluster.status(*id).await else {
                continue;
            };
            if status.role != "leader" || !status.gate_open {
                continue;
            }
            let in_sync: Vec<u64> = status
                .in_sync
                .iter()
                .filter_map(|name| name.trim_start_matches('n').parse().ok())
                .collect();
            let rebuilding = status.replicas.iter().any(|r| r.resync_running);
            // With the clients stopped, the writer repairs what an
            // unacknowledged write left different and retires every mark:
            // none left means the members agree (S6 within the term).
            let marks: u64 = status.replicas.iter().map(|r| r.dirty_extents).sum();
            last = format!(
                "writer {id}, in-sync {:?}, rebuilding {rebuilding}, marks {marks}",
                status.in_sync
            );
            if in_sync.len() == cluster.ids.len() && !rebuilding && marks == 0 {
                return Ok((*id, in_sync));
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "not converged within {within:?} (last seen: {last})"
    ))
}

/// Every workload block, read through the writer's NBD export.
async fn read_blocks(cluster: &Cluster, writer: u64) -> Result<BTreeMap<u64, Vec<u8>>, String> {
    let limit = Duration::from_secs(5);
    let mut conn = nbd::Connection::open(cluster.nbd_addrs[&writer], limit)
        .await
        .map_err(|err| format!("connecting to the writer's export: {err}"))?;
    assert!(
        conn.size >= SIZE + FILL,
        "the export shrank to {}",
        conn.size
    );
    let mut blocks = BTreeMap::new();
    for block in LAYOUT.all_blocks() {
        match conn.read(LAYOUT.offset(block), BLOCK as u32, limit).await {
            Ok(nbd::Reply::Ok(data)) => {
                blocks.insert(block, data);
            }
            other => return Err(format!("reading block {block} from the writer: {other:?}")),
        }
    }
    Ok(blocks)
}

/// Waits for a node with its gate open.
async fn writer_within(cluster: &Cluster, within: Duration) -> Result<u64, String> {
    let deadline = Instant::now() + within;
    loop {
        for id in &cluster.ids {
            if let Some(status) = cluster.status(*id).await {
                if status.role == "leader" && status.gate_open {
                    return Ok(*id);
                }
            }
        }
        if Instant::now() > deadline {
            return Err(format!("no writer within {within:?}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// BLAKE3 of each 1 MiB extent of the first `size` bytes of node `id`'s
/// replica file (node stopped). An extent the file is too short for gets a
/// digest no bytes have, so a short copy is seen to diverge.
fn file_digests(cluster: &Cluster, id: u64, size: u64) -> Vec<[u8; 32]> {
    let path = cluster.data_dir(id).join("replica").join("volume.img");
    let file = std::fs::File::open(&path).expect("open the replica file");
    let mut file = file.take(size);
    let mut digests = Vec::new();
    let mut buf = vec![0u8; EXTENT as usize];
    let mut read = 0u64;
    loop {
        let mut filled = 0;
        while filled < buf.len() {
            match file
                .read(&mut buf[filled..])
                .expect("read the replica file")
            {
                0 => break,
                n => filled += n,
            }
        }
        if filled == 0 {
            break;
        }
        read += filled as u64;
        digests.push(*blake3::hash(&buf[..filled]).as_bytes());
    }
    if read < size {
        digests.push([0xff; 32]);
    }
    digests
}
