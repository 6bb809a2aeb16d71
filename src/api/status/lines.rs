//! The one-line summaries of a status reply that the table and the live
//! view share: I/O, scrub, reads, membership, a rebuild's progress, times
//! in UTC, and the volumes, a line each. Each says what the node reported
//! and nothing more.

use crate::proto::admin::{ReplicaStatus, StatusReply, VolumeStatus};

/// A node id that is 0 for "none" (no leader, no writer yet) as "-".
pub(super) fn or_none(id: u64) -> String {
    if id == 0 {
        "-".to_string()
    } else {
        id.to_string()
    }
}

/// "flowing", or "suspended: 3 requests waiting 1.2 s (1 in-sync replica
/// of the 2 needed; waiting for node 3's rebuild, 62%)".
pub(super) fn io_line(reply: &StatusReply) -> String {
    if reply.io_suspended_requests == 0 {
        return "flowing".into();
    }
    format!(
        "suspended: {} requests waiting {:.1} s ({})",
        reply.io_suspended_requests, reply.io_suspended_seconds, reply.io_suspended_why
    )
}

/// The writer's scrub: "42% of a pass (last pass ...; 4 MiB/s)", "last
/// pass 2026-12-04 14:30:02 UTC: 64 extents, 1 differed, 1 repaired (4
/// MiB/s)", or "-" on a node that is not the writer and never scrubbed.
pub(super) fn scrub_line(reply: &StatusReply) -> String {
    if !reply.gate_open && reply.scrub_passes == 0 && !reply.scrub_running {
        return "-".into();
    }
    let last = if reply.scrub_last_finished_unix == 0 {
        "no pass finished yet".to_string()
    } else {
        format!(
            "last pass {}: {} extents, {} differed, {} repaired",
            utc(reply.scrub_last_finished_unix),
            reply.scrub_last_checked_extents,
            reply.scrub_last_found,
            reply.scrub_last_repaired
        )
    };
    let rate = match reply.scrub_rate_bytes_per_second {
        0 => "on request".to_string(),
        r => format!("{} MiB/s", r as f64 / 1048576.0),
    };
    if reply.scrub_running {
        format!(
            "{:.0}% of a pass ({last}; {rate})",
            100.0 * reply.scrub_done_bytes as f64 / reply.scrub_total_bytes.max(1) as f64
        )
    } else {
        format!("{last} ({rate})")
    }
}

/// A Unix time as "YYYY-MM-DD HH:MM:SS UTC".
pub(super) fn utc(unix: u64) -> String {
    match time::OffsetDateTime::from_unix_timestamp(unix as i64) {
        Ok(t) => format!(
            "{:04}-{:02}-{:02} {:02}:{:02}:{:02} UTC",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        ),
        Err(_) => format!("{unix} (Unix time)"),
    }
}

/// "member", or why this node is not one (S8): "replaced disk: waiting to
/// be re-added (`replica-ha members replace --id 3`)".
pub fn member_line(reply: &StatusReply) -> String {
    if reply.not_member.is_empty() {
        "member".into()
    } else {
        reply.not_member.clone()
    }
}

/// "served", or "refused (replica not in sync)".
pub(super) fn reads_line(reply: &StatusReply) -> String {
    if reply.reads_served {
        "served".into()
    } else {
        format!("refused ({})", reply.reads_refused)
    }
}

/// "resync 42% (from the missed-write map: 100 of 240 MiB compared, 4 MiB
/// copied, 128 MiB/s, 1 s left)": a running rebuild of replica `r`, for the
/// table and the watch; "full" when it compares every extent.
pub(super) fn resync_progress(r: &ReplicaStatus) -> String {
    format!(
        "resync {:.0}% ({}: {} of {} MiB compared, {} MiB copied, {:.0} MiB/s, {:.0} s left)",
        100.0 * r.resync_done_bytes as f64 / r.resync_total_bytes.max(1) as f64,
        if r.resync_full {
            "full"
        } else {
            "from the missed-write map"
        },
        r.resync_done_bytes >> 20,
        r.resync_total_bytes >> 20,
        r.resync_copied_bytes >> 20,
        r.resync_rate_bytes_per_second / 1048576.0,
        r.resync_eta_seconds
    )
}

/// The volumes section the table and the live view end with: a line a
/// volume (its group, writer and term as this node knows them, what this
/// node is to it, and its copies with their states), then a line for each
/// rebuild of one of its copies that runs. Empty for a reply without
/// volumes (from a node of an earlier build).
pub(super) fn volumes_block(reply: &StatusReply) -> String {
    if reply.volumes.is_empty() {
        return String::new();
    }
    let mut block = format!(
        "{:<16} {:>5} {:>6} {:>6}  {:<9}  copies\n",
        "volume", "group", "writer", "term", "this node"
    );
    for volume in &reply.volumes {
        let term = match volume.term {
            0 => "-".to_string(),
            term => term.to_string(),
        };
        block.push_str(&format!(
            "{:<16} {:>5} {:>6} {term:>6}  {:<9}  {}\n",
            volume.name,
            volume.group,
            or_none(volume.leader),
            this_node(volume),
            copies(volume)
        ));
        for r in volume.replicas.iter().filter(|r| r.resync_running) {
            let progress = resync_progress(r);
            block.push_str(&format!("  copy {} of {}: {progress}\n", r.id, volume.name));
        }
    }
    block
}

/// What this node is to a volume: "writes", "copy" (it holds one and
/// does not write), "starting" (its copy does not run yet) or "no copy".
fn this_node(volume: &VolumeStatus) -> &'static str {
    match volume.here.as_str() {
        "running" if volume.writing => "writes",
        "running" => "copy",
        "starting" => "starting",
        _ => "no copy",
    }
}

/// "1 in_sync, 2 rebuilding, 3 offline" where this node runs the volume;
/// "on 2, 3, 4" (states unknown here) where it does not.
fn copies(volume: &VolumeStatus) -> String {
    if volume.here != "running" {
        let on: Vec<String> = volume.placement.iter().map(u64::to_string).collect();
        return format!("on {}", on.join(", "));
    }
    let states: Vec<String> = volume
        .replicas
        .iter()
        .map(|r| format!("{} {}", r.id, r.state))
        .collect();
    states.join(", ")
}
